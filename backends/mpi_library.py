"""What the MPI library mpi4py loaded does differently, decided from what it says it is.

mpi4py 4 picks its MPI library when it is imported (the MPICH, Open MPI or Intel MPI
wheel, or the cluster's), so the quirks of the library are only known then, from
``MPI.Get_library_version()``, never guessed from the launcher or the environment.

Open MPI's AVX reduction component (``op/avx``, on by default on x86-64 since 4.1)
SATURATES the sums of 8- and 16-bit integers where every other MPI, and numpy, wrap:
3 x 30000 as int16 gives 32767 instead of 24464, as soon as a vector instruction does the
add (about 64 elements and up; open-mpi/ompi#8045, closed as intended). The contract says
small-integer SUM and PROD wrap on every backend, so under Open MPI those reductions go
through int32 on the wire, which no sum of 8- or 16-bit values from fewer than 65,536 ranks
overflows, and are written back with a wrapping cast: the low bits are the wrapped result.
PROD did not saturate in any measurement; it goes the same way all the same, since the
AVX component's kernels for it are the same kind of code and the cost is a copy.

float16: mpi4py names ``MPI.FLOAT16_T`` (``MPIX_C_FLOAT16``) wherever it can, yet a library
may still refuse to reduce it: Debian's Open MPI 4.1.6 fails every float16 reduction with
``MPI_ERR_TYPE``. Whether it reduces is probed once, locally (:func:`float16_datatype`); where
it does not, float16 is reduced through float32 like bfloat16.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from collectives.ops import ReduceOp

#: The dtypes whose SUM/PROD Open MPI may saturate, and the dtype they are reduced in there.
SATURATING_WIRE = {"int8": "int32", "uint8": "int32", "int16": "int32"}
WRAPPING_OPS = (ReduceOp.SUM, ReduceOp.PROD)


def library_version(MPI: Any) -> str:
    """The first line of ``MPI_Get_library_version`` ("Open MPI v5.0.11, ...", "MPICH
    Version: 5.0.2", "Intel(R) MPI Library 2021.18 ..."), its runs of blanks as one space and
    without the NUL Open MPI 4.1 leaves in it; "" where mpi4py cannot say."""
    try:
        text: str = MPI.Get_library_version().replace("\0", " ")
    except Exception:  # noqa: BLE001  (an MPI-1 library, or mpi4py built without it)
        return ""
    return " ".join(text.strip().splitlines()[0].split()) if text.strip() else ""


def saturates_small_integer_sums(version: str) -> bool:
    """Whether the library of ``version`` (:func:`library_version`) may saturate small-integer
    sums: Open MPI (its op/avx component; ``--mca op ^avx`` turns it off, but the library
    cannot be asked which components a job loaded, so every Open MPI is treated alike)."""
    return version.startswith("Open MPI")


def persistent_allgather_works(version: str) -> bool:
    """Whether the library of ``version`` completes a persistent MPI_Allgather_init right on every
    start. Intel MPI 2021.18 does not: at 2 ranks rank 1's own block of the gathered buffer keeps
    the previous start's data (with a separate send buffer and with MPI_IN_PLACE alike), where
    MPI_Iallgather is right; there the check's round takes MPI_Iallgather."""
    return not version.startswith("Intel")


def wrapping_wire(dtype: str, op: ReduceOp, saturates: bool) -> str | None:
    """The dtype to reduce ``dtype`` under ``op`` in, where the library would saturate it;
    ``None`` where the dtype itself reduces correctly."""
    if saturates and op in WRAPPING_OPS:
        return SATURATING_WIRE.get(dtype)
    return None


def float16_datatype(MPI: Any) -> Any:
    """``MPI.FLOAT16_T`` where the library reduces it, else ``MPI.DATATYPE_NULL``.

    Probed on this process alone: an in-place ``MPI_Allreduce`` on ``MPI_COMM_SELF`` (the
    argument checks of every reduction) and an ``MPI_Reduce_local`` of 1 + 2 (the op's kernel).
    """
    float16 = getattr(MPI, "FLOAT16_T", MPI.DATATYPE_NULL)
    if float16 == MPI.DATATYPE_NULL:
        return float16
    x, y = np.ones(1, np.float16), np.full(1, 2, np.float16)
    try:
        MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, [x, float16], MPI.SUM)
        MPI.SUM.Reduce_local([x, float16], [y, float16])
    except Exception:  # noqa: BLE001  (MPI.Exception; a library may fail it in other ways)
        return MPI.DATATYPE_NULL
    return float16 if y[0] == 3 else MPI.DATATYPE_NULL
