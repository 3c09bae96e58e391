"""Raw NCCL through ``cupy.cuda.nccl.NcclCommunicator``, on the caller's CUDA stream.

One NCCL communicator per process, on device ``local_rank % device_count`` (bound
before the communicator exists). Rank 0's NCCL unique id reaches the other ranks as
:mod:`collectives.backends.nccl_id` says (MPI broadcast under mpiexec, TCP store under torchrun).

Arrays: CuPy arrays and torch CUDA tensors, zero-copy: NCCL gets their device
pointers. Every NCCL call and every local step runs on the caller's current stream
(``torch.cuda.current_stream()`` for tensors, CuPy's current stream for CuPy
arrays), so results are ordered with the caller's kernels and the host never waits;
a handle's ``wait()`` makes the then-current stream wait for the collective's event.

What NCCL lacks is emulated, as on the torch backend (:func:`reduce_plan` is the table):
- bool is reduced as its uint8 bytes (a view): MIN/MAX, and BAND/BOR as MIN/MAX;
- int16 is reduced in int32 (a copy), which keeps wrapping SUM/PROD and MIN/MAX exact;
- BXOR, and every bitwise op on integers, gathers all ranks' arrays and folds locally;
- AVG is SUM, then a division by size (not ``ncclAvg``, which scales each input first
  and so rounds differently from the other backends);
- bfloat16 is native from NCCL 2.10 on, else reduced in float32.
Broadcast and all_gather move raw bytes. Host arrays are refused with a ``TypeError``.
``split`` uses ncclCommSplit where CuPy wraps it (CuPy >= 14, NCCL >= 2.18.1), else makes the
new communicator through this one (its group leader's id travels in an all_gather).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce
from typing import Any

from collectives.backends.nccl_id import UNIQUE_ID_BYTES, exchange_unique_id, id_from_bytes, id_to_bytes

from collectives import arrays
from collectives.arrays import ArrayAdapter
from collectives.communicator import Communicator, Work, deliver
from collectives.errors import BackendUnavailable, CollectiveError
from collectives.launcher import LaunchInfo
from collectives.ops import ReduceOp

log = logging.getLogger("collectives")

INSTALL_HINT = ("install CuPy for your CUDA: pip install 'pycollectives[cupy]' (cupy-cuda13x), "
                "or cupy-cuda12x for CUDA 12")

#: ncclDataType_t values of nccl.h (a stable ABI); bfloat16 needs NCCL >= 2.10.
NCCL_DTYPES: dict[str, int] = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4,
                               "uint64": 5, "float16": 6, "float32": 7, "float64": 8,
                               "bfloat16": 9}
#: ncclRedOp_t values of nccl.h for the ops we hand to NCCL (ncclAvg=4 is not used: see above).
NCCL_OPS: dict[str, int] = {"sum": 0, "prod": 1, "max": 2, "min": 3}
#: First NCCL with ncclBfloat16.
BFLOAT16_SINCE = (2, 10, 0)
#: First NCCL with ncclCommSplit (CuPy >= 14 wraps it as NcclCommunicator.commSplit).
COMM_SPLIT_SINCE = (2, 18, 1)
#: ``NCCL_SPLIT_NOCOLOR`` of nccl.h: this rank joins no new communicator.
NCCL_SPLIT_NOCOLOR = -1
_NOT_CALLED = object()
#: First NCCL that allows several ranks on one GPU (with NCCL_MULTI_RANK_GPU_ENABLE=1).
MULTI_RANK_GPU_SINCE = (2, 30, 0)

_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8,
             "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


@dataclass(frozen=True)
class ReducePlan:
    """How one (dtype, op) reduction runs on NCCL.

    ``wire``: the dtype NCCL (or the gather) sees; ``nccl_op``: a key of
    :data:`NCCL_OPS`, or ``None`` to all_gather and fold locally with ``fold``
    (``"band"``, ``"bor"``, ``"bxor"``) in ``wire``; ``divide``: divide by size after (AVG).
    """

    wire: str
    nccl_op: str | None
    fold: str | None = None
    divide: bool = False


def reduce_plan(dtype: str, op: ReduceOp, bfloat16_native: bool = True) -> ReducePlan:
    """The :class:`ReducePlan` for a pair that :func:`collectives.ops.check_reduction` allowed."""
    if op in _BITWISE:
        if dtype == "bool" and op is not ReduceOp.BXOR:
            # On 0/1 bytes AND is MIN and OR is MAX.
            return ReducePlan("uint8", "min" if op is ReduceOp.BAND else "max")
        return ReducePlan(dtype, None, fold=op.value)
    wire = {"bool": "uint8", "int16": "int32"}.get(dtype, dtype)
    if dtype == "bfloat16" and not bfloat16_native:
        wire = "float32"
    if op is ReduceOp.AVG:
        return ReducePlan(wire, "sum", divide=True)
    return ReducePlan(wire, op.value)


def decode_nccl_version(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s integer as (major, minor, patch): 21803 -> (2, 18, 3)."""
    if code >= 10000:  # NCCL >= 2.9: major*10000 + minor*100 + patch
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100  # older: major*1000 + minor*100 + patch


