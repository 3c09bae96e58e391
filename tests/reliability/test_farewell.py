"""A rank that is done with a communicator tells its peers (collectives/farewell.py): a call
left without a partner because a peer finished raises at once on every rank waiting in it,
naming that rank and its count of calls, on every backend; the rank that finished ends cleanly.

The jobs run under the real launchers with COLLECTIVES_TIMEOUT=600: a job that ends within the
test's own timeout did not wait for it. The pool cases close a split communicator early.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
from launched_job import LaunchedJob

from collectives.testing import get_pool

ROOT = Path(__file__).resolve().parents[2]
JOB = str(ROOT / "tests" / "reliability" / "farewell_job.py")
FEWER = 3  # farewell_job.FEWER: the calls rank 0 makes before it ends

# (launcher, backend): every backend, under the launchers it runs under.
JOBS = [("mpiexec", "mpi"), ("torchrun", "torch"), ("mpiexec", "torch"), ("mpiexec", "c10d")]


# Rank 0's interpreter takes 1 s more to end (an atexit handler), on one job per launcher: the
# failing ranks must not exit (non-zero, so the launcher ends the rest) before it has.
SLOW = [("mpiexec", "mpi", "1.0"), ("torchrun", "torch", "1.0")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("launcher,backend,slow_exit", [(*job, "") for job in JOBS] + SLOW,
                         ids=["-".join(j) for j in JOBS] + [f"{j[0]}-{j[1]}-slow-exit" for j in SLOW])
def test_ranks_left_without_a_partner_raise_at_once_and_the_rank_that_finished_ends_cleanly(
        launcher, backend, slow_exit, tmp_path):
    """The question the library was started from: rank 0 makes 3 all_reduces and ends normally,
    ranks 1 and 2 make 5. Their 4th raises at once (not after COLLECTIVES_TIMEOUT=600) naming
    rank 0 and its 3 calls; rank 0 ends with exit code 0, even when its ending is slow."""
    job = LaunchedJob(launcher, 3, JOB, [backend, str(tmp_path)],
                      {"COLLECTIVES_TIMEOUT": "600", "COLLECTIVES_BACKEND": "mpi" if backend == "c10d" else backend,
                       "FAREWELL_SLOW_EXIT": slow_exit},
                      "COLLECTIVES_FAREWELL_TEST")
    started = time.monotonic()
    code = job.wait_exit(60)
    elapsed = time.monotonic() - started
    job.assert_nothing_left()
    text = job.text
    lines = {rank: (tmp_path / f"rank-{rank}.txt").read_text() for rank in range(3)
             if (tmp_path / f"rank-{rank}.txt").exists()}
    assert code != 0, text
    # The farewell says why the connection closed: no transport's own text about it (Gloo's
    # "Connection closed by peer ... GLHF!") is printed above the PeerLeft.
    assert "Connection closed by peer" not in text and "GLHF" not in text, text
    assert lines.get(0, "").startswith(f"DONE rank 0 after {FEWER} calls"), (lines, text)
    for rank in (1, 2):
        line = lines.get(rank, "")
        assert line.startswith(f"RAISED rank {rank}") and "PeerLeft" in line, (lines, text)
        assert f"call #{FEWER + 1})" in line and "rank 0 finished" in line, line
        assert f"after {FEWER} collective calls on it" in line, line
        waited = float(re.search(r"after ([0-9.]+) s", line).group(1))
        print(f"TIMING rank {rank} raised {waited:.3f} s into its call [{backend} under {launcher}]")
    # Rank 0 ended cleanly: not aborted, not killed by the launcher as the others failed.
    if launcher == "mpiexec":  # the failing ranks end through MPI_Finalize, where rank 0 waits
        assert "Abort(" not in text and "BAD TERMINATION" not in text, text
        assert "ending through MPI_Finalize" in text, text
    else:
        assert "rank      : 0 (local_rank: 0)" not in text, text
    print(f"TIMING job of 3 ranks, rank 0 finished early -> ended [{backend} under {launcher}]: {elapsed:.2f} s")


def closed_early_job(comm):
    """Rank 0 makes one call on a split and closes it; rank 1 makes two calls there."""
    sub = comm.split(0)
    sub.all_reduce(np.ones(2))
    if comm.rank == 0:
        sub.close()
        return "closed", comm.all_reduce(np.ones(1)).tolist()
    start = time.monotonic()
    try:
        sub.all_reduce(np.ones(2))
        outcome = "no error"
    except Exception as error:  # noqa: BLE001 - its type and text are what the test reads
        outcome = f"{type(error).__name__}: {error}"
        inner = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
        if inner is not None:  # what a traceback prints above it (the transport's own text)
            outcome += f" [above it: {type(inner).__name__}: {inner}]"
    waited = time.monotonic() - start
    try:
        sub.all_reduce(np.ones(2))
        after = "no error"
    except Exception as error:  # noqa: BLE001
        after = f"{type(error).__name__}: {error}"
    return outcome, waited, after, comm.all_reduce(np.ones(1)).tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_a_peer_that_closed_the_communicator_is_named_by_the_next_call(backend):
    """Default settings (COLLECTIVES_TIMEOUT as the pool has it): the second call raises at once,
    the communicator is unusable after it, the pool's own communicator is not."""
    pool = get_pool(backend, 2)
    (closed, world0), (outcome, waited, after, world) = pool.run(closed_early_job, timeout=30)
    assert closed == "closed" and world0 == [2.0]
    assert outcome.startswith("PeerLeft: all_reduce (call #2)"), outcome
    assert "rank 0 finished (closed this communicator, or ended normally) after 1 collective call" in outcome
    assert "[above it:" not in outcome, outcome  # (Gloo's "Connection closed by peer ... GLHF!")
    assert after.startswith("CollectiveError") and "is unusable" in after, after
    assert world == [2.0]
    print(f"TIMING closed split -> next call raised [{backend}]: {waited:.3f} s")


@pytest.mark.timeout(30)
def test_wait_ended_returns_when_the_process_ends_and_names_the_ones_still_running():
    """What a failing rank waits on before it exits (collectives.diagnostics._exits.wait_ended):
    a process that runs on is named after the time given; one that ends is waited for until it
    does, not for the whole time."""
    import subprocess
    import sys
    import threading

    from collectives.diagnostics._exits import wait_ended

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        assert wait_ended([child.pid], 0.05) == [child.pid]
        threading.Timer(0.2, child.stdin.close).start()  # it ends once its input closes
        started = time.monotonic()
        assert wait_ended([child.pid], 20.0) == []
        assert time.monotonic() - started < 10.0  # (it did not wait out the 20 s)
        assert child.wait(5) == 0
        assert wait_ended([child.pid], 1.0) == []  # ended and reaped
    finally:
        child.kill()
        child.wait()
