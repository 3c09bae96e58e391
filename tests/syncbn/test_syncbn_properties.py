"""SyncBatchNorm, property-tested: any shape, channel count, per-rank batch split (empty ranks
included) and data scale matches plain torch BatchNorm on the concatenated batch (float64).

Hypothesis draws the case (dims, channels, spatial sizes, every rank's batch size, scale,
offset and a seed for the data) in the test process; the data comes from numpy with that
seed. Tolerances (float32 SyncBatchNorm): output and running stats rtol = atol = 1e-5,
gradients rtol 1e-4, atol 1e-5 (parameter gradients summed over ranks, as data
parallelism does).
"""
import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from collectives import syncbn

WORLDS = [("mpi", 2), ("torch", 3), ("mpi", 4)]
TOL = {"y": (1e-5, 1e-5), "grad": (1e-4, 1e-5), "stats": (1e-5, 1e-5)}


def syncbn_job(comm, x, grad_out, weight, bias):
    module = syncbn.SyncBatchNorm(x.shape[1], comm=comm)
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(weight))
        module.bias.copy_(torch.from_numpy(bias))
    xt = torch.from_numpy(x).requires_grad_(True)
    y = module(xt)
    y.backward(torch.from_numpy(grad_out))
    return {"y": y.detach().numpy(), "grad_x": xt.grad.numpy(), "grad_w": module.weight.grad.numpy(),
            "grad_b": module.bias.grad.numpy(), "mean": module.running_mean.numpy(),
            "var": module.running_var.numpy()}


@st.composite
def cases(draw, size):
    ndim = draw(st.integers(2, 5), label="ndim")
    channels = draw(st.integers(1, 4), label="channels")
    spatial = tuple(draw(st.lists(st.integers(1, 3), min_size=ndim - 2, max_size=ndim - 2)))
    batches = draw(st.lists(st.integers(0, 3), min_size=size, max_size=size), label="batch per rank")
    assume(sum(batches) * int(np.prod(spatial)) >= 2)  # BatchNorm needs 2 values per channel
    scale = draw(st.sampled_from([1e-2, 1.0, 1e2]), label="scale")
    offset = draw(st.sampled_from([0.0, 3.0]), label="offset (in scales)") * scale
    seed = draw(st.integers(0, 2**16), label="seed")
    return channels, spatial, batches, scale, offset, seed


def _reference(x, grad_out, weight, bias):
    cls = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}
    module = cls[x.ndim](x.shape[1]).double()
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(weight))
        module.bias.copy_(torch.from_numpy(bias))
    xt = torch.from_numpy(x).double().requires_grad_(True)
    y = module(xt)
    y.backward(torch.from_numpy(grad_out).double())
    return {"y": y.detach().numpy(), "grad_x": xt.grad.numpy(), "grad_w": module.weight.grad.numpy(),
            "grad_b": module.bias.grad.numpy(), "mean": module.running_mean.numpy(),
            "var": module.running_var.numpy()}


@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=[f"{b}-{s}" for b, s in WORLDS])
@given(data=st.data())
def test_syncbn_matches_batchnorm_on_the_concatenated_batch(world, data):
    channels, spatial, batches, scale, offset, seed = data.draw(cases(world.size))
    rng = np.random.default_rng(seed)
    xs = [(offset + scale * rng.standard_normal((n, channels, *spatial))).astype(np.float32) for n in batches]
    gs = [rng.standard_normal((n, channels, *spatial)).astype(np.float32) for n in batches]
    weight = rng.uniform(0.5, 2.0, channels).astype(np.float32)
    bias = rng.standard_normal(channels).astype(np.float32)
    results = world.run(syncbn_job, [(x, g, weight, bias) for x, g in zip(xs, gs)], timeout=120)
    want = _reference(np.concatenate(xs), np.concatenate(gs), weight, bias)
    starts = np.cumsum([0, *batches])
    for rank, got in enumerate(results):
        rows = slice(starts[rank], starts[rank + 1])
        for key, kind in (("y", "y"), ("grad_x", "grad")):
            rtol, atol = TOL[kind]
            np.testing.assert_allclose(got[key], want[key][rows], rtol, atol, err_msg=f"rank {rank} {key}")
        for key in ("mean", "var"):  # identical on every rank
            np.testing.assert_allclose(got[key], want[key], *TOL["stats"], err_msg=f"rank {rank} {key}")
    # Parameter gradients are each rank's share (data parallelism sums them, as with
    # torch.nn.SyncBatchNorm): their sum over ranks is the full batch's gradient.
    for key in ("grad_w", "grad_b"):
        total = np.sum([got[key].astype(np.float64) for got in results], axis=0)
        np.testing.assert_allclose(total, want[key], *TOL["grad"], err_msg=f"sum over ranks of {key}")
