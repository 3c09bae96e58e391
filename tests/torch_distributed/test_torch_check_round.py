"""The torch transport's default check on Gloo: one small all_gather a call, of blocks made once
per transport (a new tensor each call made the round about half a raw Gloo round slower), whose
words tell the calls apart and which carry the uneven collectives' counts, so that those make
two Gloo calls as a raw program that must learn the counts does; every call's data stays right.
The Gloo calls are counted by torch's own profiler."""

from __future__ import annotations

import numpy as np
import pytest

WORLDS = [("torch", 2), ("torch", 3)]


def _gloo_calls(torch, call):
    """``call()``'s result and the names of the Gloo collectives it made (torch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        result = call()
    return result, [event.name for event in profile.events() if event.name.startswith("gloo:")]


def check_round_job(comm):
    import torch  # noqa: PLC0415

    child = comm.split(0)  # a transport of its own: its own blocks
    x = torch.arange(3, dtype=torch.float32)
    tensors = []
    for c in (comm, child, comm, child):
        c.all_reduce(x)  # (the first call of each compares fingerprints in full; the rest, the word)
        c.broadcast(x, src=c.size - 1)
        tensors.append(c._transport._blocks[2])
    child.close()
    return [id(t) for t in tensors], x.numpy()


@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
def test_the_check_reuses_its_blocks_per_transport_and_the_data_stays_right(world):
    results = world.run(check_round_job)
    want = np.arange(3, dtype=np.float64)
    for _ in range(4):
        want = want * world.size  # all_reduce (SUM) of equal arrays, then a broadcast of the same
    for ids, got in results:
        assert ids[0] == ids[2] and ids[1] == ids[3], "the check made new blocks for a call"
        assert ids[0] != ids[1], "a split shares its parent's blocks"
        np.testing.assert_array_equal(got, want)


def uneven_job(comm):
    import torch  # noqa: PLC0415

    rank, size = comm.rank, comm.size
    splits = [1 + (rank + peer) % 2 for peer in range(size)]  # rows this rank sends to each peer
    x = torch.arange(sum(splits) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
    mine = torch.full((rank + 1, 2), float(rank))
    comm.all_reduce(torch.zeros(1))  # the first call compares fingerprints in full
    received, calls = _gloo_calls(torch, lambda: comm.all_to_all(x, splits))
    (gathered, counts), gathered_calls = _gloo_calls(torch, lambda: comm.all_gather_v(mine))
    _, reduce_calls = _gloo_calls(torch, lambda: comm.all_reduce(torch.ones(4)))
    return received.numpy(), calls, gathered.numpy(), counts, gathered_calls, reduce_calls


@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
def test_the_uneven_collectives_counts_travel_in_the_checks_round(world):
    results = world.run(uneven_job)
    size = world.size
    splits = [[1 + (r + peer) % 2 for peer in range(size)] for r in range(size)]
    inputs = [np.arange(sum(splits[r]) * 2, dtype=np.float64).reshape(-1, 2) + 100 * r for r in range(size)]
    for rank, (received, calls, gathered, counts, gathered_calls, reduce_calls) in enumerate(results):
        want = np.concatenate([inputs[r][sum(splits[r][:rank]):sum(splits[r][:rank + 1])] for r in range(size)])
        np.testing.assert_array_equal(received, want)
        np.testing.assert_array_equal(gathered, np.concatenate([np.full((r + 1, 2), r) for r in range(size)]))
        assert counts == [r + 1 for r in range(size)]
        # the check's round with the counts in it, then the data: as raw (counts, then data)
        assert calls == ["gloo:all_gather", "gloo:all_to_all"], calls
        assert gathered_calls[0] == "gloo:all_gather" and len(gathered_calls) == 2, gathered_calls
        assert reduce_calls == ["gloo:all_gather", "gloo:all_reduce"], reduce_calls
