"""The MPI backend's buffers: what MPI is handed for each kind of array.

Host arrays go to MPI without a copy where they can (a CPU torch tensor as a numpy view
of its memory); CUDA memory directly when the MPI library is CUDA-aware
(:func:`mpi_cuda_aware`), else through pinned host memory; in both cases after the stream
that produced it has finished.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

from collectives import arrays, config
from collectives.arrays import ArrayAdapter

from ._toolkit import stage


def mpi_cuda_aware(MPI: Any) -> bool:
    """Whether the loaded MPI library takes CUDA device pointers.

    ``COLLECTIVES_MPI_CUDA_AWARE`` decides when set; else MPICH's and Open MPI's
    ``MPIX_Query_cuda_support()`` is asked, from the libmpi this process loaded.
    """
    forced = config.env_flag(config.MPI_CUDA_AWARE)
    if forced is not None:
        return forced
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libmpi" in line})
    except OSError:
        return False
    for path in paths:
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if query is not None:
            return bool(query())
    return False


def device_buffer(x: Any, adapter: ArrayAdapter, dtype: str | None, wire: str | None,
                  cuda_aware: bool) -> tuple[Any, Callable[[], None] | None]:
    """:meth:`MPICommunicator._buffer` of CUDA memory: the memory itself (staged where it
    must be) where MPI is ``cuda_aware``, else a copy in pinned host memory. MPI does not
    know CUDA streams: whatever produced x is finished first."""
    if cuda_aware:
        staged, copy_back = stage(x, adapter, dtype, wire)
        if adapter is arrays.TORCH:
            torch = sys.modules["torch"]
            torch.cuda.current_stream(staged.device).synchronize()
            return device_view(staged), copy_back
        sys.modules["cupy"].cuda.get_current_stream().synchronize()
        return staged, copy_back
    if adapter is arrays.TORCH:
        torch = sys.modules["torch"]
        t = x.detach()
        host = torch.empty(t.shape, dtype=t.dtype if wire is None else getattr(torch, wire),
                           pin_memory=True)
        host.copy_(t)  # a blocking device-to-host copy: ordered after the producer
        return host_view(host), lambda: t.copy_(host)
    cupy = sys.modules["cupy"]
    target = x.dtype if wire is None else arrays.NUMPY.dtype_of(wire)
    # Pinned host memory, filled by a copy on CuPy's current stream that blocks the host:
    # so it is ordered after whatever produced x on that stream.
    host = cupyx_empty_pinned(x.shape, target)
    cupy.ascontiguousarray(x, dtype=target).get(out=host, blocking=True)

    def writeback() -> None:
        staged_back = cupy.asarray(host)
        x[...] = staged_back
        # The copy from pinned memory may still run when we return; the next call may
        # reuse that memory, so wait for it here (as torch's blocking copy_ does).
        cupy.cuda.get_current_stream().synchronize()

    return host, writeback


def cupyx_empty_pinned(shape: tuple[int, ...], dtype: Any) -> Any:
    """A numpy array in pinned (page-locked) host memory, from CuPy's pinned pool."""
    import cupyx  # noqa: PLC0415

    return cupyx.empty_pinned(shape, dtype=dtype)


def host_view(t: Any) -> Any:
    """A CPU tensor's memory as a numpy array (bfloat16, which numpy lacks, as its int16 bytes)."""
    torch = sys.modules["torch"]
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def device_view(t: Any) -> Any:
    """What mpi4py takes for CUDA memory: the tensor itself (it has __cuda_array_interface__),
    with bfloat16 reinterpreted as int16 since only its bytes matter when we get here."""
    torch = sys.modules["torch"]
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t
