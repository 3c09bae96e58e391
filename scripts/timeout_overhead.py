"""What timeouts and debug mode cost per all_reduce on the MPI backend.

    mpiexec -n 2 python scripts/timeout_overhead.py

Compares, for a few message sizes, raw mpi4py ``Allreduce`` with ``all_reduce`` on
an MPICommunicator without a timeout (blocking MPI calls), with a timeout
(nonblocking call polled against a deadline, the default), and in debug mode
(plus the fingerprint all_gather). Each variant runs in interleaved rounds; the
best round counts (the machine is shared). Rank 0 prints microseconds per call.
"""

from __future__ import annotations

import time

import numpy as np
from collectives.backends.mpi import MPICommunicator
from mpi4py import MPI


def per_call_us(fn, buf, calls: int) -> float:
    for _ in range(min(calls, 200)):
        fn(buf)
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn(buf)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    raw = MPI.COMM_WORLD.Dup()
    blocking = MPICommunicator(timeout=0)
    with_timeout = MPICommunicator(timeout=1800)
    debug = MPICommunicator(timeout=1800)
    debug.debug = True
    variants = {
        "raw mpi4py": lambda b: raw.Allreduce(MPI.IN_PLACE, [b, MPI.FLOAT], MPI.SUM),
        "no timeout": lambda b: blocking.all_reduce(b),
        "timeout (default)": lambda b: with_timeout.all_reduce(b),
        "debug + timeout": lambda b: debug.all_reduce(b),
    }
    if raw.Get_rank() == 0:
        print(f"{'bytes':>8}  " + "  ".join(f"{name:>18}" for name in variants) + "   (us per call)")
    for nbytes, calls in ((4, 20000), (16384, 4000), (1 << 20, 200)):
        buf = np.ones(nbytes // 4, dtype=np.float32)
        best = dict.fromkeys(variants, float("inf"))
        for _ in range(5):
            for name, fn in variants.items():
                best[name] = min(best[name], per_call_us(fn, buf, calls))
        if raw.Get_rank() == 0:
            base = best["raw mpi4py"]
            cells = [f"{best[n]:8.2f} ({best[n] - base:+6.2f})" for n in variants]
            print(f"{nbytes:>8}  " + "  ".join(f"{c:>18}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
