"""torch.distributed over the "collectives" backend (collectives.c10d), in real ranks.

Every operation is compared with numpy on the same inputs (each rank computes every
rank's inputs from shared seeds); DDP and FSDP2 training with the one-process run on the
global batch (float64) and with DDP over Gloo in the same ranks. Each test module's pools
are its own: the ranks keep a torch default group between jobs.
"""

from __future__ import annotations

import subprocess
import sys

import c10d_jobs as jobs
import numpy as np
import pytest

from collectives.testing.pool import RankCrashed, RankError, RankPool

pytest.importorskip("torch")

# (transport, ranks): the mpi transport under mpiexec, and local (one rank, no launcher).
WORLDS = [("mpi", 2), ("mpi", 4), ("local", 1)]


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"{w[0]}-{w[1]}")
def group(request):
    with RankPool(*request.param) as pool:
        yield pool


@pytest.fixture(scope="module")
def two():
    with RankPool("mpi", 2) as pool:
        yield pool


@pytest.mark.parametrize("subgroup", [False, True], ids=["default-group", "new_group"])
def test_every_operation_matches_numpy(group, subgroup):
    results = group.run(jobs.op_set_job, args=(subgroup,), timeout=120)
    for rank, per_rank in enumerate(results):
        assert len(per_rank) >= 22
        for name, (got, want) in per_rank.items():
            assert got.shape == want.shape and np.array_equal(got, want), (rank, name, got, want)


