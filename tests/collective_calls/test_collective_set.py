"""The rest of the collective set, beyond tests/collective_calls/test_collectives.py's grid (which checks
every collective x dtype x op x backend x world size against numpy): pairwise exchanges
between every pair of ranks, bad arguments of every new collective (an error on every rank,
nothing sent, input untouched), all_gather_v disagreements (the same error on every rank),
and the new collectives on a split whose rank order is reversed.
"""

from __future__ import annotations

import numpy as np
import pytest
from grid import SHAPE, make_input

from collectives.testing import worlds
from collectives.testing.reference import as_array, to_numpy

KINDS = ["torch", "numpy"]
SEED = 20261203


def world_id(param):
    return f"{param[0]}-{param[1]}"


# -- on the ranks ----------------------------------------------------------------------------

def _empty_like(x, shape):
    if isinstance(x, np.ndarray):
        return np.empty(shape, dtype=x.dtype)
    import torch  # noqa: PLC0415

    return torch.empty(shape, dtype=x.dtype)


def pairwise_job(comm, kind, dtype, values_by_peer):
    """Every pair of ranks exchanges arrays both ways (async, all issued first, then waited in
    reverse order); returns {peer: what that peer sent here}."""
    handles, received = [], {}
    for peer in range(comm.size):
        if peer == comm.rank:
            continue
        x = as_array(values_by_peer[peer], dtype, kind)
        got = _empty_like(x, tuple(x.shape))
        handles.append(comm.send(x, peer, tag=peer, async_op=True))
        handles.append(comm.recv(got, peer, tag=comm.rank, async_op=True))
        received[peer] = got
    for handle in reversed(handles):
        handle.wait()
    return {peer: to_numpy(got) for peer, got in received.items()}


def bad_call_job(comm, kind, name, values, kwargs):
    """One call that must fail before anything is sent; returns (error type, message, untouched)."""
    x = as_array(values, "float32", kind)
    before = to_numpy(x)
    out = kwargs.pop("out_shape", None)
    if out is not None:
        kwargs["out"] = _empty_like(x, out) if not isinstance(out, str) else \
            as_array(np.zeros(SHAPE, np.float64), "float64", kind)
    try:
        getattr(comm, name)(x, **kwargs)
    except (TypeError, ValueError) as error:
        # the communicator is still usable: the next collective works
        probe = np.ones(2, np.float32)
        comm.all_reduce(probe)
        return type(error).__name__, str(error), np.array_equal(before, to_numpy(x)), float(probe[0])
    return "no error", "", True, 0.0


# -- in the test process ----------------------------------------------------------------------


P2P_WORLDS = worlds((2, 3, 4), local=False)


@pytest.mark.parametrize("world", P2P_WORLDS, indirect=True, ids=world_id)
def test_pairwise_exchanges_in_both_directions_do_not_deadlock(world):
    size = world.size
    for dtype in ("int64", "bool", "float16"):
        # r and p exchange arrays of one shape, (3 + r + p, 2): each side's recv buffer is its
        # own send's shape, and every pair's shape differs from every other pair's.
        sent = {(r, p): make_input(SEED + 31 * r + p, r, dtype, None, (3 + r + p, 2))
                for r in range(size) for p in range(size) if p != r}
        per_rank = [("numpy", dtype, {p: sent[(r, p)] for p in range(size) if p != r})
                    for r in range(size)]
        results = world.run(pairwise_job, per_rank)
        for r in range(size):
            assert sorted(results[r]) == [p for p in range(size) if p != r]
            for p, got in results[r].items():
                assert got.tobytes() == sent[(p, r)].tobytes(), (dtype, r, p)


