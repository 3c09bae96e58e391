"""convert_sync_batchnorm keeps what a batch-norm subclass does beyond normalizing.

The subclass here is timm's BatchNormAct2d in miniature (batch norm, dropout, activation in
its own forward, through torch.nn.functional.batch_norm). Reference: the same class,
unconverted, on one process over the concatenated batch, in float64.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from collectives.backends.local import LocalCommunicator
from torch import nn

from collectives import syncbn
from collectives.testing.pool import get_pool


class BatchNormAct2d(nn.BatchNorm2d):
    """Batch norm, then dropout, then an activation, in one module (as timm's)."""

    def __init__(self, num_features: int, momentum: float | None = 0.1, drop: float = 0.0) -> None:
        super().__init__(num_features, momentum=momentum)
        self.drop = nn.Dropout(drop) if drop else nn.Identity()
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        x = F.batch_norm(x, self.running_mean if not self.training or self.track_running_stats else None,
                         self.running_var if not self.training or self.track_running_stats else None,
                         self.weight, self.bias, bn_training, factor, self.eps)
        return self.act(self.drop(x))


class ScaledBatchNorm1d(nn.BatchNorm1d):
    """A subclass that adds to torch's forward by calling it (no forward of its own for the norm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(x)


class ManualNorm2d(nn.BatchNorm2d):
    """Normalizes without torch.nn.functional.batch_norm: it cannot be synchronized."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean((0, 2, 3), keepdim=True)
        var = x.var((0, 2, 3), unbiased=False, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps)


class Counted(syncbn.SyncBatchNorm):
    """A subclass of ours: it keeps its class."""

    def extra_repr(self) -> str:
        return "counted, " + super().extra_repr()


def _trained(module: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _ in range(3):
            module(torch.randn(6, 3, 4, 4, generator=g) * 2 + 1)
    return module


def test_a_batch_norm_with_an_activation_keeps_it_eval_output_unchanged():
    original = _trained(BatchNormAct2d(3), seed=0).eval()
    x = torch.randn(4, 3, 5, 5, generator=torch.Generator().manual_seed(1))
    want = original(x)
    converted = syncbn.convert_sync_batchnorm(copy.deepcopy(original), comm=LocalCommunicator())
    torch.testing.assert_close(converted(x), want, rtol=0, atol=0)
    model = nn.Sequential(nn.Linear(4, 5), ScaledBatchNorm1d(5))
    with torch.no_grad():
        model(torch.randn(8, 4) + 3)
    model.eval()
    x = torch.randn(2, 4)
    want = model(x)
    assert torch.equal(syncbn.convert_sync_batchnorm(model)(x), want)


def test_the_converted_class_is_both_and_reverts_to_the_original():
    original = BatchNormAct2d(3, drop=0.1)
    weight, running_var = original.weight, original.running_var
    comm = LocalCommunicator()
    converted = syncbn.convert_sync_batchnorm(nn.Sequential(original), comm=comm)[0]
    assert isinstance(converted, BatchNormAct2d) and isinstance(converted, syncbn.SyncBatchNorm)
    assert type(converted).__name__ == "SyncBatchNormAct2d" and converted.comm is comm
    assert converted.weight is weight and converted.running_var is running_var and converted.act is original.act
    assert list(converted.state_dict()) == list(original.state_dict())
    assert type(syncbn.convert_sync_batchnorm(converted)) is type(converted)  # converting again keeps it
    reverted = syncbn.revert_sync_batchnorm(nn.Sequential(converted))[0]
    assert type(reverted) is BatchNormAct2d and reverted.weight is weight and not hasattr(reverted, "_comm_ref")
    assert copy.deepcopy(converted).comm is comm
    restored = pickle.loads(pickle.dumps(converted))
    assert type(restored) is type(converted) and restored.comm is None
    assert torch.equal(restored.running_var, running_var)
    ours = Counted(3)
    assert type(syncbn.convert_sync_batchnorm(ours, comm=comm)) is Counted


def test_a_subclass_that_normalizes_by_other_means_is_refused_by_name():
    converted = syncbn.convert_sync_batchnorm(ManualNorm2d(3), comm=LocalCommunicator())
    converted.eval()
    converted(torch.randn(2, 3, 2, 2))  # nothing to synchronize in eval
    converted.train()
    with pytest.raises(TypeError, match="ManualNorm2d.forward normalized without calling torch.nn.functional"):
        converted(torch.randn(2, 3, 2, 2))


# -- in real ranks: trains as the original does on the concatenated batch ----------------------

def _batch(rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng([step, rank])
    shape = (rank + 2, 3, 4, 3)  # uneven batches
    return g.normal(1.0, 2.0, shape), g.normal(size=shape)


def subclass_train_job(comm: Any, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = syncbn.convert_sync_batchnorm(BatchNormAct2d(3, momentum=None).double(), comm=comm)
    out: dict[str, Any] = {"y": [], "dx": [], "dw": []}
    for step in range(steps):
        x_np, dy_np = _batch(comm.rank, step)
        x = torch.from_numpy(x_np).requires_grad_()
        module.zero_grad()
        y = module(x)
        y.backward(torch.from_numpy(dy_np))
        out["y"].append(y.detach().numpy())
        out["dx"].append(x.grad.numpy())
        out["dw"].append(module.weight.grad.numpy().copy())
    out["stats"] = {k: v.numpy() for k, v in module.state_dict().items()}
    return out


def test_the_synchronized_subclass_trains_like_the_original_on_the_concatenated_batch():
    size, steps = 3, 2
    results = get_pool("mpi", size).run(subclass_train_job, args=(steps,), timeout=120)
    torch.manual_seed(0)
    reference = BatchNormAct2d(3, momentum=None).double()
    for step in range(steps):
        batches = [_batch(rank, step) for rank in range(size)]
        x = torch.from_numpy(np.concatenate([b[0] for b in batches])).requires_grad_()
        reference.zero_grad()
        y = reference(x)
        y.backward(torch.from_numpy(np.concatenate([b[1] for b in batches])))
        bounds = np.cumsum([0] + [len(b[0]) for b in batches])
        dw = np.zeros(3)
        for rank, got in enumerate(results):
            rows = slice(bounds[rank], bounds[rank + 1])
            np.testing.assert_allclose(got["y"][step], y.detach().numpy()[rows], rtol=1e-10, atol=1e-10)
            np.testing.assert_allclose(got["dx"][step], x.grad.numpy()[rows], rtol=1e-10, atol=1e-10)
            dw += got["dw"][step]
        np.testing.assert_allclose(dw, reference.weight.grad.numpy(), rtol=1e-10, atol=1e-10)
    for got in results:
        for key, value in reference.state_dict().items():
            np.testing.assert_allclose(got["stats"][key], value.numpy(), rtol=1e-10, atol=1e-12, err_msg=key)
