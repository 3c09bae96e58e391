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

from collectives import calls
from collectives.calls import NOT_TAKEN
from collectives.ops import ReduceOp
from collectives.wire import FAST_BIT

#: Bit 63 of a check word (collectives.wire.FAST_BIT): this rank's x travels in its block.
CARRIED = FAST_BIT
#: A check word's bits but :data:`CARRIED`.
WORD_BITS = (1 << 63) - 1

#: The bytes of x a call carries in the check's round at most.
CARRY_BYTES = 1024
#: Shapes per carried path whose views into the round's blocks are kept at most.
CARRIED_SHAPES = 1024

Carry = Callable[[Any, Any, Any, Any, int], "tuple[int, Any]"]


def new_result(tensors: bool) -> Callable[[Any, tuple[int, ...], Any], tuple[Any, Any]]:
    """``new(view, shape, out)``: a carried call's result (``out`` where given; a CPU tensor for a
    tensor's ``view``) and its numpy view. A new tensor is a numpy array's (``torch.from_numpy``:
    0.8 us where ``torch.empty`` and its numpy view take 2.0; torch looked up when one is made, so
    that a function for tensors can be made before torch is imported). An ``out`` that is a numpy
    array is its own view, also for tensors."""
    def new(view: Any, shape: tuple[int, ...], out: Any) -> tuple[Any, Any]:
        if out is not None:
            return out, out.numpy() if tensors and not isinstance(out, np.ndarray) else out
        result = np.empty(shape, view.dtype)
        return (sys.modules["torch"].from_numpy(result) if tensors else result), result
    return new


def carried_path(channel: Any, call: Any, dtype: str, op: ReduceOp | None, tensors: bool) -> Carry | None:
    """The carried form of ``call`` on host arrays of ``dtype`` (and ``op``) over ``channel`` (an
    MPIChannel): ``carry(view, root, out, extra, word)`` -> ``(AND of the ranks' words, result)``,
    the result NOT_TAKEN unless every rank agreed and carried (``tensors``: x is a CPU tensor,
    ``view`` its numpy view). None where the channel's round carries nothing or the call cannot
    be carried."""
    state = channel.round
    if not state.gathers:
        return None
    new = new_result(tensors)
    size, rank, start, block = channel.size, channel.rank, state.payload_offset, state.block
    mpi_type: Any = None
    local: Any = None
    if call.reduces:  # (MPI_Reduce_local: MPI's own arithmetic, where MPI reduces the pair as it is)
        spec = channel._native[dtype].get(op) if op is not None else None
        if spec is None:
            return None
        mpi_type, local = spec[0], spec[1].Reduce_local
    avg = op is ReduceOp.AVG
    places: dict[Any, Any] = {}
    shapes: dict[Any, tuple[list[Any], Any]] = {}

    def place(x: Any) -> Any:
        """x's place in this rank's block (the same in either size of block), kept per shape."""
        if len(places) >= CARRIED_SHAPES:
            places.clear()
        into = places[x.shape] = np.ndarray(x.shape, x.dtype, buffer=block, offset=start)
        return into

    def views(x: Any, blocks: Any) -> tuple[list[Any], Any]:
        """Every rank's x in ``blocks`` (the round's blocks of the size it ran with,
        backends/mpi_round.py), as a list and as one array (views). Kept per shape and block size,
        up to CARRIED_SHAPES (then forgotten and made again)."""
        shape, kind, stride = x.shape, x.dtype, blocks.strides[0]
        if len(shapes) >= CARRIED_SHAPES:
            shapes.clear()
        rows = np.ndarray((size, *shape), kind, buffer=blocks, offset=start, strides=(stride, *x.strides))
        found = shapes[shape, stride] = ([rows[r, ...] for r in range(size)], rows)  # (also of 0-d x)
        return found

    round_ = channel._round  # (the channel's: it says whether every rank runs the call on its fast path)

    make = result_maker(call, size, rank, new, mpi_type, local, avg)
    if make is None:
        return None
    on_root = call is calls.BROADCAST or call is calls.SCATTER  # (only the root's x is read)

    def carry(view: Any, root: Any, out: Any, extra: Any, word: int) -> tuple[int, Any]:
        # (the payload of the round about to run: every rank's alike, see backends/mpi_round.py)
        n = view.nbytes
        state.wants(n)
        if n > state.carry_bytes:  # the round of the word alone (every rank of this call: x this size)
            return round_(word | CARRIED) & WORD_BITS, NOT_TAKEN
        if not on_root or root == rank:
            into = places.get(view.shape)
            if into is None:
                into = place(view)
            into[...] = view
        reduced = round_(word | CARRIED)
        if reduced >= 0 or reduced & WORD_BITS != word:  # a rank did not carry, or another call
            return reduced & WORD_BITS, NOT_TAKEN
        blocks = state.blocks  # (the blocks of the size the round ran with)
        each, rows = shapes.get((view.shape, blocks.strides[0])) or views(view, blocks)
        return word, make(view, root, out, each, rows)
    return carry



def compiled_module() -> Any:
    """The MPI backend's compiled round and carried calls: none is built at this commit (the
    Python forms run)."""
    return None


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
