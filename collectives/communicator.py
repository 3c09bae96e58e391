"""The Communicator interface every backend implements. Read this file first.

A backend subclasses :class:`Communicator` and implements the underscored
methods (``_all_reduce``, ``_broadcast``, ..., ``_send``, ``_recv``). Every public
collective hands its arguments to ONE call path, :meth:`Communicator._run`, driven by
the table of :mod:`collectives.calls` (one row per collective). That path checks every
argument first, through the rules of :mod:`collectives.ops` and the adapters of
:mod:`collectives.arrays`, so a bad call raises the same ``TypeError``/``ValueError``
on every backend, before anything is sent and with the input untouched. Backends only
ever see arguments that passed.

Reliability lives on that path too, once for every backend (see :mod:`collectives.debug`):
every collective gets a per-communicator sequence number; with ``COLLECTIVES_DEBUG=1``
the ranks compare a fingerprint of each call before it runs (``CollectiveMismatch``);
backends enforce ``timeout`` (``CollectiveTimeout``), after which the communicator
is unusable. Asynchronous handles (``async_op=True``) are kept by the communicator
until they complete, so a handle the caller drops still completes correctly (its
buffers stay alive), and ``close()`` completes them all.

Where a backend's transport has no primitive for a collective, the base class here
provides a correct emulation from the backend's other methods (``reduce`` from
``all_reduce``, ``gather`` from ``all_gather``, ...); backends override it with their
transport's own call where there is one.
"""

from __future__ import annotations

import abc
import collections
import itertools
import operator
import sys
import time
import weakref
from _thread import get_ident as _thread_id
from collections.abc import Callable, Sequence
from typing import Any

from . import arrays, calls, config, recorder
from .arrays import ArrayAdapter
from .calls import Call
from .errors import CollectiveError, CollectiveTimeout
from .launcher import LaunchInfo
from .ops import ReduceOp, check_reduction
from .recorder import COMPLETED, END, ERROR, FAILED, POSTED, SEQ, STARTED, STATE, CallRecord, HookHandle

_C_INT_MAX = 2**31 - 1

#: Handles kept at most for a communicator; one more waits for the oldest first, so a
#: program that drops handles in a loop runs in bounded memory.
MAX_PENDING = 1024

# Every communicator not yet closed. A timeout leaves requests behind in the transport,
# and a peer that timed out on ANOTHER communicator left its own behind there: the next
# call on any communicator of that transport could match one of them and return the
# peer's abandoned data. So a timeout makes every live communicator of its backend in
# this process unusable (see Communicator._timeout_error).
_LIVE: weakref.WeakSet[Communicator] = weakref.WeakSet()

_clock = time.monotonic
# Names of communicators in the split tree (see Communicator.trace_name): communicators made
# without a parent are numbered in the order this process made them; a split's child is
# named by split() before the backend makes it (pushed here, taken by __init__).
_ROOTS = itertools.count()
_ORDER = itertools.count()
_CHILD_NAME: list[str] = []
#: The tag of a barrier's messages (see Communicator.barrier): every MPI allows it.
BARRIER_TAG = 32767


class Work:
    """Handle of an asynchronous collective. ``wait()`` completes it and returns the result
    (``x`` for the in-place collectives, the new array for the others)."""

    def __init__(self, x: Any) -> None:
        self._x = x

    def wait(self) -> Any:
        """Block until the collective has completed; return its result."""
        return self._x

    def is_completed(self) -> bool:
        """Whether the collective has completed (once true, ``wait()`` does not block)."""
        return True


class _Then(Work):
    """A handle whose result is ``then(inner.wait())``: finishing work after the transport's."""

    def __init__(self, inner: Work, then: Any) -> None:
        super().__init__(None)
        self._inner: Work | None = inner
        self._then = then

    def wait(self) -> Any:
        if self._inner is not None:
            self._x = self._then(self._inner.wait())
            self._inner = None
        return self._x

    def is_completed(self) -> bool:
        if self._inner is None:
            return True
        if self._inner.is_completed():
            self.wait()
            return True
        return False


