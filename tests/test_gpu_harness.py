"""The GPU check's own harness, run in CI on host tensors over the CPU transports.

tests/test_gpu.py runs once in a while on a lent GPU machine; a mistake in its jobs or in
its comparisons would waste that run. Here the same job and the same checks run with
``library="cpu"`` (host tensors, Gloo and MPI), so they are known to pass on correct
results, and to fail on a wrong one, before any GPU sees them.
"""

import pytest
from test_gpu import check_grid, check_split, check_syncbn, grid_job

from collectives.testing.pool import get_pool


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [("mpi", 2), ("torch", 3)], indirect=True)
def test_gpu_grid_checks_pass_on_host_tensors(world):
    check_grid(world, "cpu")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [("mpi", 3), ("torch", 3)], indirect=True)
def test_gpu_split_check_passes_on_host_tensors(world):
    check_split(world, "cpu")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True)
def test_gpu_syncbn_check_passes_on_host_tensors(world):
    check_syncbn(world, "cpu", with_torch=False)


def corrupt_sum_job(comm, library, inputs, root):
    results = grid_job(comm, library, inputs, root)
    key = ("all_reduce", "int16", "sum")
    results[key] = results[key] + (comm.rank == 0)  # one rank off by one (numpy: wraps)
    return results


@pytest.mark.timeout(300)
def test_gpu_grid_checks_catch_a_wrong_result(monkeypatch):
    import test_gpu

    monkeypatch.setattr(test_gpu, "grid_job", corrupt_sum_job)
    with pytest.raises(AssertionError, match="int16"):
        check_grid(get_pool("mpi", 2), "cpu")
