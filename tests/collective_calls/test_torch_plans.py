"""The torch backend's plans (backends/torch_plans.py): the first call of a kind of CPU tensors
binds the process group's own call, and later calls of that kind make one check of the tensor and
that call. A plan made for one kind never serves another (dtype, op, out=, async, a tensor that
is not contiguous, a subclass, a numpy array), and what it does not take runs the row's method.

The reference for every result is numpy (exact small integers, float64 for averages) on the
inputs of every rank, computed here in the test process.
"""

import gc
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

ROWS = 2  # rows of x per rank in reduce_scatter


def _data(seed, rank, shape, dtype="float32"):
    """Rank ``rank``'s input number ``seed``: small integers, so every sum is exact."""
    return np.random.default_rng([seed, rank]).integers(-4, 5, shape).astype(dtype)


def _t(seed, rank, shape, dtype="float32"):
    return torch.from_numpy(_data(seed, rank, shape, dtype))


def plans_job(comm):
    """Calls of many kinds on one communicator, planned kinds first: the results, by name."""
    r, n = comm.rank, comm.size
    got = {}
    for attempt in range(3):  # the first call of a kind makes its plan; the others use it
        x = _t(1, r, (4, 3))
        assert comm.all_reduce(x) is x
        got["sum", attempt] = x.numpy().copy()
    x64 = _t(2, r, (5,), "float64")  # another dtype after the first
    comm.all_reduce(x64)
    got["sum float64"] = x64.numpy().copy()
    avg = _t(3, r, (4,))  # another op, then AVG
    comm.all_reduce(avg, "avg")
    got["avg"] = avg.numpy().copy()
    high = _t(4, r, (4,))
    if r == 0:
        high[1] = float("nan")
    comm.all_reduce(high, "max")  # float MAX: order keys, NaN propagated (not planned)
    got["max"] = high.numpy().copy()
    wide = _t(5, r, (8,))
    strided = wide[::2]  # same kind (float32 tensor, sum), not contiguous: the row's method
    assert comm.all_reduce(strided) is strided
    got["strided"] = wide.numpy().copy()
    got["int16"] = comm.all_reduce(_t(6, r, (3,), "int16")).numpy().copy()
    plain = _data(7, r, (3,))
    comm.all_reduce(plain)  # a numpy array on the same communicator
    got["numpy"] = plain.copy()
    parameter = torch.nn.Parameter(_t(8, r, (3,)), requires_grad=False)  # a subclass
    comm.all_reduce(parameter)
    got["parameter"] = parameter.detach().numpy().copy()
    with pytest.raises(ValueError, match="requires grad"):
        comm.all_reduce(torch.zeros(3, requires_grad=True))
    # asynchronous calls of a planned kind, a blocking one between post and wait
    first, second = _t(9, r, (4,)), _t(10, r, (4,))
    handle = comm.all_reduce(first, async_op=True)
    averaged = comm.all_reduce(second, "avg", async_op=True)
    between = _t(11, r, (4,))
    comm.all_reduce(between)
    assert handle.wait() is first
    averaged.wait()
    got["async sum"], got["async avg"] = first.numpy().copy(), second.numpy().copy()
    got["between"] = between.numpy().copy()
    # broadcast from every root (the plan's options are per root), blocking and asynchronous
    for root in range(n):
        y = _t(20 + root, r, (3,))
        assert comm.broadcast(y, root) is y
        got["broadcast", root] = y.numpy().copy()
        z = _t(30 + root, r, (2, 2))
        assert comm.broadcast(z, root, async_op=True).wait() is z
        got["async broadcast", root] = z.numpy().copy()
    # all_gather: out= and new results, 2-d and 0-d, async, a non-contiguous x, another dtype
    out = torch.full((n, 2, 3), -1.0)
    assert comm.all_gather(_t(40, r, (2, 3)), out=out) is out
    got["gather out"] = out.numpy().copy()
    got["gather"] = comm.all_gather(_t(40, r, (2, 3))).numpy().copy()
    got["gather 0-d"] = comm.all_gather(_t(41, r, ())).numpy().copy()
    got["gather async"] = comm.all_gather(_t(40, r, (2, 3)), async_op=True).wait().numpy().copy()
    out = torch.zeros(n, 2, 3)
    got["gather async out"] = comm.all_gather(_t(40, r, (2, 3)), out=out, async_op=True).wait().numpy().copy()
    got["gather strided"] = comm.all_gather(_t(42, r, (3, 2)).t()).numpy().copy()
    got["gather int16"] = comm.all_gather(_t(43, r, (3,), "int16")).numpy().copy()
    # reduce_scatter: out=, new, AVG, async, a non-contiguous x
    rows = (ROWS * n, 3)
    mine = torch.full((ROWS, 3), -1.0)
    assert comm.reduce_scatter(_t(50, r, rows), out=mine) is mine
    got["scatter out"] = mine.numpy().copy()
    got["scatter"] = comm.reduce_scatter(_t(50, r, rows)).numpy().copy()
    got["scatter avg"] = comm.reduce_scatter(_t(51, r, rows), "avg").numpy().copy()
    got["scatter async"] = comm.reduce_scatter(_t(50, r, rows), async_op=True).wait().numpy().copy()
    got["scatter async avg"] = comm.reduce_scatter(_t(51, r, rows), "avg", async_op=True).wait().numpy().copy()
    got["scatter strided"] = comm.reduce_scatter(_t(52, r, rows[::-1]).t()).numpy().copy()
    # x requiring grad, read only (all_gather, reduce_scatter): the row's method takes it detached
    gathered = comm.all_gather(_t(40, r, (2, 3)).requires_grad_())
    scattered = comm.reduce_scatter(_t(50, r, rows).requires_grad_())
    assert not gathered.requires_grad and not scattered.requires_grad
    got["gather grad"], got["scatter grad"] = gathered.numpy().copy(), scattered.numpy().copy()
    return got


