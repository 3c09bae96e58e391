"""The table of calls: one row per collective, read by the one call path of
:class:`collectives.Communicator`.

Each row says what the call path checks for that collective (is ``op`` reduced and
checked against the dtype x op table, is ``x`` written in place, which argument is a
root rank, which shapes are allowed, what shape an ``out=`` array must have), what the
ranks compare before it, and which method of the backend does
the work. Adding a collective is adding a row here and a public method (in
``collectives.callpath.Collectives``) that hands its arguments to ``Communicator._run``; the
checks, the sequence number, the fingerprint, the timeout and the error mapping come with the
path, never with the method.

The call path hands the transport one :class:`Request` per call (a record with slots, made
once per kind of call and refilled per call); the row names the transport's method that takes
it (:attr:`Call.method`).

Imports: nothing of the package at run time (arrays and ops for annotations only).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .arrays import ArrayAdapter

Shape = tuple[int, ...]


@dataclass(frozen=True, eq=False, slots=True)
class Call:
    """How the call path treats one collective (hashed by identity: a key of the call
    path's plans)."""

    #: The operation's name, as error messages and fingerprints show it.
    name: str
    #: ``op`` is a reduce op, checked against the dtype x op table.
    reduces: bool = False
    #: ``x`` is written in place (it must be writable; autograd tensors refused).
    in_place: bool = False
    #: The name of the root argument ("src" or "dst"), checked as a rank; ``None``: no root.
    root: str | None = None
    #: The root may be ``None``: any rank (recv from any source; the row's ``check`` checks it).
    any_root: bool = False
    #: ``False`` for point-to-point calls: they take no part in the communicator's
    #: sequence numbers or fingerprints (only two ranks make them).
    collective: bool = True
    #: ``ValueError`` for shapes (and extra arguments) this collective cannot take:
    #: ``(comm, x.shape, extra, root)``.
    check: Callable[[Any, Shape, Any, Any], None] | None = None
    #: The shape an ``out=`` array must have, from x's shape (and the extra argument).
    out_shape: Callable[[Any, Shape, Any], Shape] | None = None
    #: The ranks' dtypes and shapes are compared by a counts exchange of the call's own (the
    #: uneven collectives: their rows differ by design): the check before the call compares
    #: only its kind and sequence number (or, where the transport carries the counts in the
    #: check's round, also dtype and ``x.shape[1:]``: ``CallCheck.check_counts``).
    counted: bool = False
    #: The name of the :class:`~collectives.transport.Transport` method that does the work,
    #: given the call's :class:`Request`. Calls with a path of their own (barrier, split): "".
    method: str = ""
    #: The operation's code in the ranks' fingerprints (collectives.wire): a wire format, so
    #: a new operation takes the next free code and no code ever changes.
    code: int = -1
    #: nccl-tests' bus bandwidth factor is ``bus_steps * (n - 1) / n`` on n ranks (2 for
    #: all_reduce, 1 for the calls that move each rank's block once); 0: a factor of 1.
    bus_steps: int = 0


class _NotTaken:
    """What a transport's fast path returns for an array it cannot take (see
    :meth:`collectives.transport.Transport._fast_path`): the row's method runs the call."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_TAKEN"


NOT_TAKEN: Any = _NotTaken()


class Request:
    """One call, as the call path hands it to a transport's method (its row's
    :attr:`Call.method`), after every check passed.

    A communicator keeps one record per kind of call (row, type and dtype of x, op), made when
    the kind first passes the checks with what stays the same (the row, the adapter, the dtype,
    the op); each call refills the rest (x, root, out, async flag, extra) and empties x and
    out once the method returned: no record to make, so the call path costs no more than
    positional arguments. A transport reads the record during the call and keeps what it
    needs, never the record (a handle keeps the arrays). A transport that calls another of its
    methods makes one with keywords (``Request(ALL_GATHER, x, adapter, dtype)``) or
    ``request._replace(...)``.
    """

    __slots__ = ("call", "x", "adapter", "dtype", "op", "root", "out", "async_op", "extra", "carried", "view")

    #: The row of the call being run (an emulation's inner call names its own row).
    call: Call
    #: The array: reduced or written in place (the rows with ``in_place``), else read.
    x: Any
    #: x's :class:`~collectives.arrays.ArrayAdapter`.
    adapter: ArrayAdapter
    #: x's dtype name (a key of :data:`collectives.ops.DTYPES`).
    dtype: str
    #: The :class:`~collectives.ReduceOp`, allowed on ``dtype`` (the rows that reduce); ``None``
    #: for the others.
    op: Any
    #: The root (``src``/``dst``) or the peer of a send/recv, a valid rank; -1: none. A recv from
    #: any source has ``None`` (only on a transport with ``_recv_any_source``; its handle's
    #: ``source`` says which rank sent), typed as a rank for the other calls' sake.
    root: int
    #: Where the result goes (checked shape and dtype), or ``None``: a new array.
    out: Any
    #: Return a :class:`~collectives.Work` (a handle) instead of waiting.
    async_op: bool
    #: The row's extra argument: the tag (send, recv), every rank's row counts (all_gather_v,
    #: after the counts exchange), the splits ``splits[i][j]`` (uneven all_to_all, after it).
    extra: Any
    #: Every rank's x (its bytes, one row per rank), where an uneven call's x travelled with its
    #: counts in the check's round (``Transport._agree_counts``): the method makes the result
    #: from it, no data collective; the same where every rank's x was a host view the round
    #: marked but not all travelled (larger than its block: the rows say so, and the method
    #: may move them its own way); else ``None``.
    carried: Any
    #: x's view where the call path made one: what the plan's per-array check returned (an
    #: uneven call's x of host memory, see ``ArrayAdapter.host_view``: a C-contiguous numpy array
    #: of its memory; on a kind with a fast path, what the backend's fast path takes, see
    #: ``Transport._array_check``), else ``None``.
    view: Any

    def __init__(self, call: Call, x: Any, adapter: ArrayAdapter, dtype: str, op: Any = None,
                 root: int = -1, out: Any = None, async_op: bool = False, extra: Any = None,
                 carried: Any = None, view: Any = None) -> None:
        self.call, self.x, self.adapter, self.dtype, self.op = call, x, adapter, dtype, op
        self.root, self.out, self.async_op, self.extra, self.carried = root, out, async_op, extra, carried
        self.view = view

    def _replace(self, **fields: Any) -> Request:
        """A new record: this one's fields, ``fields`` changed."""
        made = Request(self.call, self.x, self.adapter, self.dtype, self.op, self.root, self.out,
                       self.async_op, self.extra, self.carried, self.view)
        for name, value in fields.items():
            setattr(made, name, value)
        return made

    def __repr__(self) -> str:
        return (f"Request({self.call.name}, dtype={self.dtype}, op={self.op}, root={self.root}, "
                f"async_op={self.async_op}, extra={self.extra!r})")


