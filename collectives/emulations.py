"""Collectives a transport may lack, made correctly from its other methods, and the counts
exchange of the uneven collectives.

The defaults of :class:`collectives.transport.Transport`'s ``_reduce`` (all_reduce of a copy),
``_gather`` and ``_all_to_all`` (all_gather), ``_scatter`` (broadcast of a copy), and the uneven
``_all_gather_v`` and ``_all_to_all_v`` (all_gather of padded rows) call the functions here; a
backend overrides one where its transport has the call. The uneven collectives first exchange
every rank's counts (:func:`rows_of_everyone`, run by the call path before the transport's
method), so a disagreement is the same ``ValueError`` on every rank before any of the data moves.

Imports: the array adapters, the call table (its rows and :class:`~collectives.calls.Request`),
:class:`~collectives.work.Work` and the wire headers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .arrays import ArrayAdapter
from .calls import ALL_GATHER, ALL_GATHER_V, ALL_REDUCE, BROADCAST, Request
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


def counted(comm: Any, r: Request) -> None:
    """The uneven rows' counts exchange, run by the call path before the transport's method:
    ``r.extra`` becomes every rank's row counts (all_gather_v) or the splits ``splits[i][j]``
    (uneven all_to_all, from each rank's ``send_splits``). Where the transport carries them in
    the check's round (``CallCheck.check_counts``), the call path ran that round first and calls
    this only where it did not."""
    if r.call is ALL_GATHER_V:
        r.extra = header_rows(rows_of_everyone(comm, r.x, r.dtype, r.out, None))
    else:
        r.extra = header_splits(rows_of_everyone(comm, r.x, r.dtype, r.out, r.extra), comm.size)


# -- emulations: correct on any transport, from its other methods -----------------------------


def reduce(transport: Any, r: Request) -> Work | None:
    """Reduce into ``x`` on ``dst``. Emulated: all_reduce, of x itself on ``dst`` (which gets the
    result there) and of a copy elsewhere (x stays as it was)."""
    x, adapter = r.x, r.adapter
    if transport.rank == r.root:
        transport._all_reduce(Request(ALL_REDUCE, x, adapter, r.dtype, r.op))
        return Work(x) if r.async_op else None
    copy = adapter.empty(x, tuple(x.shape))
    adapter.copy_(copy, x)
    transport._all_reduce(Request(ALL_REDUCE, copy, adapter, r.dtype, r.op))
    return Work(x) if r.async_op else None


def gather(transport: Any, r: Request) -> Any:
    """``(size, *x.shape)`` on ``dst``, ``None`` elsewhere. Emulated: all_gather."""
    here = transport.rank == r.root
    gathered = transport._all_gather(Request(ALL_GATHER, r.x, r.adapter, r.dtype,
                                             out=r.out if here else None))
    result = gathered if here else None
    return Work(result) if r.async_op else result


def scatter(transport: Any, r: Request) -> Any:
    """Row ``rank`` of ``src``'s ``x``. Emulated: broadcast of a copy of x on ``src`` (x stays
    untouched; the transport may write the values back into the buffer it broadcasts), into
    new memory elsewhere."""
    x, adapter = r.x, r.adapter
    copy = adapter.empty(x, tuple(x.shape))
    if transport.rank == r.root:
        adapter.copy_(copy, x)
    transport._broadcast(Request(BROADCAST, copy, adapter, r.dtype, root=r.root))
    result = _into(adapter, r.out, copy[transport.rank])
    return Work(result) if r.async_op else result


def all_to_all(transport: Any, r: Request) -> Any:
    """Row ``j`` of the result is rank ``j``'s row ``rank``. Emulated: all_gather."""
    gathered = transport._all_gather(Request(ALL_GATHER, r.x, r.adapter, r.dtype))
    result = _into(r.adapter, r.out, gathered[:, transport.rank])
    return Work(result) if r.async_op else result


def all_gather_v(transport: Any, r: Request) -> Any:
    """``(concatenation, counts)``. Emulated: all_gather of x padded to the most rows."""
    x, adapter, counts, out = r.x, r.adapter, r.extra, r.out
    most = max(counts)
    padded = adapter.empty(x, (most, *x.shape[1:]))
    if x.shape[0]:
        adapter.copy_(padded[:x.shape[0]], x)
    gathered = transport._all_gather(Request(ALL_GATHER, padded, adapter, r.dtype))
    result = out if out is not None else adapter.empty(x, (sum(counts), *x.shape[1:]))
    start = 0
    for rank, count in enumerate(counts):
        if count:
            adapter.copy_(result[start:start + count], gathered[rank, :count])
        start += count
    return Work((result, counts)) if r.async_op else (result, counts)


def all_to_all_v(transport: Any, r: Request) -> Any:
    """Uneven all_to_all; ``splits[i][j]`` is how many rows rank ``i`` sends to rank ``j``
    (so this rank sends ``splits[rank]`` and receives ``[s[rank] for s in splits]``).
    Emulated: all_gather_v of x, then each rank keeps the rows addressed to it."""
    x, adapter, splits, out = r.x, r.adapter, r.extra, r.out
    rows = [sum(row) for row in splits]
    everyone, _ = transport._all_gather_v(Request(ALL_GATHER_V, x, adapter, r.dtype, extra=rows))
    received = [row[transport.rank] for row in splits]
    result = out if out is not None else adapter.empty(x, (sum(received), *x.shape[1:]))
    position = offset = 0
    for sender, count in enumerate(received):
        start = offset + sum(splits[sender][:transport.rank])
        if count:
            adapter.copy_(result[position:position + count], everyone[start:start + count])
        position += count
        offset += rows[sender]
    return Work(result) if r.async_op else result


def _into(adapter: ArrayAdapter, out: Any, value: Any) -> Any:
    """``value`` copied into ``out``, or into a new array of its shape when ``out`` is None."""
    if out is None:
        out = adapter.empty(value, tuple(value.shape))
    adapter.copy_(out, value)
    return out
