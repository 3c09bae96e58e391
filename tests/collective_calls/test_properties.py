"""Properties of every collective, on real ranks of every CPU backend, checked by Hypothesis.

Hypothesis draws dtypes, ops, shapes (0-d and 0-size included), per-rank arrays with
edge values (NaN, +-inf, -0.0, integer extremes, subnormals), array library (numpy or
torch), layout (contiguous or a strided view) and roots in the test process; each
example is one job sent to a warm pool of ranks (:mod:`collectives.testing`), and the
per-rank results are checked here against the numpy reference of
:mod:`collectives.testing.reference` (its ``float_tolerance`` states and derives the
float error bound: ``(size - 1) * eps * sum|x_i|`` per element for SUM).

Profile: ``COLLECTIVES_HYPOTHESIS_PROFILE`` (default ``ci``: 50 examples per test and
world, derandomized). ``world`` is session-scoped, so pytest runs the tests world by
world and only one pool is needed at a time.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.ops import FLOAT_DTYPES, ReduceOp, check_reduction, resolve_op
from collectives.testing import as_array, check_reduction_result, same_bits, to_numpy, worlds
from collectives.testing import strategies as cst

WORLDS = worlds((1, 2, 3, 4))
worlds = pytest.mark.parametrize("world", WORLDS, indirect=True,
                                 ids=[f"{b}-{s}" for b, s in WORLDS])


# -- jobs (run on every rank; module level so that the ranks can import them) -------------

def all_reduce_job(comm, values, dtype, op, library, layout, async_op):
    x = as_array(values, dtype, library, layout)
    out = comm.all_reduce(x, op, async_op=async_op)
    if async_op:
        out = out.wait()
    assert out is x, "all_reduce must return its (in-place) input"
    return to_numpy(x)


def broadcast_job(comm, values, dtype, library, layout, src):
    x = as_array(values, dtype, library, layout)
    assert comm.broadcast(x, src) is x, "broadcast must return its (in-place) input"
    return to_numpy(x)


def all_gather_job(comm, values, dtype, library, layout):
    x = as_array(values, dtype, library, layout)
    gathered = comm.all_gather(x)
    return to_numpy(gathered), type(gathered) is type(x), same_bits(to_numpy(x), values)


def reduce_scatter_job(comm, values, dtype, op, library, layout):
    x = as_array(values, dtype, library, layout)
    block = comm.reduce_scatter(x, op)
    untouched = same_bits(to_numpy(x), values)
    full = comm.all_reduce(as_array(values, dtype, library, layout), op)
    return to_numpy(block), to_numpy(full), type(block) is type(x), untouched


def disallowed_job(comm, values, dtype, op, library, collective):
    x = as_array(values, dtype, library)
    try:
        getattr(comm, collective)(x, op)
        error = None
    except Exception as caught:  # noqa: BLE001  (which exception is what the test checks)
        error = (type(caught).__name__, str(caught))
    untouched = same_bits(to_numpy(x), values)
    # Nothing was sent: the ranks are still in step and the next collective works.
    after = comm.all_reduce(np.ones(1, dtype=np.int64))
    return error, untouched, int(after[0])


# -- helpers --------------------------------------------------------------------------------

def _draw_library(data, dtype):
    """The array library of a drawn case: torch for bfloat16 (numpy has none), else drawn."""
    return "torch" if dtype == "bfloat16" else data.draw(cst.array_libraries(), label="library")


def _layout_and_library(data, dtype):
    library = _draw_library(data, dtype)
    return library, data.draw(cst.array_layouts(), label="layout")


def _assert_identical_on_every_rank(results, what):
    # NaN payloads may differ: x86 adds two NaNs into the first one's payload, and ranks
    # add in different orders (a finding reported to the lead; every other bit must agree).
    for rank, got in enumerate(results):
        assert same_bits(got, results[0], nan_payloads=False), \
            f"{what}: rank {rank} differs from rank 0:\n{got!r}\n{results[0]!r}"


def _exact(dtype, op):
    return dtype not in FLOAT_DTYPES or resolve_op(op) in (ReduceOp.MIN, ReduceOp.MAX)


# -- properties -----------------------------------------------------------------------------

@worlds
@given(data=st.data())
def test_all_reduce_matches_numpy_and_is_identical_on_every_rank(world, data):
    dtype, op = data.draw(cst.dtype_and_op(spellings=True), label="dtype, op")
    shape = data.draw(cst.shapes(), label="shape")
    inputs = data.draw(cst.rank_arrays(dtype, shape, world.size), label="inputs")
    library, layout = _layout_and_library(data, dtype)
    async_op = data.draw(st.booleans(), label="async_op")
    results = world.run(all_reduce_job, [(x, dtype, op, library, layout, async_op) for x in inputs])
    _assert_identical_on_every_rank(results, "all_reduce")
    check_reduction_result(results[0], inputs, dtype, op, what="all_reduce")


@worlds
@given(data=st.data())
def test_broadcast_reproduces_the_root_bytes(world, data):
    dtype = data.draw(cst.dtypes(), label="dtype")
    shape = data.draw(cst.shapes(), label="shape")
    inputs = data.draw(cst.rank_arrays(dtype, shape, world.size), label="inputs")
    src = data.draw(cst.roots(world.size), label="src")
    library, layout = _layout_and_library(data, dtype)
    results = world.run(broadcast_job, [(x, dtype, library, layout, src) for x in inputs])
    for rank, got in enumerate(results):
        assert same_bits(got, inputs[src]), f"rank {rank} got {got!r}, root {src} sent {inputs[src]!r}"


@worlds
@given(data=st.data())
def test_all_gather_rows_are_every_rank_input(world, data):
    dtype = data.draw(cst.dtypes(), label="dtype")
    shape = data.draw(cst.shapes(), label="shape")
    inputs = data.draw(cst.rank_arrays(dtype, shape, world.size), label="inputs")
    library, layout = _layout_and_library(data, dtype)
    results = world.run(all_gather_job, [(x, dtype, library, layout) for x in inputs])
    for rank, (gathered, same_type, untouched) in enumerate(results):
        assert same_type and untouched, f"rank {rank}: result type kept {same_type}, input untouched {untouched}"
        assert gathered.shape == (world.size, *shape)
        for source in range(world.size):
            assert same_bits(gathered[source], inputs[source]), f"rank {rank}, row {source}"


@worlds
@given(data=st.data())
def test_reduce_scatter_is_this_ranks_slice_of_all_reduce(world, data):
    dtype, op = data.draw(cst.dtype_and_op(spellings=True), label="dtype, op")
    shape = data.draw(cst.shapes(min_dims=1, first=world.size), label="shape")
    inputs = data.draw(cst.rank_arrays(dtype, shape, world.size), label="inputs")
    library, layout = _layout_and_library(data, dtype)
    results = world.run(reduce_scatter_job, [(x, dtype, op, library, layout) for x in inputs])
    rows = shape[0] // world.size
    for rank, (block, full, same_type, untouched) in enumerate(results):
        assert same_type and untouched, f"rank {rank}: result type kept {same_type}, input untouched {untouched}"
        mine = slice(rank * rows, (rank + 1) * rows)
        check_reduction_result(block, [x[mine] for x in inputs], dtype, op, what=f"rank {rank}'s block")
        if _exact(dtype, op):
            assert same_bits(block, full[mine], nan_payloads=False), f"rank {rank}: block != all_reduce slice"


@worlds
@given(data=st.data())
def test_disallowed_dtype_and_op_raise_the_same_type_error_everywhere(world, data):
    dtype, op = data.draw(cst.disallowed_dtype_and_op(spellings=True), label="dtype, op")
    shape = data.draw(cst.shapes(min_dims=1, first=world.size), label="shape")
    inputs = data.draw(cst.rank_arrays(dtype, shape, world.size), label="inputs")
    library = _draw_library(data, dtype)
    collective = data.draw(st.sampled_from(["all_reduce", "reduce_scatter"]), label="collective")
    with pytest.raises(TypeError) as expected:
        check_reduction(dtype, op)
    results = world.run(disallowed_job, [(x, dtype, op, library, collective) for x in inputs])
    for rank, (error, untouched, after) in enumerate(results):
        assert error == ("TypeError", str(expected.value)), f"rank {rank} raised {error}"
        assert untouched, f"rank {rank}: the input was modified"
        assert after == world.size, f"rank {rank}: the next collective gave {after}"


# -- the rest of the collective set ------------------------------------------------------------
# Fewer worlds and examples than above: each property crosses the rank pool per example.

NEW_WORLDS = [("local", 1), ("mpi", 1), ("mpi", 3), ("mpi", 4), ("torch", 2), ("torch", 3)]
new_worlds = pytest.mark.parametrize("world", NEW_WORLDS, indirect=True,
                                     ids=[f"{b}-{s}" for b, s in NEW_WORLDS])
few = settings(max_examples=20)


def all_to_all_twice_job(comm, values, dtype, library, splits):
    x = as_array(values, dtype, library)
    there = comm.all_to_all(x, [int(c) for c in splits[comm.rank]])
    back = comm.all_to_all(there, [int(row[comm.rank]) for row in splits])
    return to_numpy(back), same_bits(to_numpy(x), values)


def gather_and_all_gather_job(comm, values, dtype, library, dst):
    x = as_array(values, dtype, library)
    gathered = comm.gather(x, dst)
    everyone = comm.all_gather(x)
    return None if gathered is None else to_numpy(gathered), to_numpy(everyone)


def scatter_job(comm, values, dtype, library, src):
    return to_numpy(comm.scatter(as_array(values, dtype, library), src))


def reduce_and_all_reduce_job(comm, values, dtype, op, library, dst):
    x = as_array(values, dtype, library)
    comm.reduce(x, op, dst)
    y = comm.all_reduce(as_array(values, dtype, library), op)
    return to_numpy(x), to_numpy(y)


def all_gather_v_job(comm, values, dtype, library):
    gathered, counts = comm.all_gather_v(as_array(values, dtype, library))
    return to_numpy(gathered), counts


@new_worlds
@few
@given(data=st.data())
def test_all_to_all_twice_with_the_transposed_splits_is_the_identity(world, data):
    dtype = data.draw(cst.dtypes(), label="dtype")
    splits = data.draw(cst.splits_matrices(world.size), label="splits")
    rest = data.draw(cst.shapes(max_dims=2, max_side=3), label="rest")
    inputs = [data.draw(cst.arrays(dtype, (sum(splits[r]), *rest)), label=f"x{r}")
              for r in range(world.size)]
    library = _draw_library(data, dtype)
    results = world.run(all_to_all_twice_job, [(x, dtype, library, splits) for x in inputs])
    for rank, (back, untouched) in enumerate(results):
        assert untouched and same_bits(back, inputs[rank]), f"rank {rank}: {back!r} != {inputs[rank]!r}"


@new_worlds
@few
@given(data=st.data())
def test_gather_is_all_gather_on_dst(world, data):
    dtype = data.draw(cst.dtypes(), label="dtype")
    shape = data.draw(cst.shapes(), label="shape")
    inputs = data.draw(cst.rank_arrays(dtype, shape, world.size), label="inputs")
    dst = data.draw(cst.roots(world.size), label="dst")
    library = _draw_library(data, dtype)
    results = world.run(gather_and_all_gather_job, [(x, dtype, library, dst) for x in inputs])
    for rank, (gathered, everyone) in enumerate(results):
        if rank == dst:
            assert same_bits(gathered, everyone), f"dst {dst}: gather != all_gather"
        else:
            assert gathered is None, f"rank {rank} is not dst but got {gathered!r}"


@new_worlds
@few
@given(data=st.data())
def test_scatter_gives_every_rank_its_row_of_src(world, data):
    dtype = data.draw(cst.dtypes(), label="dtype")
    rest = data.draw(cst.shapes(max_dims=2), label="rest")
    inputs = data.draw(cst.rank_arrays(dtype, (world.size, *rest), world.size), label="inputs")
    src = data.draw(cst.roots(world.size), label="src")
    library = _draw_library(data, dtype)
    results = world.run(scatter_job, [(x, dtype, library, src) for x in inputs])
    for rank, got in enumerate(results):
        assert same_bits(got, inputs[src][rank]), f"rank {rank}: {got!r} != row of src {src}"


@new_worlds
@few
@given(data=st.data())
def test_reduce_is_all_reduce_on_dst(world, data):
    dtype, op = data.draw(cst.dtype_and_op(spellings=True), label="dtype, op")
    shape = data.draw(cst.shapes(), label="shape")
    inputs = data.draw(cst.rank_arrays(dtype, shape, world.size), label="inputs")
    dst = data.draw(cst.roots(world.size), label="dst")
    library = _draw_library(data, dtype)
    results = world.run(reduce_and_all_reduce_job, [(x, dtype, op, library, dst) for x in inputs])
    reduced, everyone = results[dst]
    check_reduction_result(reduced, inputs, dtype, op, what=f"reduce on dst {dst}")
    if _exact(dtype, op):
        assert same_bits(reduced, everyone, nan_payloads=False), "reduce != all_reduce on dst"
    for rank, (x, _) in enumerate(results):
        if rank != dst:
            assert same_bits(x, inputs[rank]), f"rank {rank} is not dst, but x changed"


@new_worlds
@few
@given(data=st.data())
def test_all_gather_v_is_the_concatenation_of_every_rank(world, data):
    dtype = data.draw(cst.dtypes(), label="dtype")
    counts = data.draw(cst.row_counts(world.size), label="counts")
    rest = data.draw(cst.shapes(max_dims=2, max_side=3), label="rest")
    inputs = [data.draw(cst.arrays(dtype, (counts[r], *rest)), label=f"x{r}") for r in range(world.size)]
    library = _draw_library(data, dtype)
    results = world.run(all_gather_v_job, [(x, dtype, library) for x in inputs])
    expected = np.concatenate(inputs)
    for rank, (gathered, got_counts) in enumerate(results):
        assert got_counts == counts and same_bits(gathered, expected), f"rank {rank}"