class _Both(Work):
    """Two handles as one (a debug-mode send: its header and its payload)."""

    def __init__(self, first: Work, second: Work | None) -> None:
        super().__init__(None)
        self._works = [first] if second is None else [first, second]

    def wait(self) -> Any:
        for work in self._works:
            work.wait()
        return None

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class _CheckedRecv(Work):
    """An asynchronous debug-mode recv (see ``Communicator._checked_p2p``): the header and the
    payload recvs are both posted when the recv is made (so the sender's handles complete in
    any wait order), the payload into a staging array of x's shape; ``wait()`` compares the
    header and copies the payload into ``x`` only when it matches."""

    def __init__(self, comm: Communicator, x: Any, adapter: ArrayAdapter, dtype: str,
                 src: int, tag: int, header: Any) -> None:
        super().__init__(x)
        self._comm, self._adapter, self._src, self._tag = comm, adapter, src, tag
        self._header, self._theirs = header, header.copy()
        self._header_work = comm._recv_small(self._theirs, src, tag)
        self._staging = adapter.empty(x, tuple(x.shape))
        self._payload = comm._recv(self._staging, adapter, dtype, src, tag, True) or Work(self._staging)
        self._done = False
        self._error: Exception | None = None
        # An error the payload's handle raised while polled (it raises it only once).
        self._payload_error: Exception | None = None

    def wait(self) -> Any:
        if not self._done:
            from .debug import p2p_mismatch  # noqa: PLC0415

            self._header_work.wait()
            error = p2p_mismatch(self._header, self._theirs, self._comm, self._src, self._tag)
            try:
                if self._payload_error is not None:
                    raise self._payload_error
                self._payload.wait()
            except CollectiveError:
                raise
            except Exception as transport:  # the sizes differ: the transport refused it
                if error is None:
                    raise
                self._error = error
                raise error from transport
            finally:
                self._done = True
                try:  # waited: close() need not wait (and raise) again
                    self._comm._pending_p2p.remove(self)
                except ValueError:
                    pass
            if error is None:
                self._adapter.copy_(self._x, self._staging)
            self._error, self._staging = error, None
        if self._error is not None:
            raise self._error
        return self._x

    def is_completed(self) -> bool:
        if self._done or self._payload_error is not None:
            return True
        try:
            return self._header_work.is_completed() and self._payload.is_completed()
        except CollectiveError:
            raise
        except Exception as error:  # kept for wait(), which says what it means
            self._payload_error = error
            return True


