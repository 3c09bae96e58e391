"""Reliability: mismatched calls (default settings and debug mode), timeouts, rank failure
(bad input is bad_input_catalogue.py's, run by test_bad_input.py).

Mismatch tests run on the session's shared pools (default settings) and on pools of their
own (COLLECTIVES_DEBUG=1, short COLLECTIVES_TIMEOUT); timeout tests on pools of their own; each
job makes a fresh split, so a communicator they break is never the pool's. Rank-failure tests start a job under
mpiexec and torchrun in a subprocess. Times they measure are printed (``-s``) as
``TIMING ...`` lines: that is where the README's numbers come from.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from collectives import CollectiveError, CollectiveMismatch, CollectiveTimeout, config
from collectives.launcher import without_launcher_variables
from collectives.testing import RankPool

ROOT = Path(__file__).resolve().parents[2]
# Communicators a job must keep alive after it returns (a peer may still be waiting on them).
_KEEP: list = []


def _timing(name: str, seconds: float) -> None:
    print(f"TIMING {name}: {seconds:.3f} s")


# -- mismatched calls: caught by default, and in debug mode ----------------------------------

def _pool(backend: str, env: dict[str, str]):
    pool = RankPool(backend, 2, env=env, job_timeout=30)
    pool.start()
    return pool


@pytest.fixture(scope="module", params=["mpi", "torch"])
def debug_world(request):
    pool = _pool(request.param, {config.DEBUG: "1", config.TIMEOUT: "3"})
    yield pool
    pool.close()


@pytest.fixture(params=["default", "debug"])
def checked_world(request, debug_world):
    """Ranks with default settings (the session's shared pool), and in debug mode."""
    if request.param == "debug":
        return debug_world
    from collectives.testing import get_pool

    return get_pool(debug_world.backend, 2)


def _case_operation(comm, x):
    return (lambda: comm.all_reduce(x)) if comm.rank == 0 else (lambda: comm.broadcast(x, 0))


def _case_reduce_op(comm, x):
    return lambda: comm.all_reduce(x, "sum" if comm.rank == 0 else "max")


def _case_root(comm, x):
    return lambda: comm.broadcast(x, src=comm.rank)


def _case_dtype(comm, x):
    y = x.astype(np.float32 if comm.rank == 0 else np.float64)
    return lambda: comm.all_reduce(y)


def _case_shape(comm, x):
    y = np.ones(3 + comm.rank)
    return lambda: comm.all_reduce(y)


def _case_all_gather_shape(comm, x):
    # Without the check: rows of uninitialized memory on MPI.
    y = np.ones(3 + comm.rank)
    return lambda: comm.all_gather(y)


def _case_sequence_number(comm, x):
    # White-box: a rank whose count of calls drifted (the other fields agree).
    if comm.rank == 1:
        comm._seq += 1
    return lambda: comm.all_reduce(x)


def _case_extra_call(comm, x):
    # Rank 1 makes one all_reduce more than rank 0, whose next call is a broadcast.
    if comm.rank == 0:
        return lambda: (comm.all_reduce(x), comm.broadcast(x, 0))
    return lambda: (comm.all_reduce(x), comm.all_reduce(x), comm.broadcast(x, 0))


def _case_skipped_call(comm, x):
    # Rank 1 skips the all_reduce that rank 0 makes before their broadcast.
    if comm.rank == 0:
        return lambda: (comm.all_reduce(x), comm.broadcast(x, 0))
    return lambda: comm.broadcast(x, 0)


def _case_uneven_operation(comm, x):
    # An uneven call's counts travel in its check's round on MPI: a rank in another call meets it there.
    return (lambda: comm.all_gather_v(x)) if comm.rank == 0 else (lambda: comm.all_reduce(x))


def _case_uneven_kinds(comm, x):
    y = np.ones((comm.size, 3))
    return (lambda: comm.all_to_all(y, [1] * comm.size)) if comm.rank == 0 else (lambda: comm.all_gather_v(y))


MISMATCHES = {  # case -> (this rank's calls, the field reported, rank 0's and rank 1's value)
    "operation": (_case_operation, "operation", "all_reduce", "broadcast"),
    "reduce_op": (_case_reduce_op, "reduce op", "SUM", "MAX"),
    "root": (_case_root, "root", "0", "1"),
    "dtype": (_case_dtype, "dtype", "float32", "float64"),
    "shape": (_case_shape, "shape", "(3,)", "(4,)"),
    "all_gather_shape": (_case_all_gather_shape, "shape", "(3,)", "(4,)"),
    "sequence_number": (_case_sequence_number, "sequence number", "#2", "#3"),
    "extra_call": (_case_extra_call, "operation", "broadcast", "all_reduce"),
    "skipped_call": (_case_skipped_call, "operation", "all_reduce", "broadcast"),
    "uneven_operation": (_case_uneven_operation, "operation", "all_gather_v", "all_reduce"),
    "uneven_kinds": (_case_uneven_kinds, "operation", "all_to_all", "all_gather_v"),
}


def mismatch_job(comm, case):
    sub = comm.split(0)  # sequence numbers from 0, and the pool's communicator stays clean
    sub.all_reduce(np.ones(1))  # (the first call of a communicator always compares in full)
    calls = MISMATCHES[case][0](sub, np.ones(3))
    start = time.perf_counter()
    try:
        calls()
        outcome = ("no error", "")
    except CollectiveMismatch as error:
        outcome = ("CollectiveMismatch", str(error))
    elapsed = time.perf_counter() - start
    ok = None
    if case != "sequence_number":  # still in step: a real collective works
        ok = sub.all_reduce(np.ones(1)).tolist() == [float(sub.size)]
    sub.close()
    return outcome, elapsed, ok


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatched_calls_raise_on_every_rank(checked_world, case):
    _, field, value0, value1 = MISMATCHES[case]
    results = checked_world.run(mismatch_job, args=(case,), timeout=20)
    for rank, ((kind, message), _, ok) in enumerate(results):
        assert kind == "CollectiveMismatch", f"rank {rank}: {kind} {message}"
        assert f"{field} differs: {value0} on rank 0; {value1} on rank 1" in message, message
        others = [f for f in ("operation", "reduce op", "root", "dtype", "shape")
                  if f != field and f"{f} differs" in message]
        if field != "operation":  # different operations differ in reduce op and root too
            assert not others, message
        assert ok in (True, None)
    _timing(f"mismatch {case} [{checked_world.backend}]", max(r[1] for r in results))


def barrier_mismatch_job(comm):
    """A barrier that the last rank meets with an all_reduce (after one barrier that matches)."""
    sub = comm.split(0)
    sub.all_reduce(np.ones(1))  # (the first call of a communicator always compares in full)
    sub.barrier()
    try:
        sub.barrier() if sub.rank != sub.size - 1 else sub.all_reduce(np.ones(3))
        outcome = ("no error", "")
    except CollectiveMismatch as error:
        outcome = ("CollectiveMismatch", str(error))
    ok = sub.all_reduce(np.ones(1)).tolist() == [float(sub.size)]  # still in step
    sub.close()
    return outcome, ok


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("backend", "size"), [("mpi", 2), ("mpi", 3), ("torch", 3)])
def test_a_barrier_met_by_another_call_is_a_mismatch_on_every_rank(backend, size):
    """The barrier under a timeout is the call's check word (an agreement is a barrier), on MPI
    and on torch's Gloo (whose own monitored barrier runs only with checks off): a rank in
    another call is a mismatch on every rank, not a hang."""
    from collectives.testing import get_pool

    assert_barrier_mismatch(get_pool(backend, size).run(barrier_mismatch_job, timeout=20), size)


