"""SyncBatchNorm's own collectives, ours against the raw transport, after a barrier and right after compute.

    torchrun --nproc_per_node 2 scripts/bench_collective_after_compute.py
    COLLECTIVES_BACKEND=mpi mpiexec -n 2 python scripts/bench_collective_after_compute.py

SyncBatchNorm makes two collectives per layer: forward, ``comm.all_gather`` of one float64
row of 1 + 3C values; backward, ``comm.all_reduce`` of 2C values in the input's statistics
dtype (float32 or float64). This script makes exactly those calls for every C of
``--channels``, through the communicator ("ours") and through the raw transport on the same
tensors (torch.distributed's ``all_gather_single``/``all_gather_into_tensor`` and
``all_reduce``; mpi4py's ``Allgather``/``Allreduce`` on numpy views), interleaved call by
call (ours, raw, raw, ours, ...), with no SyncBatchNorm in the timed call. Before each call
the ranks meet at a barrier (not timed) and then do, on every rank alike, what ``--modes``
says:

- ``idle``: nothing;
- ``syncbn``: a SyncBatchNorm forward+backward (``comm=None``: local statistics, no
  communication) of the ResNet-50 layer shape with C channels, batch ``--batch``: the
  compute that precedes these calls inside a training step;
- ``conv``: ``--compute-ms`` of 3x3 convolutions (one shape for every C);
- ``spin``: a Python busy loop as long as the ``syncbn`` compute (CPU used, no memory
  traffic, no torch threads);
- ``asleep``: ``time.sleep`` as long (the threads asleep, no CPU used).

For each call it takes the entry and exit times of every rank (CLOCK_MONOTONIC, one clock for
the host's processes) and reports the medians over calls of the time in the call (the mean
over ranks: what a SyncBatchNorm layer pays), of the last-arriving rank's own call time (the
collective's cost once every rank is there) and of how long the others waited for it to
arrive, for ours and raw, and the ratios ours/raw. ``--json`` writes every row.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from collectives.syncbn.function import SyncBatchNormFunction

import collectives
from collectives.communicator import Communicator

# ResNet-50's BatchNorm layer shapes (C, H, W), one per channel count (scripts/bench_syncbn.py's).
RESNET50 = {64: (56, 56), 128: (28, 28), 256: (56, 56), 512: (28, 28), 1024: (14, 14), 2048: (7, 7)}


def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def raw_all_gather(comm: Communicator, row: torch.Tensor) -> Callable[[], object]:
    if comm.backend == "torch":
        import torch.distributed as dist  # noqa: PLC0415

        out = torch.empty(comm.size * row.numel(), dtype=row.dtype)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(out, row, group=comm.process_group)
    if comm.backend == "mpi":
        send, received = row.numpy(), np.empty(comm.size * row.numel(), dtype=row.numpy().dtype)
        return lambda: comm.mpi_comm.Allgather(send, received)
    raise SystemExit(f"backend {comm.backend!r}: start this with torchrun or mpiexec (2 or more ranks)")


def raw_all_reduce(comm: Communicator, sums: torch.Tensor) -> Callable[[], object]:
    if comm.backend == "torch":
        import torch.distributed as dist  # noqa: PLC0415

        return lambda: dist.all_reduce(sums, group=comm.process_group)
    from mpi4py import MPI  # noqa: PLC0415

    view = sums.numpy()
    return lambda: comm.mpi_comm.Allreduce(MPI.IN_PLACE, view)


def timed_calls(comm: Communicator, calls: dict[str, Callable[[], object]], before: Callable[[], None],
                iterations: int, warmup: int = 2) -> dict[str, dict[str, float]]:
    """Per call name: medians (s) over calls of the rank-mean time in the call, of the
    last-arriving rank's own call time and of the others' wait for it. Calls interleave
    (ours, raw, raw, ours, ...) so that a busy machine slows both alike."""
    record: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    names = list(calls)
    for i in range(warmup + iterations):
        for name in names if i % 2 == 0 else names[::-1]:
            comm.barrier()
            before()
            enter = _now()
            calls[name]()
            record[name].append((enter, _now()))
    medians = {}
    for name in names:
        times = comm.all_gather(np.array(record[name][warmup:]))  # (ranks, calls, 2)
        enter, leave = times[:, :, 0], times[:, :, 1]
        last, columns = enter.argmax(axis=0), np.arange(enter.shape[1])
        medians[name] = {
            "in_call": float(np.median((leave - enter).mean(axis=0))),
            "last_own": float(np.median(leave[last, columns] - enter[last, columns])),
            "waited": float(np.median((enter.max(axis=0) - enter).sum(axis=0) / (comm.size - 1))),
        }
    return medians


def syncbn_step(channels: int, batch: int) -> Callable[[], None]:
    """A SyncBatchNorm forward+backward of the ResNet-50 shape with ``channels``, no communication."""
    h, w = RESNET50.get(channels, (14, 14))
    x = torch.randn(batch, channels, h, w, requires_grad=True)
    weight, bias = torch.ones(channels, requires_grad=True), torch.zeros(channels, requires_grad=True)
    dy = torch.randn_like(x)

    def step() -> None:
        x.grad = weight.grad = bias.grad = None
        SyncBatchNormFunction.apply(x, weight, bias, None, None, None, 0.1, 1e-5, None).backward(dy)

    return step


def _median_seconds(comm: Communicator, step: Callable[[], None], repeats: int = 5) -> float:
    """Rank 0's median time of ``step``, the same number on every rank."""
    times = []
    for _ in range(repeats):
        start = _now()
        step()
        times.append(_now() - start)
    return float(comm.broadcast(np.array([float(np.median(times))]), src=0)[0])


