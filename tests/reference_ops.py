"""Independent references for collectives tests (CPU only: Python integers, float64)."""

import torch

from collectives import ReduceOp

#: Relative (and, times the rank count, absolute) tolerance of a float reduction vs float64.
FLOAT_TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12}


def reference(dtype, op, per_rank):
    """Independent: Python integers reduced mod 2**bits, logic on bools, float64 for floats.

    ``per_rank``: CPU tensors of one shape and dtype; returns that shape (float64 for floats).
    """
    shape = tuple(per_rank[0].shape)
    return _reference_flat(dtype, op, [t.reshape(-1) for t in per_rank]).reshape(shape)


def _reference_flat(dtype, op, per_rank):
    values = [t.to(torch.float64 if dtype in ("float16", "bfloat16", "float32", "float64")
                   else torch.int64).tolist() for t in per_rank]
    columns = list(zip(*values))
    if dtype == "bool":
        fn = {ReduceOp.MIN: all, ReduceOp.BAND: all, ReduceOp.MAX: any, ReduceOp.BOR: any,
              ReduceOp.BXOR: lambda c: sum(c) % 2 == 1}[op]
        return torch.tensor([fn(c) for c in columns])
    if dtype.startswith(("int", "uint")):
        bits = torch.iinfo(getattr(torch, dtype)).bits
        fn = {ReduceOp.SUM: sum, ReduceOp.PROD: lambda c: _fold(c, int.__mul__), ReduceOp.MIN: min, ReduceOp.MAX: max,
              ReduceOp.BAND: lambda c: _fold(c, int.__and__), ReduceOp.BOR: lambda c: _fold(c, int.__or__),
              ReduceOp.BXOR: lambda c: _fold(c, int.__xor__)}[op]
        wrapped = []
        for c in columns:
            v = fn([int(e) for e in c]) % 2 ** bits
            if dtype.startswith("int") and v >= 2 ** (bits - 1):
                v -= 2 ** bits
            wrapped.append(v)
        return torch.tensor(wrapped, dtype=getattr(torch, dtype))
    fn = {ReduceOp.SUM: sum, ReduceOp.AVG: lambda c: sum(c) / len(c), ReduceOp.PROD: lambda c: _fold(c, float.__mul__),
          ReduceOp.MIN: min, ReduceOp.MAX: max}[op]
    return torch.tensor([fn(list(c)) for c in columns], dtype=torch.float64)


def _fold(column, fn):
    acc = column[0]
    for e in column[1:]:
        acc = fn(acc, e)
    return acc


def random_rank_tensors(dtype, size, rng, shape=(64,)):
    """One CPU tensor per rank: all of the dtype's range for integers, [-2, 2] for floats."""
    if dtype == "bool":
        return [torch.from_numpy(rng.integers(0, 2, shape).astype(bool)) for _ in range(size)]
    if dtype.startswith(("int", "uint")):
        info = torch.iinfo(getattr(torch, dtype))
        return [torch.from_numpy(rng.integers(info.min, info.max, shape, endpoint=True)).to(getattr(torch, dtype))
                for _ in range(size)]
    return [torch.from_numpy(rng.uniform(-2, 2, shape)).to(getattr(torch, dtype)) for _ in range(size)]
