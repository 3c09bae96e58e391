"""The Communicator: the public interface and the one call path. Read this file first.

A :class:`Communicator` holds a :class:`~collectives.transport.Transport` (the backend: it moves
the data). Every public collective hands its arguments to ONE call path, :meth:`Communicator._run`
(:meth:`collectives.callpath.CallPath._run`), driven by the table of :mod:`collectives.calls` (one row per
collective): it checks every argument
first (the same ``TypeError``/``ValueError`` on every backend, before any data is sent, the input
untouched; a refused call still takes part in its check), numbers the call, checks that every rank
makes it, records it, runs it on the transport and maps its errors; a timeout leaves the
communicator unusable. Asynchronous handles are kept until they complete.

The communicator has no base class: it HOLDS its parts, each with its own state: kept handles
(:mod:`collectives.work`), argument checks (:mod:`collectives.checks`), the context its transport
sees, which owns timeouts and what errors become (:mod:`collectives.context`), the same-call
check and the monitored barrier (:mod:`collectives.reliability`), farewells
(:mod:`collectives.farewell`), debug-mode send/recv (:mod:`collectives.debug_p2p`) and fault
tolerance (:mod:`collectives.fault_tolerance`). Imports: those, the table of
:mod:`collectives.calls` and the transport protocol, never a backend.
"""

from __future__ import annotations

import collections
import itertools
from _thread import get_ident as _thread_id
from collections.abc import Callable, Sequence
from typing import Any

from . import config, farewell, front, objects
from .callpath import Collectives
from .calls import BARRIER, SPLIT, Call
from .checks import ArgumentChecks, check_split, in_backward_pass, wrong_thread
from .context import CommunicatorContext
from .debug_p2p import CheckedPointToPoint
from .diagnostics import process_hooks, recorder
from .diagnostics.recorder import END, STARTED, CallRecord, HookHandle
from .errors import CollectiveError
from .fault_tolerance import FaultTolerance, check_flag
from .reliability import MonitoredBarrier, call_check_for
from .transport import Transport
from .work import MAX_PENDING, KeptHandles, Work, deliver  # noqa: F401  (MAX_PENDING: also here)

_LIVE = farewell.LIVE
_clock = recorder.clock
# Names of communicators in the split tree (see Communicator.trace_name): communicators made
# without a parent are numbered in the order this process made them; split() names its child.
_ROOTS = itertools.count()
_ORDER = itertools.count()