def _expected(n):
    def every(seed, shape, dtype="float32"):
        return [_data(seed, rank, shape, dtype) for rank in range(n)]

    def total(seed, shape, dtype="float32"):
        return np.sum(every(seed, shape, dtype), axis=0, dtype=dtype)

    def mean(seed, shape):
        return (np.sum(every(seed, shape, "float64"), axis=0) / n).astype("float32")

    want = {("sum", attempt): total(1, (4, 3)) for attempt in range(3)}
    want["sum float64"] = total(2, (5,), "float64")
    want["avg"] = mean(3, (4,))
    want["max"] = np.max(every(4, (4,)), axis=0)
    want["max"][1] = np.nan
    want["strided"] = total(5, (8,))[::2]  # (each rank's odd elements stay as they were)
    want["int16"] = total(6, (3,), "int16")
    want["numpy"] = total(7, (3,))
    want["parameter"] = total(8, (3,))
    want["async sum"], want["async avg"], want["between"] = total(9, (4,)), mean(10, (4,)), total(11, (4,))
    for root in range(n):
        want["broadcast", root] = _data(20 + root, root, (3,))
        want["async broadcast", root] = _data(30 + root, root, (2, 2))
    gathered = np.stack(every(40, (2, 3)))
    for name in ("gather out", "gather", "gather async", "gather async out", "gather grad"):
        want[name] = gathered
    want["gather 0-d"] = np.stack(every(41, ()))
    want["gather strided"] = np.stack([x.T for x in every(42, (3, 2))])
    want["gather int16"] = np.stack(every(43, (3,), "int16"))
    return want


def _rows_of(rank, full):
    return full[ROWS * rank:ROWS * (rank + 1)]


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_a_plan_serves_only_its_own_kind_and_results_match_numpy(world):
    n = world.size
    want = _expected(n)
    rows = (ROWS * n, 3)
    every = {seed: [_data(seed, rank, rows) for rank in range(n)] for seed in (50, 51)}
    strided = [_data(52, rank, rows[::-1]).T for rank in range(n)]
    for rank, got in enumerate(world.run(plans_job, [()] * n)):
        for key, value in got.items():
            if key == "strided":
                expect = _data(5, rank, (8,))
                expect[::2] = want["strided"]
            elif isinstance(key, str) and key.startswith("scatter"):
                seed = 51 if "avg" in key else 50
                if key == "scatter strided":
                    full = np.sum(strided, axis=0)
                elif "avg" in key:
                    full = (np.sum(np.array(every[seed], "float64"), axis=0) / n).astype("float32")
                else:
                    full = np.sum(every[seed], axis=0)
                expect = _rows_of(rank, full)
            else:
                expect = want[key]
            np.testing.assert_array_equal(value, expect, err_msg=f"{key} on rank {rank}")


