"""Three parts a :class:`collectives.Communicator` holds for reliability, each with its own
state and given what it needs (the transport, the communicator's
:class:`~collectives.context.CommunicatorContext`):

- :class:`CallCheck`: before a collective moves data, every rank makes the same call (one word
  agreed over the ranks; the fingerprints of :mod:`collectives.wire` when the words differ);
- :class:`MonitoredBarrier`: the barrier under a timeout, whose timeout names the ranks that
  never arrived.

The peers that left are :class:`collectives.farewell.Farewells`; timeouts, what a transport's
error becomes and the listening wait are the context's (:mod:`collectives.context`); the call
path itself is ``Communicator._run``.

Imports: calls, config, the context, errors, the recorder, the transport protocol, wire and
work (never the communicator).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import config
from .calls import BARRIER_TAG, Call
from .context import CommunicatorContext, poll_until
from .diagnostics import recorder
from .errors import CollectiveError, CollectiveMismatch, CollectiveTimeout
from .ops import ReduceOp
from .transport import Transport
from .wire import call_hash
from .work import KeptHandles, Work

_clock = recorder.clock
#: Kinds of call whose hash a communicator keeps (a program with more forgets and hashes again).
MAX_CALL_HASHES = 4096

class CallCheck:
    """Every rank makes the same collective call, checked before it moves data, on a
    communicator of ``size`` ranks over ``transport``; ``context`` is the communicator's side
    (the running call, its exchange, what errors become)."""

    __slots__ = ("_transport", "_context", "_comm", "level", "first_checked", "_hashes")

    def __init__(self, transport: Transport, context: CommunicatorContext, size: int) -> None:
        self._transport, self._context = transport, context
        # The communicator, for the running call's number (``context.call`` without its tuple:
        # :meth:`check` runs on every call).
        self._comm = context.comm
        # One rank has nobody to disagree with: checks cost nothing at size 1.
        level = config.check_level() if size > 1 else config.CHECKS_OFF
        if level == config.CHECKS_DEFAULT and not transport._checks_by_default:
            level = config.CHECKS_OFF
        #: The checks level (:func:`collectives.config.check_level`; CHECKS_OFF where the
        #: transport does not check by default).
        self.level = level
        #: Whether the first collective is checked: it compares in full, COLLECTIVES_DEBUG=0 too
        #: (then no more), where the transport checks by default.
        self.first_checked = size > 1 and (level != config.CHECKS_OFF or transport._checks_by_default)
        # The hashes of the kinds of call seen (see check).
        self._hashes: dict[tuple[Any, ...], int] = {}

    def check(self, call: Call, reduce_op: ReduceOp | None, root: int, dtype: str | None,
              shape: tuple[int, ...]) -> None:
        """Before the running collective ``call`` moves any data: every rank makes the same
        call, else :class:`CollectiveMismatch` on every rank, nothing sent.

        By default one small all_reduce (the transport's ``_agree_word``) of a word that hashes
        the call's kind, reduce op, root, dtype, shape and sequence number (an uneven
        collective's dtype and shape are compared by its own counts exchange, which follows);
        the full fingerprints travel only when the words disagree, to name the ranks and the
        difference. In debug mode (``COLLECTIVES_DEBUG=1``), and on the first collective of
        every communicator (which also compares the ranks' checks levels), the full
        fingerprints always travel. Every rank makes the same exchanges as long as every rank
        makes the same calls: the ranks all see the same result, so all raise or none."""
        seq: int = self._comm._seq
        if call.counted:  # dtype and shape: the call's counts exchange compares them
            dtype, shape = None, ()
        if self.level != config.CHECKS_DEFAULT or seq == 1:
            self.compare_fingerprints(reduce_op, root, dtype, shape)
            if self.level == config.CHECKS_OFF:
                self._context.stop_checking()
            return
        try:
            h = self._hashes[call, dtype, reduce_op, root, shape]
        except KeyError:
            h = self._hash_call(call, reduce_op, root, dtype, shape)
        # check_word(h, seq) and words_agree, written out: this runs on every call
        h = (h ^ seq) & 0x7FFFFFFF
        reduced = self._transport._agree_word((h << 32) | (h ^ 0xFFFFFFFF))
        if ((reduced >> 32) | reduced) & 0xFFFFFFFF != 0xFFFFFFFF:
            self.compare_fingerprints(reduce_op, root, dtype, shape)
            raise CollectiveMismatch(  # (hash words differ only where fingerprints do)
                f"{self._context.call_name()}: the ranks' check words differ, but their "
                "fingerprints agree; is COLLECTIVES_DEBUG set the same on every rank?")

    def _hash_call(self, call: Call, reduce_op: ReduceOp | None, root: int, dtype: str | None,
                   shape: tuple[int, ...]) -> int:
        """:func:`collectives.wire.call_hash` of a kind of call, remembered."""
        if len(self._hashes) >= MAX_CALL_HASHES:
            self._hashes.clear()
        h = call_hash(call.name, reduce_op, root, dtype, tuple(shape))
        self._hashes[call, dtype, reduce_op, root, shape] = h
        return h

    def compare_fingerprints(self, reduce_op: ReduceOp | None, root: int, dtype: str | None,
                             shape: tuple[int, ...]) -> None:
        """``CollectiveMismatch`` on every rank unless every rank makes the running call.

        One all_gather of a fixed-size int64 vector over the communicator's own transport.
        """
        from .wire import fingerprint, mismatch  # noqa: PLC0415

        context = self._context
        operation, seq = context.call
        mine = fingerprint(operation, seq, reduce_op, root, dtype, tuple(shape), self.level)
        try:
            everyone = context.exchange_listening(mine)
        except CollectiveError:
            raise
        except Exception as error:
            raise context.transport_error(error) from error
        found = mismatch(everyone, context.comm)
        if found is not None:
            context.record_failed(seq, found)
            recorder.dump(f"CollectiveMismatch in {context.call_name()}")
            raise found


class MonitoredBarrier:
    """The barrier under a timeout on rank ``rank`` of ``size``, over ``transport``: before
    the barrier itself, one word from every rank to rank 0 (the barrier's sequence number), so
    that rank 0's timeout can name the ranks that never arrived. A rank's send of its word is
    kept in ``handles`` until it completes."""

    __slots__ = ("_transport", "_rank", "_size", "_handles", "_words")

    def __init__(self, transport: Transport, rank: int, size: int, handles: KeptHandles) -> None:
        self._transport, self._rank, self._size, self._handles = transport, rank, size, handles
        # Rank 0's posted receives of the barrier's words not taken yet: peer -> (handle, word).
        self._words: dict[int, tuple[Work, Any]] = {}

    def run(self, seconds: float, seq: int, synchronize: Callable[[], None]) -> None:
        """Barrier number ``seq``: ``synchronize()`` (the barrier itself, under the deadline of
        ``seconds``), with the words. The words travel while the barrier runs: a barrier that
        completes costs one small message more per rank, not a round trip. A word that rank 0
        did not take (a mismatch ended the barrier, or rank 0 was in another call) is taken by
        its next barrier, which skips words of older barriers."""
        import numpy as np  # noqa: PLC0415

        if self._transport._native_monitored_barrier(seconds):
            return
        if self._rank != 0:
            word = np.full(1, seq, np.int64)
            self._handles.keep_p2p(self._transport._send_small(word, 0, BARRIER_TAG))  # (kept till sent)
            try:
                synchronize()
            except CollectiveTimeout as error:
                raise CollectiveTimeout(
                    f"{error} (rank 0 did not release the barrier: its CollectiveTimeout, or its "
                    "dump with COLLECTIVES_TRACE_DIR, names the ranks that never arrived)") from error
            return
        words = self._words
        for peer in range(1, self._size):
            if peer not in words:
                vector = np.zeros(1, np.int64)
                words[peer] = (self._transport._recv_small(vector, peer, BARRIER_TAG), vector)
        try:
            synchronize()
        except CollectiveTimeout as error:
            missing = [peer for peer in range(1, self._size) if not self._take_word(peer, seq, _clock())]
            if not missing:
                raise
            raise CollectiveTimeout(
                f"{error} (rank(s) {', '.join(map(str, missing))} never arrived at the barrier)"
            ) from error
        # Every word of this barrier was sent before its rank entered the check that completed.
        deadline = _clock() + seconds
        for peer in range(1, self._size):
            self._take_word(peer, seq, deadline)

    def _take_word(self, peer: int, seq: int, deadline: float) -> bool:
        """Whether ``peer``'s word of barrier ``seq`` reached rank 0 by ``deadline`` (taken
        then; words of older barriers are skipped)."""
        import numpy as np  # noqa: PLC0415

        words = self._words
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
