"""The torch route's small rounds on a group with a CPU backend (Gloo): with the default check, and
with it off (COLLECTIVES_DEBUG=0), an uneven collective's counts travel in its check's round (one
small all_to_all of the word and the counts to every rank), so it makes one small round before its
data, as a raw program that must learn the counts does. Results against numpy on every rank's
inputs; the rounds counted on the transport.
"""

import collections
import os

import numpy as np
import pytest
import torch
from collectives.backends.mpi_carried import CARRIED

CALLS = 3
DEBUG = "COLLECTIVES_DEBUG"


def _rows(rank, count, width=2):
    """Rank ``rank``'s rows: ``count`` rows of ``width``, each holding (rank, row number)."""
    return np.array([[rank, i] for i in range(count)], dtype=np.int64).reshape(count, width)


def _splits(rank, size):
    """What rank ``rank`` sends to each rank: 0, 1 or 2 rows, differing between ranks."""
    return [(rank + 2 * j) % 3 for j in range(size)]


def _counting(method, name, seen):
    """``method``, counting its calls in ``seen[name]`` (``_agree_counts``: those with counts; the
    check of a call without any travels there as a word alone)."""
    def counted(*args, **kwargs):
        if name != "_agree_counts" or args[1]:
            seen[name] += 1
        return method(*args, **kwargs)
    return counted


def _split(comm, level):
    """A split of ``comm`` made under COLLECTIVES_DEBUG=``level`` (None: unset), which a
    communicator reads when it is made; the variable as it was after."""
    kept = os.environ.get(DEBUG)
    os.environ.pop(DEBUG, None)
    if level is not None:
        os.environ[DEBUG] = level
    try:
        return comm.split(0)
    finally:
        os.environ.pop(DEBUG, None)
        if kept is not None:
            os.environ[DEBUG] = kept


def rounds_job(comm, level=None):
    """Uneven calls on a new communicator (made under COLLECTIVES_DEBUG=``level``) after its first
    call (always compared in full): the transport's small rounds counted, the results."""
    sub = _split(comm, level)
    sub.all_reduce(np.ones(1))
    transport, seen = sub._transport, collections.Counter()
    for name in ("_agree_counts", "_exchange_small", "_start_exchange_small"):
        setattr(transport, name, _counting(getattr(transport, name), name, seen))
    r, n = sub.rank, sub.size
    got = []
    for _ in range(CALLS):
        splits = _splits(r, n)
        mine = torch.from_numpy(_rows(r, sum(splits)))
        got.append(("all_to_all", sub.all_to_all(mine, splits).numpy().copy()))
        gathered, counts = sub.all_gather_v(torch.from_numpy(_rows(r, r + 1)))
        got.append(("all_gather_v", gathered.numpy().copy(), counts))
        sub.all_reduce(torch.ones(2))  # (a call without counts between them)
    sub.close()
    return dict(seen), got


def _expected(rank, size):
    """numpy's results of rounds_job's calls on rank ``rank``."""
    received = [_rows(s, sum(_splits(s, size))) for s in range(size)]
    pieces = []
    for s in range(size):  # rank s's rows for ``rank`` follow those it sends to the ranks before
        start = sum(_splits(s, size)[:rank])
        pieces.append(received[s][start:start + _splits(s, size)[rank]])
    return np.concatenate(pieces), np.concatenate([_rows(s, s + 1) for s in range(size)]), \
        [s + 1 for s in range(size)]


@pytest.mark.parametrize("world", [("torch", 3), ("mpi", 3)], indirect=True)
@pytest.mark.parametrize("level", [None, "0", "1"])
def test_an_uneven_calls_counts_travel_in_its_check_round_on_gloo_and_mpi(world, level):
    """With the default check, and with the check off (COLLECTIVES_DEBUG=0: the counts exchange the
    call makes anyway is that round, no exchange of its own); in debug mode the full exchange. (On
    MPI up to 4 ranks the same.)"""
    for rank, (seen, got) in enumerate(world.run(rounds_job, [(level,)] * world.size)):
        if level == "1":  # (besides the fingerprints of every call)
            assert "_agree_counts" not in seen and seen["_exchange_small"] == 2 * CALLS, seen
        else:
            assert seen == {"_agree_counts": 2 * CALLS}, seen  # (no exchange of its own)
        to_me, gathered, counts = _expected(rank, world.size)
        for name, *result in got:
            if name == "all_to_all":
                np.testing.assert_array_equal(result[0], to_me)
            else:
                np.testing.assert_array_equal(result[0], gathered)
                assert result[1] == counts



