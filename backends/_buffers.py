"""What every backend needs, written once: sizes, staging, wire dtypes, bitwise emulation.

- Sizes of numpy/CuPy arrays and torch tensors alike (:func:`itemsize`, :func:`count`,
  :func:`nbytes`, :func:`row_bytes`), their memory as flat bytes (:func:`flat_bytes`),
  and the byte offsets of blocks laid back to back (:func:`offsets`).
- :func:`stage`: a contiguous buffer of ``x`` in the dtype a transport takes, and the
  copy back into ``x`` when the buffer is a copy.
- :data:`NARROW_WIRE`: the dtypes NCCL and Gloo lack and what they are reduced in;
  :func:`bitwise_as_min_max` and :func:`fold_bitwise`: the bitwise reductions those
  transports lack.

The deadline-and-poll loop every backend waits in is :mod:`collectives.polling`'s (the call
path's per-call timeouts use it too), with a policy per transport.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from collectives import arrays
from collectives.arrays import ArrayAdapter
from collectives.ops import ReduceOp

# -- sizes ------------------------------------------------------------------------------------


def itemsize(x: Any) -> int:
    """Bytes per element of a numpy/CuPy array or a torch tensor."""
    return int(x.itemsize) if hasattr(x, "itemsize") else int(x.element_size())


def count(x: Any) -> int:
    """Elements of ``x``."""
    return math.prod(x.shape)


def nbytes(x: Any) -> int:
    """Bytes of ``x``'s elements."""
    return count(x) * itemsize(x)


def row_bytes(x: Any) -> int:
    """Bytes of one row (``x.shape[1:]``) of ``x``."""
    row: int = math.prod(x.shape[1:])
    return row * itemsize(x)


def offsets(sizes: list[int]) -> list[int]:
    """Where each of ``sizes`` starts when they are laid back to back (exclusive prefix sums)."""
    starts, total = [], 0
    for size in sizes:
        starts.append(total)
        total += size
    return starts


def flat_bytes(buf: Any) -> Any:
    """A flat uint8 view of a contiguous numpy/CuPy array or torch tensor."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.numel() == 0:  # torch cannot reinterpret an empty view; nothing moves anyway
            return torch.empty(0, dtype=torch.uint8, device=buf.device)
        flat = buf.reshape(-1)
        if flat.stride(0) != 1:  # 0 or 1 elements count as contiguous with any stride; .view refuses
            flat = flat.as_strided(flat.shape, (1,))
        return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    return buf.reshape(-1).view("uint8")  # numpy and CuPy


def divide_(buf: Any, size: int) -> None:
    """``buf /= size``, in place for numpy, CuPy and torch alike (AVG's division)."""
    buf /= size


def clone(buf: Any) -> Any:
    """A copy of a numpy/CuPy array or torch tensor."""
    return buf.clone() if hasattr(buf, "clone") else buf.copy()


# -- staging ------------------------------------------------------------------------------------


def stage(x: Any, adapter: ArrayAdapter, dtype: str | None, wire: str | None
          ) -> tuple[Any, Callable[[], None] | None]:
    """A contiguous buffer of ``x``'s values in dtype ``wire`` that a transport may read and
    write, and the copy back into ``x`` (``None`` when the buffer is ``x``'s own memory).
    ``dtype`` is x's dtype name; ``wire`` ``None`` (or ``dtype``) keeps it.

    ``x`` itself when it is contiguous and of that dtype; a bool array's memory as its uint8
    bytes; else a contiguous copy, cast to ``wire`` (written back with a wrapping cast)."""
    if adapter is arrays.TORCH:
        x = x.detach()
    if adapter.is_contiguous(x):
        if wire is None or wire == dtype:
            return x, None
        if dtype == "bool" and wire == "uint8":
            return adapter.view(x, wire), None
    staged = adapter.cast(x, dtype if wire is None else wire)
    return staged, lambda: adapter.copy_(x, staged)


# -- wire dtypes and the bitwise reductions NCCL and Gloo lack ------------------------------------

#: dtypes neither NCCL nor Gloo reduce, and the type they are reduced in instead: 0/1 bytes
#: keep MIN=AND, MAX=OR, BXOR=XOR; int32 keeps int16's wrapping SUM/PROD and bit patterns.
NARROW_WIRE = {"bool": "uint8", "int16": "int32"}

BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)

#: Integer dtypes by width, for a float's memory seen as integers (order keys).
INT_OF_WIDTH = {2: "int16", 4: "int32", 8: "int64"}


def bitwise_as_min_max(dtype: str, op: ReduceOp) -> ReduceOp | None:
    """The MIN/MAX that computes bitwise ``op`` on ``dtype`` (bool: on 0/1 bytes AND is MIN and
    OR is MAX), or ``None`` when none does (XOR; any other dtype)."""
    if dtype != "bool":
        return None
    return {ReduceOp.BAND: ReduceOp.MIN, ReduceOp.BOR: ReduceOp.MAX}.get(op)


def fold_bitwise(rows: Any, op: ReduceOp) -> Any:
    """The bitwise ``op`` of the rows of ``rows`` (every rank's array, gathered), as a new
    array: torch tensors with torch's ops, CuPy arrays with CuPy's."""
    library = sys.modules[type(rows).__module__.partition(".")[0]]
    combine = getattr(library, {ReduceOp.BAND: "bitwise_and", ReduceOp.BOR: "bitwise_or",
                                ReduceOp.BXOR: "bitwise_xor"}[op])
    result = clone(rows[0])
    for row in rows[1:]:
        combine(result, row, out=result)
    return result
