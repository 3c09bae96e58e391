"""Small-integer SUM and PROD wrap, as numpy's do, on every MPI library: Open MPI's AVX
reduction component saturates them (3 x 30000 as int16 is 32767 there, 24464 in numpy) once
a vector instruction does the add, so the MPI backend reduces them through int32 under Open
MPI (backends/mpi_library.py). float16 reductions match numpy both where the library reduces
MPIX_C_FLOAT16 and, through float32, where it refuses it (Debian's Open MPI 4.1.6, on the GPU
machine's image). Run under each MPI by `make test-environments`."""

from __future__ import annotations

import numpy as np
import pytest
from collectives.backends.mpi_library import saturates_small_integer_sums, wrapping_wire

from collectives.ops import ReduceOp
from collectives.testing.reference import as_array, to_numpy

DTYPES = ["int8", "uint8", "int16"]
# 3 elements stay in scalar code; 64 and more go through the vector kernels.
LENGTHS = [3, 64, 1000]


def values(dtype, op, length, rank):
    """Inputs whose sum (product) leaves the dtype's range: near the top for SUM, 3..9 for PROD."""
    info = np.iinfo(dtype)
    if op == "sum":
        start = info.max // 2 + 1 + rank
        return np.full(length, start, dtype=dtype) - np.arange(length, dtype=dtype) % 5
    return (np.arange(length) % 7 + 3 + rank).astype(dtype)


def expected(dtype, op, length, size):
    with np.errstate(over="ignore"):
        total = values(dtype, op, length, 0).copy()
        for rank in range(1, size):
            x = values(dtype, op, length, rank)
            total = total + x if op == "sum" else total * x
    return total


