"""MIN/MAX of floats with NaNs: every result NaN is the dtype's canonical quiet NaN (the bits of
``numpy.nan`` / ``torch.nan`` in that dtype), whatever NaNs the ranks gave (negative, with a
payload, signalling), on every backend, in all_reduce, reduce and reduce_scatter; the other
elements are the exact MIN/MAX. The order keys that carry NaN through the transports'
integer MIN/MAX used to decode into 0x7fff...f (MAX) and 0xffff...f (MIN).

The cupy backend's plan is checked on CPU in tests/gpu/test_cupy_backend.py (the same keys).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

FLOATS = ("float16", "bfloat16", "float32", "float64")
INTS = {"float16": torch.int16, "bfloat16": torch.int16, "float32": torch.int32, "float64": torch.int64}
#: NaNs that are not the canonical one: negative, with a payload, signalling (quiet bit clear).
#: The reference: what torch.nan is in each dtype (numpy.nan too, checked below).
QUIET_NAN_BITS = {dtype: torch.tensor(float("nan"), dtype=getattr(torch, dtype)).view(INTS[dtype]).item()
                  for dtype in FLOATS}
ODD_NANS = {"float16": [-0x0200, 0x7C01, 0x7E05],  # -0x0200 is 0xFE00: the negative quiet NaN
            "bfloat16": [-0x0040, 0x7F81, 0x7FC5],
            "float32": [-0x0040_0000, 0x7F80_0001, 0x7FC0_0123],
            "float64": [-0x0008_0000_0000_0000, 0x7FF0_0000_0000_0001, 0x7FF8_0000_0000_4567]}


def rank_values(dtype, rank, size):
    """``4 * size`` elements as float bits: [NaN on this rank only if rank 0, NaN on every rank
    (each its own kind), a finite value, -0.0/0.0] repeated per reduce_scatter block."""
    one = torch.tensor([1.5 + rank, -2.0 * rank, 0.0 if rank else -0.0], dtype=getattr(torch, dtype))
    bits = one.view(INTS[dtype]).tolist()
    odd = ODD_NANS[dtype]
    block = [odd[0] if rank == 0 else bits[0], odd[rank % len(odd)], bits[1], bits[2]]
    return block * size


def nan_job(comm, kind):
    """all_reduce, reduce (dst 0) and reduce_scatter of MIN and MAX on every float dtype; results
    as their integer bits (numpy), keyed (collective, dtype, op)."""
    out = {}
    for dtype in FLOATS:
        if kind == "numpy" and dtype == "bfloat16":
            continue  # numpy has no bfloat16 of its own
        bits = torch.tensor(rank_values(dtype, comm.rank, comm.size), dtype=INTS[dtype])
        for op in ("min", "max"):
            x = _fresh(bits, dtype, kind)
            comm.all_reduce(x, op)
            out[("all_reduce", dtype, op)] = _bits(x, dtype)
            x = _fresh(bits, dtype, kind)
            comm.reduce(x, op, dst=0)
            if comm.rank == 0:
                out[("reduce", dtype, op)] = _bits(x, dtype)
            out[("reduce_scatter", dtype, op)] = _bits(comm.reduce_scatter(_fresh(bits, dtype, kind), op), dtype)
    return out


def _fresh(bits, dtype, kind):
    x = bits.clone().view(getattr(torch, dtype))
    return x.numpy() if kind == "numpy" else x


def _bits(x, dtype):
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    return t.contiguous().view(INTS[dtype]).numpy().copy()


def expected(dtype, op, size):
    """The block of 4 every result holds: quiet NaN, quiet NaN, MIN/MAX, MIN/MAX (-0.0 < 0.0)."""
    columns = zip(*(torch.tensor(rank_values(dtype, r, size)[2:4], dtype=INTS[dtype])
                    .view(getattr(torch, dtype)).tolist() for r in range(size)))
    pick = min if op == "min" else max
    values = [pick(column, key=lambda v: (v, math.copysign(1.0, v))) for column in columns]
    bits = torch.tensor(values, dtype=getattr(torch, dtype)).view(INTS[dtype]).tolist()
    return [QUIET_NAN_BITS[dtype]] * 2 + bits


def test_quiet_nan_bits_are_numpys_and_the_backends():
    from collectives.backends import _float_order

    assert QUIET_NAN_BITS == {"float16": 0x7E00, "bfloat16": 0x7FC0, "float32": 0x7FC0_0000,
                              "float64": 0x7FF8_0000_0000_0000}
    for dtype in ("float16", "float32", "float64"):
        assert np.array(np.nan, dtype=dtype).view(f"int{INTS[dtype].itemsize * 8}") == QUIET_NAN_BITS[dtype]
    assert _float_order.QUIET_NAN_BITS == QUIET_NAN_BITS


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["torch", "numpy"])
@pytest.mark.parametrize("world", [("mpi", 2), ("mpi", 3), ("torch", 2), ("torch", 3)], indirect=True,
                         ids=lambda p: f"{p[0]}-{p[1]}")
def test_min_max_nan_results_are_the_canonical_quiet_nan(world, kind):
    size = world.size
    replies = world.run(nan_job, args=(kind,), timeout=120)
    for rank, reply in enumerate(replies):
        for (collective, dtype, op), got in reply.items():
            want = expected(dtype, op, size)
            if collective != "reduce_scatter":
                want = want * size
            assert got.tolist() == want, (f"{collective} {dtype} {op} on rank {rank}: "
                                          f"{[hex(v & (1 << 64) - 1) for v in got.tolist()]}")
