"""The "collectives" process group is as strict as Gloo where Gloo raises, in real ranks.

Where Gloo raises on the rank with the bad argument and leaves the others to time out (and
its group broken), the group raises on that rank at the call and on the others at once
(a CollectiveMismatch naming that rank), and its next all_reduce is right.
"""

from __future__ import annotations

import c10d_strict_jobs as jobs
import numpy as np
import pytest

from collectives.testing.pool import RankPool

pytest.importorskip("torch")


@pytest.fixture(scope="module")
def three():
    with RankPool("mpi", 3, env={"COLLECTIVES_TIMEOUT": "60"}) as pool:
        yield pool


ROOTED = {
    "gather N-1": "gather_list holds 2 tensors; it needs 3, one per rank of the group",
    "gather N+1": "gather_list holds 4 tensors; it needs 3, one per rank of the group",
    "gather shape (3, 2)": "gather_list[0] has shape (3, 2); it must have the input tensor's shape (2,)",
    "scatter rows (4,) into (2, 2)": "scatter_list[0] has shape (4,); it must have the output tensor's shape (2, 2)",
}


@pytest.mark.parametrize("case", ROOTED)
def test_a_bad_list_at_the_root_raises_on_every_rank_and_the_group_stays_in_step(three, case):
    results = three.run(jobs.bad_rooted_call_job, args=(case,), timeout=60)
    root, *others = results
    assert root["raised"].startswith("ValueError") and ROOTED[case] in root["raised"], root
    for out in others:
        assert out["raised"].startswith("CollectiveMismatch"), out
        assert "rank 0 refused the call" in out["raised"] and ROOTED[case] in out["raised"], out
    for out in results:
        assert out["after"] == [3.0, 3.0, 3.0]


SIDES = {  # case: (the ranks whose list is wrong, what they are told)
    "group.scatter list on a non-source": ([1, 2], "scatter_list is given on rank {rank}, which is not the source"),
    "group.scatter no list on the source": ([0], "the source (rank 0) needs scatter_list"),
    "group.gather list on a non-destination": ([1, 2], "gather_list is given on rank {rank}, which is not the "
                                                       "destination"),
    "group.gather no list on the destination": ([0], "the destination (rank 0) needs gather_list"),
}


@pytest.mark.parametrize("case", SIDES)
def test_the_group_checks_the_list_on_both_sides_and_every_rank_raises(three, case):
    """torch's dist.scatter/gather refuse a list on the wrong side on that rank only; the
    group itself checks both sides, and every rank raises before anything is sent."""
    wrong, told = SIDES[case]
    for rank, out in enumerate(three.run(jobs.bad_rooted_call_job, args=(case,), timeout=60)):
        if rank in wrong:
            assert out["raised"].startswith("ValueError") and told.format(rank=rank) in out["raised"], out
        else:
            assert out["raised"].startswith("CollectiveMismatch") and "refused the call" in out["raised"], out
        assert out["after"] == [3.0, 3.0, 3.0]


#: The call path's checks that pair the others' scatter with that rank's next call: debug mode's
#: full fingerprint here (the checks on by default pair it as well).
CALL_PATH_CHECKS = {"COLLECTIVES_DEBUG": "1"}


@pytest.mark.parametrize("case", ["scatter_list everywhere", "scatter_list missing on the source"])
def test_torch_refusing_scatter_list_on_one_side_is_caught_on_every_rank(case):
    """torch raises on the rank whose scatter_list is wrong before the group sees the call; the
    others' scatter then meets that rank's next call, and the call path's checks make every
    rank raise there instead of pairing them; the group's next all_reduce is right."""
    with RankPool("mpi", 3, env={**CALL_PATH_CHECKS, "COLLECTIVES_TIMEOUT": "60"}) as pool:
        results = pool.run(jobs.scatter_list_on_the_wrong_ranks_job, args=(case,), timeout=60)
    for out in results:
        if out["first"].startswith("ValueError"):  # torch's refusal; then its next call is refused
            assert out["second"].startswith("CollectiveMismatch"), out
        else:
            assert out["first"].startswith("CollectiveMismatch") and "scatter" in out["first"], out
        assert out["after"] == [3.0, 3.0, 3.0]