def rooted_job(comm):
    """reduce, gather, scatter and all_to_all of planned kinds from every root, blocking and
    asynchronous, with and without out=, then of kinds the plan does not take (not contiguous,
    empty): the results, by name."""
    r, n = comm.rank, comm.size
    got = {}
    for root in range(n):
        for mode in ("blocking", "async"):
            wait = (lambda h: h.wait()) if mode == "async" else (lambda h: h)
            kw = {"async_op": True} if mode == "async" else {}
            x = _t(60 + root, r, (2, 3))
            assert wait(comm.reduce(x, "sum", root, **kw)) is x  # off dst: x as it was (Gloo's scratch)
            got["reduce", root, mode] = x.numpy().copy()
            y = _t(61 + root, r, (4,))
            wait(comm.reduce(y, "avg", root, **kw))
            got["reduce avg", root, mode] = y.numpy().copy()
            gathered = wait(comm.gather(_t(62, r, (2, 3)), root, **kw))
            got["gather", root, mode] = None if gathered is None else gathered.numpy().copy()
            out = torch.full((n, 2, 3), -1.0)
            gathered = wait(comm.gather(_t(62, r, (2, 3)), root, out=out if r == root else None, **kw))
            got["gather out", root, mode] = None if gathered is None else out.numpy().copy()
            got["scatter", root, mode] = wait(comm.scatter(_t(63 + root, r, (n, 2)), root, **kw)).numpy().copy()
            mine = torch.full((2,), -1.0)
            assert wait(comm.scatter(_t(63 + root, r, (n, 2)), root, out=mine, **kw)) is mine
            got["scatter out", root, mode] = mine.numpy().copy()
        got["scatter 0-d", root] = comm.scatter(_t(65 + root, r, (n,)), root).numpy().copy()
        got["reduce strided", root] = comm.reduce(_t(66, r, (3, 2)).t(), "sum", root).numpy().copy()
        got["gather strided", root] = _copy(comm.gather(_t(67, r, (3, 2)).t(), root))
        got["gather empty", root] = _copy(comm.gather(torch.zeros(0, 2), root))
    got["all_to_all"] = comm.all_to_all(_t(70, r, (n, 3))).numpy().copy()
    out = torch.full((n, 3), -1.0)
    assert comm.all_to_all(_t(70, r, (n, 3)), out=out, async_op=True).wait() is out
    got["all_to_all async out"] = out.numpy().copy()
    got["all_to_all strided"] = comm.all_to_all(_t(71, r, (3, n)).t()).numpy().copy()
    got["all_to_all int64"] = comm.all_to_all(_t(72, r, (n,), "int64")).numpy().copy()
    return got


def _copy(result):
    return None if result is None else result.numpy().copy()


def _rooted_expected(n, rank):
    def every(seed, shape, dtype="float32"):
        return [_data(seed, r, shape, dtype) for r in range(n)]

    want = {}
    for root in range(n):
        here = rank == root
        for mode in ("blocking", "async"):
            want["reduce", root, mode] = np.sum(every(60 + root, (2, 3)), axis=0) if here \
                else _data(60 + root, rank, (2, 3))
            want["reduce avg", root, mode] = (np.sum(every(61 + root, (4,), "float64"), axis=0) / n).astype(
                "float32") if here else _data(61 + root, rank, (4,))
            want["gather", root, mode] = want["gather out", root, mode] = np.stack(every(62, (2, 3))) if here else None
            want["scatter", root, mode] = want["scatter out", root, mode] = _data(63 + root, root, (n, 2))[rank]
        want["scatter 0-d", root] = _data(65 + root, root, (n,))[rank]
        want["reduce strided", root] = np.sum(every(66, (3, 2)), axis=0).T if here else _data(66, rank, (3, 2)).T
        want["gather strided", root] = np.stack([x.T for x in every(67, (3, 2))]) if here else None
        want["gather empty", root] = np.zeros((n, 0, 2), "float32") if here else None
    want["all_to_all"] = want["all_to_all async out"] = np.stack([x[rank] for x in every(70, (n, 3))])
    want["all_to_all strided"] = np.stack([x.T[rank] for x in every(71, (3, n))])
    want["all_to_all int64"] = np.stack([x[rank] for x in every(72, (n,), "int64")])
    return want


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_planned_rooted_and_all_to_all_results_match_numpy(world):
    n = world.size
    for rank, got in enumerate(world.run(rooted_job, [()] * n)):
        want = _rooted_expected(n, rank)
        assert got.keys() == want.keys()
        for key, value in got.items():
            if want[key] is None:
                assert value is None, f"{key} on rank {rank}"
            else:
                np.testing.assert_array_equal(value, want[key], err_msg=f"{key} on rank {rank}")