@pytest.mark.timeout(60)
def test_a_barrier_met_by_another_call_is_a_mismatch_in_debug_mode(debug_world):
    assert_barrier_mismatch(debug_world.run(barrier_mismatch_job, timeout=20), 2)


def assert_barrier_mismatch(results, size):
    for rank, ((kind, message), ok) in enumerate(results):
        assert kind == "CollectiveMismatch", f"rank {rank}: {kind} {message}"
        assert "operation differs: barrier on rank" in message and f"all_reduce on rank {size - 1}" in message, message
        assert ok


def barrier_close_job(comm):
    """Barriers that the last rank comes to late (the others wait, and send rank 0 their words),
    then close: rank 0's receives of the words, posted at its first barrier, are given up."""
    sub = comm.split(0)
    sub.all_reduce(np.ones(1))
    for _ in range(3):
        if sub.rank == sub.size - 1:
            time.sleep(0.02)
        sub.barrier()
    posted = [work for work, _ in sub._monitored._words.values()]  # (white-box)
    sub.close()
    return len(posted), all(work.is_completed() for work in posted)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [2, 3])
def test_a_closed_communicator_gives_up_its_barrier_receives(size):
    """A receive left posted would keep the freed MPI communicator (and its context id) alive."""
    from collectives.testing import get_pool

    results = get_pool("mpi", size).run(barrier_close_job, timeout=30)
    assert results[0] == (size - 1, True), results
    assert all(result == (0, True) for result in results[1:]), results