# -- shape rules ---------------------------------------------------------------------------

def rows_divisible(comm: Any, shape: Shape, extra: Any, root: Any) -> None:
    if not shape:
        raise ValueError("reduce_scatter needs x with at least one dimension; got a 0-d array")
    if shape[0] % comm.size:
        raise ValueError(f"reduce_scatter needs x.shape[0] divisible by size={comm.size}; "
                         f"got x.shape={shape}")


def rows_equal_size(name: str) -> Callable[[Any, Shape, Any, Any], None]:
    def check(comm: Any, shape: Shape, extra: Any, root: Any) -> None:
        if not shape or shape[0] != comm.size:
            raise ValueError(f"{name} needs x of shape (size, ...) with size={comm.size} rows, "
                             f"one per rank; got x.shape={shape}")
    return check


def at_least_one_dim(name: str) -> Callable[[Any, Shape, Any, Any], None]:
    def check(comm: Any, shape: Shape, extra: Any, root: Any) -> None:
        if not shape:
            raise ValueError(f"{name} needs x with at least one dimension (rows); got a 0-d array")
    return check


def check_splits(comm: Any, shape: Shape, splits: Sequence[int], root: Any) -> None:
    """``send_splits``: ``size`` non-negative ints that sum to ``x.shape[0]``."""
    if not shape:
        raise ValueError("all_to_all with send_splits needs x with at least one dimension; "
                         "got a 0-d array")
    if isinstance(splits, (str, bytes)) or not hasattr(splits, "__len__"):
        raise TypeError(f"send_splits must be a list of {comm.size} ints (rows for each rank) "
                        f"or None; got {type(splits).__name__}")
    if len(splits) != comm.size:
        raise ValueError(f"send_splits must have one entry per rank (size={comm.size}); "
                         f"got {len(splits)}")
    total = 0
    for count in splits:  # (one loop, no generator: this runs on every uneven all_to_all)
        if type(count) is not int and (isinstance(count, bool) or not is_int(count)):  # (an int at once)
            raise TypeError(f"send_splits must hold ints; got {type(count).__name__}")
        if count < 0:
            raise ValueError(f"send_splits must be >= 0; got {list(splits)}")
        total += int(count)
    if total != shape[0]:
        raise ValueError(f"send_splits must sum to x.shape[0]={shape[0]}; got {list(splits)} (sum {total})")


#: The tag of the barrier's own messages under a timeout (see ``Communicator.barrier``): a
#: user's send of this tag could be taken for a rank's arrival, so send/recv refuse it.
BARRIER_TAG = 32767
#: The tag of a rank's farewell on MPI (see collectives.farewell), refused by send/recv too.
FAREWELL_TAG = 32766
#: The tag of a reduce's own messages on a torch group with Gloo of two ranks (the rank off dst
#: sends x to dst: see collectives/backends/torch_reduce.py), refused by send/recv too.
REDUCE_TAG = 32765
RESERVED_TAGS = (BARRIER_TAG, FAREWELL_TAG, REDUCE_TAG)