def _t(seed, rank, shape, dtype="float32"):
    """Rank ``rank``'s input number ``seed``: small integers, so every sum is exact."""
    return torch.from_numpy(np.random.default_rng([seed, rank]).integers(-4, 5, shape).astype(dtype))


def _counting_payloads(transport, seen):
    """Count the transport's check rounds that carry a payload (a call's data: its word's bit 63,
    CARRIED, set) in ``seen``."""
    method = transport._carried_round

    def counted(word):
        if word & CARRIED:
            seen["carried"] += 1
        return method(word)
    transport._carried_round = counted


def carried_job(comm):
    """Small planned calls of every kind (their data in the check's round), one asynchronous all_reduce on
    rank 1 against a blocking one elsewhere (the same call: not carried, the data collective runs), and a
    larger one (its word alone): results by name, and the rounds that carried."""
    sub = comm.split(0)
    sub.all_reduce(np.ones(1))
    seen = collections.Counter()
    _counting_payloads(sub._transport, seen)
    r, n = sub.rank, sub.size
    got = {}
    for name, op, dtype in (("sum", "sum", "float32"), ("prod", "prod", "int64"), ("max", "max", "int32"),
                            ("avg", "avg", "float64"), ("min", "min", "int8")):
        x = _t(1, r, (3, 2), dtype)
        assert sub.all_reduce(x, op) is x
        got[name] = x.numpy().copy()
    x = _t(2, r, (4,))
    sub.reduce(x, "sum", dst=n - 1)
    got["reduce"] = x.numpy().copy()
    x = _t(3, r, (5,))
    got["broadcast"] = sub.broadcast(x, 1).numpy().copy()
    got["all_gather"] = sub.all_gather(_t(4, r, (2, 2))).numpy()
    gathered = sub.gather(_t(5, r, (3,)), dst=0)
    got["gather"] = None if gathered is None else gathered.numpy()
    got["scatter"] = sub.scatter(_t(6, r, (n, 2)), src=n - 1).numpy()
    got["all_to_all"] = sub.all_to_all(_t(7, r, (n, 3))).numpy()
    got["reduce_scatter"] = sub.reduce_scatter(_t(8, r, (n, 2))).numpy()
    out = torch.empty(n, 2)
    assert sub.all_gather(_t(9, r, (2,)), out=out) is out
    got["out"] = out.numpy()
    carried = seen["carried"]
    x = _t(10, r, (3,))
    (sub.all_reduce(x, async_op=True).wait() if r == 1 else sub.all_reduce(x))
    got["one async"] = x.numpy().copy()
    x = _t(11, r, (600,))  # (2,400 bytes: past the payload)
    sub.all_reduce(x)
    got["large"] = x.numpy().copy()
    others = seen["carried"] - carried
    sub.close()
    return got, carried, others


def _inputs(seed, n, shape, dtype="float32"):
    return [_t(seed, s, shape, dtype).numpy().astype(np.float64) for s in range(n)]


@pytest.mark.parametrize("world", [("torch", 3)], indirect=True)
def test_small_calls_travel_in_the_check_round_and_match_numpy(world):
    n = world.size
    for rank, (got, carried, others) in enumerate(world.run(carried_job, [()] * n)):
        assert carried == 13, carried  # (every small planned call above)
        assert others == (rank != 1), (rank, others)  # (the async call's peers carried; it ran as usual)
        np.testing.assert_array_equal(got["sum"], sum(_inputs(1, n, (3, 2))))
        np.testing.assert_array_equal(got["prod"], np.prod(_inputs(1, n, (3, 2), "int64"), axis=0))
        np.testing.assert_array_equal(got["max"], np.max(_inputs(1, n, (3, 2), "int32"), axis=0))
        np.testing.assert_allclose(got["avg"], sum(_inputs(1, n, (3, 2), "float64")) / n, rtol=1e-15)
        np.testing.assert_array_equal(got["min"], np.min(_inputs(1, n, (3, 2), "int8"), axis=0))
        reduced = _inputs(2, n, (4,))
        np.testing.assert_array_equal(got["reduce"], sum(reduced) if rank == n - 1 else reduced[rank])
        np.testing.assert_array_equal(got["broadcast"], _inputs(3, n, (5,))[1])
        np.testing.assert_array_equal(got["all_gather"], np.stack(_inputs(4, n, (2, 2))))
        if rank == 0:
            np.testing.assert_array_equal(got["gather"], np.stack(_inputs(5, n, (3,))))
        else:
            assert got["gather"] is None
        np.testing.assert_array_equal(got["scatter"], _inputs(6, n, (n, 2))[n - 1][rank])
        np.testing.assert_array_equal(got["all_to_all"], np.stack([x[rank] for x in _inputs(7, n, (n, 3))]))
        np.testing.assert_array_equal(got["reduce_scatter"], sum(_inputs(8, n, (n, 2)))[rank:rank + 1])
        np.testing.assert_array_equal(got["out"], np.stack(_inputs(9, n, (2,))))
        np.testing.assert_array_equal(got["one async"], sum(_inputs(10, n, (3,))))
        np.testing.assert_array_equal(got["large"], sum(_inputs(11, n, (600,))))


