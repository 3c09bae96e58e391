"""The synchronized batch-norm autograd Function: forward and backward side by side.

Each direction has the same three steps: local per-channel statistics, ONE
collective, an elementwise finish.

Forward. Every rank takes the per-channel sums of its input and of its squares in
one fused pass. Where a channel is far from zero (|mean| > FAR standard deviations,
so that Σx² - (Σx)²/n would cancel), the rank subtracts a per-channel shift ``K``
(its own first sample of the channel), which is exact for such data (1e4 + N(0, 1)
in float32 keeps every bit), and sums the shifted values instead; on CUDA it always
shifts (deciding would read a value back to the host). fp16/bf16 input uses torch's
two-pass statistics kernel with float32 results (never shifted). One ``all_gather``
of the rows ``[count, K, mean, var]`` (float64, so counts stay exact) gives every rank
the same table, which every rank merges in the same order with Chan's formula --
exact for uneven counts, an empty rank is a row of zeros, and the result (and so the
running stats) is bit-identical everywhere. The output normalizes the (shifted)
input, so no large mean is ever subtracted in working precision. A communicator of
one rank (or none) has nothing to merge: its own statistics are used as they are.

Backward. The local sums ``Σdy`` and ``Σdy·x̂`` (2C values) are all_reduced and
divided by the global count: ``dx = w·invstd·(dy - mean(dy) - x̂·mean(dy·x̂))``.
At one rank the local sums are the global ones, and torch's own training-mode
backward kernel computes exactly that (one reduction, one elementwise pass).
``grad_weight``/``grad_bias`` stay local (data-parallel training sums them over
ranks, like every other parameter gradient).

On CUDA no value is read back to the host: counts are device tensors after the
collective and the empty-batch case is handled with ``torch.where``. On CPU the
far-from-zero test reads one flag (free there).
"""

from __future__ import annotations

from typing import Any

import torch

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
    return torch.batch_norm(x, scale, shift, center, ones, False, 0.0, 0.0, torch.backends.cudnn.enabled)


#: A channel counts as "far from zero" when its |mean| exceeds FAR standard deviations: then
#: ``x`` is shifted before its statistics are taken and before it is normalized (below FAR,
#: normalizing ``x`` itself loses at most a few ulps more than the shifted form).
FAR = 3.0


