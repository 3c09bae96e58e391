"""Small collectives carried in the check's round: one MPI call where the default check and the
data would take two.

With the default check on, every collective starts with the check's round, on up to
COUNTS_RANKS ranks an MPI_Allgather of one fixed block per rank (see ``MPIChannel._round``): the
check word, the uneven collectives' counts and CARRY_BYTES of payload. A call whose host ``x``
fits there puts its bytes in its block and sets bit 63 of its word (:data:`CARRIED`): the
collectives of even shapes through :func:`carried_path`, the uneven ones with their counts
(``MPIChannel._agree_counts``, then backends/mpi_uneven.py).
A call of even shapes on the fast path whose ``x`` is larger makes the same round with its word
alone (bit 63 set: it runs on the fast path; every rank of the same call has ``x`` of the same
size, as the word hashes its shape and dtype), then runs as usual: its check costs no Python.
Once the round is back every rank holds every rank's ``x``, and each call makes its result from
them locally (a reduction in rank order, so every rank computes the same bits; the rows of a
gather; a block of an all_to_all). The data collective is not made.

Every rank decides from what it sees alone (an asynchronous call, a non-contiguous or device
``x`` and a debug-mode call do not carry), and the round tells it what the others did: the
result is made only where every rank's word agrees and every rank carried; where the words
agree but a rank did not carry, every rank runs the call as usual (the data collective after
the round); where they disagree, the check's :class:`CollectiveMismatch`, ``x`` untouched. The
round is the same MPI call for a carried call and for any other call's check, so ranks in
different calls always meet in it.

A reduction carries only where MPI reduces the dtype x op as it is (the fast path's pairs; not
float MIN/MAX, which order NaN, nor the staged dtypes): MPI_Reduce_local of the op, MPI's own
arithmetic, rank 0's x first.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from collectives import calls, config
from collectives.calls import NOT_TAKEN
from collectives.ops import ReduceOp
from collectives.wire import FAST_BIT

from .mpi_staged import STAGED_BYTES, staged_table

try:
    import cython
except ImportError:  # (the Python form where Cython is not installed)
    from types import SimpleNamespace

    cython = SimpleNamespace(compiled=False)

#: Bit 63 of a check word (collectives.wire.FAST_BIT): this rank's x travels in its block.
CARRIED = FAST_BIT
#: A check word's bits but :data:`CARRIED`.
WORD_BITS = (1 << 63) - 1

#: The bytes of x a call carries in the check's round at most.
CARRY_BYTES = 1024
#: Shapes per carried path whose views into the round's blocks are kept at most.
CARRIED_SHAPES = 1024

Carry = Callable[[Any, Any, Any, Any, int], "tuple[int, Any]"]


class KeptView:
    """The numpy view of the last CPU tensor :meth:`of` was given: ``t.numpy()`` costs about 0.7 us,
    the test that the kept view still shows ``t`` about 0.2 (t is the tensor it was made of, at the
    same data pointer and of the same shape: the view holds that tensor, so no other has its id).
    The caller has checked the rest (a plan's x, the call path's ``out=``: a plain contiguous
    tensor of the kind's dtype). It holds that tensor's memory until another takes its place."""

    __slots__ = ("key", "ptr", "view")

    def __init__(self) -> None:
        self.key, self.ptr = -1, 0
        self.view: Any = None

    def of(self, t: Any) -> Any:
        """``t``'s numpy view."""
        view = self.view
        if id(t) == self.key and t.data_ptr() == self.ptr and t.shape == view.shape:
            return view
        view = self.view = t.numpy()
        self.key, self.ptr = id(t), t.data_ptr()
        return view


def new_result(tensors: bool) -> Callable[[Any, tuple[int, ...], Any], tuple[Any, Any]]:
    """``new(view, shape, out)``: a carried call's result (``out`` where given; a CPU tensor for a
    tensor's ``view``) and its numpy view. A new tensor is a numpy array's (``torch.from_numpy``:
    0.8 us where ``torch.empty`` and its numpy view take 2.0; torch looked up when one is made, so
    that a function for tensors can be made before torch is imported). An ``out`` that is a numpy
    array is its own view, also for tensors; a tensor's is kept (:class:`KeptView`)."""
    kept = KeptView()

    def new(view: Any, shape: tuple[int, ...], out: Any) -> tuple[Any, Any]:
        if out is not None:
            return out, kept.of(out) if tensors and not isinstance(out, np.ndarray) else out
        result = np.empty(shape, view.dtype)
        return (sys.modules["torch"].from_numpy(result) if tensors else result), result
    return new


#: The kinds of carried call (Carrier.kind), by the collective.
KINDS = {calls.ALL_REDUCE: 0, calls.REDUCE: 1, calls.REDUCE_SCATTER: 2, calls.BROADCAST: 3, calls.ALL_GATHER: 4,
         calls.GATHER: 5, calls.SCATTER: 6, calls.ALL_TO_ALL: 7}
#: The reductions the compiled form makes in C (plain C arithmetic, MPI's result bit for bit:
#: integers wrap, float SUM and PROD are IEEE's), by (dtype, op): (its code, the dtype's bytes);
#: the others (bool, float16) through mpi4py's MPI_Reduce_local, as the Python form does.
ARITHMETIC = {(dtype, op): (10 * t + o, size)
              for t, (dtype, size) in enumerate((("int8", 1), ("uint8", 1), ("int16", 2), ("int32", 4), ("int64", 8),
                                                 ("float32", 4), ("float64", 8)))
              for o, op in enumerate(("sum", "prod", "min", "max", "band", "bor", "bxor", "avg"))
              if t < 5 and op != "avg" or t >= 5 and op in ("sum", "prod", "avg")}


def carried_path(channel: Any, call: Any, dtype: str, op: ReduceOp | None, tensors: bool) -> Carry | None:
    """The carried form of ``call`` on host arrays of ``dtype`` (and ``op``) over ``channel`` (an
    MPIChannel): ``carry(view, root, out, extra, word)`` -> ``(AND of the ranks' words, result)``,
    the result NOT_TAKEN unless every rank agreed and carried (``tensors``: x is a CPU tensor,
    ``view`` its numpy view): a :class:`Carrier`'s ``run``. None where the channel's round
    carries nothing or the call cannot be carried."""
    state = channel.round
    if not state.gathers or call not in KINDS:
        return None
    mpi_type: Any = None
    local: Any = None
    if call.reduces:  # (MPI_Reduce_local: MPI's own arithmetic, where MPI reduces the pair as it is)
        spec = channel._native[dtype].get(op) if op is not None else None
        if spec is None:
            return None
        mpi_type, local = spec[0], spec[1].Reduce_local
    carrier = Carrier(state, call, dtype, op, tensors, mpi_type, local)
    carrier.channel, carrier.staged = channel, staged_table(channel, call, dtype, op)
    return carrier.run


class Carrier:
    """The carried form of one kind of call (``call``, ``dtype``, ``op``) over the round ``round_``
    (the channel's :class:`~.mpi_round.Round`): :meth:`run`. Its Python form keeps numpy views
    of x's place in this rank's block and of every rank's x in the blocks, per shape (up to
    CARRIED_SHAPES: then forgotten and made again), and makes the result with numpy and
    MPI_Reduce_local (:func:`result_maker`); the compiled form copies bytes with ``memcpy`` and
    reduces in C where the op is plain C arithmetic (:data:`ARITHMETIC`; mpi_carried.pxd)."""

    def __init__(self, round_: Any, call: Any, dtype: str, op: ReduceOp | None, tensors: bool, mpi_type: Any,
                 local: Any) -> None:
        self.round = round_
        self.size, self.rank, self.start = round_.size, round_.rank, round_.payload_offset
        self.kind = KINDS[call]
        self.avg = op is ReduceOp.AVG
        #: Whether only the root's x is read (broadcast, scatter), and whether x is the result.
        self.on_root = call is calls.BROADCAST or call is calls.SCATTER
        self.writes_x = call is calls.ALL_REDUCE or call is calls.REDUCE or call is calls.BROADCAST
        self.mpi_type, self.local = mpi_type, local
        self.new = new_result(tensors)
        self.arith, self.item = ARITHMETIC.get((dtype, "" if op is None else op.value), (-1, 1))
        make = result_maker(call, self.size, self.rank, self.new, mpi_type, local, self.avg)
        if make is None:  # (every kind of KINDS has one)
            raise ValueError(f"{call.name} is not carried")
        self.make = make
        self.places: dict[Any, Any] = {}
        self.shapes: dict[Any, tuple[list[Any], Any]] = {}
        self.held = False
        #: Whether the call has a root; the channel and its table of staged requests of this kind
        #: of call (None: it keeps none), the most bytes of x they take (see :func:`staged_call`).
        self.rooted = call in (calls.REDUCE, calls.BROADCAST, calls.GATHER, calls.SCATTER)
        self.channel: Any = None
        self.staged: dict[Any, tuple[Any, Any]] | None = None
        self.staged_bytes = STAGED_BYTES

    def run(self, view: Any, root: Any, out: Any, extra: Any, word: int) -> tuple[int, Any]:
        """The call carried in the round about to run (the payload every rank's alike, see
        backends/mpi_round.py): ``(AND of the ranks' words, result)``, NOT_TAKEN where x is past
        the payload (the round of the word alone: every rank of this call has x of this size),
        a rank did not carry, or the ranks made different calls."""
        round_ = self.round
        if round_ is None:
            raise RuntimeError("a Carrier is made by carried_path")
        n = hold(self, view)
        try:
            round_.wants(n)
            if n > round_.carry_bytes:  # the round of the word alone (every rank of this call: x this size)
                reduced = round_.run(marked(word))
                if reduced >= 0 or unmarked(reduced) != word:
                    return unmarked(reduced), NOT_TAKEN
                return word, staged_call(self, view, root, out)
            if not self.on_root or root == self.rank:
                place(self, view)
            reduced = round_.run(marked(word))
            if reduced >= 0 or unmarked(reduced) != word:  # a rank did not carry, or another call
                return unmarked(reduced), NOT_TAKEN
            return word, made(self, view, root, out)
        finally:
            release(self)

    def place_numpy(self, view: Any) -> None:
        """x into its place in this rank's block (the same in either size of block)."""
        into = self.places.get(view.shape)
        if into is None:
            if len(self.places) >= CARRIED_SHAPES:
                self.places.clear()
            into = self.places[view.shape] = np.ndarray(view.shape, view.dtype, buffer=self.round.block,
                                                        offset=self.start)
        into[...] = view

    def made_numpy(self, view: Any, root: Any, out: Any) -> Any:
        """The result from every rank's x in the blocks of the size the round ran with, as numpy
        views (a list and one array)."""
        blocks = self.round.blocks
        shape, stride = view.shape, blocks.strides[0]
        found = self.shapes.get((shape, stride))
        if found is None:
            if len(self.shapes) >= CARRIED_SHAPES:
                self.shapes.clear()
            rows = np.ndarray((self.size, *shape), view.dtype, buffer=blocks, offset=self.start,
                              strides=(stride, *view.strides))
            found = self.shapes[shape, stride] = ([rows[r, ...] for r in range(self.size)], rows)  # (also of 0-d x)
        return self.make(view, root, out, found[0], found[1])


if not cython.compiled:  # the Python form of mpi_carried.pxd's C helpers
    def marked(word: int) -> int:
        """``word`` with bit 63 (:data:`CARRIED`): this rank's x travels in its block."""
        return word | CARRIED

    def unmarked(word: int) -> int:
        """``word`` less bit 63."""
        return word & WORD_BITS

    def hold(c: Carrier, view: Any) -> int:
        """x's bytes (the compiled form holds its buffer)."""
        return int(view.nbytes)

    def release(c: Carrier) -> None:
        """The buffer :func:`hold` held, released."""

    def place(c: Carrier, view: Any) -> None:
        """x's bytes into this rank's payload."""
        c.place_numpy(view)

    def made(c: Carrier, view: Any, root: Any, out: Any) -> Any:
        """The call's result from every rank's x."""
        return c.made_numpy(view, root, out)

    def staged_call(c: Carrier, view: Any, root: Any, out: Any) -> Any:
        """A call past the payload whose round said every rank runs it on its fast path: NOT_TAKEN,
        the fast path runs its staged request (mpi_moves.Move, mpi_staged.staged). The compiled form runs the
        same request here where the fast path made it (the same MPI calls, without its frames)."""
        return NOT_TAKEN


def compiled_carrier() -> Any:
    """This module compiled (``collectives.backends._carried_c``: its :class:`Carrier` in C), or None
    where it was not built (or from another version of the file) or ``COLLECTIVES_COMPILED=0``."""
    return config.compiled_extension(f"{__package__}._carried_c", sys.modules[f"{__package__}.mpi_carried"])


Make = Callable[[Any, Any, Any, "list[Any]", Any], Any]


def result_maker(call: Any, size: int, rank: int, new: Any, mpi_type: Any, local: Any, avg: bool) -> Make | None:
    """``make(view, root, out, each, rows)``: the result of ``call`` on this rank from every rank's
    x (``each``, a list, and ``rows``, one array), once the round carried them."""

    def reduced_into(target: Any, each: list[Any]) -> None:
        """The reduction of ``each`` (rank 0's first) into ``target``."""
        target[...] = each[0]
        into = [target, mpi_type]
        for x in each[1:]:
            local([x, mpi_type], into)
        if avg:
            target /= size

    if call is calls.ALL_REDUCE or call is calls.REDUCE:
        everyone = call is calls.ALL_REDUCE

        def reduction(view: Any, root: Any, out: Any, each: list[Any], rows: Any) -> Any:
            if not everyone and root != rank:
                return view
            if size == 2:  # x holds this rank's own: the peer's reduced into it (MPI's ops commute)
                local([each[1 - rank], mpi_type], [view, mpi_type])
                if avg:
                    view /= size
            else:
                reduced_into(view, each)
            return view
        return reduction
    if call is calls.REDUCE_SCATTER:
        def reduce_scatter(view: Any, root: Any, out: Any, each: list[Any], rows: Any) -> Any:
            n = view.shape[0] // size
            result, recv = new(view, (n, *view.shape[1:]), out)
            reduced_into(recv, [x[rank * n:(rank + 1) * n] for x in each])
            return result
        return reduce_scatter
    if call is calls.BROADCAST:
        def broadcast(view: Any, root: Any, out: Any, each: list[Any], rows: Any) -> Any:
            if root != rank:
                view[...] = each[root]
            return view
        return broadcast
    if call is calls.ALL_GATHER or call is calls.GATHER:
        everyone = call is calls.ALL_GATHER

        def gather(view: Any, root: Any, out: Any, each: list[Any], rows: Any) -> Any:
            if not everyone and root != rank:
                return None
            result, recv = new(view, (size, *view.shape), out)
            recv[...] = rows
            return result
        return gather
    if call is calls.SCATTER:
        def scatter(view: Any, root: Any, out: Any, each: list[Any], rows: Any) -> Any:
            result, recv = new(view, view.shape[1:], out)
            recv[...] = each[root][rank]
            return result
        return scatter
    if call is calls.ALL_TO_ALL:
        def all_to_all(view: Any, root: Any, out: Any, each: list[Any], rows: Any) -> Any:
            result, recv = new(view, view.shape, out)
            recv[...] = rows[:, rank]
            return result
        return all_to_all
    return None
