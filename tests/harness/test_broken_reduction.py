"""A deliberately wrong reduction is caught by the property suite's machinery and shrunk.

``wrong_avg`` divides the sum by ``size + 1``. Hypothesis, driving real MPI ranks through
``collectives.testing``, must find a failing example and shrink it to a minimal one: one
element, every rank's value 0 but one (a non-zero sum is what exposes the wrong divisor).
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives.testing import check_reduction_result
from collectives.testing import strategies as cst


def wrong_avg(comm, x):  # the bug under test: AVG as SUM / (size + 1)
    total = comm.all_reduce(x, "sum")
    return total / (comm.size + 1)


def right_avg(comm, x):
    return comm.all_reduce(x, "avg")


def _hunt(world, job):
    """Run a Hypothesis search for a counterexample to ``job`` == AVG; return
    (exception or None, the last failing example = the shrunk one)."""
    failing = []

    @settings(max_examples=60, derandomize=True, database=None, print_blob=False)
    @given(data=st.data())
    def avg_matches_numpy(data):
        shape = data.draw(cst.shapes(max_dims=2, max_side=3))
        inputs = data.draw(cst.rank_arrays("float64", shape, world.size, edges=False))
        results = world.run(job, [(x,) for x in inputs])
        try:
            for got in results:
                check_reduction_result(got, inputs, "float64", "avg")
        except AssertionError:
            failing.append(inputs)
            raise

    try:
        avg_matches_numpy()
    except AssertionError as error:
        return error, failing[-1]
    return None, None


@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True)
def test_wrong_avg_is_caught_and_shrunk_to_a_minimal_example(world):
    error, shrunk = _hunt(world, wrong_avg)
    assert error is not None, "the wrong AVG passed the property"
    assert "elements wrong for AVG" in str(error)
    values = np.concatenate([x.reshape(-1) for x in shrunk])
    assert shrunk[0].size == 1, f"not shrunk to one element: {shrunk}"
    assert np.count_nonzero(values) == 1, f"not shrunk to a single non-zero: {shrunk}"


@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True)
def test_the_right_avg_passes_the_same_search(world):
    error, _ = _hunt(world, right_avg)
    assert error is None, f"the correct AVG failed: {error}"
