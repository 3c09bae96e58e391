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


def tensor_job(comm, values):
    import torch

    return comm.all_reduce(torch.tensor(values, dtype=torch.float64))


@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True)
def test_jobs_may_take_and_return_torch_tensors(world):
    results = world.run(tensor_job, [([1.0, 2.0],), ([3.0, 4.0],)])
    assert [r.tolist() for r in results] == [[4.0, 6.0]] * 2
