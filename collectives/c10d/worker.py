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
raised by ``wait()`` in the caller.

The worker never runs a future's callbacks. ``wait()`` waits for the worker's word alone,
and the futures are completed by completer threads (:class:`Completer`): a callback may
wait for a later operation of the same group (DDP's PowerSGD hook does, inside ``then``),
which the worker, free, runs meanwhile; one more completer thread is started only when
every one is inside such a callback, so completions keep their order otherwise.
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
#: Completer threads at most per group: callbacks nested this deep in waits for operations
#: of their own group (each waiting one holds a thread).
MAX_COMPLETERS = 32

_STOP = object()
_WORKERS: weakref.WeakSet[Worker] = weakref.WeakSet()


_TorchWork: Any = dist._Work


class CollectivesWork(_TorchWork):  # type: ignore[misc]
    """The handle torch gets for an operation of a "collectives" process group.

    ``wait()`` blocks until the worker has run the operation and raises its error, if it
    had one; ``get_future()`` is a ``torch.futures.Future`` that completes with it (its
    value is what torch's own backends give, the tensors written, or the error).
    """

    def __init__(self, outcome: Outcome) -> None:
        super().__init__()
        self._outcome = outcome
        self._future = outcome.source.then(_unwrap)

    def wait(self, timeout: Any = None) -> bool:
        self._outcome.done.wait()
        if isinstance(self._outcome.value, _Failure):
            raise self._outcome.value.error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return self._outcome.done.is_set()

    def is_success(self) -> bool:
        return self.exception() is None and self.is_completed()

    def exception(self) -> BaseException | None:
        value = self._outcome.value if self._outcome.done.is_set() else None
        return value.error if isinstance(value, _Failure) else None

    def result(self) -> Any:
        self.wait()
        return self._outcome.value


class Outcome:
    """What became of one operation: set once by the worker (``done``, ``value``: the
    tensors, or the failure), then handed to the completers for ``source``, the
    future torch's consumers chain on."""

    __slots__ = ("done", "value", "source")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.source: torch.futures.Future[Any] = torch.futures.Future()


class Completer:
    """Threads that complete the futures of one group's operations, in the order the worker
    finished them while one thread suffices. A completion runs the future's callbacks; one
    that waits for a later operation of the group holds its thread, and the next completion
    then starts another (at most MAX_COMPLETERS)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._pending = 0  # handed over, not yet taken by a thread
        self._busy = 0  # threads inside a completion (its callbacks)

    def complete(self, outcome: Outcome) -> None:
        with self._lock:
            self._pending += 1
            start = self._pending + self._busy > len(self._threads) and len(self._threads) < MAX_COMPLETERS
            if start:
                thread = threading.Thread(target=self._main, daemon=True,
                                          name=f"{self._name}-completer-{len(self._threads)}")
                self._threads.append(thread)
            self._queue.put(outcome)
        if start:
            thread.start()

    def _main(self) -> None:
        while True:
            outcome = self._queue.get()
            if outcome is _STOP:
                return
            with self._lock:
                self._pending -= 1
                self._busy += 1
            try:
                outcome.source.set_result(outcome.value)
            except Exception:  # noqa: BLE001 - a callback's error is its chained future's
                pass
            finally:
                with self._lock:
                    self._busy -= 1

    def stop(self, grace: float) -> None:
        """End the threads once they have completed what was handed to them."""
        with self._lock:
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(_STOP)
        deadline = time.monotonic() + grace
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class _InFlight:
    """A point-to-point operation the worker started and completes later."""

    __slots__ = ("handle", "outcome", "value", "deadline", "name")

    def __init__(self, handle: Work, outcome: Outcome, value: Any, deadline: float | None, name: str):
        self.handle, self.outcome, self.value, self.deadline, self.name = handle, outcome, value, deadline, name


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
        self._completer = Completer(name)
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
        # The completers complete ``outcome.source``; the caller's future is
        # ``source.then(_unwrap)``, which fails where the operation failed. A future completed
        # through Future.set_exception holds the exception as its VALUE (Python raises it on
        # unwrapping; C++ consumers such as DDP's reducer would take it for the tensors), while
        # an error raised in a then() callback is the future's error for C++ too.
        outcome = Outcome()
        self._queue.put((operation, outcome))
        return CollectivesWork(outcome)

    def stop(self) -> None:
        """Run what is queued, then end the thread (and close its communicator)."""
        if not self._stopped:
            self._stopped = True
            self._queue.put(_STOP)
            if threading.get_ident() != self.ident:
                self._thread.join(STOP_GRACE)
                self._completer.stop(STOP_GRACE)

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

    def _run(self, operation: Callable[[Communicator], Any], outcome: Outcome) -> None:
        try:
            value = operation(self.comm)
        except BaseException as error:  # noqa: BLE001 - it belongs to the caller's wait()
            self._finish(outcome, _failure(error))
            return
        if isinstance(value, Started):
            timeout = self.comm.timeout
            deadline = None if timeout is None else time.monotonic() + timeout
            self._in_flight.append(_InFlight(value.handle, outcome, value.value, deadline, value.name))
        else:
            self._finish(outcome, value)

    def _finish(self, outcome: Outcome, value: Any) -> None:
        """The operation's end: ``wait()`` returns now; its future completes on a completer."""
        outcome.value = value
        outcome.done.set()
        self._completer.complete(outcome)

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
                self._finish(pending.outcome, _failure(error))
                continue
            if done:
                self._in_flight.remove(pending)
                self._finish(pending.outcome, pending.value)
                continue
            if pending.deadline is not None:
                now = time.monotonic() if now is None else now
                if now >= pending.deadline:
                    self._in_flight.remove(pending)
                    self._finish(pending.outcome, _failure(CollectiveTimeout(
                        f"{pending.name} on {self.comm!r} did not complete within "
                        f"timeout={self.comm.timeout:g}s (COLLECTIVES_TIMEOUT): the peer never made "
                        "the matching call, or is stuck or dead")))


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


def _failure(error: BaseException) -> _Failure:
    if not isinstance(error, Exception):  # KeyboardInterrupt, SystemExit: the worker's own end
        error = CollectiveError(f"the operation was interrupted: {error!r}")
    return _Failure(error)


@atexit.register
def _stop_all_workers() -> None:
    # Before MPI is finalized (mpi4py finalizes after the interpreter's atexit functions).
    for worker in list(_WORKERS):
        worker.stop()
