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

import sys
from collections.abc import Callable
from typing import Any

from . import config
from .calls import ALL_GATHER_V, BARRIER_TAG, NOT_TAKEN, Call, Request
from .checks import refused_call
from .context import CommunicatorContext, poll_until
from .diagnostics import recorder
from .diagnostics.recorder import mark_failed
from .errors import CollectiveError, CollectiveMismatch, CollectiveTimeout
from .ops import ReduceOp
from .transport import Transport
from .wire import FAST_BIT, REFUSED_WORD, call_hash, check_word, words_agree
from .work import KeptHandles, Work

_clock = recorder.clock
# (bound once: the compiled form reads it as a C int, collectives/reliability.pxd)
_CHECKS_DEFAULT = config.CHECKS_DEFAULT

#: Kinds of call whose hash a communicator keeps (a program with more forgets and hashes again).
MAX_CALL_HASHES = 4096

class CallCheck:
    """Every rank makes the same collective call, checked before it moves data, on a
    communicator of ``size`` ranks over ``transport``; ``context`` is the communicator's side
    (the running call, its exchange, what errors become).

    Compiled as it stands where it was built (the module ``collectives._reliability_c``, with the
    types of collectives/reliability.pxd: :func:`call_check` makes the communicator's); its
    methods are the same in both forms."""

    __slots__ = ("_transport", "_context", "_comm", "level", "first_checked", "hashes", "carries", "fast_bit",
                 "posts", "_kept_call", "_kept_dtype", "_kept_op", "_kept_root", "_kept_shape", "_kept_hash",
                 "_kept_kind", "_kinds", "_uneven_fixed")

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
        #: The hashes of the kinds of call seen, by (call, dtype, reduce_op, root, shape) (see check).
        self.hashes: dict[tuple[Any, ...], int] = {}
        # The kind of call hashed last and its hash (see _call_hash): a loop of one kind of call
        # looks nothing up (a reduce op's hash is a Python function of Enum's).
        self._kept_call: Any = None
        self._kept_dtype: Any = None
        self._kept_op: Any = None
        self._kept_root: Any = None
        self._kept_shape: Any = None
        self._kept_hash = 0
        # The posted checks' kinds of call (see post): the last one's, and every kind's by the key of
        # hashes, so that a posted check adds no tuple of its own to the queue (which lives until
        # the watchdog compares it: a tuple per call there would wake the garbage collector).
        self._kept_kind: Any = None
        self._kinds: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        #: Whether an uneven call's counts travel in the round of its word (see check_counts): the
        #: default check's, and with the check off the same round, which the call's counts exchange
        #: makes anyway (not in debug mode, whose exchange compares everything).
        self.carries = transport._counts_with_check and level != config.CHECKS_FULL
        # The bound on an uneven call's carried x where the transport's holds for its life (-1:
        # read on every call; see check_counts).
        self._uneven_fixed = transport._uneven_bytes_fixed
        #: What a word on the fast path adds (FAST_BIT where the transport reads it).
        self.fast_bit = FAST_BIT if transport._marks_fast_path else 0
        #: Whether the default check of a stream-ordered call is posted beside it (see :meth:`post`).
        self.posts = transport._posts_checks and level == config.CHECKS_DEFAULT

    def forms(self) -> tuple[Callable[..., None], Callable[..., Any], Callable[[Request], bool]]:
        """What the call path calls for the default check: :meth:`check`, :meth:`carry` and
        :meth:`check_counts` (compiled, where this check is: see :func:`call_check`)."""
        return self.check, self.carry, self.check_counts

    def check(self, call: Call, reduce_op: ReduceOp | None, root: int, dtype: str | None,
              shape: tuple[int, ...], waiting: Callable[[], None] | None = None, fast: bool = False) -> None:
        """Before the running collective ``call`` moves any data: every rank makes the same
        call, else :class:`CollectiveMismatch` on every rank, nothing sent.

        By default one small all_reduce (the transport's ``_agree_word``) of a word that hashes
        the call's kind, reduce op, root, dtype, shape and sequence number (an uneven
        collective's dtype and shape are compared by its own counts exchange, which follows,
        or, where the transport carries counts with the word, by :meth:`check_counts`);
        the full fingerprints travel only when the words disagree, to name the ranks and the
        difference. In debug mode (``COLLECTIVES_DEBUG=1``), and on the first collective of
        every communicator (which also compares the ranks' checks levels), the full
        fingerprints always travel. Every rank makes the same exchanges as long as every rank
        makes the same calls: the ranks all see the same result, so all raise or none.
        ``waiting()`` (the monitored barrier's) is run once this rank waits for its peers;
        ``fast``: this rank runs the call on the transport's fast path (see wire.FAST_BIT)."""
        seq: int = self._comm._seq
        if call.counted:  # dtype and shape: the call's counts exchange compares them
            if self.carries and seq != 1:
                return  # its counts travel in its check's round (check_counts)
            dtype, shape = None, ()
        if self.level != _CHECKS_DEFAULT or seq == 1:
            if waiting is not None:
                waiting()
            self.compare_fingerprints(reduce_op, root, dtype, shape)
            if self.level == config.CHECKS_OFF:
                self._context.stop_checking()
            return
        h = self._call_hash(call, reduce_op, root, dtype, shape)
        # (the check word: wire.py's, the one place that says its format)
        reduced = self._transport._agree_word(check_word(h, seq) | (self.fast_bit if fast else 0), waiting)
        if not words_agree(reduced):
            self.disagreed(reduce_op, root, dtype, shape)

    def post(self, call: Call, reduce_op: ReduceOp | None, root: int, dtype: str | None,
             shape: tuple[int, ...], seq: int) -> None:
        """:meth:`check` of the running collective ``call``, ordered on a device stream, where
        the transport posts checks (:attr:`posts`): its word goes beside the call
        (``Transport._post_check``), compared with every rank's off the call path, so the host
        neither waits nor makes a collective of its own; a mismatch is raised at a later call or
        ``wait()`` on every rank, the transport's communicator aborted. The first collective
        and the uneven ones are checked before they move data, as :meth:`check` does. ``seq``:
        the call's number (the communicator's ``_seq``, which the call path has at hand)."""
        if seq == 1 or call.counted:
            self.check(call, reduce_op, root, dtype, shape)
            return
        shape = tuple(shape)
        h = self._call_hash(call, reduce_op, root, dtype, shape)
        post_to = self._transport._post_to
        if post_to is None:  # (the first: the transport starts posting)
            self._transport._post_check(check_word(h, seq), call.name, seq, reduce_op, root, dtype, shape)
            return
        kind = self._kept_kind  # (the kind _post_check makes, kept: see _kinds)
        if kind is None:
            key = (call, dtype, reduce_op, root, shape)
            kind = self._kinds.get(key)
            if kind is None:
                if len(self._kinds) >= MAX_CALL_HASHES:
                    self._kinds.clear()
                kind = self._kinds[key] = (call.name, reduce_op, root, dtype, shape, None)
            self._kept_kind = kind
        post_to((check_word(h, seq), seq, kind))  # (with no frame of the transport's)

    def carry(self, carry: Callable[[Any, Any, Any, Any, int], tuple[int, Any]], call: Call,
              reduce_op: ReduceOp | None, root: int, dtype: str, view: Any, out: Any, extra: Any,
              shape: Any) -> Any:
        """:meth:`check` of the running collective ``call`` on ``view`` (a fast path's host view of
        x), whose round carries ``view`` where the default check runs (the transport's carried
        path ``carry``, see ``Transport._carried_path``): the call's result, or NOT_TAKEN where
        the data did not travel (the call is checked; it runs as usual). ``shape``: view's shape
        where the call path has read it (a tensor's is made anew at each read), else None."""
        seq: int = self._comm._seq
        if shape is None:
            shape = view.shape
        if self.level != _CHECKS_DEFAULT or seq == 1:
            self.check(call, reduce_op, root, dtype, shape)
            return NOT_TAKEN
        h = self._call_hash(call, reduce_op, root, dtype, shape)
        reduced, result = carry(view, root, out, extra, check_word(h, seq))
        if not words_agree(reduced):
            self.disagreed(reduce_op, root, dtype, shape)
        return result

    def disagreed(self, reduce_op: ReduceOp | None, root: int, dtype: str | None, shape: tuple[int, ...]) -> None:
        """The check words differ: the fingerprints name how (CollectiveMismatch on every rank)."""
        self.compare_fingerprints(reduce_op, root, dtype, shape)
        raise CollectiveMismatch(  # (hash words differ only where fingerprints do)
            f"{self._context.call_name()}: the ranks' check words differ, but their "
            "fingerprints agree; is COLLECTIVES_DEBUG set the same on every rank?")

    def check_counts(self, r: Request) -> bool:
        """An uneven call's check and counts exchange in one small collective, where the
        transport carries counts with the check word (``_agree_counts``, the default check):
        ``r.extra`` becomes every rank's row counts (all_gather_v) or the splits ``splits[i][j]``
        (all_to_all), and where every rank's x travelled with it (host memory of at most the
        transport's ``_uneven_bytes``), ``r.carried`` every rank's x. The word hashes the call's
        kind, dtype, ``x.shape[1:]`` and sequence number; a rank in another call is
        :class:`CollectiveMismatch` on every rank. The same round with the check off
        (``COLLECTIVES_DEBUG=0``: the counts exchange the call makes anyway, its word compared for
        free). False where the call path's own counts exchange runs instead: the first call, debug
        mode, or ranks whose dtypes, trailing shapes or ``out`` rows disagree (its error on every
        rank says how)."""
        seq: int = self._comm._seq
        if not self.carries or seq == 1:
            return False
        call, out, view = r.call, r.out, r.view  # (view: the call path's host view of x, or None)
        shape = r.x.shape if view is None else view.shape  # (a tuple; a tensor's torch.Size, made per read, is one too)
        h = self._call_hash(call, None, -1, r.dtype, shape[1:])
        gathered = call is ALL_GATHER_V
        if gathered:
            row = [int(shape[0])]
        else:
            row = []
            for n in r.extra:  # (a loop, not a comprehension: the compiled form runs it in C)
                row.append(int(n))
        row.append(-1 if out is None else int(out.shape[0]))
        if view is not None:  # (x's bytes travel where they are few enough)
            limit = self._uneven_fixed
            if view.nbytes > (limit if limit >= 0 else self._transport._uneven_bytes):
                view = None
        reduced, rows, carried = self._transport._agree_counts(check_word(h, seq), row, view)
        if not words_agree(reduced):
            self.compare_fingerprints(None, -1, None, ())  # another call: the mismatch
            return False  # the same call, another dtype or x.shape[1:]: the exchange says which
        size = len(rows)
        total = 0
        if gathered:
            for got in rows:
                total += got[0]
            for rank in range(size):  # (the round's rows are new lists: each becomes its rank's count)
                got = rows[rank]
                outs = got[1]
                if outs != -1 and outs != total:
                    return False  # an out of the wrong rows
                rows[rank] = got[0]  # type: ignore[call-overload]
            r.extra, r.carried = rows, carried
            return True
        for rank in range(size):  # (loops, not generators: the compiled form runs them in C)
            outs = rows[rank][size]
            if outs != -1:
                total = 0
                for sent in rows:
                    total += sent[rank]
                if outs != total:
                    return False  # an out of the wrong rows
        for got in rows:  # (the round's rows are new lists: each loses its out rows, the splits stay)
            got.pop()
        r.extra, r.carried = rows, carried
        return True

    def _call_hash(self, call: Call, reduce_op: ReduceOp | None, root: int, dtype: str | None,
                   shape: tuple[int, ...]) -> int:
        """:func:`collectives.wire.call_hash` of a kind of call: the last one's as it was kept, else
        from :attr:`hashes`, else hashed and remembered there (all forgotten first where it holds
        :data:`MAX_CALL_HASHES`)."""
        if (call is self._kept_call and dtype is self._kept_dtype and reduce_op is self._kept_op
                and root == self._kept_root and shape == self._kept_shape):
            return self._kept_hash
        hashes = self.hashes
        key = (call, dtype, reduce_op, root, shape)
        h = hashes.get(key)
        if h is None:
            if len(hashes) >= MAX_CALL_HASHES:
                hashes.clear()
            h = hashes[key] = call_hash(call.name, reduce_op, root, dtype, tuple(shape))
        self._kept_call, self._kept_dtype, self._kept_op, self._kept_root, self._kept_shape = key
        self._kept_hash, self._kept_kind = h, None
        return h

    def refused(self, call: Call, x: Any, op: Any, root: Any, error: Exception, record: list[Any] | None) -> None:
        """The running collective ``call`` (its number taken, its ``record``), which this rank
        refused with ``error`` before sending anything: its check, as :meth:`check` makes it, with
        this rank's word :data:`~collectives.wire.REFUSED_WORD` (it never agrees) and its
        fingerprint marked refused (what is known of ``x``, ``op`` and ``root``), so that the peers
        that made the call raise :class:`CollectiveMismatch` naming this rank and ``error``.
        Returns once every rank has the verdict (the caller raises ``error``); the round's own
        failure (a timeout, a peer that left) marks ``record`` and is not raised either."""
        reduce_op, root, dtype, shape = refused_call(call, x, op, root)
        if self.posts and self._comm._seq != 1 and not call.counted and self._transport._stream_ordered(x):
            # (beside the peers' calls, as theirs are: see post)
            self._transport._post_check(REFUSED_WORD, call.name, self._comm._seq, reduce_op, root, dtype,
                                        shape, error)
            mark_failed(record, error)
            return
        try:
            if self.level == config.CHECKS_DEFAULT and self._comm._seq != 1:
                self._transport._agree_word(REFUSED_WORD)  # (as a rank in another call: never agrees)
            self.compare_fingerprints(reduce_op, root, dtype, shape, error)
        except Exception as failure:  # noqa: BLE001  (a timeout has made the communicator unusable)
            mark_failed(record, failure)
            return
        finally:
            if self.level == config.CHECKS_OFF:
                self._context.stop_checking()
        mark_failed(record, error)

    def compare_fingerprints(self, reduce_op: ReduceOp | None, root: int, dtype: str | None,
                             shape: tuple[int, ...], refused: Exception | None = None) -> None:
        """``CollectiveMismatch`` on every rank unless every rank makes the running call
        (``refused``: the error this rank refused it with, see :meth:`refuse`).

        One all_gather of a fixed-size int64 vector over the communicator's own transport; where
        some ranks refused the call and others did not, a second one of the refusing ranks'
        reasons (every rank sees the same fingerprints, so every rank makes it).
        """
        from .wire import fingerprint, mismatch, reason_vector, refusal_mismatch, refused_ranks  # noqa: PLC0415

        context = self._context
        operation, seq = context.call
        mine = fingerprint(operation, seq, reduce_op, root, dtype, tuple(shape), self.level, refused)
        everyone = self._exchange(mine)
        refusing = refused_ranks(everyone)
        found: CollectiveMismatch | None
        if refusing:
            if len(refusing) == len(everyone):
                return  # every rank refused it: each raises its own error
            reasons = self._exchange(reason_vector(refused))
            if refused is not None:
                return
            found = refusal_mismatch(everyone, reasons, context.comm)
        else:
            found = mismatch(everyone, context.comm)
        if found is not None:
            context.record_failed(seq, found)
            recorder.dump(f"CollectiveMismatch in {context.call_name()}")
            raise found

    def _exchange(self, vector: Any) -> Any:
        """Every rank's int64 ``vector``, through the context (a peer that left is heard)."""
        context = self._context
        try:
            return context.exchange_listening(vector)
        except CollectiveError:
            raise
        except Exception as error:
            raise context.transport_error(error) from error