class Communicator(abc.ABC):
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

    Every collective takes ``async_op=True``: it then returns a :class:`Work` whose
    ``wait()`` returns what the call would have returned. The collectives that return
    an array take ``out=``: an array of the result's type, dtype, device and shape
    (contiguous, writable) that the result is written into and returned.
    """

    backend: str = ""
    #: Whether this class overrides ``_check_device`` (the call path skips it when not).
    _checks_device: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._checks_device = cls._check_device is not Communicator._check_device

    def __init__(self, rank: int, size: int, local_rank: int, *,
                 timeout: Any = None) -> None:
        self.rank = rank
        self.size = size
        self.local_rank = local_rank
        self.timeout: float | None = config.timeout_seconds(timeout)
        # One rank has nobody to disagree with: debug costs nothing at size 1.
        self.debug: bool = bool(config.env_flag(config.DEBUG)) and size > 1
        self._closed = False
        # Why the communicator cannot be used any more (after a timeout), else None.
        self._why_broken: str | None = None
        # The running call, for error messages: its operation and sequence number.
        self._seq = 0
        self._operation = ""
        # Handles of asynchronous calls not known to be complete, oldest first.
        self._pending: collections.deque[Work] = collections.deque()
        # Point-to-point handles apart: one may wait for a send the peer makes only later, so
        # they are never waited for to make room (that could deadlock) and never block the
        # reaping of collective handles.
        self._pending_p2p: collections.deque[Work] = collections.deque()
        # The thread that may call collectives on this communicator (see bind_thread).
        self._owner = _thread_id()
        # The call path's one test of closed, unusable and owner thread: the owner's id
        # while the communicator is open and usable, else None (see _check_open).
        self._gate: int | None = self._owner
        # The plans of the kinds of arrays that passed the checks (see _plan).
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        #: This communicator's place in the split tree, the same on every member: "world" (the
        #: one init() made), "comm<N>" (made directly), "<parent>/<k>:<color>" (the k-th split).
        self.trace_name = _CHILD_NAME.pop() if _CHILD_NAME else f"comm{next(_ROOTS)}"
        self._trace_order = next(_ORDER)
        self._trace_splits = 0
        # The flight recorder (collectives/recorder.py): the last calls, None when turned off.
        self._ring = recorder.new_ring(self)
        self._call_site = bool(config.env_flag(config.TRACE_CALLSITE))
        self._hooks: list[Callable[[CallRecord], Any]] = []
        if config.env_flag(config.PROFILE):
            from . import profile  # noqa: PLC0415

            profile.attach(self)
        _LIVE.add(self)

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

    def barrier(self, *, timeout: Any = None) -> None:
        """Block until every rank of this communicator has called ``barrier``.

        Under a timeout (the communicator's, or ``timeout=`` for this call) the
        :class:`CollectiveTimeout` on rank 0 names the ranks that never arrived: every rank
        tells rank 0 it arrived and waits for rank 0's word (messages of tag
        :data:`BARRIER_TAG`). Without a timeout it is the transport's own barrier.
        """
        self._check_open()
        seconds = self.timeout if timeout is None else config.timeout_seconds(timeout or 0)
        record = self._begin(BARRIER)
        try:
            if self.debug:
                self._compare_fingerprints(None, -1, None, ())
            if seconds is None or self.size == 1:
                self._barrier()
            else:
                self._monitored_barrier(seconds)
        except Exception as error:
            self._failed(record, error)
            if isinstance(error, CollectiveError):
                raise
            raise self._transport_error(error) from error
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
            if value is not None and (isinstance(value, bool) or not _is_int(value)):
                raise TypeError(f"{name} must be an int or None; got {type(value).__name__}")
        if color is not None and int(color) < 0:
            raise ValueError(f"color must be >= 0 (or None to join no group); got {color}")
        # One range on every backend: MPI takes C ints (torch's int64 would allow more).
        if color is not None and int(color) > _C_INT_MAX:
            raise ValueError(f"color must be at most 2**31 - 1 = {_C_INT_MAX}; got {color}")
        if key is not None and not -_C_INT_MAX - 1 <= int(key) <= _C_INT_MAX:
            raise ValueError(f"key must be between -2**31 and 2**31 - 1; got {key}")
        record = self._begin(SPLIT)
        _CHILD_NAME[:] = [f"{self.trace_name}/{self._trace_splits}:{color}"]
        self._trace_splits += 1
        try:
            if self.debug:  # colors and keys differ by design: only the call itself is compared
                self._compare_fingerprints(None, -1, None, ())
            child = self._split(None if color is None else int(color),
                                self.rank if key is None else int(key))
        except Exception as error:
            self._failed(record, error)
            if isinstance(error, CollectiveError):
                raise
            raise self._transport_error(error) from error
        finally:
            _CHILD_NAME.clear()
        self._completed(record)
        return child

    def register_hook(self, fn: Callable[[CallRecord], Any]) -> HookHandle:
        """Call ``fn(record)`` when each call on this communicator completes (in the calling
        thread, after the transport returned). ``record`` is a
        :class:`collectives.recorder.CallRecord`: ``op``, ``seq``, ``dtype``, ``shape``,
        ``bytes``, ``start`` and ``end`` (``time.monotonic()``). An asynchronous call is
        reported when it is posted. Returns a handle whose ``remove()`` unregisters ``fn``.
        Hooks need the flight recorder: with ``COLLECTIVES_TRACE_SIZE=0`` they are not called.
        """
        if not callable(fn):
            raise TypeError(f"fn must be callable; got {type(fn).__name__}")
        self._hooks.append(fn)
        return HookHandle(self._hooks, fn)

    def dump_trace(self, path: str | None = None) -> str | None:
        """Write this rank's flight-recorder dump (every communicator's recent calls, every
        thread's stack) to ``path``, else to ``COLLECTIVES_TRACE_DIR/rank-<R>.json``; returns
        the path written, None when neither is given. Local: no other rank takes part."""
        return recorder.dump(f"dump_trace() on {self.trace_name}", path)

    def close(self) -> None:
        """Complete outstanding asynchronous calls, then release the transport's resources;
        the communicator can no longer be used."""
        if not self._closed:
            try:
                if not self._broken:
                    self._complete_pending()
            finally:
                self._closed, self._gate = True, None
                _LIVE.discard(self)
                self._close()

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
            check, fast, adapter, dtype, reduce_op = self._plans[call, type(x), x.dtype, op]
        except (KeyError, TypeError, AttributeError):
            check, fast, adapter, dtype, reduce_op = self._plan(call, x, op)
            view = None
        else:  # what can differ between two arrays of one kind, checked on every call
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
        record = None
        if self._ring is not None:  # the flight recorder (collectives/recorder.py)
            record = [self._seq if call.collective else -1, call.name, dtype, x.shape, root,
                      STARTED, _clock(), 0.0, recorder.call_site() if self._call_site else None,
                      None]
            self._ring.append(record)
        try:
            if self.debug and call.collective:
                self._compare_fingerprints(reduce_op, root, dtype, call.fingerprint_shape(x.shape))
            if view is not None and not async_op and fast(view, root):
                result = x  # the backend's fast path ran it (see _fast_path)
            elif self.debug and not call.collective:
                result = self._checked_p2p(call, x, adapter, dtype, root, async_op, extra)
            else:
                result = call.run(self, x, adapter, dtype, reduce_op, root, out, async_op, extra)
        except Exception as error:
            if record is not None:
                self._failed(record, error)
            if isinstance(error, CollectiveError):
                raise
            raise self._transport_error(error) from error
        if record is not None:
            record[STATE] = POSTED if async_op else COMPLETED
            record[END] = _clock()
            if self._hooks:
                self._call_hooks(record)
        if async_op:
            if type(result) is not Work:  # a handle that may still be running: keep it
                if call.collective:
                    self._keep(result)
                else:
                    self._pending_p2p.append(result)
                    _reap(self._pending_p2p)
            return result
        return x if call.in_place else result

    def _begin(self, call: Call) -> list[Any] | None:
        """Number (and record) a call that takes no array (barrier, split)."""
        if self._pending:
            self._reap()
        self._seq += 1
        self._operation = call.name
        if self._ring is None:
            return None
        record = [self._seq, call.name, None, None, -1, STARTED, _clock(), 0.0,
                  recorder.call_site() if self._call_site else None, None]
        self._ring.append(record)
        return record

    # -- the flight recorder and hooks ---------------------------------------------------

    def _completed(self, record: list[Any] | None) -> None:
        if record is not None:
            record[STATE], record[END] = COMPLETED, _clock()
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
            if record[SEQ] == seq:
                return record
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
            delay = 0.0
            while not work.is_completed():
                if _clock() > deadline:
                    error = self._timeout_error(call=(call.name, seq))
                    self._failed(self._record_of(seq), error)
                    raise error
                time.sleep(delay)
                delay = min(0.001, delay + 0.0001)
            result = work.wait()
            record = self._record_of(seq) if call.collective else None
            if record is not None:
                record[STATE], record[END] = COMPLETED, _clock()
            return x if call.in_place else result
        finally:
            self.timeout = kept

    def _monitored_barrier(self, seconds: float) -> None:
        """The barrier under a timeout: every rank sends a word to rank 0, which answers each
        once all have arrived; rank 0's timeout names those that did not."""
        import numpy as np  # noqa: PLC0415

        deadline = _clock() + seconds
        if self.rank == 0:
            words = [np.zeros(1, np.int64) for _ in range(self.size)]
            arrivals = {peer: self._recv_small(words[peer], peer, BARRIER_TAG)
                        for peer in range(1, self.size)}
            missing = self._wait_all(arrivals, deadline)
            if missing:
                raise self._timeout_error(
                    detail=f"rank(s) {', '.join(map(str, missing))} never arrived at the barrier")
            releases = {peer: self._send_small(np.ones(1, np.int64), peer, BARRIER_TAG)
                        for peer in range(1, self.size)}
            self._wait_all(releases, deadline + seconds)
            return
        works = {0: self._send_small(np.ones(1, np.int64), 0, BARRIER_TAG),
                 -1: self._recv_small(np.zeros(1, np.int64), 0, BARRIER_TAG)}
        if self._wait_all(works, deadline):
            raise self._timeout_error(
                detail="rank 0 did not release the barrier: its CollectiveTimeout (or its "
                       "dump, with COLLECTIVES_TRACE_DIR) names the ranks that never arrived")

    def _wait_all(self, works: dict[int, Work], deadline: float) -> list[int]:
        """Poll ``works`` until all completed or ``deadline``; the keys of those that did not."""
        delay = 0.0
        while True:
            waiting = sorted(key for key, work in works.items() if not work.is_completed())
            if not waiting or _clock() > deadline:
                for key, work in works.items():
                    if key not in waiting:
                        work.wait()
                return waiting
            time.sleep(delay)
            delay = min(0.001, delay + 0.0001)

    # -- asynchronous handles ------------------------------------------------------------

    def _keep(self, work: Work) -> None:
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft().wait()
        self._pending.append(work)

    def _reap(self) -> None:
        """Forget the collective handles that have completed, oldest first (collectives
        complete in the order they were made; a still-running one ends the scan)."""
        _reap(self._pending)

    def _complete_pending(self) -> None:
        for pending in (self._pending, self._pending_p2p):
            while pending:
                pending.popleft().wait()

    # -- argument checks shared by every backend ----------------------------------------

    # The checks run on every call. _run first looks the kind of x (its type and dtype,
    # and op) up among the kinds that passed before on this communicator, for this row of
    # the table, and then checks only what can differ from one array to the next (memory,
    # writable, device); a kind not seen yet goes through the full checks below. The order
    # of the checks, and so which error a call with several faults gets, is the same on
    # both paths.

    def _check_kind(self, x: Any, op: Any, reduces: bool, in_place: bool
                    ) -> tuple[ArrayAdapter, str, ReduceOp | None]:
        """The adapter and dtype name of ``x`` and, for a reduction, the ReduceOp; for
        ``in_place`` also that x is writable."""
        adapter = arrays.adapter_for(x)
        dtype = adapter.dtype_name(x)
        adapter.check_array(x, in_place)
        if self._checks_device:
            self._check_device(x, adapter)
        reduce_op = check_reduction(dtype, op) if reduces else None
        return adapter, dtype, reduce_op

    def _plan(self, call: Call, x: Any, op: Any) -> _Plan:
        """The full checks of a kind of ``x`` (and ``op``) not seen before by ``call``, and
        what later calls of that kind run (remembered): the per-array check, the backend's
        fast path if it has one (:meth:`_fast_path`; in-place collectives only, so its
        result is ``x``), the adapter, dtype name and ReduceOp."""
        adapter, dtype, reduce_op = self._check_kind(x, op, call.reduces, call.in_place)
        fast = self._fast_path(call, adapter, dtype, reduce_op) \
            if call.in_place and call.collective else None
        # The per-array check: with a fast path, the one that also returns x's host view
        # (without, check_array's None means the fast path, never taken, is never called);
        # then the backend's device check, where it has one.
        check: Callable[[Any, bool], Any] = adapter.check_array if fast is None else adapter.host_view
        if self._checks_device:
            check = self._checked_device(check, adapter)
        plan = (check, fast or _no_fast_path, adapter, dtype, reduce_op)
        try:
            self._plans[call, type(x), x.dtype, op] = plan
        except TypeError:  # an unhashable op spelling or dtype: valid, just not remembered
            pass
        return plan

    def _checked_device(self, check: Callable[[Any, bool], Any], adapter: ArrayAdapter
                        ) -> Callable[[Any, bool], Any]:
        """``check``, then :meth:`_check_device` (as in :meth:`_check_kind`)."""
        def check_and_device(x: Any, in_place: bool) -> Any:
            view = check(x, in_place)
            self._check_device(x, adapter)
            return view
        return check_and_device

    def _fast_path(self, call: Call, adapter: ArrayAdapter, dtype: str,
                   reduce_op: ReduceOp | None) -> Callable[[Any, Any], bool] | None:
        """For backends: a callable ``(view, root)`` that runs the in-place collective
        ``call`` on ``view``, the C-contiguous numpy array of a host ``x`` of this kind
        (``adapter.host_view``), blocking; it returns ``False`` when it cannot take that
        array (the row's general ``run`` then does). ``None``: no fast path for this kind.
        Called once per kind, after every check of the call path has passed; the fast path
        runs after the checks, the sequence number and the fingerprint of each call."""
        return None

    def _check_array(self, x: Any, in_place: bool) -> tuple[ArrayAdapter, str]:
        """For backends and helpers: the checks of ``_run`` for an array argument."""
        if self._gate != _thread_id():  # closed, unusable, or another thread
            self._check_open()
        adapter, dtype, _ = self._check_kind(x, None, False, in_place)
        return adapter, dtype

    def _check_out(self, call: Call, x: Any, adapter: ArrayAdapter, out: Any, extra: Any,
                   root: Any) -> None:
        """``out=`` must be an array of x's kind, dtype and device, contiguous and writable,
        of the result's shape (``ValueError``/``TypeError`` naming expected and got)."""
        if call.out_shape is None and call.name not in _OUT_SHAPE_AFTER_COUNTS:
            raise TypeError(f"{call.name} takes no out= argument")
        try:
            out_adapter = arrays.adapter_for(out)
        except TypeError:
            raise TypeError(f"out must be an array of x's type ({adapter.name}); got "
                            f"{arrays.type_name(type(out))}") from None
        if out_adapter is not adapter:
            raise TypeError(f"out must be a {adapter.name} array like x; got a {out_adapter.name} array")
        if out.dtype != x.dtype:
            raise ValueError(f"out has dtype {out.dtype}; expected x's dtype {x.dtype}")
        if adapter.device_index(out) != adapter.device_index(x) or \
                (adapter is arrays.TORCH and out.device != x.device):
            raise ValueError(f"out is on device {getattr(out, 'device', 'cpu')}; expected x's "
                             f"device {getattr(x, 'device', 'cpu')}")
        if call.out_shape is not None:
            expected = call.out_shape(self, tuple(x.shape), extra)
            if tuple(out.shape) != expected:
                raise ValueError(f"out has shape {tuple(out.shape)}; {call.name} of x.shape="
                                 f"{tuple(x.shape)} on size={self.size} needs out.shape={expected}")
        elif len(out.shape) != len(x.shape) or tuple(out.shape[1:]) != tuple(x.shape[1:]):
            raise ValueError(f"out has shape {tuple(out.shape)}; {call.name} of x.shape="
                             f"{tuple(x.shape)} needs out.shape=(total rows, *x.shape[1:])")
        if not adapter.is_contiguous(out):
            raise ValueError("out must be contiguous (C order)")
        adapter.check_writable(out)

    def _check_device(self, x: Any, adapter: ArrayAdapter) -> None:
        """``TypeError``/``ValueError`` if this backend cannot take ``x`` (device, kind)."""

    def _check_rank(self, rank: Any, name: str) -> None:
        if isinstance(rank, bool) or not _is_int(rank):
            raise TypeError(f"{name} must be an int rank; got {type(rank).__name__}")
        if not 0 <= rank < self.size:
            raise ValueError(f"{name}={rank} is out of range; valid ranks: 0 to {self.size - 1}")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"{self!r} is closed; create a new communicator")
        if self._broken:
            raise CollectiveError(self._broken)
        if self._owner != _thread_id() and not _in_backward_pass():
            import threading  # noqa: PLC0415  (only for the message)

            raise CollectiveError(
                f"{self!r} takes calls from one thread, the one that created it (or last "
                f"called bind_thread()); this call came from thread "
                f"{threading.current_thread().name!r}. Two threads on one communicator would "
                "mix up their calls between ranks: give each thread a communicator of its "
                "own (split() in the owning thread, then bind_thread() in the other)")

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
        first_line = text.splitlines()[0][:300] if text else ""
        return CollectiveError(f"{self._call_name()} failed in the {self.backend} transport: "
                               f"{type(error).__module__}.{type(error).__qualname__}: {first_line}")

    def _exchange_small(self, vector: Any) -> Any:
        """Every rank's small int64 numpy ``vector`` (same length everywhere), as a numpy
        ``(size, len)`` array: the fingerprints of debug mode and the counts of the uneven
        collectives travel this way. Backends whose transport takes no host memory
        override it (the vector goes through device memory)."""
        return self._all_gather(vector, arrays.NUMPY, "int64", None, False)

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

    def _split_groups(self, color: int | None, key: int) -> list[int] | None:
        """Every rank's group for ``split``, through one all_gather of (color, key).

        Returns this rank's group as a list of ranks of this communicator in the
        new communicator's order, or ``None`` when ``color`` is ``None``. For
        backends whose transport has no native split.
        """
        import numpy as np  # noqa: PLC0415  (numpy is a dependency of the interface)

        mine = np.array([-1 if color is None else color, key], dtype=np.int64)
        everyone = self._exchange_small(mine)
        if color is None:
            return None
        members = [r for r in range(self.size) if everyone[r, 0] == color]
        return sorted(members, key=lambda r: (int(everyone[r, 1]), r))

    # -- point-to-point in debug mode: a header ahead of each payload ----------------------

    def _checked_p2p(self, call: Call, x: Any, adapter: ArrayAdapter, dtype: str, peer: int,
                     async_op: bool, tag: int) -> Any:
        """Debug mode: a send sends a small header (dtype, shape, tag, bytes) ahead of its
        payload, without blocking; a recv receives the header first and compares it. On a
        mismatch the recv still takes the payload (into scratch memory) so that the stream
        stays in step, and raises :class:`CollectiveMismatch` naming both sides, ``x``
        untouched. Every recv posts its transport recvs when it is made, in the order made,
        so headers meet headers and no order of waits deadlocks. A synchronous recv waits for
        the header before it receives the payload (scratch of the sender's size on a
        mismatch); an asynchronous one receives both at once (see :class:`_CheckedRecv`: a
        payload of another size is the transport's error, raised as the mismatch)."""
        from .debug import p2p_header  # noqa: PLC0415  (debug mode only)

        header = p2p_header(dtype, tuple(x.shape), tag, _nbytes(x))
        if call is SEND:
            sent = self._send_small(header, peer, tag)
            payload = self._send(x, adapter, dtype, peer, tag, async_op)
            if async_op:
                return _Both(sent, payload)
            if type(sent) is not Work:  # completes later: kept like a dropped p2p handle
                self._pending_p2p.append(sent)
            return None
        if async_op:
            return _CheckedRecv(self, x, adapter, dtype, peer, tag, header)
        from .debug import p2p_mismatch, p2p_nbytes  # noqa: PLC0415

        theirs = header.copy()
        self._recv_small(theirs, peer, tag).wait()
        error = p2p_mismatch(header, theirs, self, peer, tag)
        if error is None:
            self._recv(x, adapter, dtype, peer, tag, False)
            return None
        # Take the payload anyway, into scratch memory of the size the header says, so
        # that the stream stays in step; x is untouched.
        scratch = self._scratch_bytes(x, adapter, p2p_nbytes(theirs))
        self._recv(scratch, adapter, "uint8", peer, tag, False)
        raise error

    def _send_small(self, vector: Any, dst: int, tag: int) -> Work:
        """Send a small int64 numpy vector to ``dst``, nonblocking (the debug-mode header of a
        send). Backends whose transport takes no host memory override it and
        :meth:`_recv_small`."""
        return self._send(vector, arrays.NUMPY, "int64", dst, tag, True) or Work(vector)

    def _recv_small(self, vector: Any, src: int, tag: int) -> Work:
        """Receive into a small int64 numpy vector from ``src``, nonblocking."""
        return self._recv(vector, arrays.NUMPY, "int64", src, tag, True) or Work(vector)

    def _scratch_bytes(self, x: Any, adapter: ArrayAdapter, nbytes: int) -> Any:
        """``nbytes`` of uninitialized uint8 memory of x's kind and device."""
        memory = adapter.empty(x, (nbytes,))
        if adapter is arrays.TORCH:
            return memory.view(sys.modules["torch"].uint8)[:nbytes]
        return memory.view("uint8")[:nbytes]

    # -- the uneven collectives: counts first -------------------------------------------

    def _rows_of_everyone(self, x: Any, dtype: str, out: Any, splits: Sequence[int] | None
                          ) -> Any:
        """One small exchange before an uneven collective: every rank's rows, the rest of its
        shape, its dtype, its ``out`` rows and (all_to_all) its splits, as a numpy array of
        one row per rank. A disagreement is the same ``ValueError`` on every rank, before any
        of the data moves."""
        from .debug import uneven_header, uneven_mismatch  # noqa: PLC0415

        mine = uneven_header(tuple(x.shape), dtype, None if out is None else int(out.shape[0]),
                             splits, self.size)
        everyone = self._exchange_small(mine)
        error = uneven_mismatch(everyone, self, self._operation, splits is not None)
        if error is not None:
            raise error
        return everyone

    def _all_gather_v_counted(self, x: Any, adapter: ArrayAdapter, dtype: str, out: Any,
                              async_op: bool) -> Any:
        from .debug import header_rows  # noqa: PLC0415

        counts = [int(c) for c in header_rows(self._rows_of_everyone(x, dtype, out, None))]
        return self._all_gather_v(x, adapter, dtype, counts, out, async_op)

    def _all_to_all_counted(self, x: Any, adapter: ArrayAdapter, dtype: str,
                            send_splits: Sequence[int], out: Any, async_op: bool) -> Any:
        from .debug import header_splits  # noqa: PLC0415

        splits = header_splits(self._rows_of_everyone(x, dtype, out, send_splits), self.size)
        return self._all_to_all_v(x, adapter, dtype, splits, out, async_op)

    # -- emulations: correct on any backend, overridden where the transport does better ---

    def _reduce(self, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp, dst: int,
                async_op: bool) -> Work | None:
        """Reduce into ``x`` on ``dst``. Emulated: all_reduce of a copy, kept on ``dst``."""
        copy = adapter.empty(x, tuple(x.shape))
        adapter.copy_(copy, x)
        self._all_reduce(copy, adapter, dtype, op, False)
        if self.rank == dst:
            adapter.copy_(x, copy)
        return Work(x) if async_op else None

    def _gather(self, x: Any, adapter: ArrayAdapter, dtype: str, dst: int, out: Any,
                async_op: bool) -> Any:
        """``(size, *x.shape)`` on ``dst``, ``None`` elsewhere. Emulated: all_gather."""
        gathered = self._all_gather(x, adapter, dtype, out if self.rank == dst else None, False)
        result = gathered if self.rank == dst else None
        return Work(result) if async_op else result

    def _scatter(self, x: Any, adapter: ArrayAdapter, dtype: str, src: int, out: Any,
                 async_op: bool) -> Any:
        """Row ``rank`` of ``src``'s ``x``. Emulated: broadcast of a copy (x stays untouched)."""
        copy = adapter.empty(x, tuple(x.shape))
        adapter.copy_(copy, x)
        self._broadcast(copy, adapter, dtype, src, False)
        result = _into(adapter, out, copy[self.rank])
        return Work(result) if async_op else result

    def _all_to_all(self, x: Any, adapter: ArrayAdapter, dtype: str, out: Any,
                    async_op: bool) -> Any:
        """Row ``j`` of the result is rank ``j``'s row ``rank``. Emulated: all_gather."""
        gathered = self._all_gather(x, adapter, dtype, None, False)
        result = _into(adapter, out, gathered[:, self.rank])
        return Work(result) if async_op else result

    def _all_gather_v(self, x: Any, adapter: ArrayAdapter, dtype: str, counts: list[int],
                      out: Any, async_op: bool) -> Any:
        """``(concatenation, counts)``. Emulated: all_gather of x padded to the most rows."""
        most = max(counts)
        padded = adapter.empty(x, (most, *x.shape[1:]))
        if x.shape[0]:
            adapter.copy_(padded[:x.shape[0]], x)
        gathered = self._all_gather(padded, adapter, dtype, None, False)
        result = out if out is not None else adapter.empty(x, (sum(counts), *x.shape[1:]))
        start = 0
        for rank, count in enumerate(counts):
            if count:
                adapter.copy_(result[start:start + count], gathered[rank, :count])
            start += count
        return Work((result, counts)) if async_op else (result, counts)

    def _all_to_all_v(self, x: Any, adapter: ArrayAdapter, dtype: str,
                      splits: list[list[int]], out: Any, async_op: bool) -> Any:
        """Uneven all_to_all; ``splits[i][j]`` is how many rows rank ``i`` sends to rank ``j``
        (so this rank sends ``splits[rank]`` and receives ``[s[rank] for s in splits]``).
        Emulated: all_gather_v of x, then each rank keeps the rows addressed to it."""
        rows = [sum(row) for row in splits]
        everyone, _ = self._all_gather_v(x, adapter, dtype, rows, None, False)
        received = [row[self.rank] for row in splits]
        result = out if out is not None else adapter.empty(x, (sum(received), *x.shape[1:]))
        position = offset = 0
        for sender, count in enumerate(received):
            start = offset + sum(splits[sender][:self.rank])
            if count:
                adapter.copy_(result[position:position + count], everyone[start:start + count])
            position += count
            offset += rows[sender]
        return Work(result) if async_op else result

    # -- what a backend implements --------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def from_launcher(cls, launch: LaunchInfo) -> Communicator:
        """The world communicator of this backend for a process started as ``launch`` says.

        Raises :class:`BackendUnavailable` with the reason when the backend cannot
        run under that launcher or its transport is missing.
        """

    @abc.abstractmethod
    def _all_reduce(self, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp,
                    async_op: bool) -> Work | None:
        """Reduce in place; return a Work when ``async_op``."""

    @abc.abstractmethod
    def _broadcast(self, x: Any, adapter: ArrayAdapter, dtype: str, src: int,
                   async_op: bool) -> Work | None:
        """Broadcast in place; return a Work when ``async_op``."""

    @abc.abstractmethod
    def _all_gather(self, x: Any, adapter: ArrayAdapter, dtype: str, out: Any = None,
                    async_op: bool = False) -> Any:
        """Return the gathered ``(size, *x.shape)`` array (``out`` when given, its shape
        checked), or a Work whose ``wait()`` returns it."""

    @abc.abstractmethod
    def _reduce_scatter(self, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp,
                        out: Any = None, async_op: bool = False) -> Any:
        """Return this rank's reduced block (shape already checked), into ``out`` when given,
        or a Work whose ``wait()`` returns it."""

    @abc.abstractmethod
    def _send(self, x: Any, adapter: ArrayAdapter, dtype: str, dst: int, tag: int,
              async_op: bool) -> Work | None:
        """Send ``x`` to ``dst`` (another rank); a Work when ``async_op``."""

    @abc.abstractmethod
    def _recv(self, x: Any, adapter: ArrayAdapter, dtype: str, src: int, tag: int,
              async_op: bool) -> Work | None:
        """Receive into ``x`` from ``src`` (another rank); a Work when ``async_op``."""

    @abc.abstractmethod
    def _barrier(self) -> None: ...

    @abc.abstractmethod
    def _split(self, color: int | None, key: int) -> Communicator | None: ...

    def _close(self) -> None:
        """Release transport resources (called once)."""


