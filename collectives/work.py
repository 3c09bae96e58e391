"""Handles of asynchronous calls: :class:`Work`, and :func:`deliver` for backends.

Every collective takes ``async_op=True`` and then returns a :class:`Work` (or a
subclass a backend defines around its transport's requests); the communicator keeps
the handles that may still be running in a :class:`KeptHandles` it holds, so a handle the
caller drops still completes.

Imports: arrays, polling and the recorder's record layout (never the communicator).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

from .arrays import ArrayAdapter
from .diagnostics import recorder
from .diagnostics.recorder import END, POSTED, STARTED, STATE
from .polling import SPIN_YIELD_EVERY, PollPolicy, wait_until

#: Handles kept at most for a communicator; one more waits for the oldest first, so a
#: program that drops handles in a loop runs in bounded memory.
MAX_PENDING = 1024
# How Work.wait_for polls: 50 us without yielding (but every SPIN_YIELD_EVERY tests), yields to
# 2 ms, then sleeps 0.1-1 ms.
_POLL = PollPolicy(fast_polls=0, busy_seconds=0.002, sleep_min=1e-4, sleep_max=1e-3, spin_seconds=50e-6,
                   spin_yield_every=SPIN_YIELD_EVERY)


class Work:
    """Handle of an asynchronous collective. ``wait()`` completes it and returns the result
    (``x`` for the in-place collectives, the new array for the others).

    ``source``: a recv's sender, the rank (of the communicator) whose message it received, once
    completed (for a recv from any source, ``src=None``, how the receiver learns it, as MPI's
    status and torch's ``dist.recv`` tell it); ``None`` for the other calls."""

    #: A recv's sender, once completed (see the class); ``None`` for the other calls.
    source: int | None = None

    def __init__(self, x: Any) -> None:
        self._x = x

    def wait(self) -> Any:
        """Block until the collective has completed; return its result."""
        return self._x

    def is_completed(self) -> bool:
        """Whether the collective has completed. Once true, its result is in place (what the
        handle does at the end, such as AVG's division or a staged copy back, has run) and
        ``wait()`` does not block; a failure raises here, as from ``wait()``."""
        return True

    def wait_for(self, seconds: float) -> bool:
        """Wait at most ``seconds`` for the collective to complete; whether it has (its result
        is then ``wait()``'s). Polls ``is_completed``; a handle whose transport can block with a
        timeout overrides it."""
        return self.is_completed() or wait_until(self.is_completed, seconds, _POLL)

    def _cancel(self) -> None:
        """Give up a posted receive that no message may ever complete (a closing communicator's
        monitored barrier: see :class:`collectives.reliability.MonitoredBarrier`). Default:
        nothing (the receive stays posted)."""


class AllOf(Work):
    """Several handles as one: ``wait()`` waits for each in turn and returns ``None`` (a
    debug-mode send's header and payload; the sends of one torch point-to-point call)."""

    def __init__(self, works: Iterable[Work | None]) -> None:
        super().__init__(None)
        self._works = [work for work in works if work is not None]

    def wait(self) -> Any:
        for work in self._works:
            work.wait()
        return None

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def deliver(adapter: ArrayAdapter, result: Any, out: Any, async_op: bool) -> Any:
    """For backends: ``result`` (copied into ``out`` when the caller passed one), or a
    completed :class:`Work` holding it when ``async_op``."""
    if out is not None and result is not out:
        adapter.copy_(out, result)
        result = out
    return Work(result) if async_op else result


class KeptHandles:
    """The handles a communicator keeps (it holds one: ``Communicator._handles``): those of
    asynchronous collectives not known to be complete, oldest first, with their flight-recorder
    records (``None`` where the recorder is off), and point-to-point handles apart: one may wait
    for a send the peer makes only later, so they are never waited for to make room (that could
    deadlock) and never block the reaping of collective handles. A record stays "posted" until
    the communicator learns its handle completed (the next call's reaping, ``close()``, or a
    dump written by the communicator's own thread)."""

    __slots__ = ("pending", "posted", "pending_p2p")

    def __init__(self) -> None:
        self.pending: collections.deque[Work] = collections.deque()
        self.posted: collections.deque[list[Any] | None] = collections.deque()
        self.pending_p2p: collections.deque[Work] = collections.deque()

    def keep(self, work: Work, record: list[Any] | None) -> None:
        """Keep the handle of an asynchronous collective (and its record) until it completes.
        Past MAX_PENDING the oldest is waited for first; one whose ``wait()`` only ordered the
        caller's stream after it (a CUDA call: the host does not wait) stays kept until it has
        completed (the GPU's own queue bounds how many calls run behind the host)."""
        self.pending.append(work)
        self.posted.append(record)
        if len(self.pending) > MAX_PENDING:
            self._retire_oldest(wait=True)

    def keep_p2p(self, work: Work) -> None:
        """Keep the handle of an asynchronous send or recv until it completes."""
        self.pending_p2p.append(work)
        _reap(self.pending_p2p)

    def reap(self) -> None:
        """Forget the collective handles that have completed, oldest first (collectives
        complete in the order they were made; a still-running one ends the scan), and mark
        their records completed."""
        pending = self.pending
        while pending and self._retire_oldest():
            pass

    def _retire_oldest(self, wait: bool = False) -> bool:
        """Forget the oldest collective handle if it has completed (after its ``wait()`` with
        ``wait``), its result then in place (see :meth:`Work.is_completed`) and its record marked
        completed; whether it had. A dropped handle's failure raises here (reaping: in the next
        call, before anything of that call is sent), its record marked failed and the handle
        forgotten, so the calls after it go on."""
        oldest = self.pending[0]
        try:
            if wait:
                oldest.wait()
            if not oldest.is_completed():
                return False
        except Exception as error:
            self.pending.popleft()
            recorder.mark_failed(self.posted.popleft(), error)
            raise
        self.pending.popleft()
        _completed_record(self.posted.popleft())
        return True

    def complete(self) -> None:
        """Wait for every kept handle, collectives first (``close()``)."""
        while self.pending:
            self.pending.popleft().wait()
            _completed_record(self.posted.popleft())
        while self.pending_p2p:
            self.pending_p2p.popleft().wait()


def _reap(pending: collections.deque[Work]) -> None:
    while pending:
        oldest = pending[0]
        if not oldest.is_completed():
            return
        if pending and pending[0] is oldest:  # (a debug-mode recv that completes forgets itself)
            pending.popleft()


def _completed_record(record: list[Any] | None) -> None:
    """Mark the record of an asynchronous call completed (see recorder.state): its handle has."""
    if record is not None and record[STATE] is POSTED:
        record[STATE], record[END] = STARTED, recorder.clock()
