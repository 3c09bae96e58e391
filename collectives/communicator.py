"""The Communicator: the public interface and the one call path. Read this file first.

A :class:`Communicator` holds a :class:`~collectives.transport.Transport` (the backend: it
moves the data) and does everything else itself. Every public
collective hands its arguments to ONE call path, :meth:`Communicator._run`, driven by
the table of :mod:`collectives.calls` (one row per collective). That path checks every
argument first, through the rules of :mod:`collectives.ops` and the adapters of
:mod:`collectives.arrays`, so a bad call raises the same ``TypeError``/``ValueError``
on every backend, before anything is sent and with the input untouched. Backends only
ever see arguments that passed.

Reliability lives on that path too, once for every backend (see :mod:`collectives.wire`):
every collective gets a per-communicator sequence number; with ``COLLECTIVES_DEBUG=1``
the ranks compare a fingerprint of each call before it runs (``CollectiveMismatch``);
backends enforce ``timeout`` (``CollectiveTimeout``), after which the communicator
is unusable. Asynchronous handles (``async_op=True``) are kept by the communicator
until they complete, so a handle the caller drops still completes correctly (its
buffers stay alive), and ``close()`` completes them all.

Where a transport has no primitive for a collective, the default of
:class:`~collectives.transport.Transport` is a correct emulation (:mod:`collectives.emulations`)
from its other methods (``reduce`` from ``all_reduce``, ``gather`` from ``all_gather``, ...);
a transport overrides it with its own call where there is one.

The other rooms: :mod:`collectives.calls` (the table, one row per collective),
:mod:`collectives.checks` (the argument checks and the plans of the call path),
:mod:`collectives.work` (the asynchronous handle), :mod:`collectives.debug_p2p`
(point-to-point in debug mode), :mod:`collectives.reliability` (timeouts, fingerprints,
the monitored barrier, farewells). Imports: those modules and the transport protocol, never a
backend.
"""

from __future__ import annotations

import collections
import itertools
import sys
from _thread import get_ident as _thread_id
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from . import config, emulations, farewell
from .calls import (
    ALL_GATHER,
    ALL_GATHER_V,
    ALL_REDUCE,
    ALL_TO_ALL,
    ALL_TO_ALL_V,
    BARRIER,
    BROADCAST,
    GATHER,
    RECV,
    REDUCE,
    REDUCE_SCATTER,
    SCATTER,
    SEND,
    SPLIT,
    Call,
    is_int,
)
from .checks import ArgumentChecks, Plan
from .context import CommunicatorContext
from .debug_p2p import CheckedPointToPoint
from .diagnostics import process_hooks, recorder
from .diagnostics.recorder import END, POSTED, STARTED, STATE, CallRecord
from .errors import CollectiveError, RankFailure
from .fault_tolerance import FaultTolerance
from .ops import ReduceOp
from .reliability import _LIVE, Reliability
from .transport import Transport
from .work import MAX_PENDING, KeptHandles, Work, _reap, deliver  # noqa: F401  (MAX_PENDING: also here)

_C_INT_MAX = 2**31 - 1



_clock = recorder.clock
# Names of communicators in the split tree (see Communicator.trace_name): communicators made
# without a parent are numbered in the order this process made them; split() names its child.
_ROOTS = itertools.count()
_ORDER = itertools.count()


