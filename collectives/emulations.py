"""Collectives a transport may lack, made correctly from its other methods.

:class:`Emulations` gives every backend a correct ``_reduce`` (all_reduce of a copy),
``_gather`` and ``_all_to_all`` (all_gather), ``_scatter`` (broadcast of a copy), and
the uneven ``_all_gather_v`` and ``_all_to_all_v`` (all_gather of padded rows); a
backend overrides one where its transport has the call. The uneven collectives first
exchange every rank's counts (``_rows_of_everyone``), so a disagreement is the same
``ValueError`` on every rank before any of the data moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .arrays import ArrayAdapter
from .ops import ReduceOp
from .transport import Transport
from .work import Work


class Emulations(Transport):
    """The emulated collectives and the counts of the uneven ones (a base of
    :class:`collectives.Communicator`)."""

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


def _into(adapter: ArrayAdapter, out: Any, value: Any) -> Any:
    """``value`` copied into ``out``, or into a new array of its shape when ``out`` is None."""
    if out is None:
        out = adapter.empty(value, tuple(value.shape))
    adapter.copy_(out, value)
    return out
