"""How the cupy backend completes its NCCL calls: CUDA streams and events of each array
library, the deadline on a call's event (:func:`wait_for`), the handles
(:class:`_StreamWork`) and this thread's open NCCL group of asynchronous sends and recvs.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from collectives import arrays
from collectives.errors import CollectiveError
from collectives.polling import PollPolicy, wait_until, yield_or_sleep
from collectives.work import Work

#: Waiting for a collective under a timeout (:func:`wait_for`): tight polls of its CUDA event,
#: then polls that yield the CPU for BUSY_POLL_SECONDS, then sleeps from POLL_MIN_SECONDS
#: doubling to POLL_MAX_SECONDS.
FAST_POLLS = 16
BUSY_POLL_SECONDS = 0.05
POLL_MIN_SECONDS = 1e-4
POLL_MAX_SECONDS = 0.01
POLL = PollPolicy(FAST_POLLS, BUSY_POLL_SECONDS, POLL_MIN_SECONDS, POLL_MAX_SECONDS)


# -- CUDA streams and events of each array library (the arrays themselves: collectives.arrays) --

class _TorchStreams:
    """torch CUDA tensors: torch's current stream and events."""

    def __init__(self, device: int) -> None:
        self.torch = sys.modules["torch"]
        self.device = device  # the communicator's, which the call path checked x is on
        self.pool: list[Any] = []  # completed events for the next calls (stream_watch)
        self.adapter = arrays.TORCH  # (whose arrays' streams these are)
        #: The current stream of the communicator's device, read per call (the device's
        #: ordinal: x.device would make a torch.device per call).
        self.current_stream = functools.partial(self.torch.cuda.current_stream, device)

    def use(self, stream: Any) -> Any:
        """A context in which ``stream`` is torch's current stream (and its device current)."""
        return self.torch.cuda.stream(stream)

    @staticmethod
    def stream_ptr(stream: Any) -> int:
        return int(stream.cuda_stream)

    @staticmethod
    def ptr(x: Any) -> int:
        return int(x.data_ptr())

    def new_event(self) -> Any:
        return self.torch.cuda.Event()

    def record(self, stream: Any) -> Any:
        event = self.new_event()
        event.record(stream)
        return event

    def wait_event(self, event: Any, x: Any) -> None:
        self.torch.cuda.current_stream(x.device).wait_event(event)

    @staticmethod
    def query(event: Any) -> bool:
        return bool(event.query())


class _CupyStreams:
    """CuPy arrays: CuPy's current stream and events."""

    def __init__(self, device: int) -> None:
        self.cupy = sys.modules["cupy"]
        self.pool: list[Any] = []  # completed events for the next calls (stream_watch)
        self.adapter = arrays.CUPY  # (whose arrays' streams these are)
        #: CuPy's current stream, read per call.
        self.current_stream = self.cupy.cuda.get_current_stream

    @staticmethod
    def use(stream: Any) -> Any:
        """A context in which ``stream`` is CuPy's current stream."""
        return stream

    @staticmethod
    def stream_ptr(stream: Any) -> int:
        return int(stream.ptr)

    @staticmethod
    def ptr(x: Any) -> int:
        return int(x.data.ptr)

    def new_event(self) -> Any:
        return self.cupy.cuda.Event(disable_timing=True)

    def record(self, stream: Any) -> Any:
        event = self.new_event()
        event.record(stream)
        return event

    def wait_event(self, event: Any, x: Any) -> None:
        with x.device:
            self.cupy.cuda.get_current_stream().wait_event(event)

    @staticmethod
    def query(event: Any) -> bool:
        return bool(event.done)


# -- waiting for the GPU, with a deadline ---------------------------------------------------------

def wait_for(done: Callable[[], bool], timeout: float, check: Callable[[], None] | None = None,
             clock: Callable[[], float] = time.monotonic,
             pause: Callable[[float], None] = yield_or_sleep) -> bool:
    """Poll ``done()`` until it is true (``True``) or ``timeout`` seconds have passed (``False``).

    A few tight polls first (a small collective is done by then), then polls that yield the CPU
    (``pause(0)``) for :data:`BUSY_POLL_SECONDS`, then sleeps from :data:`POLL_MIN_SECONDS`
    doubling to :data:`POLL_MAX_SECONDS`, so a hung collective does not burn a core. ``check()``
    runs before each sleep (NCCL's asynchronous error query: it raises what it finds).
    """
    return wait_until(done, timeout, POLL, check, clock, pause)


