"""What the MPI backend's timeout path costs: all_reduce and broadcast through a
communicator with a timeout (the default), one with none (blocking MPI calls) and raw
mpi4py, interleaved call by call in one run (see docs/performance.md).

    mpiexec -n 2 python scripts/bench_mpi_timeout.py
"""

import os
import sys

import numpy as np
from collectives.backends.mpi import MPICommunicator
from mpi4py import MPI

import collectives

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import time_interleaved  # noqa: E402

timed = collectives.init("mpi")
plain = MPICommunicator(timeout=0)
assert timed.timeout and plain.timeout is None
raw = plain.mpi_comm


def calls(op, xs):
    """ours with a timeout, ours without, raw mpi4py: on three arrays of one size."""
    spec = [xs[2], MPI.FLOAT]
    if op == "all_reduce":
        return [lambda: timed.all_reduce(xs[0]), lambda: plain.all_reduce(xs[1]),
                lambda: raw.Allreduce(MPI.IN_PLACE, spec, MPI.SUM)]
    return [lambda: timed.broadcast(xs[0]), lambda: plain.broadcast(xs[1]), lambda: raw.Bcast(spec, 0)]


rows = []
print_rank = timed.rank == 0
for nbytes in (4, 1024, 16384, 65536, 1 << 20):
    for op in ("all_reduce", "broadcast"):
        xs = [np.zeros(nbytes // 4, np.float32) for _ in range(3)]
        fns = calls(op, xs)
        n = 3000 if nbytes < 100000 else 400
        time_interleaved(fns, 100, raw.Barrier, None)
        s = time_interleaved(fns, n, raw.Barrier, None)
        every = np.array(raw.allgather(s)).max(axis=0)
        med = np.median(every, axis=1) * 1e6
        d_t = np.median(every[0] - every[2]) * 1e6
        d_0 = np.median(every[1] - every[2]) * 1e6
        rows.append(f"{op:11s} {nbytes:>8} B  timeout-on {med[0]:8.2f}  timeout-off {med[1]:8.2f}  raw {med[2]:8.2f} us"
                    f"  | paired diff vs raw: on {d_t:+.2f}  off {d_0:+.2f} us")
if print_rank:
    print("\n".join(rows))
