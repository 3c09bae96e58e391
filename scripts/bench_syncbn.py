"""Per-rank forward+backward time of syncbn.SyncBatchNorm against unsynchronized torch BatchNorm2d.

    COLLECTIVES_BACKEND=mpi   mpiexec -n 2 python scripts/bench_syncbn.py
    COLLECTIVES_BACKEND=torch torchrun --nproc_per_node 2 scripts/bench_syncbn.py

Every rank runs the same local batch (ResNet-50 layer shapes, batch 8 by
default) through both layers, alternating iteration by iteration so that a busy
machine slows both alike; ranks meet at a barrier (not timed) before each
iteration. The table on rank 0 shows, per shape, the median over iterations of
the slowest rank's time, and the ratio ours / unsynced. ``--profile`` adds the
median time of the pieces of our layer (local statistics, the two collectives,
normalization, the backward's sums and elementwise finish).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from collectives.syncbn import function as sbf

import collectives
from collectives import syncbn

SHAPES = [(64, 56, 56), (256, 56, 56), (512, 28, 28), (1024, 14, 14), (2048, 7, 7)]


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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    comm = collectives.init()
    lines = [f"backend={comm.backend} ranks={comm.size} batch={args.batch} threads/rank={args.threads} "
             f"iterations={args.iterations} (median of the slowest rank)",
             f"{'shape (C, H, W)':<18} {'unsynced ms':>12} {'SyncBN ms':>10} {'ratio':>6}"]
    profiles = []
    for C, H, W in SHAPES:
        x = torch.randn(args.batch, C, H, W).requires_grad_()
        dy = torch.randn(args.batch, C, H, W)
        ours = syncbn.SyncBatchNorm(C, comm=comm)
        plain = torch.nn.BatchNorm2d(C)
        t_ours, t_plain = time_pair(comm, ours, plain, x, dy, args.iterations, args.warmup)
        lines.append(f"{f'{C}x{H}x{W}':<18} {t_plain * 1e3:>12.2f} {t_ours * 1e3:>10.2f} "
                     f"{t_ours / t_plain:>6.2f}")
        if args.profile:
            profiles.append((f"{C}x{H}x{W}", profile_pieces(comm, x.detach(), dy, args.iterations)))
    if comm.rank == 0:
        print("\n".join(lines))
        for shape, pieces in profiles:
            print(f"{shape}: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in pieces.items()))


if __name__ == "__main__":
    main()