def import_cupy_nccl() -> tuple[Any, Any]:
    """``(cupy, cupy.cuda.nccl)``, or ``BackendUnavailable`` saying why and how to install."""
    try:
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415
    except ImportError as error:
        raise BackendUnavailable(f"backend 'cupy' needs CuPy with NCCL ({error}); "
                                 f"{INSTALL_HINT}") from error
    if not getattr(nccl, "available", False):
        raise BackendUnavailable("backend 'cupy': this CuPy was built without NCCL; "
                                 f"{INSTALL_HINT}")
    return cupy, nccl


def nccl_runtime_version() -> tuple[int, int, int]:
    """The version of the libnccl CuPy loaded (``ncclGetVersion``)."""
    _, nccl = import_cupy_nccl()
    return decode_nccl_version(int(nccl.get_version()))


def check_cuda_array(x: Any, adapter: ArrayAdapter, device: int | None) -> None:
    """``TypeError`` unless ``x`` is CUDA memory; ``ValueError`` unless on ``device``."""
    if not adapter.is_cuda(x):
        kind = "numpy.ndarray" if adapter is arrays.NUMPY else "CPU torch.Tensor"
        raise TypeError(f"backend 'cupy' runs NCCL on CUDA memory only; x is a {kind} in host "
                        "memory: pass a cupy.ndarray or a CUDA torch.Tensor (cupy.asarray(x), "
                        "x.cuda()), or use backend 'mpi' or 'torch' for host arrays")
    index = adapter.device_index(x)
    if device is not None and index != device:
        raise ValueError(f"x is on CUDA device {index}, but this communicator's NCCL runs on "
                         f"device {device} (local_rank % device_count); move x there")


# -- what the NCCL calls need from each array library ------------------------------------------

class _TorchArrays:
    """torch CUDA tensors: torch's current stream, torch's ops."""

    def __init__(self) -> None:
        self.torch = sys.modules["torch"]

    def stream(self, x: Any) -> Any:
        return self.torch.cuda.current_stream(x.device)

    @staticmethod
    def stream_ptr(stream: Any) -> int:
        return int(stream.cuda_stream)

    @staticmethod
    def ptr(x: Any) -> int:
        return int(x.data_ptr())

    @staticmethod
    def count(x: Any) -> int:
        return int(x.numel())

    @staticmethod
    def nbytes(x: Any) -> int:
        return int(x.numel()) * int(x.element_size())

    @staticmethod
    def is_contiguous(x: Any) -> bool:
        return bool(x.is_contiguous())

    @staticmethod
    def contiguous(x: Any) -> Any:
        return x.contiguous()

    def view(self, x: Any, dtype: str) -> Any:
        return x.view(getattr(self.torch, dtype))

    def cast(self, x: Any, dtype: str) -> Any:
        """A new contiguous copy in ``dtype`` (never ``x`` itself)."""
        return self.torch.empty(x.shape, dtype=getattr(self.torch, dtype),
                                device=x.device).copy_(x)

    def empty(self, like: Any, shape: tuple[int, ...], dtype: str | None = None) -> Any:
        kind = like.dtype if dtype is None else getattr(self.torch, dtype)
        return self.torch.empty(shape, dtype=kind, device=like.device)

    @staticmethod
    def copy_(dst: Any, src: Any) -> None:
        dst.copy_(src)  # casts (wrapping, for int32 -> int16)

    @staticmethod
    def divide_(x: Any, n: int) -> None:
        x.div_(n)

    def fold(self, rows: Any, op: str) -> Any:
        combine = {"band": self.torch.bitwise_and, "bor": self.torch.bitwise_or,
                   "bxor": self.torch.bitwise_xor}[op]
        return reduce(lambda acc, row: combine(acc, row, out=acc), rows[1:], rows[0].clone())

    def record(self, stream: Any) -> Any:
        event = self.torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, event: Any, x: Any) -> None:
        self.torch.cuda.current_stream(x.device).wait_event(event)

    @staticmethod
    def query(event: Any) -> bool:
        return bool(event.query())


