"""The MPI backend's buffers: what MPI is handed for each kind of array.

Host arrays go to MPI without a copy where they can (a CPU torch tensor as a numpy view
of its memory); CUDA memory directly when the MPI library is CUDA-aware
(:func:`mpi_cuda_aware`), else through pinned host memory; in both cases after the stream
that produced it has finished. Direct device memory is handed over by :func:`hand_over`,
right before the MPI call: after every kernel of the call that wrote it (staging copies,
order keys), its stream is synchronized (mpi4py takes device buffers through DLPack with
``stream=-1``: no synchronization of its own).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

from collectives import arrays, config
from collectives.arrays import ArrayAdapter

from ._buffers import stage


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
    must be) where MPI is ``cuda_aware`` (:func:`hand_over` makes it ready for MPI), else a
    copy in pinned host memory, made after whatever produced x."""
    if cuda_aware:
        return stage(x, adapter, dtype, wire)
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
    with x.device:
        cupy.ascontiguousarray(x, dtype=target).get(out=host, blocking=True)

    def writeback() -> None:
        with x.device:
            x[...] = cupy.asarray(host)
            # The copy from pinned memory may still run when we return; the next call may
            # reuse that memory, so wait for it here (as torch's blocking copy_ does).
            cupy.cuda.get_current_stream().synchronize()

    return host, writeback


def hand_over(calls: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """The arguments of MPI calls (``[buffer, ...]`` lists among other values) with their
    CUDA memory made ready for a CUDA-aware MPI, right before the calls:

    - the stream that wrote each device buffer (torch's or CuPy's current stream on the
      buffer's device) is synchronized, once per device: the staging copies and the order
      keys of the call ran on it after the caller's kernels;
    - a torch tensor goes as raw device memory through the CUDA array interface
      (:class:`DeviceMemory`): its ``__dlpack__`` refuses a tensor of a device other than
      torch's current one, and would type bfloat16 as a void.
    """
    synced: set[Any] = set()
    return [tuple(_ready(arg, synced) if isinstance(arg, list) and arg else arg for arg in args)
            for args in calls]


def _ready(spec: list[Any], synced: set[Any]) -> list[Any]:
    buffer = spec[0]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buffer, torch.Tensor):
        if not arrays.TORCH.is_cuda(buffer):
            return spec
        if buffer.device not in synced:
            torch.cuda.current_stream(buffer.device).synchronize()
            synced.add(buffer.device)
        return [DeviceMemory(buffer), *spec[1:]]
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(buffer, cupy.ndarray):
        if buffer.device.id not in synced:
            with buffer.device:
                cupy.cuda.get_current_stream().synchronize()
            synced.add(buffer.device.id)
    return spec


class DeviceMemory:
    """A contiguous tensor's bytes as mpi4py takes device memory: the CUDA array interface
    alone (no ``__dlpack__``, no buffer protocol), keeping the tensor alive."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        nbytes = tensor.numel() * tensor.element_size()
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (tensor.data_ptr() if nbytes else 0, False),
            "strides": None, "version": 3, "stream": None}


def bind_device(local_rank: int) -> int | None:
    """Make CUDA device ``local_rank % device_count`` current in the CUDA libraries this
    process has loaded (torch, CuPy), as every backend does before its communicator exists;
    ``None`` where neither is loaded with a GPU in sight. Nothing is imported here."""
    bound = None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        bound = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(bound)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            count = int(cupy.cuda.runtime.getDeviceCount())
        except Exception:  # noqa: BLE001  (CUDARuntimeError: no driver, no device)
            count = 0
        if count:
            bound = local_rank % count
            cupy.cuda.Device(bound).use()
    return bound


def cupyx_empty_pinned(shape: tuple[int, ...], dtype: Any) -> Any:
    """A numpy array in pinned (page-locked) host memory, from CuPy's pinned pool."""
    import cupyx  # noqa: PLC0415

    return cupyx.empty_pinned(shape, dtype=dtype)


def host_view(t: Any) -> Any:
    """A CPU tensor's memory as a numpy array (bfloat16, which numpy lacks, as its int16 bytes)."""
    torch = sys.modules["torch"]
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def tensor_address(MPI: Any, t: Any) -> Any:
    """A contiguous CPU tensor's memory as an mpi4py buffer, by address: what a tensor's numpy
    view gives MPI, at a tenth of its cost (~0.1 us; ``t.detach().numpy()`` takes ~1 us)."""
    return MPI.buffer.fromaddress(t.data_ptr(), t.nbytes)