BAD_CALLS = [
    ("reduce", {"op": "sum", "dst": 5}, "ValueError", "dst=5 is out of range"),
    ("reduce", {"op": "bxor"}, "TypeError", "not allowed on dtype float32"),
    ("gather", {"dst": -1}, "ValueError", "dst=-1 is out of range"),
    ("gather", {"out_shape": (1, 1)}, "ValueError", "needs out.shape="),
    ("gather", {"out_shape": "wrong dtype"}, "ValueError", "expected x's dtype"),
    ("scatter", {"src": 1.0}, "TypeError", "src must be an int rank"),
    ("scatter", {}, "ValueError", "scatter needs x of shape (size, ...)"),
    ("all_to_all", {}, "ValueError", "all_to_all needs x of shape (size, ...)"),
    ("all_to_all", {"send_splits": "one too many"}, "ValueError", "one entry per rank"),
    ("all_to_all", {"send_splits": "ab"}, "TypeError", "send_splits must be a list"),
    ("all_gather", {"out_shape": (2,)}, "ValueError", "needs out.shape="),
    ("reduce_scatter", {"out_shape": (9, 9)}, "ValueError", "needs out.shape="),
    ("all_gather_v", {"out_shape": (1, 7)}, "ValueError", "out.shape=(total rows, *x.shape[1:])"),
    ("send", {"dst": 0}, "ValueError", "is this rank"),
    ("recv", {"src": 0, "tag": -1}, "ValueError", "tag must be"),
    ("recv", {"src": 0, "tag": 32767}, "ValueError", "tag 32767 is reserved for the library's"),
    ("recv", {"src": 0, "tag": 32766}, "ValueError", "tag 32766 is reserved for the library's"),
    ("recv", {"src": 0, "tag": 32765}, "ValueError", "tag 32765 is reserved for the library's"),
    ("send", {"dst": 1, "tag": "a"}, "TypeError", "tag must be an int"),
    ("all_reduce", {"async_op": "yes"}, "TypeError", "async_op must be True or False"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name,kwargs,error,message", BAD_CALLS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_CALLS)])
@pytest.mark.parametrize("world", [("local", 1), ("mpi", 3), ("torch", 2)], indirect=True, ids=world_id)
def test_bad_arguments_raise_on_every_rank_before_anything_is_sent(world, kind, name, kwargs, error, message):
    kwargs = dict(kwargs)
    if kwargs.get("send_splits") == "one too many":
        kwargs["send_splits"] = [5] + [0] * world.size
    if kwargs.get("dst") == 0 and name == "send":
        per_rank_kwargs = [dict(kwargs, dst=r) for r in range(world.size)]  # each rank: itself
    elif name == "recv":
        per_rank_kwargs = [dict(kwargs, src=(r + 1) % world.size) for r in range(world.size)]
    else:
        per_rank_kwargs = [dict(kwargs) for _ in range(world.size)]
    if name == "send" and kwargs.get("tag") == "a":
        per_rank_kwargs = [dict(kwargs, dst=(r + 1) % world.size) for r in range(world.size)]
    if world.size == 1 and name in ("send", "recv") and "tag" in kwargs:
        pytest.skip("one rank has no peer: the peer check comes first")
    shape = (2 * world.size, 3) if name == "reduce_scatter" else SHAPE
    values = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    results = world.run(bad_call_job, [(kind, name, values, per_rank_kwargs[r]) for r in range(world.size)])
    for rank, (type_name, text, untouched, probe) in enumerate(results):
        assert type_name == error, (rank, type_name, text)
        assert message in text, text
        assert untouched, f"input changed on rank {rank}"
        assert probe == world.size, "the communicator must stay usable"


def uneven_mismatch_job(comm, rest, dtype, out_rows):
    x = np.zeros((comm.rank + 1, *rest), dtype=dtype)
    out = None if out_rows is None else np.zeros((out_rows, *rest), dtype=dtype)
    try:
        comm.all_gather_v(x, out=out)
    except ValueError as error:
        probe = np.ones(1, np.float32)
        comm.all_reduce(probe)
        return str(error), float(probe[0])
    return "no error", 0.0


@pytest.mark.parametrize("world", [("mpi", 3), ("torch", 3)], indirect=True, ids=world_id)
def test_all_gather_v_disagreements_are_the_same_error_on_every_rank(world):
    cases = {
        "x.shape[1:] differs": [((2,), "float32", None), ((3,), "float32", None), ((2,), "float32", None)],
        "dtype differs": [((2,), "float32", None), ((2,), "float64", None), ((2,), "float32", None)],
        "out has the wrong number of rows": [((2,), "int32", 6), ((2,), "int32", 5), ((2,), "int32", None)],
    }
    for phrase, per_rank in cases.items():
        results = world.run(uneven_mismatch_job, per_rank)
        messages = {text for text, _ in results}
        assert len(messages) == 1 and phrase in messages.pop(), (phrase, results)
        assert all(probe == world.size for _, probe in results)


def reordered_split_job(comm, kind):
    """On a split whose ranks run in reverse order, every new collective keeps the new order."""
    sub = comm.split(0, key=-comm.rank)
    r, n = sub.rank, sub.size
    x = as_array(np.full((n, 2), r, np.int64) + np.arange(n)[:, None] * 100, "int64", kind)
    reply = {"rank": r}
    g = sub.gather(as_array(np.array([r, r]), "int64", kind), dst=n - 1)
    reply["gather"] = None if g is None else to_numpy(g)
    reply["scatter"] = to_numpy(sub.scatter(x, src=0))
    reply["all_to_all"] = to_numpy(sub.all_to_all(x))
    splits = [1] * n
    reply["all_to_all_v"] = to_numpy(sub.all_to_all(x, splits))
    uneven = [1 + r + j for j in range(n)]  # (rank r sends rank j its rows r * 1000 + j * 10 + k)
    rows = np.array([[r * 1000 + j * 10 + k] for j in range(n) for k in range(uneven[j])], np.int64)
    reply["all_to_all_uneven"] = to_numpy(sub.all_to_all(as_array(rows, "int64", kind), uneven))
    y = as_array(np.array([r + 1, 10 * (r + 1)]), "int64", kind)
    sub.reduce(y, "sum", dst=0)
    reply["reduce"] = to_numpy(y)
    reply["all_gather_v"] = to_numpy(sub.all_gather_v(as_array(np.full((r, 1), r), "int64", kind))[0])
    sub.close()
    return reply


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [("mpi", 3), ("torch", 3)], indirect=True, ids=world_id)
def test_new_collectives_follow_the_rank_order_of_a_reordered_split(world, kind):
    results = world.run(reordered_split_job, [(kind,)] * world.size)
    n = world.size
    for reply in results:
        r = reply["rank"]
        if r == n - 1:
            np.testing.assert_array_equal(reply["gather"], [[s, s] for s in range(n)])
        else:
            assert reply["gather"] is None
        np.testing.assert_array_equal(reply["scatter"], [0 + 100 * r, 0 + 100 * r])
        np.testing.assert_array_equal(reply["all_to_all"], [[s + 100 * r] * 2 for s in range(n)])
        np.testing.assert_array_equal(reply["all_to_all_v"], [[s + 100 * r] * 2 for s in range(n)])
        np.testing.assert_array_equal(reply["all_to_all_uneven"],  # (the counts in the new rank order too)
                                      [[s * 1000 + r * 10 + k] for s in range(n) for k in range(1 + s + r)])
        expected = [sum(range(1, n + 1)), 10 * sum(range(1, n + 1))] if r == 0 else [r + 1, 10 * (r + 1)]
        np.testing.assert_array_equal(reply["reduce"], expected)
        np.testing.assert_array_equal(reply["all_gather_v"], [[s] for s in range(n) for _ in range(s)])