class _CupyArrays:
    """CuPy arrays: CuPy's current stream, CuPy's ops."""

    def __init__(self) -> None:
        self.cupy = sys.modules["cupy"]
        import numpy as np  # noqa: PLC0415

        self._dtypes = {name: np.dtype(name) for name in _ITEMSIZE if name != "bfloat16"}
        try:  # CuPy arrays of bfloat16 use ml_dtypes' dtype
            import ml_dtypes  # noqa: PLC0415

            self._dtypes["bfloat16"] = np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            pass

    def stream(self, x: Any) -> Any:
        return self.cupy.cuda.get_current_stream()

    @staticmethod
    def stream_ptr(stream: Any) -> int:
        return int(stream.ptr)

    @staticmethod
    def ptr(x: Any) -> int:
        return int(x.data.ptr)

    @staticmethod
    def count(x: Any) -> int:
        return int(x.size)

    @staticmethod
    def nbytes(x: Any) -> int:
        return int(x.nbytes)

    @staticmethod
    def is_contiguous(x: Any) -> bool:
        return bool(x.flags.c_contiguous)

    def contiguous(self, x: Any) -> Any:
        return self.cupy.ascontiguousarray(x)

    def view(self, x: Any, dtype: str) -> Any:
        return x.view(self._dtypes[dtype])

    def cast(self, x: Any, dtype: str) -> Any:
        return x.astype(self._dtypes[dtype], order="C", copy=True)

    def empty(self, like: Any, shape: tuple[int, ...], dtype: str | None = None) -> Any:
        with like.device:
            return self.cupy.empty(shape, dtype=like.dtype if dtype is None else self._dtypes[dtype])

    def copy_(self, dst: Any, src: Any) -> None:
        self.cupy.copyto(dst, src, casting="unsafe")  # wrapping, for int32 -> int16

    @staticmethod
    def divide_(x: Any, n: int) -> None:
        x /= n

    def fold(self, rows: Any, op: str) -> Any:
        combine = {"band": self.cupy.bitwise_and, "bor": self.cupy.bitwise_or,
                   "bxor": self.cupy.bitwise_xor}[op]
        return reduce(lambda acc, row: combine(acc, row, out=acc), rows[1:], rows[0].copy())

    def record(self, stream: Any) -> Any:
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def wait_event(self, event: Any, x: Any) -> None:
        with x.device:
            self.cupy.cuda.get_current_stream().wait_event(event)

    @staticmethod
    def query(event: Any) -> bool:
        return bool(event.done)


class _StreamWork(Work):
    """An enqueued collective: ``wait()`` makes the caller's current stream wait for it."""

    def __init__(self, x: Any, library: Any, event: Any) -> None:
        super().__init__(x)
        self._library = library
        self._event = event

    def wait(self) -> Any:
        """Order the current stream (of ``x``'s library and device) after the collective.

        Returns ``x`` at once, like torch's NCCL ``Work.wait()``: kernels enqueued on that
        stream afterwards see the result; the host synchronizes only if it reads ``x``.
        """
        self._library.wait_event(self._event, self._x)
        return self._x

    def is_completed(self) -> bool:
        return bool(self._library.query(self._event))