def spin(seconds: float) -> Callable[[], None]:
    def busy() -> None:
        end = _now() + seconds
        while _now() < end:
            pass

    return busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--channels", type=lambda s: [int(c) for c in s.split(",")],
                        default=[64, 256, 512, 1024, 2048], help="C values, comma-separated "
                        "(default 64,256,512,1024,2048)")
    parser.add_argument("--collectives", default="all_gather,all_reduce32,all_reduce64",
                        help="of all_gather (float64 1+3C), all_reduce32, all_reduce64 (2C)")
    parser.add_argument("--modes", default="idle,syncbn",
                        help="comma-separated, of idle, syncbn, conv, spin, asleep (default idle,syncbn)")
    parser.add_argument("--batch", type=int, default=8, help="batch of the syncbn compute (default 8)")
    parser.add_argument("--compute-ms", type=float, default=30.0,
                        help="convolutions before each call in mode conv (default 30 ms)")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's, OMP_NUM_THREADS; torchrun sets 1)")
    parser.add_argument("--json", default=None, help="write every row to this file")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    comm = collectives.init()
    modes = args.modes.split(",")
    x, w = torch.randn(8, 16, 32, 32), torch.randn(16, 16, 3, 3)
    conv_seconds = _median_seconds(comm, lambda: torch.conv2d(x, w, padding=1))
    convs = max(1, round(args.compute_ms / 1e3 / conv_seconds))
    conv = lambda: [torch.conv2d(x, w, padding=1) for _ in range(convs)]  # noqa: E731
    load = os.getloadavg()
    header = (f"backend={comm.backend} ranks={comm.size} torch threads={torch.get_num_threads()} "
              f"load average {' '.join(f'{v:.2f}' for v in load)}; medians in ms; "
              "in call = mean over ranks, own = the last-arriving rank's, waited = the others' wait for it")
    lines = [header, f"{'mode':<8} {'collective':<13} {'C':>5} {'compute':>8} | {'in call ours/raw':>17} "
             f"{'ratio':>6} | {'own ours/raw':>15} {'ratio':>6} | {'waited ours/raw':>15}"]
    rows: list[dict[str, Any]] = []
    for channels in args.channels:
        row = torch.zeros(1 + 3 * channels, dtype=torch.float64)
        sums = {"all_reduce32": torch.zeros(2 * channels, dtype=torch.float32),
                "all_reduce64": torch.zeros(2 * channels, dtype=torch.float64)}
        collectives_here: dict[str, dict[str, Callable[[], object]]] = {}
        for name in args.collectives.split(","):
            if name == "all_gather":
                collectives_here[name] = {"ours": lambda row=row: comm.all_gather(row),
                                          "raw": raw_all_gather(comm, row)}
            else:
                t = sums[name]
                collectives_here[name] = {"ours": lambda t=t: comm.all_reduce(t, "sum"),
                                          "raw": raw_all_reduce(comm, t)}
        step = syncbn_step(channels, args.batch)
        step_seconds = _median_seconds(comm, step) if set(modes) & {"syncbn", "spin", "asleep"} else 0.0
        befores: dict[str, tuple[Callable[[], None], float]] = {
            "idle": (lambda: None, 0.0), "syncbn": (step, step_seconds),
            "conv": (conv, convs * conv_seconds), "spin": (spin(step_seconds), step_seconds),
            "asleep": (lambda s=step_seconds: time.sleep(s), step_seconds)}
        for mode in modes:
            before, seconds = befores[mode]
            for name, calls in collectives_here.items():
                result = timed_calls(comm, calls, before, args.iterations)
                ours, raw = result["ours"], result["raw"]
                rows.append({"mode": mode, "collective": name, "channels": channels,
                             "compute_ms": 1e3 * seconds, "ours": ours, "raw": raw})
                lines.append(
                    f"{mode:<8} {name:<13} {channels:>5} {1e3 * seconds:8.1f} | "
                    f"{1e3 * ours['in_call']:8.3f}/{1e3 * raw['in_call']:8.3f} "
                    f"{ours['in_call'] / raw['in_call']:6.2f} | "
                    f"{1e3 * ours['last_own']:7.3f}/{1e3 * raw['last_own']:7.3f} "
                    f"{ours['last_own'] / raw['last_own']:6.2f} | "
                    f"{1e3 * ours['waited']:7.3f}/{1e3 * raw['waited']:7.3f}")
    if comm.rank == 0:
        print("\n".join(lines), flush=True)
        if args.json:
            meta = {"backend": comm.backend, "ranks": comm.size, "threads": torch.get_num_threads(),
                    "load_start": load, "load_end": os.getloadavg(), "batch": args.batch,
                    "iterations": args.iterations}
            with open(args.json, "w") as file:
                json.dump({"meta": meta, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
