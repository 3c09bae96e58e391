"""Host instructions per call on the torch route, counted by valgrind's callgrind, ours against raw
torch.distributed in the same process: a count, not a time, so a busy machine gives the same numbers.

    python scripts/bench/host_cost.py                     # defaults, then COLLECTIVES_DEBUG=0
    python scripts/bench/host_cost.py --json docs/bench/host-cost.json
    python scripts/bench/host_cost.py --world 2           # two processes over a FakeStore

The group is torch's own fake process group (``torch.testing._internal.distributed.fake_pg``: every
call completes at once and moves nothing), so what is counted is the host work in front of the
transport: torch.distributed's Python and C++ for raw, and ours on top of it. Each case runs a loop
of ``--calls`` calls inside ``functools.reduce``; callgrind collects only inside that C function
(``--toggle-collect``) and dumps after each loop (``--dump-after``), so one child process gives one
count per loop, and a loop of no-op steps, subtracted, takes the loop's own cost away.

Cases (4 KiB float32 CPU tensors): all_reduce; async all_reduce + wait; all_gather(out=) against
``all_gather_into_tensor``; reduce_scatter(out=) against ``reduce_scatter_tensor``; broadcast; and
torch's floor under ``dist.all_reduce``'s Python, ``pg.allreduce([t], opts).wait()``.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

SETTINGS = {"defaults": {}, "COLLECTIVES_DEBUG=0": {"COLLECTIVES_DEBUG": "0"}}
# (case, ours, raw): what each loop's step calls. ``t``: the tensor, ``out``: a result of the
# right shape, ``comm``: ours, ``dist`` and ``pg``: torch's.
CASES = [
    ("all_reduce", "comm.all_reduce(t)", "dist.all_reduce(t)"),
    ("all_reduce async + wait", "comm.all_reduce(t, async_op=True).wait()",
     "dist.all_reduce(t, async_op=True).wait()"),
    ("all_gather(out=)", "comm.all_gather(t, out=gathered)", "dist.all_gather_into_tensor(gathered, t)"),
    ("reduce_scatter(out=)", "comm.reduce_scatter(rows, out=mine)", "dist.reduce_scatter_tensor(mine, rows)"),
    ("broadcast", "comm.broadcast(t, 0)", "dist.broadcast(t, 0)"),
]
FLOOR = ("torch's floor: pg.allreduce([t], opts).wait()", "pg.allreduce([t], opts).wait()")
ELEMENTS = 1024  # 4 KiB of float32


def child(calls: int, world: int, rank: int) -> None:
    """Run under callgrind: set up, warm every call, then one reduce loop per count."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415

    import collectives  # noqa: PLC0415

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    comm = collectives.init("torch")
    pg = dist.group.WORLD
    opts = dist.AllreduceOptions()
    names = {"torch": torch, "dist": dist, "comm": comm, "pg": pg, "opts": opts,
             "t": torch.ones(ELEMENTS), "gathered": torch.empty(world, ELEMENTS),
             "rows": torch.ones(world, ELEMENTS), "mine": torch.empty(1, ELEMENTS)}
    run_loops([FLOOR[1]] + [s for _, ours, raw in CASES for s in (ours, raw)], names, calls)
    comm.close()
    dist.destroy_process_group()


def run_loops(statements: list[str], names: dict, calls: int) -> None:
    """Warm every statement, then a no-op loop and one loop of ``calls`` of each statement, each
    inside ``functools.reduce`` (what callgrind collects and dumps after)."""
    steps = []
    for statement in statements:
        code = compile(statement, statement, "eval")
        steps.append(functools.partial(_step, code, names))
        for _ in range(50):  # warm: the first calls of a kind build what later calls reuse
            eval(code, names)
    functools.reduce(_noop, range(calls), None)
    for step in steps:
        functools.reduce(step, range(calls), None)


def _noop(acc: object, _: int) -> object:
    return acc


def _step(code: object, names: dict, acc: object, _: int) -> object:
    eval(code, names)
    return acc


def count(setting: dict[str, str], calls: int, world: int) -> list[float]:
    """Instructions per call of every statement of :func:`child`, in its order."""
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, **setting, PYTHONHASHSEED="0", OMP_NUM_THREADS="1",
                   COLLECTIVES_BACKEND="torch")
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK"):
            env.pop(key, None)
        procs = []
        for rank in range(world):
            out = os.path.join(folder, f"rank{rank}.%p")
            procs.append(subprocess.Popen(
                ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
                 "--dump-after=functools_reduce", f"--callgrind-out-file={out}", sys.executable, __file__,
                 "--child", "--calls", str(calls), "--world", str(world), "--rank", str(rank)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for proc in procs:
            _, err = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"host_cost: the child failed ({proc.returncode}):\n{err[-3000:]}")
        dumps = sorted(glob.glob(os.path.join(folder, "rank0.*.*")), key=lambda p: int(p.rsplit(".", 1)[1]))
        totals = [_total(p) for p in dumps]
    loops = 1 + 1 + 2 * len(CASES)  # the no-op loop, the floor, ours and raw per case
    if len(totals) < loops:
        raise SystemExit(f"host_cost: {len(totals)} loops counted, {loops} expected")
    totals = totals[-loops:]
    return [(total - totals[0]) / calls for total in totals[1:]]


def _total(path: str) -> int:
    with open(path) as file:
        for line in file:
            if match := re.match(r"(?:summary|totals):\s*(\d+)", line):
                return int(match.group(1))
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.calls, args.world, args.rank)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("host_cost: needs valgrind (apt-get install valgrind)")
    results = {}
    for name, setting in SETTINGS.items():
        per_call = count(setting, args.calls, args.world)
        floor, rest = per_call[0], per_call[1:]
        rows = {case: {"ours": rest[2 * i], "raw": rest[2 * i + 1]} for i, (case, _, _) in enumerate(CASES)}
        results[name] = {"floor": floor, "cases": rows}
        print(f"\n{name}, world {args.world}: instructions a call (4 KiB float32, fake process group)")
        print(f"{'call':<26} {'ours':>9} {'raw':>9} {'ours - raw':>11}")
        for case, row in rows.items():
            ours, raw = row["ours"] / 1e3, row["raw"] / 1e3
            print(f"{case:<26} {ours:8.1f}k {raw:8.1f}k {ours - raw:+10.1f}k")
        print(f"{FLOOR[0]}: {floor / 1e3:.1f}k")
    if args.json:
        import torch  # noqa: PLC0415

        with open(args.json, "w") as file:
            json.dump({"command": " ".join(["python", "scripts/bench/host_cost.py", *sys.argv[1:]]),
                       "torch": torch.__version__, "world": args.world, "calls": args.calls,
                       "results": results}, file, indent=1)
            file.write("\n")


if __name__ == "__main__":
    main()
