"""The torch transport's default check on Gloo: one small round a call (up to 8 ranks an all_to_all
of a block to every rank, else an all_reduce of one int64), of tensors made once per transport (a
new tensor each call made the round about half a raw Gloo round slower), whose word still tells
the calls apart and lets every call's data through right."""

from __future__ import annotations

import numpy as np
import pytest


def check_round_job(comm):
    import torch  # noqa: PLC0415

    child = comm.split(0)  # a transport of its own: its own tensor
    x = torch.arange(3, dtype=torch.float32)
    tensors = []
    for c in (comm, child, comm, child):
        c.all_reduce(x)  # (the first call of each compares fingerprints in full; the rest, the word)
        c.broadcast(x, src=c.size - 1)
        arrays = c._transport._counts_arrays  # (the round's blocks and their tensors, once it ran)
        tensors.append(None if arrays is None else arrays[2])
    child.close()
    return [id(t) for t in tensors], [t is not None for t in tensors], x.numpy()


@pytest.mark.parametrize("world", [("torch", 2), ("torch", 3)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
def test_the_check_reuses_one_tensor_per_transport_and_the_data_stays_right(world):
    results = world.run(check_round_job)
    want = np.arange(3, dtype=np.float64)
    for _ in range(4):
        want = want * world.size  # all_reduce (SUM) of equal arrays, then a broadcast of the same
    for ids, made, got in results:
        assert all(made), "the check's round ran without its tensor"
        assert ids[0] == ids[2] and ids[1] == ids[3], "the check made a new tensor for a call"
        assert ids[0] != ids[1], "a split shares its parent's check tensor"
        np.testing.assert_array_equal(got, want)