def _fused_sums(x: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σx, Σx²)`` per channel in ONE pass over ``x`` (``like``: a per-channel tensor of the
    statistics' dtype): torch's inference batch-norm backward with grad_output = input = x,
    mean 0, var 1, eps 0 returns exactly those as grad_bias and grad_weight (3-5x faster on
    CPU than torch's two-pass statistics kernel)."""
    zeros, ones = torch.zeros_like(like), torch.ones_like(like)
    _, sum_squares, sums = inference_backward(x, x, ones, zeros, ones, 0.0, [False, True, True])
    return sums, sum_squares


def inference_backward(grad_output: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None,
                       mean: torch.Tensor, var: torch.Tensor, eps: float,
                       mask: list[bool]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """torch's inference-mode batch-norm backward around ``mean``/``var``: ``(grad_input,
    Σdy·(x - mean)/sqrt(var + eps), Σdy)`` per channel, the parts ``mask`` asks for.

    The saved-statistics arguments are empty tensors, not None: CUDA's kernel asserts that they
    are defined (an empty one tells it to use ``mean``/``var``); CPU's ignores them here.
    """
    empty = mean.new_empty(0)
    result: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = torch.ops.aten.native_batch_norm_backward(
        grad_output, x, weight, mean, var, empty, empty, False, eps, mask)
    return result


def _far(mean: torch.Tensor, var: torch.Tensor, min_var: float | None = None) -> bool:
    """Whether some channel is far from zero (``|mean| > FAR·sqrt(var)``), or, with
    ``min_var``, has a variance below it."""
    far = mean * mean > (FAR * FAR) * var
    return bool((far if min_var is None else far | (var < min_var)).any())


def _channels_last_like(x: torch.Tensor) -> bool:
    """``(N, C)`` input or channels_last(_3d) memory: where torch's CPU batch-norm forward
    kernel computes statistics and output in fewer passes than ours can."""
    if x.dim() == 2:
        return True
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return x.dim() in formats and not x.is_contiguous() and x.is_contiguous(memory_format=formats[x.dim()])


def _moments(sums: torch.Tensor, sum_squares: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    mean = sums.double() / count
    return mean, sum_squares.double() / count - mean * mean


def local_moments(x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's ``(count, K, mean, var, x - K)``: the per-channel count, shift, mean and biased
    variance (float64 mean/var) of ``x - K``, and ``x - K`` itself.

    ``K`` is a per-channel shift and ``mean``/``var`` are the mean and biased variance of
    ``x - K``. On CPU, float32/float64 input is summed as it is first (one fused pass, no
    copy); only if some channel is far from zero (|mean| > :data:`FAR` standard deviations,
    where Σx² - (Σx)²/n would cancel) is it shifted by one sample per channel (``x - K`` is
    exact for data far from zero: 1e4 + N(0, 1) in float32 keeps every bit) and summed
    again. On other devices it is always shifted (deciding would read a value back to the
    host). fp16/bf16 input is never shifted (``K = 0``): float32 statistics of it are
    already far more precise than the input. An empty ``x`` gives a row of zeros (it adds
    nothing to the merge) and itself.
    """
    channels = x.shape[1]
    count = x.numel() // channels if channels else 0
    stat = _stat_dtype(x)
    if count == 0:
        zeros = torch.zeros(channels, dtype=torch.float64, device=x.device)
        return 0, zeros, zeros, zeros, x
    if x.dtype == stat:
        shift = torch.zeros(channels, dtype=stat, device=x.device)
        shifted = x
        if x.device.type == "cpu":
            mean, var = _moments(*_fused_sums(x, shift), count)
            far = _far(mean, var)
        else:
            far = True
        if far:
            # A contiguous copy: torch's CPU batch-norm kernels take a 5-10x slower path
            # when a per-channel tensor is a strided view.
            shift = x[(0, slice(None)) + (0,) * (x.dim() - 2)].to(stat, copy=True)
            shifted = _affine(x, shift, None, None)
            mean, var = _moments(*_fused_sums(shifted, shift), count)
        var = var.clamp(min=0.0)
    else:
        # fp16/bf16: x - K would round to x's precision, and float32 statistics of x itself
        # are already far more precise than x; float32 buffers make torch accumulate and
        # return float32 (it updates them with momentum 0: they are scratch).
        shift = torch.zeros(channels, dtype=stat, device=x.device)
        shifted = x
        mean, var = torch.batch_norm_update_stats(x, torch.zeros_like(shift), torch.ones_like(shift), 0.0)
    return count, shift, mean.double(), var.double(), shifted


def local_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``[count, K, mean, var]`` row (float64, length 1 + 3C) for the merge, and
    ``x - K`` (see :func:`local_moments`)."""
    count, shift, mean, var, shifted = local_moments(x)
    return _row(count, shift, mean, var), shifted


def _row(count: int, shift: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """The ``[count, K, mean, var]`` row of :func:`local_stats` (float64)."""
    counts = torch.full((1,), float(count), dtype=torch.float64, device=mean.device)
    return torch.cat([counts, shift.double(), mean, var])


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
                    total: int | torch.Tensor, mean: torch.Tensor, m2: torch.Tensor) -> None:
    """torch's running-stat update with the global unbiased variance.

    ``total``: the global count, a 0-d tensor after a merge (no host read) or an int.
    A globally empty batch changes nothing (not even ``num_batches_tracked``).
    ``momentum=None`` is the cumulative average 1/num_batches_tracked.
    """
    nonempty: torch.Tensor | None = None
    if isinstance(total, int):
        if total == 0:
            return
        unbiased = m2 / max(total - 1, 1)
    else:
        nonempty = total > 0
        unbiased = m2 / (total - 1.0).clamp(min=1.0)
    if num_batches_tracked is not None:
        num_batches_tracked.add_(1 if nonempty is None else nonempty.to(num_batches_tracked.dtype))
    factor: float | torch.Tensor
    if momentum is None:
        if num_batches_tracked is None:
            return
        factor = 1.0 / num_batches_tracked.clamp(min=1).to(torch.float64)
    else:
        factor = float(momentum)
    for buffer, value in ((running_mean, mean), (running_var, unbiased)):
        old = buffer.to(torch.float64)
        new = (1.0 - factor) * old + factor * value
        buffer.copy_(new if nonempty is None else torch.where(nonempty, new, old))


def _forward_alone_by_torch(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                            bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                            running_var: torch.Tensor | None, num_batches_tracked: torch.Tensor | None,
                            momentum: float | None, eps: float) -> torch.Tensor | None:
    """One rank, CPU, a channels-last-like float32/64 ``x``: torch's own training forward
    kernel (statistics and output in its fused passes). Its output is kept unless some
    channel is far from zero or has a variance below ``eps`` (there its ``x·a + b`` form and
    a variance recovered from ``invstd`` would lose digits); then ``None``: the caller takes
    the shifted path."""
    y, mean, invstd = torch.native_batch_norm(x, weight, bias, None, None, True, 0.0, eps)
    var = invstd.double().pow(-2) - eps
    if _far(mean.double(), var, min_var=eps):
        return None
    count = x.numel() // x.shape[1]
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            _update_running(running_mean, running_var, num_batches_tracked, momentum,
                            count, mean.double(), var * count)
    ctx.save_for_backward(x, weight, mean, None, invstd, None)
    ctx.count = count
    return y


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
        alone = comm is None or comm.size == 1
        ctx.eps = eps
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.comm = None if alone else comm
        if alone and x.dtype == stat and x.device.type == "cpu" and _channels_last_like(x) and x.numel():
            y = _forward_alone_by_torch(ctx, x, weight, bias, running_mean, running_var,
                                        num_batches_tracked, momentum, eps)
            if y is not None:
                return y
        count, shift, local_mean, local_var, shifted = local_moments(x)
        total: int | torch.Tensor
        if alone:  # this rank's statistics are the global ones: nothing to merge
            total, center, var = count, local_mean.to(stat), local_var.to(stat)
        else:
            assert comm is not None  # for the type checker: not alone
            rows = comm.all_gather(_row(count, shift, local_mean, local_var))
            total, mean, m2, shifts = merge_stats(rows)
            # The global mean relative to this rank's shift: small, so exact in working precision.
            center = (mean - shifts[comm.rank]).to(stat)
            var = (m2 / total.clamp(min=1.0)).to(stat)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None and running_var is not None:
            if alone:
                mean, m2 = shift.double() + local_mean, local_var * count
            with torch.no_grad():
                _update_running(running_mean, running_var, num_batches_tracked, momentum,
                                total, mean, m2)
        if x.numel() == 0:
            y = torch.empty_like(x)
        else:
            y = torch.batch_norm(shifted, weight, bias, center, var, False, 0.0, eps, torch.backends.cudnn.enabled)
        ctx.save_for_backward(shifted, weight, center, var, invstd,
                              None if isinstance(total, int) else total)
        ctx.count = count
        return y

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        shifted, weight, center, var, invstd, total = ctx.saved_tensors
        comm, bias_dtype = ctx.comm, ctx.bias_dtype
        if comm is None and ctx.count > 0:
            # One rank: its sums are the global ones, so torch's training-mode backward
            # (one reduction pass, one elementwise pass) is exactly ours, on x - K.
            grad_input, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
                grad_output, shifted, weight, None, None, center, invstd, True, ctx.eps,
                list(ctx.needs_input_grad[:3]))
            return grad_input, grad_weight, grad_bias, None, None, None, None, None, None
        channels = center.shape[0]
        ones = torch.ones_like(center)
        if shifted.numel() == 0:
            sum_dy = torch.zeros_like(center)
            sum_dy_xhat = torch.zeros_like(center)
        else:
            # One fused pass for both sums: inference-mode backward computes exactly
            # grad_bias = Σdy and grad_weight = Σdy·(x - center)·invstd.
            _, sum_dy_xhat, sum_dy = inference_backward(grad_output, shifted, ones, center, var, ctx.eps,
                                                        [False, True, True])
        grad_input = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat])
            if comm is not None and comm.size > 1:
                comm.all_reduce(sums, "sum")
            sums = sums / (max(ctx.count, 1) if total is None else total.to(sums.dtype).clamp(min=1.0))
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
