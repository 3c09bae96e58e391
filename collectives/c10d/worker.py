"""Who runs a process group's operations, and the ``Work`` torch waits on.

The threading, and why. A :class:`~collectives.Communicator` takes calls from one
thread (``bind_thread``), because two threads sharing one would issue their calls in
different orders on different ranks. torch calls a process group from several threads:
the user's, and autograd's (DDP launches its bucket all_reduces from backward hooks and
waits on their futures at the end of backward). So every group has ONE worker thread
that owns a communicator of its own (a ``split`` of the group's, made when the group is
created) and runs the group's operations one after the other, in the order the callers
issued them (a FIFO queue). The caller gets a :class:`CollectivesWork` at once; the
worker fulfils its ``torch.futures.Future`` when the operation has completed, so
asynchronous work completes without anyone polling, and a bucket's all_reduce runs on
the worker while autograd computes the next bucket's gradients (MPI calls release the
GIL). The group's own communicator (``collectives.c10d.communicator(group)``) stays with
the thread that made it, for the user's own calls (SyncBatchNorm, DataParallel).

Point-to-point operations are started nonblocking and completed by the same worker
between operations (a blocking send would deadlock ``batch_isend_irecv``, where both
ranks send before they receive). Collectives run blocking, under the communicator's
timeout; an error (timeout, mismatch, a bad argument) becomes the future's exception,
raised by ``wait()`` in the caller. A future's callbacks (``then``) run on the worker:
one that waits for a later operation of the same group cannot complete, and
``CollectivesWork.wait`` refuses to wait there rather than hang.
"""

from __future__ import annotations

import atexit
import collections
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from collectives.communicator import Communicator, Work
from collectives.errors import CollectiveError, CollectiveTimeout

#: Seconds between polls of in-flight point-to-point operations while no other operation waits.
P2P_POLL_INTERVAL = 0.0002
#: Seconds a worker gets to finish its queue when its group is destroyed or the process exits.
STOP_GRACE = 5.0

_STOP = object()
_WORKERS: weakref.WeakSet[Worker] = weakref.WeakSet()


_TorchWork: Any = dist._Work


class CollectivesWork(_TorchWork):  # type: ignore[misc]
    """The handle torch gets for an operation of a "collectives" process group.

    ``wait()`` blocks until the worker has run the operation and raises its error, if it
    had one; ``get_future()`` is a ``torch.futures.Future`` that completes with it (its
    value is what torch's own backends give, the tensors written, or the error).
    """

    def __init__(self, source: torch.futures.Future[Any], worker: Any) -> None:
        super().__init__()
        self._source = source  # completed by the worker (a _Failure when the operation failed)
        self._future = source.then(_unwrap)
        self._worker = worker

    def wait(self, timeout: Any = None) -> bool:
        if not self._source.done() and threading.get_ident() == self._worker.ident:
            raise CollectiveError(
                "a callback of a 'collectives' future waits for another operation of its "
                "process group; callbacks run on the group's worker thread, which runs that "
                "operation only after the callback returns: chain it with then() instead")
        failure = self._source.wait()
        if isinstance(failure, _Failure):
            raise failure.error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return bool(self._source.done())

    def is_success(self) -> bool:
        return self.exception() is None and self.is_completed()

    def exception(self) -> BaseException | None:
        value = self._source.value() if self._source.done() else None
        return value.error if isinstance(value, _Failure) else None

    def result(self) -> Any:
        self.wait()
        return self._source.value()


class _InFlight:
    """A point-to-point operation the worker started and completes later."""

    __slots__ = ("handle", "future", "value", "deadline", "name")

    def __init__(self, handle: Work, future: Any, value: Any, deadline: float | None, name: str):
        self.handle, self.future, self.value, self.deadline, self.name = handle, future, value, deadline, name


class Started:
    """What an operation returns to say it is still running: its handle, and the future's
    value once it has completed."""

    def __init__(self, handle: Work, value: Any, name: str) -> None:
        self.handle, self.value, self.name = handle, value, name


