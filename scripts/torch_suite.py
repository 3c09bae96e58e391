"""torch's own distributed test base against a backend, under mpiexec, with counts.

    python scripts/torch_suite.py --backend collectives -n 3 --json out.json [-k PATTERN] [--limit N]
    python scripts/torch_suite.py --backend gloo -n 3 ...          # the same harness over Gloo

Runs the tests of ``torch.testing._internal.distributed.distributed_test`` (``_DistTestBase``,
shipped in the torch wheel) in the ranks of one ``mpiexec -n N`` job, test after test, each
in a fresh default process group made by ``collectives.c10d.init_process_group(backend=...)``
(the store reaches the ranks over MPI, for Gloo as for "collectives"). torch's own harness
spawns its ranks with multiprocessing, which an MPI transport cannot use, so this one runs
each test's body on every rank as torch's ``_run`` would. "collectives" is added to the
feature sets torch's tests check for Gloo (ddp, subgroup, gpu, cuda), so both backends face
the same tests.

A test that fails on a rank ends the job (its peers may wait in a collective it never
reached); the driver records it and starts a new job from the next test, as it does when
a job prints nothing for ``--hang`` seconds. Outcome per test: failed if any rank failed
(or the job died in it), skipped if rank 0 skipped, else passed.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# -- rank side ---------------------------------------------------------------------------------

def rank_main(backend: str, names: list[str], out_dir: Path) -> None:
    import collectives

    comm = collectives.init()  # the MPI world; every rank of the job runs the same tests
    rank, size = comm.rank, comm.size
    os.environ["WORLD_SIZE"] = str(size)
    os.environ["BACKEND"] = backend
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from torch.testing._internal import common_distributed as cd

    for feature in ("ddp", "subgroup", "gpu", "cuda"):
        cd.DistTestCases.backend_feature[feature].add("collectives")
    import datetime
    import unittest

    import torch.distributed as dist
    from torch.testing._internal.common_utils import SEED, set_rng_seed
    from torch.testing._internal.distributed import distributed_test as dt

    import collectives.c10d

    class Suite(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
        pass

    # torch's file barrier gives ranks 10 s; on a loaded machine one rank's start can take longer.
    sync = dt.Barrier.sync.__func__
    dt.Barrier.sync = classmethod(lambda cls, wait_for=None, timeout=10: sync(cls, wait_for, max(timeout, 120)))

    skip_codes = {skip.exit_code: skip.message for skip in cd.TEST_SKIPS.values()}
    log = open(out_dir / f"rank{rank}.jsonl", "a", buffering=1)
    for name in names:
        work = out_dir / name
        for sub in ("barrier", "test_dir", "init_dir"):
            os.makedirs(work / sub, exist_ok=True)
        os.environ["TEMP_DIR"] = str(work)
        dt.Barrier.barrier_id = 0
        test = Suite(name)
        test.rank = rank
        test.file_name = str(work / "init")
        for variable in ("MASTER_ADDR", "MASTER_PORT"):  # the store travels over MPI
            os.environ.pop(variable, None)
        os.environ["INIT_METHOD"] = f"file://{work / 'init_dir' / 'shared_init_file'}"
        set_rng_seed(SEED)  # as torch's TestCase.setUp: every rank draws the same "random" data
        start = time.monotonic()
        outcome, detail = "passed", ""
        # A test torch restricts to backends by name (skip_but_pass_in_sandcastle_if,
        # require_backend_is_available: unittest's skip flag, which torch's own runner reads before
        # it spawns ranks) runs here all the same, its restriction recorded beside its outcome.
        body = getattr(Suite, name)
        restricted = getattr(body, "__unittest_skip_why__", "") if getattr(body, "__unittest_skip__", False) else ""
        try:
            timeout = datetime.timedelta(seconds=dt.CUSTOM_PG_TIMEOUT.get(name, dt.default_pg_timeout))
            collectives.c10d.init_process_group(backend=backend, timeout=timeout)
            test._barrier()
            getattr(test, name)()
            test._barrier()
        except unittest.SkipTest as skip:
            outcome, detail = "skipped", str(skip)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
            outcome, detail = ("skipped", skip_codes[code]) if code in skip_codes else ("failed", f"exit {code}")
        except BaseException as error:  # noqa: BLE001 - recorded; the job then ends
            outcome, detail = "failed", f"{type(error).__name__}: {str(error)[:400]}"
        log.write(json.dumps({"test": name, "outcome": outcome, "detail": detail, "restricted": restricted,
                              "seconds": round(time.monotonic() - start, 2)}) + "\n")
        if outcome == "failed":
            os._exit(1)  # peers may be waiting inside the test: the driver starts a new job
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass
    log.close()


# -- driver ------------------------------------------------------------------------------------

def test_names(patterns: list[str] | None, size: int) -> list[str]:
    os.environ.setdefault("BACKEND", "gloo")
    os.environ["WORLD_SIZE"] = str(size)  # read by decorators at import
    from torch.testing._internal.distributed import distributed_test as dt

    names = sorted(n for n in dir(dt.DistributedTest._DistTestBase) if n.startswith("test_"))
    return [n for n in names if not patterns or any(fnmatch.fnmatch(n, f"*{p}*") for p in patterns)]


def run(backend: str, size: int, names: list[str], hang: float, env: dict[str, str]) -> dict[str, dict]:
    results: dict[str, dict] = {}
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as tmp:
        out = Path(tmp)
        position = 0
        while position < len(names):
            todo = names[position:]
            listing = out / "names.txt"
            listing.write_text("\n".join(todo))
            for f in out.glob("rank*.jsonl"):
                f.unlink()
            command = [mpiexec, "-n", str(size), sys.executable, __file__, "--rank-side", "--backend", backend,
                       "--names", str(listing), "--out", str(out)]
            job = subprocess.Popen(command, env={**os.environ, **env}, start_new_session=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            seen, last = 0, time.monotonic()
            while job.poll() is None:
                lines = _lines(out, size)
                done = min(len(rows) for rows in lines)
                if done != seen or any(len(rows) > seen for rows in lines):
                    seen, last = done, time.monotonic()
                if time.monotonic() - last > hang:
                    os.killpg(job.pid, signal.SIGKILL)
                    job.wait()
                    break
                time.sleep(0.5)
            lines = _lines(out, size)
            finished = 0
            for i, name in enumerate(todo):
                outcomes = [rows[i] for rows in lines if len(rows) > i]
                if len(outcomes) == size and all(o["outcome"] != "failed" for o in outcomes):
                    results[name] = outcomes[0]
                    finished = i + 1
                    continue
                failed = [o for o in outcomes if o["outcome"] == "failed"]
                results[name] = failed[0] if failed else {"test": name, "outcome": "failed",
                                                          "detail": "hung or died (no result from every rank)"}
                finished = i + 1
                break
            position += max(finished, 1)
            print(f"{backend}: {position}/{len(names)}", file=sys.stderr, flush=True)
    return results


def _lines(out: Path, size: int) -> list[list[dict]]:
    rows = []
    for rank in range(size):
        path = out / f"rank{rank}.jsonl"
        text = path.read_text() if path.exists() else ""
        rows.append([json.loads(line) for line in text.splitlines() if line.endswith("}")])
    return rows


def compare(a: dict, b: dict) -> None:
    """Two runs (``--json``) side by side: their counts, then every test whose outcome differs."""
    left, right = a["backend"], b["backend"]
    width = max(len(name) for name in {*a["results"], *b["results"], "test"})
    print(f"{'':{width}}  {left:>11}  {right:>11}")
    for kind in ("passed", "skipped", "failed"):
        print(f"{kind:{width}}  {a['counts'][kind]:>11}  {b['counts'][kind]:>11}")
    print(f"\n{'test (outcomes that differ)':{width}}  {left:>11}  {right:>11}")
    for name in sorted({*a["results"], *b["results"]}):
        ours, theirs = (run["results"].get(name, {}).get("outcome", "-") for run in (a, b))
        restricted = a["results"].get(name, {}).get("restricted") or b["results"].get(name, {}).get("restricted")
        if ours != theirs:
            print(f"{name:{width}}  {ours:>11}  {theirs:>11}" + (f"  (torch: {restricted})" if restricted else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="collectives", help="collectives (default) or gloo")
    parser.add_argument("-n", type=int, default=3, help="ranks (default 3: torch's tests use groups of ranks 1, 2)")
    parser.add_argument("-k", dest="patterns", action="append",
                        help="only the tests whose name contains this (repeatable: any of them)")
    parser.add_argument("--limit", type=int, help="only the first N tests (after -k)")
    parser.add_argument("--hang", type=float, default=120, help="seconds without progress before a job is ended")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                        help="print two runs' counts side by side and the tests whose outcomes differ")
    parser.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--names", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_side:
        rank_main(args.backend, Path(args.names).read_text().split(), Path(args.out))
        return
    if args.compare:
        compare(*(json.loads(Path(path).read_text()) for path in args.compare))
        return
    names = test_names(args.patterns, args.n)[:args.limit]
    started = time.time()
    results = run(args.backend, args.n, names, args.hang, {"COLLECTIVES_TIMEOUT": "60"})
    counts = {k: sum(r["outcome"] == k for r in results.values()) for k in ("passed", "skipped", "failed")}
    print(f"{args.backend} on {args.n} ranks: {counts['passed']} passed, {counts['skipped']} skipped, "
          f"{counts['failed']} failed of {len(results)} ({time.time() - started:.0f} s)")
    for name, r in sorted(results.items()):
        if r["outcome"] == "failed":
            restricted = f" (torch: {r['restricted']})" if r.get("restricted") else ""
            print(f"  FAILED {name}: {r['detail'][:200]}{restricted}")
    if args.json:
        import datetime

        import torch

        Path(args.json).write_text(json.dumps({"backend": args.backend, "ranks": args.n, "counts": counts,
                                               "date": datetime.date.today().isoformat(),
                                               "torch": torch.__version__, "load": os.getloadavg(),
                                               "seconds": round(time.time() - started),
                                               "results": results}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
