"""The torch route's small rounds on a group with a CPU backend (Gloo): with the default check an
uneven collective's counts travel in its check's round (one small all_to_all of the word and the
counts to every rank), so it makes one small round before its data, as a raw program that must
learn the counts does. Results against numpy on every rank's inputs; the rounds counted on the
transport.
"""

import collections

import numpy as np
import pytest
import torch

CALLS = 3


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


def rounds_job(comm):
    """Uneven calls on a new communicator after its first call (always compared in full): the
    transport's small rounds counted, the results."""
    sub = comm.split(0)
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


@pytest.mark.parametrize("world", [("torch", 3)], indirect=True)
def test_an_uneven_calls_counts_travel_in_its_check_round_on_gloo(world):
    for rank, (seen, got) in enumerate(world.run(rounds_job, [()] * world.size)):
        assert seen == {"_agree_counts": 2 * CALLS}, seen  # (no exchange of its own)
        to_me, gathered, counts = _expected(rank, world.size)
        for name, *result in got:
            if name == "all_to_all":
                np.testing.assert_array_equal(result[0], to_me)
            else:
                np.testing.assert_array_equal(result[0], gathered)
                assert result[1] == counts

