"""Operations of a "collectives" group on the caller's CUDA stream, as torch's NCCL group runs them.

Over the cupy transport (NCCL), a torch operation on CUDA tensors is made on the calling thread,
through the group's communicator (its one call path: the same checks, sequence numbers and
timeouts as every call), on torch's current stream, and returns once enqueued: the
:class:`StreamWork` torch gets is the operation's end on that stream. Nothing on the calling thread
waits for the GPU or for a peer:

- ``wait()`` makes the then-current stream wait for the operation's end (a CUDA event recorded
  after it), and raises the communicator's failure where it has one (a mismatch of calls found by
  the default check beside the calls, a timeout found by the watchdog: backends/posted_checks.py,
  backends/stream_watch.py), as the next call would;
- ``is_completed()`` queries the event;
- ``get_future()`` completes once the GPU has run the operation: the process's watchdog thread (the
  one that watches the calls' timeouts) looks at the futures asked for (:class:`FutureWatch`) and
  hands the completed ones to completer threads (:class:`~collectives.c10d.worker.Completer`),
  which run their callbacks. A future no one asks for costs nothing.

Where the calling thread may not call the group's communicator (a thread other than the one that
made the group, outside a backward pass), CPU tensors, and the other transports, the operation
runs on the group's worker thread instead (:mod:`collectives.c10d.worker`).
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch
import torch.distributed as dist

from collectives.backends import stream_watch
from collectives.communicator import Communicator
from collectives.work import Work

from .worker import STOP_GRACE, Completer, Outcome, _failure, _unwrap, source_rank

_TorchWork: Any = dist._Work


class TorchStreams:
    """torch's CUDA streams and events on CUDA device ``device``, as the stream-ordered operations
    use them (a twin stands in for them on CPU: collectives.testing.c10d_twin). An operation's
    event is pooled: it goes back to ``pool`` once its handle is gone (no one waits on it or
    queries it again; a stream already told to wait on it keeps the record it waited for), and
    the next operation records it again, as torch's NCCL group reuses its events."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.pool: list[Any] = []

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    @staticmethod
    def new_event() -> Any:
        return torch.cuda.Event()

    def end(self) -> EventEnd:
        """The end of what was just enqueued on the current stream."""
        pool = self.pool
        event = pool.pop() if pool else self.new_event()
        event.record(self.current_stream())
        return EventEnd(self, event)

    def wait_event(self, event: Any) -> None:
        """The current stream waits for ``event`` (the host does not)."""
        self.current_stream().wait_event(event)

    @staticmethod
    def query(event: Any) -> bool:
        return bool(event.query())

    @staticmethod
    def synchronize(event: Any) -> None:
        """The host waits for ``event``."""
        event.synchronize()


class EventEnd:
    """An operation's end on a stream: an event recorded after it (``wait()``, ``is_completed()``,
    as a communicator's handle has them), given back to its streams' pool when the end is gone."""

    __slots__ = ("_streams", "_event")

    def __init__(self, streams: Any, event: Any) -> None:
        self._streams, self._event = streams, event

    def wait(self) -> None:
        self._streams.wait_event(self._event)

    def is_completed(self) -> bool:
        return bool(self._streams.query(self._event))

    def synchronize(self) -> None:
        """The host waits for the operation's end."""
        self._streams.synchronize(self._event)

    def __del__(self) -> None:
        self._streams.pool.append(self._event)


def failure_of(comm: Communicator) -> Exception | None:
    """The error ``comm``'s next call would raise, where it is unusable (``None`` where it is not)."""
    return comm._context.failure() if comm._broken else None


