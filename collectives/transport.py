"""What a backend implements: the Transport protocol, in one file.

A :class:`collectives.Communicator` HOLDS one :class:`Transport`: the communicator is the
public API and the call path (argument checks, sequence numbers, fingerprints, timeouts,
the flight recorder, hooks, kept handles); the transport moves the data and knows nothing
of that bookkeeping. A backend is a subclass of :class:`Transport` that implements the
abstract methods below (each collective the transport must have, ``_barrier``, ``_split``,
construction from the launcher) and may override the hooks with a default (the other
collectives default to correct emulations, :mod:`collectives.emulations`). Its public
class (``MPICommunicator``, ...) is a thin :class:`~collectives.Communicator` subclass that
builds the transport.

Each collective takes one :class:`~collectives.calls.Request` (the call's row, the array,
its adapter and dtype, the op, the root, ``out``, the async flag, the row's extra argument),
made by the call path only after every check passed: ``x`` is an array of a known kind,
``adapter`` is its :class:`~collectives.arrays.ArrayAdapter`, ``dtype`` its dtype name,
``op`` a :class:`~collectives.ReduceOp` allowed on that dtype, roots and peers are valid
ranks. What a transport may ask of the communicator that holds
it (the running call, its deadline's error, the peers that left) is its
:attr:`Transport.context`, a :class:`CallContext`; the communicator keeps
:attr:`Transport.timeout` up to date. docs/architecture.md has the picture and an example.

Imports: arrays, calls, emulations, ops, work (never the communicator).
"""

from __future__ import annotations

import abc
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import arrays, emulations
from .arrays import ArrayAdapter
from .calls import ALL_GATHER, ALL_REDUCE, RECV, SEND, Call, Request
from .ops import ReduceOp
from .work import Work

if TYPE_CHECKING:
    from .errors import RankFailure
    from .launcher import LaunchInfo


class CallContext(abc.ABC):
    """What a transport (and its handles) may ask of the communicator that holds it; the
    communicator gives its transport one (``transport.context``)."""

    @property
    @abc.abstractmethod
    def call(self) -> tuple[str, int]:
        """The running call: its operation and sequence number (a handle keeps it)."""

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The communicator's place in the split tree, the same on every member."""

    @property
    @abc.abstractmethod
    def broken(self) -> str | None:
        """Why the communicator is unusable (after a timeout or a lost peer), else None."""

    @abc.abstractmethod
    def call_name(self, call: tuple[str, int] | None = None) -> str:
        """The running call (or ``call``) as error messages name it."""

    @abc.abstractmethod
    def timeout_error(self, detail: str = "", call: tuple[str, int] | None = None) -> Exception:
        """The :class:`~collectives.CollectiveTimeout` to raise when the deadline of the running
        call (or ``call``) passed; the communicator becomes unusable."""

    @abc.abstractmethod
    def hear_farewells(self, call: tuple[str, int] | None = None) -> None:
        """Raise ``collectives.farewell.PeerLeft`` if a peer left before making the
        running call (or ``call``); a transport calls it while it waits."""

    @abc.abstractmethod
    def mark_broken(self, why: str) -> None:
        """Make the communicator unusable (every later call raises, saying ``why``): the
        transport failed in a way it cannot recover from."""

    @abc.abstractmethod
    def fail_later(self, error: Exception) -> None:
        """A failure the transport found off the call path (its watchdog thread, any thread):
        the communicator becomes unusable, and ``error`` is raised at its next call or handle
        ``wait()`` on this rank (and at every later one)."""

    @abc.abstractmethod
    def posted_mismatch(self, everyone: Any, reasons: Any, call: tuple[str, int]) -> Exception | None:
        """The :class:`~collectives.CollectiveMismatch` of call ``call`` (its operation and
        number), whose check went beside it (``Transport._post_check``), from every rank's
        fingerprint (``everyone``, rows of ``collectives.wire.fingerprint``) and reason
        (``reasons``, rows of ``collectives.wire.reason_vector``); its record marked failed
        and the flight recorder dumped. ``None`` where every rank refused the call (each raised
        its own error)."""

    @abc.abstractmethod
    def failure(self) -> Exception:
        """What a call or a handle's ``wait()`` on the unusable communicator raises: the failure
        given to :meth:`fail_later`, else a :class:`~collectives.CollectiveError` saying why."""

    @abc.abstractmethod
    def forget_plans(self) -> None:
        """Forget the plans of the kinds of arrays the communicator remembers (their fast
        paths and methods, which the transport bound): it is about to release what they hold
        (a process group that must die before the interpreter does). A later call of a kind
        plans it again."""

    @abc.abstractmethod
    def has_left(self, rank: int) -> bool:
        """Whether ``rank`` is known to have left the communicator."""

    @abc.abstractmethod
    def await_work(self, work: Work, seconds: float) -> None:
        """Wait for ``work`` (a call of the transport's own, before data moves) at most
        ``seconds``, listening for farewells; ``CollectiveTimeout`` past them."""

    @abc.abstractmethod
    def map_error(self, error: Exception) -> Exception:
        """What an exception the transport raised inside a call (or a handle's wait) becomes."""


