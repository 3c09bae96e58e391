"""A small all_gather right after a barrier and right after compute: where SyncBN's collective time goes.

    torchrun --nproc_per_node 2 scripts/bench_collective_after_compute.py
    COLLECTIVES_BACKEND=mpi mpiexec -n 2 python scripts/bench_collective_after_compute.py

SyncBatchNorm's forward all_gathers one float64 row of 1 + 3C per layer. Inside a
training step that call comes after tens of ms of convolutions, not after a
barrier as in scripts/bench.py. This script times that all_gather both ways,
through the communicator ("ours") and the raw transport (torch.distributed's
all_gather_single or mpi4py's Allgather), with no SyncBatchNorm involved: (1) "idle":
right after a barrier; (2) "after compute": after ``--compute-ms`` of convolutions
on every rank; (3) "asleep": after sleeping as long instead. For each call it takes
the entry and exit times of every rank (CLOCK_MONOTONIC, one clock for the host's
processes) and reports the medians of
the last-arriving rank's own call time (the collective's cost once every rank is
there) and of how long the other ranks waited for it to arrive.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import numpy as np
import torch

import collectives
from collectives.communicator import Communicator


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def raw_all_gather(comm: Communicator, row: torch.Tensor) -> Callable[[], object]:
    if comm.backend == "torch":
        import torch.distributed as dist  # noqa: PLC0415

        out = torch.empty(comm.size * row.numel(), dtype=row.dtype)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, row, group=comm.process_group)
    if comm.backend == "mpi":
        send, received = row.numpy(), np.empty(comm.size * row.numel())
        return lambda: comm.mpi_comm.Allgather(send, received)
    raise SystemExit(f"backend {comm.backend!r}: start this with torchrun or mpiexec (2 or more ranks)")


def timed_calls(comm: Communicator, call: Callable[[], object], before: Callable[[], None],
                iterations: int) -> tuple[float, float]:
    """Medians (s) of the last-arriving rank's own call time and of the others' wait for it."""
    record = []
    for _ in range(iterations):
        comm.barrier()
        before()
        enter = _now()
        call()
        record.append((enter, _now()))
    times = comm.all_gather(np.array(record[2:]))  # (ranks, calls, 2); the first two are warm-up
    enter, leave = times[:, :, 0], times[:, :, 1]
    last, calls = enter.argmax(axis=0), np.arange(enter.shape[1])
    own = leave[last, calls] - enter[last, calls]
    waited = (enter.max(axis=0) - enter).sum(axis=0) / (comm.size - 1)
    return float(np.median(own)), float(np.median(waited))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=int, default=64, help="C of the row 1 + 3C (default 64)")
    parser.add_argument("--compute-ms", type=float, default=30.0,
                        help="convolutions before each call in 'after compute' (default 30 ms)")
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = collectives.init()
    row = torch.zeros(1 + 3 * args.channels, dtype=torch.float64)
    x, w = torch.randn(8, 16, 32, 32), torch.randn(16, 16, 3, 3)
    start = _now()
    for _ in range(5):
        torch.conv2d(x, w, padding=1)
    # Every rank runs the same number of convolutions (rank 0's estimate).
    convs = comm.broadcast(np.array([max(1, round(args.compute_ms / 1e3 / ((_now() - start) / 5)))]), src=0)
    compute = lambda: [torch.conv2d(x, w, padding=1) for _ in range(int(convs[0]))]  # noqa: E731
    calls = {"raw": raw_all_gather(comm, row), "ours": lambda: comm.all_gather(row)}
    lines = [f"backend={comm.backend} ranks={comm.size} row={row.numel()} float64, load average "
             f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}; medians in ms"]
    # Sleeping as long as the convolutions take tells the scheduler's share (a process that has
    # just computed waits its turn at each wake-up) from idle Gloo threads (asleep either way).
    modes = (("idle", lambda: None), (f"after {int(convs[0])} convs", compute),
             (f"after {args.compute_ms:g} ms asleep", lambda: time.sleep(args.compute_ms / 1e3)))
    for mode, before in modes:
        for name, call in calls.items():
            own, waited = timed_calls(comm, call, before, args.iterations)
            lines.append(f"  {mode:<20} {name:<5} last rank's own call {1e3 * own:8.3f}   "
                         f"others waited for it {1e3 * waited:8.3f}")
    if comm.rank == 0:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