def peer_and_tag(name: str) -> Callable[[Any, Shape, Any, Any], None]:
    """send/recv: the peer is another rank (a recv's may be ``None``: any source, where the
    communicator has another rank); ``tag`` a non-negative int other than BARRIER_TAG."""
    def check(comm: Any, shape: Shape, tag: Any, peer: Any) -> None:
        if type(tag) is int and 0 <= tag < REDUCE_TAG and peer != comm.rank and peer is not None:  # noqa: E721
            return  # (the usual tags, below the reserved ones: one test)
        if peer is None:
            comm._checks.check_any_source()
        if peer == comm.rank:
            raise ValueError(f"{name}={peer} is this rank; point-to-point calls go to another "
                             f"rank (valid: 0 to {comm.size - 1} except {comm.rank})")
        if isinstance(tag, bool) or not is_int(tag):
            raise TypeError(f"tag must be an int; got {type(tag).__name__}")
        if not 0 <= tag < 2**31 - 1:
            raise ValueError(f"tag must be between 0 and 2**31 - 2; got {tag}")
        if tag in RESERVED_TAGS:
            raise ValueError(f"tag {tag} is reserved for the library's own messages (the "
                             f"barrier's, a rank's farewell, a reduce's); use any other tag between 0 "
                             f"and 2**31 - 2 except {REDUCE_TAG}, {FAREWELL_TAG} and {BARRIER_TAG}")
    return check


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int or a numpy integer (not a float, str or None)."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


# -- out= shapes ----------------------------------------------------------------------------

def stacked(comm: Any, shape: Shape, extra: Any) -> Shape:
    return (comm.size, *shape)


def block_of_rows(comm: Any, shape: Shape, extra: Any) -> Shape:
    return (shape[0] // comm.size, *shape[1:])


def one_row(comm: Any, shape: Shape, extra: Any) -> Shape:
    return tuple(shape[1:])


def same_shape(comm: Any, shape: Shape, extra: Any) -> Shape:
    return tuple(shape)


# -- the table: one row per collective ------------------------------------------------------
# Each row's ``method`` names the transport's method that takes the call's Request.

ALL_REDUCE = Call(
    "all_reduce", reduces=True, in_place=True, code=0, bus_steps=2, method="_all_reduce")
BROADCAST = Call(
    "broadcast", in_place=True, root="src", code=1, method="_broadcast")
REDUCE = Call(
    "reduce", reduces=True, in_place=True, root="dst", code=6, method="_reduce")
ALL_GATHER = Call(
    "all_gather", out_shape=stacked, code=2, bus_steps=1, method="_all_gather")
ALL_GATHER_V = Call(
    "all_gather_v", check=at_least_one_dim("all_gather_v"), counted=True, code=10, bus_steps=1,
    method="_all_gather_v")
REDUCE_SCATTER = Call(
    "reduce_scatter", reduces=True, check=rows_divisible, out_shape=block_of_rows, code=3, bus_steps=1,
    method="_reduce_scatter")
GATHER = Call(
    "gather", root="dst", out_shape=stacked, code=7, bus_steps=1, method="_gather")
SCATTER = Call(
    "scatter", root="src", check=rows_equal_size("scatter"), out_shape=one_row, code=8, bus_steps=1, method="_scatter")
ALL_TO_ALL = Call(
    "all_to_all", check=rows_equal_size("all_to_all"), out_shape=same_shape, code=9, bus_steps=1, method="_all_to_all")
ALL_TO_ALL_V = Call(
    "all_to_all", check=check_splits, counted=True, code=9, bus_steps=1,
    method="_all_to_all_v")
SEND = Call(
    "send", root="dst", collective=False, check=peer_and_tag("dst"), code=11, method="_send")
RECV = Call(
    "recv", in_place=True, root="src", any_root=True, collective=False, check=peer_and_tag("src"), code=12,
    method="_recv")
BARRIER = Call("barrier", code=4)
SPLIT = Call("split", code=5)

#: Every row, in the order reports list them (the profile's table, the benchmark's ``all``).
ROWS = (ALL_REDUCE, BROADCAST, REDUCE, ALL_GATHER, ALL_GATHER_V, REDUCE_SCATTER, GATHER, SCATTER,
        ALL_TO_ALL, ALL_TO_ALL_V, SEND, RECV, BARRIER, SPLIT)
#: The operations' names, in that order (the uneven all_to_all is all_to_all).
OPERATIONS = tuple(dict.fromkeys(row.name for row in ROWS))
_BUS_STEPS = {row.name: row.bus_steps for row in ROWS}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for operation ``op`` (a name of :data:`OPERATIONS`, or
    ``all_to_all_v``) on ``n`` ranks: ``bus_steps * (n - 1) / n`` of its row, 1 for a row
    without bus steps and for a name of no row (``send_recv``)."""
    steps = _BUS_STEPS.get(op.removesuffix("_v") if op == "all_to_all_v" else op, 0)
    return steps * (n - 1) / n if steps else 1.0
