"""Timeouts of calls on a device stream on the torch route, beside the calls (backends/torch_watch.py):
a blocking CUDA tensor's call on NCCL returns once enqueued, a pooled event recorded after it goes on
the transport's watch, and the process's watchdog thread finds a call past its deadline: the NCCL
backend is aborted and every rank's next call (or a handle's wait) raises CollectiveTimeout naming
the call, the flight recorder dumped.

CI has no GPU: the CPU twin (collectives.testing.torch_twin.StreamOrderedTwin, ``enqueues=True``)
runs a blocking call as Gloo's asynchronous call put on the twin's stream (returned at once, as on
NCCL), its events complete once what was enqueued before them has, and a call stays in flight
while a Gloo recv enqueued before it waits for a peer that sends only later. References: numpy on
every rank's inputs, computed here; the calls the calling thread makes, counted by a profiler.
"""

import json
import os
import sys
import threading

import numpy as np
import pytest
import torch

from collectives.context import poll_until
from collectives.diagnostics.recorder import clock

SETTLE = 30.0  # seconds a rank waits for the watchdog at most (a bug fails, not hangs)
WATCHDOG = "collectives-stream-watchdog"
#: What the calling thread must not call during a blocking call: a wait for a call or an event, a
#: query of one (the watchdog thread's job), a sleep.
WAITS = frozenset({"wait", "wait_for", "synchronize", "is_completed", "query", "sleep", "_wait_for_tstate_lock"})


def _data(seed, rank, shape):
    """Small integers: every sum is exact."""
    return np.random.default_rng([seed, rank]).integers(-4, 5, shape).astype("float32")


def _twin(comm, timeout):
    from collectives.testing.torch_twin import twin_of

    return twin_of(comm, timeout=timeout, enqueues=True)


def _drained(twin):
    """Wait until every call on the twin's watch has completed (the watchdog took it off)."""
    watch = twin._transport._stream_watch
    assert poll_until(lambda: not watch._inflight, clock() + SETTLE), "the calls never completed"


class _Stall:
    """A Gloo recv from the peer put on the twin's stream: what is enqueued after it stays in flight
    until :meth:`release` (every rank: the peer's send, then the recv's end)."""

    def __init__(self, twin, tag):
        import torch.distributed as dist

        transport = twin._transport
        self.dist, self.group, self.tag = dist, transport._group, tag
        self.peer = transport._global_ranks[1 - twin.rank]
        self.work = dist.irecv(torch.zeros(1), self.peer, group=self.group, tag=tag)
        transport.stream.enqueue(self.work)

    def release(self):
        self.dist.send(torch.ones(1), self.peer, group=self.group, tag=self.tag)
        self.work.wait()


