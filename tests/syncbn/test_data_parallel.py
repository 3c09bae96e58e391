"""DataParallel: gradients equal the average of every rank's gradient, and equal torch DDP.

References are computed independently: in the test process, with plain torch in
float64 on each rank's data (gradients of the same model, averaged by hand), or
with torch's own DistributedDataParallel over Gloo in the same ranks.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from collectives.backends.local import LocalCommunicator
from collectives.syncbn.data_parallel import DataParallel
from torch import nn

# -- models and data, built identically in the ranks and in the test process ----------------


class TwoHeads(nn.Module):
    """A trunk and three heads; ``head`` picks which head a forward uses."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 5)
        self.head_a = nn.Linear(5, 3)
        self.head_b = nn.Linear(5, 3)
        self.head_never = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, head: str = "a") -> torch.Tensor:
        return getattr(self, f"head_{head}")(torch.tanh(self.trunk(x)))


def make_two_heads(seed: int) -> TwoHeads:
    torch.manual_seed(seed)
    return TwoHeads().double()


def batch(seed: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 6, generator=g, dtype=torch.float64),
            torch.randn(n, 3, generator=g, dtype=torch.float64))


def local_grads(model: nn.Module, pieces: list[tuple[torch.Tensor, torch.Tensor, str]]) -> dict:
    """Gradients of sum-over-pieces of MSE on an undistributed copy (None for unused)."""
    model = copy.deepcopy(model)
    for x, y, head in pieces:
        nn.functional.mse_loss(model(x, head), y).backward()
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def grads_of(model: nn.Module) -> dict:
    """As numpy: torch tensors in a pool's results would travel as shared-memory handles."""
    return {name: None if p.grad is None else p.grad.numpy().copy()
            for name, p in model.named_parameters()}


