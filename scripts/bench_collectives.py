"""The rest of the collective set against raw mpi4py, in the same run, interleaved.

Rows: all_gather with out= (vs Allgather into a preallocated array), gather (Gather),
scatter (Scatter), reduce (Reduce, in place on the root), all_to_all (Alltoall),
all_to_all with splits (Alltoallv: ours includes the counts exchange, one small
all_gather, that raw mpi4py, told the counts, skips) and send/recv (a ping-pong of
Send/Recv between ranks 0 and 1). float32 numpy arrays on the MPI backend; timing,
the slowest rank per iteration and the table are scripts/bench.py's.

    mpiexec -n 2 python scripts/bench_collectives.py [--min-bytes 4] [--max-bytes 64M]
        [--time-per-size 0.3] [--json out.json] [--ops gather,scatter]

Sizes are the bytes each rank sends (all_gather, gather: its own x; scatter, all_to_all:
the whole x).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import human, parse_size, sizes, stats, time_interleaved  # noqa: E402

OPS = ("all_gather_out", "gather", "scatter", "reduce", "all_to_all", "all_to_all_v", "send_recv")


def pair(op: str, comm: Any, count: int) -> tuple[Any, Any]:
    """(ours, raw) zero-argument calls of ``op`` on float32 arrays of ``count`` elements."""
    from mpi4py import MPI  # noqa: PLC0415

    raw, n, rank = comm.mpi_comm, comm.size, comm.rank
    F = MPI.FLOAT
    if op == "all_gather_out":
        x, out, out_raw = np.zeros(count, np.float32), np.empty((n, count), np.float32), \
            np.empty((n, count), np.float32)
        return lambda: comm.all_gather(x, out=out), lambda: raw.Allgather([x, F], [out_raw, F])
    if op == "gather":
        x, out_raw = np.zeros(count, np.float32), np.empty((n, count), np.float32)
        out = np.empty((n, count), np.float32) if rank == 0 else None
        return (lambda: comm.gather(x, 0, out=out),
                lambda: raw.Gather([x, F], [out_raw, F] if rank == 0 else None, 0))
    if op == "scatter":
        rows = max(1, count // n)
        x, out, out_raw = np.zeros((n, rows), np.float32), np.empty(rows, np.float32), \
            np.empty(rows, np.float32)
        return lambda: comm.scatter(x, 0, out=out), lambda: raw.Scatter([x, F], [out_raw, F], 0)
    if op == "reduce":
        x, y = np.zeros(count, np.float32), np.zeros(count, np.float32)
        spec = [y, F]
        return (lambda: comm.reduce(x, "sum", 0),
                lambda: raw.Reduce(MPI.IN_PLACE if rank == 0 else spec,
                                   spec if rank == 0 else None, MPI.SUM, 0))
    if op == "all_to_all":
        rows = max(1, count // n)
        x, out, out_raw = np.zeros((n, rows), np.float32), np.empty((n, rows), np.float32), \
            np.empty((n, rows), np.float32)
        return lambda: comm.all_to_all(x, out=out), lambda: raw.Alltoall([x, F], [out_raw, F])
    if op == "all_to_all_v":
        rows = max(1, count // n)
        splits = [rows] * n
        x, out, out_raw = np.zeros(rows * n, np.float32), np.empty(rows * n, np.float32), \
            np.empty(rows * n, np.float32)
        displs = [rows * j for j in range(n)]
        return (lambda: comm.all_to_all(x, splits, out=out),
                lambda: raw.Alltoallv([x, (splits, displs), F], [out_raw, (splits, displs), F]))
    if op == "send_recv":  # a ping-pong: 0 -> 1 -> 0
        x = np.zeros(count, np.float32)
        if rank == 0:
            def ours() -> None:
                comm.send(x, 1)
                comm.recv(x, 1)

            def bare() -> None:
                raw.Send([x, F], 1)
                raw.Recv([x, F], 1)
        elif rank == 1:
            def ours() -> None:
                comm.recv(x, 0)
                comm.send(x, 0)

            def bare() -> None:
                raw.Recv([x, F], 0)
                raw.Send([x, F], 0)
        else:
            def ours() -> None:
                pass
            bare = ours
        return ours, bare
    raise SystemExit(f"unknown op {op}; valid: {', '.join(OPS)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=parse_size, default=4)
    parser.add_argument("--max-bytes", type=parse_size, default=64 << 20)
    parser.add_argument("--step-factor", type=int, default=16)
    parser.add_argument("--time-per-size", type=float, default=0.3)
    parser.add_argument("--max-iters", type=int, default=2000)
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import collectives  # noqa: PLC0415

    comm = collectives.init("mpi")
    raw = comm.mpi_comm
    rows = []
    for op in args.ops.split(","):
        for nbytes in sizes(args.min_bytes, args.max_bytes, args.step_factor):
            count = max(1, nbytes // 4)
            fns = list(pair(op, comm, count))
            probe = time_interleaved(fns, 3, raw.Barrier, None)
            per_iter = raw.allreduce(float(probe.min(axis=1).sum()), op=__import__("mpi4py").MPI.MAX)
            iters = int(min(args.max_iters, max(10, args.time_per_size / max(per_iter, 1e-7))))
            time_interleaved(fns, min(100, max(3, iters // 10)), raw.Barrier, None)
            samples = time_interleaved(fns, iters, raw.Barrier, None)
            slowest = np.max(raw.allgather(samples), axis=0)
            ours, bare = stats(slowest[0], count * 4, 1.0), stats(slowest[1], count * 4, 1.0)
            row = {"op": op, "bytes": count * 4, "iters": iters, "ours": ours, "raw": bare,
                   "ratio": ours["median_us"] / bare["median_us"],
                   "diff_us": float(np.median(slowest[0] - slowest[1]) * 1e6)}
            rows.append(row)
            if comm.rank == 0:
                print(f"{op:15s} {human(row['bytes']):>8s}  ours {ours['median_us']:10.1f} us  "
                      f"raw {bare['median_us']:10.1f} us  ratio {row['ratio']:.3f}  "
                      f"diff {row['diff_us']:+.1f} us", flush=True)
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": {"ranks": comm.size, "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                         time.gmtime()),
                                "load": os.getloadavg()}, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
