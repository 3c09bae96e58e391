"""The synchronized batch-norm autograd Function: forward and backward side by side.

Each direction has the same three steps: local per-channel statistics, ONE
collective, an elementwise finish.

Forward. Every rank subtracts a per-channel shift ``K`` (its own first sample of
the channel) from its input, which is exact for data far from zero (1e4 + N(0, 1)
in float32 keeps every bit) and keeps the mean small, then takes the per-channel sums
of the shifted values and of their squares in one fused pass (float32 inputs:
at least float32 accumulation; fp16/bf16 use torch's two-pass statistics kernel
with float32 results instead, since they are not shifted). One ``all_gather`` of the rows ``[count, K, mean,
var]`` (float64, so counts stay exact) gives every rank the same table, which
every rank merges in the same order with Chan's formula -- exact for uneven
counts, an empty rank is a row of zeros, and the result (and so the running
stats) is bit-identical everywhere. The output normalizes the *shifted* input,
so no large mean is ever subtracted in working precision.

Backward. The local sums ``Σdy`` and ``Σdy·x̂`` (2C values) are all_reduced and
divided by the global count: ``dx = w·invstd·(dy - mean(dy) - x̂·mean(dy·x̂))``.
``grad_weight``/``grad_bias`` stay local (data-parallel training sums them over
ranks, like every other parameter gradient).

No value is read back to the host: counts are device tensors after the
collective and the empty-batch case is handled with ``torch.where``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from collectives import Communicator


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    """Statistics and the merge run in float64 for float64 input, else in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _per_channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    return (x.shape[1],) + (1,) * (x.dim() - 2)


def _affine(x: torch.Tensor, center: torch.Tensor, scale: torch.Tensor | None,
            shift: torch.Tensor | None) -> torch.Tensor:
    """``(x - center) * scale + shift`` per channel, in x's dtype and memory format.

    torch's inference batch-norm kernel is the fastest fused per-channel affine on
    every device (channels_last, mixed fp16/bf16 input with float32 parameters);
    with variance 1 and eps 0 its 1/sqrt(var + eps) is exactly 1.
    """
    ones = torch.ones_like(center)
    return F.batch_norm(x, center, ones, scale, shift, False, 0.0, 0.0)


def local_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``[count, K, mean, var]`` row (float64, length 1 + 3C) and ``x - K``.

    ``K`` is one sample per channel (0 for fp16/bf16 input), ``mean``/``var`` are the mean and biased
    variance of ``x - K``. An empty ``x`` gives a row of zeros (it adds nothing
    to the merge) and itself.
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    stat = _stat_dtype(x)
    if count == 0:
        return torch.zeros(1 + 3 * channels, dtype=torch.float64, device=x.device), x
    if x.dtype == stat:
        # A contiguous copy: torch's CPU batch-norm kernels take a 5-10x slower path
        # when a per-channel tensor is a strided view.
        shift = x[(0, slice(None)) + (0,) * (x.dim() - 2)].to(stat, copy=True)
        shifted = _affine(x, shift, None, None)
        # Σs and Σs² of s = x - K in ONE fused pass: torch's inference batch-norm backward
        # with grad_output = input = s, mean 0, var 1, eps 0 returns exactly those as
        # grad_bias and grad_weight (3-5x faster on CPU than the two-pass stats kernel;
        # after the shift, Σs² - (Σs)²/n cancels little).
        zeros, ones = torch.zeros_like(shift), torch.ones_like(shift)
        _, sum_squares, sums = torch.ops.aten.native_batch_norm_backward(
            shifted, shifted, ones, zeros, ones, None, None, False, 0.0, [False, True, True])
        mean = sums.double() / count
        var = (sum_squares.double() / count - mean * mean).clamp(min=0.0)
    else:
        # fp16/bf16: x - K would round to x's precision, and float32 statistics of x itself
        # are already far more precise than x; float32 buffers make torch accumulate and
        # return float32 (it updates them with momentum 0: they are scratch).
        shift = torch.zeros(channels, dtype=stat, device=x.device)
        shifted = x
        mean, var = torch.batch_norm_update_stats(x, torch.zeros_like(shift), torch.ones_like(shift), 0.0)
    counts = torch.full((1,), float(count), dtype=torch.float64, device=x.device)
    return torch.cat([counts, shift.double(), mean.double(), var.double()]), shifted


