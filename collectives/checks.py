"""The call path's argument checks, and the plans that let a kind of array skip them.

Every call is checked before anything is sent, on every backend, so a bad argument is
the same ``TypeError``/``ValueError`` everywhere with the input untouched. A
:class:`collectives.Communicator` holds one :class:`ArgumentChecks` (given its transport and
size); ``Communicator._run`` calls its methods. The checks of ``split``'s arguments and of
the calling thread are here too.

Imports: arrays, calls, errors, ops and the transport protocol (never the communicator).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from . import arrays, calls, host_views
from .arrays import ArrayAdapter
from .calls import NOT_TAKEN, Call, Request, is_int
from .errors import CollectiveError
from .ops import ReduceOp, check_reduction, resolve_op
from .transport import Transport

# What the calls of a kind (row, type(x), x.dtype, op as spelled or None) that passed the checks
# run: (per-array check, fast path, carried path or None, adapter, dtype name, ReduceOp or None,
# the kind's request record, the transport's method of the row, bound, the rule of a numpy out='s
# shape or 0); the call path remembers it, with what it reads of the row, as a
# collectives.callpath.Plan.
Plan = tuple[Callable[[Any, bool], Any], Callable[[Any, Any, Any, Any], Any],
             Callable[[Any, Any, Any, Any, int], tuple[int, Any]] | None, ArrayAdapter, str,
             ReduceOp | None, Request, Callable[[Request], Any], int]

# Calls whose out= rows are known only once the counts have travelled (checked then).
_OUT_SHAPE_AFTER_COUNTS = frozenset({"all_gather_v", "all_to_all"})
_C_INT_MAX = 2**31 - 1


class ArgumentChecks:
    """The checks of the call path for one communicator: of ``size`` ranks, over ``transport``
    (its device check, its fast paths). ``size`` is also what the rows' shape rules read."""

    __slots__ = ("_transport", "size", "plans", "_checks_device", "debug")

    def __init__(self, transport: Transport, size: int) -> None:
        self._transport = transport
        self.size = size
        #: The plans of the kinds of arrays that passed the checks (see :meth:`plan`), as the call
        #: path keeps them (:class:`collectives.callpath.Plan`), by (row, type(x), x.dtype, op).
        self.plans: dict[tuple[Any, ...], Any] = {}
        # Whether the backend checks the device of every array (else the per-array check skips
        # _check_device; check_kind makes it once per kind where the backend has one).
        self._checks_device = type(transport)._check_device is not Transport._check_device and \
            transport._check_device_per_array
        #: Debug mode (set by the communicator): send and recv take no fast path (headers go first).
        self.debug = False

    # The checks run on every call. _run first looks the kind of x (its type and dtype,
    # and op) up among the kinds that passed before on this communicator, for this row of
    # the table, and then checks only what can differ from one array to the next (memory,
    # writable, device); a kind not seen yet goes through the full checks below. The order
    # of the checks, and so which error a call with several faults gets, is the same on
    # both paths.

    def check_kind(self, x: Any, op: Any, reduces: bool, in_place: bool
                    ) -> tuple[ArrayAdapter, str, ReduceOp | None]:
        """The adapter and dtype name of ``x`` and, for a reduction, the ReduceOp; for
        ``in_place`` also that x is writable."""
        adapter = arrays.adapter_for(x)
        dtype = adapter.dtype_name(x)
        adapter.check_array(x, in_place)
        if self._checks_device:
            self._transport._check_device(x, adapter)
        reduce_op = check_reduction(dtype, op) if reduces else None
        return adapter, dtype, reduce_op

    def plan(self, call: Call, x: Any, op: Any) -> Plan:
        """The full checks of a kind of ``x`` (and ``op``) not seen before by ``call``, and
        what later calls of that kind run (the call path remembers it in :attr:`plans`, and
        looks it up there first): the per-array check (the backend's own where it has one for its fast
        path, ``Transport._array_check``), the backend's
        fast path if it has one (``Transport._fast_path``; not for the uneven collectives, which
        exchange their counts first, nor for send/recv in debug mode), with it the carried path
        of a collective if the transport has one (``Transport._carried_path``), the adapter, dtype name
        and ReduceOp, the kind's request record (see :class:`~collectives.calls.Request`),
        the transport's method for the kind (``Transport._method_of``: the row's, or one the
        backend bound for the kind) and, for a numpy array or torch tensor x, the rule of its
        result's shape that the call path checks an ``out=`` against at once (``host_views.out_fits``:
        a tensor's with ``host_views.TENSOR`` set; 0: only :meth:`check_out`, which the call path
        runs where that check does not pass)."""
        adapter, dtype, reduce_op = self.check_kind(x, op, call.reduces, call.in_place)
        fast = self._transport._fast_path(call, adapter, dtype, reduce_op) \
            if not call.counted and (call.collective or not self.debug) else None
        # The per-array check: with a fast path, the one that also returns x's view, the backend's
        # own (its device check in it) or x's host view (without, check_array's None means the
        # fast path, never taken, is never called), and for the uneven rows (their method gets
        # it: Request.view); then the backend's device check, where it has one for every array.
        check: Callable[[Any, bool], Any] | None = None
        if fast is not None:
            check = self._transport._array_check(adapter)
        if check is None:
            check = adapter.check_array if fast is None and not call.counted else adapter.host_view
            if self._checks_device:
                check = self.checked_device(check, adapter)
        carry = None if fast is None or not call.collective else \
            self._transport._carried_path(call, adapter, dtype, reduce_op)
        return (check, fast or _no_fast_path, carry, adapter, dtype, reduce_op,
                Request(call, None, adapter, dtype, reduce_op),
                self._transport._method_of(call, adapter, dtype, reduce_op),
                _out_form(call, adapter))

    def checked_device(self, check: Callable[[Any, bool], Any], adapter: ArrayAdapter
                        ) -> Callable[[Any, bool], Any]:
        """``check``, then the transport's ``_check_device`` (as in :meth:`check_kind`)."""
        def check_and_device(x: Any, in_place: bool) -> Any:
            view = check(x, in_place)
            self._transport._check_device(x, adapter)
            return view
        return check_and_device

    def check_out(self, call: Call, x: Any, adapter: ArrayAdapter, out: Any, extra: Any,
                   root: Any) -> None:
        """``out=`` must be an array of x's kind, dtype and device, contiguous and writable,
        of the result's shape (``ValueError``/``TypeError`` naming expected and got)."""
        if type(out) is type(x):
            # An out= that passes, in a few reads (any fault: the checks below name it; a
            # contiguous array has no zero stride on a dimension longer than 1).
            if adapter is _NUMPY:
                flags = out.flags
                if out.dtype == x.dtype and flags.c_contiguous and flags.writeable and \
                        self._out_shape_fits(call, out.shape, x.shape, extra):
                    return
            elif adapter is _TORCH and host_views.tensor_out_usable(out, x):
                try:  # (a nested tensor's shape raises: the checks below)
                    if self._out_shape_fits(call, out.shape, x.shape, extra):
                        return
                except RuntimeError:
                    pass
        if call.out_shape is None and call.name not in _OUT_SHAPE_AFTER_COUNTS:
            raise TypeError(f"{call.name} takes no out= argument")
        try:
            out_adapter = arrays.adapter_for(out)
        except TypeError:
            raise TypeError(f"out must be an array of x's type ({adapter.name}); got "
                            f"{arrays.type_name(type(out))}") from None
        if out_adapter is not adapter:
            raise TypeError(f"out must be a {adapter.name} array like x; got a {out_adapter.name} array")
        adapter.check_array(out, True, "out")  # its memory (layout, device kind, negative bit), writable
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

    def _out_shape_fits(self, call: Call, shape: tuple[int, ...], x_shape: tuple[int, ...], extra: Any) -> bool:
        """Whether an out= of ``shape`` has the result's shape (the uneven rows: its trailing
        shape; its rows are checked once the counts have travelled). A torch.Size is taken as
        it is: it equals the tuple of its sizes, and so do its slices."""
        if call.out_shape is not None:
            return bool(shape == call.out_shape(self, x_shape, extra))
        return call.name in _OUT_SHAPE_AFTER_COUNTS and len(shape) == len(x_shape) and shape[1:] == x_shape[1:]

    def check_rank(self, rank: Any, name: str) -> None:
        """``rank`` (the argument ``name``) is a rank of this communicator."""
        check_rank(rank, name, self.size)

    def check_any_source(self) -> None:
        """recv(src=None): ``ValueError`` where the transport has no recv from any source, or no
        other rank can send (before anything is sent)."""
        if self.size == 1:
            raise ValueError("src=None (any source) on a communicator of one rank: no other rank can send")
        if not self._transport._recv_any_source:
            raise ValueError(f"recv(src=None), from any source, is not available on the "
                             f"{self._transport.backend} backend (MPI has it, and torch's Gloo); name the src rank")