def carried_mismatch_job(comm):
    """Rank 0 all_reduces a small tensor where the others broadcast one: both carried."""
    from collectives import CollectiveMismatch

    sub = comm.split(0)
    sub.all_reduce(np.ones(1))
    x = _t(1, sub.rank, (3,))
    before = x.numpy().copy()
    try:
        sub.all_reduce(x) if sub.rank == 0 else sub.broadcast(x, 0)
        outcome = "no error"
    except CollectiveMismatch as error:
        outcome = str(error)
    untouched = bool((x.numpy() == before).all())
    ok = sub.all_reduce(torch.ones(2)).tolist() == [float(sub.size)] * 2  # (still in step)
    sub.close()
    return outcome, untouched, ok


@pytest.mark.parametrize("world", [("torch", 3)], indirect=True)
def test_carried_calls_that_differ_are_a_mismatch_on_every_rank_with_x_untouched(world):
    for outcome, untouched, ok in world.run(carried_mismatch_job, [()] * world.size):
        assert "operation differs: all_reduce on rank 0; broadcast on rank" in outcome, outcome
        assert untouched and ok


def reordered_job(comm):
    """Carried calls on a split whose rank order is not torch's (ranks reversed): every rank's row
    must be taken from torch's place of that rank."""
    sub = comm.split(0, key=-comm.rank)
    sub.all_reduce(np.ones(1))
    seen = collections.Counter()
    _counting_payloads(sub._transport, seen)
    r = sub.rank
    got = {"reordered": sub._transport._reordered, "broadcast": sub.broadcast(_t(3, r, (5,)), 0).numpy().copy()}
    x = _t(2, r, (4,), "float64")
    got["all_reduce"] = sub.all_reduce(x).numpy().copy()
    sub.close()
    return got, seen["carried"]


@pytest.mark.parametrize("world", [("torch", 3)], indirect=True)
def test_carried_calls_on_a_reordered_group_take_each_rank_s_row(world):
    n = world.size
    for got, carried in world.run(reordered_job, [()] * n):
        assert got["reordered"] and carried == 2, (got, carried)
        np.testing.assert_array_equal(got["broadcast"], _inputs(3, n, (5,))[0])  # (rank 0: torch's rank 2)
        np.testing.assert_array_equal(got["all_reduce"], sum(_inputs(2, n, (4,), "float64")))


def pair_job(comm):
    """At 2 ranks the round carries up to 4 KiB: a 4 KiB all_reduce carried, one of 4 KiB + 4 not."""
    sub = comm.split(0)
    sub.all_reduce(np.ones(1))
    seen = collections.Counter()
    _counting_payloads(sub._transport, seen)
    got = []
    for elements in (1024, 1025):
        x = _t(12, sub.rank, (elements,))
        sub.all_reduce(x)
        got.append((seen["carried"], x.numpy().copy()))
    sub.close()
    return got


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_at_two_ranks_a_4_kib_call_travels_in_the_check_round(world):
    for (carried, fits), (still, past) in world.run(pair_job, [()] * 2):
        assert (carried, still) == (1, 1)
        np.testing.assert_array_equal(fits, sum(_inputs(12, 2, (1024,))))
        np.testing.assert_array_equal(past, sum(_inputs(12, 2, (1025,))))
