"""Exits and signals: a rank that ends, or is interrupted or terminated, ends the whole job.

With real launchers (mpiexec from the venv's MPICH wheel, torchrun) running
``tests/reliability/signals_job.py``: rank 0 waits in an all_reduce that rank 1 never joins
while the test signals one rank or the launcher, or rank 1 exits. Every case must end
the job within seconds, with the expected exit code, and leave no process of the job
running (found through a token in their environment). The time from the signal (or
the failure) to the launcher's exit is printed as a ``TIMING`` line (``-s``): the README's
and docs/reliability.md's numbers come from there. ``test_exit_verdict_*`` runs
``collectives/diagnostics/_exits.py`` (how a process is ending) on every Python 3.10-3.13 found.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import pytest
from launched_job import LaunchedJob

ROOT = Path(__file__).resolve().parents[2]
JOB = str(ROOT / "tests" / "reliability" / "signals_job.py")
#: Seconds a job may take to end after its signal or failure before the test fails.
BOUND = 30


class Job(LaunchedJob):
    """A 2-rank signals_job.py under a launcher, its output read as it comes."""

    def __init__(self, launcher: str, backend: str, mode: str, timeout: str = "600", **env: str) -> None:
        # Each rank's stderr goes to a file of its own: what a rank writes just before
        # MPI_Abort is on disk, where Hydra's forwarding of it may be cut off by the abort.
        self.stderr_dir = tempfile.mkdtemp(prefix="signals-job-")
        weakref.finalize(self, shutil.rmtree, self.stderr_dir, True)
        super().__init__(launcher, 2, JOB, [mode], {
            "COLLECTIVES_BACKEND": backend.split("-")[0], "COLLECTIVES_TIMEOUT": timeout,
            "SIGNALS_JOB_STDERR": self.stderr_dir, **env}, "COLLECTIVES_SIGNAL_TEST")

    @property
    def text(self) -> str:
        """What the job printed: the launcher's output, then every rank's stderr file."""
        ranks = [Path(path).read_text(errors="replace")
                 for path in sorted(glob.glob(os.path.join(self.stderr_dir, "*.err")))]
        return "".join(self.lines) + "".join(ranks)

    def rank_pids(self) -> dict[int, int]:
        return self.pids()

    def end(self, timeout: float = BOUND) -> tuple[int, float]:
        """The launcher's exit code, and when it exited (time.time())."""
        code = self.wait_exit(timeout)
        ended = time.time()
        self.assert_nothing_left()
        return code, ended


def _timing(name: str, seconds: float) -> None:
    print(f"TIMING {name}: {seconds:.3f} s")


# -- how a process is ending, on every Python version found ----------------------------------

def _pythons() -> list[str]:
    found = {}
    for minor in (10, 11, 12, 13):
        candidates = [f"/usr/bin/python3.{minor}", f"/usr/local/bin/python3.{minor}",
                      *sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/3.{minor}.*/bin/python")))]
        for path in candidates:
            if os.access(path, os.X_OK):
                found[minor] = path
                break
    return [found[minor] for minor in sorted(found)]


EXIT_CASES = {  # case -> verdict on Python 3.12+, and on 3.10/3.11 where it differs
    "normal": (None, None),
    "caught-exit": (None, None),
    "exit": (("sys.exit(3)", 3), None),
    "exit-main": (("sys.exit(3)", 3), None),
    "raise-exit": (("uncaught SystemExit(3)", 3), ("uncaught SystemExit (its code is not visible", 1)),
    "exit-zero": (None, None),
    "exit-none": (None, None),
    "exit-message": (("sys.exit('bye')", 1), None),
    "thread-exit": (None, None),
    "caught-then-raise": (("uncaught SystemExit(4)", 4), ("uncaught SystemExit (its code is not visible", 1)),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("python", _pythons() or [sys.executable])
def test_exit_verdict_on_every_python(python):
    version = subprocess.run([python, "-c", "import sys; print(sys.version_info[1])"],
                             capture_output=True, text=True, timeout=30, check=True)
    minor = int(version.stdout)
    for case, (new, old) in EXIT_CASES.items():
        run = subprocess.run([python, str(ROOT / "tests" / "reliability" / "exit_cases.py"), case],
                             capture_output=True, text=True, timeout=30, env={"PATH": os.environ["PATH"]})
        verdict = re.search(r"VERDICT (.*)", run.stdout)
        assert verdict, (case, run.stdout, run.stderr)
        expected = old if minor < 12 and old is not None else new
        if expected is None:
            assert verdict.group(1) == "None", (python, case, run.stdout)
        else:
            what, code = expected
            assert verdict.group(1).startswith(f"({what!r}"[:-1]) and verdict.group(1).endswith(f", {code})"), \
                (python, case, verdict.group(1))


# -- exits under mpiexec ------------------------------------------------------------------

@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["caught-exit", "exit-zero"])
def test_exit_that_ends_normally_does_not_abort(mode):
    """A sys.exit the program caught, then a normal end (or sys.exit(0)): exit 0, all output."""
    job = Job("mpiexec", "mpi", mode)
    code, _ = job.end(60)
    assert code == 0, job.text
    assert "MPI_Abort" not in job.text, job.text
    for rank in (0, 1):
        assert f"FINISHED rank {rank} sum 2" in job.text, job.text


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["exit", "raise-exit"])
def test_uncaught_exit_ends_the_job(mode):
    """Rank 1 ends with an uncaught sys.exit(3) / raise SystemExit(3) while rank 0 waits in
    an all_reduce: the job ends within seconds, non-zero (3 where the code can be read)."""
    job = Job("mpiexec", "mpi", mode)
    job.rank_pids()
    failing = float(job.wait_for(r"FAILING AT ([0-9.]+)")[0].group(1))
    code, ended = job.end()
    assert code != 0, job.text
    if mode == "exit" or sys.version_info >= (3, 12):
        assert code == 3, job.text
    assert "FINISHED" not in job.text, job.text
    _timing(f"rank 1 {mode} -> job ended [mpi under mpiexec]", ended - failing)


