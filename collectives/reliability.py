"""Reliability on the call path (a base of :class:`collectives.Communicator`): the flight
recorder's hooks and dumps, timeouts (per call too), the barrier that names who is missing,
debug-mode fingerprints, and what a transport's error becomes.

``Communicator._run`` records each call (see :mod:`collectives.recorder`); the methods here
finish a record, call the hooks, run a call under its own ``timeout=``, run the barrier
under a timeout, and write the dump when a call times out or the ranks' calls differ.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import Any

from . import config, recorder
from .calls import BARRIER_TAG, Call
from .errors import CollectiveError, CollectiveTimeout
from .ops import ReduceOp
from .polling import PollPolicy, wait_until
from .recorder import END, ERROR, FAILED, OP, SEQ, STARTED, STATE, CallRecord, HookHandle
from .transport import Transport
from .work import Work

_clock = recorder.clock

#: How ``poll_until`` waits: tests without giving up the CPU for SPIN_SECONDS (a peer's answer
#: is seen the moment it lands), then tests with a yield until YIELD_SECONDS, then sleeps from
#: 0.1 ms up to 1 ms between tests (a long wait does not burn the CPU).
SPIN_SECONDS = 50e-6
YIELD_SECONDS = 0.002
POLL = PollPolicy(fast_polls=0, busy_seconds=YIELD_SECONDS, sleep_min=1e-4, sleep_max=1e-3,
                  spin_seconds=SPIN_SECONDS)


def poll_until(done: Callable[[], bool], deadline: float) -> bool:
    """Poll ``done()`` until it is true (``True``) or ``deadline`` passes (``False``)."""
    return wait_until(done, deadline - _clock(), POLL, clock=_clock)


# Every communicator not yet closed. A timeout leaves requests behind in the transport,
# and a peer that timed out on ANOTHER communicator left its own behind there: the next
# call on any communicator of that transport could match one of them and return the
# peer's abandoned data. So a timeout makes every live communicator of its backend in
# this process unusable (see Reliability._timeout_error).
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


class Reliability(Transport):
    """Hooks, dumps, timeouts, the monitored barrier, fingerprints, transport errors."""

    # Set by Communicator.__init__.
    timeout: float | None
    trace_name: str
    _ring: Any
    _hooks: list[Callable[[CallRecord], Any]]

    _run: Callable[..., Any]  # Communicator's call path
    _why_broken: str | None
    _broken: str | None  # Communicator's property (setting it closes the gate)
    _closed: bool
    backend: str

    def register_hook(self, fn: Callable[[CallRecord], Any]) -> HookHandle:
        """Call ``fn(record)`` when each call on this communicator completes (in the calling
        thread, after the transport returned). ``record`` is a
        :class:`collectives.recorder.CallRecord`: ``op``, ``seq``, ``dtype``, ``shape``,
        ``bytes``, ``start`` and ``end`` (``time.monotonic()``). An asynchronous call is
        reported when it is posted. Returns a handle whose ``remove()`` unregisters ``fn``.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable; got {type(fn).__name__}")
        if self._ring is None:  # COLLECTIVES_TRACE_SIZE=0: a ring of one call carries the hooks' records
            self._ring = collections.deque(maxlen=1)
        self._hooks.append(fn)
        return HookHandle(self._hooks, fn)

    def dump_trace(self, path: str | None = None) -> str | None:
        """Write this rank's flight-recorder dump (every communicator's recent calls, every
        thread's stack) to ``path``, else to ``COLLECTIVES_TRACE_DIR/rank-<R>.json``; returns
        the path written, None when neither is given. Local: no other rank takes part."""
        return recorder.dump(f"dump_trace() on {self.trace_name}", path)

    def _completed(self, record: list[Any] | None) -> None:
        if record is not None:
            record[END] = _clock()
            if self._hooks:
                self._call_hooks(record)

    def _failed(self, record: list[Any] | None, error: BaseException) -> None:
        if record is not None and record[STATE] is not FAILED:
            record[STATE], record[END] = FAILED, _clock()
            record[ERROR] = f"{type(error).__name__}: {str(error)[:300]}"

    def _call_hooks(self, record: list[Any]) -> None:
        described = CallRecord(record, self)
        for hook in list(self._hooks):
            hook(described)

    def _record_of(self, seq: int) -> list[Any] | None:
        """The recorded collective numbered ``seq``, if the ring still holds it."""
        for record in reversed(self._ring or ()):
            if record[SEQ] == seq and record[OP].collective:
                found: list[Any] = record
                return found
        return None

    def _run_with_timeout(self, call: Call, x: Any, op: Any, root: Any, out: Any, async_op: Any,
                          extra: Any, timeout: Any) -> Any:
        """A call with its own ``timeout=``: the communicator's timeout is replaced for it (a
        backend's deadline reads ``self.timeout``); a blocking call runs as an asynchronous
        one whose handle is polled against the deadline, so the value holds on transports
        that take their timeout from elsewhere (torch's process group), when it is shorter."""
        seconds = config.timeout_seconds(timeout or 0)  # 0 / None: no timeout for this call
        kept, self.timeout = self.timeout, seconds
        try:
            if seconds is None or async_op is not False:
                return self._run(call, x, op, root, out, async_op, extra)
            deadline = _clock() + seconds
            work = self._run(call, x, op, root, out, True, extra)
            seq = self._seq
            if not poll_until(work.is_completed, deadline):
                error = self._timeout_error(call=(call.name, seq))
                self._failed(self._record_of(seq), error)
                raise error
            result = work.wait()
            record = self._record_of(seq) if call.collective else None
            if record is not None:
                record[STATE], record[END] = STARTED, _clock()  # completed (see recorder.state)
            return x if call.in_place else result
        finally:
            self.timeout = kept

    def _monitored_barrier(self, seconds: float) -> None:
        """The barrier under a timeout: the transport's own barrier (under the deadline), and
        before it one word from every rank to rank 0, so that rank 0's timeout can name the
        ranks that never arrived. The words travel while the barrier runs: a barrier that
        completes costs one small message more per rank, not a round trip."""
        import numpy as np  # noqa: PLC0415

        if self.rank != 0:
            arrived = self._send_small(np.ones(1, np.int64), 0, BARRIER_TAG)
            try:
                self._barrier()
            except CollectiveTimeout as error:
                raise CollectiveTimeout(
                    f"{error} (rank 0 did not release the barrier: its CollectiveTimeout, or its "
                    "dump with COLLECTIVES_TRACE_DIR, names the ranks that never arrived)") from error
            self._wait_all({0: arrived}, _clock() + seconds)
            return
        words = [np.zeros(1, np.int64) for _ in range(self.size)]
        arrivals = {peer: self._recv_small(words[peer], peer, BARRIER_TAG) for peer in range(1, self.size)}
        try:
            self._barrier()
        except CollectiveTimeout as error:
            missing = self._wait_all(arrivals, _clock())
            if not missing:
                raise
            raise CollectiveTimeout(
                f"{error} (rank(s) {', '.join(map(str, missing))} never arrived at the barrier)"
            ) from error
        # Every word was sent before its rank entered the barrier that just completed.
        self._wait_all(arrivals, _clock() + seconds)

    def _wait_all(self, works: dict[int, Work], deadline: float) -> list[int]:
        """Poll ``works`` until all completed or ``deadline``; the keys of those that did not."""
        poll_until(lambda: all(work.is_completed() for work in works.values()), deadline)
        waiting = sorted(key for key, work in works.items() if not work.is_completed())
        for key, work in works.items():
            if key not in waiting:
                work.wait()
        return waiting

    # -- reliability: sequence numbers, fingerprints, timeouts ---------------------------

    @property
    def sequence_number(self) -> int:
        """How many collectives this communicator has started (the running one's number)."""
        return self._seq

    @property
    def _timeout_arg(self) -> float:
        """``timeout`` as a constructor argument, for a split to inherit (0: none)."""
        return 0.0 if self.timeout is None else self.timeout

    def _call_name(self, call: tuple[str, int] | None = None) -> str:
        operation, seq = call or (self._operation, self._seq)
        return f"{operation or 'collective'} (call #{seq}) on {self!r}"

    def _timeout_error(self, detail: str = "", call: tuple[str, int] | None = None) -> CollectiveTimeout:
        """A :class:`CollectiveTimeout` for the running call (or ``call``: operation and
        sequence number of an asynchronous one); the communicator becomes unusable.

        Backends call this when their deadline passes (or their transport timed out).
        """
        call_name = self._call_name(call)
        seq = call[1] if call is not None else self._seq
        self._failed(self._record_of(seq), CollectiveTimeout(f"did not complete within {self.timeout}s"))
        recorder.dump(f"CollectiveTimeout in {call_name}")
        self._broken = (f"{self!r} is unusable: {call_name} timed out, and the transport cannot "
                        "take it back (some ranks may still be inside it); create a new "
                        "communicator, or end the job")
        for sibling in list(_LIVE):  # a peer may have left requests on any of them
            if sibling is not self and sibling.backend == self.backend and not sibling._broken:
                sibling._broken = (
                    f"{sibling!r} is unusable: {call_name} timed out, and this communicator "
                    f"shares the {self.backend} transport with it (a rank that timed out on "
                    "another communicator may have left a call behind on this one); end the job")
        source = f"timeout={self.timeout:g}s" if self.timeout is not None else "the transport's timeout"
        return CollectiveTimeout(
            f"{call_name} did not complete within {source} ({config.TIMEOUT}): another rank "
            f"skipped this call, called a different collective, or is stuck or dead"
            f"{'; ' + detail if detail else ''}. This communicator is now unusable: "
            "every later call on it raises."
        )

    def _transport_error(self, error: Exception) -> Exception:
        """What an exception raised inside the running call becomes.

        Our own ``TypeError``/``ValueError`` (and ``MemoryError``) propagate unchanged;
        anything else came from the transport and becomes :class:`CollectiveError` naming
        the call. Backends override this to turn their transport's timeout into
        :meth:`_timeout_error` first, and end with this.
        """
        if isinstance(error, (TypeError, ValueError, MemoryError)):
            return error
        text = str(error).strip()
        # MPICH's first line announces a stack of frames ("Other MPI error, error stack:"): its class is the news.
        first_line = text.splitlines()[0][:300].removesuffix(" error stack:").rstrip(",") if text else ""
        return CollectiveError(f"{self._call_name()} failed in the {self.backend} transport: "
                               f"{type(error).__module__}.{type(error).__qualname__}: {first_line}")

    def _compare_fingerprints(self, reduce_op: ReduceOp | None, root: int, dtype: str | None,
                              shape: tuple[int, ...]) -> None:
        """Debug mode: ``CollectiveMismatch`` on every rank unless every rank makes this call.

        One all_gather of a fixed-size int64 vector over this communicator's own transport.
        """
        from .debug import fingerprint, mismatch  # noqa: PLC0415  (debug mode only)

        mine = fingerprint(self._operation, self._seq, reduce_op, root, dtype, tuple(shape))
        try:
            everyone = self._exchange_small(mine)
        except CollectiveError:
            raise
        except Exception as error:
            raise self._transport_error(error) from error
        found = mismatch(everyone, self)
        if found is not None:
            self._failed(self._record_of(self._seq), found)
            recorder.dump(f"CollectiveMismatch in {self._call_name()}")
            raise found