def skipped_call_job(comm):
    """Rank 0 makes a second all_reduce that rank 1 skips; then rank 1 returns."""
    sub = comm.split(0)
    _KEEP.append(sub)  # rank 1 must not tear sub down under rank 0's feet
    sub.all_reduce(np.ones(2))
    if comm.rank == 1:
        return None
    start = time.perf_counter()
    try:
        sub.all_reduce(np.ones(2))
        return ("no error", "", time.perf_counter() - start)
    except CollectiveTimeout as error:
        return ("CollectiveTimeout", str(error), time.perf_counter() - start)


@pytest.mark.timeout(60)
def test_skipped_call_with_nothing_after_times_out(debug_world):
    kind, message, elapsed = debug_world.run(skipped_call_job, timeout=20)[0]
    assert kind == "CollectiveTimeout", message
    assert "all_reduce (call #2)" in message and "timeout=3s" in message
    assert 3 <= elapsed < 10
    _timing(f"skipped call, timeout 3 s [{debug_world.backend}]", elapsed)


# -- timeouts --------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=["mpi", "torch"])
def timeout_world(request):
    pool = _pool(request.param, {config.TIMEOUT: "2"})
    yield pool
    pool.close()


def timeout_job(comm, explicit):
    """Rank 0 calls all_reduce on a communicator where rank 1 never does."""
    if explicit:  # the per-communicator argument beats COLLECTIVES_TIMEOUT=2
        from collectives.backends.mpi import MPICommunicator

        sub = MPICommunicator(comm.mpi_comm, timeout=1.0)
    else:
        sub = comm.split(0)  # inherits the parent's timeout
    _KEEP.append(sub)
    if comm.rank == 1:
        return sub.timeout, None, None, None
    start = time.perf_counter()
    try:
        sub.all_reduce(np.ones(3))
        outcome = ("no error", "")
    except CollectiveTimeout as error:
        outcome = ("CollectiveTimeout", str(error))
    elapsed = time.perf_counter() - start
    try:
        sub.all_reduce(np.ones(3))
        after = ("no error", "")
    except CollectiveError as error:
        after = (type(error).__name__, str(error))
    return sub.timeout, outcome, elapsed, after


@pytest.mark.timeout(60)
@pytest.mark.parametrize("explicit", [False, True], ids=["inherited", "argument"])
def test_collective_that_never_completes_times_out(timeout_world, explicit):
    if explicit and timeout_world.backend != "mpi":
        pytest.skip("a per-communicator timeout on an existing torch group is torch's own")
    seconds = 1.0 if explicit else 2.0
    results = timeout_world.run(timeout_job, args=(explicit,), timeout=20)
    assert results[1][0] == seconds  # rank 1's communicator has the same timeout
    timeout, (kind, message), elapsed, (after_kind, after) = results[0]
    assert timeout == seconds
    assert kind == "CollectiveTimeout", message
    backend = timeout_world.backend
    assert "all_reduce (call #1) on <" in message and f"backend={backend}" in message, message
    assert f"timeout={seconds:g}s" in message and "now unusable" in message, message
    # what torch's callers match in a timeout's message (its own suite: test_barrier_timeout_*)
    assert re.search(" (Timed out|closed|timeout) ", message) and " timed out" in message, message
    assert seconds <= elapsed < seconds + 5
    assert after_kind == "CollectiveError" and "is unusable" in after, after
    _timing(f"timeout {seconds:g} s [{backend}, {'argument' if explicit else 'env'}]", elapsed)


def sibling_timeout_job(comm):
    """Two split communicators used in opposite orders: each rank times out on its first,
    leaving a call behind on it; the next call on the OTHER one would meet the peer's
    abandoned call and return its data (1 + 100) unless it refuses to run."""
    first, second = comm.split(0), comm.split(0)
    _KEEP.extend([first, second])
    mine, other = (first, second) if comm.rank == 0 else (second, first)
    try:
        mine.all_reduce(np.full(4, 1.0 if comm.rank == 0 else 100.0))
        timed_out = "no error"
    except CollectiveTimeout:
        timed_out = "CollectiveTimeout"
    outcomes = []
    for sub in (other, comm):
        try:
            outcomes.append(("no error", sub.all_reduce(np.full(4, comm.rank + 1.0)).tolist()))
        except CollectiveError as error:
            outcomes.append((type(error).__name__, str(error)))
    return timed_out, outcomes


@pytest.mark.timeout(150)
def test_timeout_makes_every_communicator_of_the_transport_unusable(timeout_world):
    results = timeout_world.run(sibling_timeout_job, timeout=20)
    for rank, (timed_out, outcomes) in enumerate(results):
        assert timed_out == "CollectiveTimeout", rank
        for kind, message in outcomes:  # never a result: 101 + 2 or 1 + 2 would be garbage
            assert kind == "CollectiveError", f"rank {rank}: {kind} {message}"
            assert "is unusable" in message and "shares the" in message, message
    # The pool's own communicator was made unusable too: the next job gets new ranks.
    starts = timeout_world.starts
    assert timeout_world.run(_sum_of_ranks, timeout=20) == [3.0, 3.0]
    assert timeout_world.starts == starts + 1


