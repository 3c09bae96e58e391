"""SyncBatchNorm against plain torch BatchNorm on one process over the concatenated batch (float64).

Ranks get their part of the batch as numpy arrays (float64, cast on the rank to
the dtype under test), run our SyncBatchNorm for several training steps and send back
outputs, input gradients, parameter gradients and running stats. The test
process computes the reference from the same data. Job functions live at module
level: the ranks import this file.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from collectives.backends.local import LocalCommunicator

import collectives
from collectives import Communicator, syncbn
from collectives.transport import Transport

# The key case runs on every world; the others on a sample. The matrix's last four
# worlds are the ones the rest of the file uses, so they stay warm (the session keeps 4).
MATRIX = [("local", 1), ("mpi", 1), ("torch", 1), ("mpi", 2), ("torch", 3),
          ("mpi", 3), ("torch", 2), ("mpi", 4), ("torch", 4)]
SAMPLE = [("mpi", 3), ("torch", 2)]
SUBGROUP = [("mpi", 4), ("torch", 4)]
JOB_TIMEOUT = 120

FP32 = {"y": (1e-5, 1e-5), "grad": (1e-4, 1e-5), "stats": (1e-5, 1e-6)}
FP64 = {"y": (1e-10, 1e-10), "grad": (1e-10, 1e-10), "stats": (1e-10, 1e-12)}
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64}
MEMORY_FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last,
                  "channels_last_3d": torch.channels_last_3d}


# -- on the ranks ---------------------------------------------------------------------------

class CountingTransport(Transport):
    """Wraps a real communicator's transport and counts the collectives that go through it."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner.rank, inner.size, inner.local_rank)
        self.inner = inner
        self.backend = inner.backend
        self.calls: list[str] = []

    @classmethod
    def from_launcher(cls, launch, *, timeout=None):  # pragma: no cover - never launched
        raise NotImplementedError

    def _all_reduce(self, r):
        self.calls.append("all_reduce")
        return self.inner._all_reduce(r)

    def _broadcast(self, r):
        self.calls.append("broadcast")
        return self.inner._broadcast(r)

    def _all_gather(self, r):
        self.calls.append("all_gather")
        return self.inner._all_gather(r)

    def _reduce_scatter(self, r):
        self.calls.append("reduce_scatter")
        return self.inner._reduce_scatter(r)

    def _send(self, r):
        self.calls.append("send")
        return self.inner._send(r)

    def _recv(self, r):
        self.calls.append("recv")
        return self.inner._recv(r)

    def _barrier(self):
        self.calls.append("barrier")
        self.inner._barrier()

    def _split(self, color, key):
        self.calls.append("split")
        return self.inner._split(color, key)


def CountingCommunicator(inner: Communicator) -> Communicator:
    """A communicator over ``inner``'s transport that counts its collectives (``.calls``)."""
    transport = CountingTransport(inner._transport)
    counting = Communicator(transport, timeout=inner.timeout or 0)
    counting.calls = transport.calls
    counting._checking = False  # SyncBatchNorm's collectives are counted, not the check before each
    return counting


def _numpy(t: torch.Tensor | None) -> np.ndarray | None:
    return None if t is None else t.detach().to(torch.float64).numpy()