def test_reduce_scatter_with_wrong_sizes_is_our_error_at_the_call(three):
    for out in three.run(jobs.reduce_scatter_job, timeout=60):
        assert out["raised"] == ("ValueError: input_list[0] has shape (3,); it must have the output "
                                 "tensor's shape (2,)"), out
        assert out["tensor"].startswith("ValueError: reduce_scatter_tensor: input holds 7 elements; it "
                                        "needs size * output.numel() = 3 * 2 = 6"), out
        assert out["after"] == [3.0, 3.0, 3.0]


def test_communicator_of_a_group_this_rank_is_not_in_is_a_clear_error(three):
    for out in three.run(jobs.non_member_job, timeout=60):
        if out["member"]:
            assert out["raised"] == "ok"
        else:
            assert out["raised"].startswith("ValueError: this rank (2) is not a member of the group"), out


def test_wait_with_a_timeout_raises_at_that_timeout_and_the_operation_completes_later(three):
    """COLLECTIVES_TIMEOUT is 60 s and the job's limit 30 s: a wait() that ignored its 1 s
    timeout would outlast the job."""
    results = three.run(jobs.wait_timeout_job, args=(1.0,), timeout=30)
    for out in results[:-1]:
        assert out["raised"].startswith("CollectiveTimeout") and "wait(timeout=1s)" in out["raised"], out
    for out in results:
        assert out["after"] == [3.0, 3.0, 3.0]


def test_a_bad_call_raises_at_the_call_and_a_peer_refusal_is_a_runtime_error_both_ways(three):
    for rank, out in enumerate(three.run(jobs.same_error_both_ways_job, timeout=60)):
        assert out["at_call"].startswith("ValueError: all_gather_into_tensor: output_tensor holds 3"), out
        for way, said in out["through"].items():
            if rank == 0:
                assert said.startswith("at the call: ValueError: gather_list[0] has shape (1,)"), (way, said)
            else:  # the same error, a RuntimeError, through wait() and through the future
                assert "(RuntimeError: True)" in said and "rank 0 refused the call" in said, (way, said)
        assert out["after"] == [3.0, 3.0, 3.0]


def test_future_values_are_shaped_as_gloos(three):
    for out in three.run(jobs.future_values_job, timeout=60):
        assert out["collectives"] == out["gloo"]


def test_the_group_queue_is_bounded_and_a_dropped_handle_still_completes():
    with RankPool("mpi", 2, env={"COLLECTIVES_TIMEOUT": "60"}) as pool:
        results = pool.run(jobs.bounded_queue_job, timeout=120)
    assert results[0]["waiting"] is True, results[0]
    for out in results:
        assert out["most pending"] <= out["limit"] and out["pending after"] == 0, out
        assert out["sums"] == [2.0], out


def test_completer_threads_end_when_idle(three):
    for out in three.run(jobs.completers_shrink_job, timeout=90):
        assert out["grown"] >= 4 and out["shrunk"] == 1, out


def test_distributed_checkpoint_broadcast_from_rank0_and_async_save(three, tmp_path):
    """torch.distributed.checkpoint reads the group's device types: rank 0's full state dict
    reaches every rank (model and optimizer), and an async_save reads back."""
    for out in three.run(jobs.checkpoint_job, args=(str(tmp_path / "ckpt"),), timeout=120):
        assert set(out["device_types"]) == {"cpu", "cuda"}
        for got, want in ((out["model"], out["reference model"]), (out["loaded model"], out["reference model"])):
            for name, value in want.items():
                np.testing.assert_array_equal(got[name], value)
        for got in (out["optim"], out["loaded optim"]):
            for index, state in out["reference optim"].items():
                for name, value in state.items():
                    np.testing.assert_array_equal(np.asarray(got[index][name]), np.asarray(value))
