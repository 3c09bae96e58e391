"""Small collectives of CPU tensors carried in the torch route's check round: one Gloo call where
the default check and the data would take two.

On a torch group with Gloo of up to ``COUNTS_RANKS`` ranks the default check's round is
one all_to_all of a block to every rank (``TorchGroup._carried_round``): the check word, the uneven
collectives' counts and :data:`~.torch_group.CARRY_BYTES` of payload (PAIR_CARRY_BYTES at 2 ranks).
A planned call (a plain contiguous CPU tensor of a kind the torch plans take, blocking) whose x
fits there puts its bytes in its blocks and sets bit 63 of its word (:data:`CARRIED`); once the
round is back every rank holds every rank's x, and each makes its result from them locally, as on
MPI (backends/mpi_carried.py: the same results from the same rows): a reduction in rank order
with numpy's arithmetic (so every rank computes the same bits), the rows of a gather, a block of
an all_to_all. The data collective is not made. A larger x makes the round with its word alone, then its own call.

The round tells each rank what the others did: the result is made only where every rank's word
agrees and every rank carried; where the words agree but a rank did not carry (an asynchronous
call, another kind of array), every rank runs the call as usual after the round; where they
disagree, the check's :class:`~collectives.CollectiveMismatch`, x untouched. Every call's check
on such a group travels in the same all_to_all, so ranks in different calls always meet in it.

A reduction carries where numpy's arithmetic is the transport's for the dtype x op: the sum and
product of the floats numpy has (float32, float64; AVG as the sum, divided), and every op of the
integer types (their sums and products wrap alike); not float MIN/MAX (NaN), bool, float16 or
bfloat16. bfloat16 tensors (numpy has no such dtype) do not carry.

Imports: the interface, numpy, mpi_carried's results (no MPI); never torch_dist (which calls this).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from collectives.calls import NOT_TAKEN
from collectives.ops import ReduceOp

from .mpi_carried import CARRIED, WORD_BITS, Carry, KeptView, new_result, result_maker

_INTEGERS = ("int8", "uint8", "int16", "int32", "int64")
#: The shapes of x whose views of the round's blocks a carried kind keeps (then made anew).
_KEPT_SHAPES = 64
#: numpy's function of each (dtype, op) carried: the transport's arithmetic on those.
UFUNCS: dict[tuple[str, ReduceOp], Callable[..., Any]] = {
    **{(dtype, op): ufunc for dtype in ("float32", "float64")
       for op, ufunc in ((ReduceOp.SUM, np.add), (ReduceOp.AVG, np.add), (ReduceOp.PROD, np.multiply))},
    **{(dtype, op): ufunc for dtype in _INTEGERS
       for op, ufunc in ((ReduceOp.SUM, np.add), (ReduceOp.PROD, np.multiply), (ReduceOp.MIN, np.minimum),
                         (ReduceOp.MAX, np.maximum), (ReduceOp.BAND, np.bitwise_and),
                         (ReduceOp.BOR, np.bitwise_or), (ReduceOp.BXOR, np.bitwise_xor))},
}


def carried_path(transport: Any, call: Any, dtype: str, op: ReduceOp | None, carry_bytes: int) -> Carry | None:
    """The carried form of ``call`` on CPU tensors of ``dtype`` (and ``op``) over ``transport`` (a
    TorchGroup whose round carries): ``carry(view, root, out, extra, word)`` -> ``(AND of the
    ranks' words, result)``, the result NOT_TAKEN unless every rank agreed and carried (``view``:
    the tensor x, as the plans' array check gives it). None where the call cannot be carried."""
    if dtype == "bfloat16":  # (no numpy dtype: its tensors have no numpy view)
        return None
    local: Any = None
    if call.reduces:
        ufunc = UFUNCS.get((dtype, op)) if op is not None else None
        if ufunc is None:
            return None

        if dtype in _INTEGERS:  # (integer arithmetic sets no floating-point flag: nothing to quiet)
            def local(source: list[Any], target: list[Any]) -> None:  # (as MPI_Reduce_local's buffers)
                ufunc(target[0], source[0], out=target[0])
        else:
            def local(source: list[Any], target: list[Any]) -> None:
                with np.errstate(over="ignore", invalid="ignore"):  # (torch's arithmetic says nothing of inf, NaN)
                    ufunc(target[0], source[0], out=target[0])
    size = transport.size
    make = result_maker(call, size, transport.rank, new_result(True), None, local, op is ReduceOp.AVG)
    if make is None:
        return None
    agree, carried_round = transport._agree_word, transport._carried_round
    order = transport._torch_rank if transport._reordered else None
    views: dict[tuple[int, ...], tuple[Any, ...]] = {}  # (by x's shape: see shaped)
    kept = KeptView()  # (x's numpy view: x is a plain CPU tensor of this dtype, the plan's check says)

    def shaped(blocks: tuple[Any, ...], shape: tuple[int, ...], n: int) -> tuple[Any, ...]:
        """The round's payloads (``blocks``: TorchGroup._counts_round's arrays) as rows of x's
        dtype and ``shape``: what this rank sends (one row a rank), every rank's row received
        (rank order where torch's differs: a copy, made at each call) and a list of them."""
        if len(views) >= _KEPT_SHAPES:
            views.clear()
        send, received = blocks[4][:, :n].view(dtype), blocks[5][:, :n].view(dtype)
        send.shape = received.shape = (size, *shape)  # (views of the blocks, never copies)
        each = None if order is not None else [received[k, ...] for k in range(size)]  # (views, 0-d too)
        views[shape] = found = (blocks, send, received, each)
        return found

    def carry(view: Any, root: Any, out: Any, extra: Any, word: int) -> tuple[int, Any]:
        x = kept.of(view)
        n = x.nbytes
        if n > carry_bytes:  # the round of the word alone, then the call
            return agree(word), NOT_TAKEN
        blocks = transport._counts_round()
        found = views.get(x.shape)
        if found is None or found[0] is not blocks:  # (new blocks after an abandoned round)
            found = shaped(blocks, x.shape, n)
        send, rows, each = found[1:]
        send[...] = x
        reduced = carried_round(word | CARRIED)[0]
        if reduced >= 0 or reduced & WORD_BITS != word:  # a rank did not carry, or another call
            return reduced & WORD_BITS, NOT_TAKEN
        if order is not None:
            rows = rows[order]
            each = [rows[k, ...] for k in range(size)]
        return word, make(x, root, out, each, rows)
    return carry