def planned_route_job(comm):
    """On a new communicator whose row methods for the planned collectives raise on a tensor:
    the planned kinds (blocking and asynchronous) run without them; a tensor the plan does not
    take (not contiguous) goes to the row's method. (Debug mode's fingerprints, numpy arrays,
    still go through the all_gather row's method.)"""
    sub = comm.split(0)
    try:
        transport = sub._transport

        def row_method(name):
            original = getattr(transport, name)

            def method(request):
                if isinstance(request.x, torch.Tensor):
                    raise AssertionError(f"the row's method ran {request.call.name}")
                return original(request)
            return method

        for name in ("_all_reduce", "_broadcast", "_all_gather", "_reduce_scatter", "_reduce", "_gather",
                     "_scatter", "_all_to_all"):
            setattr(transport, name, row_method(name))
        r, n = sub.rank, sub.size
        x, y = _t(1, r, (4,)), _t(2, r, (4,))
        sub.all_reduce(x)
        sub.all_reduce(y, "avg", async_op=True).wait()
        z = _t(3, r, (3,))
        sub.broadcast(z, n - 1)
        gathered = sub.all_gather(_t(4, r, (2,)), async_op=True).wait()
        mine = sub.reduce_scatter(_t(5, r, (n,)))
        reduced = _t(7, r, (3,))
        sub.reduce(reduced, "sum", 0)
        sub.reduce(_t(8, r, (3,)), "sum", n - 1, async_op=True).wait()
        gathered_at_0 = sub.gather(_t(9, r, (2,)), 0)
        row = sub.scatter(_t(10, r, (n, 2)), n - 1, async_op=True).wait()
        exchanged = sub.all_to_all(_t(11, r, (n, 2)))
        with pytest.raises(Exception, match="failed") as refused:
            sub.all_reduce(_t(6, r, (8,))[::2])
        assert isinstance(refused.value.__cause__, AssertionError)
        rooted = (reduced.numpy(), None if gathered_at_0 is None else gathered_at_0.numpy(), row.numpy(),
                  exchanged.numpy())
        return x.numpy(), y.numpy(), z.numpy(), gathered.numpy(), mine.numpy(), rooted
    finally:
        sub.close()


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_a_planned_kind_runs_the_process_groups_call_not_the_rows_method(world):
    n = world.size

    def every(seed, shape):
        return [_data(seed, rank, shape) for rank in range(n)]

    for rank, (x, y, z, gathered, mine, rooted) in enumerate(world.run(planned_route_job, [()] * n)):
        np.testing.assert_array_equal(x, np.sum(every(1, (4,)), axis=0))
        np.testing.assert_array_equal(y, (np.sum(np.array(every(2, (4,)), "float64"), axis=0) / n).astype("float32"))
        np.testing.assert_array_equal(z, _data(3, n - 1, (3,)))
        np.testing.assert_array_equal(gathered, np.stack(every(4, (2,))))
        np.testing.assert_array_equal(mine, np.sum(every(5, (n,)), axis=0)[rank:rank + 1])
        reduced, gathered_at_0, row, exchanged = rooted
        np.testing.assert_array_equal(reduced, np.sum(every(7, (3,)), axis=0) if rank == 0 else _data(7, rank, (3,)))
        if rank == 0:
            np.testing.assert_array_equal(gathered_at_0, np.stack(every(9, (2,))))
        else:
            assert gathered_at_0 is None
        np.testing.assert_array_equal(row, _data(10, n - 1, (n, 2))[rank])
        np.testing.assert_array_equal(exchanged, np.stack([x[rank] for x in every(11, (n, 2))]))


def _bound_to(group):
    """The bound methods of ``group`` still alive (a plan's ``pg.allreduce`` ...)."""
    gc.collect()
    return [r for r in gc.get_referrers(group) if isinstance(r, types.MethodType)]


def closed_plans_job(comm):
    """Planned calls on a split communicator, then its close: what still holds its group."""
    from collectives.backends.torch_bootstrap import planning

    sub = comm.split(0)
    transport = sub._transport
    x = _t(1, sub.rank, (sub.size, 2))
    sub.all_reduce(x)
    sub.broadcast(x, 0)
    sub.reduce_scatter(x)
    sub.all_to_all(x)
    held = (transport in planning, len(_bound_to(transport._group)) > 0)
    group = transport._group
    sub.close()
    return held, (transport in planning, len(_bound_to(group)), len(sub._checks.plans))


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_closing_a_communicator_drops_the_plans_that_hold_its_process_group(world):
    # A group still alive when the interpreter ends aborts the process ("terminate called
    # without an active exception"): destroy_process_group must free it, so nothing else may
    # hold it, and the plans hold its bound methods.
    for before, after in world.run(closed_plans_job, [()] * world.size):
        assert before == (True, True)
        assert after == (False, 0, 0)


AT_EXIT = """
import gc, types, torch, collectives
import torch.distributed as dist
from collectives.backends import torch_bootstrap
comm = collectives.init()
comm.all_reduce(torch.ones(4))
comm.broadcast(torch.ones(4), 0)
group = dist.group.WORLD
print(len(torch_bootstrap.planning), len(comm._checks.plans))
torch_bootstrap._destroy_created_groups()  # what runs at exit
gc.collect()
print(len([r for r in gc.get_referrers(group) if isinstance(r, types.MethodType)]), len(comm._checks.plans))
"""


def test_the_exit_hook_drops_the_plans_before_it_destroys_the_default_group():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COLLECTIVES_", "MASTER_", "RANK",
                                                                     "WORLD_SIZE", "LOCAL_", "PMI", "OMPI"))}
    env["COLLECTIVES_BACKEND"] = "torch"
    done = subprocess.run([sys.executable, "-c", AT_EXIT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "2", "0", "0"], done.stdout