class Worker:
    """The thread that runs one process group's operations on ``comm`` (see the module)."""

    def __init__(self, comm: Communicator, name: str) -> None:
        self.comm = comm
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._stopped = False
        bound = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(bound,), name=name, daemon=True)
        self._thread.start()
        bound.wait()
        self.ident = self._thread.ident
        _WORKERS.add(self)

    def submit(self, operation: Callable[[Communicator], Any]) -> CollectivesWork:
        """Queue ``operation(comm)``; its return value (or a :class:`Started`) completes the work."""
        if self._stopped:
            raise CollectiveError("this 'collectives' process group was destroyed; create a new one")
        # The worker completes ``source``; the caller's future is ``source.then(_unwrap)``, which
        # fails where the operation failed. A future completed through Future.set_exception holds
        # the exception as its VALUE (Python raises it on unwrapping; C++ consumers such as DDP's
        # reducer would take it for the tensors), while an error raised in a then() callback is
        # the future's error for C++ too.
        source: torch.futures.Future[Any] = torch.futures.Future()
        self._queue.put((operation, source))
        return CollectivesWork(source, self)

    def stop(self) -> None:
        """Run what is queued, then end the thread (and close its communicator)."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(_STOP)
            if threading.get_ident() != self.ident:
                self._thread.join(STOP_GRACE)

    # -- the thread ---------------------------------------------------------------------

    def _main(self, bound: threading.Event) -> None:
        self.comm.bind_thread()
        bound.set()
        while True:
            if self._in_flight:
                try:
                    item = self._queue.get(timeout=P2P_POLL_INTERVAL)
                except queue.Empty:
                    self._poll()
                    continue
            else:
                item = self._queue.get()
            if item is _STOP:
                break
            self._run(*item)
            if self._in_flight:
                self._poll()
        while self._in_flight:  # a stopped group still completes what it started
            self._poll()
            time.sleep(P2P_POLL_INTERVAL)
        try:
            self.comm.close()
        except Exception:  # noqa: BLE001 - the group is going away; its errors were reported
            pass

    def _run(self, operation: Callable[[Communicator], Any], future: Any) -> None:
        try:
            value = operation(self.comm)
        except BaseException as error:  # noqa: BLE001 - it belongs to the caller's wait()
            _fail(future, error)
            return
        if isinstance(value, Started):
            timeout = self.comm.timeout
            deadline = None if timeout is None else time.monotonic() + timeout
            self._in_flight.append(_InFlight(value.handle, future, value.value, deadline, value.name))
        else:
            future.set_result(value)

    def _poll(self) -> None:
        """Complete the point-to-point operations that have completed (in any order)."""
        now: float | None = None
        for pending in list(self._in_flight):
            try:
                done = pending.handle.is_completed()
                if done:
                    pending.handle.wait()
            except BaseException as error:  # noqa: BLE001
                self._in_flight.remove(pending)
                _fail(pending.future, error)
                continue
            if done:
                self._in_flight.remove(pending)
                pending.future.set_result(pending.value)
                continue
            if pending.deadline is not None:
                now = time.monotonic() if now is None else now
                if now >= pending.deadline:
                    self._in_flight.remove(pending)
                    _fail(pending.future, CollectiveTimeout(
                        f"{pending.name} on {self.comm!r} did not complete within "
                        f"timeout={self.comm.timeout:g}s (COLLECTIVES_TIMEOUT): the peer never made "
                        "the matching call, or is stuck or dead"))


class _Failure:
    """What a failed operation completes its source future with (see Worker.submit)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _unwrap(source: torch.futures.Future[Any]) -> Any:
    value = source.value()
    if isinstance(value, _Failure):
        raise value.error
    return value


def _fail(future: Any, error: BaseException) -> None:
    if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: the worker's own end
        error = CollectiveError(f"the operation was interrupted: {error!r}")
    future.set_result(_Failure(error))


@atexit.register
def _stop_all_workers() -> None:
    # Before MPI is finalized (mpi4py finalizes after the interpreter's atexit functions).
    for worker in list(_WORKERS):
        worker.stop()