def _sum_of_ranks(comm):
    return float(comm.all_reduce(np.array([comm.rank + 1.0]))[0])


def test_timeout_setting_parses_env_and_argument(monkeypatch):
    from collectives.backends.local import LocalCommunicator

    monkeypatch.delenv(config.TIMEOUT, raising=False)
    assert config.timeout_seconds() == config.DEFAULT_TIMEOUT == 1800
    assert LocalCommunicator(timeout=5).timeout == 5.0
    import datetime

    assert config.timeout_seconds(datetime.timedelta(minutes=2)) == 120
    assert LocalCommunicator(timeout=0).timeout is None
    for text, expected in (("60", 60.0), ("0", None), ("none", None), (" 2.5 ", 2.5)):
        monkeypatch.setenv(config.TIMEOUT, text)
        assert config.timeout_seconds() == expected
        assert LocalCommunicator().split(0).timeout == expected  # a split inherits
    for text in ("soon", "-1", "nan"):
        monkeypatch.setenv(config.TIMEOUT, text)
        with pytest.raises(ValueError, match=config.TIMEOUT):
            config.timeout_seconds()
    with pytest.raises(TypeError, match="timeout must be seconds"):
        LocalCommunicator(timeout="10")
    with pytest.raises(ValueError, match="timeout=-2"):
        LocalCommunicator(timeout=-2)


# -- rank failure under each launcher --------------------------------------------------------

CRASHES = [("mpiexec", "mpi", "raise"), ("mpiexec", "mpi", "exit"), ("mpiexec", "mpi", "kill"),
           ("mpiexec", "torch", "raise"), ("mpiexec", "torch", "kill"),
           ("torchrun", "torch", "raise"), ("torchrun", "torch", "kill")]


def _launcher(name: str) -> str:
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


def _processes_with(token: str) -> list[int]:
    """Pids of live processes whose environment holds ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if token.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _describe(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()[:3]
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            lines.append(f"{pid}: {cmd} {status}")
        except OSError:
            lines.append(f"{pid}: gone")
    return "; ".join(lines)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("launcher,backend,mode", CRASHES, ids=["-".join(c) for c in CRASHES])
def test_failing_rank_ends_the_job(launcher, backend, mode):
    from collectives.testing.launch import free_port as _free_port

    script = str(ROOT / "tests" / "reliability" / "reliability_crash.py")
    if launcher == "mpiexec":
        command = [_launcher("mpiexec"), "-n", "2", sys.executable, script, mode]
    else:
        command = [_launcher("torchrun"), "--nnodes", "1", "--nproc_per_node", "2",
                   "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), script, mode]
    token = f"COLLECTIVES_CRASH_TEST={secrets.token_hex(8)}"
    env = {**os.environ, "COLLECTIVES_BACKEND": backend, "COLLECTIVES_TIMEOUT": "600",
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           token.split("=")[0]: token.split("=")[1]}
    env = without_launcher_variables(env)
    process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the job did not end within 60 s:\n{output.decode(errors='replace')}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    ended = time.time()
    text = output.decode(errors="replace")
    assert process.returncode != 0, text
    failing = re.search(r"FAILING AT ([0-9.]+) rank 1 pid (\d+)", text)
    assert failing, text
    assert "the second all_reduce returned" not in text, text
    if launcher == "torchrun":  # torchrun's failure report names the rank and its exit
        assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: -?[1-9]", text), text
    elif mode in ("raise", "exit"):  # the hook's line, printed before MPI_Abort; on a
        # loaded machine Hydra may drop it, but MPICH's own abort line names the rank too
        line = "uncaught RuntimeError" if mode == "raise" else "sys.exit(3)"
        assert (f"{line} on rank 1 of 2" in text
                or "Abort(" in text and "(rank 1 in comm 0)" in text), text
    elif "BAD TERMINATION" in text:  # Hydra names a process killed by a signal by its pid
        assert f"PID {failing.group(2)} RUNNING AT" in text, text
    else:  # torch: the survivor lost its connection first, said so (maybe lost), aborted
        assert backend == "torch" and ("(a peer rank may have died)" in text
                                       or "(rank 0 in comm 0)" in text), text
    # Nothing of the job is left running (a zombie has no readable environment). Hydra
    # may exit while the SIGKILLs it sent are still being delivered: allow a moment.
    deadline = time.monotonic() + 5
    while (left := _processes_with(token)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not left, f"processes left running 5 s after the launcher exited: {_describe(left)}"
    _timing(f"rank 1 {mode} -> job ended [{backend} under {launcher}]",
            ended - float(failing.group(1)))
