"""The GPU check's own harness, run in CI on host tensors over the CPU transports.

tests/gpu/test_gpu.py runs once in a while on a lent GPU machine; a mistake in its jobs or in
its comparisons would waste that run. Here the same job and the same checks run with
``library="cpu"`` (host tensors, Gloo and MPI), so they are known to pass on correct
results, and to fail on a wrong one, before any GPU sees them.
"""

import pytest
from test_gpu import (
    check_collective_set,
    check_grid,
    check_p2p,
    check_split,
    check_syncbn,
    collective_set_job,
    grid_job,
)

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
@pytest.mark.parametrize("world", [("mpi", 2), ("torch", 3)], indirect=True)
def test_gpu_collective_set_checks_pass_on_host_tensors(world):
    check_collective_set(world, "cpu")


def corrupt_scatter_job(comm, library, inputs, splits, counts):
    results = collective_set_job(comm, library, inputs, splits, counts)
    key = ("scatter_out_async", "bfloat16", "")
    results[key] = results[key] * (1 + comm.rank)  # rank 1's row doubled
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("job,corrupt,check,match", [
    ("grid_job", corrupt_sum_job, check_grid, "int16"),
    ("collective_set_job", corrupt_scatter_job, check_collective_set, "scatter_out_async bfloat16  on rank 1"),
], ids=["grid", "collective-set"])
def test_gpu_checks_catch_a_wrong_result(monkeypatch, job, corrupt, check, match):
    import test_gpu

    monkeypatch.setattr(test_gpu, job, corrupt)
    with pytest.raises(AssertionError, match=match):
        check(get_pool("mpi", 2), "cpu")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [("mpi", 2), ("torch", 3)], indirect=True)
def test_gpu_p2p_check_passes_on_host_tensors(world):
    for recv_first in (False, True):
        check_p2p(world, "cpu", recv_first, n=1 << 16)
