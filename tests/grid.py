"""Inputs and numpy references for the dtype x op x world-size grid (used by the test process
and, through the jobs, by the ranks).

Every per-rank input is made from (seed, rank, dtype, op) in the test process, so the
reference below is computed from exactly the arrays the ranks reduced. bfloat16 values are
float32 numbers rounded to bfloat16 (numpy has no bfloat16); the ranks turn them into
torch.bfloat16 tensors.
"""

from __future__ import annotations

import numpy as np

from collectives.ops import ALLOWED_OPS, DTYPES, FLOAT_DTYPES, INTEGER_DTYPES, ReduceOp

SHAPE = (5, 3)
# float32 epsilon of each float dtype's significand (bfloat16: 8 bits).
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}


def round_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), still as float32."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def numpy_dtype(dtype: str) -> np.dtype:
    """How a dtype travels between the test process and ranks (bfloat16 as float32)."""
    return np.dtype("float32" if dtype == "bfloat16" else dtype)


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


def reference(inputs: list[np.ndarray], dtype: str, op: ReduceOp) -> np.ndarray:
    """The reduction of ``inputs`` computed by numpy: integers in their own dtype (so SUM
    and PROD wrap), floats in float64."""
    stack = np.stack(inputs)
    if dtype == "bool":
        reducer = {ReduceOp.MIN: np.logical_and, ReduceOp.BAND: np.logical_and,
                   ReduceOp.MAX: np.logical_or, ReduceOp.BOR: np.logical_or,
                   ReduceOp.BXOR: np.logical_xor}[op]
        return reducer.reduce(stack, axis=0)
    if dtype in INTEGER_DTYPES:
        reducer = {ReduceOp.SUM: np.add, ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum,
                   ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and,
                   ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}[op]
        return reducer.reduce(stack, axis=0, dtype=dtype)
    wide = stack.astype(np.float64)
    if op is ReduceOp.SUM:
        return wide.sum(axis=0)
    if op is ReduceOp.AVG:
        return wide.sum(axis=0) / len(inputs)
    if op is ReduceOp.PROD:
        return wide.prod(axis=0)
    return wide.min(axis=0) if op is ReduceOp.MIN else wide.max(axis=0)


def tolerance(inputs: list[np.ndarray], dtype: str, op: ReduceOp, ref: np.ndarray) -> np.ndarray:
    """Per-element error bound for float reductions; 0 (exact) for everything else.

    SUM of n terms in any order: (n-1) roundings of partial sums, each at most eps times
    the sum of magnitudes, plus the final rounding to the dtype: n * eps * sum|x_i|.
    AVG adds one rounding of the division. PROD: n * eps relative. MIN/MAX are exact.
    """
    if dtype not in FLOAT_DTYPES or op in (ReduceOp.MIN, ReduceOp.MAX):
        return np.zeros_like(ref, dtype=np.float64)
    n, eps = len(inputs), EPS[dtype]
    magnitude = np.abs(np.stack(inputs).astype(np.float64)).sum(axis=0)
    if op is ReduceOp.SUM:
        return n * eps * magnitude
    if op is ReduceOp.AVG:
        return n * eps * magnitude / n + eps * np.abs(ref)
    return (n + 1) * eps * np.abs(ref)


def allowed_pairs() -> list[tuple[str, ReduceOp]]:
    return [(dtype, op) for dtype in DTYPES for op in ReduceOp if op in ALLOWED_OPS[dtype]]


def disallowed_pairs() -> list[tuple[str, ReduceOp]]:
    return [(dtype, op) for dtype in DTYPES for op in ReduceOp if op not in ALLOWED_OPS[dtype]]


# -- in the ranks -------------------------------------------------------------------------

def to_kind(values: np.ndarray, dtype: str, kind: str):
    """The rank's array of ``kind`` ("numpy" or "torch") holding ``values`` as ``dtype``."""
    if kind == "numpy":
        return values.astype(dtype, copy=True)
    import torch

    tensor = torch.from_numpy(np.array(values, copy=True))
    return tensor.to(getattr(torch, dtype))


def to_numpy(x, dtype: str) -> np.ndarray:
    """A rank's result back as numpy (bfloat16 as float32, exactly)."""
    if isinstance(x, np.ndarray):
        return x.copy()
    import torch

    if x.dtype == torch.bfloat16:
        x = x.to(torch.float32)
    return x.detach().cpu().numpy().copy()


def kinds_for(backend: str) -> list[str]:
    return ["torch", "numpy"]


def dtypes_for(kind: str) -> tuple[str, ...]:
    # numpy has no bfloat16 (without ml_dtypes), so that dtype is covered by torch tensors.
    return DTYPES if kind == "torch" else tuple(d for d in DTYPES if d != "bfloat16")