def check_rank(rank: Any, name: str, size: int) -> None:
    """``rank`` (the argument ``name``) is an int from 0 to ``size - 1``."""
    if isinstance(rank, bool) or not is_int(rank):
        raise TypeError(f"{name} must be an int rank; got {type(rank).__name__}")
    if not 0 <= rank < size:
        raise ValueError(f"{name}={rank} is out of range; valid ranks: 0 to {size - 1}")


def refused_call(call: Call, x: Any, op: Any, root: Any) -> tuple[ReduceOp | None, int, str | None, tuple[int, ...]]:
    """What a rank that refused a collective ``call`` of these arguments says of it in its
    fingerprint (``CallCheck.refused``): the reduce op, root, dtype and shape as far as they are
    valid (else None, -1, None, ()); an uneven row's dtype and shape as its check leaves them."""
    reduce_op = dtype = None
    shape: tuple[int, ...] = ()
    if call.reduces:
        try:
            reduce_op = resolve_op(op)
        except ValueError:
            pass
    if not call.counted:
        try:
            dtype = arrays.adapter_for(x).dtype_name(x)
            shape = tuple(int(n) for n in x.shape)
        except (TypeError, ValueError, AttributeError):
            pass
    if isinstance(root, bool) or not is_int(root) or not -1 <= root < 2**62:
        root = -1
    return reduce_op, int(root), dtype, shape


