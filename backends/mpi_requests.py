"""How the MPI backend completes a nonblocking call: the poll policies of its deadline
(:func:`poll_policy`) and the handle of an asynchronous call (:class:`_Request`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from collectives.farewell import LISTEN_SECONDS
from collectives.polling import SPIN_YIELD_EVERY, PollPolicy
from collectives.work import Work

#: Waiting for a request under a timeout where ranks share cores: FAST_POLLS tests before the
#: clock is read (none on the fast path), then tests with sched_yield (the clock read every
#: 64th) for BUSY_POLL_SECONDS, then one test per POLL_INTERVAL (a hung call sleeps).
FAST_POLLS = 16
BUSY_POLL_SECONDS = 1.0
POLL_INTERVAL = 0.001
# While yielding, a look for farewells (collectives.farewell) every LISTEN_SECONDS at most.
POLL = PollPolicy(FAST_POLLS, BUSY_POLL_SECONDS, POLL_INTERVAL, POLL_INTERVAL, clock_every=64,
                  check_seconds=LISTEN_SECONDS)
#: Where no rank shares a core: tests without yielding, but a yield every SPIN_YIELD_EVERY
#: tests, for the whole busy second (SPIN_SECONDS), then sleeps. Measured on 2 ranks of a
#: 2-core machine (scripts/bench/poll_policy.py, docs/performance.md): yielding at every
#: test made 16-256 KiB broadcasts 1.1-1.3x raw on a quiet node (the message landed while
#: the rank was in the kernel); spinning without yields is 10-150x raw when the scheduler
#: puts both ranks on one core (a busy job on the other: the peer waits for the spin to
#: end); the periodic yield costs the first nothing measurable and is within the noise of
#: yielding at every test in the second, as MPI's own blocking calls are.
SPIN_SECONDS = BUSY_POLL_SECONDS
SPIN_POLL = PollPolicy(FAST_POLLS, BUSY_POLL_SECONDS, POLL_INTERVAL, POLL_INTERVAL, clock_every=64,
                       spin_seconds=SPIN_SECONDS, check_seconds=LISTEN_SECONDS,
                       spin_yield_every=SPIN_YIELD_EVERY)


def poll_policy(ranks_on_node: int) -> PollPolicy:
    """How a communicator with ``ranks_on_node`` ranks on this node waits: :data:`SPIN_POLL`
    when each can have a core of this process's CPU set, else :data:`POLL`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        cores = os.cpu_count() or 1
    return SPIN_POLL if ranks_on_node <= cores else POLL


class _Request(Work):
    """Nonblocking MPI requests, plus what must happen once they complete.

    ``wait(request, call, status)`` completes one request (the communicator's: under its
    deadline, listening for farewells); ``call`` is the call this is, ``(operation, seq)``, for
    a timeout's message (the communicator moves on). Without ``wait``: ``request.Wait``."""

    def __init__(self, x: Any, MPI: Any, requests: list[Any], finish: Callable[[], None],
                 wait: Callable[[Any, tuple[str, int] | None, Any], None] | None = None,
                 call: tuple[str, int] | None = None, statuses: list[Any] | None = None,
                 buffers: Any = None):
        super().__init__(x)
        self._MPI = MPI
        self._requests = requests
        self._statuses = statuses
        # Memory MPI reads or writes until the requests complete (staging copies).
        self._buffers = buffers
        self._finish: Callable[[], None] | None = finish
        self._wait_one = wait
        self._call = call

    def wait(self) -> Any:
        if self._finish is not None:
            statuses = self._statuses or [None] * len(self._requests)
            wait = self._wait_one
            for request, status in zip(self._requests, statuses):
                if wait is None:
                    request.Wait(status)
                else:
                    wait(request, self._call, status)
            self._complete()
        return self._x

    def _complete(self) -> None:
        # Once: a completed request is inactive, and waiting on it again would reset its status.
        finish, self._finish, self._buffers = self._finish, None, None
        if finish is not None:
            finish()

    def _cancel(self) -> None:
        """Cancel the requests not complete (a posted receive no message came for) and complete
        them, so that MPI frees their communicator once it is freed."""
        MPI = self._MPI
        if self._finish is None or MPI.Is_finalized():
            return
        try:
            for request in self._requests:
                if request != MPI.REQUEST_NULL and not request.Test():
                    request.Cancel()
                    request.Wait()
        except MPI.Exception:  # (a communicator a lost peer broke: the request stays MPI's)
            return
        self._finish = self._buffers = None

    def is_completed(self) -> bool:
        if self._finish is None:
            return True
        statuses = self._statuses or [None] * len(self._requests)
        if not all(request.Test(status) for request, status in zip(self._requests, statuses)):
            return False
        self._complete()
        return True
