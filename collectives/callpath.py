"""The one call path every collective goes through: :meth:`CallPath._run`, the communicator's ``_run``
(``Communicator._run``). It checks every argument first (the same ``TypeError``/``ValueError`` on
every backend, before any data is sent, the input untouched; a refused call still takes part in its
check), numbers the call, checks that every rank makes it, records it, runs it on the transport and
maps its errors. ``comm`` is the Communicator (typed ``Any``: this module does not import
the one that imports it). A module of its own so that it reads in one sitting, beside the communicator
whose parts it calls (see :mod:`collectives.communicator`).

It is also the call path's compiled form: the build compiles this file as it stands with Cython
(``collectives._callpath_c``, setup.py's ``COMPILED``, with the types of callpath.pxd), whose
:class:`CallPath` :mod:`collectives.front` makes for a communicator; a change here is a change of
both forms (build again to run it compiled)."""

from __future__ import annotations

from _thread import get_ident as _thread_id
from collections.abc import Sequence
from types import MethodType
from typing import Any

from . import emulations, host_views
from .calls import (
    ALL_GATHER,
    ALL_GATHER_V,
    ALL_REDUCE,
    ALL_TO_ALL,
    ALL_TO_ALL_V,
    BROADCAST,
    GATHER,
    NOT_TAKEN,
    RECV,
    REDUCE,
    REDUCE_SCATTER,
    SCATTER,
    SEND,
    Call,
)
from .diagnostics import recorder
from .diagnostics.recorder import END, POSTED, STARTED, STATE
from .ops import ReduceOp
from .work import Work

try:
    import cython
except ImportError:  # (the Python form where Cython is not installed)
    from types import SimpleNamespace

    cython = SimpleNamespace(compiled=False)

if not cython.compiled:  # (compiled: callpath.pxd's _clock, the same clock read in C)
    _clock = recorder.clock


class Plan:
    """What the calls of one kind (the row, x's type and dtype, op) run, made when the kind first
    passes the full checks (:meth:`collectives.checks.ArgumentChecks.plan`, whose tuple it holds
    by name) with what the call path reads of the row (:class:`~collectives.calls.Call`); kept in
    the communicator's plans. Compiled, its fields are typed (callpath.pxd): one read each."""

    def __init__(self, call: Call, check: Any, fast: Any, carry: Any, adapter: Any, dtype: Any,
                 reduce_op: Any, request: Any, method: Any, out_form: int) -> None:
        self.check, self.fast, self.carry, self.adapter = check, fast, carry, adapter
        self.dtype, self.reduce_op, self.request, self.method = dtype, reduce_op, request, method
        self.out_form = out_form
        self.name, self.in_place, self.collective = call.name, call.in_place, call.collective
        self.root, self.any_root, self.counted, self.row_check = call.root, call.any_root, call.counted, call.check


