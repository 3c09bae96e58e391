"""SyncBatchNorm's accuracy at one rank, on every route its CPU forward takes.

At one rank (and on CPU) SyncBatchNorm chooses how to compute (syncbn/function.py):
torch's own fused kernel for channels-last-like input near zero, its own fused sums for
other layouts near zero, and the shifted path (``x - K``, one sample per channel) where a
channel is far from zero (|mean| > FAR standard deviations) or, on torch's route, has a
variance below eps. Every route is checked here against torch's BatchNorm in float64 on
the same float32 data, next to torch's own float32 BatchNorm on it:

- data far from zero (1e4 + N(0, 1)): our output at least 100x closer to float64 than
  torch's, our input gradient at least 10x closer (issue 12 keeps this promise while making
  the layer faster);
- ordinary data (N(0, 1), post-ReLU, a mean of 2.5 standard deviations): no more than a few
  times torch's own error;
- one far channel among near ones, and a channel of variance far below eps: the running
  statistics too match float64.
"""

from __future__ import annotations

import pytest
import torch
from collectives.backends.local import LocalCommunicator
from collectives.syncbn import function as sbf

from collectives import syncbn

LAYERS = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}
CASES = [  # (shape, memory format)
    ((64, 32), torch.contiguous_format),
    ((6, 16, 40), torch.contiguous_format),
    ((6, 16, 12, 10), torch.contiguous_format),
    ((6, 16, 12, 10), torch.channels_last),
    ((4, 8, 3, 6, 5), torch.contiguous_format),
    ((4, 8, 3, 6, 5), torch.channels_last_3d),
]
IDS = [f"{'x'.join(map(str, s))}-{str(f).split('.')[-1]}" for s, f in CASES]


def _data(shape: tuple[int, ...], kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return {"far": 1e4 + x, "normal": x, "relu": x.relu(), "mean2.5": 2.5 + x}[kind]


def _run(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two training steps (the running stats move twice); the second step's output and
    gradients, and the running stats after it, in float64."""
    for _ in range(2):
        module.zero_grad(set_to_none=True)
        xin = x.clone().requires_grad_()
        y = module(xin)
        y.backward(dy)
    return {"y": y.detach().double(), "dx": xin.grad.double(), "dw": module.weight.grad.double(),
            "running_mean": module.running_mean.double(), "running_var": module.running_var.double()}


def _compare(shape, memory_format, kind, seed=0):
    x64 = _data(shape, kind, seed)
    x32 = x64.float().contiguous(memory_format=memory_format)
    x64 = x32.double().contiguous(memory_format=memory_format)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(seed + 1)).contiguous(memory_format=memory_format)
    channels = shape[1]
    layer = LAYERS[len(shape)]
    want = _run(layer(channels).double(), x64, dy.double())
    torch32 = _run(layer(channels), x32, dy)
    ours = _run(syncbn.SyncBatchNorm(channels, comm=LocalCommunicator()), x32, dy)
    error = {name: {key: (got[key] - want[key]).abs().max().item() for key in want}
             for name, got in (("torch", torch32), ("ours", ours))}
    return want, ours, error


@pytest.mark.parametrize("shape,memory_format", CASES, ids=IDS)
def test_far_from_zero_is_far_closer_to_float64_than_torch(shape, memory_format):
    _, ours, error = _compare(shape, memory_format, "far")
    assert ours["y"].is_contiguous(memory_format=memory_format)
    assert error["ours"]["y"] * 100 <= error["torch"]["y"], error
    assert error["ours"]["dx"] * 10 <= error["torch"]["dx"], error


@pytest.mark.parametrize("kind", ["normal", "relu", "mean2.5"])
@pytest.mark.parametrize("shape,memory_format", CASES, ids=IDS)
def test_ordinary_data_is_as_close_as_torch(shape, memory_format, kind):
    _, _, error = _compare(shape, memory_format, kind)
    for key in ("y", "dx", "dw", "running_mean", "running_var"):
        assert error["ours"][key] <= 10 * error["torch"][key] + 1e-6, (key, error)


@pytest.mark.parametrize("shape,memory_format", CASES, ids=IDS)
def test_one_far_channel_and_a_tiny_variance_take_the_exact_path(shape, memory_format):
    """Channel 0 far from zero, channel 1 of variance 1e-12 (far below eps), the rest
    ordinary: every channel, and the running stats, match float64."""
    x64 = _data(shape, "normal", 5)
    x64[:, 0] += 1e4
    x64[:, 1] = 0.5 + 1e-6 * x64[:, 1]
    x32 = x64.float().contiguous(memory_format=memory_format)
    x64 = x32.double()
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(6)).contiguous(memory_format=memory_format)
    want = _run(LAYERS[len(shape)](shape[1]).double(), x64, dy.double())
    ours = _run(syncbn.SyncBatchNorm(shape[1], comm=LocalCommunicator()), x32, dy)
    torch.testing.assert_close(ours["y"], want["y"], rtol=0, atol=2e-5)
    torch.testing.assert_close(ours["dx"], want["dx"], rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(ours["running_mean"], want["running_mean"], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours["running_var"], want["running_var"], rtol=1e-4, atol=1e-12)


def test_the_routes_are_the_ones_described():
    """The route rules themselves (a test of the tests above: each route is reached)."""
    x = torch.randn(8, 4, 5, 5)
    assert sbf._channels_last_like(torch.randn(8, 4))
    assert sbf._channels_last_like(x.contiguous(memory_format=torch.channels_last))
    assert not sbf._channels_last_like(x)
    assert not sbf._channels_last_like(torch.randn(8, 4, 7))
    mean, var = torch.tensor([0.0, 3.5]), torch.tensor([1.0, 1.0])
    assert sbf._far(mean, var) and not sbf._far(mean[:1], var[:1])
    count, shift, *_ = sbf.local_moments(x + 1e4)
    assert count == 200 and (shift != 0).all()  # shifted
    count, shift, *_ = sbf.local_moments(x)
    assert (shift == 0).all()  # summed as it is
