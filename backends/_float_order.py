"""MIN/MAX of floats that propagate NaN, through the transports' integer MIN/MAX.

MPI's and Gloo's float MIN/MAX compare with ``<``, so a NaN on one rank is lost or
kept depending on the order of evaluation; NCCL's use ``fminf``/``fmaxf``/``__hmin``/
``__hmax``, which drop it; numpy and torch propagate it. The float's bits, read as a
signed integer ``i`` and mapped to ``i ^ ((i >> (bits-1)) & INT_MAX)``, order exactly
like the floats (``-inf < ... < -0.0 < 0.0 < ... < inf``), so the transport's exact
integer MIN/MAX compute the float MIN/MAX. Before the reduction every NaN is set to the
integer that wins (INT_MIN for MIN, INT_MAX for MAX), and only a NaN can become those
keys; after it they are replaced by the dtype's quiet NaN (:data:`QUIET_NAN_BITS`, what
``numpy.nan`` and ``torch.nan`` are in each dtype), the same bits on every rank and every
backend whatever NaN the ranks gave. -0.0 is below 0.0 (IEEE 754's
``minimum``/``maximum``).

The functions work in place on numpy, CuPy and torch arrays alike (only operators and
boolean-mask assignment are used).
"""

from __future__ import annotations

from typing import Any

from collectives.ops import ReduceOp

NAN_ORDERED_OPS = (ReduceOp.MIN, ReduceOp.MAX)

#: Bits per element of each float dtype.
FLOAT_BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}
#: +inf and the canonical quiet NaN of each float dtype, as the signed integers of their bits
#: (sign 0, exponent all ones; fraction 0 / only its quiet bit set).
INFINITY_BITS = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F80_0000,
                 "float64": 0x7FF0_0000_0000_0000}
QUIET_NAN_BITS = {"float16": 0x7E00, "bfloat16": 0x7FC0, "float32": 0x7FC0_0000,
                  "float64": 0x7FF8_0000_0000_0000}


def encode(ints: Any, op: ReduceOp, dtype: str) -> None:
    """Turn ``ints``, the bits of a float array of the dtype named ``dtype`` read as signed
    integers of its width, into order keys for ``op`` (MIN or MAX), in place.

    NaNs are found from the bits (exponent all ones, fraction not zero), so ``ints`` may be
    the only view of the floats there is (bfloat16 in numpy has none of its own)."""
    bits = FLOAT_BITS[dtype]
    top = (1 << (bits - 1)) - 1
    isnan = (ints & top) > INFINITY_BITS[dtype]
    ints ^= (ints >> (bits - 1)) & top
    ints[isnan] = -top - 1 if op is ReduceOp.MIN else top


def decode(ints: Any, dtype: str) -> None:
    """Turn order keys back into the bits of the float dtype named ``dtype``, in place; the
    keys only a NaN has (INT_MIN, INT_MAX) become the dtype's quiet NaN."""
    bits = FLOAT_BITS[dtype]
    top = (1 << (bits - 1)) - 1
    ints[(ints == top) | (ints == -top - 1)] = QUIET_NAN_BITS[dtype]  # a positive key: kept below
    ints ^= (ints >> (bits - 1)) & top