class Collectives:
    """The public collectives of :class:`~collectives.Communicator` (its base) and of
    :class:`CallPath`: each hands its arguments to ``self._run``, the call path, and does nothing
    else. Here, beside the call path, so that they are compiled with it: a compiled communicator's
    public methods are its compiled call path's (see :mod:`collectives.front`), which call its
    ``_run`` in C, without a Python frame or a lookup."""

    #: The names :mod:`collectives.front` binds to a compiled communicator, its call path's.
    _METHODS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_v", "reduce_scatter", "gather",
               "scatter", "all_to_all", "send", "recv")

    def _run(self, call: Call, x: Any, op: Any, root: Any, out: Any, async_op: Any,
             extra: Any = None, timeout: Any = None) -> Any:
        """The call path (:meth:`CallPath._run`)."""
        raise NotImplementedError

    def all_reduce(self, x: Any, op: ReduceOp | str = "sum", *, async_op: bool = False, timeout: Any = None) -> Any:
        """Reduce ``x`` elementwise over all ranks, in place; every rank gets the result.

        ``x`` keeps its shape and dtype. ``op`` must be allowed on ``x``'s dtype
        (see :data:`collectives.ops.ALLOWED_OPS`), else ``TypeError``. Returns
        ``x``, or with ``async_op=True`` a :class:`Work` whose ``wait()`` returns ``x``.
        """
        return self._run(ALL_REDUCE, x, op, -1, None, async_op, None, timeout)

    def broadcast(self, x: Any, src: int = 0, *, async_op: bool = False, timeout: Any = None) -> Any:
        """Copy rank ``src``'s ``x`` into ``x`` on every rank, in place.

        ``x`` must have the same shape and dtype on every rank. ``src`` is a rank
        of this communicator (``0 <= src < size``), else ``ValueError``. Returns
        ``x``, or with ``async_op=True`` a :class:`Work` whose ``wait()`` returns ``x``.
        """
        return self._run(BROADCAST, x, None, src, None, async_op, None, timeout)

    def reduce(self, x: Any, op: ReduceOp | str = "sum", dst: int = 0, *,
               async_op: bool = False, timeout: Any = None) -> Any:
        """Reduce ``x`` elementwise over all ranks into ``x`` on rank ``dst``, in place.

        On the other ranks ``x`` is left untouched. ``op`` as for :meth:`all_reduce`.
        Returns ``x`` (or a :class:`Work` whose ``wait()`` returns ``x``).
        """
        return self._run(REDUCE, x, op, dst, None, async_op, None, timeout)

    def all_gather(self, x: Any, *, out: Any = None, async_op: bool = False, timeout: Any = None) -> Any:
        """Gather every rank's ``x``: a new array of shape ``(size, *x.shape)``.

        Row ``r`` of the result is rank ``r``'s ``x``. ``x`` is not modified. With
        ``out=`` the rows are written into ``out`` (shape ``(size, *x.shape)``).
        """
        return self._run(ALL_GATHER, x, None, -1, out, async_op, None, timeout)

    def all_gather_v(self, x: Any, *, out: Any = None, async_op: bool = False, timeout: Any = None) -> Any:
        """Gather arrays whose first dimension may differ between ranks.

        Returns ``(gathered, counts)``: every rank's ``x`` concatenated in rank order
        along dimension 0, and the list of each rank's ``x.shape[0]``. The other
        dimensions and the dtype must be the same on every rank, else ``ValueError``
        on every rank. ``out=`` (shape ``(sum(counts), *x.shape[1:])``) receives the
        concatenation. The counts travel first, in one small collective (MPI: the check's).
        """
        return self._run(ALL_GATHER_V, x, None, -1, out, async_op, None, timeout)

    def reduce_scatter(self, x: Any, op: ReduceOp | str = "sum", *, out: Any = None,
                       async_op: bool = False, timeout: Any = None) -> Any:
        """Reduce ``x`` over all ranks and return this rank's block of rows.

        ``x.shape[0]`` must be divisible by ``size`` (else ``ValueError``); the
        result is a new array of shape ``(x.shape[0] // size, *x.shape[1:])``
        holding rows ``rank * n // size`` to ``(rank + 1) * n // size`` of the
        reduction. ``x`` is not modified.
        """
        return self._run(REDUCE_SCATTER, x, op, -1, out, async_op, None, timeout)

    def gather(self, x: Any, dst: int = 0, *, out: Any = None, async_op: bool = False, timeout: Any = None) -> Any:
        """Gather every rank's ``x`` on rank ``dst``: there a new ``(size, *x.shape)``
        array (row ``r`` is rank ``r``'s ``x``), ``None`` on the other ranks.

        ``out=`` is used on ``dst`` only (the other ranks may pass ``None``).
        """
        return self._run(GATHER, x, None, dst, out, async_op, None, timeout)

    def scatter(self, x: Any, src: int = 0, *, out: Any = None, async_op: bool = False, timeout: Any = None) -> Any:
        """Hand row ``r`` of rank ``src``'s ``x`` to rank ``r``.

        Every rank passes ``x`` of the same shape ``(size, *rest)`` and dtype (only
        ``src``'s content is read; ``x`` is never modified). Returns a new array of
        shape ``rest`` (or ``out``).
        """
        return self._run(SCATTER, x, None, src, out, async_op, None, timeout)

    def all_to_all(self, x: Any, send_splits: Sequence[int] | None = None, *, out: Any = None,
                   async_op: bool = False, timeout: Any = None) -> Any:
        """Every rank sends a block of rows to every rank.

        Equal form (``send_splits=None``): ``x`` has shape ``(size, *rest)``; row ``j``
        goes to rank ``j``, and row ``j`` of the result is what rank ``j`` sent here.
        Uneven form: ``send_splits`` is a list of ``size`` ints that sum to
        ``x.shape[0]``; rows ``[sum(send_splits[:j]), sum(send_splits[:j+1]))`` go to
        rank ``j``; the result is the concatenation, in rank order, of what every rank
        sent here. The counts travel first, in one small collective (every rank learns
        every rank's splits, so a wrong ``out`` or a shape mismatch is an error on every
        rank).
        """
        if send_splits is None:
            return self._run(ALL_TO_ALL, x, None, -1, out, async_op, None, timeout)
        return self._run(ALL_TO_ALL_V, x, None, -1, out, async_op, send_splits, timeout)

    def send(self, x: Any, dst: int, *, tag: int = 0, async_op: bool = False, timeout: Any = None) -> Any:
        """Send ``x`` to rank ``dst`` (matched by a :meth:`recv` there with the same ``tag``).

        Returns ``None``, or with ``async_op=True`` a :class:`Work`; ``x`` must not be
        changed until that has completed.
        """
        return self._run(SEND, x, None, dst, None, async_op, tag, timeout)

    def recv(self, x: Any, src: int | None, *, tag: int = 0, async_op: bool = False, timeout: Any = None) -> Any:
        """Receive into ``x``, in place, what rank ``src`` sent with ``tag``; returns ``x``.

        ``x`` must have the shape and dtype of the sender's array (in debug mode a
        difference is :class:`CollectiveMismatch`; otherwise the transport's error). ``src=None``:
        any source (mpi, torch's Gloo); the handle's ``source`` (``async_op=True``) says who sent.
        """
        return self._run(RECV, x, None, src, None, async_op, tag, timeout)


