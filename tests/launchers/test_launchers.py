"""The launcher matrix of DESIGN.md with the real launchers (mpiexec from the MPICH wheel,
torchrun from torch), including the clear errors. Each run is a subprocess with a timeout."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from collectives.launcher import without_launcher_variables
from collectives.testing.launch import free_port, mpi_command, mpi_launcher_name

SCRIPTS = Path(__file__).parent / "scripts"
BIN = Path(sys.executable).parent
TIMEOUT = 120


def launch(launcher, n, script, backend, *args, launcher_flags=()):
    env = {k: v for k, v in without_launcher_variables(os.environ).items()
           if not k.startswith("COLLECTIVES_POOL")}
    env.pop("COLLECTIVES_BACKEND", None)
    if backend is not None:
        env["COLLECTIVES_BACKEND"] = backend
    env["OMP_NUM_THREADS"] = "1"
    python = [sys.executable, str(SCRIPTS / script), *args]
    if launcher == "mpiexec":  # the MPI launcher COLLECTIVES_TEST_LAUNCHER names (default mpiexec)
        command = mpi_command(n, python)
        at = command.index("-n")
        command[at:at] = launcher_flags  # after the launcher's own: the last --mpi= wins
    elif launcher == "torchrun":
        # The c10d rendezvous on a free port: without an endpoint it takes localhost:29400, and two
        # suites on one machine then join each other's rendezvous.
        command = [str(BIN / "torchrun"), "--nproc_per_node", str(n), "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", "127.0.0.1:0", str(SCRIPTS / script)]
    else:
        command = python
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL)


# What each rank prints, found anywhere in the output: ranks share stdout, so one rank's line
# can land in the middle of another's.
RANK_RECORDS = {
    "OK": r"OK backend=\w+ rank=\d+ size=\d+ local_rank=\d+",
    "ERROR": r"ERROR \w+: [^\n]*?(?=ERROR |OK |\n|$)",
    "rank ": r"rank \d+/\d+ backend=\w+ checked=\d+ failures=\[[^\]]*\]",
    "REUSED": r"REUSED rank=\d+ size=\d+ sum=\d+",
    "C10D": r"C10D rank=\d+ size=\d+ sum=\d+",
    "LET GO": r"LET GO rank=\d+ (?:True|False)",
}


def rank_lines(output, prefix):
    return sorted(re.findall(RANK_RECORDS[prefix], output))


# launcher, ranks, COLLECTIVES_BACKEND, the backend it must pick
MATRIX = [
    ("mpiexec", 3, "mpi", "mpi"),
    ("mpiexec", 3, None, "mpi"),  # auto
    ("mpiexec", 2, "torch", "torch"),
    ("torchrun", 3, "torch", "torch"),
    ("torchrun", 3, "auto", "torch"),
    ("none", 1, None, "local"),
    ("none", 1, "torch", "torch"),
    ("none", 1, "mpi", "mpi"),
    ("none", 1, "local", "local"),
]


@pytest.mark.parametrize("launcher, n, backend, expected", MATRIX)
def test_every_launcher_and_backend_pair_gives_the_right_communicator(launcher, n, backend, expected):
    result = launch(launcher, n, "which_backend.py", backend)
    lines = rank_lines(result.stdout, "OK")
    assert result.returncode == 0, result.stdout + result.stderr
    # One host: local ranks number the ranks 0..n-1 (in rank order but under Open MPI's mapping).
    local_ranks = [int(line.rsplit("=", 1)[1]) for line in lines]
    assert sorted(local_ranks) == list(range(n)), lines
    assert [line.rsplit(" ", 1)[0] for line in lines] == sorted(
        f"OK backend={expected} rank={r} size={n}" for r in range(n))


ERRORS = [
    ("torchrun", 2, "mpi",
     r"BackendUnavailable: backend 'mpi' needs an MPI launcher .mpiexec, mpirun or srun.*torchrun"),
    ("mpiexec", 2, "local", r"BackendUnavailable: backend .local. runs one rank, but (mpi|slurm) started 2"),
    ("torchrun", 2, "local", r"BackendUnavailable: backend 'local' runs one rank, but torchrun started 2"),
    ("none", 1, "nccl", r"ValueError: unknown backend 'nccl'.*valid: auto, local, torch, mpi, cupy"),
]


@pytest.mark.parametrize("launcher, n, backend, message", ERRORS)
def test_a_backend_that_cannot_run_under_a_launcher_is_a_clear_error_on_every_rank(launcher, n, backend, message):
    result = launch(launcher, n, "which_backend.py", backend)
    assert result.returncode != 0
    errors = rank_lines(result.stdout, "ERROR")
    # torchrun and Open MPI's mpirun stop the other ranks as soon as one exits non-zero, so
    # there a slower rank may be stopped before it prints; Hydra's mpiexec lets every rank report.
    if launcher == "torchrun" or mpi_launcher_name().split()[0] in ("mpirun", "prterun"):
        assert 1 <= len(errors) <= n, result.stdout + result.stderr
    else:
        assert len(errors) == n, result.stdout + result.stderr
    assert all(re.search(message, line) for line in errors), errors


CONTRACT = [("mpiexec", "mpi"), ("mpiexec", None), ("torchrun", "torch"), ("torchrun", None)]


@pytest.mark.parametrize("launcher, backend", CONTRACT)
def test_every_allowed_pair_matches_numpy_through_the_public_contract_on_3_ranks(launcher, backend):
    result = launch(launcher, 3, "contract_check.py", backend)
    lines = rank_lines(result.stdout, "rank ")
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(lines) == 3 and all(line.endswith("failures=[]") for line in lines), lines


def test_the_torch_backend_reuses_a_process_group_the_user_initialized():
    result = launch("torchrun", 2, "reuse_group.py", None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert rank_lines(result.stdout, "REUSED") == [f"REUSED rank={r} size=2 sum=3" for r in range(2)]
    assert rank_lines(result.stdout, "LET GO") == [f"LET GO rank={r} True" for r in range(2)]


@pytest.mark.parametrize("mode", ["master-addr", "env"])
def test_torch_environment_variables_under_an_mpi_launcher_start_a_collectives_group(mode):
    # MASTER_ADDR alone is the store's address (no env:// without RANK/WORLD_SIZE); plain
    # dist.init_process_group("collectives") with env:// set by the script is an MPI job too.
    result = launch("mpiexec", 2, "c10d_env_check.py", None, mode, str(free_port()))
    assert result.returncode == 0, result.stdout + result.stderr
    assert rank_lines(result.stdout, "C10D") == [f"C10D rank={r} size=2 sum=3" for r in range(2)]


@pytest.mark.parametrize("launcher,mode,port", [("mpiexec", "plain", False), ("mpirun", "plain", False),
                                               ("mpiexec", "plain-gloo", False), ("mpiexec", "plain", True)])
def test_plain_init_process_group_works_under_an_mpi_launcher_with_no_variable_set(launcher, mode, port):
    """torch code unchanged: `import collectives.c10d; dist.init_process_group("collectives")` (or
    "gloo") on 3 ranks of the MPI launcher (COLLECTIVES_TEST_LAUNCHER's, e.g. srun; or the MPICH
    wheel's mpirun): the import filled RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/MASTER_PORT (a
    MASTER_PORT the user set is kept), and the group's all_reduce is the sum of 1, 2, 3."""
    chosen = free_port() if port else None
    if launcher == "mpirun":  # (the wheel's own mpirun, whatever COLLECTIVES_TEST_LAUNCHER says)
        env = {k: v for k, v in without_launcher_variables(os.environ).items() if not k.startswith("COLLECTIVES_")}
        slots = ["--oversubscribe"] if (BIN / "ompi_info").exists() else []  # (Open MPI's: 3 ranks, 2 cores)
        command = [str(BIN / "mpirun"), *slots, "-n", "3", sys.executable, str(SCRIPTS / "c10d_env_check.py"), mode]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                                stdin=subprocess.DEVNULL)
    else:
        result = launch("mpiexec", 3, "c10d_env_check.py", None, mode, *([str(chosen)] if port else []))
    assert result.returncode == 0, result.stdout + result.stderr
    assert rank_lines(result.stdout, "C10D") == [f"C10D rank={r} size=3 sum=6" for r in range(3)], result.stdout
    filled = sorted(re.findall(r"ENV RANK=(\d+) WORLD_SIZE=(\d+) LOCAL_RANK=(\d+) MASTER_PORT=(\d+)", result.stdout))
    assert [row[:2] for row in filled] == [(str(r), "3") for r in range(3)], result.stdout
    assert sorted(row[2] for row in filled) == ["0", "1", "2"], result.stdout  # (Open MPI may number them in
    # another order than the ranks: the launcher's local ranks, whatever they are)
    assert len({row[3] for row in filled}) == 1, filled  # one port, agreed
    if chosen is not None:
        assert filled[0][3] == str(chosen)


@pytest.mark.skipif(not mpi_launcher_name().startswith("srun"), reason="needs COLLECTIVES_TEST_LAUNCHER=srun ...")
def test_srun_without_mpi_is_refused_on_every_rank_naming_the_flag():
    # Plain `srun -n 3`: MPI cannot reach Slurm's PMI, each task is an MPI job of one rank.
    result = launch("mpiexec", 3, "which_backend.py", "mpi", launcher_flags=["--mpi=none"])
    errors = rank_lines(result.stdout, "ERROR")
    assert result.returncode != 0 and len(errors) == 3, result.stdout + result.stderr
    assert all(re.search(r"MPI sees 1 rank.*SLURM_NTASKS=3.*srun --mpi=pmi2", line) for line in errors), errors


def test_the_cupy_backends_nccl_id_reaches_every_rank_over_the_mpi_launcher():
    # The cupy backend's bootstrap without a GPU (tests/launchers/scripts/nccl_id_check.py).
    result = launch("mpiexec", 3, "nccl_id_check.py", None)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "NCCL IDS OK route=mpi ranks=3 exchanges=3" in result.stdout, result.stdout + result.stderr
