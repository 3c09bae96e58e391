"""Reliability on the call path (a base of :class:`collectives.Communicator`): the check that
every rank makes the same call, the flight recorder's hooks and dumps, timeouts (per call
too), the barrier that names who is missing, and what a transport's error becomes.

``Communicator._run`` records each call (see :mod:`collectives.diagnostics.recorder`); the methods here
finish a record, call the hooks, run a call under its own ``timeout=``, run the barrier
under a timeout, and write the dump when a call times out or the ranks' calls differ.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

from . import config, farewell
from .calls import BARRIER, BARRIER_TAG, Call
from .diagnostics import recorder
from .diagnostics.recorder import END, ERROR, FAILED, OP, SEQ, STARTED, STATE, CallRecord, HookHandle
from .errors import CollectiveError, CollectiveMismatch, CollectiveTimeout
from .ops import ReduceOp
from .polling import SPIN_YIELD_EVERY, PollPolicy, wait_until
from .transport import Transport
from .wire import call_hash
from .work import Work, _reap

_clock = recorder.clock
#: Kinds of call whose hash a communicator keeps (a program with more forgets and hashes again).
MAX_CALL_HASHES = 4096

#: How ``poll_until`` waits: tests without giving up the CPU for SPIN_SECONDS (a peer's answer
#: is seen the moment it lands; a yield every SPIN_YIELD_EVERY tests, for a peer on this core),
#: then tests with a yield until YIELD_SECONDS, then sleeps from 0.1 ms up to 1 ms between
#: tests (a long wait does not burn the CPU).
SPIN_SECONDS = 50e-6
YIELD_SECONDS = 0.002
POLL = PollPolicy(fast_polls=0, busy_seconds=YIELD_SECONDS, sleep_min=1e-4, sleep_max=1e-3,
                  spin_seconds=SPIN_SECONDS, spin_yield_every=SPIN_YIELD_EVERY)
#: Seconds a call path's own exchange waits in one go before it looks for farewells again.
LISTEN_SLICE = 0.05


def poll_until(done: Callable[[], bool], deadline: float) -> bool:
    """Poll ``done()`` until it is true (``True``) or ``deadline`` passes (``False``)."""
    return wait_until(done, deadline - _clock(), POLL, clock=_clock)


# Every communicator not yet closed (collectives.farewell's): a timeout makes every live
# communicator of its backend in this process unusable (see Reliability._timeout_error).
_LIVE = farewell.LIVE


class Reliability:
    """Hooks, dumps, timeouts, the monitored barrier, fingerprints, transport errors."""

    # Set by Communicator.__init__.
    timeout: float | None
    trace_name: str
    _ring: Any
    _hooks: list[Callable[[CallRecord], Any]]

    _transport: Transport
    rank: int
    size: int
    _seq: int
    _operation: str
    _pending_p2p: collections.deque[Work]
    _run: Callable[..., Any]  # Communicator's call path
    _rank_failure: Callable[[Exception | None], Any]  # Communicator's (fault tolerance)
    _why_broken: str | None
    _broken: str | None  # Communicator's property (setting it closes the gate)
    _closed: bool
    # Set by Communicator.__init__: the checks level (config.check_level(), CHECKS_OFF where
    # the transport does not check by default), whether calls are still checked (the call
    # path's one test), and the hashes of the kinds of call seen (see _check_call).
    _check_level: int
    _checking: bool
    _call_hashes: dict[tuple[Any, ...], int]
    # Rank 0's posted receives of the barrier's words not taken yet: peer -> (handle, word).
    _barrier_words: dict[int, tuple[Work, Any]]
    # Peers that left this communicator: rank -> (its count of calls, how; see farewell), and
    # whether this rank said its own farewell.
    _left: dict[int, tuple[int, int]]
    _farewell_said: bool
    # Handles of calls that timed out or lost a peer: kept, the transport may write their buffers.
    _abandoned_works: list[Work]

    def register_hook(self, fn: Callable[[CallRecord], Any]) -> HookHandle:
        """Call ``fn(record)`` when each call on this communicator completes (in the calling
        thread, after the transport returned). ``record`` is a
        :class:`collectives.diagnostics.recorder.CallRecord`: ``op``, ``seq``, ``dtype``, ``shape``,
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

    def _synchronize(self) -> None:
        """The barrier itself: with checks on, the check before the call (an all_reduce over every
        rank, which no rank completes before every rank has entered it, so it is a barrier and
        also tells a barrier from another call); else the transport's barrier."""
        if self._checking:
            self._check_call(BARRIER, None, -1, None, ())
        else:
            self._transport._barrier()

    def _monitored_barrier(self, seconds: float) -> None:
        """The barrier under a timeout: :meth:`_synchronize` (under the deadline), and before it
        one word from every rank to rank 0 (the barrier's sequence number), so that rank 0's
        timeout can name the ranks that never arrived. The words travel while the barrier runs:
        a barrier that completes costs one small message more per rank, not a round trip. A
        word that rank 0 did not take (a mismatch ended the barrier, or rank 0 was in another
        call) is taken by its next barrier, which skips words of older barriers."""
        import numpy as np  # noqa: PLC0415

        if self._transport._native_monitored_barrier(seconds):
            return
        seq = self._seq
        if self.rank != 0:
            word = np.full(1, seq, np.int64)
            self._pending_p2p.append(self._transport._send_small(word, 0, BARRIER_TAG))  # (kept till sent)
            _reap(self._pending_p2p)
            try:
                self._synchronize()
            except CollectiveTimeout as error:
                raise CollectiveTimeout(
                    f"{error} (rank 0 did not release the barrier: its CollectiveTimeout, or its "
                    "dump with COLLECTIVES_TRACE_DIR, names the ranks that never arrived)") from error
            return
        words = self._barrier_words
        for peer in range(1, self.size):
            if peer not in words:
                vector = np.zeros(1, np.int64)
                words[peer] = (self._transport._recv_small(vector, peer, BARRIER_TAG), vector)
        try:
            self._synchronize()
        except CollectiveTimeout as error:
            missing = [peer for peer in range(1, self.size) if not self._take_word(peer, seq, _clock())]
            if not missing:
                raise
            raise CollectiveTimeout(
                f"{error} (rank(s) {', '.join(map(str, missing))} never arrived at the barrier)"
            ) from error
        # Every word of this barrier was sent before its rank entered the check that completed.
        deadline = _clock() + seconds
        for peer in range(1, self.size):
            self._take_word(peer, seq, deadline)

    def _take_word(self, peer: int, seq: int, deadline: float) -> bool:
        """Whether ``peer``'s word of barrier ``seq`` reached rank 0 by ``deadline`` (taken
        then; words of older barriers are skipped)."""
        import numpy as np  # noqa: PLC0415

        words = self._barrier_words
        while True:
            work, vector = words[peer]
            if not poll_until(work.is_completed, deadline):
                return False
            work.wait()
            if int(vector[0]) >= seq:
                del words[peer]
                return True
            vector = np.zeros(1, np.int64)  # an older barrier's: the next word is this one's
            words[peer] = (self._transport._recv_small(vector, peer, BARRIER_TAG), vector)

    def _wait_all(self, works: dict[int, Work], deadline: float) -> list[int]:
        """Poll ``works`` until all completed or ``deadline``; the keys of those that did not."""
        poll_until(lambda: all(work.is_completed() for work in works.values()), deadline)
        waiting = sorted(key for key, work in works.items() if not work.is_completed())
        for key, work in works.items():
            if key not in waiting:
                work.wait()
        return waiting

    # -- farewells: a peer that left (collectives/farewell.py) ------------------------------

    def _say_farewell(self, how: int) -> None:
        """Tell the peers that this rank leaves this communicator (``close()``, interpreter exit).
        Best effort: a peer that cannot be told waits for its timeout, as before."""
        if self.size > 1 and not self._closed and not self._why_broken and not self._farewell_said:
            self._farewell_said = True
            try:
                self._transport._tell_peers_left(how)
            except Exception:  # noqa: BLE001 - the transport is going away already
                pass

    def _hear_farewells(self, call: tuple[str, int] | None = None) -> None:
        """While a call waits (``call``: its operation and number; default the running one):
        :class:`~collectives.farewell.PeerLeft` when a peer left before making it."""
        for rank, calls, how in self._transport._peers_left():
            self._left[rank] = (calls, how)
        seq = call[1] if call is not None else self._seq
        gone = [(rank, calls, how) for rank, (calls, how) in self._left.items() if calls < seq]
        if not gone:
            return
        call_name = self._call_name(call)
        error = farewell.PeerLeft(
            f"{call_name} cannot complete: {farewell.describe(gone)}, so it will never make this "
            f"call (#{seq}): the ranks made different numbers of collective calls. This "
            "communicator is now unusable: every later call on it raises.")
        error.left = gone
        farewell.raised.extend(gone)
        self._failed(self._record_of(seq), error)
        self._broken = f"{self!r} is unusable: {call_name} waited for a rank that left ({farewell.describe(gone)})"
        recorder.dump(f"PeerLeft in {call_name}")
        raise error

    def _exchange_listening(self, vector: Any) -> Any:
        """:meth:`_exchange_small`, polled under the communicator's timeout while looking for
        farewells (a peer that left is heard here too, also with no timeout)."""
        work = self._transport._start_exchange_small(vector)
        if work is None:
            return self._transport._exchange_small(vector)
        self._await(work, math.inf if self.timeout is None else self.timeout)
        return work.wait()

    def _await(self, work: Work, seconds: float) -> None:
        """Wait for ``work`` (a call of the call path's own, before any data moves) at most
        ``seconds``, looking for farewells every LISTEN_SLICE: ``PeerLeft`` when a peer left,
        :class:`CollectiveTimeout` past ``seconds``; the handle is then kept (the transport may
        still write its buffers)."""
        deadline = _clock() + seconds
        try:
            while not work.wait_for(min(LISTEN_SLICE, max(deadline - _clock(), 0.0))):
                self._hear_farewells()
                if _clock() >= deadline:
                    raise self._timeout_error()
        except CollectiveError:
            self._abandoned_works.append(work)
            raise

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
            if sibling is not self and sibling.backend == self._transport.backend and not sibling._broken:
                sibling._broken = (
                    f"{sibling!r} is unusable: {call_name} timed out, and this communicator "
                    f"shares the {self._transport.backend} transport with it (a rank that timed out on "
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
        anything else came from the transport: what the backend's :meth:`_map_error` makes of
        it (its transport's timeout as :meth:`_timeout_error`), else :class:`CollectiveError`
        naming the call.
        """
        if isinstance(error, (TypeError, ValueError, MemoryError)):
            return error
        failure: Exception | None = self._rank_failure(error)  # fault tolerance: a peer died
        if failure is not None:
            return failure
        mapped = self._transport._map_error(error)
        if mapped is not None:
            return mapped
        text = str(error).strip()
        # MPICH's first line announces a stack of frames ("Other MPI error, error stack:"): its class is the news.
        first_line = text.splitlines()[0][:300].removesuffix(" error stack:").rstrip(",") if text else ""
        return CollectiveError(f"{self._call_name()} failed in the {self._transport.backend} transport: "
                               f"{type(error).__module__}.{type(error).__qualname__}: {first_line}")

    def _check_call(self, call: Call, reduce_op: ReduceOp | None, root: int, dtype: str | None,
                    shape: tuple[int, ...]) -> None:
        """Before collective ``call`` (numbered ``self._seq``) moves any data: every rank makes
        the same call, else :class:`CollectiveMismatch` on every rank, nothing sent.

        By default one small all_reduce (:meth:`_agree_word`) of a word that hashes the call's
        kind, reduce op, root, dtype, shape and sequence number (an uneven collective's dtype and
        shape are compared by its own counts exchange, which follows); the
        full fingerprints travel only when the words disagree, to name the ranks and the
        difference. In debug mode (``COLLECTIVES_DEBUG=1``), and on the first collective of
        every communicator (which also compares the ranks' checks levels), the full
        fingerprints always travel. Every rank makes the same exchanges as long as every rank
        makes the same calls: the ranks all see the same result, so all raise or none."""
        seq = self._seq
        if call.counted:  # dtype and shape: the call's counts exchange compares them
            dtype, shape = None, ()
        if self._check_level != config.CHECKS_DEFAULT or seq == 1:
            self._compare_fingerprints(reduce_op, root, dtype, shape)
            if self._check_level == config.CHECKS_OFF:
                self._checking = False
            return
        try:
            h = self._call_hashes[call, dtype, reduce_op, root, shape]
        except KeyError:
            h = self._hash_call(call, reduce_op, root, dtype, shape)
        # check_word(h, seq) and words_agree, written out: this runs on every call
        h = (h ^ seq) & 0x7FFFFFFF
        reduced = self._transport._agree_word((h << 32) | (h ^ 0xFFFFFFFF))
        if ((reduced >> 32) | reduced) & 0xFFFFFFFF != 0xFFFFFFFF:
            self._compare_fingerprints(reduce_op, root, dtype, shape)
            raise CollectiveMismatch(  # (hash words differ only where fingerprints do)
                f"{self._call_name()}: the ranks' check words differ, but their fingerprints "
                "agree; is COLLECTIVES_DEBUG set the same on every rank?")

    def _hash_call(self, call: Call, reduce_op: ReduceOp | None, root: int, dtype: str | None,
                   shape: tuple[int, ...]) -> int:
        """:func:`collectives.wire.call_hash` of a kind of call, remembered."""
        if len(self._call_hashes) >= MAX_CALL_HASHES:
            self._call_hashes.clear()
        h = call_hash(call.name, reduce_op, root, dtype, tuple(shape))
        self._call_hashes[call, dtype, reduce_op, root, shape] = h
        return h

    def _compare_fingerprints(self, reduce_op: ReduceOp | None, root: int, dtype: str | None,
                              shape: tuple[int, ...]) -> None:
        """``CollectiveMismatch`` on every rank unless every rank makes this call.

        One all_gather of a fixed-size int64 vector over this communicator's own transport.
        """
        from .wire import fingerprint, mismatch  # noqa: PLC0415

        mine = fingerprint(self._operation, self._seq, reduce_op, root, dtype, tuple(shape),
                           self._check_level)
        try:
            everyone = self._exchange_listening(mine)
        except CollectiveError:
            raise
        except Exception as error:
            raise self._transport_error(error) from error
        found = mismatch(everyone, self)
        if found is not None:
            self._failed(self._record_of(self._seq), found)
            recorder.dump(f"CollectiveMismatch in {self._call_name()}")
            raise found