class _Calls:
    """The functions the calling thread called (Python's and C's, by name) while profiled."""

    def __init__(self):
        self.names = []

    def __enter__(self):
        names, me = self.names, threading.get_ident()

        def profile(frame, event, arg):
            if threading.get_ident() != me:
                return
            if event == "c_call":
                names.append(getattr(arg, "__name__", ""))
            elif event == "call":
                names.append(frame.f_code.co_name)

        sys.setprofile(profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def enqueued_job(comm, calls):
    """``calls`` blocking all_reduces behind a stalled stream: whether each returned its x, what is
    on the watch then, what the calling thread called, and the results once the stream moves."""
    twin = _twin(comm, 60)
    transport = twin._transport
    r = twin.rank
    twin.all_reduce(torch.from_numpy(_data(99, r, (3,))))  # the first collective: checked before it runs
    _drained(twin)
    stall = _Stall(twin, tag=77)
    before = (transport.agreed, transport.exchanged)
    xs = [torch.from_numpy(_data(i, r, (6,))) for i in range(calls)]
    with _Calls() as called:
        returned = [twin.all_reduce(x) is x for x in xs]
    in_flight = len(transport._stream_watch._inflight)
    rounds = (transport.agreed - before[0], transport.exchanged - before[1])
    stall.release()
    _drained(twin)
    got = [x.numpy().copy() for x in xs]
    failed = twin._why_broken
    twin.close()
    return dict(returned=returned, in_flight=in_flight, rounds=rounds, failed=failed, got=got,
                waits=sorted(name for name in called.names if name in WAITS),
                allreduces=called.names.count("allreduce"))


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_a_blocking_stream_ordered_call_returns_once_enqueued_with_no_wait_and_no_cpu_collective(world):
    calls = 40
    results = world.run(enqueued_job, args=(calls,), timeout=120)
    for rank, result in enumerate(results):
        assert result["returned"] == [True] * calls
        # every call was still in flight when the last returned (its event on the watch) ...
        assert result["in_flight"] == calls, result["in_flight"]
        # ... and the calling thread neither waited for one, nor queried one, nor slept
        assert result["waits"] == [], result["waits"]
        # no CPU collective for the check: the only allreduces are the calls themselves
        assert result["rounds"] == (0, 0) and result["allreduces"] == calls, (result["rounds"], result["allreduces"])
        assert result["failed"] is None
        for i, got in enumerate(result["got"]):
            np.testing.assert_array_equal(got, np.sum([_data(i, peer, (6,)) for peer in range(2)], axis=0),
                                          err_msg=f"rank {rank}, call {i}")


def stalled_job(comm, trace_dir):
    """A blocking all_reduce (call #2) that never completes within its timeout on every rank, an
    asynchronous one (#3) behind it: what the next calls and the handle's wait raise, the aborts
    of the group's backend, the dump, the watchdog threads left after close."""
    from collectives import CollectiveTimeout

    os.environ["COLLECTIVES_TRACE_DIR"] = trace_dir
    try:
        twin = _twin(comm, 2.0)
        transport = twin._transport
        x = torch.ones(4)
        twin.all_reduce(x)  # call #1
        _drained(twin)
        stall = _Stall(twin, tag=78)
        twin.all_reduce(x)  # call #2: returns at once; its event waits behind the stall
        handle = twin.all_reduce(torch.ones(4), async_op=True)  # call #3
        assert poll_until(lambda: twin._why_broken is not None, clock() + SETTLE), "no timeout found"
        raised = []
        for attempt in (lambda: twin.all_reduce(x), handle.wait, lambda: twin.broadcast(x, 0)):
            with pytest.raises(CollectiveTimeout) as error:
                attempt()
            raised.append(str(error.value))
        stall.release()
        twin.close()
    finally:
        del os.environ["COLLECTIVES_TRACE_DIR"]
    with open(os.path.join(trace_dir, f"rank-{comm.rank}.json")) as dump:
        reason = json.load(dump)["reason"]
    watchdogs = [thread for thread in threading.enumerate() if thread.name == WATCHDOG]
    return raised, transport.aborted, reason, len(watchdogs)


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_a_call_past_its_timeout_aborts_the_group_and_every_rank_raises_naming_it(world, tmp_path):
    for rank, (raised, aborted, reason, watchdogs) in enumerate(
            world.run(stalled_job, args=(str(tmp_path),), timeout=120)):
        named = f"all_reduce (call #2) on <TorchCommunicator backend=torch rank={rank} size=2"
        for text in raised:  # the next call, the handle's wait, every later call
            assert named in text and "timeout=2s" in text and "aborted" in text, text
        assert aborted == 1
        assert "CollectiveTimeout in all_reduce (call #2)" in reason, reason
        assert watchdogs == 0


def pooled_job(comm, rounds, per_round):
    """``rounds`` rounds of ``per_round`` blocking all_reduces, each round left to complete: the
    events the watch made, and the last round's results."""
    twin = _twin(comm, 60)
    r = twin.rank
    twin.all_reduce(torch.ones(2))  # the first collective: checked before it runs
    events = twin._transport._events
    made = []
    for k in range(rounds):
        xs = [torch.from_numpy(_data(k * per_round + i, r, (5,))) for i in range(per_round)]
        for x in xs:
            twin.all_reduce(x)
        _drained(twin)
        made.append(events.made)
    got = [x.numpy().copy() for x in xs]
    pooled = len(events.pool)
    twin.close()
    return made, pooled, got


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_the_calls_take_pooled_events_not_one_each(world):
    rounds, per_round = 20, 10
    for made, pooled, got in world.run(pooled_job, args=(rounds, per_round), timeout=120):
        # at most a round's calls in flight at once: at most that many events, ever
        assert made[-1] <= per_round + 1 and pooled == made[-1], (made, pooled)
        last = (rounds - 1) * per_round
        for i, values in enumerate(got):
            np.testing.assert_array_equal(values, _data(last + i, 0, (5,)) + _data(last + i, 1, (5,)))


def backstop_job(comm):
    """The timeout torch's own watchdog gets on the NCCL backend of a group ``split`` makes (this
    CPU build of torch has no NCCL: Gloo's backend class stands in for it, Gloo's backend then
    taking CUDA tensors' calls as NCCL's would)."""
    import torch.distributed as dist

    had = getattr(dist, "ProcessGroupNCCL", None)
    dist.ProcessGroupNCCL = dist.ProcessGroupGloo
    try:
        child = comm.split(0)
    finally:
        if had is None:
            del dist.ProcessGroupNCCL
        else:
            dist.ProcessGroupNCCL = had
    backend = child._transport._group._get_backend(torch.device("cuda"))
    seconds = backend.options._timeout.total_seconds()
    child.close()
    return comm.timeout, seconds


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_torchs_own_nccl_watchdog_waits_longer_than_the_communicators_timeout(world):
    for timeout, seconds in world.run(backstop_job, timeout=60):
        assert seconds == 2 * timeout + 60, (timeout, seconds)