class Communicator(KeptHandles, Reliability, CheckedPointToPoint, ArgumentChecks, FaultTolerance):
    """A group of ranks that run collectives together.

    Attributes: ``rank`` (0 .. size-1 within this communicator), ``size``,
    ``local_rank`` (this process's rank on its node, used to pick a GPU) and
    ``backend`` (the backend's name: "local", "torch", "mpi" or "cupy").

    Arrays may be ``torch.Tensor`` (CPU or CUDA), ``numpy.ndarray`` or
    ``cupy.ndarray``, as far as the backend takes them; results have the input's
    type, device and dtype. Every rank must call the same collectives in the
    same order with the same dtype, shape, op and root. Non-contiguous inputs are
    handled through a contiguous copy (results are written back into ``x``).

    ``timeout`` is the seconds a blocking collective may take before it raises
    :class:`CollectiveTimeout` (``None``: no timeout); it comes from the
    constructor's ``timeout`` argument, else ``COLLECTIVES_TIMEOUT``, else 1800 s,
    and a ``split`` inherits it. ``debug`` is whether calls are fingerprinted
    (``COLLECTIVES_DEBUG=1``).

    Every collective (and ``barrier``) takes ``timeout=``: seconds (or a timedelta) for this
    call, overriding the communicator's ``timeout`` (0: none); bad values are the same errors
    as the constructor's. Every call is remembered by the flight recorder
    (:mod:`collectives.diagnostics.recorder`; ``register_hook``, ``dump_trace``).

    Every collective takes ``async_op=True``: it then returns a :class:`Work` whose
    ``wait()`` returns what the call would have returned. The collectives that return
    an array take ``out=``: an array of the result's type, dtype, device and shape
    (contiguous, writable) that the result is written into and returned.
    """

    #: The backend's transport class (a public subclass sets it: ``from_launcher`` builds one).
    transport_class: type[Transport] | None = None

    def __init__(self, transport: Transport, *, timeout: Any = None, name: str | None = None) -> None:
        """``transport``: the backend that moves the data (this communicator's only).
        ``timeout``: seconds (or a timedelta) per blocking call; ``None`` reads
        ``COLLECTIVES_TIMEOUT``; 0 means none. ``name``: its place in the split tree."""
        if not isinstance(transport, Transport):
            raise TypeError(f"transport must be a collectives.transport.Transport; got {type(transport).__name__}")
        self._transport = transport
        self.rank = transport.rank
        self.size = size = transport.size
        self.local_rank = transport.local_rank
        transport.attach(CommunicatorContext(self), config.timeout_seconds(timeout))
        # One rank has nobody to disagree with: checks cost nothing at size 1.
        level = config.check_level() if size > 1 else config.CHECKS_OFF
        checks_by_default = transport._checks_by_default
        if level == config.CHECKS_DEFAULT and not checks_by_default:
            level = config.CHECKS_OFF
        self._check_level = level
        # Debug mode (COLLECTIVES_DEBUG=1): full fingerprints, and headers ahead of send/recv.
        self.debug: bool = level == config.CHECKS_FULL
        # The first collective compares in full, COLLECTIVES_DEBUG=0 too (then no more).
        self._checking = size > 1 and (level != config.CHECKS_OFF or checks_by_default)
        self._call_hashes: dict[tuple[Any, ...], int] = {}
        self._barrier_words: dict[int, tuple[Work, Any]] = {}
        self._left: dict[int, tuple[int, int]] = {}
        self._abandoned_works: list[Work] = []
        self._farewell_said = False
        if size > 1:
            process_hooks.install_farewell()
        self._closed = False
        # Why the communicator cannot be used any more (after a timeout), else None.
        self._why_broken: str | None = None
        # Fault tolerance: the RankFailure this communicator raised, and its next generation.
        self._failure: RankFailure | None = None
        self._successor: Communicator | None = None
        # The running call, for error messages: its operation and sequence number.
        self._seq = 0
        self._operation = ""
        # Handles of asynchronous calls not known to be complete (see KeptHandles).
        self._pending: collections.deque[Work] = collections.deque()
        self._posted: collections.deque[list[Any] | None] = collections.deque()
        self._pending_p2p: collections.deque[Work] = collections.deque()
        # The thread that may call collectives on this communicator (see bind_thread).
        self._owner = _thread_id()
        # The call path's one test of closed, unusable and owner thread: the owner's id
        # while the communicator is open and usable, else None (see _check_open).
        self._gate: int | None = self._owner
        # The plans of the kinds of arrays that passed the checks (see _plan), and whether the
        # backend checks devices (else the call path skips _check_device).
        self._plans: dict[tuple[Any, ...], Plan] = {}
        self._checks_device = type(transport)._check_device is not Transport._check_device
        #: This communicator's place in the split tree, the same on every member: "world" (the
        #: one init() made), "comm<N>" (made directly), "<parent>/<k>:<color>" (the k-th split).
        self.trace_name = name or f"comm{next(_ROOTS)}"
        self._trace_order = next(_ORDER)
        self._trace_splits = 0
        # The flight recorder (collectives/recorder.py): the last calls, None when turned off.
        self._ring = recorder.new_ring(self)
        self._hooks: list[Callable[[CallRecord], Any]] = []
        if config.env_flag(config.PROFILE):
            from . import profile  # noqa: PLC0415

            profile.attach(self)
        _LIVE.add(self)

    @classmethod
    def from_launcher(cls, launch: Any, *, timeout: Any = None) -> Communicator:
        """The world communicator of ``cls``'s backend for a process started as ``launch``
        says (see :func:`collectives.init`); ``timeout`` as the constructor's."""
        if cls.transport_class is None:
            raise TypeError(f"{cls.__name__} names no transport_class; pass a Transport to Communicator()")
        comm: Communicator = cls._adopt(cls.transport_class.from_launcher(launch, timeout=timeout),
                                        timeout=timeout)
        return comm

    @classmethod
    def _adopt(cls, transport: Transport, *, timeout: Any = None, name: str | None = None) -> Any:
        """A communicator of this class around ``transport`` (made by ``from_launcher`` or a
        split), without the public constructor of a backend's class."""
        comm = cls.__new__(cls)
        Communicator.__init__(comm, transport, timeout=timeout, name=name)
        return comm

    @property
    def backend(self) -> str:
        """The backend's name ("local", "torch", "mpi", "cupy", ...)."""
        return self._transport.backend

    @property
    def timeout(self) -> float | None:
        """Seconds a blocking collective may take before :class:`CollectiveTimeout` (None: none)."""
        return self._transport.timeout

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self._transport.timeout = seconds

    # -- the public interface: every method hands its arguments to _run ------------------

    def all_reduce(self, x: Any, op: ReduceOp | str = "sum", *, async_op: bool = False,
                   timeout: Any = None) -> Any:
        """Reduce ``x`` elementwise over all ranks, in place; every rank gets the result.

        ``x`` keeps its shape and dtype. ``op`` must be allowed on ``x``'s dtype
        (see :data:`collectives.ops.ALLOWED_OPS`), else ``TypeError``. Returns
        ``x``, or with ``async_op=True`` a :class:`Work` whose ``wait()`` returns ``x``.
        """
        return self._run(ALL_REDUCE, x, op, -1, None, async_op, None, timeout)

    def broadcast(self, x: Any, src: int = 0, *, async_op: bool = False,
                  timeout: Any = None) -> Any:
        """Copy rank ``src``'s ``x`` into ``x`` on every rank, in place.

        ``x`` must have the same shape and dtype on every rank. ``src`` is a rank
        of this communicator (``0 <= src < size``), else ``ValueError``. Returns
        ``x``, or with ``async_op=True`` a :class:`Work` whose ``wait()`` returns ``x``.
        """
        return self._run(BROADCAST, x, None, src, None, async_op, None, timeout)

    def reduce(self, x: Any, op: ReduceOp | str = "sum", dst: int = 0, *,
               async_op: bool = False,
               timeout: Any = None) -> Any:
        """Reduce ``x`` elementwise over all ranks into ``x`` on rank ``dst``, in place.

        On the other ranks ``x`` is left untouched. ``op`` as for :meth:`all_reduce`.
        Returns ``x`` (or a :class:`Work` whose ``wait()`` returns ``x``).
        """
        return self._run(REDUCE, x, op, dst, None, async_op, None, timeout)

    def all_gather(self, x: Any, *, out: Any = None, async_op: bool = False,
                   timeout: Any = None) -> Any:
        """Gather every rank's ``x``: a new array of shape ``(size, *x.shape)``.

        Row ``r`` of the result is rank ``r``'s ``x``. ``x`` is not modified. With
        ``out=`` the rows are written into ``out`` (shape ``(size, *x.shape)``).
        """
        return self._run(ALL_GATHER, x, None, -1, out, async_op, None, timeout)

    def all_gather_v(self, x: Any, *, out: Any = None, async_op: bool = False,
                     timeout: Any = None) -> Any:
        """Gather arrays whose first dimension may differ between ranks.

        Returns ``(gathered, counts)``: every rank's ``x`` concatenated in rank order
        along dimension 0, and the list of each rank's ``x.shape[0]``. The other
        dimensions and the dtype must be the same on every rank, else ``ValueError``
        on every rank. ``out=`` (shape ``(sum(counts), *x.shape[1:])``) receives the
        concatenation. The counts travel first, in one small all_gather.
        """
        return self._run(ALL_GATHER_V, x, None, -1, out, async_op, None, timeout)

    def reduce_scatter(self, x: Any, op: ReduceOp | str = "sum", *, out: Any = None,
                       async_op: bool = False,
                       timeout: Any = None) -> Any:
        """Reduce ``x`` over all ranks and return this rank's block of rows.

        ``x.shape[0]`` must be divisible by ``size`` (else ``ValueError``); the
        result is a new array of shape ``(x.shape[0] // size, *x.shape[1:])``
        holding rows ``rank * n // size`` to ``(rank + 1) * n // size`` of the
        reduction. ``x`` is not modified.
        """
        return self._run(REDUCE_SCATTER, x, op, -1, out, async_op, None, timeout)

    def gather(self, x: Any, dst: int = 0, *, out: Any = None, async_op: bool = False,
               timeout: Any = None) -> Any:
        """Gather every rank's ``x`` on rank ``dst``: there a new ``(size, *x.shape)``
        array (row ``r`` is rank ``r``'s ``x``), ``None`` on the other ranks.

        ``out=`` is used on ``dst`` only (the other ranks may pass ``None``).
        """
        return self._run(GATHER, x, None, dst, out, async_op, None, timeout)

    def scatter(self, x: Any, src: int = 0, *, out: Any = None, async_op: bool = False,
                timeout: Any = None) -> Any:
        """Hand row ``r`` of rank ``src``'s ``x`` to rank ``r``.

        Every rank passes ``x`` of the same shape ``(size, *rest)`` and dtype (only
        ``src``'s content is read; ``x`` is never modified). Returns a new array of
        shape ``rest`` (or ``out``).
        """
        return self._run(SCATTER, x, None, src, out, async_op, None, timeout)

    def all_to_all(self, x: Any, send_splits: Sequence[int] | None = None, *, out: Any = None,
                   async_op: bool = False,
                   timeout: Any = None) -> Any:
        """Every rank sends a block of rows to every rank.

        Equal form (``send_splits=None``): ``x`` has shape ``(size, *rest)``; row ``j``
        goes to rank ``j``, and row ``j`` of the result is what rank ``j`` sent here.
        Uneven form: ``send_splits`` is a list of ``size`` ints that sum to
        ``x.shape[0]``; rows ``[sum(send_splits[:j]), sum(send_splits[:j+1]))`` go to
        rank ``j``; the result is the concatenation, in rank order, of what every rank
        sent here. The counts travel first, in one small all_gather (every rank learns
        every rank's splits, so a wrong ``out`` or a shape mismatch is an error on every
        rank).
        """
        if send_splits is None:
            return self._run(ALL_TO_ALL, x, None, -1, out, async_op, None, timeout)
        return self._run(ALL_TO_ALL_V, x, None, -1, out, async_op, send_splits, timeout)

    def send(self, x: Any, dst: int, *, tag: int = 0, async_op: bool = False,
             timeout: Any = None) -> Any:
        """Send ``x`` to rank ``dst`` (matched by a :meth:`recv` there with the same ``tag``).

        Returns ``None``, or with ``async_op=True`` a :class:`Work`; ``x`` must not be
        changed until that has completed.
        """
        return self._run(SEND, x, None, dst, None, async_op, tag, timeout)

    def recv(self, x: Any, src: int, *, tag: int = 0, async_op: bool = False,
             timeout: Any = None) -> Any:
        """Receive into ``x``, in place, what rank ``src`` sent with ``tag``; returns ``x``.

        ``x`` must have the shape and dtype of the sender's array (in debug mode a
        difference is :class:`CollectiveMismatch`; otherwise the transport's error).
        """
        return self._run(RECV, x, None, src, None, async_op, tag, timeout)

    # -- object collectives: pickled, through the calls above (collectives/objects.py) -----
    # Unpickling what another rank sent trusts it, as torch's and mpi4py's do.

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (any picklable object), on every rank (``src`` gets ``obj``)."""
        from . import objects  # noqa: PLC0415

        return objects.broadcast_object(self, obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, as a list in rank order, on every rank."""
        from . import objects  # noqa: PLC0415

        return objects.all_gather_object(self, obj)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` as a list in rank order on rank ``dst``; ``None`` elsewhere."""
        from . import objects  # noqa: PLC0415

        return objects.gather_object(self, obj, dst)

    def scatter_object(self, objs: Sequence[Any] | None, src: int = 0) -> Any:
        """Object ``r`` of rank ``src``'s ``objs`` (one per rank) on rank ``r``; the other
        ranks' ``objs`` is not read (pass ``None``)."""
        from . import objects  # noqa: PLC0415

        return objects.scatter_object(self, objs, src)

    def barrier(self, *, timeout: Any = None) -> None:
        """Block until every rank of this communicator has called ``barrier``.

        Under a timeout (the communicator's, or ``timeout=`` for this call) the
        :class:`CollectiveTimeout` on rank 0 names the ranks that never arrived: before the
        transport's barrier every rank sends rank 0 a word (tag 32767,
        ``collectives.calls.BARRIER_TAG``, which send/recv refuse). Without a timeout: the transport's barrier.
        """
        self._check_open()
        kept = self.timeout
        if timeout is not None:  # this call's (a timeout's message names it)
            self.timeout = config.timeout_seconds(timeout or 0)
        record = self._begin(BARRIER)
        try:
            if self.timeout is None or self.size == 1:
                self._synchronize()
            else:
                self._monitored_barrier(self.timeout)
        except Exception as error:
            self._raise_failed(record, error)
        finally:
            self.timeout = kept
        self._completed(record)

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """A new communicator over the ranks that passed the same ``color``.

        Collective over this communicator: every rank must call it. ``color`` is
        a non-negative int, or ``None`` to take part without joining any group
        (that rank gets ``None`` back). Ranks of the new communicator are ordered
        by ``key`` (default: this rank), ties broken by rank here.
        """
        self._check_open()
        for name, value in (("color", color), ("key", key)):
            if value is not None and (isinstance(value, bool) or not is_int(value)):
                raise TypeError(f"{name} must be an int or None; got {type(value).__name__}")
        if color is not None and int(color) < 0:
            raise ValueError(f"color must be >= 0 (or None to join no group); got {color}")
        # One range on every backend: MPI takes C ints (torch's int64 would allow more).
        if color is not None and int(color) > _C_INT_MAX:
            raise ValueError(f"color must be at most 2**31 - 1 = {_C_INT_MAX}; got {color}")
        if key is not None and not -_C_INT_MAX - 1 <= int(key) <= _C_INT_MAX:
            raise ValueError(f"key must be between -2**31 and 2**31 - 1; got {key}")
        record = self._begin(SPLIT)
        name = f"{self.trace_name}/{self._trace_splits}:{color}"
        self._trace_splits += 1
        try:
            if self._checking:  # colors and keys differ by design: only the call is compared
                self._check_call(SPLIT, None, -1, None, ())
            transport = self._transport._split(None if color is None else int(color),
                                               self.rank if key is None else int(key))
        except Exception as error:
            self._raise_failed(record, error)
        self._completed(record)
        if transport is None:
            return None
        child: Communicator = type(self)._adopt(transport, timeout=self._timeout_arg, name=name)
        return child

    def close(self) -> None:
        """Complete outstanding asynchronous calls, tell the peers this rank is done with the
        communicator (a peer still waiting in a call of it then raises at once, naming this
        rank), then release the transport's resources; the communicator can no longer be used."""
        if not self._closed:
            try:
                if not self._broken:
                    self._complete_pending()
            finally:
                self._say_farewell(farewell.FINISHED)
                self._closed, self._gate = True, None
                _LIVE.discard(self)
                self._transport._close()

    def bind_thread(self) -> None:
        """Make the calling thread the one this communicator takes calls from.

        A communicator takes calls from one thread: the one that created it, until
        another thread calls ``bind_thread()`` (hand it over only while no call of the
        old thread is running). A call from any other thread raises
        :class:`CollectiveError` before anything is sent, on that rank; backward passes
        run by torch's autograd engine on its own threads count as the owner's. Every
        rank must hand over the same way: a communicator per thread keeps the order
        of calls the same on every rank, which two threads sharing one cannot.
        """
        if self._closed or self._broken:
            self._check_open()
        self._owner = self._gate = _thread_id()

    @property
    def _broken(self) -> str | None:
        """Why the communicator cannot be used any more (after a timeout), else None."""
        return self._why_broken

    @_broken.setter
    def _broken(self, why: str | None) -> None:
        self._why_broken = why
        if why:
            self._gate = None

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ", closed" if self._closed else ", unusable" if self._broken else ""
        return (f"<{type(self).__name__} backend={self.backend} rank={self.rank} "
                f"size={self.size}{state}>")

    # -- the one call path ---------------------------------------------------------------

    def _run(self, call: Call, x: Any, op: Any, root: Any, out: Any, async_op: Any,
             extra: Any = None, timeout: Any = None) -> Any:
        """Check, number, fingerprint, record, run and map the errors of one call of
        ``call``'s kind.

        Everything before the backend's method is local: a bad argument raises on this
        rank with nothing sent and ``x`` untouched.
        """
        if self._gate != _thread_id():  # closed, unusable, or another thread
            self._check_open()
        if timeout is not None:
            return self._run_with_timeout(call, x, op, root, out, async_op, extra, timeout)
        if async_op is not False and async_op is not True:
            raise TypeError(f"async_op must be True or False; got {type(async_op).__name__}")
        try:  # a kind of x (type, dtype, and op) that passed the checks before: its plan
            check, fast, adapter, dtype, reduce_op, request, method = self._plans[call, type(x), x.dtype, op]
        except (KeyError, TypeError, AttributeError):  # a new kind: its full checks, its plan
            check, fast, adapter, dtype, reduce_op, request, method = self._plan(call, x, op)
        # What can differ between two arrays of one kind, checked on every call; the first
        # call of a kind runs the same route as the later ones (the backend's fast path too).
        view = check(x, call.in_place)
        if call.root is not None and (type(root) is not int or not 0 <= root < self.size):  # noqa: E721
            self._check_rank(root, call.root)  # (a bool is no rank)
        if call.check is not None:
            call.check(self, tuple(x.shape), extra, root)
        if out is not None:
            self._check_out(call, x, adapter, out, extra, root)
        if self._pending:
            self._reap()
        if call.collective:
            self._seq += 1
        self._operation = call.name
        ring = self._ring
        if ring is not None:  # the flight recorder (collectives/recorder.py); a call with an
            # end time and no error has completed (one STORE less on every call)
            # (the fast path's numpy view has x's shape as a plain tuple: a torch.Size costs more)
            record = [self._seq, call, dtype, (x if view is None else view).shape, root, STARTED,
                      _clock(), 0.0, None, None, reduce_op]
            ring.append(record)
        else:
            record = None
        try:
            if self._checking and call.collective:
                self._check_call(call, reduce_op, root, dtype, x.shape)
            if view is not None and not async_op and fast(view, root):
                result = x  # the backend's fast path ran it (see _fast_path)
            elif self.debug and not call.collective:
                result = self._checked_p2p(call, x, adapter, dtype, root, async_op, extra)
            else:  # the transport's method of the row, given the kind's record refilled (calls.Request)
                request.x, request.root, request.out, request.async_op, request.extra = x, root, out, async_op, extra
                if call.counted:  # the uneven rows: the counts exchange puts every rank's in extra
                    emulations.counted(self, request)
                result = method(request)
                request.x = request.out = None  # (the record keeps no array alive)
        except Exception as error:
            self._raise_failed(record, error)
        if record is not None:
            record[END] = _clock()
            if self._hooks:
                self._call_hooks(record)
        if async_op:
            if type(result) is not Work:  # a handle that may still be running: keep it
                if record is not None:  # (completed once the communicator learns it has)
                    record[STATE] = POSTED
                if call.collective:
                    self._keep(result, record)
                else:
                    self._pending_p2p.append(result)
                    _reap(self._pending_p2p)
            return result
        return x if call.in_place else result

    def _raise_failed(self, record: list[Any] | None, error: Exception) -> NoReturn:
        """Raise what ``error``, raised inside the call of ``record``, becomes (the record marked
        failed): our own errors as they are, the transport's through :meth:`_transport_error`."""
        self._failed(record, error)
        if isinstance(error, CollectiveError):
            # fault tolerance: our own timeout or a peer's farewell may mean a peer failed
            failure = None if isinstance(error, RankFailure) else self._rank_failure(error)
            if failure is not None:
                raise failure from error
            raise error
        raise self._transport_error(error) from error

    def _begin(self, call: Call) -> list[Any] | None:
        """Number (and record) a call that takes no array (barrier, split)."""
        if self._pending:
            self._reap()
        self._seq += 1
        self._operation = call.name
        if self._ring is None:
            return None
        record = [self._seq, call, None, None, -1, STARTED, _clock(), 0.0, None, None, None]
        self._ring.append(record)
        return record

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self!r} is closed; create a new communicator")
        if self._broken:
            raise self._rank_failure(None) or CollectiveError(self._broken)
        if self._owner != _thread_id() and not _in_backward_pass():
            import threading  # noqa: PLC0415  (only for the message)

            raise CollectiveError(
                f"{self!r} takes calls from one thread, the one that created it (or last "
                f"called bind_thread()); this call came from thread "
                f"{threading.current_thread().name!r}. Two threads on one communicator would "
                "mix up their calls between ranks: give each thread a communicator of its "
                "own (split() in the owning thread, then bind_thread() in the other)")


def _in_backward_pass() -> bool:
    """Whether this thread is running a backward pass of torch's autograd engine (which
    runs CUDA backward functions on threads of its own, for the thread that called
    ``backward()``)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch._C._current_graph_task_id() != -1


__all__ = ["Communicator", "Work", "CollectiveError", "deliver"]
# Also importable from here, where they used to live: MAX_PENDING and the rows of the table
# (ALL_REDUCE, BROADCAST, ...; defined in collectives.calls).
