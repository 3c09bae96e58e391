"""Examples per second through collectives.testing: small all_reduce jobs sent to warm ranks.

    python scripts/bench_pool.py [--jobs 300]

For each world (backend, size) starts one RankPool, warms it, then times ``--jobs``
round trips of a job that all_reduces an 8-element float32 array on every rank
(what one Hypothesis example of the property suite costs, without data generation).
Prints one line per world, and the machine's load average.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from collectives.testing import RankPool

WORLDS = [("local", 1), ("mpi", 2), ("mpi", 4), ("torch", 2), ("torch", 4)]


def all_reduce_job(comm, x):
    return comm.all_reduce(x, "sum")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=300)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.1f}, cores: {os.cpu_count()}")
    for backend, size in WORLDS:
        with RankPool(backend, size) as pool:
            per_rank = [(np.full(8, r, np.float32),) for r in range(size)]
            for _ in range(20):
                pool.run(all_reduce_job, per_rank)
            start = time.perf_counter()
            for _ in range(args.jobs):
                pool.run(all_reduce_job, per_rank)
            elapsed = time.perf_counter() - start
        print(f"{backend:>5} x{size}: {args.jobs / elapsed:7.0f} jobs/s  "
              f"({1e3 * elapsed / args.jobs:.2f} ms per job)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
