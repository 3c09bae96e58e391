"""reduce on the torch backend over Gloo (backends/torch_reduce.py): off dst x is never the
process group's scratch. At two ranks the rank off dst sends x to dst (torch's send, which only
reads it) and dst reduces what it receives into x, with the reserved tag; on more ranks a kept
copy goes to Gloo's reduce. Past the check's round (calls it does not carry) and with the check
off, of every kind torch reduces as it is, blocking and asynchronous, from every root, of plain
tensors, non-contiguous ones and numpy arrays. The reference is numpy on every rank's input
(small integers: every sum and product is exact; float64 for the average)."""

import os

import numpy as np
import pytest
import torch

DEBUG = "COLLECTIVES_DEBUG"
COUNT = 3000  # past the check's round at every size (it carries 4 KiB at two ranks)
KINDS = (("float32", "sum"), ("float64", "avg"), ("int64", "max"), ("int32", "min"), ("float32", "prod"),
         ("int64", "sum"))


def _data(seed, rank, dtype, count=COUNT):
    # (products of 2 or 3 values of -2..2 are exact in every dtype)
    return np.random.default_rng([seed, rank]).integers(-2, 3, count).astype(dtype)


def _split(comm, level):
    kept = os.environ.get(DEBUG)
    if level is None:
        os.environ.pop(DEBUG, None)
    else:
        os.environ[DEBUG] = level
    try:
        return comm.split(0)
    finally:
        if kept is None:
            os.environ.pop(DEBUG, None)
        else:
            os.environ[DEBUG] = kept


def _gloo_ops(run):
    """The Gloo operations ``run()`` makes on this thread (torch's profiler)."""
    from torch.profiler import profile

    with profile() as prof:
        run()
    return sorted({e.name for e in prof.events() if e.name.startswith("gloo:") and e.name != "gloo:all_to_all"})


def reduce_job(comm, level):
    sub = _split(comm, level)
    r, n = sub.rank, sub.size
    got = {}
    try:
        for root in range(n):
            for seed, (dtype, op) in enumerate(KINDS):
                for mode in ("blocking", "async"):
                    x = torch.from_numpy(_data(seed, r, dtype))
                    handle = sub.reduce(x, op, root, async_op=mode == "async")
                    assert (handle.wait() if mode == "async" else handle) is x
                    got[root, dtype, op, mode] = x.numpy().copy()
            strided = torch.from_numpy(_data(20, r, "float32", 2 * COUNT).reshape(COUNT, 2)).t()
            sub.reduce(strided, "sum", root)
            got[root, "strided"] = strided.numpy().copy()
            array = _data(21, r, "float64")
            sub.reduce(array, "sum", root)
            got[root, "numpy"] = array.copy()
        # What runs at dst and off it: at two ranks a send and a receive, no Gloo reduce.
        x = torch.from_numpy(_data(22, r, "float32"))
        got["ops"] = _gloo_ops(lambda: sub.reduce(x, "sum", 0))
        got["ops async"] = _gloo_ops(lambda: sub.reduce(x, "sum", 1, async_op=True).wait())
    finally:
        sub.close()
    return got


def _expected(n, rank):
    every = lambda seed, dtype, count=COUNT: [_data(seed, k, dtype, count).astype("float64") for k in range(n)]  # noqa: E731
    fold = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min, "prod": np.prod}
    want = {}
    for root in range(n):
        here = rank == root
        for seed, (dtype, op) in enumerate(KINDS):
            for mode in ("blocking", "async"):
                want[root, dtype, op, mode] = fold[op](every(seed, dtype), axis=0).astype(dtype) if here \
                    else _data(seed, rank, dtype)
        mine = _data(20, rank, "float32", 2 * COUNT).reshape(COUNT, 2).T
        want[root, "strided"] = np.sum(every(20, "float32", 2 * COUNT), axis=0).reshape(COUNT, 2).T.astype(
            "float32") if here else mine
        want[root, "numpy"] = np.sum(every(21, "float64"), axis=0) if here else _data(21, rank, "float64")
    pair = n == 2
    want["ops"] = (["gloo:recv"] if rank == 0 else ["gloo:send"]) if pair else ["gloo:reduce"]
    want["ops async"] = (["gloo:recv"] if rank == 1 else ["gloo:send"]) if pair else ["gloo:reduce"]
    return want


@pytest.mark.parametrize("level", [None, "0"], ids=["check", "no-check"])
@pytest.mark.parametrize("world", [("torch", 2), ("torch", 3)], indirect=True, ids=["torch-2", "torch-3"])
def test_reduce_leaves_x_off_dst_and_matches_numpy(world, level):
    n = world.size
    for rank, got in enumerate(world.run(reduce_job, [(level,)] * n)):
        want = _expected(n, rank)
        assert got.keys() == want.keys()
        for key, value in got.items():
            if key in ("ops", "ops async"):
                assert value == want[key], f"{key} on rank {rank}"
            else:
                np.testing.assert_array_equal(value, want[key], err_msg=f"{key} on rank {rank}")
