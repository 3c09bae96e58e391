"""Host instructions per call of the call path on the MPI backend, numpy arrays, one rank (an MPI
singleton: no peer, no check round), counted by valgrind's callgrind: the compiled form against
the Python form (``COLLECTIVES_COMPILED=0``) in the same way, a count that a busy machine leaves
the same.

    python scripts/bench/callpath_count.py                        # both forms, every case
    python scripts/bench/callpath_count.py --forms compiled --cases all_reduce --keep /tmp/cg
    callgrind_annotate --inclusive=yes /tmp/cg/compiled/rank0.*.3  # where one loop's instructions go
    python scripts/bench/callpath_count.py --pythonpath /tmp/old/site   # another build of the library

Each case (an 8-byte float64 array, numpy or with ``--array torch`` a CPU tensor; scatter's rows
are one row of it; gather_out writes into an ``out=`` of one row, scatter_out into one of x's shape,
raw mpi4py into the same memory)
runs loops of ``--calls`` calls inside ``functools.reduce``, as :mod:`host_cost` does (a no-op loop
subtracted, the heap frozen first), the raw mpi4py call beside ours for reference.
``--pythonpath`` puts a directory first on the child's path (e.g. an install of an earlier commit
made with ``pip install --no-deps --target``), so two builds are counted the same way.
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_cost import _total, run_loops  # noqa: E402  (the same loops and totals)

#: (case, ours, raw mpi4py on the same buffers: ``v`` and ``vrows`` are x's and rows' numpy views).
CASES = [
    ("all_reduce", "comm.all_reduce(x)", "raw.Allreduce(MPI.IN_PLACE, v(x))"),
    ("broadcast", "comm.broadcast(x, 0)", "raw.Bcast(v(x), 0)"),
    ("all_gather", "comm.all_gather(x)", "raw.Allgather(v(x), numpy.empty((1, 1)))"),
    ("scatter", "comm.scatter(rows, 0)", "raw.Scatter(v(rows), numpy.empty(1), 0)"),
    ("gather_out", "comm.gather(x, 0, out=rows_out)", "raw.Gather(v(x), v(rows_out), 0)"),
    ("scatter_out", "comm.scatter(rows, 0, out=x_out)", "raw.Scatter(v(rows), v(x_out), 0)"),
]
FORMS = {"compiled": {}, "python": {"COLLECTIVES_COMPILED": "0"}}


def child(calls: int, cases: list[tuple[str, str, str]], array: str) -> None:
    """Run under callgrind: one MPI communicator of one rank, every case's loops."""
    import numpy  # noqa: PLC0415
    from collectives.backends.mpi import MPICommunicator  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415

    comm = MPICommunicator()
    x, rows, rows_out, x_out = numpy.ones(1), numpy.ones((1, 1)), numpy.ones((1, 1)), numpy.ones(1)
    if array == "torch":  # (a raw caller takes the tensor's numpy view each call)
        import torch  # noqa: PLC0415

        x, rows, rows_out, x_out = (torch.from_numpy(x), torch.from_numpy(rows), torch.from_numpy(rows_out),
                                    torch.from_numpy(x_out))
    names = {"numpy": numpy, "MPI": MPI, "comm": comm, "raw": MPI.COMM_WORLD.Dup(), "x": x, "rows": rows,
             "rows_out": rows_out, "x_out": x_out,
             "v": (lambda a: a) if array == "numpy" else (lambda a: a.numpy())}
    # The heap so far out of the collector's way (as host_cost.py does): a full collection that
    # falls into one loop would add its walk of torch's heap to that loop's count alone.
    gc.collect()
    gc.freeze()
    run_loops([s for _, ours, raw in cases for s in (ours, raw)], names, calls)
    comm.close()
    names["raw"].Free()


def count(env_extra: dict[str, str], calls: int, cases: list[str], array: str, keep: str | None) -> list[float]:
    """Instructions per call of every statement of :func:`child`, in its order."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = scratch if keep is None else keep
        os.makedirs(folder, exist_ok=True)
        for old in glob.glob(f"{folder}/rank0.*"):  # (a kept folder's earlier run)
            os.remove(old)
        env = dict(os.environ, **env_extra, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        for key in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "RANK", "WORLD_SIZE"):
            env.pop(key, None)
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
             "--dump-after=functools_reduce", f"--callgrind-out-file={folder}/rank0.%p", sys.executable,
             __file__, "--child", "--calls", str(calls), "--array", array, "--cases", *cases],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"callpath_count: the child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        dumps = sorted(glob.glob(f"{folder}/rank0.*.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        totals = [_total(p) for p in dumps]
    loops = 1 + 2 * len(cases)
    totals = totals[-loops:]
    return [(total - totals[0]) / calls for total in totals[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--cases", nargs="+", default=[case for case, _, _ in CASES])
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    parser.add_argument("--array", default="numpy", choices=["numpy", "torch"], help="x's kind (torch: CPU)")
    parser.add_argument("--pythonpath", help="a directory put first on the child's sys.path")
    parser.add_argument("--keep", help="keep callgrind's files under KEEP/<form>")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = [c for c in CASES if c[0] in args.cases]
    if args.child:
        child(args.calls, cases, args.array)
        return
    print(f"{'case':<12}" + "".join(f"{form:>12}" for form in args.forms) + f"{'raw':>10}")
    counts = {}
    for form in args.forms:
        extra = dict(FORMS[form])
        if args.pythonpath:
            extra["PYTHONPATH"] = args.pythonpath
        counts[form] = count(extra, args.calls, [c for c, _, _ in cases], args.array,
                             None if args.keep is None else os.path.join(args.keep, form))
    for i, (case, _, _) in enumerate(cases):
        print(f"{case:<12}" + "".join(f"{counts[form][2 * i]:>12,.0f}" for form in args.forms)
              + f"{counts[args.forms[0]][2 * i + 1]:>10,.0f}")


if __name__ == "__main__":
    main()
