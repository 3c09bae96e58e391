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
from hypothesis import given
from hypothesis import strategies as st

from collectives.ops import FLOAT_DTYPES, ReduceOp, check_reduction, resolve_op
from collectives.testing import as_array, check_reduction_result, same_bits, to_numpy
from collectives.testing import strategies as cst

WORLDS = [("local", 1)] + [(backend, size) for backend in ("mpi", "torch") for size in (1, 2, 3, 4)]
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

def _layout_and_library(data, dtype):
    library = "torch" if dtype == "bfloat16" else data.draw(cst.array_libraries(), label="library")
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
    library = "torch" if dtype == "bfloat16" else data.draw(cst.array_libraries(), label="library")
    collective = data.draw(st.sampled_from(["all_reduce", "reduce_scatter"]), label="collective")
    with pytest.raises(TypeError) as expected:
        check_reduction(dtype, op)
    results = world.run(disallowed_job, [(x, dtype, op, library, collective) for x in inputs])
    for rank, (error, untouched, after) in enumerate(results):
        assert error == ("TypeError", str(expected.value)), f"rank {rank} raised {error}"
        assert untouched, f"rank {rank}: the input was modified"
        assert after == world.size, f"rank {rank}: the next collective gave {after}"