class Transport(abc.ABC):
    """The methods a backend implements (the call path's side of the contract is
    :class:`CallContext`)."""

    #: The backend's name ("local", "torch", "mpi", "cupy"), as COLLECTIVES_BACKEND says it.
    backend: str = ""
    #: The seconds a blocking call may take (``None``: none): kept by the communicator (its
    #: ``timeout``, or a call's own ``timeout=`` while that call runs).
    timeout: float | None = None
    #: The communicator's side (set when a communicator takes the transport).
    context: CallContext

    def __init__(self, rank: int, size: int, local_rank: int) -> None:
        self.rank, self.size, self.local_rank = rank, size, local_rank

    def attach(self, context: CallContext, timeout: float | None) -> None:
        """Called once, by the communicator that holds this transport, before any call."""
        self.context, self.timeout = context, timeout

    @classmethod
    @abc.abstractmethod
    def from_launcher(cls, launch: LaunchInfo, *, timeout: Any = None) -> Transport:
        """The world transport of this backend for a process started as ``launch`` says;
        ``timeout`` as the communicator's (``None``: ``COLLECTIVES_TIMEOUT``, 0: none), for
        transports that enforce it themselves.

        Raises :class:`~collectives.BackendUnavailable` with the reason when the backend cannot
        run under that launcher or its transport is missing.
        """

    # Each collective takes the call's one Request (collectives.calls.Request): ``r.x`` the
    # array, ``r.adapter`` its adapter, ``r.dtype`` its dtype name, ``r.op`` the reduce op,
    # ``r.root`` the root or peer, ``r.out`` the array for the result (or None), ``r.async_op``,
    # ``r.extra`` the row's extra argument. "A Work when async_op": a handle whose ``wait()``
    # returns what the blocking call returns.

    @abc.abstractmethod
    def _all_reduce(self, r: Request) -> Work | None:
        """Reduce ``r.x`` (any shape) over the ranks with ``r.op``, in place; a Work when
        ``r.async_op``."""

    @abc.abstractmethod
    def _broadcast(self, r: Request) -> Work | None:
        """Copy rank ``r.root``'s ``r.x`` into every rank's ``r.x`` (same shape everywhere), in
        place; a Work when ``r.async_op``."""

    @abc.abstractmethod
    def _all_gather(self, r: Request) -> Any:
        """Return every rank's ``r.x`` stacked, a new ``(size, *x.shape)`` array (``r.out`` when
        given, its shape checked); ``r.x`` untouched. A Work when ``r.async_op``."""

    @abc.abstractmethod
    def _reduce_scatter(self, r: Request) -> Any:
        """Return this rank's block of ``x.shape[0] // size`` rows of ``r.x`` reduced with
        ``r.op`` over the ranks (``x.shape[0]`` divisible by size, checked), a new array or
        ``r.out``; ``r.x`` untouched. A Work when ``r.async_op``."""

    @abc.abstractmethod
    def _send(self, r: Request) -> Work | None:
        """Send ``r.x`` to rank ``r.root`` (another rank) with tag ``r.extra``; ``r.x``
        untouched. A Work when ``r.async_op``."""

    @abc.abstractmethod
    def _recv(self, r: Request) -> Work | None:
        """Receive into ``r.x`` (in place, the sender's shape and dtype) from rank ``r.root``
        with tag ``r.extra``; a Work when ``r.async_op``."""

    # -- collectives a transport may lack: correct emulations from the methods above
    # -- (collectives/emulations.py), overridden where the transport has the call -----------

    def _reduce(self, r: Request) -> Work | None:
        """Reduce into ``r.x`` in place on rank ``r.root`` with ``r.op``; the other ranks'
        ``r.x`` untouched. A Work when ``r.async_op``. Default: all_reduce of a copy."""
        return emulations.reduce(self, r)

    def _gather(self, r: Request) -> Any:
        """``(size, *x.shape)`` on rank ``r.root`` (``r.out`` there when given), ``None``
        elsewhere; ``r.x`` untouched. A Work when ``r.async_op``. Default: all_gather."""
        return emulations.gather(self, r)

    def _scatter(self, r: Request) -> Any:
        """Row ``rank`` of rank ``r.root``'s ``(size, *rest)`` ``r.x``, a new ``rest`` array (or
        ``r.out``); ``r.x`` untouched. A Work when ``r.async_op``. Default: broadcast of a copy."""
        return emulations.scatter(self, r)

    def _all_to_all(self, r: Request) -> Any:
        """Row ``j`` of the new ``x.shape`` result (or ``r.out``) is rank ``j``'s row ``rank`` of
        its ``(size, ...)`` ``r.x``; ``r.x`` untouched. A Work when ``r.async_op``. Default:
        all_gather."""
        return emulations.all_to_all(self, r)

    def _all_gather_v(self, r: Request) -> Any:
        """``(concatenation, counts)``: every rank's ``r.x`` (``counts[i]`` rows from rank ``i``,
        ``counts = r.extra``, agreed by the call path's counts exchange) along dimension 0, a new
        array or ``r.out``; ``r.x`` untouched. A Work when ``r.async_op``. Default: all_gather
        of x padded to the most rows."""
        return emulations.all_gather_v(self, r)

    def _all_to_all_v(self, r: Request) -> Any:
        """Uneven all_to_all; ``splits[i][j]`` (``splits = r.extra``, agreed by the counts
        exchange) is how many rows rank ``i`` sends to rank ``j``; the result (new, or
        ``r.out``) is what every rank sent here, in rank order; ``r.x`` untouched. A Work when
        ``r.async_op``. Default: all_gather_v, each rank keeping the rows addressed to it."""
        return emulations.all_to_all_v(self, r)

    @abc.abstractmethod
    def _barrier(self) -> None:
        """Return once every rank has entered the barrier."""

    @abc.abstractmethod
    def _split(self, color: int | None, key: int) -> Transport | None:
        """Collective: the transport of the ranks that passed ``color`` (a non-negative int),
        ranked by ``key`` then by rank here; ``None`` for a ``None`` color. Transports without
        a native split use :meth:`_split_groups`."""

    def _close(self) -> None:
        """Release transport resources (called once)."""

    def _split_groups(self, color: int | None, key: int) -> list[int] | None:
        """Every rank's group for ``_split``, through one :meth:`_exchange_small` of (color, key):
        this rank's group as ranks of this transport in the new order, ``None`` when ``color``
        is ``None``. For transports without a native split."""
        import numpy as np  # noqa: PLC0415

        mine = np.array([-1 if color is None else color, key], dtype=np.int64)
        everyone = self._exchange_small(mine)
        if color is None:
            return None
        members = [r for r in range(self.size) if everyone[r, 0] == color]
        return sorted(members, key=lambda r: (int(everyone[r, 1]), r))

    # -- hooks with a default ------------------------------------------------------------

    def _check_device(self, x: Any, adapter: ArrayAdapter) -> None:
        """``TypeError``/``ValueError`` if this backend cannot take ``x`` (device, kind)."""

    #: Whether :meth:`_check_device` must see every array (two arrays of one kind may lie on
    #: different devices); False where its verdict depends on the kind of array alone: then the
    #: first call of each kind makes it, and later ones skip it.
    _check_device_per_array: bool = True

    def _array_check(self, adapter: ArrayAdapter) -> Callable[[Any, bool], Any] | None:
        """For backends whose fast paths take the array itself rather than its host view: the
        per-array check ``(x, in_place)`` of a kind of ``adapter``'s arrays that has a fast
        path. It makes ``adapter.check_array``'s checks (raising its errors; and
        :meth:`_check_device`'s where ``_check_device_per_array``) and returns what the fast path
        and the kind's method (:meth:`_method_of`, as ``Request.view``) then take, or ``None``
        (x is taken by the row's method as usual). ``None``: ``adapter.host_view``, a numpy view
        of the memory of a C-contiguous host array."""
        return None

    def _method_of(self, call: Call, adapter: ArrayAdapter, dtype: str,
                   reduce_op: ReduceOp | None) -> Callable[[Request], Any]:
        """The method that runs the calls of this kind (row, adapter, dtype, op) that do not take
        the fast path (asynchronous ones, an array the fast path does not take, the uneven rows):
        the row's method (:attr:`~collectives.calls.Call.method`) unless the backend binds one of
        its own for the kind once (its constants made then), which gives a call it does not take
        to the row's method. Called once per kind, after the kind's first checks passed."""
        return getattr(self, call.method)  # type: ignore[no-any-return]

    def _fast_path(self, call: Call, adapter: ArrayAdapter, dtype: str,
                   reduce_op: ReduceOp | None) -> Callable[[Any, Any, Any, Any], Any] | None:
        """For backends: a callable ``(view, root, out, extra)`` that runs the call ``call``
        (a collective of even shapes, send or recv: not the uneven rows) on ``view``, the
        C-contiguous numpy array of a host ``x`` of this kind (``adapter.host_view``; or what
        the backend's :meth:`_array_check` returned),
        blocking, and returns the call's result (an in-place call's is ignored: ``x`` is
        returned), or :data:`collectives.calls.NOT_TAKEN` when it cannot take that array (the
        transport's method of the row then does). ``root`` is the root or peer, ``out`` the
        caller's ``out=`` (checked) or ``None``, ``extra`` the row's extra argument (send and
        recv: the tag); a new result is of ``x``'s kind (a tensor for a tensor's view).
        ``None``: no fast path for this kind. Called once per kind, after every check of the
        call path has passed; the fast path runs after the checks, the sequence number and the
        fingerprint of each call."""
        return None

    def _carried_path(self, call: Call, adapter: ArrayAdapter, dtype: str,
                      reduce_op: ReduceOp | None) -> Callable[[Any, Any, Any, Any, int], tuple[int, Any]] | None:
        """For backends whose check's round can carry a small call's data (MPI's): a callable
        ``(view, root, out, extra, word)`` that makes the default check's round of ``word``, with
        ``view`` (as the fast path's) in it where it holds at most :attr:`_carry_bytes`, and
        returns the check's reduced word and the call's result, or
        :data:`collectives.calls.NOT_TAKEN` where the round did not carry it (the call then runs
        as usual, its check made). The call path hands it every call on the fast path. ``None``:
        none for this kind. See backends/mpi_carried.py."""
        return None

    #: The bytes of ``x`` that :meth:`_carried_path`'s round carries at most.
    _carry_bytes: int = 0
    #: The bytes of an uneven call's host ``x`` that :meth:`_agree_counts` takes as ``view`` at
    #: most (at least :attr:`_carry_bytes`; past it, x does not travel: its word is marked).
    _uneven_bytes: int = 0
    #: :attr:`_uneven_bytes` where it holds for the transport's life (the check reads it once,
    #: when the communicator is made), else -1 (read on every uneven call).
    _uneven_bytes_fixed: int = -1

    #: Whether the default check's words mark the ranks on the fast path (``wire.FAST_BIT``):
    #: :meth:`_agree_word` then gets words with bit 63 set, and may learn that every rank runs
    #: the call on its fast path.
    _marks_fast_path: bool = False

    def _exchange_small(self, vector: Any) -> Any:
        """Every rank's small int64 numpy ``vector`` (same length everywhere), as a numpy
        ``(size, len)`` array: the fingerprints of debug mode and the counts of the uneven
        collectives travel this way. Backends whose transport takes no host memory
        override it (the vector goes through device memory)."""
        return self._all_gather(Request(ALL_GATHER, vector, arrays.NUMPY, "int64"))

    #: Whether the default check (``COLLECTIVES_DEBUG`` unset) runs on this transport. A
    #: transport whose :meth:`_agree_word` would synchronize a device stream on every call
    #: sets it False: there only ``COLLECTIVES_DEBUG=1`` checks.
    _checks_by_default: bool = True

    #: Whether the default check of a stream-ordered call (:meth:`_stream_ordered`) goes beside
    #: the call instead of before it: its word goes to :meth:`_post_check`, and the transport
    #: compares the ranks' words off the call path (a mismatch then raises at a later call or
    #: wait: ``CallContext.fail_later``). The first collective of a communicator is checked
    #: before it moves data all the same.
    _posts_checks: bool = False

    #: Whether every call of this transport is stream-ordered (:meth:`_stream_ordered` is true of
    #: every x): the call path then does not ask it per call.
    _all_stream_ordered: bool = False

    def _stream_ordered(self, x: Any) -> bool:
        """Whether a call on ``x`` is ordered on a device stream and returns once enqueued (a
        CUDA array on NCCL): then, where :attr:`_posts_checks`, its check is posted."""
        return False

    #: Once the transport posts checks (its first :meth:`_post_check` started them), the call that
    #: takes a posted check, ``(word, seq, kind)`` with ``kind`` the tuple ``(operation, reduce_op,
    #: root, dtype, shape, refused)`` that :meth:`_post_check` makes (the call path keeps one per
    #: kind of call: nothing it posts is made per call and outlives it), with no frame of the
    #: transport's (the queue's extend); ``None`` before and once stopped.
    _post_to: Callable[[tuple[Any, ...]], None] | None = None

    def _post_check(self, word: int, operation: str, seq: int, reduce_op: ReduceOp | None,
                    root: int, dtype: str | None, shape: tuple[int, ...],
                    refused: Exception | None = None) -> None:
        """Post the default check of the running stream-ordered collective: its
        :func:`~collectives.wire.check_word` and what its fingerprint says (``refused``: the
        error this rank refused the call with, its word then ``wire.REFUSED_WORD``), compared
        with every rank's in call order off the call path (where :attr:`_posts_checks`). Must
        not wait."""
        raise NotImplementedError(f"{type(self).__name__} posts no checks")

    #: Whether :meth:`_agree_word` and :meth:`_barrier_waiting` run their ``waiting`` only once
    #: this rank waits (else first).
    _says_waiting: bool = False

    def _barrier_waiting(self, waiting: Callable[[], None]) -> None:
        """:meth:`_barrier`, running ``waiting()`` (the monitored barrier's word to rank 0) once
        this rank waits for its peers; a transport that cannot tell runs it first."""
        waiting()
        self._barrier()

    def _agree_word(self, word: int, waiting: Callable[[], None] | None = None) -> int:
        """The bitwise AND (BAND) over every rank of one int64 ``word`` each: the default check's
        one small collective (:func:`collectives.wire.check_word`; non-negative, but for
        ``wire.FAST_BIT`` where the transport has ``_marks_fast_path``). Backends
        override it with the cheapest call their transport has for it. ``waiting()`` (the
        monitored barrier's word to rank 0) runs once, when the peers' words have not all come
        at once; a transport that cannot tell runs it first."""
        import numpy as np  # noqa: PLC0415

        if waiting is not None:
            waiting()

        vector = np.array([word], dtype=np.int64)
        self._all_reduce(Request(ALL_REDUCE, vector, arrays.NUMPY, "int64", ReduceOp.BAND))
        return int(vector[0])

    #: Whether :meth:`_agree_counts` carries an uneven collective's counts with the check word.
    _counts_with_check: bool = False

    def _agree_counts(self, word: int, row: list[int], view: Any = None) -> tuple[int, list[list[int]], Any]:
        """:meth:`_agree_word`'s result, every rank's ``row`` (at most ``size + 1`` ints) in
        rank order (new lists: the caller's to keep or change), from the same one small
        collective, where ``_counts_with_check`` (the default check of an uneven collective: its
        counts travel in the check's round), and where every rank gave a ``view`` (x's host
        view, at most :attr:`_uneven_bytes`, or None) every rank's x as bytes (see
        ``Request.carried``; a view past :attr:`_carry_bytes` does not travel, the rows say whose
        did), else None. Every call's check word must then travel
        in the same collective, so that a rank in another call meets it."""
        raise NotImplementedError(f"{type(self).__name__} carries no counts with its check word")

    def _tell_peers_left(self, how: int) -> None:
        """Leave a farewell with every peer: this rank made ``self.context.call[1]`` collectives on this
        communicator and is done with it (``how``: :data:`collectives.farewell.FINISHED` or
        ``FAILED``). Must not wait for the peers. Default: the transport cannot tell them (a
        call left without a partner then waits for its timeout)."""

    def _peers_left(self) -> list[tuple[int, int, int]]:
        """The farewells received since the last look, as ``(rank, calls, how)``; must not
        block. Default: none."""
        return []

    def _start_exchange_small(self, vector: Any) -> Work | None:
        """:meth:`_exchange_small` started, as a handle whose ``wait()`` returns every rank's
        vector (the call path polls it, looking for farewells while it waits); ``None`` where
        the transport only has the blocking form (then :meth:`_exchange_small` runs)."""
        if type(self)._exchange_small is not Transport._exchange_small:
            return None  # a transport of its own for small vectors (device memory)
        work: Work = self._all_gather(Request(ALL_GATHER, vector, arrays.NUMPY, "int64", async_op=True))
        return work

    def _send_small(self, vector: Any, dst: int, tag: int) -> Work:
        """Send a small int64 numpy vector to ``dst``, nonblocking (the debug-mode header of a
        send). Backends whose transport takes no host memory override it and
        :meth:`_recv_small`."""
        return self._send(Request(SEND, vector, arrays.NUMPY, "int64", root=dst, async_op=True,
                                  extra=tag)) or Work(vector)

    def _recv_small(self, vector: Any, src: int | None, tag: int) -> Work:
        """Receive into a small int64 numpy vector from ``src`` (``None``: any source), nonblocking."""
        return self._recv(Request(RECV, vector, arrays.NUMPY, "int64", root=src,  # type: ignore[arg-type]
                                  async_op=True, extra=tag)) or Work(vector)  # (None: see Request.root)

    def _scratch_bytes(self, x: Any, adapter: ArrayAdapter, nbytes: int) -> Any:
        """``nbytes`` of uninitialized uint8 memory of x's kind and device (where a debug-mode
        recv whose header disagreed takes the payload)."""
        memory = adapter.empty(x, (nbytes,))
        if adapter is arrays.TORCH:
            return memory.view(sys.modules["torch"].uint8)[:nbytes]
        return memory.view("uint8")[:nbytes]

    def _map_error(self, error: Exception) -> Exception | None:
        """What an exception the transport raised inside a call means, where the backend
        knows better than the default (a :class:`CollectiveError` naming the call): its
        transport's timeout as ``context.timeout_error()``'s :class:`CollectiveTimeout`, a peer
        that died. ``None``: the default. Never called for ``TypeError``/``ValueError``."""
        return None

    #: Whether :meth:`_recv` takes a request whose ``root`` is ``None`` (a recv from any source,
    #: the handle's ``source`` set to the sender); where not, the call path refuses ``src=None``
    #: before anything is sent.
    _recv_any_source: bool = False

    def _native_monitored_barrier(self, seconds: float, check: Callable[[], None] | None = None) -> bool:
        """The barrier under a timeout of ``seconds``, where the transport has one that names
        the ranks that never arrived (``True``: done); ``False`` (the default): the call
        path's own (a word from every rank to rank 0 ahead of the barrier). ``check``: where
        checks are on, the call's check, which is then the barrier (a barrier against another
        call raises its mismatch on every rank)."""
        return False

    # -- fault tolerance (collectives.init(fault_tolerant=True)): hooks that a transport able
    # -- to go on after a peer's death overrides (backends/torch_elastic.py, backends/mpi_ulfm.py);
    # -- the defaults refuse, naming what works (collectives/elastic/support.py) -------------

    #: 0 for a transport made by ``from_launcher``; one more after each shrink or join (a
    #: fault-tolerant transport's ``_split`` has its parent's).
    generation: int = 0

    def _rank_failure(self, error: Exception | None) -> RankFailure | None:
        """The :class:`~collectives.RankFailure` that ``error`` (raised inside a call) means: a
        peer died or hung, and the communicator can go on without it; ``None`` (the default):
        ``error`` means what it says. ``error=None`` asks what an earlier failure means for the
        next call (a fresh RankFailure, or ``None``)."""
        return None

    def _shrink(self) -> Transport:
        """The transport of the survivors, a generation later (see ``Communicator.shrink``)."""
        from .elastic.support import refuse  # noqa: PLC0415

        raise refuse(self.backend, "shrink()")

    def _agree(self, flag: bool) -> bool:
        """The AND of ``flag`` over the ranks still alive (see ``Communicator.agree``)."""
        from .elastic.support import refuse  # noqa: PLC0415

        raise refuse(self.backend, "agree()")

    def _joiners_registered(self) -> int | None:
        """How many replacements have asked to join so far, as this rank sees it (local);
        ``None`` (the default): the transport takes none, and ``admit`` communicates nothing."""
        return None

    def _admit(self, registered: int) -> Transport | None:
        """The next generation with the replacements waiting to join, ``registered`` being the
        most :meth:`_joiners_registered` of any rank (agreed through the call path first);
        ``None`` when none waits (the default). Collective."""
        return None
