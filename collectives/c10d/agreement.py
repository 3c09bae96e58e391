"""What the ranks of a "collectives" group agree on before an operation's data moves.

Most arguments are checked on each rank alone (:mod:`collectives.c10d.arguments`): every
rank makes the same call, so every rank finds the same fault and raises before sending
anything. Two things are not visible to every rank, and are exchanged first, in one small
``all_gather`` on the group's worker communicator:

- A rooted operation's list (``gather_list`` at the destination, ``scatter_list`` at the
  source) exists on one rank only. That rank raises at once; its refusal still takes part
  in the exchange, so the other ranks raise :class:`~collectives.CollectiveMismatch` naming
  it instead of waiting for data that never comes, and the group stays in step.
- The ranks' tensors of a ``gather``/``scatter`` must have one shape and dtype, and the
  split sizes of an uneven ``all_to_all`` must agree pairwise (what rank i sends to rank j
  is what rank j expects from rank i): a disagreement is a ``CollectiveMismatch`` on every
  rank, before the data.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from collectives import arrays
from collectives.communicator import Communicator
from collectives.errors import CollectiveMismatch
from collectives.ops import DTYPES

#: Dimensions a descriptor holds one by one (a hash stands for the rest).
_DIMS = 8
_CODES = {name: code for code, name in enumerate(DTYPES)}


def _descriptor(refused: bool, t: torch.Tensor) -> list[int]:
    """``[refused, dtype, ndim, dims[0..7] (padded with -1), hash of the dims beyond]``
    (a dtype the transports do not take is -1: a refusing rank's tensor may be wrong too)."""
    shape = tuple(t.shape)
    dims = list(shape[:_DIMS]) + [-1] * (_DIMS - min(len(shape), _DIMS))
    tail = zlib.crc32(repr(shape[_DIMS:]).encode()) if len(shape) > _DIMS else -1
    try:
        dtype = _CODES[arrays.TORCH.dtype_name(t)]
    except (TypeError, ValueError):
        dtype = -1
    return [int(refused), dtype, len(shape), *dims, tail]


def _shape_text(row: Sequence[int]) -> str:
    ndim = row[2]
    dims = [str(d) for d in row[3:3 + min(ndim, _DIMS)]]
    more = ", ..." if ndim > _DIMS else ""
    dtype = DTYPES[row[1]] if row[1] >= 0 else "an unsupported dtype"
    return f"{dtype} ({', '.join(dims)}{',' if ndim == 1 else ''}{more})"


def _exchange(comm: Communicator, operation: str, row: torch.Tensor) -> list[list[int]]:
    """Every rank's ``row``; a mismatch the call path finds in the exchange (another rank is
    in another call) is told as this operation's."""
    try:
        table: list[list[int]] = comm.all_gather(row).cpu().tolist()
    except CollectiveMismatch as error:
        raise CollectiveMismatch(f"{operation} on {comm!r} (the all_gather that opens it): {error}") from error
    return table


def agree(comm: Communicator, operation: str, t: torch.Tensor, refusal: str | None) -> None:
    """Every rank's tensor ``t`` has one dtype and shape, and no rank refused this call
    (``refusal``: this rank's reason, or ``None``); else ``CollectiveMismatch`` on every rank."""
    device = t.device if t.device.type in ("cpu", "cuda") else torch.device("cpu")
    row = torch.tensor(_descriptor(refusal is not None, t), dtype=torch.int64, device=device)
    table = _exchange(comm, operation, row)
    refused = [rank for rank, r in enumerate(table) if r[0]]
    if refused:
        reasons = comm.all_gather_object(refusal)
        told = "; ".join(f"rank {rank}: {reasons[rank]}" for rank in refused)
        raise CollectiveMismatch(f"{operation} on {comm!r}: rank{'s' if len(refused) > 1 else ''} "
                                 f"{', '.join(map(str, refused))} refused the call ({told}), so no rank "
                                 "sent anything")
    if any(r[1:] != table[0][1:] for r in table):
        raise CollectiveMismatch(
            f"{operation} on {comm!r} needs one dtype and shape on every rank; the ranks differ: "
            + "; ".join(f"rank {rank}: {_shape_text(r)}" for rank, r in enumerate(table)) + ". Nothing was sent")


def agree_splits(comm: Communicator, operation: str, sends: Sequence[int], receives: Sequence[int],
                 device: torch.device) -> None:
    """What each rank sends to each rank (``sends[j]``: to rank j) is what that rank expects
    from it (``receives[i]``: from rank i); else ``CollectiveMismatch`` on every rank."""
    row = torch.tensor([*sends, *receives], dtype=torch.int64, device=device)
    table = _exchange(comm, operation, row)
    size = comm.size
    wrong = [(i, j, table[i][j], table[j][size + i]) for i in range(size) for j in range(size)
             if table[i][j] != table[j][size + i]]
    if wrong:
        described = "; ".join(f"rank {i} sends {sent} to rank {j}, which expects {expected}"
                              for i, j, sent, expected in wrong[:4])
        more = f" (and {len(wrong) - 4} more pairs)" if len(wrong) > 4 else ""
        raise CollectiveMismatch(f"{operation} on {comm!r}: the split sizes do not agree between ranks: "
                                 f"{described}{more}. Nothing was sent")

