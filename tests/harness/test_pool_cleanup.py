"""No process of a rank pool outlives the pool, its launcher or the test process.

torchrun starts every worker in a session of its own, so killing the launcher's process
group left a rank stuck in a job alive, re-parented to PID 1 (one leaked worker per full
run). Each test here checks /proc: nothing whose environment carries the pool's key may
be alive once the pool is gone. The session itself checks the same at its end
(collectives.testing.plugin's pytest_sessionfinish).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from collectives.testing import RankPool, RankTimeout, cpu_backends
from collectives.testing.pool import describe_processes, processes_of, processes_with

ROOT = Path(__file__).resolve().parents[2]
BACKENDS = cpu_backends()


def pid_job(comm):
    return os.getpid()


def hang_on_rank_0(comm):
    if comm.rank == 0:
        threading.Event().wait()  # never set: only the pool's cleanup ends this rank
    return comm.rank


def hang_everywhere(comm, directory):
    Path(directory, f"rank{comm.rank}").touch()  # tells the test this rank is in the job
    threading.Event().wait()


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if line.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return "Z" not in state.split()[1]


def _wait_until_gone(find, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hung_rank_is_killed_with_its_pool(backend):
    pool = RankPool(backend, 2)
    try:
        pids = pool.run(pid_job, timeout=60)
        key = pool._authkey
        assert sorted(processes_of([key])) and set(pids) <= set(processes_of([key]))
        with pytest.raises(RankTimeout):
            pool.run(hang_on_rank_0, timeout=2)
        # The timeout killed the pool: every process of it is gone when run() returns.
        left = processes_of([key])
        assert not left, f"still alive after the pool was killed:\n{describe_processes(left)}"
        # (their environment is unreadable as soon as they are exiting; give them a moment)
        assert not _wait_until_gone(lambda: [pid for pid in pids if _alive(pid)], 5)
    finally:
        pool.close()


OWNER = textwrap.dedent("""
    import sys
    from collectives.testing import RankPool
    sys.path.insert(0, {tests!r})
    from test_pool_cleanup import hang_everywhere, pid_job

    pool = RankPool({backend!r}, {size})
    print("PIDS", *pool.run(pid_job), flush=True)
    pool.run(hang_everywhere, args=({directory!r},), timeout=600)   # killed in this job
""")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend,size", [("mpi", 2), ("torch", 2), ("local", 1)])
def test_ranks_die_when_the_test_process_is_killed(backend, size, tmp_path):
    """SIGKILL to the process that owns the pool (no cleanup runs there): its launcher and
    ranks end within seconds (the ranks' watchdogs see the connection close, the launcher
    and local ranks get their parent-death signal)."""
    marker = secrets.token_hex(8)
    env = {**os.environ, "COLLECTIVES_CLEANUP_TEST": marker,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    owner = subprocess.Popen([sys.executable, "-c", OWNER.format(tests=str(ROOT / "tests" / "harness"),
                                                                 backend=backend, size=size,
                                                                 directory=str(tmp_path))],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        line = owner.stdout.readline().decode()
        assert line.startswith("PIDS"), line + owner.stdout.read().decode(errors="replace")
        pids = [int(p) for p in line.split()[1:]]
        assert all(_alive(pid) for pid in pids)
        in_job = [tmp_path / f"rank{r}" for r in range(size)]
        assert not _wait_until_gone(lambda: [p for p in in_job if not p.exists()], 30)
        owner.kill()
        owner.wait(timeout=10)
        started = time.monotonic()
        left = _wait_until_gone(lambda: processes_with("COLLECTIVES_CLEANUP_TEST", [marker]), 20)
        gone_after = time.monotonic() - started
        assert not left, f"outlived their owner:\n{describe_processes(left)}"
        print(f"TIMING pool owner SIGKILLed -> its {backend} processes gone: {gone_after:.2f} s")
    finally:
        for pid in processes_with("COLLECTIVES_CLEANUP_TEST", [marker]):
            os.kill(pid, signal.SIGKILL)
        if owner.poll() is None:
            owner.kill()


LEAKY = textwrap.dedent("""
    import os, subprocess, sys
    from collectives.testing.pool import POOL_AUTHKEY_ENV, _authkeys

    def test_leaks_a_pool_process():
        # Pretend a pool of this session started a process that its cleanup missed.
        _authkeys.add("feed")
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                                 env={**os.environ, POOL_AUTHKEY_ENV: "feed"})
        print("CHILD", child.pid)
""")


@pytest.mark.timeout(120)
def test_the_session_fails_when_a_pool_process_outlives_it(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKY)
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["collectives.testing.plugin"]\n')
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                             str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=100,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    text = result.stdout + result.stderr
    assert result.returncode == 1, text
    assert "1 passed" in text and "leftover rank-pool processes" in text, text
    assert "outlived them (killed now" in text and "time.sleep(120)" in text, text
    child = int(text.split("CHILD ")[1].split()[0])
    assert not _alive(child), "the session's check must kill what it found"
