"""Per-rank forward+backward time of syncbn.SyncBatchNorm against unsynchronized torch BatchNorm1d/2d/3d.

    COLLECTIVES_BACKEND=local python scripts/bench/syncbn.py       # 1 rank: compute only
    COLLECTIVES_BACKEND=mpi   mpiexec -n 2 python scripts/bench/syncbn.py
    COLLECTIVES_BACKEND=torch torchrun --nproc_per_node 2 scripts/bench/syncbn.py

Every rank runs the same local batch through both layers (torch's BatchNorm of the
input's dimensionality against ours), alternating iteration by iteration so that a
busy machine slows both alike; ranks meet at a barrier (not timed) before each
iteration. The shapes (:data:`SHAPES`): ResNet-50's BatchNorm2d layers at batch 8,
two BatchNorm1d inputs (a classifier head's ``(N, C)``, a 1-D conv net's ``(N, C, L)``)
and two BatchNorm3d inputs (video-style ``(N, C, D, H, W)``); 2d and 3d also in
channels_last memory format. The table on rank 0 shows, per shape, the median over
iterations of the slowest rank's time, and the ratio ours / unsynced; ``--json PATH``
writes the rows. ``--profile`` adds the median time of the pieces of our layer (local
statistics, the two collectives, normalization, the backward's sums and elementwise
finish) for the contiguous 4-D shapes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from collectives.syncbn import function as sbf

import collectives
from collectives import syncbn

#: (torch's layer, the whole input shape; the batch dimension ``None`` = ``--batch``).
SHAPES: list[tuple[type[torch.nn.Module], tuple[int | None, ...]]] = [
    *[(torch.nn.BatchNorm2d, (None, *chw)) for chw in
      [(64, 56, 56), (256, 56, 56), (512, 28, 28), (1024, 14, 14), (2048, 7, 7)]],
    (torch.nn.BatchNorm1d, (256, 2048)), (torch.nn.BatchNorm1d, (None, 256, 1024)),
    (torch.nn.BatchNorm3d, (None, 64, 8, 28, 28)), (torch.nn.BatchNorm3d, (None, 256, 4, 14, 14)),
]
#: The memory format of the channels_last rows, by input dimensionality.
CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> None:
    layer.zero_grad(set_to_none=True)
    x.grad = None
    layer(x).backward(dy)


def time_pair(comm, ours, plain, x, dy, iterations: int, warmup: int) -> tuple[float, float]:
    """Median seconds per forward+backward of (ours, plain) on the slowest rank."""
    times: dict[str, list[float]] = {"ours": [], "plain": []}
    for i in range(warmup + iterations):
        for name, layer in (("ours", ours), ("plain", plain)):
            comm.barrier()
            start = time.perf_counter()
            step(layer, x, dy)
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
    per_rank = np.array([statistics.median(times["ours"]), statistics.median(times["plain"])])
    slowest = comm.all_gather(per_rank).max(axis=0)
    return float(slowest[0]), float(slowest[1])


class _Stopwatch:
    """Accumulates the seconds of named pieces: ``with watch("name"): ...``."""

    def __init__(self) -> None:
        self.pieces: dict[str, list[float]] = {}
        self._name = ""

    def __call__(self, name: str) -> _Stopwatch:
        self._name = name
        return self

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.pieces.setdefault(self._name, []).append(time.perf_counter() - self._start)


def profile_pieces(comm, x: torch.Tensor, dy: torch.Tensor, iterations: int) -> dict[str, float]:
    """Median seconds of each piece of SyncBatchNormFunction on this rank (same calls, timed apart)."""
    C = x.shape[1]
    weight, bias = torch.ones(C), torch.zeros(C)
    watch = _Stopwatch()
    for _ in range(iterations):
        comm.barrier()
        with watch("fwd: local stats"):
            row, shifted = sbf.local_stats(x)
        with watch("fwd: all_gather"):
            rows = comm.all_gather(row)
        with watch("fwd: merge"):
            total, mean, m2, shifts = sbf.merge_stats(rows)
            center = (mean - shifts[comm.rank]).float()
            var = (m2 / total).float()
        with watch("fwd: normalize"):
            torch.nn.functional.batch_norm(shifted, center, var, weight, bias, False, 0.0, 1e-5)
        with watch("bwd: local sums"):
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, shifted, weight, center, var, None, None, False, 1e-5, [False, True, True])
            sums = torch.cat([sum_dy, sum_dy_xhat])
        with watch("bwd: all_reduce"):
            comm.all_reduce(sums)
        with watch("bwd: elementwise"):
            invstd = torch.rsqrt(var + 1e-5)
            b, c = -invstd * invstd * sums[C:] / total, -invstd * sums[:C] / total
            sbf._affine(shifted, center, b, c).addcmul_(dy, invstd.view(C, 1, 1))
    return {name: statistics.median(values) for name, values in watch.pieces.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--profile", action="store_true", help="time the pieces of our layer too")
    parser.add_argument("--json", default=None, help="write the rows to this file (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    comm = collectives.init()
    lines = [f"backend={comm.backend} ranks={comm.size} batch={args.batch} threads/rank={args.threads} "
             f"iterations={args.iterations} (median of the slowest rank)",
             f"{'layer':<12} {'shape':<18} {'format':<14} {'unsynced ms':>12} {'SyncBN ms':>10} {'ratio':>6}"]
    rows, profiles = [], []
    for layer, shape in SHAPES:
        full = tuple(args.batch if n is None else n for n in shape)
        formats = [("contiguous", torch.contiguous_format)]
        if len(full) in CHANNELS_LAST:
            formats.append(("channels_last", CHANNELS_LAST[len(full)]))
        for name, memory_format in formats:
            x = torch.randn(full).to(memory_format=memory_format).requires_grad_()
            dy = torch.randn(full).to(memory_format=memory_format)
            ours = syncbn.SyncBatchNorm(full[1], comm=comm)
            plain = layer(full[1])
            t_ours, t_plain = time_pair(comm, ours, plain, x, dy, args.iterations, args.warmup)
            label = "x".join(map(str, full))
            rows.append({"layer": layer.__name__, "shape": list(full), "format": name,
                         "unsynced_ms": t_plain * 1e3, "syncbn_ms": t_ours * 1e3, "ratio": t_ours / t_plain})
            lines.append(f"{layer.__name__:<12} {label:<18} {name:<14} {t_plain * 1e3:>12.2f} "
                         f"{t_ours * 1e3:>10.2f} {t_ours / t_plain:>6.2f}")
            if args.profile and len(full) == 4 and name == "contiguous":
                profiles.append((label, profile_pieces(comm, x.detach(), dy, args.iterations)))
    if comm.rank == 0:
        print("\n".join(lines))
        for label, pieces in profiles:
            print(f"{label}: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in pieces.items()))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"backend": comm.backend, "ranks": comm.size, "batch": args.batch,
                           "threads": args.threads, "iterations": args.iterations, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
