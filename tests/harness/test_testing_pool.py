"""The rank pool itself: failures come back as errors, never as a hung or poisoned session.

These tests use their own pools (not the session's shared ones), since they break them on purpose.
"""

import os
import threading

import numpy as np
import pytest

from collectives.testing import RankCrashed, RankError, RankPool, RankTimeout, cpu_backends, get_pool

BACKENDS = cpu_backends()


def sum_job(comm, x):
    return comm.all_reduce(x, "sum")


def identity_job(comm):
    return comm.rank, comm.size, comm.backend, os.getpid()


def raise_on_rank_1(comm):
    if comm.rank == 1:
        return 1 // (comm.rank - 1)  # ZeroDivisionError, on this line
    return comm.rank


def raise_everywhere(comm, message):
    raise ValueError(f"{message} from rank {comm.rank}")


def rank_1_rejects_large_values(comm, value):
    """Rank 1 raises before the collective that rank 0 is already waiting in."""
    if comm.rank == 1 and value >= 7:
        raise ValueError(f"rank 1 rejects {value}")
    return float(comm.all_reduce(np.array([float(value)]))[0])


def hang_on_rank_0(comm):
    if comm.rank == 0:
        threading.Event().wait()  # never set: this rank hangs until the pool kills it
    return comm.rank


def exit_on_rank_1(comm):
    if comm.rank == 1:
        os._exit(3)  # dies without a word, as a segfault would
    return comm.rank


def _works(pool):
    inputs = [np.arange(4, dtype=np.int64) * (r + 1) for r in range(pool.size)]
    for got in pool.run(sum_job, [(x,) for x in inputs], timeout=60):
        np.testing.assert_array_equal(got, np.sum(inputs, axis=0))


@pytest.fixture(params=BACKENDS, scope="module")
def pool(request):
    with RankPool(request.param, 2) as pool:
        yield pool


def test_results_come_back_in_rank_order(pool):
    results = pool.run(identity_job)
    assert [r[:3] for r in results] == [(0, 2, pool.backend), (1, 2, pool.backend)]
    assert len({r[3] for r in results}) == 2  # two processes


def test_exception_on_one_rank_comes_back_with_its_traceback(pool):
    with pytest.raises(RankError) as caught:
        pool.run(raise_on_rank_1, timeout=30)
    error = caught.value
    assert sorted(error.errors) == [1] and error.results == {0: 0}
    remote = error.errors[1]
    assert remote.type_name == "ZeroDivisionError"
    assert "raise_on_rank_1" in remote.traceback and "1 // (comm.rank - 1)" in remote.traceback
    assert "rank 1: ZeroDivisionError" in str(error)
    starts = pool.starts
    _works(pool)  # the ranks that did not raise are still in step: no restart needed
    assert pool.starts == starts


def test_a_rank_failing_in_a_hypothesis_test_is_reported_at_once_and_the_ranks_survive(pool):
    """Hypothesis runs a property whose rank 1 raises for some examples while rank 0 waits in an
    all_reduce: every failing example (shrinking runs many) comes back at once with rank 1's
    traceback (rank 0 hears that rank 1 gave up on the communicator), the pool is never
    restarted, and the next job runs on the same ranks."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    starts, runs = pool.starts, []

    @settings(max_examples=30, database=None, deadline=None, derandomize=True)
    @given(st.integers(0, 20))
    def property_of_the_sum(value):
        runs.append(value)
        assert pool.run(rank_1_rejects_large_values, args=(value,), timeout=30) == [2.0 * value] * 2

    with pytest.raises(RankError) as caught:
        property_of_the_sum()
    error = caught.value
    assert error.errors[1].type_name == "ValueError" and "rank 1 rejects 7" in str(error), error
    assert "rank_1_rejects_large_values" in error.errors[1].traceback
    assert error.errors[0].type_name == "PeerLeft" and "rank 1 gave up on this communicator" in str(error)
    assert len([v for v in runs if v >= 7]) >= 2  # failing examples, and shrinking replayed them
    assert pool.starts == starts, "a Python exception must not restart the pool"
    _works(pool)
    assert pool.starts == starts


def test_exception_on_every_rank_names_every_rank(pool):
    with pytest.raises(RankError) as caught:
        pool.run(raise_everywhere, args=("boom",), timeout=30)
    assert {r: e.message for r, e in caught.value.errors.items()} == {
        0: "boom from rank 0", 1: "boom from rank 1"}
    _works(pool)


def test_hung_rank_is_a_timeout_and_the_pool_restarts(pool):
    starts = pool.starts
    with pytest.raises(RankTimeout, match=r"hang_on_rank_0 did not finish within 2s on rank\(s\) \[0\]"):
        pool.run(hang_on_rank_0, timeout=2)
    assert not pool.alive
    _works(pool)
    assert pool.starts == starts + 1


def test_rank_killed_by_os_exit_is_reported_and_the_pool_restarts(pool):
    starts = pool.starts
    with pytest.raises(RankCrashed, match="rank 1 died during job exit_on_rank_1"):
        pool.run(exit_on_rank_1, timeout=30)
    assert not pool.alive
    _works(pool)
    assert pool.starts == starts + 1


def test_bad_requests_fail_before_anything_is_sent():
    pool = RankPool("local", 1)
    with pytest.raises(TypeError, match="module-level function"):
        pool.run(lambda comm: None)
    with pytest.raises(ValueError, match="per_rank has 2 entries for 1 ranks"):
        pool.run(identity_job, [(), ()])
    with pytest.raises(ValueError, match="backend='nccl'; valid: mpi, torch, local, cupy"):
        RankPool("nccl", 2)
    with pytest.raises(ValueError, match="backend 'local' has size 1"):
        RankPool("local", 2)
    assert pool.starts == 0


def test_get_pool_shares_one_warm_pool_per_world():
    first = get_pool("local", 1)
    assert get_pool("local", 1) is first
    assert first.run(identity_job)[0][:3] == (0, 1, "local")


@pytest.mark.parametrize("world", [("mpi", 3)], indirect=True)
def test_world_fixture_is_a_started_pool_of_that_size(world):
    assert world.alive and (world.backend, world.size) == ("mpi", 3)
    assert [r[0] for r in world.run(identity_job)] == [0, 1, 2]