def merge_stats(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge every rank's row (``rows``: (ranks, 1 + 3C) float64) with Chan's formula.

    Returns ``(count, mean, M2, shifts)``: the global count (0-d), the global
    mean and sum of squared deviations (shape (C,)), and each rank's shift
    (shape (ranks, C)); all float64. Ranks of count 0 contribute nothing.
    """
    channels = (rows.shape[1] - 1) // 3
    counts = rows[:, :1]  # (ranks, 1): broadcasts over channels
    shifts = rows[:, 1:1 + channels]
    means = shifts + rows[:, 1 + channels:1 + 2 * channels]
    m2s = rows[:, 1 + 2 * channels:] * counts
    total = counts.sum()
    safe_total = total.clamp(min=1.0)
    mean = (counts * means).sum(0) / safe_total
    m2 = m2s.sum(0) + (counts * (means - mean) ** 2).sum(0)
    return total, mean, m2, shifts


def _update_running(running_mean: torch.Tensor, running_var: torch.Tensor,
                    num_batches_tracked: torch.Tensor | None, momentum: float | None,
                    total: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
    """torch's running-stat update with the global unbiased variance.

    A globally empty batch changes nothing (not even ``num_batches_tracked``).
    ``momentum=None`` is the cumulative average 1/num_batches_tracked.
    """
    nonempty = total > 0
    if num_batches_tracked is not None:
        num_batches_tracked.add_(nonempty.to(num_batches_tracked.dtype))
    if momentum is None:
        if num_batches_tracked is None:
            return
        factor = 1.0 / num_batches_tracked.clamp(min=1).to(torch.float64)
    else:
        factor = torch.tensor(float(momentum), dtype=torch.float64, device=mean.device)
    unbiased = m2 / (total - 1.0).clamp(min=1.0)
    for buffer, value in ((running_mean, mean), (running_var, unbiased)):
        old = buffer.to(torch.float64)
        new = torch.where(nonempty, (1.0 - factor) * old + factor * value, old)
        buffer.copy_(new)


class SyncBatchNormFunction(torch.autograd.Function):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` with global batch statistics.

    ``comm=None`` uses this rank's batch alone (no collective at all). Running
    stats, when given, are updated in place (forward only).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                num_batches_tracked: torch.Tensor | None, momentum: float | None, eps: float,
                comm: Communicator | None) -> torch.Tensor:
        stat = _stat_dtype(x)
        row, shifted = local_stats(x)
        rows = row[None] if comm is None or comm.size == 1 else comm.all_gather(row)
        total, mean, m2, shifts = merge_stats(rows)
        rank = 0 if comm is None else comm.rank
        # The global mean relative to this rank's shift: small, so exact in working precision.
        center = (mean - shifts[rank]).to(stat)
        var = (m2 / total.clamp(min=1.0)).to(stat)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                _update_running(running_mean, running_var, num_batches_tracked, momentum,
                                total, mean, m2)
        if x.numel() == 0:
            y = torch.empty_like(x)
        else:
            y = F.batch_norm(shifted, center, var, weight, bias, False, 0.0, eps)
        ctx.save_for_backward(shifted, weight, center, var, invstd, total)
        ctx.eps = eps
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.comm = comm
        return y

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        shifted, weight, center, var, invstd, total = ctx.saved_tensors
        comm, bias_dtype = ctx.comm, ctx.bias_dtype
        channels = center.shape[0]
        ones = torch.ones_like(center)
        if shifted.numel() == 0:
            sum_dy = torch.zeros_like(center)
            sum_dy_xhat = torch.zeros_like(center)
        else:
            # One fused pass for both sums: inference-mode backward computes exactly
            # grad_bias = Σdy and grad_weight = Σdy·(x - center)·invstd.
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                grad_output, shifted, ones, center, var, None, None, False, ctx.eps,
                [False, True, True])
        grad_input = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])
            if comm is not None and comm.size > 1:
                comm.all_reduce(sums, "sum")
            sums = sums / total.to(sums.dtype).clamp(min=1.0)
            mean_dy, mean_dy_xhat = sums[:channels], sums[channels:]
            scale = invstd if weight is None else weight.to(invstd.dtype) * invstd
            if shifted.numel() == 0:
                grad_input = torch.empty_like(shifted)
            else:
                # dx = scale·dy + (x - center)·b + c, with per-channel b and c.
                b = -scale * invstd * mean_dy_xhat
                c = -scale * mean_dy
                grad_input = _affine(shifted, center, b, c)
                grad_input.addcmul_(grad_output, scale.view(_per_channel_shape(shifted)))
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(bias_dtype) if ctx.needs_input_grad[2] else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None