def call_check_for(transport: Transport, context: CommunicatorContext, size: int) -> CallCheck:
    """The communicator's :class:`CallCheck` (see there), compiled where its compiled form was built
    from this source and collectives/wire.py's (``collectives._reliability_c``, which calls
    ``collectives._wire_c``'s check word in C) and ``COLLECTIVES_COMPILED`` leaves it on; a
    communicator keeps the form it was made with."""
    from . import wire  # noqa: PLC0415

    module = config.compiled_extension(f"{__package__}._reliability_c", sys.modules[__name__])
    if module is None or config.compiled_extension(f"{__package__}._wire_c", wire) is None:
        return CallCheck(transport, context, size)
    return module.CallCheck(transport, context, size)  # type: ignore[no-any-return]


class MonitoredBarrier:
    """The barrier under a timeout on rank ``rank`` of ``size``, over ``transport``, whose
    timeout on rank 0 names the ranks that never arrived.

    The barrier itself is the call's agreement (the check word's all_reduce: no rank completes
    it before every rank entered it), or with checks off the transport's barrier. A rank that
    finds it not complete at once (its peers are not all there yet) sends rank 0 one word, this
    barrier's sequence number, and waits on (kept in ``handles`` until sent); a barrier that
    every rank enters together costs nothing more. Rank 0 keeps a receive posted for every
    peer's words, and at a timeout the peers whose word of this barrier has not come are the
    ones that never arrived. Words of barriers that completed are taken now and then (every
    :data:`TAKE_EVERY` barriers, one peer at a time), so that they do not pile up at rank 0;
    older barriers' words are skipped. Where the barrier compares the ranks' fingerprints (debug
    mode, a communicator's first call) or the transport cannot tell when a rank waits
    (``_says_waiting``), every rank sends its word first, and rank 0 takes every peer's word of
    each barrier after it."""

    __slots__ = ("_transport", "_rank", "_size", "_handles", "_words", "_heard", "_seq", "_native", "_waiting",
                 "_lazy")

    def __init__(self, transport: Transport, rank: int, size: int, handles: KeptHandles,
                 call_check: CallCheck) -> None:
        self._transport, self._rank, self._size, self._handles = transport, rank, size, handles
        # Whether a barrier's words (but on a communicator's first call, which compares the
        # fingerprints) come only from the ranks that wait: the default check's agreement, or
        # with checks off (``_checking`` off after the first call) the transport's barrier.
        self._lazy = call_check.level != config.CHECKS_FULL and transport._says_waiting
        # Rank 0's posted receives of the peers' words: peer -> (handle, word).
        self._words: dict[int, tuple[Work, Any]] = {}
        # Rank 0: the latest barrier each peer's word came from (0: none yet).
        self._heard = [0] * size
        self._seq = 0  # the running barrier's number (its word)
        # Whether to ask the transport for its own (most have none: no call per barrier then).
        self._native = type(transport)._native_monitored_barrier is not Transport._native_monitored_barrier
        self._waiting = self._send_word if rank else None  # (bound once)

    def run(self, seconds: float, seq: int, synchronize: Callable[[Callable[[], None] | None], None],
            checked: bool = False) -> None:
        """Barrier number ``seq``: ``synchronize(waiting)`` (the barrier itself, under the
        deadline of ``seconds``; ``waiting()`` is run once this rank waits for its peers, or
        first where the transport cannot tell), with the words. ``checked``: whether
        ``synchronize`` is the check (a transport's own monitored barrier then runs it too, so
        that a barrier against another call is a mismatch on every rank, as everywhere)."""
        if self._native and self._transport._native_monitored_barrier(
                seconds, (lambda: synchronize(None)) if checked else None):
            return
        self._seq = seq
        if self._rank != 0:
            try:
                synchronize(self._waiting)
            except CollectiveTimeout as error:
                raise CollectiveTimeout(
                    f"{error} (rank 0 did not release the barrier: its CollectiveTimeout, or its "
                    "dump with COLLECTIVES_TRACE_DIR, names the ranks that never arrived)") from error
            return
        words = self._words
        if len(words) < self._size - 1:  # a receive for every peer's words (a taken one: again)
            for peer in range(1, self._size):
                if peer not in words:
                    self._post(peer)
        try:
            synchronize(None)
        except CollectiveTimeout as error:
            missing = [peer for peer in range(1, self._size) if self._take_words(peer, seq) < seq]
            if not missing:
                raise
            raise CollectiveTimeout(
                f"{error} (rank(s) {', '.join(map(str, missing))} never arrived at the barrier)"
            ) from error
        if not self._lazy or seq == 1:  # every peer sent its word first: take them (as they come)
            deadline = _clock() + seconds
            for peer in range(1, self._size):
                self._take_words(peer, seq, deadline)
        elif not seq % TAKE_EVERY:  # the words of barriers that completed: one peer's, in turn
            self._take_words(seq // TAKE_EVERY % (self._size - 1) + 1)

    def close(self) -> None:
        """Give up rank 0's posted receives (the communicator closes)."""
        for work, _ in self._words.values():
            work._cancel()
        self._words.clear()

    def _send_word(self) -> None:
        """A peer's word to rank 0: it entered the running barrier and waits."""
        import numpy as np  # noqa: PLC0415

        word = np.full(1, self._seq, np.int64)
        self._handles.keep_p2p(self._transport._send_small(word, 0, BARRIER_TAG))  # (kept till sent)

    def _post(self, peer: int) -> tuple[Work, Any]:
        import numpy as np  # noqa: PLC0415

        vector = np.zeros(1, np.int64)
        entry = self._words[peer] = (self._transport._recv_small(vector, peer, BARRIER_TAG), vector)
        return entry

    def _take_words(self, peer: int, seq: int = 0, deadline: float = 0.0) -> int:
        """Take the words ``peer`` sent that have come (one test each), or until ``deadline``
        barrier ``seq``'s (then its receive is posted again at the next barrier, not now); the
        latest barrier it sent a word of."""
        heard, words = self._heard, self._words
        while True:
            work, vector = words.get(peer) or self._post(peer)
            if not work.is_completed() and (heard[peer] >= seq or not poll_until(work.is_completed, deadline)):
                return heard[peer]
            work.wait()
            heard[peer] = max(heard[peer], int(vector[0]))
            del words[peer]
            if seq and heard[peer] >= seq:
                return heard[peer]


#: Rank 0 takes the words of barriers that completed every this many barriers (see MonitoredBarrier).
TAKE_EVERY = 8
