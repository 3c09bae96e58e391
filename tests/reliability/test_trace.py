"""The flight recorder: dumps on a hang, a mismatch, a crash and signals, read by collectives-trace.

Multi-rank cases run ``tests/reliability/trace_job.py`` under the real launchers (mpiexec from the venv's
MPICH wheel, torchrun) with ``COLLECTIVES_TRACE_DIR`` set, signal ranks the way a user would,
wait for the dump files (never for a time), and check ``collectives-trace --json`` exactly.
The recorder itself (bounded ring, hooks, dumps, the analyzer on made-up dumps) is tested in
this process on the local backend.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from collectives.backends.local import LocalCommunicator
from launched_job import LaunchedJob

import collectives
from collectives.diagnostics import recorder, trace
from collectives.launcher import without_launcher_variables

ROOT = Path(__file__).resolve().parents[2]
JOB = str(ROOT / "tests" / "reliability" / "trace_job.py")
CALLS = 5  # trace_job.CALLS: the call the last rank never makes


class Job(LaunchedJob):
    """``trace_job.py MODE`` on ``size`` ranks under ``launcher``, its output read as it comes."""

    def __init__(self, launcher: str, mode: str, size: int, directory: Path, **env: str) -> None:
        super().__init__(launcher, size, JOB, [mode], {
            "COLLECTIVES_BACKEND": "mpi" if launcher == "mpiexec" else "torch",
            "COLLECTIVES_TIMEOUT": "600", "COLLECTIVES_TRACE_DIR": str(directory), **env},
            "COLLECTIVES_TRACE_TEST")
        self.directory = directory

    def dumps_with(self, ranks: list[int], reason: str, timeout: float = 30) -> None:
        """Wait until each of ``ranks`` has a dump whose reason starts with ``reason``."""
        deadline = time.monotonic() + timeout
        while True:
            reasons = {}
            for rank in ranks:
                try:
                    reasons[rank] = json.loads((self.directory / f"rank-{rank}.json").read_text())["reason"]
                except (OSError, ValueError):
                    reasons[rank] = None
            if all(r is not None and r.startswith(reason) for r in reasons.values()):
                return
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"dumps of {ranks} with reason {reason!r}: {reasons}\n{''.join(self.lines)}")
            with self._changed:  # the job's output, or a poll every 20 ms: files have no event
                self._changed.wait(0.02)

    def end(self, timeout: float = 60) -> int:
        code = self.wait_exit(timeout)
        self.assert_nothing_left()
        return code


def verdict(directory: Path) -> dict:
    """What ``collectives-trace DIR --json`` prints (the console script of the venv)."""
    script = Path(sys.executable).parent / "collectives-trace"
    run = subprocess.run([str(script), str(directory), "--json"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode in (0, 1), run.stderr
    return json.loads(run.stdout)


def assert_verdict(found: dict, kind: str, op: str, behind: list[int], odd: list[int],
                   communicator: str = "world", seq: int = CALLS, dumps: list[int] | None = None) -> None:
    assert found["verdict"] == kind, found
    assert (found["call"]["seq"], found["call"]["op"], found["call"]["dtype"], found["call"]["shape"],
            found["call"]["communicator"]) == (seq, op, "float32", [4], communicator), found
    assert found["behind"] == behind, found
    assert found["odd"] == odd, found
    if dumps is not None:
        assert found["dumps"] == dumps, found


LAUNCHERS = ["mpiexec", "torchrun"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_hang_names_the_rank_behind_on_sigusr1_then_sigterm(launcher, tmp_path):
    """Rank 2 of 3 never enters call 5. SIGUSR1 to every rank writes the dumps and the job goes
    on; then SIGTERM to rank 0 rewrites its dump and ends the job."""
    job = Job(launcher, "hang", 3, tmp_path)
    pids = job.pids()
    job.wait_for(r"ENTERING rank", 2)
    job.wait_for(r"ALIVE rank", 0)
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)
    job.dumps_with([0, 1, 2], "SIGUSR1")
    job.wait_for(r"ALIVE rank 2")  # the process went on after its dump
    found = verdict(tmp_path)
    assert_verdict(found, "hang", "all_reduce", behind=[2], odd=[], dumps=[0, 1, 2])
    assert all(pid_alive(pid) for pid in pids.values())
    os.kill(pids[0], signal.SIGTERM)
    job.dumps_with([0], "SIGTERM")
    assert job.end() != 0
    assert_verdict(verdict(tmp_path), "hang", "all_reduce", behind=[2], odd=[])
    text = subprocess.run([sys.executable, "-m", "collectives.trace", str(tmp_path)],
                          capture_output=True, text=True, timeout=60).stdout
    assert text.startswith("hang: call #5 all_reduce float32(4,) SUM on communicator 'world'"), text
    assert "rank 2 is behind: last completed call #4 all_reduce float32(4,) SUM" in text, text


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_mismatch_names_the_odd_rank(launcher, tmp_path):
    """Debug mode; rank 2 of 3 calls broadcast where ranks 0 and 1 call all_reduce."""
    job = Job(launcher, "mismatch", 3, tmp_path, COLLECTIVES_DEBUG="1")
    assert job.end() != 0
    found = verdict(tmp_path)
    assert_verdict(found, "mismatch", "all_reduce", behind=[], odd=[2])
    assert all(reason.startswith(("CollectiveMismatch", "uncaught CollectiveMismatch"))
               for reason in found["reasons"].values()), found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_crash_is_named_in_the_dump_of_the_rank_behind(launcher, tmp_path):
    """Rank 2 of 3 dies of an uncaught exception instead of making call 5: its dump says so."""
    job = Job(launcher, "crash", 3, tmp_path)
    assert job.end() != 0
    found = verdict(tmp_path)
    assert found["reasons"]["2"].startswith("uncaught RuntimeError: the last rank fails"), found
    assert found["crashed"] == [2], found
    if launcher == "torchrun":  # torchrun sends SIGTERM to the others: they write their dumps
        assert_verdict(found, "hang", "all_reduce", behind=[2], odd=[], dumps=[0, 1, 2])
    else:  # MPI_Abort: mpiexec kills the others (SIGKILL) before they can write
        assert_verdict(found, "crash", "all_reduce", behind=[], odd=[], seq=CALLS - 1, dumps=[2])


LATE_SIGTERM = """
import signal, sys
from collectives.diagnostics import process_hooks, recorder
recorder.dump(sys.argv[1])  # what this rank wrote first (its excepthook, a timeout, SIGUSR1)
process_hooks._die_of(signal.SIGTERM)  # then the launcher's SIGTERM, handled while it still ends
"""


@pytest.mark.parametrize("first, kept", [("uncaught RuntimeError: the last rank fails", True),
                                         ("timeout: all_reduce call #5", True), ("SIGUSR1", False)])
def test_a_late_sigterm_keeps_the_dump_that_says_more(first, kept, tmp_path):
    """The race under torchrun, forced: the launcher's SIGTERM reaches the rank that failed after
    its dump; the process still ends by SIGTERM, and the dump that names the failure stays (one
    written on request is rewritten)."""
    env = {**without_launcher_variables(dict(os.environ)), "COLLECTIVES_TRACE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", LATE_SIGTERM, first], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == -signal.SIGTERM, done.stderr
    reason = json.loads((tmp_path / "rank-0.json").read_text())["reason"]
    assert reason == (first if kept else "SIGTERM")


@pytest.mark.timeout(120)
def test_rank_killed_with_sigkill_leaves_no_dump_and_the_verdict_says_so(tmp_path):
    job = Job("mpiexec", "hang", 3, tmp_path)
    pids = job.pids()
    job.wait_for(r"ENTERING rank", 2)
    # The others dump first: once a rank is killed, mpiexec kills the rest at once, and a
    # SIGUSR1 sent after the SIGKILL races with that.
    for rank in (0, 1):
        os.kill(pids[rank], signal.SIGUSR1)
    job.dumps_with([0, 1], "SIGUSR1")
    os.kill(pids[2], signal.SIGKILL)
    assert job.end() != 0
    assert not (tmp_path / "rank-2.json").exists()
    found = verdict(tmp_path)
    assert_verdict(found, "hang", "all_reduce", behind=[2], odd=[], dumps=[0, 1])
    assert found["no_dump"] == [2], found
    job.kill()
    text = subprocess.run([sys.executable, "-m", "collectives.diagnostics.trace", str(tmp_path)],
                          capture_output=True, text=True, timeout=60).stdout
    assert "rank 2 wrote no dump" in text, text


@pytest.mark.timeout(120)
def test_call_on_a_split_communicator_is_identified(tmp_path):
    """4 ranks split by rank % 2; rank 3 never makes call 5 on its half ("world/0:1")."""
    job = Job("mpiexec", "hang-split", 4, tmp_path)
    pids = job.pids()
    job.wait_for(r"ENTERING rank", 3)  # rank 1 in call 5 of its half, ranks 0 and 2 in the barrier
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)
    job.dumps_with([0, 1, 2, 3], "SIGUSR1")
    found = verdict(tmp_path)
    job.kill()
    assert_verdict(found, "hang", "all_reduce", behind=[3], odd=[], communicator="world/0:1")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("hooks", ["1", "0"])
def test_uncaught_exception_in_a_thread_ends_the_job(hooks, tmp_path):
    """Rank 2's worker thread raises; its main thread sleeps. With the process hooks the job
    ends (exit non-zero, a dump naming the thread); with COLLECTIVES_PROCESS_HOOKS=0 it does not."""
    job = Job("mpiexec", "thread-crash", 3, tmp_path, COLLECTIVES_PROCESS_HOOKS=hooks)
    job.pids()
    if hooks == "0":
        job.wait_for(r"Exception in thread worker|RuntimeError: a worker thread fails")
        assert job.process.poll() is None and not (tmp_path / "rank-2.json").exists()
        job.kill()
        return
    assert job.end() != 0
    reason = json.loads((tmp_path / "rank-2.json").read_text())["reason"]
    assert reason == "uncaught RuntimeError in thread 'worker': a worker thread fails", reason


def raised_lines(directory: Path) -> str:
    """The RAISED lines the ranks wrote, each into a file of its own (see trace_job)."""
    return "".join(path.read_text() for path in sorted(directory.glob("raised-*.txt")))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_barrier_that_times_out_names_the_ranks_that_never_arrived(launcher, tmp_path):
    job = Job(launcher, "barrier", 3, tmp_path)
    assert job.end() != 0
    text = "".join(job.lines)
    raised = dict(re.findall(r"RAISED rank (\d) after [0-9.]+ s: (.*)", raised_lines(tmp_path)))
    assert raised["0"].startswith("CollectiveTimeout: barrier (call #5)"), text
    assert "rank(s) 2 never arrived at the barrier" in raised["0"], text
    if "1" in raised:  # (rank 0's abort may end rank 1 first)
        assert "rank 0 did not release the barrier" in raised["1"], text
    found = verdict(tmp_path)
    assert (found["verdict"], found["call"]["op"], found["call"]["seq"], found["behind"]) == \
        ("hang", "barrier", CALLS, [2]), found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("debug", ["", "1", "0"], ids=["check", "debug", "check-off"])
def test_a_barrier_timeout_counts_only_the_words_of_that_barrier(tmp_path, debug):
    """Ranks 1 and 2 waited for rank 0 at three barriers, each sending rank 0 a word it did not
    need then (in debug mode every rank sends its word first, and rank 0 takes them after each
    barrier; with the check off the barrier is MPI's, its words as with the check); at the
    fourth, which rank 2 never joins, rank 0 names rank 2 alone."""
    job = Job("mpiexec", "barrier-late", 3, tmp_path, **({"COLLECTIVES_DEBUG": debug} if debug else {}))
    assert job.end() != 0
    text = "".join(job.lines)
    raised = dict(re.findall(r"RAISED rank (\d) after [0-9.]+ s: (.*)", raised_lines(tmp_path)))
    assert raised["0"].startswith(f"CollectiveTimeout: barrier (call #{CALLS + 3})"), text
    assert raised["0"].endswith("(rank(s) 2 never arrived at the barrier)"), text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_per_call_timeout_overrides_the_communicators(launcher, tmp_path):
    """COLLECTIVES_TIMEOUT=600; all_reduce(x, timeout=1) that rank 2 never joins."""
    job = Job(launcher, "call-timeout", 3, tmp_path)
    assert job.end() != 0
    text = "".join(job.lines)
    # The first of ranks 0 and 1 to time out ends the job; the other may see it leave first.
    raised = re.findall(r"RAISED rank [01] after ([0-9.]+) s: (CollectiveTimeout: .*)", raised_lines(tmp_path))
    assert raised, text
    after, message = raised[0]
    assert message.startswith("CollectiveTimeout: all_reduce (call #5)") and "timeout=1s" in message, text
    assert 1 <= float(after) < 10, text
    found = verdict(tmp_path)
    assert_verdict(found, "hang", "all_reduce", behind=[2], odd=[])


@pytest.mark.timeout(60)
def test_profile_of_a_job_is_aggregated_on_rank_0(tmp_path):
    job = Job("mpiexec", "profile", 3, tmp_path, COLLECTIVES_PROFILE="1")
    assert job.end() == 0
    text = "".join(job.lines)
    assert text.count("collectives profile (3 ranks; time: mean per rank)") == 1, text
    assert re.search(r"all_reduce\s+0 B-1 KiB\s+4 ", text), text  # 16 bytes, 4 calls per rank


def test_profile_prints_a_table_at_exit():
    code = ("import numpy as np, collectives; c = collectives.init('local')\n"
            "for _ in range(10): c.all_reduce(np.ones(1000, np.float32))\n"
            "c.broadcast(np.ones(10**6, np.float32), 0)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**without_launcher_variables(dict(os.environ)), "COLLECTIVES_PROFILE": "1"})
    assert re.search(r"all_reduce\s+1 KiB-64 KiB\s+10 ", run.stderr), run.stderr
    assert re.search(r"broadcast\s+1 MiB-16 MiB\s+1 ", run.stderr), run.stderr
    assert "algbw GB/s" in run.stderr and "busbw GB/s" in run.stderr, run.stderr


def test_bus_bandwidth_factors_are_nccl_tests():
    from collectives.profile import bus_factor

    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_gather", 4) == bus_factor("reduce_scatter", 4) == 0.75
    assert bus_factor("broadcast", 4) == bus_factor("reduce", 4) == 1.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hooks", ["1", "0"])
def test_one_switch_turns_every_process_hook_off(hooks, tmp_path):
    job = Job("mpiexec", "hooks", 2, tmp_path, COLLECTIVES_PROCESS_HOOKS=hooks)
    assert job.end() == 0
    on = "True" if hooks == "1" else "False"
    for rank in (0, 1):
        assert f"HOOKS rank {rank} excepthook={on} thread={on} exit={on} sigterm={on} wakeup={on}" \
            in "".join(job.lines), "".join(job.lines)


# -- in this process: the recorder on the local backend ----------------------------------------

def test_ring_stays_bounded_over_a_million_calls(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_TRACE_SIZE", "100")
    comm = LocalCommunicator()
    x = np.ones(1, np.float32)
    import gc

    for _ in range(1000):
        comm.all_reduce(x)
    gc.collect()
    before = len(gc.get_objects())  # every call's record is a list: a leak would add 10**6
    for _ in range(10**6):
        comm.all_reduce(x)
    gc.collect()
    assert len(comm._ring) == 100
    assert comm._ring[-1][recorder.SEQ] == 10**6 + 1000
    assert len(gc.get_objects()) - before < 1000


def test_trace_size_zero_turns_the_recorder_off_but_not_the_hooks(monkeypatch, tmp_path):
    monkeypatch.setenv("COLLECTIVES_TRACE_SIZE", "0")
    comm = LocalCommunicator()
    comm.all_reduce(np.ones(2))
    assert comm._ring is None
    seen = []
    comm.register_hook(seen.append)
    comm.all_reduce(np.ones(2))
    assert [r.op for r in seen] == ["all_reduce"]
    content = json.loads(Path(comm.dump_trace(str(tmp_path / "d.json"))).read_text())
    assert comm.trace_name not in [c["name"] for c in content["communicators"]]


def test_the_recorders_times_are_read_on_the_monotonic_clock():
    """The call path reads the flight recorder's clock in C where compiled: the clock of
    time.monotonic (the watchdogs' deadlines and the dumps compare its times with that one's)."""
    comm = LocalCommunicator()
    seen = []
    comm.register_hook(seen.append)
    before = time.monotonic()
    comm.all_reduce(np.ones(2))
    after = time.monotonic()
    assert before <= seen[0].start <= seen[0].end <= after
    comm.close()


def test_hooks_see_each_call_until_removed():
    comm = LocalCommunicator()
    seen = []
    handle = comm.register_hook(seen.append)
    x = np.ones((2, 3), np.float64)
    comm.all_reduce(x)
    comm.broadcast(x, 0, timeout=5)
    comm.barrier()
    handle.remove()
    comm.all_reduce(x)
    assert [(r.op, r.seq, r.bytes, r.dtype, r.shape) for r in seen] == [
        ("all_reduce", 1, 48, "float64", (2, 3)), ("broadcast", 2, 48, "float64", (2, 3)),
        ("barrier", 3, 0, None, ())]
    assert all(r.end >= r.start for r in seen)
    with pytest.raises(TypeError, match="fn must be callable"):
        comm.register_hook(3)


def test_dump_trace_writes_a_whole_file_with_stacks_and_the_split_tree(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_TRACE_CALLSITE", "1")
    comm = LocalCommunicator()
    child = comm.split(7)
    child.all_reduce(np.ones(3, np.int32))
    path = comm.dump_trace(str(tmp_path / "d.json"))
    content = json.loads(Path(path).read_text())
    assert [p.name for p in tmp_path.iterdir()] == ["d.json"]  # nothing half-written left
    names = {c["name"]: c for c in content["communicators"]}
    assert f"{comm.trace_name}/0:7" in names
    (call,) = names[f"{comm.trace_name}/0:7"]["calls"]
    assert (call["op"], call["state"], call["shape"], call["dtype"]) == ("all_reduce", "completed", [3], "int32")
    assert call["site"].startswith(f"{__file__}:") and "test_dump_trace" in call["site"]
    assert any(thread["main"] and any("test_dump_trace" in line for line in thread["stack"])
               for thread in content["threads"])
    assert {"host", "pid", "rank", "world_size", "backend", "reason"} <= set(content)


def test_process_hooks_are_not_installed_at_import_or_for_one_process():
    code = ("import sys, threading; hook = sys.excepthook; exit = sys.exit; "
            "import collectives; collectives.init(); "
            "print(sys.excepthook is hook, sys.exit is exit, threading.excepthook is threading.__excepthook__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=without_launcher_variables(dict(os.environ)))
    assert run.stdout.split() == ["True", "True", "True"], run.stderr


def _fake_dump(rank: int, calls: list[tuple], size: int = 3, name: str = "world") -> dict:
    return {"format": recorder.FORMAT, "rank": rank, "world_size": size, "reason": "test",
            "communicators": [{"name": name, "rank": rank, "size": size, "seq": max(c[0] for c in calls),
                               "calls": [{"seq": s, "op": op, "dtype": "float32", "shape": [4], "root": -1,
                                          "state": state, "start": float(s), "site": None}
                                         for s, op, state in calls]}]}


def test_analyzer_on_dumps_made_by_hand():
    done = [(1, "all_reduce", "completed"), (2, "all_reduce", "completed")]
    ok = trace.analyze({r: _fake_dump(r, done) for r in range(3)})
    assert (ok["verdict"], ok["behind"], ok["odd"]) == ("ok", [], [])
    hang = trace.analyze({0: _fake_dump(0, done + [(3, "all_reduce", "started")]),
                          1: _fake_dump(1, done + [(3, "all_reduce", "started")]),
                          2: _fake_dump(2, done)})
    assert (hang["verdict"], hang["call"]["seq"], hang["behind"]) == ("hang", 3, [2])
    odd = trace.analyze({0: _fake_dump(0, done + [(3, "all_reduce", "failed")]),
                         1: _fake_dump(1, done + [(3, "broadcast", "failed")]),
                         2: _fake_dump(2, done + [(3, "all_reduce", "failed")])})
    assert (odd["verdict"], odd["call"]["op"], odd["odd"]) == ("mismatch", "all_reduce", [1])


def test_collectives_trace_is_a_console_script_and_a_module(tmp_path):
    (tmp_path / "rank-0.json").write_text(json.dumps(_fake_dump(0, [(1, "all_reduce", "completed")], size=1)))
    for command in ([str(Path(sys.executable).parent / "collectives-trace")],
                    [sys.executable, "-m", "collectives.diagnostics.trace"]):
        run = subprocess.run([*command, str(tmp_path), "--json"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and json.loads(run.stdout)["verdict"] == "ok", run.stderr


def test_per_call_timeout_is_checked_like_the_communicators():
    comm = collectives.init("local")
    with pytest.raises(ValueError, match="timeout"):
        comm.all_reduce(np.ones(2), timeout=-1)
    assert comm.all_reduce(np.ones(2), timeout=0.5)[0] == 1.0


# -- the verdict on every route -----------------------------------------------------------------

@pytest.mark.timeout(120)
def test_signal_to_one_rank_names_it_and_not_the_ranks_the_launcher_ended(tmp_path):
    """SIGTERM to rank 1 (inside call 5): mpiexec then kills ranks 0 and 2 (no dumps). They are
    not 'behind' and not 'killed by out of memory': rank 1 was signalled first."""
    job = Job("mpiexec", "hang", 3, tmp_path)
    pids = job.pids()
    job.wait_for(r"ENTERING rank", 2)
    os.kill(pids[1], signal.SIGTERM)
    assert job.end() != 0
    found = verdict(tmp_path)
    assert found["verdict"] == "signal" and found["signalled"]["rank"] == 1, found
    assert found["signalled"]["signal"] == "SIGTERM" and found["no_dump"] == [0, 2], found
    text = subprocess.run([sys.executable, "-m", "collectives.diagnostics.trace", str(tmp_path)],
                          capture_output=True, text=True, timeout=60).stdout
    assert text.startswith("signal: rank 1 was ended by SIGTERM first"), text
    assert "ended by the launcher after rank 1 was ended by SIGTERM" in text, text
    assert "out of memory" not in text, text


@pytest.mark.timeout(120)
def test_hang_inside_wait_of_an_asynchronous_call_is_a_hang(tmp_path):
    """Call 5 is all_reduce(async_op=True) and ranks 0 and 1 wait in its wait(): the posted
    call has not completed (it used to count as completed once posted). Checks off: with the
    check on, the ranks would wait in the check before posting (a plain hang)."""
    job = Job("mpiexec", "async-hang", 3, tmp_path, COLLECTIVES_DEBUG="0")
    pids = job.pids()
    job.wait_for(r"ENTERING rank", 2)
    for pid in pids.values():
        os.kill(pid, signal.SIGUSR1)
    job.dumps_with([0, 1, 2], "SIGUSR1")
    found = verdict(tmp_path)
    job.kill()
    assert_verdict(found, "hang", "all_reduce", behind=[2], odd=[], dumps=[0, 1, 2])
    assert found["details"]["states"] == {"0": "posted", "1": "posted", "2": "not entered"}, found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["c10d-timeout", "c10d-crash"])
def test_torch_distributed_calls_on_the_backends_own_communicator_are_named(mode, tmp_path):
    """collectives.c10d runs torch's calls on a split communicator of its own ('world/0:0'):
    the verdict names call 5 there and rank 2, not the split (#1 on 'world') that made it."""
    job = Job("mpiexec", mode, 3, tmp_path, COLLECTIVES_TIMEOUT="3")
    assert job.end() != 0
    found = verdict(tmp_path)
    if mode == "c10d-timeout":  # ranks 0 and 1 time out and dump; MPI_Abort ends rank 2
        assert_verdict(found, "hang", "all_reduce", behind=[2], odd=[], communicator="world/0:0",
                       dumps=[0, 1])
        assert found["no_dump_why"].startswith("ended by the job's MPI_Abort after rank"), found
    else:  # rank 2 dies before call 5; the others are killed before they can write
        assert_verdict(found, "crash", "all_reduce", behind=[], odd=[], seq=CALLS - 1,
                       communicator="world/0:0", dumps=[2])


def test_empty_folder_is_no_dumps_and_a_failure(tmp_path):
    run = subprocess.run([sys.executable, "-m", "collectives.diagnostics.trace", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and run.stdout.startswith("no dumps: the folder holds no rank-<R>.json"), run
    assert trace.analyze({})["verdict"] == "no dumps"


def _dump(rank: int, communicators: dict[str, list[tuple]], reason: str = "test", size: int = 3,
          time_: float = 100.0, launcher: str = "mpiexec") -> dict:
    """A made-up dump: communicator name -> calls (seq, op, state[, redop])."""
    return {"format": recorder.FORMAT, "rank": rank, "world_size": size, "reason": reason,
            "time": time_, "launcher": launcher,
            "communicators": [{"name": name, "rank": rank, "size": size, "seq": max(c[0] for c in calls),
                               "calls": [{"seq": c[0], "op": c[1], "dtype": "float32", "shape": [4],
                                          "root": -1, "state": c[2], "start": float(c[0]), "site": None,
                                          "redop": c[3] if len(c) > 3 else "SUM"} for c in calls]}
                              for name, calls in communicators.items()]}


def test_analyzer_tells_reduce_ops_apart():
    """Debug mode, SUM on ranks 0 and 2 and MAX on rank 1: a mismatch, not 'hang, behind []'."""
    done = [(1, "all_reduce", "completed")]
    found = trace.analyze({r: _dump(r, {"world": done + [(2, "all_reduce", "failed", "MAX" if r == 1 else "SUM")]})
                           for r in range(3)})
    assert (found["verdict"], found["call"]["seq"], found["odd"]) == ("mismatch", 2, [1]), found


def test_analyzer_names_a_crash_by_its_last_call_on_any_communicator():
    calls = {"world": [(1, "split", "completed")],
             "world/0:0": [(s, "all_reduce", "completed") for s in range(1, 11)]}
    found = trace.analyze({2: _dump(2, calls, reason="uncaught RuntimeError: boom")})
    assert found["verdict"] == "crash", found
    assert (found["call"]["seq"], found["call"]["op"], found["call"]["communicator"]) == (10, "all_reduce", "world/0:0")


def test_analyzer_a_rank_without_dump_does_not_make_every_communicator_hang():
    """Rank 1 wrote no dump: the world's last call (#1 split, completed by all that dumped) is
    not the hang; call 6 of 'world/0:0', which ranks 0 and 2 wait in, is."""
    def calls(last_state):
        return {"world": [(1, "split", "completed")],
                "world/0:0": [(s, "all_reduce", "completed") for s in range(1, 6)] + [(6, "all_reduce", last_state)]}
    found = trace.analyze({0: _dump(0, calls("failed")), 2: _dump(2, calls("failed"))})
    assert (found["verdict"], found["call"]["seq"], found["call"]["communicator"], found["behind"]) == \
        ("hang", 6, "world/0:0", [1]), found


def test_analyzer_posted_calls_complete_when_a_later_one_did():
    done = [(1, "all_reduce", "posted"), (2, "all_reduce", "completed")]
    assert trace.analyze({r: _dump(r, {"world": done}) for r in range(3)})["verdict"] == "ok"
    hang = trace.analyze({0: _dump(0, {"world": [(1, "all_reduce", "posted")]}),
                          1: _dump(1, {"world": [(1, "all_reduce", "posted")]}),
                          2: _dump(2, {"world": [(1, "all_reduce", "completed")]}, size=3)})
    assert hang["verdict"] == "hang" and hang["call"]["seq"] == 1, hang


def test_analyzer_a_rank_that_ended_normally_is_not_called_killed():
    done = [(s, "all_reduce", "completed") for s in range(1, 4)]
    dumps = {0: _dump(0, {"world": done}, reason="exit: ended normally"),
             1: _dump(1, {"world": done + [(4, "all_reduce", "failed")]}, reason="PeerLeft in all_reduce (call #4)"),
             2: _dump(2, {"world": done + [(4, "all_reduce", "failed")]}, reason="PeerLeft in all_reduce (call #4)")}
    found = trace.analyze(dumps)
    assert (found["verdict"], found["call"]["seq"], found["behind"]) == ("finished", 4, [0]), found
    text = trace._text(found)
    assert text.startswith("finished: rank(s) [0] ended normally before call #4"), text
    assert "killed" not in text, text


def test_analyzer_a_rank_ended_by_the_jobs_abort_is_not_called_out_of_memory():
    done = [(s, "all_reduce", "completed") for s in range(1, 5)]
    dumps = {0: _dump(0, {"world": done + [(5, "all_reduce", "failed")]}, reason="CollectiveTimeout in all_reduce"),
             1: _dump(1, {"world": done}, reason="uncaught RuntimeError: boom", time_=99.0)}
    found = trace.analyze(dumps)
    assert found["no_dump"] == [2] and "MPI_Abort after rank 1's uncaught RuntimeError" in found["no_dump_why"], found
    assert "out of memory" not in trace._text(found)


LOST = [("mpiexec", "c10d-crash", "RuntimeError: the last rank fails before its call"),
        ("mpiexec", "c10d-timeout", "CollectiveTimeout: all_reduce (call #5)"),
        ("torchrun", "hang", "CollectiveTimeout: all_reduce (call #5)")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher,mode,line", LOST, ids=[f"{c[0]}-{c[1]}" for c in LOST])
def test_no_traceback_or_timeout_message_is_lost(launcher, mode, line, tmp_path):
    """The failing rank's traceback reaches the output, also where torch's excepthook buffers it
    (collectives.c10d, torchrun), and no 'uncaught SystemExit' line follows it."""
    job = Job(launcher, mode, 3, tmp_path, COLLECTIVES_TIMEOUT="3")
    assert job.end() != 0
    text = job.text
    assert line in text and "Traceback (most recent call last)" in text, text
    assert "uncaught SystemExit" not in text, text
