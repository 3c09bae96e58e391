"""How the MPI backend's wait policies fare on a busy node: collectives-bench --raw at small sizes,
ours under each policy against raw mpi4py in the same loop, with and without a CPU-bound job
on every core.

    python scripts/bench/poll_policy.py                       # 8 B, 3 rounds, idle and busy
    python scripts/bench/poll_policy.py --busy 2 --rounds 5 --json docs/bench/poll-policy-load.json
    python scripts/bench/poll_policy.py --busy 0 --taskset 0    # both ranks on one core

Each round runs ``mpiexec -n RANKS python scripts/bench/poll_policy.py --ranked ...``, which
times every collective of ``--ops`` under every policy in turn (the order rotates between
rounds), each against raw mpi4py interleaved with it (collectives-bench's loop, the default
timeout, the flight recorder and the default check on). ``--busy N`` starts N processes of
``python -c "while 1: pass"`` first (the job sharing the node) and ends them after. The
policies (:data:`POLICIES`):

- ``chosen``: what :func:`collectives.backends.mpi_requests.poll_policy` picks for this node;
- ``yield``: ``sched_yield`` from the first slow test (the policy for more ranks than cores);
- ``spin50us``: 50 us of tests without yielding, then yielding;
- ``spin``: tests without yielding for the whole busy second, then sleeps;
- ``spin/yN``: the same with a yield every N tests (MPI's own blocking calls spin so);
- ``blocking``: no timeout, MPI's own blocking call (``timeout=0``).

Prints the median over rounds of ours/raw (medians of the slowest rank per iteration) per
collective and policy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

POLICIES = ("chosen", "yield", "spin50us", "spin", "spin/y4", "spin/y16", "spin/y64", "blocking")
OPS = ("all_reduce", "broadcast", "all_gather", "all_to_all", "all_to_all_v", "send_recv", "barrier")


def policy_of(name: str, comm: Any) -> Any:
    import dataclasses  # noqa: PLC0415

    from collectives.backends import mpi_requests  # noqa: PLC0415

    if name == "chosen":
        return mpi_requests.poll_policy(comm.size)  # (the bench's ranks: all on this node)
    if name.startswith("spin/y"):  # spinning for the busy second, a yield every N tests
        return dataclasses.replace(mpi_requests.SPIN_POLL, spin_yield_every=int(name[6:]))
    return {"yield": mpi_requests.POLL,
            "spin50us": dataclasses.replace(mpi_requests.SPIN_POLL, spin_seconds=50e-6, spin_yield_every=0),
            "spin": dataclasses.replace(mpi_requests.SPIN_POLL, spin_yield_every=0),
            "blocking": None}[name]


def ranked(args: argparse.Namespace) -> None:
    """One round, inside mpiexec: every op under every policy; rank 0 writes the rows."""
    import collectives  # noqa: PLC0415
    from collectives.bench import cli  # noqa: PLC0415

    comm = collectives.init("mpi")
    transport = getattr(comm, "_transport", comm)  # (the MPI transport waits by its _poll)
    default_timeout, default_poll = comm.timeout, transport._poll
    rows = []
    order = list(args.policies)
    shift = args.round % len(order)
    order = order[shift:] + order[:shift]
    for op in args.ops:
        for name in order:
            policy = policy_of(name, comm)
            if name != "blocking" and policy is None:
                continue  # a policy this version does not have
            comm.timeout = None if name == "blocking" else default_timeout
            transport._poll = default_poll if policy is None else policy
            bench = cli.parse_args([op, "-b", str(args.bytes), "-e", str(args.bytes), "--raw",
                                    "-t", str(args.seconds)])
            with open(os.devnull, "w") as quiet:
                doc = cli.run(bench, comm=comm, out=quiet)
            if doc is not None:
                for row in doc["results"]:
                    rows.append({"op": op, "policy": name, "ours_us": row["ours"]["median_us"],
                                 "raw_us": row["raw"]["median_us"], "ratio": row["ratio"],
                                 "ours_p10_us": row["ours"]["p10_us"], "raw_p10_us": row["raw"]["p10_us"]})
    if comm.rank == 0:
        with open(args.out, "w") as file:
            json.dump(rows, file)


def busy_loops(count: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="+", default=list(OPS))
    p.add_argument("--policies", nargs="+", default=list(POLICIES), help=f"of {', '.join(POLICIES)}, "
                   "or spin/yN for any N")
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.2, help="timed seconds per op, policy and round")
    p.add_argument("--busy", type=int, nargs="+", default=[0, 2],
                   help="busy loops beside the ranks, one setting after the other (default: 0 2)")
    p.add_argument("--taskset", default=None, metavar="CPUS",
                   help="run the ranks on these CPUs only (taskset -c CPUS): 0 puts both on one core")
    p.add_argument("--json", default=None)
    p.add_argument("--ranked", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ranked:
        ranked(args)
        return
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    env = {k: v for k, v in os.environ.items() if k not in ("COLLECTIVES_DEBUG", "COLLECTIVES_TIMEOUT")}
    results: dict[str, Any] = {"argv": sys.argv[1:], "load_before": os.getloadavg(), "runs": [],
                               "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    for busy in args.busy:
        loops = busy_loops(busy)
        try:
            for r in range(args.rounds):
                with tempfile.TemporaryDirectory() as directory:
                    out = os.path.join(directory, "rows.json")
                    pin = ["taskset", "-c", args.taskset] if args.taskset else []
                    subprocess.run([*pin, mpiexec, "-n", str(args.ranks), sys.executable, __file__, "--ranked",
                                    "--round", str(r), "--out", out, "--bytes", str(args.bytes),
                                    "--seconds", str(args.seconds), "--ops", *args.ops,
                                    "--policies", *args.policies], env=env, check=True, timeout=900)
                    with open(out) as file:
                        results["runs"] += [{**row, "busy": busy, "round": r} for row in json.load(file)]
        finally:
            for loop in loops:
                loop.kill()
                loop.wait()
    results["load_after"] = os.getloadavg()
    report(results["runs"], args)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(results, file, indent=1)


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    policies = [name for name in args.policies if any(r["policy"] == name for r in runs)]
    for busy in args.busy:
        print(f"# {busy} busy loops; {args.bytes} B; ours/raw, median over {args.rounds} rounds "
              "(ours us / raw us)")
        print(f"{'op':<14}" + "".join(f"{name:>20}" for name in policies))
        for op in args.ops:
            cells = []
            for name in policies:
                mine = [r for r in runs if r["busy"] == busy and r["op"] == op and r["policy"] == name]
                if not mine:
                    cells.append(f"{'-':>20}")
                    continue
                ratio = statistics.median(r["ratio"] for r in mine)
                ours = statistics.median(r["ours_us"] for r in mine)
                raw = statistics.median(r["raw_us"] for r in mine)
                cells.append(f"{f'{ratio:.2f} ({ours:.1f}/{raw:.1f})':>20}")
            print(f"{op:<14}" + "".join(cells))


if __name__ == "__main__":
    main()