# -- the communicator ---------------------------------------------------------------------------

class CupyNcclCommunicator(Communicator):
    """A communicator over a ``cupy.cuda.nccl.NcclCommunicator`` on one CUDA device.

    ``nccl_version`` is the runtime libnccl's (major, minor, patch); ``device`` the CUDA
    ordinal every array must live on.
    """

    backend = "cupy"

    def __init__(self, nccl_comm: Any, rank: int, size: int, local_rank: int, device: int) -> None:
        cupy, nccl = import_cupy_nccl()
        self._cupy = cupy
        self._nccl_module = nccl
        self._comm = nccl_comm
        self.device = device
        self.nccl_version = decode_nccl_version(int(nccl.get_version()))
        self._bfloat16_native = self.nccl_version >= BFLOAT16_SINCE
        self._libraries: dict[ArrayAdapter, Any] = {}
        super().__init__(rank, size, local_rank)

    @classmethod
    def from_launcher(cls, launch: LaunchInfo) -> CupyNcclCommunicator:
        cupy, nccl = import_cupy_nccl()
        device = bind_device(cupy, launch.local_rank)
        raw = exchange_unique_id(launch, lambda: id_to_bytes(nccl.get_unique_id()))
        with cupy.cuda.Device(device):
            comm = nccl.NcclCommunicator(launch.size, id_from_bytes(raw), launch.rank)
        made = cls(comm, launch.rank, launch.size, launch.local_rank, device)
        log.info("collectives: cupy backend rank %d/%d on CUDA device %d, NCCL %s",
                 launch.rank, launch.size, device, ".".join(map(str, made.nccl_version)))
        return made

    @property
    def nccl_comm(self) -> Any:
        """The underlying ``cupy.cuda.nccl.NcclCommunicator`` (for raw NCCL calls)."""
        return self._comm

    # -- arrays -----------------------------------------------------------------------------

    def _check_device(self, x: Any, adapter: ArrayAdapter) -> None:
        check_cuda_array(x, adapter, self.device)

    def _library(self, adapter: ArrayAdapter) -> Any:
        library = self._libraries.get(adapter)
        if library is None:
            library = _TorchArrays() if adapter is arrays.TORCH else _CupyArrays()
            self._libraries[adapter] = library
        return library

    def _prepare(self, lib: Any, x: Any, adapter: ArrayAdapter, dtype: str, wire: str
                 ) -> tuple[Any, Callable[[], None] | None]:
        """A contiguous ``wire``-typed buffer for x, and the copy back into x if it is a copy."""
        if adapter is arrays.TORCH:
            x = x.detach()
        if lib.is_contiguous(x):
            if wire == dtype:
                return x, None
            if _ITEMSIZE[wire] == _ITEMSIZE[dtype]:  # bool as its uint8 bytes
                return lib.view(x, wire), None
        staged = lib.cast(x, wire) if wire != dtype else lib.contiguous(x)
        return staged, lambda: lib.copy_(x, staged)

    def _gather_rows(self, lib: Any, buf: Any, stream: Any) -> Any:
        """(size, *buf.shape) in buf's dtype, row r from rank r; buf contiguous."""
        out = lib.empty(buf, (self.size, *buf.shape))
        self._comm.allGather(lib.ptr(buf), lib.ptr(out), lib.nbytes(buf), NCCL_DTYPES["uint8"],
                             lib.stream_ptr(stream))
        return out

    def _finish(self, lib: Any, x: Any, stream: Any, async_op: bool) -> Work | None:
        return _StreamWork(x, lib, lib.record(stream)) if async_op else None

    # -- collectives ------------------------------------------------------------------------

    def _all_reduce(self, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp,
                    async_op: bool) -> Work | None:
        lib = self._library(adapter)
        plan = reduce_plan(dtype, op, self._bfloat16_native)
        stream = lib.stream(x)
        buf, writeback = self._prepare(lib, x, adapter, dtype, plan.wire)
        if plan.nccl_op is None:
            lib.copy_(buf, lib.fold(self._gather_rows(lib, buf, stream), plan.fold))
        else:
            ptr = lib.ptr(buf)
            self._comm.allReduce(ptr, ptr, lib.count(buf), NCCL_DTYPES[plan.wire],
                                 NCCL_OPS[plan.nccl_op], lib.stream_ptr(stream))
        if plan.divide:
            lib.divide_(buf, self.size)
        if writeback is not None:
            writeback()
        return self._finish(lib, x, stream, async_op)

    def _broadcast(self, x: Any, adapter: ArrayAdapter, dtype: str, src: int,
                   async_op: bool) -> Work | None:
        lib = self._library(adapter)
        stream = lib.stream(x)
        buf, writeback = self._prepare(lib, x, adapter, dtype, dtype)
        ptr = lib.ptr(buf)
        self._comm.broadcast(ptr, ptr, lib.nbytes(buf), NCCL_DTYPES["uint8"], src,
                             lib.stream_ptr(stream))
        if writeback is not None:
            writeback()
        return self._finish(lib, x, stream, async_op)

    def _all_gather(self, x: Any, adapter: ArrayAdapter, dtype: str, out: Any = None,
                    async_op: bool = False) -> Any:
        lib = self._library(adapter)
        buf, _ = self._prepare(lib, x, adapter, dtype, dtype)
        return deliver(adapter, self._gather_rows(lib, buf, lib.stream(x)), out, async_op)

    def _reduce_scatter(self, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp,
                        out: Any = None, async_op: bool = False) -> Any:
        return deliver(adapter, self._reduce_scatter_new(x, adapter, dtype, op), out, async_op)

    def _reduce_scatter_new(self, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp) -> Any:
        lib = self._library(adapter)
        plan = reduce_plan(dtype, op, self._bfloat16_native)
        stream = lib.stream(x)
        buf, _ = self._prepare(lib, x, adapter, dtype, plan.wire)  # only read: x stays as it is
        rows = int(x.shape[0]) // self.size
        shape = (rows, *tuple(x.shape)[1:])
        if plan.nccl_op is None:
            folded = lib.fold(self._gather_rows(lib, buf, stream), plan.fold)
            out = lib.contiguous(folded[self.rank * rows:(self.rank + 1) * rows])
        else:
            out = lib.empty(buf, shape)
            self._comm.reduceScatter(lib.ptr(buf), lib.ptr(out), lib.count(out),
                                     NCCL_DTYPES[plan.wire], NCCL_OPS[plan.nccl_op],
                                     lib.stream_ptr(stream))
        if plan.divide:
            lib.divide_(out, self.size)
        if plan.wire == dtype:
            return out
        if _ITEMSIZE[plan.wire] == _ITEMSIZE[dtype]:
            return lib.view(out, dtype)
        return lib.cast(out, dtype)

    def _send(self, x: Any, adapter: ArrayAdapter, dtype: str, dst: int, tag: int,
              async_op: bool) -> Work | None:
        # NCCL has no tags: calls between two ranks match in the order they are made.
        lib = self._library(adapter)
        stream = lib.stream(x)
        buf, _ = self._prepare(lib, x, adapter, dtype, dtype)
        self._comm.send(lib.ptr(buf), lib.nbytes(buf), NCCL_DTYPES["uint8"], dst,
                        lib.stream_ptr(stream))
        return self._finish(lib, x, stream, async_op)

    def _recv(self, x: Any, adapter: ArrayAdapter, dtype: str, src: int, tag: int,
              async_op: bool) -> Work | None:
        lib = self._library(adapter)
        stream = lib.stream(x)
        buf, writeback = self._prepare(lib, x, adapter, dtype, dtype)
        self._comm.recv(lib.ptr(buf), lib.nbytes(buf), NCCL_DTYPES["uint8"], src,
                        lib.stream_ptr(stream))
        if writeback is not None:
            writeback()
        return self._finish(lib, x, stream, async_op)

    def _barrier(self) -> None:
        # A one-element all_reduce, waited for on the host: returns once every rank got there.
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            flag = cupy.zeros(1, dtype=cupy.int32)
            stream = cupy.cuda.get_current_stream()
            self._comm.allReduce(flag.data.ptr, flag.data.ptr, 1, NCCL_DTYPES["int32"],
                                 NCCL_OPS["sum"], stream.ptr)
            stream.synchronize()

    def _split(self, color: int | None, key: int) -> Communicator | None:
        native = getattr(self._comm, "commSplit", None)
        if native is not None and self.nccl_version >= COMM_SPLIT_SINCE:
            try:
                # ncclCommSplit orders by key, ties by rank here: the contract's order.
                new = native(NCCL_SPLIT_NOCOLOR if color is None else color, key)
            except TypeError:  # a CuPy whose commSplit takes other arguments: no call was made
                new = _NOT_CALLED
            except Exception as error:  # noqa: BLE001  (NcclError is cupy's RuntimeError)
                raise CollectiveError(f"split: ncclCommSplit failed ({error})") from error
            if new is not _NOT_CALLED:
                if color is None or new is None:
                    return None
                return CupyNcclCommunicator(new, int(new.rank_id()), int(new.size()), self.local_rank,
                                            self.device)
        return self._split_through_parent(color, key)

    def _split_through_parent(self, color: int | None, key: int) -> Communicator | None:
        # Without ncclCommSplit (CuPy < 14, NCCL < 2.18.1) the new communicator is made through
        # this one: each group's first rank makes an NCCL id, and the ids travel in one all_gather.
        import numpy as np  # noqa: PLC0415

        cupy, nccl = self._cupy, self._nccl_module
        lib = self._library(arrays.CUPY)
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.get_current_stream()
            mine = cupy.asarray([-1 if color is None else color, key], dtype=cupy.int64)
            everyone = cupy.asnumpy(self._gather_rows(lib, mine, stream), stream=stream, blocking=True)
            members = split_members(everyone.tolist(), color)
            raw = bytes(UNIQUE_ID_BYTES)
            if members and members[0] == self.rank:
                raw = id_to_bytes(nccl.get_unique_id())
            ids = cupy.asarray(np.frombuffer(raw, dtype=np.uint8))
            all_ids = cupy.asnumpy(self._gather_rows(lib, ids, stream), stream=stream, blocking=True)
            if not members:
                return None
            unique_id = id_from_bytes(all_ids[members[0]].tobytes())
            try:
                comm = nccl.NcclCommunicator(len(members), unique_id, members.index(self.rank))
            except Exception as error:  # noqa: BLE001  (NcclError is cupy's RuntimeError)
                raise CollectiveError(f"split: NCCL could not create the communicator of color "
                                      f"{color} ({error})") from error
        return CupyNcclCommunicator(comm, members.index(self.rank), len(members), self.local_rank,
                                    self.device)

    def _close(self) -> None:
        self._comm.destroy()


def split_members(everyone: list[list[int]], color: int | None) -> list[int]:
    """Ranks (of the parent) in the new communicator of ``color``, in (key, rank) order.

    ``everyone[r]`` is rank r's ``[color or -1, key]``; ``[]`` when ``color`` is ``None``.
    """
    if color is None:
        return []
    members = [r for r, (c, _) in enumerate(everyone) if c == color]
    return sorted(members, key=lambda r: (everyone[r][1], r))


def bind_device(cupy: Any, local_rank: int) -> int:
    """Make ``local_rank % device_count`` the current CUDA device (CuPy's, and torch's if loaded)."""
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as error:  # noqa: BLE001  (CUDARuntimeError: no driver, no device)
        raise BackendUnavailable(f"backend 'cupy' found no usable CUDA device ({error})") from error
    if count == 0:
        raise BackendUnavailable("backend 'cupy' found no CUDA device")
    device = local_rank % count
    cupy.cuda.Device(device).use()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.set_device(device)
    return device
