"""Timeouts of calls on CUDA streams without a host wait: the calls a communicator has enqueued,
each with a CUDA event recorded after it, watched off the call path (:class:`StreamWatch`) by one
watchdog thread per process (:func:`watch`), as torch's NCCL watchdog does.

A blocking NCCL call returns once it is enqueued on the caller's stream. Its event (taken from a
pool of events that completed, so no event is made per call) goes on its communicator's watch
with the call's deadline: the enqueue time plus the communicator's timeout. The watchdog thread
looks at every watch every :data:`PERIOD_SECONDS`: the completed events go back to their pool,
and a call still running past its deadline is the watch's ``expired(call)`` (the transport then
aborts its communicator and hands the :class:`~collectives.CollectiveTimeout` to the call path,
which raises it at the rank's next call or ``wait()``: ``CallContext.fail_later``). ``check()``
runs at each look too (NCCL's asynchronous error query). A call that finds the pool empty makes a
new event: the pool grows to the calls a program has in flight within one period, and the caller's
thread never queries an event.

A call's timeout is thus seen between its deadline and :data:`PERIOD_SECONDS` after it.

The torch transport's calls on CUDA streams go on a watch too (backends/torch_watch.py). The same
thread looks at anything else with a ``tick()`` (:class:`Ticking`, :func:`look_after`):
the checks of CUDA calls (torch with NCCL, cupy under an MPI launcher), compared beside the calls
(backends/posted_checks.py).

Imports: nothing of the library but the recorder's clock and cupy_fast (:meth:`StreamWatch.post`'s
steps, compiled there for the cupy backend's planned calls; no transport).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any, Protocol

from collectives.diagnostics.recorder import clock

from . import cupy_fast

#: How often the watchdog thread looks at the calls in flight (seconds).
PERIOD_SECONDS = 0.05


class StreamWatch:
    """The calls in flight on CUDA streams of one communicator, oldest first.

    ``expired(call)``: the call ``call`` (its operation and number) outlived its deadline (run
    once, on the watchdog's thread or a caller's; the watch then forgets every call);
    ``check()``: the transport's asynchronous error query, run at each look (it raises nothing:
    it reports through ``CallContext.fail_later`` itself). A library (the stream API of an array
    kind: ``new_event()``, ``query(event)`` and a ``pool`` list) keeps its own free events."""

    __slots__ = ("_inflight", "_free", "_lock", "_expired", "_check", "failed")

    def __init__(self, expired: Callable[[tuple[str, int]], None],
                 check: Callable[[], None] | None = None) -> None:
        # [library, event, deadline, operation, number, pooled]: the call's operation and number
        # as they are (no tuple made per call outlives it); pooled events go back to the library's pool.
        self._inflight: collections.deque[list[Any]] = collections.deque()
        # The entries of calls taken off the watch, for the next calls: an entry is made only
        # when there is none, so the calls in flight (which outlive a young garbage collection)
        # do not make the collector walk the heap over and over.
        self._free: list[list[Any]] = []
        self._lock = threading.Lock()
        self._expired, self._check = expired, check
        #: Whether a call of this watch expired (nothing is watched after that).
        self.failed = False

    def post(self, library: Any, stream: Any, call: tuple[str, int], seconds: float) -> Any:
        """Record an event after the call just enqueued on ``stream`` (a pooled one) and watch
        it against the deadline ``seconds`` from now; returns the event."""
        return cupy_fast.watch_post(self._inflight, self._free, library, stream, call[0], call[1], seconds)

    def add(self, library: Any, event: Any, call: tuple[str, int], seconds: float) -> None:
        """Watch ``event`` (a handle's own: it never goes to the pool) against the deadline
        ``seconds`` from now."""
        self._inflight.append([library, event, clock() + seconds, call[0], call[1], False])

    def look(self) -> None:
        """Take the completed calls off the watch, oldest first (their pooled events back to
        their pools); ``expired`` for the oldest call still running past its deadline."""
        with self._lock:
            inflight, free = self._inflight, self._free
            while inflight:
                library, event, deadline, operation, seq, pooled = inflight[0]
                if not library.query(event):
                    break
                entry = inflight.popleft()
                entry[1] = None  # (before the event goes back: see cupy_fast.PlannedWork)
                free.append(entry)
                if pooled:
                    library.pool.append(event)
            else:
                return
            if clock() < deadline or self.failed:
                return
            self.failed = True
            inflight.clear()
        self._expired((operation, seq))

    def tick(self) -> None:
        """The watchdog's look: the transport's error query, then :meth:`look`."""
        if self.failed:
            return
        if self._check is not None:
            self._check()
        if self._inflight:
            self.look()


class Ticking(Protocol):
    """What the watchdog thread looks at every :data:`PERIOD_SECONDS`: a :class:`StreamWatch`,
    or a transport's posted checks (backends/posted_checks.py). ``tick()`` must not block long
    and reports its failures itself."""

    def tick(self) -> None: ...


class _Watchdog:
    """The process's one watchdog thread over every live :class:`Ticking` (each
    :class:`StreamWatch`...); it runs while there is one (started by the first, it ends when the
    last is given up)."""

    def __init__(self) -> None:
        self._watches: list[Ticking] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, watch: Ticking) -> None:
        with self._lock:
            self._watches.append(watch)
            if self._thread is None:
                self._wake.clear()
                self._thread = threading.Thread(target=self._run, name="collectives-stream-watchdog",
                                                daemon=True)
                self._thread.start()

    def stop(self, watch: Ticking) -> None:
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)
            thread = self._thread if not self._watches else None
            if thread is not None:
                self._thread = None
                self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while not self._wake.wait(PERIOD_SECONDS):
            with self._lock:
                watches = list(self._watches)
            for watch in watches:
                try:
                    watch.tick()
                except Exception:  # noqa: BLE001  (a watch reports its failures itself)
                    continue


_WATCHDOG = _Watchdog()


def watch(expired: Callable[[tuple[str, int]], None], check: Callable[[], None] | None = None) -> StreamWatch:
    """A new :class:`StreamWatch`, looked at by the watchdog thread until :func:`unwatch`."""
    made = StreamWatch(expired, check)
    _WATCHDOG.start(made)
    return made


def unwatch(watch: Ticking) -> None:
    """The watchdog stops looking at ``watch`` (its thread ends with the last watch)."""
    _WATCHDOG.stop(watch)


def look_after(ticking: Ticking) -> None:
    """The watchdog thread calls ``ticking.tick()`` every period until :func:`unwatch`."""
    _WATCHDOG.start(ticking)