# -- the open NCCL group of asynchronous sends/recvs (NCCL groups are per thread) -------------------

class _ThreadGroup(threading.local):
    """This thread's open group: ``works``, its handles (``None``: no group open). A class
    attribute gives every thread ``None`` without the raised AttributeError of a missing one,
    which each NCCL call of this backend would otherwise pay."""

    works: list[_StreamWork] | None = None


_GROUP = _ThreadGroup()
#: The threads that have an open group (their idents): a call looks at this set first, and at its
#: own thread's group only where some thread has one (an attribute of a thread-local costs several
#: times a set's truth test). Added to and taken from in one step each (no lock).
OPEN_GROUPS: set[int] = set()


def _open_group(nccl: Any) -> list[_StreamWork]:
    """This thread's open group's handles, after ``ncclGroupStart`` if none was open."""
    works = _GROUP.works
    if works is None:
        nccl.groupStart()
        works = _GROUP.works = []
        OPEN_GROUPS.add(threading.get_ident())
    return works


def _launch_group(nccl: Any) -> None:
    """``ncclGroupEnd`` of this thread's open group; then each of its calls finishes on its stream."""
    works, _GROUP.works = _GROUP.works or [], None
    OPEN_GROUPS.discard(threading.get_ident())
    try:
        nccl.groupEnd()
    except Exception as error:
        failure = works[0]._comm.context.map_error(error) if works else CollectiveError(str(error))
        for work in works:
            work._error = failure
        raise failure from error
    for work in works:
        work._launched()


# -- handles ----------------------------------------------------------------------------------------

class _StreamWork(Work):
    """An enqueued NCCL call (or a send/recv waiting in this thread's open NCCL group).

    ``wait()`` launches the open group if this call is in it, then makes the then-current stream
    (of ``like``'s library and device) wait for the call's event, so kernels enqueued afterwards
    see the result, and returns, like torch's NCCL ``Work.wait()``: the host does not wait. With
    a timeout the event is on the communicator's watch (backends/stream_watch.py) from its launch:
    past the deadline the communicator is aborted, and this ``wait()`` (or the next call) raises
    the :class:`~collectives.CollectiveTimeout`. The library's own small vectors, read on the host
    once complete (``_host``: debug headers), wait on the host for the event under the deadline.
    """

    def __init__(self, result: Any, library: Any, event: Any, comm: Any,
                 like: Any = None, keep: Any = None) -> None:
        super().__init__(result)
        self._library, self._event, self._comm = library, event, comm
        self._like = result if like is None else like  # an array on the device
        self._keep = keep  # memory NCCL reads or writes until the call completes
        self._call = comm.context.call
        self._stream: Any = None  # a grouped send/recv: its stream, and what follows it there
        self._then: Callable[[], None] | None = None
        self._host: Callable[[], None] | None = None  # host work once complete (debug headers)
        self._error: Exception | None = None
        self._completed = False

    def _launched(self) -> None:
        """The group this send/recv was in has been launched: finish it on its stream (the
        write-back of a staged recv runs there, after NCCL's recv, whichever stream is current
        when the group goes out), then record the call's event there."""
        if self._then is not None:
            with self._library.use(self._stream):
                self._then()
            self._then = None
        self._event = self._library.record(self._stream)
        if self._comm.timeout is not None:
            self._comm._watch_event(self._library, self._event, self._call)

    def wait(self) -> Any:
        if self._error is not None:
            raise self._error
        comm = self._comm
        if not self._completed:
            if comm.context.broken:  # aborted: the call may have ended early, its result is not trusted
                raise comm.context.failure()
            if OPEN_GROUPS:  # (some thread has an open group: this call may be in it, launched here)
                comm._flush_group()
            if comm.timeout is not None and self._host is not None:
                try:
                    comm._complete(self._library, self._event, self._call)
                except CollectiveError as error:
                    self._error = error
                    raise
                self._completed, self._keep = True, None
            self._library.wait_event(self._event, self._like)
        if self._host is not None:
            host, self._host = self._host, None
            host()
        return self._x

    def is_completed(self) -> bool:
        if self._completed or self._error is not None:
            return True
        if self._event is None:  # still in the open group: launched at the next wait or call
            return False
        if self._library.query(self._event):
            self._completed, self._keep = True, None
            return True
        return False
