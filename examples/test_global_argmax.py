# run: python -m pytest -q -p collectives.testing.plugin examples/test_global_argmax.py
"""Property-testing your own reduction with collectives.testing.

``global_argmax`` is a reduction written by a user on top of the collectives: where is the
largest element over every rank's array (its value, the rank holding it, the index there;
ties go to the lowest rank, then the lowest index, as numpy's argmax picks the first)? The
test draws per-rank arrays with Hypothesis, edge values included (infinities, -0.0, the
dtype's extremes), runs the reduction on 3 real MPI ranks started once by mpiexec, and checks
every rank's answer against numpy on the concatenated arrays.

The pytest plugin (the ``world`` fixture, Hypothesis profiles, the check that no rank outlives
the session) is opt-in: ``-p collectives.testing.plugin`` on the command line, or
``pytest_plugins = ["collectives.testing.plugin"]`` in your conftest.py.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from collectives.testing import strategies as cst


def global_argmax(comm, x):
    """(value, rank, index) of the largest element of every rank's 1-d ``x``; runs on every rank."""
    i = int(np.argmax(x))
    mine = np.array([x[i], i], dtype=np.float64)
    every = comm.all_gather(mine)  # shape (size, 2): each rank's best and where it is
    rank = int(np.argmax(every[:, 0]))  # the first rank with the largest value
    return every[rank, 0], rank, int(every[rank, 1])


@pytest.mark.parametrize("world", [("mpi", 3)], indirect=True)
@given(data=st.data())
def test_global_argmax_is_numpys_argmax_of_the_concatenation(world, data):
    length = data.draw(st.integers(1, 6))
    xs = data.draw(cst.rank_arrays("float64", (length,), world.size, allow_nan=False))
    flat = np.concatenate(xs)
    where = int(np.argmax(flat))
    want = (flat[where], where // length, where % length)
    for got in world.run(global_argmax, [(x,) for x in xs]):
        assert got == want
