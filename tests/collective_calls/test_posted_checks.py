"""The default check of calls on a device stream goes beside them (backends/posted_checks.py): on
the torch route a CUDA tensor's collective makes no CPU collective and no host wait for its check;
the watchdog thread compares the ranks' check words over a Gloo group of their own, and a mismatch
is raised at a later call on every rank, the communicator unusable.

CI has no GPU: the CPU twin (collectives.testing.torch_twin.StreamOrderedTwin) takes every torch
tensor's call on a Gloo group as stream-ordered, as a CUDA tensor's call is on NCCL, and counts the
check's rounds that the calling thread makes on the transport's own group. References: numpy on
every rank's inputs, computed here.
"""

import collections
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from collectives.context import poll_until
from collectives.diagnostics.recorder import clock
from collectives.launcher import without_launcher_variables
from collectives.testing.launch import torchrun_command

SETTLE = 30.0  # seconds a rank waits for the watchdog's verdict at most (a bug fails, not hangs)
WATCHDOG = "collectives-stream-watchdog"
#: torch.distributed's collective functions (what a row's method calls; a plan calls the group's own)
DIST_CALLS = frozenset({"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                        "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                        "gather", "scatter", "all_to_all_single", "send", "recv", "isend", "irecv"})


def _data(seed, rank, shape, dtype="float32"):
    """Small integers: every sum is exact."""
    return np.random.default_rng([seed, rank]).integers(-4, 5, shape).astype(dtype)


def _t(seed, rank, shape, dtype="float32"):
    return torch.from_numpy(_data(seed, rank, shape, dtype))


def _twin(comm):
    from collectives.testing.torch_twin import twin_of

    return twin_of(comm, timeout=60)


def _watchdogs():
    return [thread for thread in threading.enumerate() if thread.name == WATCHDOG]