def train_job(comm: Communicator, case: dict[str, Any], steps: list[tuple[np.ndarray, np.ndarray]],
              color: int | None = None) -> dict[str, Any]:
    """Train ``SyncBatchNorm`` for ``len(steps)`` steps on this rank's ``(x, dy)``; report everything.

    ``case``: ``C``, ``kwargs`` (module arguments), ``dtype``, ``memory_format``,
    ``weight``/``bias`` (initial values), ``comm`` ("explicit" or "default": None,
    i.e. collectives.init()), ``eval_x`` (an eval forward after training), ``color``
    (train over ``comm.split(color)``).
    """
    group = comm.split(color) if color is not None else comm
    counting = CountingCommunicator(group)
    dtype = TORCH_DTYPES[case.get("dtype", "float32")]
    memory_format = MEMORY_FORMATS[case.get("memory_format", "contiguous")]
    module_comm = None if case.get("comm") == "default" else counting
    module = syncbn.SyncBatchNorm(case["C"], comm=module_comm, **case.get("kwargs", {}))
    if module.affine and "weight" in case:
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(case["weight"]))
            module.bias.copy_(torch.from_numpy(case["bias"]))
    out: dict[str, Any] = {"y": [], "dx": [], "dw": [], "db": [], "calls": [], "formats": []}
    for x_np, dy_np in steps:
        x = torch.from_numpy(x_np).to(dtype).contiguous(memory_format=memory_format).requires_grad_()
        dy = torch.from_numpy(dy_np).to(dtype).contiguous(memory_format=memory_format)
        module.zero_grad()
        before = len(counting.calls)
        y = module(x)
        y.backward(dy)
        out["calls"].append(counting.calls[before:])
        out["y"].append(_numpy(y))
        out["dx"].append(_numpy(x.grad))
        out["formats"].append((str(y.dtype), str(x.grad.dtype),
                               y.is_contiguous(memory_format=memory_format),
                               x.grad.is_contiguous(memory_format=memory_format)))
        if module.affine:
            out["dw"].append(_numpy(module.weight.grad))
            out["db"].append(_numpy(module.bias.grad))
            out["param_dtype"] = str(module.weight.grad.dtype)
    out["running_mean"] = _numpy(module.running_mean)
    out["running_var"] = _numpy(module.running_var)
    nbt = module.num_batches_tracked
    out["num_batches_tracked"] = None if nbt is None else int(nbt)
    if "eval_x" in case:
        module.eval()
        before = len(counting.calls)
        with torch.no_grad():
            y_eval = module(torch.from_numpy(case["eval_x"]).to(dtype))
        out["eval_y"] = _numpy(y_eval)
        out["eval_calls"] = counting.calls[before:]
    if group is not comm:
        group.close()
    return out


def unsynced_job(comm: Communicator, C: int, x_np: np.ndarray) -> np.ndarray:
    """The negative control: plain torch.nn.BatchNorm2d on this rank's batch alone."""
    return _numpy(torch.nn.BatchNorm2d(C)(torch.from_numpy(x_np).float()))


# -- in the test process --------------------------------------------------------------------