# -- signals --------------------------------------------------------------------------------

SIGNALS = [  # (launcher, backend, whom, signal, exit code): rank 0 waits in an all_reduce,
    # rank 1 sleeps. Under mpiexec a SIGINT is an uncaught KeyboardInterrupt on the rank(s)
    # it reaches (Hydra forwards the launcher's), which calls MPI_Abort(130); a SIGTERM
    # kills the rank (Hydra reports the signal number). torchrun exits 1 either way.
    ("mpiexec", "mpi", "rank 1", "SIGINT", 130), ("mpiexec", "mpi", "rank 0", "SIGINT", 130),
    ("mpiexec", "mpi", "self", "SIGINT", 130), ("mpiexec", "mpi", "rank 0", "SIGTERM", 15),
    ("mpiexec", "mpi", "launcher", "SIGINT", 130), ("mpiexec", "mpi", "launcher", "SIGTERM", 15),
    ("torchrun", "torch", "launcher", "SIGINT", 1), ("torchrun", "torch", "launcher", "SIGTERM", 1),
    # Rank 0 blocked where Python cannot raise KeyboardInterrupt (Gloo's wait; a blocking
    # MPI call with no timeout): backends/_interrupt.py ends it after its grace, exit 130.
    ("torchrun", "torch", "rank 0", "SIGINT", 1), ("mpiexec", "torch", "rank 0", "SIGINT", 130),
    ("mpiexec", "mpi-no-timeout", "rank 0", "SIGINT", 130),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher,backend,whom,name,expected", SIGNALS,
                         ids=["-".join((c[0], c[1], c[2].replace(" ", ""), c[3])) for c in SIGNALS])
def test_signal_ends_the_job(launcher, backend, whom, name, expected):
    """A signal to one rank (the one waiting in the all_reduce, or the one outside it: an
    uncaught KeyboardInterrupt aborts the job like any uncaught exception) or to the
    launcher: every rank ends within seconds, the launcher exits non-zero."""
    blocked = whom == "rank 0" and name == "SIGINT" and backend != "mpi"
    # Checks off for the blocked cases: the check before a call waits in a polling loop (a
    # SIGINT there is a KeyboardInterrupt at once), the call itself in the transport.
    job = Job(launcher, backend, "self-sigint" if whom == "self" else "wait",
              timeout="0" if backend == "mpi-no-timeout" else "600",
              **({"COLLECTIVES_DEBUG": "0"} if blocked else {}))
    pids = job.rank_pids()
    job.wait_for("ENTERING rank 0")
    if whom == "self":
        sent = float(job.wait_for(r"FAILING AT ([0-9.]+)")[0].group(1))
    else:
        if blocked:  # a blocking wait (Gloo, MPI without a timeout): rank 0 is in it
            job.wait_for("BLOCKED rank 0")
        target = job.process.pid if whom == "launcher" else pids[int(whom[-1])]
        sent = time.time()
        os.kill(target, getattr(signal, name))
    code, ended = job.end()
    assert code == expected, job.text
    assert "FINISHED" not in job.text, job.text
    if blocked:  # in the transport
        assert "a transport call that Python cannot interrupt" in job.text, job.text
    elif launcher == "mpiexec" and name == "SIGINT":
        assert "uncaught KeyboardInterrupt on rank" in job.text, job.text
    _timing(f"{name} to {whom} -> job ended [{backend} under {launcher}] (exit {code})", ended - sent)


@pytest.mark.timeout(90)
def test_caught_interrupt_then_collective_is_not_cut_short():
    """The ranks catch a SIGINT (Hydra forwards mpiexec's) and wind down with a blocking
    barrier that takes longer than the SIGINT watcher's grace: the job still exits 0."""
    job = Job("mpiexec", "mpi-no-timeout", "caught-sigint", timeout="0")
    job.rank_pids()
    job.wait_for(r"LOOPING rank", 2)  # both inside their try: (a SIGINT before is uncaught)
    os.kill(job.process.pid, signal.SIGINT)
    code, _ = job.end(60)
    assert code == 0, job.text
    for rank in (0, 1):
        assert f"FINISHED rank {rank} sum 2" in job.text, job.text
