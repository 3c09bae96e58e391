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
the thread that made it, for the user's own calls (SyncBatchNorm, DataParallel); over the
cupy transport it also takes the operations on CUDA tensors made on that thread (or in a
backward pass), enqueued on the caller's stream (collectives/c10d/streams.py), not here.

Point-to-point operations are started nonblocking and completed by the same worker
between operations (a blocking send would deadlock ``batch_isend_irecv``, where both
ranks send before they receive). Collectives run blocking, under the communicator's
timeout; an error (timeout, mismatch, a bad argument) becomes the future's exception,
raised by ``wait()`` in the caller.

The worker never runs a future's callbacks. ``wait()`` waits for the worker's word alone,
and the futures are completed by completer threads (:class:`Completer`): a callback may
wait for a later operation of the same group (DDP's PowerSGD hook does, inside ``then``),
which the worker, free, runs meanwhile; one more completer thread is started only when
every one is inside such a callback, so completions keep their order otherwise; a
completer that has had nothing to do for :data:`COMPLETER_IDLE` seconds ends (one stays).

A group holds at most ``MAX_PENDING`` operations that have not completed (the
Communicator's bound on kept handles): one more waits for the oldest to complete, so a
program that drops its handles in a loop runs in bounded memory. The group's own threads
(a callback that issues an operation) never wait for room, since the room is theirs to make.
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
from collectives.errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, timed_out
from collectives.work import MAX_PENDING

#: Seconds between polls of in-flight point-to-point operations while no other operation waits.
P2P_POLL_INTERVAL = 0.0002
#: Seconds a worker gets to finish its queue when its group is destroyed or the process exits.
STOP_GRACE = 5.0
#: Completer threads at most per group: callbacks nested this deep in waits for operations
#: of their own group (each waiting one holds a thread).
MAX_COMPLETERS = 32
#: Seconds a completer thread waits for a completion to run before it ends (the first stays).
COMPLETER_IDLE = 1.0

_STOP = object()
_WORKERS: weakref.WeakSet[Worker] = weakref.WeakSet()


_TorchWork: Any = dist._Work


class CollectivesWork(_TorchWork):  # type: ignore[misc]
    """The handle torch gets for an operation of a "collectives" process group.

    ``wait(timeout)`` blocks until the worker has run the operation and raises its error,
    if it had one; with a timeout (a ``timedelta``; zero: none) it raises
    :class:`~collectives.CollectiveTimeout` when the operation has not completed by then.
    ``get_future()`` is a ``torch.futures.Future`` that completes with it: its value is
    what Gloo's gives (the tensors written), its error the operation's (torch's futures
    give a callback's error as a ``RuntimeError`` that quotes it; every error an operation
    can have once queued is a :class:`~collectives.CollectiveError`, itself a
    ``RuntimeError``: bad arguments raise at the call, before any Work exists).
    """

    def __init__(self, outcome: Outcome) -> None:
        super().__init__()
        self._outcome = outcome
        self._future = outcome.source.then(_unwrap)
        #: A recv from any source's handle, once the worker made it (see ``_source_rank``).
        self.received: list[Work] = []

    def _source_rank(self) -> int:
        """The group rank a recv from any source received from (torch's ``dist.recv`` with no
        ``src`` returns it, as Gloo's handle says it), once the recv completed."""
        self.wait()
        return source_rank(self.received, self._outcome.name)

    def wait(self, timeout: Any = None) -> bool:
        seconds = _seconds(timeout)
        if not self._outcome.done.wait(seconds):
            raise CollectiveTimeout(
                f"{timed_out(f'{self._outcome.name} on {self._outcome.where}', f'wait(timeout={seconds:g}s)')}"
                ": a rank has not made the matching call, or is stuck or dead. "
                "The operation stays queued on the group: it completes if the other ranks arrive, or "
                "fails at the group's own timeout; the group's later operations run after it")
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


def source_rank(received: list[Work], name: str) -> int:
    """The rank the recv from any source of ``received`` (its handle, once made) received from."""
    source = received[0].source if received else None
    if source is None:
        raise ValueError(f"{name} is no recv from any source: it has no source rank")
    return int(source)


def _seconds(timeout: Any) -> float | None:
    """Seconds of a wait timeout (``timedelta``, milliseconds from C++ as a ``timedelta``,
    or a number); ``None`` for none (torch's ``kNoTimeout`` is zero)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return seconds if seconds > 0 else None


class Outcome:
    """What became of one operation: set once by the worker (``done``, ``value``: the
    tensors, or the failure), then handed to the completers for ``source``, the
    future torch's consumers chain on. ``name`` and ``where`` say which operation of
    which group it is (for a ``wait(timeout)`` that expires)."""

    __slots__ = ("done", "value", "source", "name", "where")

    def __init__(self, name: str = "operation", where: str = "its group") -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.source: torch.futures.Future[Any] = torch.futures.Future()
        self.name, self.where = name, where


class Completer:
    """Threads that complete the futures of one group's operations, in the order the worker
    finished them while one thread suffices. A completion runs the future's callbacks; one
    that waits for a later operation of the group holds its thread, and the next completion
    then starts another (at most MAX_COMPLETERS); a thread idle for COMPLETER_IDLE seconds
    ends, down to one. ``completed(outcome)`` is called after each completion."""

    def __init__(self, name: str, completed: Callable[[Outcome], None]) -> None:
        self._name = name
        self._completed = completed
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._started = 0  # threads ever started (for their names)
        self._pending = 0  # handed over, not yet taken by a thread
        self._busy = 0  # threads inside a completion (its callbacks)
        self.idents: set[int] = set()  # the running threads' idents

    @property
    def threads(self) -> int:
        """Completer threads running now."""
        with self._lock:
            return len(self._threads)

    def complete(self, outcome: Outcome) -> None:
        with self._lock:
            self._pending += 1
            self._queue.put(outcome)
            thread = self._another_locked()
        if thread is not None:
            thread.start()

    def _another_locked(self) -> threading.Thread | None:
        """A new thread, when something waits and every thread is inside a completion (whose
        callbacks may wait for what waits) and there is room for one."""
        if not self._pending or self._busy < len(self._threads) or len(self._threads) >= MAX_COMPLETERS:
            return None
        thread = threading.Thread(target=self._main, daemon=True, name=f"{self._name}-completer-{self._started}")
        self._started += 1
        self._threads.append(thread)
        return thread

    def _main(self) -> None:
        me = threading.current_thread()
        self.idents.add(threading.get_ident())
        try:
            while self._complete_next(me):
                pass
        finally:
            self.idents.discard(threading.get_ident())
            with self._lock:
                if me in self._threads:
                    self._threads.remove(me)

    def _complete_next(self, me: threading.Thread) -> bool:
        """Run the next completion; False when this thread is to end (stopped, or idle and
        not the only one)."""
        try:
            outcome = self._queue.get(timeout=COMPLETER_IDLE)
        except queue.Empty:
            with self._lock:
                if self._pending or self._threads[0] is me:
                    return True
                self._threads.remove(me)  # under the lock that complete() decides by
                return False
        if outcome is _STOP:
            return False
        with self._lock:
            self._pending -= 1
            self._busy += 1
            thread = self._another_locked()
        if thread is not None:
            thread.start()
        try:
            outcome.source.set_result(outcome.value)
        except Exception:  # noqa: BLE001 - a callback's error is its chained future's
            pass
        finally:
            with self._lock:
                self._busy -= 1
            self._completed(outcome)
        return True

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

    def __init__(self, comm: Communicator, name: str,
                 failed: Callable[[BaseException], None] | None = None) -> None:
        self.comm = comm
        self._failed = failed  # told of each operation's error, on the worker's thread
        self._where = repr(comm)
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._in_flight: collections.deque[_InFlight] = collections.deque()
        self._completer = Completer(name, self._completed)
        self._room = threading.Condition()
        self.pending = 0  # operations submitted and not completed (futures included)
        self.most_pending = 0  # the most there ever were
        self._stopped = False
        bound = threading.Event()
        self._thread = threading.Thread(target=self._main, args=(bound,), name=name, daemon=True)
        self._thread.start()
        bound.wait()
        self.ident = self._thread.ident
        _WORKERS.add(self)

    @property
    def completer_threads(self) -> int:
        """Completer threads running now (they end when idle, down to one)."""
        return self._completer.threads

    def submit(self, operation: Callable[[Communicator], Any], name: str = "operation") -> CollectivesWork:
        """Queue ``operation(comm)``; its return value (or a :class:`Started`) completes the
        work. ``name``: what it is, for messages. Waits while MAX_PENDING operations are
        pending (never on the group's own threads)."""
        own = threading.get_ident() == self.ident or threading.get_ident() in self._completer.idents
        # The completers complete ``outcome.source``; the caller's future is
        # ``source.then(_unwrap)``, which fails where the operation failed. A future completed
        # through Future.set_exception holds the exception as its VALUE (Python raises it on
        # unwrapping; C++ consumers such as DDP's reducer would take it for the tensors), while
        # an error raised in a then() callback is the future's error for C++ too.
        outcome = Outcome(name, self._where)
        with self._room:  # queued under the lock that stop() queues its end under: never after it
            if self.pending >= MAX_PENDING and not own:
                # Down to half before going on: one wake-up per MAX_PENDING / 2 completions,
                # not a hand-over between threads per operation.
                while self.pending > MAX_PENDING // 2 and not self._stopped:
                    self._room.wait()
            if self._stopped:
                raise CollectiveError("this 'collectives' process group was destroyed; create a new one")
            self.pending += 1
            self.most_pending = max(self.most_pending, self.pending)
            self._queue.put((operation, outcome))
        return CollectivesWork(outcome)

    def _completed(self, outcome: Outcome) -> None:
        with self._room:
            self.pending -= 1
            if self.pending == MAX_PENDING // 2:
                self._room.notify_all()

    def stop(self) -> None:
        """Run what is queued, then end the thread (and close its communicator)."""
        with self._room:
            if self._stopped:
                return
            self._stopped = True
            self._room.notify_all()
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
        except (TypeError, ValueError) as error:
            # Each rank's own arguments were checked at the call: what the worker finds wrong
            # is a disagreement between the ranks (the communicator's checks of what they
            # exchanged), a CollectiveError like every error a queued operation can have.
            mismatch = CollectiveMismatch(str(error))
            mismatch.__cause__ = error
            self._finish(outcome, _failure(mismatch))
            return
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
        if isinstance(value, _Failure) and self._failed is not None:
            self._failed(value.error)
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
                        f"{timed_out(f'{pending.name} on {self.comm!r}', f'timeout={self.comm.timeout:g}s')}"
                        " (COLLECTIVES_TIMEOUT): the peer never made "
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