def matched_job(comm, calls):
    """``calls`` rounds of mixed collectives on the twin (blocking and asynchronous): the results,
    the check's rounds the calling thread made on the twin's group after its first call, and what
    is left after close (watchdog threads, the checks' group)."""
    import torch.distributed as dist

    twin = _twin(comm)
    transport = twin._transport
    r, n = twin.rank, twin.size
    twin.all_reduce(_t(0, r, (2,)))  # the first collective: checked in full before it runs
    before = (transport.agreed, transport.exchanged)
    got = []
    through_dist = collections.Counter()  # the calling thread's calls of torch.distributed's functions

    def count_dist(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_name in DIST_CALLS and code.co_filename.endswith("distributed_c10d.py"):
            through_dist[code.co_name] += 1
    sys.setprofile(count_dist)
    for i in range(calls):
        kind = i % 6
        if kind == 0:
            got.append(twin.all_reduce(_t(i, r, (5,))).numpy().copy())
        elif kind == 1:
            got.append(twin.all_reduce(_t(i, r, (3, 2), "int32"), "max").numpy().copy())
        elif kind == 2:
            got.append(twin.broadcast(_t(i, r, (4,)), i % n).numpy().copy())
        elif kind == 3:
            got.append(twin.all_gather(_t(i, r, (2,))).numpy().copy())
        elif kind == 4:
            got.append(twin.reduce_scatter(_t(i, r, (n, 3))).numpy().copy())
        else:
            got.append(twin.all_reduce(_t(i, r, (4,), "float64"), "avg", async_op=True).wait().numpy().copy())
    sys.setprofile(None)
    rounds = (transport.agreed - before[0], transport.exchanged - before[1])
    posted, group = getattr(transport, "_posted", None), getattr(transport, "_posting_group", None)
    during = len(_watchdogs())
    twin.close()  # every posted check compared first
    names = dist.distributed_c10d._world.pg_names
    return dict(got=got, rounds=rounds, through_dist=dict(through_dist), compared=getattr(posted, "rounds", 0),
                failed=getattr(posted, "failed", None),
                during=during, after=len(_watchdogs()), group_alive=group is None or group in names)


def _expected(i, n):
    every = lambda shape, dtype="float32": [_data(i, rank, shape, dtype) for rank in range(n)]  # noqa: E731
    kind = i % 6
    if kind == 0:
        return [np.sum(every((5,)), axis=0)] * n
    if kind == 1:
        return [np.max(every((3, 2), "int32"), axis=0)] * n
    if kind == 2:
        return [_data(i, i % n, (4,))] * n
    if kind == 3:
        return [np.stack(every((2,)))] * n
    if kind == 4:
        total = np.sum(every((n, 3)), axis=0)
        return [total[rank:rank + 1] for rank in range(n)]
    return [np.mean(np.array(every((4,), "float64")), axis=0)] * n


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_stream_ordered_calls_make_no_check_round_and_match_numpy(world):
    calls = 240
    results = world.run(matched_job, args=(calls,), timeout=120)
    n = world.size
    for rank, result in enumerate(results):
        # (a) no round of the check word and no fingerprint exchange on the calling thread
        assert result["rounds"] == (0, 0), result["rounds"]
        # (b) every call took its kind's plan (the process group's own call, as a CUDA tensor's
        # does on NCCL), none torch.distributed's function
        assert result["through_dist"] == {}, result["through_dist"]
        # the checks were compared beside the calls, and found nothing
        assert result["compared"] >= 1 and result["failed"] is False
        # (c) the results, against numpy
        for i, got in enumerate(result["got"]):
            np.testing.assert_array_equal(got, _expected(i, n)[rank], err_msg=f"call {i}")
    for result in results:
        # (d) close: the watchdog thread ended, the checks' own group destroyed
        assert result["during"] == 1 and result["after"] == 0
        assert not result["group_alive"]


def mismatch_job(comm, how):
    """One matched call, then one that differs between the ranks as ``how`` says, on a new twin:
    what the next calls raise, once the watchdog has found it (on the twin the Gloo call itself
    completes: the check is what finds the difference)."""
    from collectives import CollectiveMismatch

    twin = _twin(comm)
    r = twin.rank
    x = _t(1, r, (8,))
    twin.all_reduce(x)
    twin.all_reduce(x)  # a posted check that agrees
    if how == "shape":
        twin.all_reduce(torch.ones(8) if r == 0 else torch.ones(2, 4))
    elif how == "dtype":
        twin.all_reduce(torch.ones(4, dtype=torch.float32 if r == 0 else torch.int32))
    elif how == "op":
        twin.all_reduce(torch.ones(4), "sum" if r == 0 else "max")
    elif how == "refused":  # rank 1 refuses it (bool has no SUM), then makes the call rank 0 made
        if r == 1:
            with pytest.raises(TypeError):
                twin.all_reduce(torch.ones(4, dtype=torch.bool))
        twin.all_reduce(torch.ones(4))
    else:  # a handle of the mismatched call, waited after the verdict
        handle = twin.all_reduce(torch.ones(8) if r == 0 else torch.ones(2, 4), async_op=True)
    # the verdict, found off this thread
    assert poll_until(lambda: twin._why_broken is not None, clock() + SETTLE), "no verdict"
    raised = []
    if how == "wait":
        with pytest.raises(CollectiveMismatch) as waited:
            handle.wait()
        raised.append(str(waited.value))
    for _ in range(2):  # the next call raises it, and every later one
        with pytest.raises(CollectiveMismatch) as error:
            twin.all_reduce(x)
        raised.append(str(error.value))
    twin.close()
    return raised, len(_watchdogs())


@pytest.mark.parametrize("how, difference", [
    ("shape", "shape differs: (8,) on rank 0; (2, 4) on rank 1"),
    ("dtype", "dtype differs: float32 on rank 0; int32 on rank 1"),
    ("op", "reduce op differs: SUM on rank 0; MAX on rank 1"),
    ("refused", "rank 1 refused all_reduce call #3"),
    ("wait", "shape differs: (8,) on rank 0; (2, 4) on rank 1"),
])
@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_a_mismatch_raises_at_the_next_call_on_every_rank(world, how, difference):
    for raised, watchdogs in world.run(mismatch_job, args=(how,), timeout=120):
        for text in raised:
            assert "all_reduce call #3" in text and difference in text, text
            assert "checked beside it" in text
        assert watchdogs == 0


AT_EXIT = """
import sys, threading, torch, torch.distributed as dist, collectives
from collectives.backends import torch_bootstrap
from collectives.testing.torch_twin import twin_of
comm = collectives.init()
twin = twin_of(comm)
for _ in range(20):
    twin.all_reduce(torch.ones(4))
group = getattr(twin._transport, "_posting_group", None)
torch_bootstrap._destroy_created_groups()  # what runs at exit
alive = [t.name for t in threading.enumerate() if t.name == "collectives-stream-watchdog"]
sys.stdout.write(f"AFTER {group is not None} {len(alive)}\\n")  # (one write: the ranks share the pipe)
"""


def test_the_exit_hook_stops_the_checks_and_destroys_their_group(tmp_path):
    # A Gloo group alive at the interpreter's end aborts the process ("terminate called without
    # an active exception"); a watchdog still looking at a destroyed group would fail.
    script = tmp_path / "at_exit.py"
    script.write_text(AT_EXIT)
    env = without_launcher_variables({k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")})
    env["COLLECTIVES_BACKEND"] = "torch"
    done = subprocess.run(torchrun_command(2, [str(script)]), env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.findall(r"AFTER (\w+) (\d+)", done.stdout) == [("True", "0")] * 2, done.stdout
    assert "terminate called" not in done.stderr, done.stderr[-3000:]


def backlog_job(comm, calls, differ_at):
    """``calls`` checks posted at once on a PostedChecks over a new Gloo group (the calls' words alike
    on every rank, but at ``differ_at`` on rank 1), compared by ticking it here: the rounds it took,
    and the call named by the mismatch, if any."""
    from collectives.backends.posted_checks import PostedChecks, TorchRounds

    sub = comm.split(0)
    found = []
    checks = PostedChecks(TorchRounds(torch, sub._transport._group), sub.size,
                          lambda everyone, reasons, call: RuntimeError(f"{call}"), found.append)
    for i in range(calls):
        word = i + (1 if i == differ_at and sub.rank == 1 else 0)
        checks.post((word, i + 1, ("all_reduce", None, -1, "float32", (3,), None)))

    def compared():
        checks.tick()  # (this thread drives the rounds: no watchdog here)
        return checks.idle()

    assert poll_until(compared, clock() + 60)
    sub.close()
    return checks.rounds, [str(error) for error in found]


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_a_backlog_of_posted_checks_is_compared_in_rounds_that_grow(world):
    """5,000 checks posted at once take two rounds (the first of 1,024, the next sized to the
    backlog), not five of 1,024; a difference deep in the backlog is found and named there."""
    for rounds, found in world.run(backlog_job, args=(5000, -1)):
        assert (rounds, found) == (2, [])
    for rounds, found in world.run(backlog_job, args=(5000, 3000)):
        # (two rounds of words, then one of the fingerprints of the call that differs)
        assert rounds == 3 and found == ["('all_reduce', 3001)"], (rounds, found)