def params_of(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


# -- jobs (run on every rank) ----------------------------------------------------------------


def unused_parameter_job(comm, steps):
    """Rank 0 uses head a, the others head b, nobody head_never; tiny buckets."""
    model = DataParallel(make_two_heads(seed=100 + comm.rank), comm, bucket_cap_mb=1e-4)
    head = "a" if comm.rank == 0 else "b"
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        x, y = batch(1000 * step + comm.rank)
        nn.functional.mse_loss(model(x, head), y).backward()
        out.append(grads_of(model.module))
    return {"grads": out, "buckets": model.bucket_sizes}


def accumulate_without_zero_grad_job(comm, steps, as_view):
    """No zero_grad: gradients pile up (in the bucket views with ``as_view``). Step 0 every rank
    uses head_never, later steps rank 0 head a and the others head b (head_never then unused
    everywhere)."""
    model = DataParallel(make_two_heads(seed=100 + comm.rank), comm, bucket_cap_mb=1e-4,
                         gradient_as_bucket_view=as_view)
    out = []
    for step in range(steps):
        head = "never" if step == 0 else "a" if comm.rank == 0 else "b"
        x, y = batch(1000 * step + comm.rank)
        nn.functional.mse_loss(model(x, head), y).backward()
        out.append(grads_of(model.module))
    return out


def no_sync_accumulates_job(comm, micro_steps):
    model = DataParallel(make_two_heads(seed=7 + comm.rank), comm)
    with model.no_sync():
        for i in range(micro_steps - 1):
            x, y = batch(100 * comm.rank + i)
            nn.functional.mse_loss(model(x), y).backward()
    local = grads_of(model.module)
    x, y = batch(100 * comm.rank + micro_steps - 1)
    nn.functional.mse_loss(model(x), y).backward()
    return {"local": local, "synced": grads_of(model.module)}


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8 * 4 * 4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def versus_ddp_job(comm, steps):
    """DataParallel and torch DDP (Gloo), same start (per-rank random, then rank 0's), same data."""
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415  (test only)

    torch.manual_seed(comm.rank)  # different on every rank: the broadcast must fix that
    base = ConvNet()
    ours = DataParallel(copy.deepcopy(base), comm, bucket_cap_mb=0.002, broadcast_buffers=True)
    theirs = DistributedDataParallel(copy.deepcopy(base))  # buffers broadcast (torch's default; 2.15 renames the flag)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    g = torch.Generator().manual_seed(1234 + comm.rank)
    for _ in range(steps):
        x = torch.randn(6, 2, 6, 6, generator=g)
        y = torch.randint(0, 5, (6,), generator=g)
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    diff_params = max((a - b).abs().max().item() for a, b in
                      zip(ours.module.parameters(), theirs.module.parameters()))
    diff_buffers = max((a.double() - b.double()).abs().max().item() for a, b in
                       zip(ours.module.buffers(), theirs.module.buffers()))
    moved = max((a - b).abs().max().item() for a, b in
                zip(ours.module.parameters(), base.parameters()))
    return {"params": diff_params, "buffers": diff_buffers, "moved": moved,
            "buckets": len(ours.bucket_sizes),
            "first": params_of(ours.module)}


def broadcast_job(comm):
    model = DataParallel(make_two_heads(seed=comm.rank), comm)
    return params_of(model.module)


# -- tests -------------------------------------------------------------------------------------

WORLDS = [("mpi", 2), ("torch", 3)]


@pytest.mark.parametrize("world", WORLDS, indirect=True)
def test_construction_broadcasts_rank0_parameters(world):
    results = world.run(broadcast_job, timeout=60)
    expected = list(make_two_heads(seed=0).parameters())
    for rank_params in results:
        for got, want in zip(rank_params, expected):
            np.testing.assert_array_equal(got, want.detach().numpy())


@pytest.mark.parametrize("world", WORLDS, indirect=True)
def test_unused_parameters_reduce_without_hanging(world):
    steps = 2
    results = world.run(unused_parameter_job, args=(steps,), timeout=60)
    assert len(results[0]["buckets"]) > 1, "tiny buckets: several collectives per step"
    start = make_two_heads(seed=100)  # rank 0's, broadcast to all
    for step in range(steps):
        per_rank = [local_grads(start, [(*batch(1000 * step + r), "a" if r == 0 else "b")])
                    for r in range(world.size)]
        for name, _ in start.named_parameters():
            got = [results[r]["grads"][step][name] for r in range(world.size)]
            if name.startswith("head_never"):
                assert all(g is None for g in got), f"{name}: unused everywhere, grad stays None"
                continue
            want = sum(torch.zeros_like(dict(start.named_parameters())[name]) if g[name] is None
                       else g[name] for g in per_rank) / world.size
            for g in got:
                np.testing.assert_allclose(g, want.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("as_view", [True, False], ids=["views", "copies"])
@pytest.mark.parametrize("world", WORLDS, indirect=True)
def test_gradients_accumulate_in_the_bucket_views_across_steps(world, as_view):
    # grad kept between steps is the bucket's view, accumulated into in place; a parameter
    # nobody uses in a step keeps its value although its slot in the bucket is zeroed. The
    # rule (module docs): a rank that used a parameter in this backward contributes its
    # accumulated grad, one that did not contributes zeros; the sum is divided by size.
    steps = 3
    results = world.run(accumulate_without_zero_grad_job, args=(steps, as_view), timeout=60)
    start = make_two_heads(seed=100)
    params = dict(start.named_parameters())
    want = {name: None for name in params}
    for step in range(steps):
        heads = ["never" if step == 0 else "a" if r == 0 else "b" for r in range(world.size)]
        per_rank = [local_grads(start, [(*batch(1000 * step + r), heads[r])]) for r in range(world.size)]
        for name, p in params.items():
            users = [g[name] for g in per_rank if g[name] is not None]
            if not users:
                continue  # unused everywhere this step: grad stays as it was
            kept = torch.zeros_like(p) if want[name] is None else want[name]
            want[name] = sum(kept + g for g in users) / world.size
        for r in range(world.size):
            for name, g in results[r][step].items():
                if want[name] is None:
                    assert g is None, (step, name)
                else:
                    np.testing.assert_allclose(g, want[name].numpy(), rtol=1e-12, atol=1e-12,
                                               err_msg=f"step {step} {name}")


def test_gradients_are_bucket_views_unless_asked_for_copies():
    x, y = batch(5)
    shared = DataParallel(make_two_heads(3), LocalCommunicator(), gradient_as_bucket_view=True)
    nn.functional.mse_loss(shared(x), y).backward()
    storages = {p.grad.untyped_storage().data_ptr() for p in shared.parameters() if p.grad is not None}
    assert len(shared.bucket_sizes) == 1 and len(storages) == 1, "every grad lives in the one bucket"
    own = DataParallel(make_two_heads(3), LocalCommunicator())  # the default, as in DDP
    nn.functional.mse_loss(own(x), y).backward()
    kept = {name: p.grad for name, p in own.named_parameters() if p.grad is not None}
    first = {name: g.clone() for name, g in kept.items()}
    own.zero_grad(set_to_none=True)
    nn.functional.mse_loss(own(batch(6)[0]), y).backward()
    for name, g in kept.items():
        assert torch.equal(g, first[name]), f"{name}: a kept grad is its own tensor"
    assert len({g.untyped_storage().data_ptr() for g in kept.values()}) == len(kept)


@pytest.mark.parametrize("world", WORLDS, indirect=True)
def test_no_sync_accumulates_locally_then_reduces_the_sum(world):
    micro = 3
    results = world.run(no_sync_accumulates_job, args=(micro,), timeout=60)
    start = make_two_heads(seed=7)
    pieces = [[(*batch(100 * r + i), "a") for i in range(micro)] for r in range(world.size)]
    for r in range(world.size):
        local = local_grads(start, pieces[r][:-1])
        for name, g in results[r]["local"].items():
            if local[name] is None:
                assert g is None
            else:
                np.testing.assert_allclose(g, local[name].numpy(), rtol=1e-12, atol=1e-12)
    full = [local_grads(start, pieces[r]) for r in range(world.size)]
    for name, _ in start.named_parameters():
        if full[0][name] is None:
            continue
        want = sum(f[name] for f in full) / world.size
        for r in range(world.size):
            np.testing.assert_allclose(results[r]["synced"][name], want.numpy(), rtol=1e-12,
                                       atol=1e-12)


@pytest.mark.parametrize("world", [("torch", 2), ("torch", 3)], indirect=True)
def test_matches_torch_ddp_over_10_steps(world):
    results = world.run(versus_ddp_job, args=(10,), timeout=90)
    for r in results:
        assert r["buckets"] > 1
        assert r["moved"] > 1e-2, "training moved the parameters"
        assert r["params"] <= 1e-6, r
        assert r["buffers"] <= 1e-6, r
    for p0, p in zip(results[0]["first"], results[-1]["first"]):
        np.testing.assert_array_equal(p, p0)


def test_bad_arguments_raise_before_communicating():
    comm = LocalCommunicator()
    model = make_two_heads(0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match="module"):
        DataParallel("not a module", comm)
    with pytest.raises(TypeError, match="comm"):
        DataParallel(model, comm="mpi")
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DataParallel(model, comm, bucket_cap_mb=0)
    with pytest.raises(ValueError, match="grad_reduction.*mean, sum"):
        DataParallel(model, comm, grad_reduction="avg")
    for flag in ("broadcast_buffers", "gradient_as_bucket_view"):
        with pytest.raises(TypeError, match=f"{flag} must be True or False"):
            DataParallel(model, comm, **{flag: "yes"})
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


def test_sum_reduction_and_finish_on_one_rank():
    model = DataParallel(make_two_heads(3), LocalCommunicator(), grad_reduction="sum")
    x, y = batch(5)
    nn.functional.mse_loss(model(x), y).backward()
    model.finish()  # idempotent after the automatic finish
    want = local_grads(make_two_heads(3), [(x, y, "a")])
    for name, g in grads_of(model.module).items():
        if want[name] is None:
            assert g is None
        else:
            np.testing.assert_allclose(g, want[name].numpy(), rtol=1e-12, atol=1e-12)