def check_split(color: Any, key: Any) -> None:
    """``split``'s arguments: ``color`` a non-negative int or ``None``, ``key`` an int or
    ``None``, both in the range of C ints (MPI takes C ints; torch's int64 would allow more)."""
    for name, value in (("color", color), ("key", key)):
        if value is not None and (isinstance(value, bool) or not is_int(value)):
            raise TypeError(f"{name} must be an int or None; got {type(value).__name__}")
    if color is not None and int(color) < 0:
        raise ValueError(f"color must be >= 0 (or None to join no group); got {color}")
    if color is not None and int(color) > _C_INT_MAX:
        raise ValueError(f"color must be at most 2**31 - 1 = {_C_INT_MAX}; got {color}")
    if key is not None and not -_C_INT_MAX - 1 <= int(key) <= _C_INT_MAX:
        raise ValueError(f"key must be between -2**31 and 2**31 - 1; got {key}")


def _no_fast_path(view: Any, root: Any, out: Any, extra: Any) -> Any:
    return NOT_TAKEN


_NUMPY = arrays.NUMPY
_TORCH = arrays.TORCH
#: The out= shapes the call path checks at once on a numpy or tensor out= (host_views.out_fits), by
#: the row's rule (and the uneven rows', see _out_form); other arrays are checked by check_out alone.
_OUT_FORMS: dict[Callable[[Any, tuple[int, ...], Any], tuple[int, ...]], int] = {
    calls.stacked: host_views.STACKED, calls.block_of_rows: host_views.BLOCK_OF_ROWS,
    calls.one_row: host_views.ONE_ROW, calls.same_shape: host_views.SAME_SHAPE}


def _out_form(call: Call, adapter: ArrayAdapter) -> int:
    """The rule of ``call``'s result shape for the call path's check of an ``out=`` at once (see
    ``_OUT_FORMS``; the uneven rows': ``host_views.ROWS_LATER``): a torch tensor's with
    ``host_views.TENSOR`` set; 0 for other arrays and for rows that take no ``out=``."""
    if call.out_shape is not None:
        form = _OUT_FORMS.get(call.out_shape, 0)
    else:
        form = host_views.ROWS_LATER if call.name in _OUT_SHAPE_AFTER_COUNTS else 0
    if form == 0 or adapter is _NUMPY:
        return form
    return form | host_views.TENSOR if adapter is _TORCH else 0


def in_backward_pass() -> bool:
    """Whether this thread is running a backward pass of torch's autograd engine (which
    runs CUDA backward functions on threads of its own, for the thread that called
    ``backward()``)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch._C._current_graph_task_id() != -1


def wrong_thread(comm: Any) -> CollectiveError:
    """The error of a call on ``comm`` from a thread other than its owner's."""
    import threading  # noqa: PLC0415  (only for the message)

    return CollectiveError(
        f"{comm!r} takes calls from one thread, the one that created it (or last "
        f"called bind_thread()); this call came from thread "
        f"{threading.current_thread().name!r}. Two threads on one communicator would "
        "mix up their calls between ranks: give each thread a communicator of its "
        "own (split() in the owning thread, then bind_thread() in the other)")
