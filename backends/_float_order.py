"""MIN/MAX of floats that propagate NaN, through the transports' integer MIN/MAX.

MPI's and Gloo's float MIN/MAX compare with ``<``, so a NaN on one rank is lost or
kept depending on the order of evaluation; numpy and torch propagate it. The float's
bits, read as a signed integer ``i`` and mapped to ``i ^ ((i >> (bits-1)) & INT_MAX)``,
order exactly like the floats (``-inf < ... < -0.0 < 0.0 < ... < inf``), so the
transport's exact integer MIN/MAX compute the float MIN/MAX. Before the reduction every
NaN is set to the integer that wins (INT_MIN for MIN, INT_MAX for MAX); mapped back,
those are NaN bit patterns, the same on every rank. -0.0 is below 0.0 (IEEE 754's
``minimum``/``maximum``).

The functions work in place on numpy, CuPy and torch arrays alike (only operators and
boolean-mask assignment are used). The map is its own inverse.
"""

from __future__ import annotations

from typing import Any

from collectives.ops import ReduceOp

NAN_ORDERED_OPS = (ReduceOp.MIN, ReduceOp.MAX)


def encode(ints: Any, isnan: Any, op: ReduceOp, bits: int) -> None:
    """Turn ``ints`` (a float array's bits as signed ints) into order keys, in place.

    ``isnan`` is the float array's NaN mask, taken before ``ints`` is changed.
    """
    ints ^= (ints >> (bits - 1)) & ((1 << (bits - 1)) - 1)
    ints[isnan] = -(1 << (bits - 1)) if op is ReduceOp.MIN else (1 << (bits - 1)) - 1


def decode(ints: Any, bits: int) -> None:
    """Turn order keys back into float bits, in place (reduced NaN keys become NaN)."""
    ints ^= (ints >> (bits - 1)) & ((1 << (bits - 1)) - 1)
