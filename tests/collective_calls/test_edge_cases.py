"""Shapes and call patterns beyond the grid: zero-size and 0-d arrays, non-contiguous views,
a 64 MiB message, MPI's large-count chunking, split, async handles, and init()."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

import collectives

WORLDS = [("local", 1), ("mpi", 3), ("torch", 3)]


def world_id(param):
    return f"{param[0]}-{param[1]}"


def _array(kind, values):
    if kind == "numpy":
        return np.array(values, copy=True)
    import torch

    return torch.from_numpy(np.array(values, copy=True))


def _numpy(x):
    return x.copy() if isinstance(x, np.ndarray) else x.numpy().copy()


# -- zero-size and 0-d ------------------------------------------------------------------------

def odd_shapes_job(comm, kind):
    rank, size = comm.rank, comm.size
    out = {}
    for shape in [(0,), (2, 0), ()]:
        x = _array(kind, np.full(shape, rank + 1, np.float32))
        out[("all_reduce", shape)] = _numpy(comm.all_reduce(x))
        x = _array(kind, np.full(shape, rank + 1, np.int64))
        out[("broadcast", shape)] = _numpy(comm.broadcast(x, src=size - 1))
        out[("all_gather", shape)] = _numpy(comm.all_gather(_array(kind, np.full(shape, rank, np.int16))))
    x = _array(kind, np.zeros((0, 4), np.float64))
    out[("reduce_scatter", (0, 4))] = _numpy(comm.reduce_scatter(x))
    try:
        comm.reduce_scatter(_array(kind, np.float32(1.0)))
    except ValueError as error:
        out["reduce_scatter 0-d"] = str(error)
    return out


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_zero_size_and_zero_dimensional_arrays(world, kind):
    n = world.size
    for out in world.run(odd_shapes_job, args=(kind,)):
        for shape in [(0,), (2, 0), ()]:
            np.testing.assert_array_equal(out[("all_reduce", shape)], np.full(shape, n * (n + 1) / 2))
            assert out[("all_reduce", shape)].shape == shape
            np.testing.assert_array_equal(out[("broadcast", shape)], np.full(shape, n))
            gathered = out[("all_gather", shape)]
            assert gathered.shape == (n, *shape) and gathered.dtype == np.int16
            np.testing.assert_array_equal(gathered, np.arange(n, dtype=np.int16).reshape((n,) + (1,) * len(shape))
                                          * np.ones((n, *shape), np.int16))
        assert out[("reduce_scatter", (0, 4))].shape == (0, 4)
        assert "0-d" in out["reduce_scatter 0-d"]


# -- non-contiguous inputs: handled through a contiguous copy, results written back -----------

def strided_job(comm, kind):
    rank = comm.rank
    base = _array(kind, np.zeros((4, 6), np.float32))
    view = base[:, ::2] if kind == "numpy" else base[:, ::2]
    view[...] = rank + 1
    comm.all_reduce(view)
    transposed = _array(kind, np.arange(12, dtype=np.float64).reshape(3, 4) * (rank + 1)).T
    comm.broadcast(transposed, src=comm.size - 1)
    reversed_ = _array(kind, np.arange(6, dtype=np.int32) + rank)
    if kind == "numpy":
        reversed_ = reversed_[::-1]
    else:
        reversed_ = reversed_.flip(0)  # torch has no negative strides; flip copies
    gathered = comm.all_gather(transposed)
    return _numpy(base), _numpy(transposed), _numpy(gathered), _numpy(comm.all_reduce(reversed_, "max"))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_non_contiguous_inputs_are_reduced_in_place(world, kind):
    n = world.size
    for base, transposed, gathered, reversed_ in world.run(strided_job, args=(kind,)):
        expected = np.zeros((4, 6), np.float32)
        expected[:, ::2] = n * (n + 1) / 2
        np.testing.assert_array_equal(base, expected)  # the other columns untouched
        np.testing.assert_array_equal(transposed, (np.arange(12).reshape(3, 4) * n).T)
        assert gathered.shape == (n, 4, 3)
        np.testing.assert_array_equal(gathered[0], transposed)
        np.testing.assert_array_equal(reversed_, (np.arange(6) + n - 1)[::-1])


# -- one large message -----------------------------------------------------------------------

LARGE = 16 * 2**20  # float32 elements: 64 MiB


def _large_input(rank):
    # Small integers: float32 sums are exact whatever the order, so bytes can be compared.
    return (np.arange(LARGE, dtype=np.int64) % 1024 + rank).astype(np.float32)


def large_job(comm):
    x = _large_input(comm.rank)
    comm.all_reduce(x)
    return hashlib.sha256(x.tobytes()).hexdigest(), float(x[12345])


@pytest.mark.parametrize("world", [("mpi", 2), ("torch", 2)], indirect=True, ids=world_id)
def test_a_64_mib_all_reduce_is_exact_and_identical_on_every_rank(world):
    expected = sum(_large_input(r).astype(np.float64) for r in range(world.size)).astype(np.float32)
    digest = hashlib.sha256(expected.tobytes()).hexdigest()
    results = world.run(large_job, timeout=120)
    assert [r[0] for r in results] == [digest] * world.size


# -- MPI's pieces of at most MAX_COUNT elements (2**31-1 in production) ------------------------

def chunked_job(comm, max_count):
    import collectives.backends.mpi as mpi_backend

    saved, mpi_backend.MAX_COUNT = mpi_backend.MAX_COUNT, max_count
    try:
        rank, size = comm.rank, comm.size
        x = np.arange(2500, dtype=np.int64) + rank
        comm.all_reduce(x)
        b = np.arange(2500, dtype=np.float64) * (rank + 1)
        comm.broadcast(b, src=size - 1)
        handle = comm.all_reduce(np.full(2500, rank, np.int32), "max", async_op=True)
        gathered = comm.all_gather(np.full(2500, rank, np.uint8))
        scattered = comm.reduce_scatter(np.ones((size, 2500), np.float32) * (rank + 1))
        return x, b, handle.wait(), gathered, scattered
    finally:
        mpi_backend.MAX_COUNT = saved


@pytest.mark.parametrize("world", [("mpi", 3)], indirect=True, ids=world_id)
def test_mpi_messages_above_max_count_go_in_pieces(world):
    n = world.size
    for x, b, maxed, gathered, scattered in world.run(chunked_job, args=(1000,)):
        np.testing.assert_array_equal(x, n * np.arange(2500) + n * (n - 1) // 2)
        np.testing.assert_array_equal(b, np.arange(2500) * n)
        np.testing.assert_array_equal(maxed, np.full(2500, n - 1))
        np.testing.assert_array_equal(gathered, np.repeat(np.arange(n, dtype=np.uint8), 2500).reshape(n, 2500))
        np.testing.assert_array_equal(scattered, np.full((1, 2500), n * (n + 1) / 2))


# -- split ------------------------------------------------------------------------------------

def split_job(comm):
    rank = comm.rank
    halves = comm.split(rank % 2)
    total = halves.all_reduce(np.array([rank], np.int64))
    # key reverses the order inside each group.
    reversed_ = comm.split(rank % 2, key=-rank)
    order = reversed_.all_gather(np.array([rank], np.int64)).ravel()
    root_value = reversed_.broadcast(np.array([rank], np.int64), src=0)
    scattered = reversed_.reduce_scatter(rank * 10 + np.arange(reversed_.size, dtype=np.int64))
    nobody = comm.split(None if rank == 0 else 7)
    nested = halves.split(0).all_reduce(np.array([1], np.int64)) if halves.size else None
    result = {
        "halves": (halves.rank, halves.size, int(total[0])),
        "reversed": (reversed_.rank, order.tolist(), int(root_value[0]), scattered.tolist()),
        "nobody": None if nobody is None else (nobody.rank, nobody.size),
        "nested": None if nested is None else int(nested[0]),
    }
    halves.close()
    return result


@pytest.mark.parametrize("world", [("local", 1), ("mpi", 4), ("torch", 4)], indirect=True, ids=world_id)
def test_split_groups_reduce_independently_and_follow_key_order(world):
    n = world.size
    results = world.run(split_job)
    for rank, out in enumerate(results):
        group = [r for r in range(n) if r % 2 == rank % 2]
        assert out["halves"] == (group.index(rank), len(group), sum(group))
        by_key = sorted(group, key=lambda r: -r)
        new_rank, order, root_value, scattered = out["reversed"]
        assert new_rank == by_key.index(rank)
        assert order == by_key
        assert root_value == by_key[0]
        assert scattered == [sum(r * 10 + new_rank for r in group)]
        assert out["nobody"] == (None if rank == 0 else (rank - 1, n - 1))
        assert out["nested"] == len(group)


# -- async handles ----------------------------------------------------------------------------

def async_job(comm, kind):
    rank = comm.rank
    xs = [_array(kind, np.full(4, rank + i, np.float64)) for i in range(3)]
    handles = [comm.all_reduce(x, "sum", async_op=True) for x in xs]
    b = _array(kind, np.full(2, rank, np.int32))
    bh = comm.broadcast(b, src=comm.size - 1, async_op=True)
    avg = _array(kind, np.full(3, float(rank), np.float32))
    ah = comm.all_reduce(avg, "avg", async_op=True)
    results = [_numpy(h.wait()) for h in handles]
    assert bh.wait() is b and ah.wait() is avg
    assert all(h.is_completed() for h in handles)
    return results, _numpy(b), _numpy(avg)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_async_handles_complete_on_wait_in_any_number(world, kind):
    n = world.size
    for results, b, avg in world.run(async_job, args=(kind,)):
        for i, got in enumerate(results):
            np.testing.assert_array_equal(got, np.full(4, n * (n - 1) / 2 + n * i))
        np.testing.assert_array_equal(b, np.full(2, n - 1))
        np.testing.assert_allclose(avg, np.full(3, (n - 1) / 2), rtol=1e-7)


# -- init() ------------------------------------------------------------------------------------

def init_job(comm):
    again = collectives.init()
    named = collectives.init(comm.backend)
    try:
        collectives.init("local" if comm.backend != "local" else "mpi")
        switched = "no error"
    except ValueError as error:
        switched = str(error)
    return again is comm, named is comm, switched


@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_a_second_init_returns_the_same_communicator(world):
    for same, named, switched in world.run(init_job):
        assert same and named
        assert "already initialized" in switched


def test_unknown_backend_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid: auto, local, torch, mpi, cupy"):
        collectives.init("nccl")
