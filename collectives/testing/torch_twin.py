"""The CPU twin of the torch route's CUDA decision: a torch transport over a Gloo group that takes
every call on a torch tensor as ordered on a device stream (as a CUDA tensor's call on NCCL is),
so that the default check of those calls goes beside them (backends/posted_checks.py), as it does
for CUDA tensors on a group with NCCL. The collectives themselves run on Gloo (blocking ones return
once done, where NCCL's return once enqueued, unless ``enqueues``: below); what this proves is the check's
bookkeeping: no CPU collective and no wait of the calling thread per call, a mismatch raised at a
later call on every rank, nothing left running after ``close()`` (tests/collective_calls/
test_posted_checks.py; scripts/bench/host_cost.py ``--twin``).

The calls go where a CUDA tensor's go (no CPU tensor's fast path: a plain tensor of a planned
kind through the kind's method, the plan's process-group call, as on NCCL; else the row's method)
and, under a timeout, on the transport's watch (backends/torch_watch.py) as a CUDA call does: the
twin's device stream is :class:`TwinStream` (the Gloo works enqueued on it, in
order) and its events :class:`TwinEvents` (pooled; an event completes once every work enqueued
before it was recorded has). With ``enqueues=True`` a blocking call that needs no host step after
it (an all_reduce SUM, a broadcast...) runs as Gloo's asynchronous call put on the stream and
returns at once, as an NCCL call returns once enqueued: a call whose peer never comes stays in
flight, and past its timeout the watchdog finds it (tests/collective_calls/test_stream_timeouts.py).

:class:`StreamOrderedTwin` counts what the calling thread asks of the transport's own group for
the check (``agreed``: rounds of the check word; ``exchanged``: fingerprint exchanges) and the
aborts of its group's device backend (``aborted``: the twin's group is Gloo's, whose abort would
not end a stalled call: the abort of an NCCL backend is what it stands for).
Imported explicitly (it imports torch).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from collectives import arrays
from collectives.backends import torch_plans
from collectives.backends.torch_dist import TorchCommunicator, TorchTransport
from collectives.communicator import Communicator

_TORCH = arrays.TORCH


class StreamOrderedTwin(TorchTransport):
    """A :class:`~collectives.backends.torch_dist.TorchTransport` whose torch tensors' calls are
    stream-ordered (their checks posted, the calls watched against their timeout on
    :attr:`stream`), with counts of the check's own rounds on its group and of the aborts."""

    def __init__(self, group: Any = None, ranks: list[int] | None = None, local_rank: int | None = None,
                 *, enqueues: bool = False) -> None:
        super().__init__(group, ranks, local_rank)
        self._posts_checks = self._watches_streams = True
        #: Rounds of the check word (``_agree_word``) and fingerprint exchanges made on the
        #: transport's own group, by the calling thread; aborts of the group's device backend.
        self.agreed = self.exchanged = self.aborted = 0
        #: Whether a blocking call is enqueued on :attr:`stream` (Gloo's asynchronous call) and
        #: returns at once, as on NCCL.
        self.enqueues = enqueues
        #: The twin's device stream, and its events (what the watch records after a call).
        self.stream = TwinStream()
        self._events = TwinEvents()

    def _array_check(self, adapter: Any) -> Callable[[Any, bool], Any] | None:
        # a plain tensor's verdict is a CUDA tensor's: checked, for the kind's method (never the
        # fast path, which takes only the tensors this check returns)
        return torch_plans.tensor_check(self._torch, "cpu") if adapter is _TORCH else None

    def _device_check(self) -> Callable[[Any], Any] | None:
        return torch_plans.device_check(self._torch, "cpu")  # (the plan's call on the twin's stream)

    def _stream_of(self, x: Any, adapter: Any) -> TwinStream | None:
        return self.stream if adapter is _TORCH else None

    def _watched(self, method: Callable[[Any], Any]) -> Callable[[Any], Any]:
        return super()._watched(self._enqueued(method) if self.enqueues else method)

    def _enqueued(self, method: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``method`` with a blocking call run as Gloo's asynchronous one, put on the twin's
        stream (a call with a host step after it, which NCCL would enqueue too, waits here)."""
        stream = self.stream

        def run(r: Any) -> Any:
            if r.async_op:
                return method(r)
            r.async_op = True
            try:
                handle = method(r)
            finally:
                r.async_op = False
            work = getattr(handle, "_work", None)
            if work is None or getattr(handle, "_finish", None) is not None:
                return handle.wait()
            stream.enqueue(work)
            return handle._x

        return run

    def _abort_stream_backend(self) -> None:
        self.aborted += 1
        super()._abort_stream_backend()

    def _stream_ordered(self, x: Any) -> bool:
        return type(x).__module__.startswith("torch")

    def _agree_word(self, word: int, waiting: Callable[[], None] | None = None) -> int:
        self.agreed += 1
        return super()._agree_word(word, waiting)

    def _exchange_small(self, vector: Any) -> Any:
        self.exchanged += 1
        return super()._exchange_small(vector)

    def _split_transport(self, group: Any, global_ranks: list[int]) -> TorchTransport:
        return StreamOrderedTwin(group, ranks=global_ranks, local_rank=self.local_rank, enqueues=self.enqueues)


class TwinStream:
    """The twin's device stream: the Gloo works enqueued on it (by the calling thread), which a
    stream runs in order; queried (by the watchdog's thread) through its events."""

    def __init__(self) -> None:
        self._works: collections.deque[Any] = collections.deque()
        self.enqueued = 0  # works enqueued so far
        self._completed = 0  # of them, the first ones, completed

    def enqueue(self, work: Any) -> None:
        """Put torch's handle ``work`` (of a call made) on the stream."""
        self._works.append(work)
        self.enqueued += 1

    def reached(self, mark: int) -> bool:
        """Whether the first ``mark`` works enqueued have completed."""
        works = self._works
        while self._completed < mark and works and works[0].is_completed():
            works.popleft()
            self._completed += 1
        return self._completed >= mark


class TwinEvent:
    """A CUDA event's twin: recorded on a :class:`TwinStream`, complete once the works enqueued
    before have."""

    __slots__ = ("stream", "mark")

    def __init__(self) -> None:
        self.stream: TwinStream | None = None
        self.mark = 0

    def record(self, stream: TwinStream) -> None:
        self.stream, self.mark = stream, stream.enqueued


class TwinEvents:
    """The twin's events as a watch's library (backends/torch_watch.CudaEvents'): ``made`` counts
    those made."""

    def __init__(self) -> None:
        self.pool: list[TwinEvent] = []
        self.made = 0

    def new_event(self) -> TwinEvent:
        self.made += 1
        return TwinEvent()

    @staticmethod
    def query(event: TwinEvent) -> bool:
        return event.stream is None or event.stream.reached(event.mark)


def twin_of(comm: TorchCommunicator, *, timeout: Any = None, enqueues: bool = False) -> Communicator:
    """A communicator over a new Gloo group of ``comm``'s ranks (a ``split`` of it, every rank
    calling), through :class:`StreamOrderedTwin` (``enqueues``: its)."""
    transport = comm._transport
    split = transport._split(0, comm.rank)
    assert split is not None
    twin = StreamOrderedTwin(split._group, ranks=split._global_ranks, local_rank=comm.local_rank,
                             enqueues=enqueues)
    twin._name = split._name + "/twin"
    return TorchCommunicator._adopt(twin, timeout=timeout if timeout is not None else comm.timeout,
                                    name=f"{comm.trace_name}/twin")