class Communicator(Collectives):
    """A group of ranks that run collectives together.

    Attributes: ``rank`` (0 .. size-1 within this communicator), ``size``, ``local_rank`` (this
    process's rank on its node, used to pick a GPU) and ``backend`` (the backend's name: "local",
    "torch", "mpi" or "cupy").

    Arrays may be ``torch.Tensor`` (CPU or CUDA), ``numpy.ndarray`` or ``cupy.ndarray``, as far as
    the backend takes them; results have the input's type, device and dtype. Every rank must call
    the same collectives in the same order with the same dtype, shape, op and root. Non-contiguous
    inputs are handled through a contiguous copy (results are written back into ``x``).

    ``timeout`` is the seconds a blocking collective may take before it raises
    :class:`CollectiveTimeout` (``None``: no timeout); it comes from the constructor's ``timeout``
    argument, else ``COLLECTIVES_TIMEOUT``, else 1800 s, and a ``split`` inherits it. ``debug`` is
    whether calls are fingerprinted (``COLLECTIVES_DEBUG=1``).

    Every collective (and ``barrier``) takes ``timeout=``: seconds (or a timedelta) for this call,
    overriding the communicator's ``timeout`` (0: none); bad values are the same errors as the
    constructor's. Every call is remembered by the flight recorder
    (:mod:`collectives.diagnostics.recorder`; ``register_hook``, ``dump_trace``).

    Every collective takes ``async_op=True``: it then returns a :class:`Work` whose ``wait()``
    returns what the call would have returned. The collectives that return an array take
    ``out=``: an array of the result's type, dtype, device and shape (contiguous, writable) that
    the result is written into and returned.
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
        self.rank, self.size, self.local_rank = rank, size, _ = transport.rank, transport.size, transport.local_rank
        # The parts, each with its own state (see the module's text).
        self._handles = handles = KeptHandles()
        self._checks = checks = ArgumentChecks(transport, size)
        self._fault = FaultTolerance(self, transport)
        self._farewells = farewells = farewell.Farewells(transport, size)
        self._context = context = CommunicatorContext(self, transport, farewells)
        transport.attach(context, config.timeout_seconds(timeout))
        self._call_check = call_check = call_check_for(transport, context, size)
        self._p2p = CheckedPointToPoint(transport, handles, self)
        self._monitored = MonitoredBarrier(transport, rank, size, handles, call_check)
        # The call path's shortcuts into its parts (one attribute read each).
        self._pending, self._reap, self._keep = handles.pending, handles.reap, handles.keep
        self._plans = checks.plans
        # (_check_counts: the call path calls it before emulations.counted)
        self._check_call, self._carry_call, self._check_counts = call_check.forms()
        # What an error raised inside a call becomes (the context's: see raise_failed).
        self._raise_failed = context.raise_failed
        # Debug mode (COLLECTIVES_DEBUG=1): full fingerprints, and headers ahead of send/recv.
        self.debug = checks.debug = call_check.level == config.CHECKS_FULL
        # Whether the check of a call on a device stream goes beside it (CallCheck.post).
        self._posting, self._stream_ordered, self._post_call = call_check.posts, transport._stream_ordered, \
            call_check.post
        if size > 1:
            process_hooks.install_farewell()
        self._closed = False
        self._why_broken: str | None = None  # why it cannot be used any more (a timeout), else None
        # What its next call raises when a transport's watchdog found the failure (fail_later).
        self._failure: Exception | None = None
        self._seq = 0  # the running call's number (its operation: _operation, kept by the call path)
        self._owner = _thread_id()  # the thread that may call collectives on it (see bind_thread)
        #: This communicator's place in the split tree, the same on every member: "world" (the
        #: one init() made), "comm<N>" (made directly), "<parent>/<k>:<color>" (the k-th split).
        self.trace_name = name or f"comm{next(_ROOTS)}"
        self._trace_order = next(_ORDER)
        self._trace_splits = 0
        self._hooks: list[Callable[[CallRecord], Any]] = []
        # The call path (collectives/callpath.py), compiled where it was built (collectives/front.py),
        # and this instance's _run. It holds the state the call path reads on every call: the gate
        # (the call path's one test of closed, unusable and owner thread: the owner's id while the
        # communicator is open and usable, else None; see _check_open), whether the default check
        # runs (turned off after the first call at COLLECTIVES_DEBUG=0) and the flight recorder's
        # ring (collectives/diagnostics/recorder.py: the last calls, None when turned off); and the
        # running call's operation (_operation).
        self._path = front.install(self, Communicator, self._owner, call_check.first_checked,
                                   recorder.new_ring(self))
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
        return cls._adopt(cls.transport_class.from_launcher(launch, timeout=timeout), timeout=timeout)

    @classmethod
    def _adopt(cls, transport: Transport, *, timeout: Any = None, name: str | None = None) -> Communicator:
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

    # -- object collectives: pickled, through the calls above (collectives/objects.py) -----
    # Unpickling what another rank sent trusts it, as torch's and mpi4py's do.

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` (any picklable object), on every rank (``src`` gets ``obj``)."""
        return objects.broadcast_object(self, obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, as a list in rank order, on every rank."""
        return objects.all_gather_object(self, obj)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` as a list in rank order on rank ``dst``; ``None`` elsewhere."""
        return objects.gather_object(self, obj, dst)

    def scatter_object(self, objs: Sequence[Any] | None, src: int = 0) -> Any:
        """Object ``r`` of rank ``src``'s ``objs`` (one per rank) on rank ``r``; the other
        ranks' ``objs`` is not read (pass ``None``)."""
        return objects.scatter_object(self, objs, src)

    def barrier(self, *, timeout: Any = None) -> None:
        """Block until every rank of this communicator has called ``barrier``.

        Under a timeout (the communicator's, or ``timeout=`` for this call) the :class:`CollectiveTimeout`
        on rank 0 names the ranks that never arrived: a rank that waits sends rank 0 a word (tag 32767,
        ``collectives.calls.BARRIER_TAG``, which send/recv refuse). Without a timeout: the transport's barrier.
        """
        self._check_open()
        transport = self._transport  # (its timeout: the communicator's, without the property)
        kept = seconds = transport.timeout
        if timeout is not None:  # this call's (a timeout's message names it)
            transport.timeout = seconds = config.timeout_seconds(timeout or 0)
        record = self._begin(BARRIER)
        try:
            if seconds is None or self.size == 1:
                self._synchronize()
            else:
                self._monitored.run(seconds, self._seq, self._synchronize, self._checking)
        except Exception as error:
            self._raise_failed(record, error)
        finally:
            transport.timeout = kept
        self._completed(record)

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """A new communicator over the ranks that passed the same ``color``.

        Collective over this communicator: every rank must call it. ``color`` is a non-negative
        int, or ``None`` to take part without joining any group (that rank gets ``None`` back).
        Ranks of the new communicator are ordered by ``key`` (default: this rank), ties broken by
        rank here. A rank whose arguments are refused still takes part in the call's check.
        """
        self._check_open()
        try:
            check_split(color, key)
        except (TypeError, ValueError) as refusal:  # the peers name this rank (CallCheck.refused)
            if self._checking:
                self._call_check.refused(SPLIT, None, None, -1, refusal, self._begin(SPLIT))
            raise
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
        return type(self)._adopt(transport, timeout=self._timeout_arg, name=name)

    def close(self) -> None:
        """Complete outstanding asynchronous calls, tell the peers this rank is done with the
        communicator (a peer still waiting in a call of it then raises at once, naming this
        rank), then release the transport's resources; the communicator can no longer be used."""
        if not self._closed:
            try:
                if not self._broken:
                    self._handles.complete()
            finally:
                self._say_farewell(farewell.FINISHED)
                self._closed, self._gate = True, None
                _LIVE.discard(self)
                self._monitored.close()  # (before the transport's: it gives up its posted receives)
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

    # The call path's state (see __init__), kept by the call path: read and set through it.
    @property
    def _gate(self) -> int | None:
        gate: int | None = self._path.gate
        return gate

    @_gate.setter
    def _gate(self, gate: int | None) -> None:
        self._path.gate = gate

    @property
    def _checking(self) -> bool:
        return bool(self._path.checking)

    @_checking.setter
    def _checking(self, checking: bool) -> None:
        self._path.checking = checking

    @property
    def _operation(self) -> str:
        """The running (or last) call's operation."""
        operation: str = self._path.operation
        return operation

    @_operation.setter
    def _operation(self, operation: str) -> None:
        self._path.operation = operation

    @property
    def _ring(self) -> Any:
        return self._path.ring

    @_ring.setter
    def _ring(self, ring: Any) -> None:
        self._path.ring = ring

    @property
    def _broken(self) -> str | None:
        """Why the communicator cannot be used any more (after a timeout), else None."""
        return self._why_broken

    @_broken.setter
    def _broken(self, why: str | None) -> None:
        self._why_broken = why
        if why:
            self._gate = None

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

    @property
    def sequence_number(self) -> int:
        """How many collectives this communicator has started (the running one's number)."""
        return self._seq

    def shrink(self) -> Communicator:
        """The communicator of the ranks still alive, renumbered in this one's order (rank
        ``r`` of the result is the ``r``-th survivor), a generation later (``generation``).

        Collective over the survivors: every surviving rank calls it, typically after a
        :class:`~collectives.RankFailure`; without a failure it is a new communicator of the
        same ranks. Only on a fault-tolerant communicator (``init(fault_tolerant=True)``); the
        others raise :class:`~collectives.BackendUnavailable` naming the transports that can.
        This communicator is closed by it.
        """
        if self._closed:
            self._check_open()
        successor: Communicator = self._fault.shrink()
        return successor

    def agree(self, flag: bool) -> bool:
        """The AND of ``flag`` over the ranks still alive, the same on every one of them, also
        while peers fail (the failed ones take no part). Collective over the survivors; only on
        a fault-tolerant communicator (see :meth:`shrink`)."""
        flag = check_flag(flag)
        if self._closed:
            self._check_open()
        return self._fault.agree(flag)

    @property
    def generation(self) -> int:
        """0 for a communicator made by ``init()``; one more after each :meth:`shrink` (or join
        of replacements, :mod:`collectives.elastic`); a ``split()`` has its parent's."""
        return self._transport.generation

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
        """The one call path (collectives/callpath.py: :meth:`CallPath._run <collectives.callpath.CallPath._run>`),
        compiled where it was built (front.py). A communicator's own ``_run`` is its call path's
        ``_run`` (no frame of this method in between), unless its class has a ``_run`` of its own,
        which then runs and may call this one."""
        return self._path._run(call, x, op, root, out, async_op, extra, timeout)

    @property
    def _timeout_arg(self) -> float:
        """``timeout`` as a constructor argument, for a split to inherit (0: none)."""
        return 0.0 if self.timeout is None else self.timeout

    def _completed(self, record: list[Any] | None) -> None:
        if record is not None:
            record[END] = _clock()
            if self._hooks:
                self._call_hooks(record)

    def _call_hooks(self, record: list[Any]) -> None:
        described = CallRecord(record, self)
        for hook in list(self._hooks):
            hook(described)

    def _synchronize(self, waiting: Callable[[], None] | None = None) -> None:
        """The barrier itself: with checks on, the check (no rank completes its all_reduce before every
        rank entered it; it tells a barrier from another call). ``waiting``: see MonitoredBarrier.run."""
        if self._checking:
            self._check_call(BARRIER, None, -1, None, (), waiting)
        elif waiting is None:
            self._transport._barrier()
        else:
            self._transport._barrier_waiting(waiting)

    def _say_farewell(self, how: int) -> None:
        """Tell the peers this rank leaves (``close()``, exit), unless closed or unusable already."""
        if not self._closed and not self._why_broken:
            self._farewells.say(how)

    def _begin(self, call: Call) -> list[Any] | None:
        """Number (and record) a call that takes no array (barrier, split)."""
        if self._pending:
            self._reap()
        self._seq, self._operation = self._seq + 1, call.name
        if self._ring is None:
            return None
        record = [self._seq, call, None, None, -1, STARTED, _clock(), 0.0, None, None, None]
        self._ring.append(record)
        return record

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self!r} is closed; create a new communicator")
        if self._broken:
            raise self._fault.rank_failure(None) or self._context.failure()
        if self._owner != _thread_id() and not in_backward_pass():
            raise wrong_thread(self)

__all__ = ["Communicator", "Work", "CollectiveError", "deliver"]
