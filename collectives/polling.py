"""Polling a completion test against a deadline, with a policy per caller: the one loop every
deadline of the library waits in (the backends' requests and CUDA events, the call path's
per-call timeouts and barrier).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Tests between two yields while spinning (:attr:`PollPolicy.spin_yield_every`) in the
#: library's spinning policies: a peer that shares this rank's core waits a few microseconds,
#: not the whole spin (scripts/bench/poll_policy.py measures it).
SPIN_YIELD_EVERY = 16


@dataclass(frozen=True)
class PollPolicy:
    """How :func:`wait_until` polls: ``fast_polls`` tests without a clock read (a small call
    is done by then); then tests without yielding for ``spin_seconds`` (a call a peer
    completes within microseconds is seen at once); then tests that yield the CPU to a
    rank sharing the core, until ``busy_seconds`` from the first clock read; then sleeps
    from ``sleep_min`` doubling to ``sleep_max`` (a hung call does not burn a core). The
    clock is read every ``clock_every`` tests. ``spin_yield_every``: while spinning, yield
    once every that many tests (0: never), so that a peer this rank shares a core with
    runs within microseconds, as MPI's own progress loops let it. ``check_seconds``: the
    least time between two calls of :func:`wait_until`'s ``check`` until the sleeps start
    (0: before sleeps only)."""

    fast_polls: int
    busy_seconds: float
    sleep_min: float
    sleep_max: float
    clock_every: int = 1
    spin_seconds: float = 0.0
    check_seconds: float = 0.0
    spin_yield_every: int = 0


def yield_or_sleep(seconds: float) -> None:
    """Give the CPU to another runnable thread (``0``), or sleep."""
    if seconds <= 0:
        os.sched_yield()
    else:
        time.sleep(seconds)


def wait_until(done: Callable[[], Any], timeout: float, policy: PollPolicy,
               check: Callable[[], None] | None = None,
               clock: Callable[[], float] = time.monotonic,
               pause: Callable[[float], None] = yield_or_sleep) -> bool:
    """Poll ``done()`` until it is true (``True``) or ``timeout`` seconds have passed
    (``False``), as ``policy`` says. ``check()`` runs before each sleep, and with
    ``policy.check_seconds`` also every that many seconds while yielding (a transport's
    asynchronous error query, a look for farewells: it raises what it finds)."""
    for _ in range(policy.fast_polls):
        if done():
            return True
    start = clock()
    deadline, busy_until, interval = start + timeout, start + policy.busy_seconds, policy.sleep_min
    spin_until = start + policy.spin_seconds
    # The phase: 0 spinning (a yield every spin_yield tests), 1 yielding, 2 sleeping.
    phase = 0 if policy.spin_seconds > 0 else 1
    every, polls = policy.clock_every, 0
    spin_yield = policy.spin_yield_every
    check_every = policy.check_seconds if check is not None else 0.0
    next_check = start + check_every
    while not done():
        polls += 1
        if phase == 1 or (phase == 0 and spin_yield and not polls % spin_yield):
            pause(0)
        if polls % every:
            continue
        now = clock()
        if now >= deadline:
            return False
        if now < busy_until or now < spin_until:
            if check_every and now >= next_check:
                check()  # type: ignore[misc]
                next_check = now + check_every
            if now >= spin_until:
                phase = 1
            continue
        phase, every = 2, 1  # sleeping: the clock read at every test
        if check is not None:
            check()
        pause(min(interval, deadline - now))
        interval = min(2 * interval, policy.sleep_max)
    return True