def _reap(pending: collections.deque[Work]) -> None:
    while pending and pending[0].is_completed():
        pending.popleft()


def deliver(adapter: ArrayAdapter, result: Any, out: Any, async_op: bool) -> Any:
    """For backends: ``result`` (copied into ``out`` when the caller passed one), or a
    completed :class:`Work` holding it when ``async_op``."""
    if out is not None and result is not out:
        adapter.copy_(out, result)
        result = out
    return Work(result) if async_op else result


def _into(adapter: ArrayAdapter, out: Any, value: Any) -> Any:
    """``value`` copied into ``out``, or into a new array of its shape when ``out`` is None."""
    if out is None:
        out = adapter.empty(value, tuple(value.shape))
    adapter.copy_(out, value)
    return out


def _nbytes(x: Any) -> int:
    """Bytes of a numpy/CuPy array or a torch tensor."""
    return int(x.nbytes) if hasattr(x, "nbytes") else int(x.numel() * x.element_size())


def _in_backward_pass() -> bool:
    """Whether this thread is running a backward pass of torch's autograd engine (which
    runs CUDA backward functions on threads of its own, for the thread that called
    ``backward()``)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch._C._current_graph_task_id() != -1


def _is_int(value: Any) -> bool:
    try:
        operator.index(value)  # int and numpy integers; not float, str or None
    except TypeError:
        return False
    return True


# What a communicator remembers per (row, type(x), x.dtype, op as spelled or None) that
# passed the checks: (per-array check, fast path, adapter, dtype name, ReduceOp or None).
_Plan = tuple[Callable[[Any, bool], Any], Callable[[Any, Any], bool], ArrayAdapter, str,
              ReduceOp | None]


def _no_fast_path(view: Any, root: Any) -> bool:
    return False

# -- the table: one row per collective (see collectives/calls.py) ---------------------------
# Each row's ``run`` maps the call path's arguments to the backend's method:
# (comm, x, adapter, dtype, reduce_op, root, out, async_op, extra).

ALL_REDUCE = Call(
    "all_reduce", reduces=True, in_place=True,
    run=lambda c, x, a, d, op, root, out, asy, extra: c._all_reduce(x, a, d, op, asy))
BROADCAST = Call(
    "broadcast", in_place=True, root="src",
    run=lambda c, x, a, d, op, root, out, asy, extra: c._broadcast(x, a, d, root, asy))
REDUCE = Call(
    "reduce", reduces=True, in_place=True, root="dst",
    run=lambda c, x, a, d, op, root, out, asy, extra: c._reduce(x, a, d, op, root, asy))
ALL_GATHER = Call(
    "all_gather", out_shape=calls.stacked,
    run=lambda c, x, a, d, op, root, out, asy, extra: c._all_gather(x, a, d, out, asy))
ALL_GATHER_V = Call(
    "all_gather_v", check=calls.at_least_one_dim("all_gather_v"),
    fingerprint_shape=calls.rows_free,
    run=lambda c, x, a, d, op, root, out, asy, extra: c._all_gather_v_counted(x, a, d, out, asy))
REDUCE_SCATTER = Call(
    "reduce_scatter", reduces=True, check=calls.rows_divisible, out_shape=calls.block_of_rows,
    run=lambda c, x, a, d, op, root, out, asy, extra: c._reduce_scatter(x, a, d, op, out, asy))
GATHER = Call(
    "gather", root="dst", out_shape=calls.stacked,
    run=lambda c, x, a, d, op, root, out, asy, extra: c._gather(x, a, d, root, out, asy))
SCATTER = Call(
    "scatter", root="src", check=calls.rows_equal_size("scatter"), out_shape=calls.one_row,
    run=lambda c, x, a, d, op, root, out, asy, extra: c._scatter(x, a, d, root, out, asy))
ALL_TO_ALL = Call(
    "all_to_all", check=calls.rows_equal_size("all_to_all"), out_shape=calls.same_shape,
    run=lambda c, x, a, d, op, root, out, asy, extra: c._all_to_all(x, a, d, out, asy))
ALL_TO_ALL_V = Call(
    "all_to_all", check=calls.check_splits, fingerprint_shape=calls.rows_free,
    run=lambda c, x, a, d, op, root, out, asy, splits: c._all_to_all_counted(x, a, d, splits, out, asy))
SEND = Call(
    "send", root="dst", collective=False, check=calls.peer_and_tag("dst"),
    run=lambda c, x, a, d, op, root, out, asy, tag: c._send(x, a, d, root, tag, asy))
RECV = Call(
    "recv", in_place=True, root="src", collective=False, check=calls.peer_and_tag("src"),
    run=lambda c, x, a, d, op, root, out, asy, tag: c._recv(x, a, d, root, tag, asy))
BARRIER = Call("barrier")
SPLIT = Call("split")

#: Every row, by name (the uneven all_to_all shares its public name with the equal one).
CALLS = {call.name: call for call in (ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, ALL_GATHER_V,
                                      REDUCE_SCATTER, GATHER, SCATTER, ALL_TO_ALL, SEND, RECV,
                                      BARRIER, SPLIT)}
# Calls whose out= rows are known only once the counts have travelled (checked then).
_OUT_SHAPE_AFTER_COUNTS = frozenset({"all_gather_v", "all_to_all"})


__all__ = ["Communicator", "Work", "CollectiveError", "deliver"]
