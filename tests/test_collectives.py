"""Every collective x every dtype of the table x every op x backends local/torch/mpi x world
sizes 1-4, on real ranks, checked against numpy computed from the same per-rank inputs."""

from __future__ import annotations

import numpy as np
import pytest
from grid import SHAPE, allowed_pairs, disallowed_pairs, dtypes_for, make_input, tolerance

from collectives.ops import ReduceOp
from collectives.testing.reference import as_array, carrier_dtype, reference_reduce, to_numpy

WORLDS = [("local", 1)] + [(backend, size) for backend in ("mpi", "torch") for size in (1, 2, 3, 4)]
KINDS = ["torch", "numpy"]
SEED = 20261202


def world_id(param):
    return f"{param[0]}-{param[1]}"


# -- jobs (run on every rank) -----------------------------------------------------------------

def all_reduce_job(comm, kind, cases):
    """cases: [(dtype, op, values)] -> [(result as numpy, raw bytes)] or the error raised."""
    out = []
    for dtype, op, values in cases:
        x = as_array(values, dtype, kind)
        before = to_numpy(x)
        try:
            returned = comm.all_reduce(x, op)
        except (TypeError, ValueError) as error:
            out.append(("error", type(error).__name__, str(error),
                        np.array_equal(before, to_numpy(x))))
            continue
        assert returned is x, "all_reduce must return its input"
        out.append(("ok", to_numpy(x)))
    return out


def broadcast_job(comm, kind, cases):
    out = []
    for dtype, src, values in cases:
        x = as_array(values, dtype, kind)
        assert comm.broadcast(x, src=src) is x
        out.append(to_numpy(x))
    return out


def all_gather_job(comm, kind, cases):
    out = []
    for dtype, values in cases:
        x = as_array(values, dtype, kind)
        before = to_numpy(x)
        gathered = comm.all_gather(x)
        assert type(gathered) is type(x) and gathered.dtype == x.dtype, (type(gathered), gathered.dtype)
        assert np.array_equal(before, to_numpy(x)), "all_gather modified its input"
        out.append(to_numpy(gathered))
    return out


def reduce_scatter_job(comm, kind, cases):
    out = []
    for dtype, op, values in cases:
        x = as_array(values, dtype, kind)
        try:
            result = comm.reduce_scatter(x, op)
        except (TypeError, ValueError) as error:
            out.append(("error", type(error).__name__, str(error)))
            continue
        assert type(result) is type(x) and result.dtype == x.dtype
        out.append(("ok", to_numpy(result)))
    return out


# -- checks in the test process --------------------------------------------------------------

def assert_reduced(results, inputs, dtype, op, where):
    ref = reference_reduce(inputs, dtype, op)
    tol = tolerance(inputs, dtype, op, ref)
    first = results[0]
    for rank, got in enumerate(results):
        assert got.shape == ref.shape, where
        assert got.tobytes() == first.tobytes(), f"{where}: rank {rank} differs from rank 0"
    got = first.astype(np.float64) if tol.any() else first
    if tol.any():
        assert np.all(np.abs(got - ref) <= tol), (
            f"{where}: max error {np.max(np.abs(got - ref))} above bound {tol.max()}")
    else:
        np.testing.assert_array_equal(got, ref.astype(got.dtype), err_msg=where)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_all_reduce_matches_numpy_for_every_allowed_pair(world, kind):
    pairs = [(d, op) for d, op in allowed_pairs() if d in dtypes_for(kind)]
    per_rank = [(kind, [(d, op, make_input(SEED, r, d, op)) for d, op in pairs])
                for r in range(world.size)]
    results = world.run(all_reduce_job, per_rank)
    for index, (dtype, op) in enumerate(pairs):
        replies = [results[r][index] for r in range(world.size)]
        assert all(reply[0] == "ok" for reply in replies), (dtype, op, replies[0])
        inputs = [per_rank[r][1][index][2] for r in range(world.size)]
        assert_reduced([reply[1] for reply in replies], inputs, dtype, op,
                       f"{world.backend}/{world.size} {kind} {dtype} {op}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_disallowed_pairs_raise_type_error_on_every_rank_and_leave_input(world, kind):
    pairs = [(d, op) for d, op in disallowed_pairs() if d in dtypes_for(kind)]
    per_rank = [(kind, [(d, op, make_input(SEED, r, d, None)) for d, op in pairs])
                for r in range(world.size)]
    results = world.run(all_reduce_job, per_rank)
    for index, (dtype, op) in enumerate(pairs):
        for rank in range(world.size):
            status, type_name, message, untouched = results[rank][index]
            assert (status, type_name) == ("error", "TypeError"), (dtype, op, rank)
            assert dtype in message and op.name in message, message
            assert untouched, f"{dtype} {op}: input modified on rank {rank}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_broadcast_from_every_root_copies_the_roots_bytes(world, kind):
    cases = [(d, src) for d in dtypes_for(kind) for src in range(world.size)]
    per_rank = [(kind, [(d, src, make_input(SEED + src, r, d, None)) for d, src in cases])
                for r in range(world.size)]
    results = world.run(broadcast_job, per_rank)
    for index, (dtype, src) in enumerate(cases):
        expected = per_rank[src][1][index][2].astype(carrier_dtype(dtype))
        for rank in range(world.size):
            assert results[rank][index].tobytes() == expected.tobytes(), (dtype, src, rank)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_all_gather_stacks_every_ranks_input_in_rank_order(world, kind):
    dtypes = dtypes_for(kind)
    per_rank = [(kind, [(d, make_input(SEED, r, d, None)) for d in dtypes]) for r in range(world.size)]
    results = world.run(all_gather_job, per_rank)
    for index, dtype in enumerate(dtypes):
        expected = np.stack([per_rank[r][1][index][1] for r in range(world.size)]).astype(carrier_dtype(dtype))
        for rank in range(world.size):
            assert results[rank][index].shape == (world.size, *SHAPE)
            assert results[rank][index].tobytes() == expected.tobytes(), (dtype, rank)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_reduce_scatter_returns_this_ranks_rows_of_the_reduction(world, kind):
    rows = 2 * world.size
    pairs = [(d, op) for d, op in allowed_pairs() if d in dtypes_for(kind)]
    shape = (rows, 3)
    per_rank = [(kind, [(d, op, make_input(SEED, r, d, op, shape)) for d, op in pairs])
                for r in range(world.size)]
    results = world.run(reduce_scatter_job, per_rank)
    for index, (dtype, op) in enumerate(pairs):
        inputs = [per_rank[r][1][index][2] for r in range(world.size)]
        for rank in range(world.size):
            status, got = results[rank][index]
            assert status == "ok", (dtype, op, got)
            block = slice(2 * rank, 2 * rank + 2)
            assert_reduced([got], [x[block] for x in inputs], dtype, op,
                           f"{world.backend}/{world.size} {kind} {dtype} {op} rank {rank}")


@pytest.mark.parametrize("world", [("local", 1), ("mpi", 3), ("torch", 3)], indirect=True, ids=world_id)
def test_reduce_scatter_refuses_disallowed_pairs_and_indivisible_rows(world):
    per_rank = [("torch", [("float32", ReduceOp.BXOR, np.ones((3, 2), np.float32)),
                           ("int32", ReduceOp.SUM, np.ones((3 * world.size + 1, 2), np.int32))])
                for _ in range(world.size)]
    results = world.run(reduce_scatter_job, per_rank)
    for rank in range(world.size):
        assert results[rank][0][:2] == ("error", "TypeError")
        if world.size > 1:
            assert results[rank][1][:2] == ("error", "ValueError")
            assert "divisible" in results[rank][1][2]