def sums_job(comm, kind):
    out = {}
    for dtype in DTYPES:
        for op in ("sum", "prod"):
            for length in LENGTHS:
                x = as_array(values(dtype, op, length, comm.rank), dtype, kind)
                out["all_reduce", dtype, op, length] = to_numpy(comm.all_reduce(x, op))
                rows = as_array(values(dtype, op, length * comm.size, comm.rank), dtype, kind)
                out["reduce_scatter", dtype, op, length] = to_numpy(comm.reduce_scatter(rows, op))
                y = as_array(values(dtype, op, length, comm.rank), dtype, kind)
                comm.reduce(y, op, dst=0)
                out["reduce", dtype, op, length] = to_numpy(y)
    return out


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("world", [("mpi", 3)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
def test_small_integer_sum_and_prod_wrap_like_numpy_on_this_mpi(world, kind):
    results = world.run(sums_job, args=(kind,))
    wrong = []
    for rank, got in enumerate(results):
        for (name, dtype, op, length), value in got.items():
            if name == "reduce_scatter":
                want = expected(dtype, op, length * world.size, world.size)[rank * length:(rank + 1) * length]
            elif name == "reduce" and rank != 0:
                want = values(dtype, op, length, rank)  # off dst: untouched
            else:
                want = expected(dtype, op, length, world.size)
            if value.dtype != np.dtype(dtype) or not np.array_equal(value, want):
                wrong.append(f"rank {rank} {name} {dtype} {op} x{length}: {value[:3]} != {want[:3]}")
    assert not wrong, "\n".join(wrong)


def test_only_open_mpi_reduces_small_integers_through_int32():
    open_mpi = "Open MPI v5.0.11, package: Open MPI Distribution, ident: 5.0.11"
    assert saturates_small_integer_sums(open_mpi)
    for other in ("MPICH Version:      5.0.2", "Intel(R) MPI Library 2021.18 for Linux* OS", ""):
        assert not saturates_small_integer_sums(other)
    for dtype in DTYPES:
        for op in (ReduceOp.SUM, ReduceOp.PROD):
            assert wrapping_wire(dtype, op, True) == "int32"
            assert wrapping_wire(dtype, op, False) is None
        for op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
            assert wrapping_wire(dtype, op, True) is None
    for dtype in ("int32", "int64", "float32", "bool"):
        assert wrapping_wire(dtype, ReduceOp.SUM, True) is None


def float16_job(comm, native):
    """float16 SUM, AVG, PROD, MIN of all_reduce, reduce_scatter and reduce on a split of the world
    whose transport reduces float16 natively or (``native=False``, as where the library refuses
    MPIX_C_FLOAT16) through float32; ``native`` as the transport decided it is returned too."""
    from collectives.backends import mpi_channel

    probe = mpi_channel.float16_datatype
    if not native:  # the library's answer on Debian's Open MPI 4.1.6
        mpi_channel.float16_datatype = lambda MPI: MPI.DATATYPE_NULL
    try:
        child = comm.split(0)
    finally:
        mpi_channel.float16_datatype = probe
    out = {"native": child._transport._float16_native}
    for op in ("sum", "avg", "prod", "min"):
        x = np.linspace(0.5, 2.0, 5 * comm.size, dtype=np.float16) + np.float16(comm.rank)
        out["all_reduce", op] = child.all_reduce(x.copy(), op)
        out["reduce_scatter", op] = child.reduce_scatter(x.copy(), op)
        y = x.copy()
        child.reduce(y, op, dst=0)
        out["reduce", op] = y
    child.close()
    return out


@pytest.mark.parametrize("native", [True, False], ids=["as-the-library-says", "through-float32"])
@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
def test_float16_reductions_match_numpy_natively_or_through_float32(world, native):
    results = world.run(float16_job, args=(native,))
    size = world.size
    inputs = [np.linspace(0.5, 2.0, 5 * size, dtype=np.float16) + np.float16(r) for r in range(size)]
    wide = np.stack(inputs).astype(np.float64)
    want = {"sum": wide.sum(0), "avg": wide.mean(0), "prod": wide.prod(0), "min": wide.min(0)}
    for rank, got in enumerate(results):
        if not native:
            assert got["native"] is False
        for op, total in want.items():
            for name, value, reference in (
                    ("all_reduce", got["all_reduce", op], total),
                    ("reduce_scatter", got["reduce_scatter", op], total[rank * 5:(rank + 1) * 5]),
                    ("reduce", got["reduce", op], total if rank == 0 else inputs[rank])):
                assert value.dtype == np.float16, (name, op)
                np.testing.assert_allclose(value.astype(np.float64), reference, rtol=2e-3,
                                           err_msg=f"rank {rank} {name} {op}")


def test_float16_probe_refuses_what_the_library_cannot_reduce():
    from collectives.backends.mpi_library import float16_datatype
    from mpi4py import MPI

    assert float16_datatype(MPI) == MPI.FLOAT16_T  # MPICH (and Open MPI 5) reduce it

    class Refusing:  # Debian's Open MPI 4.1.6: MPI_ERR_TYPE from any float16 reduction
        DATATYPE_NULL, FLOAT16_T, IN_PLACE, SUM = MPI.DATATYPE_NULL, MPI.FLOAT16_T, MPI.IN_PLACE, MPI.SUM

        class COMM_SELF:
            @staticmethod
            def Allreduce(*args):
                raise MPI.Exception(MPI.ERR_TYPE)

    assert float16_datatype(Refusing) == MPI.DATATYPE_NULL


def test_library_version_is_one_clean_line():
    from collectives.backends.mpi_library import library_version

    class OpenMPI41:  # what mpi4py returned on the GPU machine's Debian Open MPI 4.1.6
        @staticmethod
        def Get_library_version():
            return "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6, repo rev: v4.1.6, Sep 30, 2023\0"

    assert library_version(OpenMPI41) == \
        "Open MPI v4.1.6, package: Debian OpenMPI, ident: 4.1.6, repo rev: v4.1.6, Sep 30, 2023"
    assert saturates_small_integer_sums(library_version(OpenMPI41))
