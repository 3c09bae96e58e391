"""Fault tolerance on the mpi backend: Open MPI's ULFM, for real (the ranks of a 4-rank job
die by SIGKILL, os._exit(1), an uncaught exception, SIGSTOP, and the survivors finish with the
weights of the float64 numpy replay), and the clear refusal where the MPI cannot (the MPICH
wheel; Open MPI started without ``--with-ft ulfm``).

The ULFM jobs run in the Open MPI environment (``make test-environments``; one in
``make test-ci-slice``: ~10 s and ~25 s, and the kill points' two: ~6 s); elsewhere they skip,
saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from collectives.testing.launch import mpi_command, mpi_launcher, mpi_launcher_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
import linear_job  # noqa: E402
from test_elastic_gloo import check_final, check_split  # noqa: E402

JOB = str(Path(linear_job.__file__).resolve())
TIMEOUT = 120

pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def open_mpi() -> bool:
    return Path(mpi_launcher()[0]).with_name("ompi_info").exists()


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    return {**env, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def run_ulfm_job(out: Path, faults: str, job: str = JOB, detector: float = 2,
                 ranks: int = 4) -> tuple[int, dict[str, dict]]:
    """``job`` under ``collectives-elastic --mpi``, 4 ranks; ``detector``: the heartbeat detector's
    timeout (a job whose faults are SIGKILLs, which Open MPI sees without it, takes a long one:
    on a machine loaded by other jobs a rank starved of CPU for 2 s is taken for dead)."""
    command = [sys.executable, "-m", "collectives.elastic.launcher", "--mpi", "--launcher",
               " ".join(mpi_launcher()), "-n", str(ranks), "--timeout", "20", "--detector-timeout", f"{detector:g}",
               sys.executable, job, str(out), "--faults", faults]
    done = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL)
    results = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}
    assert results, done.stdout[-3000:] + done.stderr[-6000:]
    return done.returncode, results


needs_ulfm = pytest.mark.skipif(not open_mpi(), reason=f"ULFM needs Open MPI; the MPI launcher here is "
                                                       f"{mpi_launcher_name()} (not Open MPI's)")


@needs_ulfm
def test_ulfm_survivors_of_a_sigkill_and_an_exit_match_the_reference(tmp_path: Path) -> None:
    status, results = run_ulfm_job(tmp_path, "3:kill@4,1:exit@7")
    sizes = check_final(results, 2)
    assert sizes == [4] * 4 + [3] * 3 + [2] * 5
    assert [h[3] for h in results["0"]["history"]] == [[], [3], [1]]
    assert status in (0, 1)  # mpirun's: 1 when a rank ended with a failing status (os._exit(1))


@needs_ulfm
def test_ulfm_survivors_of_an_exception_and_a_hang_match_the_reference(tmp_path: Path) -> None:
    # The hung rank (SIGSTOP) is found by Open MPI's heartbeat detector (~2 s).
    status, results = run_ulfm_job(tmp_path, "2:raise@3,0:stop@8")
    sizes = check_final(results, 2)
    assert sizes == [4] * 3 + [3] * 5 + [2] * 4
    assert sorted(results) == ["1", "3"]


#: A rank lost at each point of the loop that ULFM has (linear_job.POINTS; its commit() sends
#: nothing, it admits no replacements, and its shrink is MPIX_Comm_shrink at the failure): the
#: survivors' shrink() meets the rank that died after MPIX_Comm_shrink counted it in
#: (MPI_ERR_PROC_FAILED in the new communicator's making) and shrinks again. SIGKILLs: Open MPI
#: 5.0.11 ends the last survivor when the ranks before it left by os._exit (its detector).
KILL_POINTS = [
    pytest.param(3, "2:kill@2/commit,1:kill@2/shrink", id="3-commit-shrink"),
    pytest.param(4, "3:kill@2/incommit,2:kill@2/restore,1:kill@4/top", id="4-top-incommit-restore"),
]


@needs_ulfm
@pytest.mark.parametrize("ranks, faults", KILL_POINTS)
def test_ulfm_a_rank_lost_at_any_point_of_the_loop_leaves_survivors_that_match_the_reference(
        tmp_path: Path, ranks: int, faults: str) -> None:
    _, results = run_ulfm_job(tmp_path, faults, ranks=ranks, detector=30)
    check_final(results, 1)
    assert sorted(results) == ["0"]


@needs_ulfm
def test_ulfm_torch_ddp_on_the_collectives_backend_trains_across_a_shrink(tmp_path: Path) -> None:
    """DistributedDataParallel over collectives.c10d.process_group() on ULFM, wrapped again in
    each generation: rank 3 is SIGKILLed between the forward and DDP's all_reduce, and the three
    survivors (ranks 0-2 of a 3-rank group) end with the parameters of a float64 plain-torch
    replay (no DDP) of the same steps on the same shards."""
    import ddp_job
    import torch

    status, results = run_ulfm_job(tmp_path, "3:kill@3", job=str(Path(ddp_job.__file__).resolve()), detector=30)
    assert sorted(results) == ["0", "1", "2"], sorted(results)
    sizes = [4, 4, 4, 3, 3, 3, 3, 3]
    expected = ddp_job.reference(sizes)
    for result in results.values():
        assert result["sizes"] == sizes
        assert result["group"] == [result["rank"], 3]  # the group's rank and size: the new generation's
        assert result["params"] == results["0"]["params"]  # every rank holds the same bits
        for got, want in zip(result["params"], expected):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-10, atol=1e-12)
    assert status in (0, 1)  # 1: a survivor's MPI_Finalize took over 3 s after the failure (docs/elastic.md)


@needs_ulfm
def test_ulfm_a_split_raises_rank_failure_and_shrinks(tmp_path: Path) -> None:
    """A split of a ULFM communicator (a ULFM communicator too): a SIGKILLed member's split raises
    RankFailure in the split's numbering, shrinks itself to the survivors, and is made again from
    the shrunk world."""
    import split_job

    _, results = run_ulfm_job(tmp_path, "", job=str(Path(split_job.__file__).resolve()), detector=30)
    check_split(results, split_shrinks=True)


REFUSAL = """
import collectives
try:
    collectives.init(fault_tolerant=True)
except collectives.BackendUnavailable as error:
    print("REFUSED", error)
else:
    print("ACCEPTED")
"""


def test_fault_tolerant_mpi_refuses_without_ulfm_naming_what_works() -> None:
    env = {**clean_env(), "COLLECTIVES_BACKEND": "mpi"}
    done = subprocess.run(mpi_command(2, [sys.executable, "-c", REFUSAL]), env=env, capture_output=True,
                          text=True, timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    # (the ranks' lines may interleave in the launcher's forwarding)
    assert done.stdout.count("REFUSED") == 2 and "ACCEPTED" not in done.stdout, done.stdout
    assert "ULFM" in done.stdout and "collectives-elastic" in done.stdout