VARIANTS = ["plain", "fp16_compress_hook", "powerSGD_hook", "no_sync", "find_unused_parameters", "static_graph"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_ddp_equals_one_process_on_the_global_batch_and_ddp_over_gloo(two, variant):
    for out in two.run(jobs.ddp_job, args=(3, variant), timeout=120):
        if variant == "powerSGD_hook":  # compression ran: a weight is not the exact one
            assert any(not np.allclose(out["collectives"][k], v, rtol=0, atol=1e-6)
                       for k, v in out["reference"].items())
        for name, want in out["reference"].items():
            got = out["collectives"][name]
            if variant == "fp16_compress_hook":  # gradients rounded to float16 on the wire
                np.testing.assert_allclose(got, want, atol=1e-3)
                np.testing.assert_array_equal(got, out["gloo"][name])
            elif variant == "powerSGD_hook":  # rank-1 compressed gradients: equal to Gloo's only
                np.testing.assert_allclose(got, out["gloo"][name], rtol=0, atol=1e-10)
            else:
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
                np.testing.assert_allclose(got, out["gloo"][name], rtol=0, atol=1e-10)


def test_fsdp2_equals_one_process_on_the_global_batch(two):
    for out in two.run(jobs.fsdp_job, args=(3,), timeout=120):
        for name, want in out["reference"].items():
            np.testing.assert_allclose(out["fsdp"][name], want, rtol=0, atol=1e-10)


def test_communicator_is_the_one_behind_the_group(two):
    for out in two.run(jobs.communicator_job, timeout=60):
        assert out["same"] and out["backend"] == "collectives" and out["name"] == "collectives"
        np.testing.assert_array_equal(out["x"], [3.0, 3.0])
        np.testing.assert_array_equal(out["t"], [2.0])
        assert "not 'collectives'" in out["refused"]


def test_bad_input_is_the_same_clear_error_on_every_rank(two):
    results = two.run(jobs.bad_input_job, timeout=60)
    assert results[0] == results[1]
    out = results[0]
    assert "ReduceOp.PREMUL_SUM" in out["premul_sum"] and out["premul_sum"].startswith("ValueError")
    assert out["sum of bool"].startswith("TypeError") and "bool" in out["sum of bool"]
    assert out["band of float"].startswith("TypeError")
    said = out["all_gather_into_tensor size"]
    assert said.startswith("ValueError") and "output_tensor holds 3 elements" in said, said
    assert out["after"] == "2.0"


def test_a_reduction_one_rank_refuses_is_named_on_the_others(two):
    """Rank 0's refused all_reduce, reduce and reduce_scatter_tensor (dtype x op) raise its TypeError
    there; the other rank, which made the calls, raises CollectiveMismatch naming rank 0 and why; the
    group works after."""
    results = two.run(jobs.refused_reduction_job, timeout=60)
    assert len(results[0]) == len(results[1]) == 3
    for (outcome, after), (op, dtype) in zip(results[0], [("AVG", "int32"), ("BAND", "float32"), ("BAND", "float32")]):
        assert outcome.startswith(f"TypeError: op={op} is not allowed on dtype {dtype}"), outcome
        assert after == 2.0
    for (outcome, after), (op, dtype, name) in zip(results[1], [("AVG", "int32", "all_reduce"),
                                                                ("BAND", "float32", "reduce"),
                                                                ("BAND", "float32", "reduce_scatter")]):
        assert "CollectiveMismatch" in outcome and f"rank 0 refused {name} call #" in outcome, outcome
        assert f"op={op} is not allowed on dtype {dtype}" in outcome, outcome
        assert after == 2.0


def test_mismatched_calls_raise_on_every_rank_by_default(two):
    """Default settings: shape, dtype, op, root, all_gather shapes, a skipped and an extra call, a
    barrier against an all_reduce are
    CollectiveMismatch on every rank, naming the difference; the group works after each."""
    fields = {"shape": "shape differs: (3,) on rank 0; (4,) on rank 1",
              "dtype": "dtype differs: float32 on rank 0; float64 on rank 1",
              "op": "reduce op differs: SUM on rank 0; MAX on rank 1",
              "root": "root differs: 0 on rank 0; 1 on rank 1",
              "all_gather shape": "shape differs: (2,) on rank 0; (3,) on rank 1",
              "skipped call": "operation differs: all_reduce on rank 0; broadcast on rank 1",
              "extra call": "operation differs: broadcast on rank 0; all_reduce on rank 1",
              "barrier": "operation differs: barrier on rank 0; all_reduce on rank 1"}
    for rank, found in enumerate(two.run(jobs.default_mismatch_job, timeout=120)):
        for case, (outcome, after) in found.items():
            assert outcome.startswith("CollectiveMismatch") and fields[case] in outcome, (rank, case, outcome)
            assert after == 2.0, (rank, case)


def test_mismatched_calls_raise_on_every_rank():
    with RankPool("mpi", 2, env={"COLLECTIVES_DEBUG": "1", "COLLECTIVES_TIMEOUT": "20"}) as pool:
        for message in pool.run(jobs.mismatch_job, timeout=60):
            assert message.startswith("CollectiveMismatch"), message


def test_a_skipped_call_times_out_on_the_ranks_that_made_it():
    with RankPool("mpi", 3, env={"COLLECTIVES_TIMEOUT": "2"}) as pool:
        results = pool.run(jobs.timeout_job, timeout=60)
    assert results[-1] == "skipped"
    for message in results[:-1]:
        assert message.startswith("CollectiveTimeout") and "timeout=2s" in message, message


def test_a_skipped_ddp_backward_is_an_error_in_the_others_backward():
    with RankPool("mpi", 2, env={"COLLECTIVES_TIMEOUT": "2"}) as pool:
        results = pool.run(jobs.ddp_timeout_job, timeout=60)
    assert results[-1] == "skipped"
    assert "CollectiveTimeout" in results[0] and "timeout=2s" in results[0], results[0]


def test_a_dead_rank_ends_the_job_instead_of_hanging():
    with RankPool("mpi", 2) as pool:
        with pytest.raises(RankCrashed):
            pool.run(jobs.dead_rank_job, timeout=60)


def test_import_registers_once_and_collectives_imports_no_torch():
    code = ("import sys, collectives; assert 'torch' not in sys.modules; "
            "import collectives.c10d as c, torch.distributed as dist; c.register(); c.register(); "
            "assert dist.Backend.COLLECTIVES == 'collectives'; "
            "assert dist.Backend.backend_list.count('collectives') == 1; "
            "assert 'collectives' in dist.Backend.backend_capability['collectives'] or "
            "dist.Backend.backend_capability['collectives'] == ['cpu', 'cuda']")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_torch_transport_is_refused_naming_gloo_and_nccl():
    code = ("import collectives.c10d as c\n"
            "try:\n    c.init_process_group()\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "COLLECTIVES_BACKEND": "torch"}).stdout
    assert out.startswith("BackendUnavailable") and "gloo" in out and "nccl" in out, out


@pytest.mark.parametrize("transport", ["", "mpi", "local"], ids=["auto", "mpi", "local"])
def test_under_torchrun_the_refusal_points_to_a_launch_that_works(transport):
    """Under torchrun auto picks torch (refused), mpi needs an MPI launcher and local one rank:
    each says to launch with mpiexec or use cupy, none sends the user back to another refusal."""
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                "TORCHELASTIC_RUN_ID": "test", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    code = ("from collectives.c10d.rendezvous import transport\n"
            "try:\n    print('chose', transport())\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    env = {**__import__("os").environ, **torchrun, "COLLECTIVES_BACKEND": transport}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env).stdout
    assert out.startswith("BackendUnavailable"), out
    assert "mpiexec" in out and "COLLECTIVES_BACKEND=cupy" in out and "COLLECTIVES_BACKEND=torch" not in out, out


def test_cpu_tensors_go_to_the_host_backend_when_the_group_has_one(two):
    """The CPU twin of the cupy transport, whose group hands CPU tensors to Gloo."""
    for out in two.run(jobs.host_backend_job, timeout=60):
        np.testing.assert_array_equal(out["t"], [3.0, 3.0, 3.0])
        np.testing.assert_array_equal(out["out"], [0.0] * 3 + [1.0] * 3)
        assert out["worker_calls"] == 0


def test_functional_collectives_match_numpy(two):
    everyone = np.stack([jobs.inputs(r, (2, 2)) for r in range(2)])
    for rank, out in enumerate(two.run(jobs.functional_job, timeout=120)):
        np.testing.assert_array_equal(out["all_reduce"], everyone.sum(0))
        np.testing.assert_array_equal(out["all_gather_tensor"], np.concatenate(everyone))
        np.testing.assert_array_equal(out["reduce_scatter_tensor"], everyone.sum(0)[rank:rank + 1])
        np.testing.assert_array_equal(out["all_to_all_single"], everyone[:, rank])
        np.testing.assert_array_equal(out["compiled all_reduce"], 2 * everyone.sum(0) + 1)


def test_ddp_backward_with_create_graph_averages_gradients(two):
    # rank r's gradient of (r + 1) * p**2 at p = 1 is 2 * (r + 1): the average over 2 ranks is 3.
    for grads in two.run(jobs.create_graph_job, timeout=60):
        assert grads == [3.0, 3.0]


def test_a_collectives_group_beside_a_gloo_default_group():
    with RankPool("mpi", 2) as pool:
        for out in pool.run(jobs.beside_gloo_job, timeout=60):
            assert (out["default"], out["group"]) == ("gloo", "collectives")
            np.testing.assert_array_equal(out["t"], [3.0, 3.0])


@pytest.mark.timeout(120)
def test_a_failed_c10d_job_leaves_the_next_one_a_working_group():
    """After a job that raised on one rank the pool renews its world; the torch.distributed
    groups an earlier job made over it are made anew, so the next job's collectives work (they
    raised PeerLeft, naming the rank that gave up, before)."""
    with RankPool("mpi", 2) as pool:
        with pytest.raises(RankError, match="rank 1 fails on purpose"):
            pool.run(jobs.failing_c10d_job, timeout=30)
        assert pool.run(jobs.c10d_sum_job, timeout=30) == [[3.0, 3.0], [3.0, 3.0]]


def test_recv_without_src_returns_the_senders_rank_as_gloo_does():
    with RankPool("mpi", 3) as pool:
        found = pool.run(jobs.recv_any_source_job, timeout=60)[0]
    ours, gloo = found[:2], found[2:]
    for received in (ours, gloo):
        assert sorted(received) == [(1, [1.0] * 3), (2, [2.0] * 3)], found


def test_sparse_all_reduce_sums_as_gloo_and_other_sparse_calls_are_refused(group):
    for found in group.run(jobs.sparse_all_reduce_job, timeout=120):
        for case in ("1-0", "2-1", "3-2"):
            ours, gloo = found[case]
            assert ours == gloo, (case, ours, gloo)
        assert found["max"].startswith("ValueError") and "ReduceOp.SUM alone" in found["max"], found["max"]
        assert found["broadcast"].startswith("TypeError") and "sparse COO tensors: all_reduce with SUM" in \
            found["broadcast"], found["broadcast"]
