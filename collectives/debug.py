"""Debug mode (``COLLECTIVES_DEBUG=1``): every rank describes its next call in a fingerprint.

Before each collective the ranks all_gather a fixed-size int64 vector saying what
they are about to do; any difference raises :class:`CollectiveMismatch` on every
rank (every rank sees the same table, so every rank raises the same message),
naming the fields that differ and which ranks hold which value. Nothing of the
collective itself has been sent then, so the communicator stays usable.

A rank that makes an extra call, or skips one, is out of step: its next exchange
meets a different call on the others (a mismatch), or nobody (the timeout).

The vector: ``[MAGIC, sequence number, operation, reduce op, root, dtype, ndim,
dims[0..MAX_DIMS-1] (padded with -1), hash of dims beyond MAX_DIMS]``.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from .errors import CollectiveMismatch
from .ops import DTYPES, ReduceOp

MAGIC = 0x436F6C6C  # "Coll": tells a fingerprint from stray data
MAX_DIMS = 8
LENGTH = 7 + MAX_DIMS + 1

OPERATIONS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier", "split")
_OPERATION_CODES = {name: code for code, name in enumerate(OPERATIONS)}
_REDUCE_OPS = tuple(ReduceOp)
_REDUCE_CODES = {op: code for code, op in enumerate(_REDUCE_OPS)}
_DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}

# field name -> its slice of the vector, in the order a message lists them.
FIELDS = {"sequence number": slice(1, 2), "operation": slice(2, 3), "reduce op": slice(3, 4),
          "root": slice(4, 5), "dtype": slice(5, 6), "shape": slice(6, LENGTH)}


def fingerprint(operation: str, seq: int, reduce_op: ReduceOp | None, root: int,
                dtype: str | None, shape: tuple[int, ...]) -> np.ndarray:
    """The int64 vector (length :data:`LENGTH`) that describes one call."""
    vector = np.full(LENGTH, -1, dtype=np.int64)
    vector[0] = MAGIC
    vector[1] = seq
    vector[2] = _OPERATION_CODES[operation]
    vector[3] = -1 if reduce_op is None else _REDUCE_CODES[reduce_op]
    vector[4] = root
    vector[5] = -1 if dtype is None else _DTYPE_CODES[dtype]
    vector[6] = len(shape)
    head = shape[:MAX_DIMS]
    vector[7:7 + len(head)] = head
    if len(shape) > MAX_DIMS:
        vector[-1] = zlib.crc32(repr(shape[MAX_DIMS:]).encode())
    return vector


def _describe(field: str, row: np.ndarray) -> str:
    """One rank's value of ``field`` in words."""
    if row[0] != MAGIC:
        return "not a fingerprint (that rank is not in debug mode, or out of step)"
    value = int(row[FIELDS[field]][0])
    if field == "sequence number":
        return f"#{value}"
    if field == "operation":
        return OPERATIONS[value] if 0 <= value < len(OPERATIONS) else f"unknown {value}"
    if field == "reduce op":
        return "-" if value < 0 else _REDUCE_OPS[value].name
    if field == "root":
        return "-" if value < 0 else str(value)
    if field == "dtype":
        return "-" if value < 0 else DTYPES[value]
    ndim = value
    dims = [int(d) for d in row[7:7 + min(ndim, MAX_DIMS)]]
    if ndim > MAX_DIMS:
        return f"({', '.join(map(str, dims))}, ... {ndim} dims, tail hash {int(row[-1]):#x})"
    return str(tuple(dims))


def mismatch(everyone: np.ndarray, comm: Any) -> CollectiveMismatch | None:
    """``CollectiveMismatch`` describing how the rows of ``everyone`` differ, or ``None``."""
    if (everyone == everyone[0]).all():
        return None
    differences = []
    for field, columns in FIELDS.items():
        if len({tuple(row[columns]) for row in everyone}) == 1:
            continue
        values: dict[str, list[int]] = {}
        for rank, row in enumerate(everyone):
            values.setdefault(_describe(field, row), []).append(rank)
        held = "; ".join(f"{value} on rank{'s' if len(ranks) > 1 else ''} "
                         f"{', '.join(map(str, ranks))}" for value, ranks in values.items())
        differences.append(f"{field} differs: {held}")
    return CollectiveMismatch(
        f"ranks made different collective calls ({comm._operation} call #{comm._seq} on "
        f"{comm!r}, rank {comm.rank}): " + " | ".join(differences)
        + ". Every rank must make the same collectives in the same order, with the same "
        "reduce op, root, dtype and shape. Nothing of this call was sent."
    )
