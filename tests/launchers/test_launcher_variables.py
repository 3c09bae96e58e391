"""What each launcher's variables mean (collectives.launcher), checked on the variables the
launchers set, as measured under them: srun with and without --mpi, Open MPI's mpirun,
Hydra's mpiexec, torchrun, and torch's env:// set by hand under mpiexec. No ranks started."""

from __future__ import annotations

import pytest

from collectives.errors import BackendUnavailable
from collectives.launcher import (
    LaunchInfo,
    check_world_size,
    detect_launcher,
    slurm_tasks_per_node,
    without_launcher_variables,
)

# srun -N 2 -n 8 (4 tasks a node), this task: rank 5, the second on node 1.
SLURM_STEP = {"SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
              "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
              "SLURM_JOB_ID": "7", "SLURM_CONF": "/etc/slurm/slurm.conf"}
PMI2 = {"PMI_RANK": "5", "PMI_SIZE": "8", "PMI_FD": "13", "PMI_JOBID": "7.0"}
PMIX = {"PMIX_RANK": "5", "PMIX_NAMESPACE": "slurm.pmix.7.0"}


def test_srun_with_pmi2_takes_the_local_rank_and_size_from_slurm_not_the_rank():
    launch = detect_launcher({**SLURM_STEP, **PMI2, "SLURM_MPI_TYPE": "pmi2"})
    assert (launch.launcher, launch.rank, launch.size) == ("mpi", 5, 8)
    assert (launch.local_rank, launch.local_size, launch.local_rank_known) == (1, 4, True)


def test_srun_with_pmix_and_without_mpi_are_slurm_launches_with_their_local_place():
    for extra in (PMIX, {}):
        launch = detect_launcher({**SLURM_STEP, **extra})
        assert (launch.launcher, launch.rank, launch.size, launch.local_rank, launch.local_size) == \
            ("slurm", 5, 8, 1, 4)
        assert launch.size_variable == "SLURM_NTASKS"


@pytest.mark.parametrize("text, counts", [("3", [3]), ("4(x2)", [4, 4]), ("2(x3),1", [2, 2, 2, 1]),
                                          ("1,5(x2),2", [1, 5, 5, 2])])
def test_slurm_tasks_per_node_expands_slurms_compressed_list(text, counts):
    assert slurm_tasks_per_node(text) == counts


def test_a_batch_script_outside_srun_is_no_launch():
    job = {k: v for k, v in SLURM_STEP.items() if not k.startswith("SLURM_STEP")}
    assert detect_launcher(job).launcher is None


def test_open_mpi_local_rank_is_the_launchers_even_out_of_rank_order():
    # mpirun --oversubscribe -n 4 on 2 cores: rank 1 is local rank 2.
    launch = detect_launcher({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
                              "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"})
    assert (launch.launcher, launch.rank, launch.local_rank, launch.local_size) == ("mpi", 1, 2, 4)


def test_env_rendezvous_set_by_hand_under_mpiexec_is_still_an_mpi_launch():
    hydra = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    by_hand = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert detect_launcher({**hydra, **by_hand}).launcher == "mpi"
    assert detect_launcher(by_hand).launcher == "torchrun"  # env:// without a launcher


def test_torchrun_started_by_srun_is_torchrun():
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
                "MASTER_ADDR": "node1", "TORCHELASTIC_RUN_ID": "7"}
    launch = detect_launcher({**SLURM_STEP, "SLURM_NTASKS": "2", "SLURM_PROCID": "0", **torchrun})
    assert (launch.launcher, launch.rank, launch.size, launch.local_rank) == ("torchrun", 3, 8, 3)


def test_a_world_smaller_than_the_launchers_count_is_refused_naming_the_srun_flag():
    launch = detect_launcher({**SLURM_STEP, "SLURM_NTASKS": "3", "SLURM_PROCID": "2",
                              "SLURM_STEP_TASKS_PER_NODE": "3", "SLURM_NODEID": "0"})
    with pytest.raises(BackendUnavailable, match=r"MPI sees 1 rank.*SLURM_NTASKS=3.*srun --mpi=pmi2.*pmix"):
        check_world_size(launch, 1)
    check_world_size(launch, 3)
    check_world_size(LaunchInfo(None, 0, 1, 0, 1), 1)
    hydra = detect_launcher({"PMI_RANK": "0", "PMI_SIZE": "4"})
    with pytest.raises(BackendUnavailable, match=r"PMI_SIZE=4.*mpiexec/mpirun of the MPI library"):
        check_world_size(hydra, 2)


def test_starting_a_new_job_drops_the_launchers_variables_and_keeps_the_users_settings():
    launcher_set = {**SLURM_STEP, **PMI2, **PMIX, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_MCA_ess_base_jobid": "1",
                    "OMPI_MCA_num_procs": "2", "OMPI_MCA_initial_wdir": "/", "OMPI_FILE_LOCATION": "/tmp/x",
                    "PMIX_SERVER_URI41": "x", "PRTE_LAUNCHED": "1", "MPI_LOCALRANKID": "0",
                    "RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "TORCHELASTIC_RUN_ID": "1"}
    users = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_op": "^avx",
             "OMPI_MCA_btl_tcp_if_include": "eth0", "PMIX_MCA_gds": "hash", "I_MPI_PMI_LIBRARY": "/x.so",
             "SLURM_CONF": "/etc/slurm/slurm.conf", "SLURM_JOB_ID": "7", "UCX_TLS": "tcp", "PATH": "/bin"}
    kept = without_launcher_variables({**launcher_set, **users})
    assert kept == users
    assert detect_launcher(kept).launcher is None


def test_the_store_listens_on_loopback_when_no_rank_is_on_another_host(monkeypatch):
    # srun --mpi=pmi2 on one node whose name resolves to 127.0.0.1 (Debian's /etc/hosts):
    # no other host to reach, whatever the launcher says of local sizes.
    from collectives.backends import _network, torch_bootstrap  # noqa: PLC0415

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setattr(_network, "own_address", lambda: "127.0.1.1")
    unknown_local = LaunchInfo("mpi", 0, 3, 0, None, "PMI_SIZE")
    assert torch_bootstrap.store_host(unknown_local, peers=[]) == "127.0.0.1"
    with pytest.raises(BackendUnavailable, match="set MASTER_ADDR"):  # another host, no route to it
        torch_bootstrap.store_host(unknown_local, peers=["host-that-does-not-resolve.invalid"])
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    assert torch_bootstrap.store_host(unknown_local, peers=[]) == "10.0.0.1"
