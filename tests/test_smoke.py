import numpy as np
import pytest


def sum_job(comm, x):
    return comm.all_reduce(x, "sum")


@pytest.mark.parametrize("world", [("local", 1), ("mpi", 2), ("torch", 2)], indirect=True)
def test_all_reduce_sums_every_rank(world):
    inputs = [np.full(3, r + 1, np.float64) for r in range(world.size)]
    results = world.run(sum_job, [(x,) for x in inputs])
    for got in results:
        np.testing.assert_array_equal(got, np.sum(inputs, axis=0))