class CallPath(Collectives):
    """The call path of one communicator (``comm``): :meth:`_run`, the communicator's ``_run``,
    with the parts it calls read once, when the communicator is made (its argument checks and
    their plans, its CallCheck's forms, its kept handles, its context), and the state that only the
    call path reads on every call, which the communicator reads and sets through it: ``gate`` (the
    owner thread's id while the communicator is open and usable, else None), ``checking`` (the
    default check runs), ``ring`` (the flight recorder's, None when it is off) and ``operation``
    (the running call's); ``twins``: the compiled forms of per-array checks it runs instead (see
    :meth:`own_form`; ``out_fits``, a numpy array's or tensor's ``out=`` checked at once, is
    ``host_views.out_fits`` in this path's form). The running call's number stays the
    communicator's (``_seq``: the check reads it on every call). Compiled, its fields are typed (callpath.pxd)."""

    def __init__(self, comm: Any, gate: Any, checking: bool, ring: Any, twins: dict[Any, Any]) -> None:
        self.comm, self.gate, self.checking, self.ring, self.twins = comm, gate, checking, ring, twins
        self.operation = ""
        #: How many calls of this path are in their transport part now (nested: an emulation's
        #: calls): a compiled call blocked in the transport has no Python frame to show it.
        self.running = 0
        self.plans, self.checks, self.call_check = comm._plans, comm._checks, comm._call_check
        self.context = comm._context
        self.pending, self.reap, self.keep, self.handles = comm._pending, comm._reap, comm._keep, comm._handles
        self.check_call, self.carry_call, self.raise_failed = comm._check_call, comm._carry_call, comm._raise_failed
        self.check_counts = comm._check_counts
        self.p2p, self.hooks, self.size, self.debug = comm._p2p, comm._hooks, comm.size, comm.debug
        self.posting, self.stream_ordered, self.post_call = comm._posting, comm._stream_ordered, comm._post_call
        self.all_ordered = comm._transport._all_stream_ordered  # (every call: no per-call question)
        self.out_fits = twins.get(host_views.out_fits, host_views.out_fits)  # (a numpy or tensor out=)
        self.forget_kept()

    def forget_kept(self) -> None:
        """Forget the plan of the last kind of call (kept beside :attr:`plans`, as the same objects
        of its key: a loop of one kind looks nothing up); the plans are being forgotten
        (``CallContext.forget_plans``)."""
        self.kept: Any = None
        self.kept_call: Any = None
        self.kept_type: Any = None
        self.kept_dtype: Any = None
        self.kept_op: Any = None

    def own_form(self, check: Any) -> Any:
        """The per-array check ``check`` in this call path's form: where its function has a
        compiled twin (``twins``, given by :mod:`collectives.front` to a compiled call path: those of
        :mod:`collectives.host_views`), the twin bound to the same adapter."""
        twin = self.twins.get(getattr(check, "__func__", None))
        return check if twin is None else MethodType(twin, check.__self__)

    def _run(self, call: Call, x: Any, op: Any, root: Any, out: Any, async_op: Any,
             extra: Any = None, timeout: Any = None) -> Any:
        """Check, number, fingerprint, record, run and map the errors of one call of ``call``'s
        kind. A bad argument raises with nothing of the call sent and ``x`` untouched."""
        comm = self.comm
        if self.gate != _thread_id():  # closed, unusable, or another thread
            comm._check_open()
        if timeout is not None:
            return self.context.run_with_timeout(call, x, op, root, out, async_op, extra, timeout)
        try:
            if async_op is not False and async_op is not True:
                raise TypeError(f"async_op must be True or False; got {type(async_op).__name__}")
            # The plan of x's kind (its type and dtype, and op) that passed the checks before: the
            # last kind's where the key's objects are the same ones, else the plans'.
            plan = self.kept
            if plan is None or call is not self.kept_call or op is not self.kept_op or \
                    type(x) is not self.kept_type or getattr(x, "dtype", None) is not self.kept_dtype:
                try:
                    plan = self.plans[call, type(x), x.dtype, op]
                except (KeyError, TypeError, AttributeError):  # (its errors not raised inside the lookup's:
                    plan = None  # a user's TypeError is never chained under a KeyError)
                remembered = True
                if plan is None:  # a kind not seen yet: the full checks (ArgumentChecks.plan), remembered
                    check, *parts = self.checks.plan(call, x, op)
                    plan = Plan(call, self.own_form(check), *parts)
                    try:
                        self.plans[call, type(x), x.dtype, op] = plan
                    except TypeError:  # an unhashable op spelling or dtype: valid, just not remembered
                        remembered = False
                if remembered:
                    self.kept, self.kept_call, self.kept_op, self.kept_type, self.kept_dtype = \
                        plan, call, op, type(x), x.dtype
            # What can differ between two arrays of one kind, checked on every call; the first
            # call of a kind runs the same route as the later ones (the backend's fast path too).
            in_place = plan.in_place
            view = plan.check(x, in_place)
            if plan.root is not None and (type(root) is not int or not 0 <= root < self.size):  # noqa: E721
                if root is not None or not plan.any_root:  # (None: a recv from any source)
                    self.checks.check_rank(root, plan.root)  # (a bool is no rank)
            if plan.row_check is not None:  # (x's view has x's shape; a numpy view's, a tuple: no tensor read)
                rows = (x if view is None else view).shape
                plan.row_check(comm, rows if type(rows) is tuple else tuple(rows), extra, root)
            if out is not None and (plan.out_form == 0 or not self.out_fits(out, x, plan.out_form, self.size)):
                self.checks.check_out(call, x, plan.adapter, out, extra, root)  # (names the fault)
        except (TypeError, ValueError) as refusal:  # nothing sent; its number and check, marked refused:
            if self.checking and call.collective:  # the peers name this rank (CallCheck.refused)
                self.call_check.refused(call, x, op, root, refusal, comm._begin(call))
            raise
        if self.pending:
            self.reap()
        collective, dtype, reduce_op = plan.collective, plan.dtype, plan.reduce_op
        seq = comm._seq
        if collective:
            comm._seq = seq = seq + 1
        self.operation = plan.name
        ring, shape = self.ring, None
        if ring is not None:  # the flight recorder (collectives/diagnostics/recorder.py): a call with an end
            # time and no error has completed; the fast path's view's shape is a plain tuple (cheaper)
            shape = (x if view is None else view).shape
            record = [seq, call, dtype, shape, root, STARTED, _clock(), 0.0, None, None, reduce_op]
            ring.append(record)
        else:
            record = None
        self.running += 1  # (in the transport: what the SIGINT watcher asks, diagnostics/process_hooks.py)
        try:
            result, on_fast_path = NOT_TAKEN, view is not None and not (async_op or plan.counted or root is None)
            if self.checking and collective:
                if on_fast_path and plan.carry is not None:  # (carried where x fits its round)
                    result = self.carry_call(plan.carry, call, reduce_op, root, dtype, view, out, extra, shape)
                else:
                    if view is not x or shape is None:  # (x's shape, read once: the recorder's where it read x's)
                        shape = x.shape
                    if self.posting and (self.all_ordered or self.stream_ordered(x)):  # (beside a device stream's call)
                        self.post_call(call, reduce_op, root, dtype, shape, seq)
                    else:
                        self.check_call(call, reduce_op, root, dtype, shape, None, on_fast_path)
            if result is not NOT_TAKEN:
                pass  # x travelled in the check's round (see Transport._carried_path)
            elif on_fast_path and (result := plan.fast(view, root, out, extra)) is not NOT_TAKEN:
                pass  # the backend's fast path ran it (see Transport._fast_path)
            elif self.debug and not collective:
                result = self.p2p.run(call, x, plan.adapter, dtype, root, async_op, extra)
            else:  # the row's transport method; its calls.Request refilled in two 3s (no tuple built)
                request = plan.request
                request.x, request.root, request.out = x, root, out
                request.async_op, request.extra, request.view = async_op, extra, view
                if plan.counted:  # the uneven rows: the counts exchange puts every rank's in extra (in
                    # the check's round where the transport carries them, the check on or off:
                    # CallCheck.check_counts)
                    if not self.check_counts(request):
                        emulations.counted(comm, request)
                result = plan.method(request)
                request.x = request.out = request.carried = request.view = None  # (the record keeps no array alive)
        except Exception as error:
            self.raise_failed(record, error)
        finally:
            self.running -= 1
        if record is not None:
            record[END] = _clock()
            if self.hooks:
                comm._call_hooks(record)
        if async_op:
            if type(result) is not Work:  # a handle that may still be running: keep it
                if record is not None:  # (completed once the communicator learns it has)
                    record[STATE] = POSTED
                if collective:
                    self.keep(result, record)
                else:
                    self.handles.keep_p2p(result)
            return result
        return x if in_place else result

