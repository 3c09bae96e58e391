"""The rest of the collective set (reduce, gather, scatter, all_to_all equal and uneven,
all_gather_v, send/recv), with out= and async_op: every collective x every dtype (x every op
where it reduces) x backends local/mpi/torch x world sizes 1-4, on real ranks, against numpy
computed in the test process from the same per-rank inputs.

One job per (world, kind) runs every case, so a world answers the whole grid in one round trip.
"""

from __future__ import annotations

import numpy as np
import pytest
from grid import SHAPE, allowed_pairs, dtypes_for, make_input, tolerance

from collectives.testing.reference import as_array, carrier_dtype, reference_reduce, to_numpy

WORLDS = [("local", 1)] + [(backend, size) for backend in ("mpi", "torch") for size in (1, 2, 3, 4)]
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


def _maybe_wait(result, async_op):
    return result.wait() if async_op else result


def collective_set_job(comm, kind, cases):
    """cases: [(name, dtype, args, values, use_out, async_op)] -> what each call returned, as
    numpy (plus flags: input untouched, result is out)."""
    replies = []
    for name, dtype, args, values, use_out, async_op in cases:
        x = as_array(values, dtype, kind)
        before = to_numpy(x)
        if name == "reduce":
            op, dst = args
            returned = _maybe_wait(comm.reduce(x, op, dst, async_op=async_op), async_op)
            assert returned is x, "reduce returns x"
            replies.append(to_numpy(x))
            continue
        if name == "gather":
            (dst,) = args
            out = _empty_like(x, (comm.size, *x.shape)) if use_out and comm.rank == dst else None
            got = _maybe_wait(comm.gather(x, dst, out=out, async_op=async_op), async_op)
            assert (got is None) == (comm.rank != dst), "gather: None exactly off dst"
            assert out is None or got is out
            replies.append(None if got is None else to_numpy(got))
        elif name == "scatter":
            (src,) = args
            out = _empty_like(x, tuple(x.shape[1:])) if use_out else None
            got = _maybe_wait(comm.scatter(x, src, out=out, async_op=async_op), async_op)
            assert out is None or got is out
            replies.append(to_numpy(got))
        elif name == "all_to_all":
            splits, rows = args
            if use_out:
                out = _empty_like(x, (rows, *x.shape[1:]))
            else:
                out = None
            got = _maybe_wait(comm.all_to_all(x, splits, out=out, async_op=async_op), async_op)
            assert out is None or got is out
            replies.append(to_numpy(got))
        elif name == "all_gather_v":
            (total,) = args
            out = _empty_like(x, (total, *x.shape[1:])) if use_out else None
            got, counts = _maybe_wait(comm.all_gather_v(x, out=out, async_op=async_op), async_op)
            assert out is None or got is out
            replies.append((to_numpy(got), list(counts)))
        elif name == "all_gather":
            out = _empty_like(x, (comm.size, *x.shape)) if use_out else None
            got = _maybe_wait(comm.all_gather(x, out=out, async_op=async_op), async_op)
            assert out is None or got is out
            replies.append(to_numpy(got))
        elif name == "reduce_scatter":
            (op,) = args
            out = _empty_like(x, (x.shape[0] // comm.size, *x.shape[1:])) if use_out else None
            got = _maybe_wait(comm.reduce_scatter(x, op, out=out, async_op=async_op), async_op)
            assert out is None or got is out
            replies.append(to_numpy(got))
        else:
            raise AssertionError(name)
        assert np.array_equal(before, to_numpy(x), equal_nan=before.dtype.kind == "f"), \
            f"{name} modified its input"
    return replies


def ring_job(comm, kind, values, async_op, recv_first):
    """Each rank sends to rank+1 and receives from rank-1, with a tag per direction; returns
    what arrived."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    x = as_array(values, "float32", kind)
    got = _empty_like(x, tuple(x.shape))
    if not async_op:
        if comm.rank % 2 == 0:  # blocking: one side sends first, the other receives first
            comm.send(x, right, tag=7)
            comm.recv(got, left, tag=7)
        else:
            comm.recv(got, left, tag=7)
            comm.send(x, right, tag=7)
        return to_numpy(got)
    if recv_first:
        receiving = comm.recv(got, left, tag=7, async_op=True)
        sending = comm.send(x, right, tag=7, async_op=True)
        assert receiving.wait() is got
        sending.wait()
    else:
        sending = comm.send(x, right, tag=7, async_op=True)
        receiving = comm.recv(got, left, tag=7, async_op=True)
        sending.wait()
        assert receiving.wait() is got
    return to_numpy(got)


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

def _splits(size: int, rank: int) -> list[int]:
    """Uneven splits with zero-length pieces; the last rank sends nothing at all."""
    if rank == size - 1 and size > 1:
        return [0] * size
    return [(rank + 2 * j) % 3 for j in range(size)]


def _cases(size, kind):
    """The grid: per case (name, dtype, args); per rank the values are drawn below."""
    cases = []
    for index, (dtype, op) in enumerate(p for p in allowed_pairs() if p[0] in dtypes_for(kind)):
        cases.append(("reduce", dtype, (op, index % size), SHAPE, False, index % 3 == 0))
        cases.append(("reduce_scatter", dtype, (op,), (2 * size, 3), index % 2 == 0, index % 4 == 1))
    for index, dtype in enumerate(dtypes_for(kind)):
        root = index % size
        flags = (index % 2 == 0, index % 3 == 1)
        cases.append(("gather", dtype, (root,), SHAPE, *flags))
        cases.append(("scatter", dtype, (root,), (size, 4, 2), *flags))
        cases.append(("all_to_all", dtype, (None,), (size, 3), *flags))
        cases.append(("all_to_all", dtype, ("uneven",), None, *flags))
        cases.append(("all_gather_v", dtype, (), None, *flags))
        cases.append(("all_gather", dtype, (), SHAPE, *flags))
    return cases


def _per_rank_cases(cases, size, rank, kind):
    mine = []
    for number, (name, dtype, args, shape, use_out, async_op) in enumerate(cases):
        op = args[0] if name in ("reduce", "reduce_scatter") else None
        if name == "all_to_all" and args[0] == "uneven":
            splits = _splits(size, rank)
            received = sum(_splits(size, sender)[rank] for sender in range(size))
            values = make_input(SEED + number, rank, dtype, None, (sum(splits), 2))
            mine.append((name, dtype, (splits, received), values, use_out, async_op))
            continue
        if name == "all_gather_v":
            rows = [(r * 2 + 1) % 4 for r in range(size)]  # 1, 3, 1, 3, ...
            rows[-1] = 0 if size > 1 else rows[-1]         # and the last rank adds no rows
            values = make_input(SEED + number, rank, dtype, None, (rows[rank], 3))
            mine.append((name, dtype, (sum(rows),), values, use_out, async_op))
            continue
        if name == "all_to_all":
            mine.append((name, dtype, (None, size), make_input(SEED + number, rank, dtype, None, shape),
                         use_out, async_op))
            continue
        mine.append((name, dtype, args, make_input(SEED + number, rank, dtype, op, shape),
                     use_out, async_op))
    return mine


def _check_reduced(got, inputs, dtype, op, where):
    ref = reference_reduce(inputs, dtype, op)
    tol = tolerance(inputs, dtype, op, ref)
    assert got.shape == ref.shape, where
    if tol.any():
        error = np.abs(got.astype(np.float64) - ref)
        assert np.all(error <= tol), f"{where}: max error {error.max()} above bound {tol.max()}"
    else:
        np.testing.assert_array_equal(got, ref.astype(got.dtype), err_msg=where)


def _bits(values, dtype):
    return np.asarray(values, dtype=carrier_dtype(dtype)).tobytes()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_every_new_collective_matches_numpy_on_every_dtype(world, kind):
    size = world.size
    cases = _cases(size, kind)
    per_rank = [_per_rank_cases(cases, size, rank, kind) for rank in range(size)]
    results = world.run(collective_set_job, [(kind, per_rank[r]) for r in range(size)])
    for number, (name, dtype, args, _, use_out, async_op) in enumerate(cases):
        where = f"{world.backend}/{size} {kind} {name} {dtype} {args} out={use_out} async={async_op}"
        inputs = [per_rank[r][number][3] for r in range(size)]
        got = [results[r][number] for r in range(size)]
        if name == "reduce":
            op, dst = args
            _check_reduced(got[dst], inputs, dtype, op, where)
            for rank in range(size):
                if rank != dst:
                    assert got[rank].tobytes() == _bits(inputs[rank], dtype), f"{where}: rank {rank} changed"
        elif name == "reduce_scatter":
            (op,) = args
            for rank in range(size):
                rows = slice(2 * rank, 2 * rank + 2)
                _check_reduced(got[rank], [x[rows] for x in inputs], dtype, op, f"{where} rank {rank}")
        elif name == "gather":
            (dst,) = args
            assert got[dst].tobytes() == _bits(np.stack(inputs), dtype), where
            assert got[dst].shape == (size, *SHAPE), where
            assert all(got[r] is None for r in range(size) if r != dst), where
        elif name == "scatter":
            (src,) = args
            for rank in range(size):
                assert got[rank].tobytes() == _bits(inputs[src][rank], dtype), f"{where} rank {rank}"
        elif name == "all_to_all" and per_rank[0][number][2][0] is None:
            for rank in range(size):
                expected = np.stack([inputs[sender][rank] for sender in range(size)])
                assert got[rank].tobytes() == _bits(expected, dtype), f"{where} rank {rank}"
        elif name == "all_to_all":
            for rank in range(size):
                pieces = []
                for sender in range(size):
                    splits = _splits(size, sender)
                    start = sum(splits[:rank])
                    pieces.append(inputs[sender][start:start + splits[rank]])
                expected = np.concatenate(pieces)
                assert got[rank].shape == expected.shape, f"{where} rank {rank}"
                assert got[rank].tobytes() == _bits(expected, dtype), f"{where} rank {rank}"
        elif name == "all_gather_v":
            expected = np.concatenate(inputs)
            for rank in range(size):
                gathered, counts = got[rank]
                assert counts == [len(x) for x in inputs], where
                assert gathered.shape == expected.shape, where
                assert gathered.tobytes() == _bits(expected, dtype), f"{where} rank {rank}"
        elif name == "all_gather":
            for rank in range(size):
                assert got[rank].tobytes() == _bits(np.stack(inputs), dtype), f"{where} rank {rank}"


P2P_WORLDS = [(backend, size) for backend in ("mpi", "torch") for size in (2, 3, 4)]


@pytest.mark.parametrize("mode", ["blocking", "async-recv-first", "async-send-first"])
@pytest.mark.parametrize("world", P2P_WORLDS, indirect=True, ids=world_id)
def test_send_recv_ring_passes_every_rank_its_left_neighbours_array(world, mode):
    values = [np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * r for r in range(world.size)]
    results = world.run(ring_job, [("numpy" if r % 2 else "torch", values[r], mode != "blocking",
                                    mode == "async-recv-first") for r in range(world.size)])
    for rank in range(world.size):
        np.testing.assert_array_equal(results[rank], values[(rank - 1) % world.size])


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
        expected = [sum(range(1, n + 1)), 10 * sum(range(1, n + 1))] if r == 0 else [r + 1, 10 * (r + 1)]
        np.testing.assert_array_equal(reply["reduce"], expected)
        np.testing.assert_array_equal(reply["all_gather_v"], [[s] for s in range(n) for _ in range(s)])
