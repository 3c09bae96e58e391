"""Collectives a transport may lack, made correctly from its other methods, and the counts
exchange of the uneven collectives.

The defaults of :class:`collectives.transport.Transport`'s ``_reduce`` (all_reduce of a copy),
``_gather`` and ``_all_to_all`` (all_gather), ``_scatter`` (broadcast of a copy), and the uneven
``_all_gather_v`` and ``_all_to_all_v`` (all_gather of padded rows) call the functions here; a
backend overrides one where its transport has the call. The uneven collectives first exchange
every rank's counts (:func:`rows_of_everyone`, run by the call path before the transport's
method), so a disagreement is the same ``ValueError`` on every rank before any of the data moves.

Imports: the array adapters, :class:`~collectives.work.Work` and the wire headers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .arrays import ArrayAdapter
from .ops import ReduceOp
from .wire import header_rows, header_splits, uneven_header, uneven_mismatch
from .work import Work

# -- the uneven collectives: counts first (the call path's rows run these) ------------------


def rows_of_everyone(comm: Any, x: Any, dtype: str, out: Any, splits: Sequence[int] | None) -> Any:
    """One small exchange before an uneven collective: every rank's rows, the rest of its
    shape, its dtype, its ``out`` rows and (all_to_all) its splits, as a numpy array of
    one row per rank. A disagreement is the same ``ValueError`` on every rank, before any
    of the data moves."""
    mine = uneven_header(tuple(x.shape), dtype, None if out is None else int(out.shape[0]),
                         splits, comm.size)
    everyone = comm._transport._exchange_small(mine)
    error = uneven_mismatch(everyone, comm, comm._operation, splits is not None)
    if error is not None:
        raise error
    return everyone


def all_gather_v_counted(comm: Any, x: Any, adapter: ArrayAdapter, dtype: str, out: Any,
                         async_op: bool) -> Any:
    """all_gather_v: the counts exchange, then the transport's ``_all_gather_v``."""
    counts = header_rows(rows_of_everyone(comm, x, dtype, out, None))
    return comm._transport._all_gather_v(x, adapter, dtype, counts, out, async_op)


def all_to_all_counted(comm: Any, x: Any, adapter: ArrayAdapter, dtype: str,
                       send_splits: Sequence[int], out: Any, async_op: bool) -> Any:
    """Uneven all_to_all: the counts exchange, then the transport's ``_all_to_all_v``."""
    splits = header_splits(rows_of_everyone(comm, x, dtype, out, send_splits), comm.size)
    return comm._transport._all_to_all_v(x, adapter, dtype, splits, out, async_op)


# -- emulations: correct on any transport, from its other methods -----------------------------


def reduce(transport: Any, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp, dst: int,
           async_op: bool) -> Work | None:
    """Reduce into ``x`` on ``dst``. Emulated: all_reduce of a copy, kept on ``dst``."""
    copy = adapter.empty(x, tuple(x.shape))
    adapter.copy_(copy, x)
    transport._all_reduce(copy, adapter, dtype, op, False)
    if transport.rank == dst:
        adapter.copy_(x, copy)
    return Work(x) if async_op else None


def gather(transport: Any, x: Any, adapter: ArrayAdapter, dtype: str, dst: int, out: Any,
           async_op: bool) -> Any:
    """``(size, *x.shape)`` on ``dst``, ``None`` elsewhere. Emulated: all_gather."""
    gathered = transport._all_gather(x, adapter, dtype, out if transport.rank == dst else None, False)
    result = gathered if transport.rank == dst else None
    return Work(result) if async_op else result


def scatter(transport: Any, x: Any, adapter: ArrayAdapter, dtype: str, src: int, out: Any,
             async_op: bool) -> Any:
    """Row ``rank`` of ``src``'s ``x``. Emulated: broadcast of a copy (x stays untouched)."""
    copy = adapter.empty(x, tuple(x.shape))
    adapter.copy_(copy, x)
    transport._broadcast(copy, adapter, dtype, src, False)
    result = _into(adapter, out, copy[transport.rank])
    return Work(result) if async_op else result


def all_to_all(transport: Any, x: Any, adapter: ArrayAdapter, dtype: str, out: Any,
                async_op: bool) -> Any:
    """Row ``j`` of the result is rank ``j``'s row ``rank``. Emulated: all_gather."""
    gathered = transport._all_gather(x, adapter, dtype, None, False)
    result = _into(adapter, out, gathered[:, transport.rank])
    return Work(result) if async_op else result


def all_gather_v(transport: Any, x: Any, adapter: ArrayAdapter, dtype: str, counts: list[int],
                  out: Any, async_op: bool) -> Any:
    """``(concatenation, counts)``. Emulated: all_gather of x padded to the most rows."""
    most = max(counts)
    padded = adapter.empty(x, (most, *x.shape[1:]))
    if x.shape[0]:
        adapter.copy_(padded[:x.shape[0]], x)
    gathered = transport._all_gather(padded, adapter, dtype, None, False)
    result = out if out is not None else adapter.empty(x, (sum(counts), *x.shape[1:]))
    start = 0
    for rank, count in enumerate(counts):
        if count:
            adapter.copy_(result[start:start + count], gathered[rank, :count])
        start += count
    return Work((result, counts)) if async_op else (result, counts)


def all_to_all_v(transport: Any, x: Any, adapter: ArrayAdapter, dtype: str,
                  splits: list[list[int]], out: Any, async_op: bool) -> Any:
    """Uneven all_to_all; ``splits[i][j]`` is how many rows rank ``i`` sends to rank ``j``
    (so this rank sends ``splits[rank]`` and receives ``[s[rank] for s in splits]``).
    Emulated: all_gather_v of x, then each rank keeps the rows addressed to it."""
    rows = [sum(row) for row in splits]
    everyone, _ = transport._all_gather_v(x, adapter, dtype, rows, None, False)
    received = [row[transport.rank] for row in splits]
    result = out if out is not None else adapter.empty(x, (sum(received), *x.shape[1:]))
    position = offset = 0
    for sender, count in enumerate(received):
        start = offset + sum(splits[sender][:transport.rank])
        if count:
            adapter.copy_(result[position:position + count], everyone[start:start + count])
        position += count
        offset += rows[sender]
    return Work(result) if async_op else result


def _into(adapter: ArrayAdapter, out: Any, value: Any) -> Any:
    """``value`` copied into ``out``, or into a new array of its shape when ``out`` is None."""
    if out is None:
        out = adapter.empty(value, tuple(value.shape))
    adapter.copy_(out, value)
    return out
