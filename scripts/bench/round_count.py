"""Host instructions per call on the MPI backend at 2 ranks, the check's round included: rank 0 runs
under valgrind's callgrind (collecting only inside the loops), rank 1 as it is; both make the same
loops. Printed per case: instructions a call, and "less round": less the instructions inside the
MPI library's MPI_Start / MPI_Test (the round's polls, which vary with how far the peer is ahead).

    python scripts/bench/round_count.py                             # numpy, every case, this venv
    python scripts/bench/round_count.py --array torch --cases all_reduce broadcast all_gather
    python scripts/bench/round_count.py --python /work/main/.venv/bin/python   # another venv's build
    python scripts/bench/round_count.py --keep /tmp/cg              # callgrind's files, to annotate

Each case (x of float64, numpy or with ``--array torch`` a CPU tensor) runs a loop of ``--calls``
calls inside ``functools.reduce`` (host_cost's loops: a no-op loop subtracted), after a warm-up.
Set COLLECTIVES_COMPILED=0 to count the Python forms.
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_cost import _total, run_loops  # noqa: E402  (the same loops and totals)

#: (case, the statement; ``x8``: 8 bytes, ``x4k``: 4 KiB, ``x16``: 2 items (all_to_all), ``rows``: 2 rows).
CASES = [
    ("all_reduce", "comm.all_reduce(x8)"),
    ("all_reduce_4k", "comm.all_reduce(x4k)"),
    ("broadcast", "comm.broadcast(x8, 0)"),
    ("all_gather", "comm.all_gather(x8)"),
    ("gather", "comm.gather(x8, 0)"),
    ("scatter", "comm.scatter(rows, 0)"),
    ("all_to_all", "comm.all_to_all(x16)"),
    ("all_gather_v", "comm.all_gather_v(x8)"),
    ("all_to_all_splits", "comm.all_to_all(x16, [1, 1])"),
    ("all_gather_v_4k", "comm.all_gather_v(x4k)"),  # (past the round's payload: the staged request)
    ("all_to_all_splits_4k", "comm.all_to_all(x4k, [256, 256])"),
    ("send", "comm.send(x8, 1) if comm.rank == 0 else comm.recv(x8, 0)"),  # (rank 0 sends, rank 1 receives)
]
#: The MPI library's functions of the round's polls (MPICH names them PMPI_*, the weak MPI_* alike).
POLLS = re.compile(r"^\s*([\d,]+) \([ \d.]+%\)\s+\S*:P?MPI_(?:Start|Test) \[")
#: The round itself (the compiled Round's run; round_run in the hand-written C before it): its
#: waits vary with how far the peer is ahead, the rest of a call does not.
RUN = re.compile(r"^\s*([\d,]+) \([ \d.]+%\)\s+\S*:(?:__pyx_f_\w+Round_run|round_run) \[")


def child(calls: int, cases: list[str], array: str) -> None:
    import numpy  # noqa: PLC0415

    import collectives  # noqa: PLC0415

    comm = collectives.init("mpi")
    x8, x4k, x16, rows = numpy.ones(1), numpy.ones(512), numpy.ones(2), numpy.ones((2, 1))
    if array == "torch":
        import torch  # noqa: PLC0415

        x8, x4k, x16, rows = (torch.from_numpy(a) for a in (x8, x4k, x16, rows))
    names = {"comm": comm, "x8": x8, "x4k": x4k, "x16": x16, "rows": rows}
    gc.collect()
    gc.freeze()  # (as host_cost: a full collection in one loop does not add its walk of the heap to it)
    run_loops([statement for name, statement in CASES if name in cases], names, calls)
    comm.close()


def polls(path: str) -> tuple[int, int | None]:
    """The inclusive instructions of the MPI library's MPI_Start and MPI_Test in one dump, and of
    the round's run (None where it is not compiled: the Python form's is no C function)."""
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", path],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    runs = [int(m.group(1).replace(",", "")) for line in lines if (m := RUN.match(line))]
    return (sum(int(m.group(1).replace(",", "")) for line in lines if (m := POLLS.match(line))),
            runs[0] if runs else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--cases", nargs="+", default=[case for case, _ in CASES])
    parser.add_argument("--array", default="numpy", choices=["numpy", "torch"])
    parser.add_argument("--python", default=sys.executable, help="the interpreter (its venv's build) to count")
    parser.add_argument("--keep", help="keep callgrind's files here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = [name for name, _ in CASES if name in args.cases]
    if args.child:
        child(args.calls, cases, args.array)
        return
    mpiexec = os.path.join(os.path.dirname(args.python), "mpiexec")
    with tempfile.TemporaryDirectory() as scratch:
        folder = args.keep or scratch
        os.makedirs(folder, exist_ok=True)
        for old in glob.glob(f"{folder}/rank0.*"):
            os.remove(old)
        job = [__file__, "--child", "--calls", str(args.calls), "--array", args.array, "--cases", *cases]
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        grind = ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
                 "--dump-after=functools_reduce", f"--callgrind-out-file={folder}/rank0.%p"]
        done = subprocess.run([mpiexec, "-n", "1", *grind, args.python, *job, ":", "-n", "1", args.python, *job],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"round_count: the job failed ({done.returncode}):\n{done.stderr[-3000:]}")
        dumps = sorted(glob.glob(f"{folder}/rank0.*.*"), key=lambda p: int(p.rsplit(".", 1)[1]))[-(1 + len(cases)):]
        totals = [_total(p) for p in dumps]
        rounds = [polls(p) for p in dumps]
    print(f"{'case':<16}{'a call':>10}{'less round':>12}{'less run':>10}   "
          f"(thousands of instructions, rank 0, {args.array})")
    for i, name in enumerate(cases):
        total = (totals[i + 1] - totals[0]) / args.calls
        less = total - (rounds[i + 1][0] - rounds[0][0]) / args.calls
        run = rounds[i + 1][1]  # (the no-op loop runs no round; the warm-up's calls are outside the loops)
        steady = "-" if run is None else f"{(total - run / args.calls) / 1e3:.1f}"
        print(f"{name:<16}{total / 1e3:>10.1f}{less / 1e3:>12.1f}{steady:>10}")


if __name__ == "__main__":
    main()