class StreamWork(_TorchWork):  # type: ignore[misc]
    """The handle torch gets for an operation enqueued on the caller's stream (see the module):
    ``end``, its end (an ``EventEnd``, or the communicator's handle of the sends and recvs it
    started); ``value``, what its future gives (as Gloo's); ``comm``, the communicator it ran on."""

    def __init__(self, end: Any, value: Any, name: str, comm: Communicator, futures: FutureWatch) -> None:
        super().__init__()
        self._end, self._value, self._name, self._comm, self._futures = end, value, name, comm, futures
        self._future: torch.futures.Future[Any] | None = None
        #: A recv from any source's handle (see ``CollectivesWork._source_rank``).
        self.received: list[Work] = []

    def wait(self, timeout: Any = None) -> bool:
        # (``timeout`` as torch's NCCL group takes it in its blocking-wait mode alone: the
        # communicator's own timeout is watched off this thread, and raised here once found)
        self._end.wait()
        error = failure_of(self._comm)
        if error is not None:
            raise error
        return True

    def is_completed(self) -> bool:
        return bool(self._end.is_completed())

    def is_success(self) -> bool:
        return self.is_completed() and failure_of(self._comm) is None

    def exception(self) -> BaseException | None:
        return failure_of(self._comm)

    def result(self) -> Any:
        self.wait()
        return self._value

    def get_future(self) -> torch.futures.Future[Any]:
        if self._future is None:
            outcome = Outcome(self._name, repr(self._comm))
            self._future = outcome.source.then(_unwrap)
            self._futures.add(self._end, outcome, self._value, self._comm)
        return self._future

    def _source_rank(self) -> int:
        self.wait()
        return source_rank(self.received, self._name)


class FutureWatch:
    """The futures asked for of one group's stream-ordered operations, looked at by the watchdog
    thread (``tick``, from the first on): a completed operation's future (or that of an operation
    of a communicator that became unusable: it may never end) is completed by the group's
    completer threads, which run its callbacks."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pending: collections.deque[tuple[Any, Outcome, Any, Communicator]] = collections.deque()
        self._lock = threading.Lock()
        self._completer: Completer | None = None
        self._watched = False

    def add(self, end: Any, outcome: Outcome, value: Any, comm: Communicator) -> None:
        with self._lock:
            self._pending.append((end, outcome, value, comm))
            if self._completer is None:
                self._completer = Completer(self._name, lambda outcome: None)
            if not self._watched:
                self._watched = True
                stream_watch.look_after(self)

    def tick(self) -> None:
        with self._lock:
            pending, completer = self._pending, self._completer
            finished = []
            for entry in list(pending):
                end, outcome, value, comm = entry
                error = failure_of(comm)
                if error is None and not end.is_completed():
                    continue
                pending.remove(entry)
                outcome.value = value if error is None else _failure(error)
                outcome.done.set()
                finished.append(outcome)
        assert completer is not None or not finished
        for outcome in finished:
            completer.complete(outcome)  # type: ignore[union-attr]

    def stop(self) -> None:
        """The watchdog stops looking; the completer threads end once done."""
        with self._lock:
            watched, self._watched = self._watched, False
        if watched:
            stream_watch.unwatch(self)
        if self._completer is not None:
            self._completer.stop(STOP_GRACE)


def after_end(operation: Any, end: EventEnd) -> Any:
    """``operation`` on the worker thread, run once ``end`` (what the caller had enqueued on its
    stream when it asked for the operation: ``TorchStreams.end()``) has run on the device: an
    operation with no tensor (a barrier) over NCCL, which would otherwise be launched beside the
    caller's NCCL calls still queued on another stream (NCCL may then hang: one communicator's
    calls must run in the order they were made)."""
    def after(comm: Communicator) -> Any:
        end.synchronize()
        return operation(comm)
    return after


def after_current_stream(operation: Any, tensors: list[torch.Tensor]) -> Any:
    """``operation`` on the worker thread (the transports other than cupy), run once the caller's
    current CUDA stream has produced ``tensors`` (the worker's stream knows nothing of it); the
    worker waits for its own stream after."""
    device = next(t.device for t in tensors if t.is_cuda)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))

    def on_device(comm: Communicator) -> Any:
        with torch.cuda.device(device):
            ready.synchronize()
            value = operation(comm)
            torch.cuda.current_stream(device).synchronize()
        return value
    return on_device
