"""Inputs and numpy references for the dtype x op x world-size grid (used by the test process
and, through the jobs, by the ranks).

Every per-rank input is made from (seed, rank, dtype, op) in the test process, so the
reference below is computed from exactly the arrays the ranks reduced. bfloat16 values are
float32 numbers rounded to bfloat16 (numpy has no bfloat16); the ranks turn them into
torch.bfloat16 tensors. The reference reduction and the conversions to and from the ranks'
arrays are collectives.testing.reference's (the harness users get).
"""

from __future__ import annotations

import numpy as np

from collectives.ops import ALLOWED_OPS, DTYPES, FLOAT_DTYPES, INTEGER_DTYPES, ReduceOp
from collectives.testing.reference import float_tolerance, round_to_bfloat16

SHAPE = (5, 3)


def make_input(seed: int, rank: int, dtype: str, op: ReduceOp | None, shape=SHAPE) -> np.ndarray:
    """Rank ``rank``'s input for (dtype, op): values that exercise the op (wraparound for
    integer SUM/PROD, full bit patterns for bitwise ops, mixed signs for floats)."""
    rng = np.random.default_rng([seed, rank, DTYPES.index(dtype), 99 if op is None else list(ReduceOp).index(op)])
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype in INTEGER_DTYPES:
        info = np.iinfo(dtype)
        if op is ReduceOp.PROD:  # small factors, and some large ones that wrap
            values = rng.integers(-3 if info.min < 0 else 0, 4, size=shape)
            values[0] = rng.integers(info.min, int(info.max) + 1, size=shape[1:])
            return values.astype(dtype)
        return rng.integers(info.min, int(info.max) + 1, size=shape, dtype=dtype)
    if op is ReduceOp.PROD:
        values = rng.uniform(0.5, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    else:
        values = rng.normal(0.0, 10.0, size=shape)
    if dtype == "bfloat16":
        return round_to_bfloat16(values.astype(np.float32))
    return values.astype(dtype)


def tolerance(inputs: list[np.ndarray], dtype: str, op: ReduceOp, ref: np.ndarray) -> np.ndarray:
    """Per-element error bound: collectives.testing.reference's (0, exact, for everything but
    float SUM, AVG and PROD; the grid's inputs never reach overflow, so every element is checked)."""
    if dtype not in FLOAT_DTYPES:
        return np.zeros_like(ref, dtype=np.float64)
    bound, checked = float_tolerance(inputs, dtype, op)
    assert checked.all(), "the grid's inputs stay far from overflow"
    return np.asarray(bound, dtype=np.float64)


def allowed_pairs() -> list[tuple[str, ReduceOp]]:
    return [(dtype, op) for dtype in DTYPES for op in ReduceOp if op in ALLOWED_OPS[dtype]]


def disallowed_pairs() -> list[tuple[str, ReduceOp]]:
    return [(dtype, op) for dtype in DTYPES for op in ReduceOp if op not in ALLOWED_OPS[dtype]]


# numpy has no bfloat16 (without ml_dtypes), so that dtype is covered by torch tensors.
def dtypes_for(kind: str) -> tuple[str, ...]:
    return DTYPES if kind == "torch" else tuple(d for d in DTYPES if d != "bfloat16")