def _reference_class(ndim: int) -> type[torch.nn.Module]:
    return {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d,
            5: torch.nn.BatchNorm3d}[ndim]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *S) -> (N*prod(S), C): one row per normalized element (for uneven spatial sizes)."""
    return x.movedim(1, -1).reshape(-1, x.shape[1])


def _unrows(rows: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    shape = (like.shape[0], *like.shape[2:], like.shape[1])
    return rows.reshape(shape).movedim(-1, 1)


def reference(case: dict[str, Any], steps: list[list[tuple[np.ndarray, np.ndarray]]]) -> dict[str, Any]:
    """Plain torch BatchNorm, float64, one process, over the concatenation of every rank's batch.

    ``steps[r][s]`` is rank r's ``(x, dy)`` at step s. With equal spatial sizes the
    ranks' batches are concatenated along N and fed to BatchNorm1d/2d/3d; otherwise
    every element becomes a row of a BatchNorm1d input (the same statistics).
    Inputs are first rounded to the case's dtype, as the ranks see them.
    Returns per step and rank ``y`` and ``dx``, per step ``dw``/``db``, and the final
    running stats (and the module, for an eval forward).
    """
    dtype = TORCH_DTYPES[case.get("dtype", "float32")]
    ranks, C = len(steps), case["C"]
    module = None
    out: dict[str, Any] = {"y": [], "dx": [], "dw": [], "db": []}
    for s in range(len(steps[0])):
        xs = [torch.from_numpy(steps[r][s][0]).to(dtype).double() for r in range(ranks)]
        dys = [torch.from_numpy(steps[r][s][1]).to(dtype).double() for r in range(ranks)]
        even = len({x.shape[2:] for x in xs}) == 1
        if module is None:
            cls = _reference_class(xs[0].dim()) if even else torch.nn.BatchNorm1d
            module = cls(C, **case.get("kwargs", {})).double()
            if module.affine and "weight" in case:
                with torch.no_grad():
                    module.weight.copy_(torch.from_numpy(case["weight"]))
                    module.bias.copy_(torch.from_numpy(case["bias"]))
        module.zero_grad()
        to_input = (lambda t: t) if even else _rows
        x = torch.cat([to_input(t) for t in xs]).requires_grad_()
        y = module(x)
        y.backward(torch.cat([to_input(t) for t in dys]))
        sizes = [len(to_input(t)) for t in xs]
        back = (lambda t, like: t) if even else _unrows
        out["y"].append([back(t, like) for t, like in zip(y.detach().split(sizes), xs)])
        out["dx"].append([back(t, like) for t, like in zip(x.grad.split(sizes), xs)])
        if module.affine:
            out["dw"].append(module.weight.grad.clone())
            out["db"].append(module.bias.grad.clone())
    out["module"] = module
    out["running_mean"] = module.running_mean
    out["running_var"] = module.running_var
    out["num_batches_tracked"] = None if module.num_batches_tracked is None else int(module.num_batches_tracked)
    return out


def _close(got: Any, want: torch.Tensor, tol: tuple[float, float], what: str) -> None:
    got_t = torch.as_tensor(got, dtype=torch.float64)
    torch.testing.assert_close(got_t, want.to(torch.float64), rtol=tol[0], atol=tol[1], msg=lambda m: f"{what}: {m}")


def check_against_reference(case: dict[str, Any], steps: list[list[tuple[np.ndarray, np.ndarray]]],
                            results: list[dict[str, Any]], tol: dict[str, tuple[float, float]] = FP32,
                            ranks: list[int] | None = None) -> dict[str, Any]:
    """Compare every rank's outputs, gradients and running stats with :func:`reference`.

    ``ranks``: which ranks of ``results`` form the group (default: all).
    """
    ranks = list(range(len(results))) if ranks is None else ranks
    results = [results[r] for r in ranks]
    want = reference(case, [steps[r] for r in ranks])
    for s in range(len(steps[0])):
        for r, got in zip(ranks, results):
            _close(got["y"][s], want["y"][s][ranks.index(r)], tol["y"], f"output, step {s}, rank {r}")
            _close(got["dx"][s], want["dx"][s][ranks.index(r)], tol["grad"], f"input grad, step {s}, rank {r}")
        if want["dw"]:
            # Each rank's parameter gradient covers its own batch: they sum to the reference.
            _close(sum(got["dw"][s] for got in results), want["dw"][s], tol["grad"], f"weight grad, step {s}")
            _close(sum(got["db"][s] for got in results), want["db"][s], tol["grad"], f"bias grad, step {s}")
    for name in ("running_mean", "running_var"):
        if want[name] is None:
            assert all(got[name] is None for got in results), name
            continue
        for got in results:
            _close(got[name], want[name], tol["stats"], name)
            # Bit-identical on every rank.
            np.testing.assert_array_equal(got[name], results[0][name], err_msg=name)
    assert [got["num_batches_tracked"] for got in results] == [want["num_batches_tracked"]] * len(results)
    return want


def make_steps(shapes: list[list[tuple[int, ...]]], seed: int, offset: float = 0.0, scale: float = 1.0,
               ) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """``steps[r][s] = (x, dy)`` with x of ``shapes[r][s]``: offset + scale * N(0, 1) per channel
    (channel c also gets c/2 added so channels differ), dy ~ N(0, 1)."""
    rng = np.random.default_rng(seed)
    steps = []
    for rank_shapes in shapes:
        rank_steps = []
        for shape in rank_shapes:
            channel = np.arange(shape[1], dtype=np.float64).reshape((1, -1) + (1,) * (len(shape) - 2))
            x = offset + channel / 2 + scale * rng.standard_normal(shape)
            rank_steps.append((x, rng.standard_normal(shape)))
        steps.append(rank_steps)
    return steps


def affine_case(C: int, seed: int = 1, **case: Any) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"C": C, "weight": rng.uniform(0.5, 1.5, C), "bias": rng.uniform(-1, 1, C), **case}


def run_case(world, case, steps, timeout=JOB_TIMEOUT, colors=None):
    per_rank = [(case, steps[r]) if colors is None else (case, steps[r], colors[r])
                for r in range(world.size)]
    return world.run(train_job, per_rank, timeout=timeout)


# -- the key case: every world ----------------------------------------------------------------

KEY_CASES = [
    # (name, case, shape of rank r's batch, steps)
    ("2d", affine_case(3, comm="default"), lambda r: (r + 2, 3, 5, 4), 3),
    ("1d-C2048", affine_case(2048), lambda r: (r + 2, 2048), 2),
    ("1d-L-C1", affine_case(1), lambda r: (r + 2, 1, 7), 2),
    ("3d", affine_case(2), lambda r: (r + 2, 2, 3, 4, 3), 2),
]


@pytest.mark.parametrize("world", MATRIX, indirect=True, ids=[f"{b}{n}" for b, n in MATRIX])
def test_uneven_batches_match_single_process_reference(world):
    """Rank r holds r+2 samples; 1d/2d/3d input, C=1 and C=2048, several steps, every backend."""
    for index, (name, case, shape, count) in enumerate(KEY_CASES):
        steps = make_steps([[shape(r)] * count for r in range(world.size)], seed=10 + index)
        results = run_case(world, case, steps)
        check_against_reference(case, steps, results)
        for got in results:  # one all_gather forward, one all_reduce backward (explicit comm)
            if case.get("comm") != "default":
                want = [["all_gather", "all_reduce"]] * count if world.size > 1 else [[]] * count
                assert got["calls"] == want, name


# -- sampled worlds -------------------------------------------------------------------------

@pytest.mark.parametrize("world", SAMPLE, indirect=True, ids=[f"{b}{n}" for b, n in SAMPLE])
def test_uneven_spatial_sizes_are_exact(world):
    case = affine_case(4)
    shapes = [[(r + 1, 4, 3 + r, 5 - r), (2, 4, 2 + 2 * r, 3)] for r in range(world.size)]
    steps = make_steps(shapes, seed=20)
    check_against_reference(case, steps, run_case(world, case, steps))


@pytest.mark.parametrize("world", SAMPLE, indirect=True, ids=[f"{b}{n}" for b, n in SAMPLE])
def test_an_empty_rank_takes_part_and_gets_empty_output(world):
    case = affine_case(3)
    shapes = [[(0 if r == 1 else r + 2, 3, 4, 4)] * 2 for r in range(world.size)]
    steps = make_steps(shapes, seed=21)
    results = run_case(world, case, steps)
    check_against_reference(case, steps, results)
    empty = results[1]
    assert empty["y"][0].shape == (0, 3, 4, 4) and empty["dx"][0].shape == (0, 3, 4, 4)
    np.testing.assert_array_equal(empty["dw"][0], 0.0)


@pytest.mark.parametrize("world", SAMPLE, indirect=True, ids=[f"{b}{n}" for b, n in SAMPLE])
def test_globally_empty_batch_gives_no_nan_and_keeps_running_stats(world):
    case = affine_case(3)
    steps = make_steps([[(0, 3, 4, 4)] for _ in range(world.size)], seed=22)
    for got in run_case(world, case, steps):
        assert got["y"][0].shape == (0, 3, 4, 4) and got["dx"][0].shape == (0, 3, 4, 4)
        np.testing.assert_array_equal(got["running_mean"], 0.0)
        np.testing.assert_array_equal(got["running_var"], 1.0)
        assert got["num_batches_tracked"] == 0
        np.testing.assert_array_equal(got["dw"][0], 0.0)
        np.testing.assert_array_equal(got["db"][0], 0.0)


@pytest.mark.parametrize("world", SAMPLE, indirect=True, ids=[f"{b}{n}" for b, n in SAMPLE])
def test_float32_data_far_from_zero_still_matches(world):
    """1e4 + N(0, 1) in float32: naive sums of squares would lose every digit of the variance."""
    case = affine_case(3)
    steps = make_steps([[(r + 2, 3, 6, 5)] * 2 for r in range(world.size)], seed=23, offset=1e4)
    check_against_reference(case, steps, run_case(world, case, steps))


@pytest.mark.parametrize("world", SAMPLE, indirect=True, ids=[f"{b}{n}" for b, n in SAMPLE])
def test_constant_channel_gives_beta_and_tiny_variance_matches(world):
    """Channel 0 is constant over every rank (output exactly beta, no NaN); channel 1 has
    variance 1e-10, far below eps, and still matches the reference."""
    case = affine_case(3)
    steps = make_steps([[(r + 2, 3, 4, 4)] * 2 for r in range(world.size)], seed=24)
    for rank_steps in steps:
        for x, _ in rank_steps:
            x[:, 0] = 0.75
            x[:, 1] = 2.0 + 1e-5 * (x[:, 1] - x[:, 1].mean())
    results = run_case(world, case, steps)
    check_against_reference(case, steps, results)
    for got in results:
        assert all(np.isfinite(a).all() for key in ("y", "dx", "dw", "db") for a in got[key])
        for y in got["y"]:
            np.testing.assert_array_equal(y[:, 0], np.float32(case["bias"][0]))


@pytest.mark.parametrize("world", [("mpi", 3)], indirect=True, ids=["mpi3"])
def test_negative_control_unsynchronized_batch_norm_differs(world):
    """Per-rank statistics (torch's BatchNorm2d on each rank, and our module over
    one-rank groups) do not match the reference: the comparison above can fail."""
    case = affine_case(3)
    steps = make_steps([[(r + 2, 3, 4, 4)] for r in range(world.size)], seed=25)
    want = reference(case, steps)
    alone = run_case(world, case, steps, colors=list(range(world.size)))
    plain = world.run(unsynced_job, [(3, steps[r][0][0]) for r in range(world.size)])
    for r in range(world.size):
        for got in (alone[r]["y"][0], plain[r]):
            assert not np.allclose(got, want["y"][0][r].numpy(), rtol=1e-3, atol=1e-3)
        assert alone[r]["calls"] == [[]]  # a group of one communicates nothing


@pytest.mark.parametrize("world", SAMPLE, indirect=True, ids=[f"{b}{n}" for b, n in SAMPLE])
def test_eval_with_running_stats_makes_no_collective_call(world):
    case = affine_case(3)
    steps = make_steps([[(r + 2, 3, 4, 4)] * 2 for r in range(world.size)], seed=26)
    case["eval_x"] = make_steps([[(5, 3, 4, 4)]], seed=27)[0][0][0]
    results = run_case(world, case, steps)
    want = check_against_reference(case, steps, results)
    module = want["module"].eval()
    with torch.no_grad():
        want_eval = module(torch.from_numpy(case["eval_x"]).float().double())
    for got in results:
        assert got["calls"] == [["all_gather", "all_reduce"]] * 2
        assert got["eval_calls"] == []
        _close(got["eval_y"], want_eval, FP32["y"], "eval output")


@pytest.mark.parametrize("world", SAMPLE, indirect=True, ids=[f"{b}{n}" for b, n in SAMPLE])
def test_momentum_none_zero_and_one(world):
    for momentum in (None, 0.0, 1.0):
        case = affine_case(2, kwargs={"momentum": momentum})
        steps = make_steps([[(r + 2, 2, 3, 3)] * 3 for r in range(world.size)], seed=28)
        check_against_reference(case, steps, run_case(world, case, steps))


@pytest.mark.parametrize("world", SAMPLE, indirect=True, ids=[f"{b}{n}" for b, n in SAMPLE])
def test_without_affine_or_running_stats(world):
    for kwargs in ({"affine": False}, {"track_running_stats": False},
                   {"affine": False, "track_running_stats": False}):
        case = {"C": 3, "kwargs": kwargs,
                "eval_x": make_steps([[(4, 3, 2, 2)]], seed=29)[0][0][0]}
        steps = make_steps([[(r + 2, 3, 2, 3)] * 2 for r in range(world.size)], seed=30)
        results = run_case(world, case, steps)
        check_against_reference(case, steps, results)
        if not kwargs.get("track_running_stats", True):
            # Eval without running stats: this rank's batch alone, no collective (as torch's).
            eval_x = torch.from_numpy(case["eval_x"]).float().double()
            want = torch.nn.BatchNorm2d(3, **kwargs).double()(eval_x)
            for got in results:
                assert got["eval_calls"] == []
                _close(got["eval_y"], want.detach(), FP32["y"], "eval output without running stats")


@pytest.mark.parametrize("world", SAMPLE, indirect=True, ids=[f"{b}{n}" for b, n in SAMPLE])
def test_half_precision_inputs_keep_dtype_with_float32_parameters(world):
    for dtype, tol in (("float16", {"y": (2e-3, 4e-3), "grad": (2e-3, 4e-3), "stats": (1e-5, 1e-6)}),
                       ("bfloat16", {"y": (1e-2, 3e-2), "grad": (1e-2, 3e-2), "stats": (1e-5, 1e-6)})):
        case = affine_case(3, dtype=dtype, memory_format="channels_last")
        steps = make_steps([[(r + 2, 3, 4, 4)] * 2 for r in range(world.size)], seed=31)
        results = run_case(world, case, steps)
        check_against_reference(case, steps, results, tol=tol)
        for got in results:
            assert got["formats"][0] == (f"torch.{dtype}", f"torch.{dtype}", True, True)
            assert got["param_dtype"] == "torch.float32"


@pytest.mark.parametrize("world", SAMPLE, indirect=True, ids=[f"{b}{n}" for b, n in SAMPLE])
def test_float64_and_channels_last_layouts(world):
    for ndim, memory_format, dtype, tol in ((4, "channels_last", "float32", FP32),
                                            (5, "channels_last_3d", "float32", FP32),
                                            (4, "contiguous", "float64", FP64)):
        kwargs = {"dtype": torch.float64} if dtype == "float64" else {}
        case = affine_case(3, dtype=dtype, memory_format=memory_format, kwargs=kwargs)
        spatial = (4, 3) if ndim == 4 else (2, 3, 2)
        steps = make_steps([[(r + 2, 3, *spatial)] * 2 for r in range(world.size)], seed=32)
        results = run_case(world, case, steps)
        check_against_reference(case, steps, results, tol=tol)
        for got in results:
            assert got["formats"][0] == (f"torch.{dtype}", f"torch.{dtype}", True, True)


@pytest.mark.parametrize("world", SUBGROUP, indirect=True, ids=[f"{b}{n}" for b, n in SUBGROUP])
def test_subgroups_of_a_split_communicator(world):
    """4 ranks as 2 groups of 2 (ranks 0,2 and 1,3): each group matches its own reference."""
    case = affine_case(3)
    steps = make_steps([[(r + 2, 3, 3, 4)] * 2 for r in range(world.size)], seed=33)
    colors = [r % 2 for r in range(world.size)]
    results = run_case(world, case, steps, colors=colors)
    check_against_reference(case, steps, results, ranks=[0, 2])
    check_against_reference(case, steps, results, ranks=[1, 3])
    assert not np.allclose(results[0]["running_mean"], results[1]["running_mean"])


# -- in this process: module plumbing ---------------------------------------------------------

def test_convert_and_revert_share_parameters_and_keep_mode():
    model = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 1), torch.nn.BatchNorm2d(4),
                                torch.nn.Sequential(torch.nn.BatchNorm1d(4, momentum=None)),
                                torch.nn.SyncBatchNorm(4, eps=1e-3, affine=False))
    model[2].eval()
    weight, running_mean = model[1].weight, model[1].running_mean
    comm = LocalCommunicator()
    converted = syncbn.convert_sync_batchnorm(model, comm=comm)
    assert [type(m) for m in (converted[1], converted[2][0], converted[3])] == [syncbn.SyncBatchNorm] * 3
    assert converted[1].weight is weight and converted[1].running_mean is running_mean
    assert converted[1].training and not converted[2][0].training
    assert converted[2][0].momentum is None and converted[3].eps == 1e-3 and not converted[3].affine
    assert converted[1].comm is comm
    reverted = syncbn.revert_sync_batchnorm(converted)
    assert type(reverted[1]) is torch.nn.BatchNorm2d and type(reverted[2][0]) is torch.nn.BatchNorm1d
    assert type(reverted[3]) is syncbn.BatchNormXd  # torch's SyncBatchNorm has no dimension
    assert reverted[1].weight is weight and reverted[1].running_mean is running_mean
    assert not reverted[2][0].training
    x = torch.randn(3, 4, 2, 2)
    torch.testing.assert_close(reverted[3](x), torch.nn.functional.batch_norm(
        x, None, None, training=True, eps=1e-3))


def test_state_dict_loads_both_ways_with_torch_batch_norms():
    ours = syncbn.SyncBatchNorm(5, comm=LocalCommunicator())
    with torch.no_grad():
        ours.weight.uniform_()
        ours.running_var.uniform_()
    ours.num_batches_tracked += 7
    for torch_module in (torch.nn.BatchNorm2d(5), torch.nn.SyncBatchNorm(5)):
        assert list(torch_module.state_dict()) == list(ours.state_dict())
        torch_module.load_state_dict(ours.state_dict())
        back = syncbn.SyncBatchNorm(5)
        back.load_state_dict(torch_module.state_dict())
        for key, value in ours.state_dict().items():
            assert torch.equal(back.state_dict()[key], value), key


def test_default_communicator_is_resolved_at_the_first_training_forward(monkeypatch):
    calls = []
    real = LocalCommunicator()
    monkeypatch.setattr(collectives, "init", lambda backend=None: calls.append(backend) or real)
    module = syncbn.SyncBatchNorm(2)
    assert calls == []
    module.eval()
    module(torch.randn(4, 2))
    assert calls == []  # eval with running stats needs no communicator
    module.train()
    x = torch.randn(4, 2, 3)
    torch.testing.assert_close(module(x), torch.nn.functional.batch_norm(x, None, None, training=True))
    assert calls == [None]


def test_copies_share_the_communicator_and_pickles_drop_it():
    comm = LocalCommunicator()
    module = syncbn.SyncBatchNorm(2, comm=comm)
    assert copy.deepcopy(module).comm is comm
    restored = pickle.loads(pickle.dumps(module))
    assert restored.comm is None and torch.equal(restored.running_var, module.running_var)


def test_bad_input_is_rejected_before_any_collective():
    comm = CountingCommunicator(LocalCommunicator())
    module = syncbn.SyncBatchNorm(3, comm=comm)
    for bad, error, words in ((torch.randn(4), ValueError, "2 to 5 dimensions"),
                              (torch.randn(4, 2, 3), ValueError, "num_features=3"),
                              (torch.ones(4, 3, dtype=torch.int64), TypeError, "float16, bfloat16"),
                              (torch.randn(1, 3), ValueError, "more than 1 value")):
        with pytest.raises(error, match=words):
            module(bad)
    assert comm.calls == []
    with pytest.raises(TypeError, match="Communicator"):
        syncbn.SyncBatchNorm(3, comm="mpi")
    with pytest.raises(TypeError, match="Communicator"):
        syncbn.convert_sync_batchnorm(torch.nn.BatchNorm2d(3), comm=object())
