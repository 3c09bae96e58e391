"""MPI through mpi4py.

Host arrays go to MPI without a copy: a numpy array as it is, a CPU torch tensor
through a numpy view of its memory (cheaper than DLPack per call). In-place
reductions use ``MPI.IN_PLACE``. Where MPI lacks a dtype (bfloat16 always,
float16 where the library has no ``MPI_FLOAT16_T``) the reduction is staged
through float32 and rounded back; broadcast and all_gather move raw bytes, so
they need no staging. AVG is SUM, then a division by size on every rank.

CUDA arrays (torch CUDA tensors, CuPy arrays) are handed to MPI directly when the
library is CUDA-aware, else staged through pinned host memory. Either way the
stream that produced the data is synchronized first: MPI knows nothing of CUDA
streams. ``COLLECTIVES_MPI_CUDA_AWARE=0|1`` overrides the detection.

Timeouts: MPI has none, so with a timeout set every collective is the nonblocking
call (``Iallreduce``, ``Ibcast``, ...) completed by polling ``Test`` against a
deadline: a few tight polls first (small collectives finish there), then polls
with ``sched_yield``, then after a second of waiting polls every millisecond (a
hung job does not burn the CPU). A collective request cannot be cancelled, so
after a timeout the communicator refuses further calls. With no timeout
(``COLLECTIVES_TIMEOUT=0``) the blocking calls are used.

Rank failure: an uncaught exception on one rank would leave the others waiting
in a collective forever, so ``collectives.init()`` under an MPI launcher installs a
``sys.excepthook`` that prints the rank and calls ``MPI_Abort`` (see
:mod:`collectives.process_hooks`); mpiexec then ends every rank.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from collectives import _exits, arrays, config, process_hooks
from collectives.arrays import ArrayAdapter
from collectives.calls import ALL_REDUCE, BROADCAST
from collectives.communicator import Communicator, Work
from collectives.errors import BackendUnavailable
from collectives.launcher import LaunchInfo
from collectives.ops import ALLOWED_OPS, ReduceOp

from . import _float_order

_MPI4PY_DEFAULT_THREAD_LEVEL = "multiple"

#: Elements per MPI call: MPI counts are C ints unless the library has large counts.
MAX_COUNT = 2**31 - 1

#: Tests of a request before the deadline is looked at (no clock read on the fast path).
FAST_POLLS = 16
#: Seconds of polling (with sched_yield) before polls back off to one per POLL_INTERVAL.
BUSY_POLL_SECONDS = 1.0
POLL_INTERVAL = 0.001

_NUMPY_DTYPES = {name: np.dtype(name) for name in
                 ("bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32",
                  "float64")}


#: The MPI thread level MPI is initialized with when this backend initializes it.
#: Measured with the MPICH wheel on 2 ranks of one node (docs/performance.md): "single"
#: (and funneled/serialized) lets MPICH use its shared-memory collectives, ~1 us faster
#: below ~4 KiB, but 2.5-7x slower from 64 KiB up; "multiple" costs ~1 us at 4 B and wins
#: everywhere else, and it is what threaded callers need. mpi4py's default too.
THREAD_LEVEL = "multiple"


def import_mpi() -> Any:
    """mpi4py's MPI module, or ``BackendUnavailable`` saying how to install it.

    When MPI is not initialized yet, it will be at :data:`THREAD_LEVEL`, unless the user
    chose a level already: ``MPI4PY_RC_THREAD_LEVEL`` in the environment, or
    ``mpi4py.rc.thread_level`` set to something else before this call. A program that
    imported ``mpi4py.MPI`` itself keeps the level it got.
    """
    try:
        import mpi4py  # noqa: PLC0415

        if "mpi4py.MPI" not in sys.modules and not os.environ.get("MPI4PY_RC_THREAD_LEVEL"):
            if mpi4py.rc.thread_level == _MPI4PY_DEFAULT_THREAD_LEVEL:
                mpi4py.rc.thread_level = THREAD_LEVEL
        from mpi4py import MPI  # noqa: PLC0415
    except ImportError as error:
        raise BackendUnavailable(
            f"backend 'mpi' needs mpi4py and an MPI library ({error}); "
            "install them with: pip install 'pycollectives[mpi,mpich]' (only [mpi] where the cluster has an MPI)"
        ) from error
    return MPI


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


def install_abort_on_uncaught_exception(MPI: Any) -> None:
    """Make an uncaught exception (or an uncaught ``sys.exit(n)``, n not 0) on this rank end
    the whole MPI job with ``MPI_Abort`` (once per process). ``collectives.init()`` installs
    it for jobs started by an MPI launcher; see :mod:`collectives.process_hooks`."""
    _exits.record_exit_calls()
    process_hooks._abort_mpi_on_uncaught_exception()


class _Request(Work):
    """Nonblocking MPI requests, plus what must happen once they complete."""

    def __init__(self, x: Any, MPI: Any, requests: list[Any], finish: Callable[[], None],
                 comm: MPICommunicator | None = None, statuses: list[Any] | None = None,
                 buffers: Any = None):
        super().__init__(x)
        self._MPI = MPI
        self._requests = requests
        self._statuses = statuses
        # Memory MPI reads or writes until the requests complete (staging copies).
        self._buffers = buffers
        self._finish: Callable[[], None] | None = finish
        self._comm = comm
        # The call this is, for a timeout's message (the communicator moves on).
        self._call = (comm._operation, comm._seq) if comm is not None else None

    def wait(self) -> Any:
        if self._finish is not None:
            statuses = self._statuses or [None] * len(self._requests)
            if self._comm is None or self._comm.timeout is None:
                for request, status in zip(self._requests, statuses):
                    request.Wait(status)
            else:
                for request, status in zip(self._requests, statuses):
                    self._comm._wait(request, self._call, status)
            self._complete()
        return self._x

    def _complete(self) -> None:
        # Once: a completed request is inactive, and waiting on it again would reset its status.
        finish, self._finish, self._buffers = self._finish, None, None
        if finish is not None:
            finish()

    def is_completed(self) -> bool:
        if self._finish is None:
            return True
        statuses = self._statuses or [None] * len(self._requests)
        if not all(request.Test(status) for request, status in zip(self._requests, statuses)):
            return False
        self._complete()
        return True


class MPICommunicator(Communicator):
    """A communicator over an ``mpi4py.MPI.Comm`` (by default a duplicate of COMM_WORLD)."""

    backend = "mpi"

    def __init__(self, comm: Any = None, local_rank: int | None = None, *,
                 timeout: Any = None) -> None:
        """``comm``: the mpi4py communicator to duplicate (default COMM_WORLD).
        ``timeout``: seconds (or timedelta) per blocking collective; ``None`` reads
        ``COLLECTIVES_TIMEOUT``; 0 means none."""
        MPI = import_mpi()
        self._MPI = MPI
        self._comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
        if local_rank is None:
            node = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
            local_rank = node.Get_rank()
            node.Free()
        super().__init__(self._comm.Get_rank(), self._comm.Get_size(), local_rank,
                         timeout=timeout)
        # Requests abandoned by a timeout: MPI may still write their buffers, so they live on.
        self._abandoned: list[Any] = []
        float16 = MPI.FLOAT16_T if hasattr(MPI, "FLOAT16_T") else MPI.DATATYPE_NULL
        self._float16_native = float16 != MPI.DATATYPE_NULL
        self._types = {
            "bool": MPI.C_BOOL, "int8": MPI.INT8_T, "uint8": MPI.UINT8_T,
            "int16": MPI.INT16_T, "int32": MPI.INT32_T, "int64": MPI.INT64_T,
            "float16": float16, "float32": MPI.FLOAT, "float64": MPI.DOUBLE,
        }
        # MPI has no bitwise ops on C_BOOL, only logical ones (same truth tables on bool).
        self._ops: dict[ReduceOp, Any] = {op: getattr(MPI, op.name) for op in ReduceOp if op is not ReduceOp.AVG}
        self._ops[ReduceOp.AVG] = MPI.SUM
        self._bool_ops: dict[ReduceOp, Any] = {ReduceOp.MIN: MPI.LAND, ReduceOp.BAND: MPI.LAND,
                          ReduceOp.MAX: MPI.LOR, ReduceOp.BOR: MPI.LOR, ReduceOp.BXOR: MPI.LXOR}
        self._cuda_aware: bool | None = None
        # The fast path's table: dtype -> {op: (MPI datatype, MPI op)} for every allowed
        # pair MPI reduces as it is: no staging through float32, and not the float MIN/MAX
        # that go through order keys (NaN). Nested: a (str, ReduceOp) tuple key costs
        # twice as much to look up.
        self._native = {dtype: {op: (self._types[dtype], self._reduce_spec(dtype, op)[2])
                                for op in allowed
                                if dtype in self._types and self._wire_dtype(dtype) == dtype
                                and not _nan_ordered(dtype, op)}
                        for dtype, allowed in ALLOWED_OPS.items()}
        self._in_place = MPI.IN_PLACE
        self._byte = MPI.BYTE

    @classmethod
    def from_launcher(cls, launch: LaunchInfo, *, timeout: Any = None) -> MPICommunicator:
        if launch.launcher == "torchrun":
            raise BackendUnavailable(
                "backend 'mpi' needs an MPI launcher (mpiexec, mpirun or srun), but this "
                "process was started by torchrun; launch with mpiexec -n N, or use "
                "COLLECTIVES_BACKEND=torch (or cupy) under torchrun"
            )
        return cls(timeout=timeout)

    @property
    def mpi_comm(self) -> Any:
        """The underlying ``mpi4py.MPI.Comm`` (for mixing raw mpi4py calls)."""
        return self._comm

    @property
    def cuda_aware(self) -> bool:
        """Whether CUDA arrays go to MPI directly (else staged through host memory)."""
        if self._cuda_aware is None:
            self._cuda_aware = mpi_cuda_aware(self._MPI)
        return self._cuda_aware

    # -- buffers ----------------------------------------------------------------------

    def _wire_dtype(self, dtype: str) -> str:
        """The dtype MPI reduces in: float32 for the float types MPI lacks."""
        if dtype == "bfloat16" or (dtype == "float16" and not self._float16_native):
            return "float32"
        return dtype

    def _buffer(self, x: Any, adapter: ArrayAdapter, wire: str | None) -> tuple[Any, Callable[[], None] | None]:
        """A contiguous buffer MPI can read and write, and the copy back into ``x`` if any.

        ``wire`` is the dtype to stage through, or ``None`` for x's bytes as they are.
        """
        if adapter.is_cuda(x):
            return self._device_buffer(x, adapter, wire)
        if adapter is arrays.NUMPY:
            if wire is None:
                wire_dtype = x.dtype
            else:
                wire_dtype = _NUMPY_DTYPES[wire]
            if x.flags.c_contiguous and wire_dtype == x.dtype:
                return x, None
            staged = np.ascontiguousarray(x, dtype=wire_dtype)
            return staged, lambda: np.copyto(x, staged, casting="unsafe")
        # CPU torch tensor: a numpy view of its memory when possible.
        torch = sys.modules["torch"]
        t = x.detach()
        if t.is_contiguous() and (wire is None or getattr(torch, wire) == t.dtype):
            if wire is None and t.dtype == torch.bfloat16:
                return t.view(torch.int16).numpy(), None  # numpy has no bfloat16: its bytes
            return t.numpy(), None
        if wire is None:
            staged_t = t.contiguous()
            if staged_t.dtype == torch.bfloat16:
                view = staged_t.view(torch.int16).numpy()
            else:
                view = staged_t.numpy()
        else:
            staged_t = t.to(getattr(torch, wire)).contiguous()
            view = staged_t.numpy()
        return view, lambda: t.copy_(staged_t)

    def _device_buffer(self, x: Any, adapter: ArrayAdapter, wire: str | None) -> tuple[Any, Callable[[], None] | None]:
        # MPI does not know CUDA streams: whatever produced x must be finished.
        if adapter is arrays.TORCH:
            torch = sys.modules["torch"]
            t = x.detach()
            target = t.dtype if wire is None else getattr(torch, wire)
            if self.cuda_aware:
                staged_t = t if (t.is_contiguous() and target == t.dtype) else t.to(target).contiguous()
                torch.cuda.current_stream(t.device).synchronize()
                if staged_t is t:
                    return _device_view(t), None
                return _device_view(staged_t), lambda: t.copy_(staged_t)
            host = torch.empty(t.shape, dtype=target, pin_memory=True)
            host.copy_(t)  # a blocking device-to-host copy: ordered after the producer
            view = host.view(torch.int16).numpy() if host.dtype == torch.bfloat16 else host.numpy()
            return view, lambda: t.copy_(host)
        cupy = sys.modules["cupy"]
        target = x.dtype if wire is None else _NUMPY_DTYPES[wire]
        if self.cuda_aware:
            staged = x if (x.flags.c_contiguous and target == x.dtype) else cupy.ascontiguousarray(x, dtype=target)
            cupy.cuda.get_current_stream().synchronize()
            if staged is x:
                return x, None
            return staged, lambda: x.__setitem__(Ellipsis, staged)
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

    # -- completion with a deadline ------------------------------------------------------

    def _wait(self, request: Any, call: tuple[str, int] | None = None, status: Any = None) -> None:
        """Complete ``request`` within ``timeout``, else :class:`CollectiveTimeout`."""
        for _ in range(FAST_POLLS):
            if request.Test(status):
                return
        self._wait_slowly(request, call, status)

    def _wait_slowly(self, request: Any, call: tuple[str, int] | None, status: Any = None) -> None:
        assert self.timeout is not None, "only calls with a timeout wait through _wait"
        start = time.monotonic()
        deadline = start + self.timeout
        backoff = start + BUSY_POLL_SECONDS
        polls = 0
        while not request.Test(status):
            polls += 1
            if polls & 63:
                os.sched_yield()  # two ranks on one core: let the other one run
                continue
            now = time.monotonic()
            if now >= deadline:
                self._abandoned.append(request)
                raise self._timeout_error(call=call)
            if now >= backoff:
                time.sleep(POLL_INTERVAL)

    def _order_keys(self, buf: Any, wire: str, op: ReduceOp) -> Any:
        """For MIN/MAX of floats: ``buf``'s memory as integer order keys (encoded in place),
        which MPI's integer MIN/MAX reduce exactly and with NaN propagated; else ``None``.

        MPI's float MIN/MAX compare with ``<`` and lose NaNs (see backends/_float_order.py).
        """
        if not _nan_ordered(wire, op):
            return None
        isnan = buf != buf
        keys = _int_view(buf)
        _float_order.encode(keys, isnan, op, 8 * _itemsize(buf))
        return keys

    def _reduce_spec(self, dtype: str, op: ReduceOp) -> tuple[str, Any, Any]:
        wire = self._wire_dtype(dtype)
        mpi_op = self._bool_ops[op] if dtype == "bool" else self._ops[op]
        return wire, self._types[wire], mpi_op

    # -- collectives --------------------------------------------------------------------

    def _fast_path(self, call: Any, adapter: ArrayAdapter, dtype: str,
                   op: ReduceOp | None) -> Callable[[Any, Any], bool] | None:
        """all_reduce (of a dtype x op MPI reduces as it is) and broadcast of a contiguous host
        array in as few steps as raw mpi4py takes: its memory (a CPU tensor's numpy view, as a
        raw caller passes it) is the buffer, bound with the MPI datatype and op once per kind."""
        comm, in_place, size, most = self._comm, self._in_place, self.size, MAX_COUNT
        if call is ALL_REDUCE:
            spec = self._native[dtype].get(op) if op is not None else None
            if spec is None:
                return None
            mpi_type, mpi_op = spec
            avg = op is _AVG
            reduce, start_reduce = comm.Allreduce, comm.Iallreduce

            def all_reduce(buf: Any, root: Any) -> bool:
                if buf.size > most:
                    return False
                if self.timeout is None:
                    reduce(in_place, [buf, mpi_type], mpi_op)
                else:  # a small one is complete at its first test: no _wait frame then
                    request = start_reduce(in_place, [buf, mpi_type], mpi_op)
                    if not request.Test():
                        self._wait(request)
                if avg:
                    buf /= size
                return True
            return all_reduce
        if call is BROADCAST:
            byte = self._byte
            bcast, start_bcast = comm.Bcast, comm.Ibcast

            def broadcast(buf: Any, root: Any) -> bool:
                if buf.nbytes > most:  # MPI counts the bytes: no uint8 view
                    return False
                if self.timeout is None:
                    bcast([buf, byte], root)
                else:
                    request = start_bcast([buf, byte], root)
                    if not request.Test():
                        self._wait(request)
                return True
            return broadcast
        return None

    def _all_reduce(self, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp,
                    async_op: bool) -> Any:
        wire, mpi_type, mpi_op = self._reduce_spec(dtype, op)
        buf, writeback = self._buffer(x, adapter, wire)
        IN_PLACE = self._MPI.IN_PLACE
        keys = self._order_keys(buf, wire, op)
        if keys is not None:  # float MIN/MAX: integer keys that propagate NaN
            mpi_type = self._types[_INT_OF_WIDTH[_itemsize(buf)]]
        return self._collective("Allreduce", [(IN_PLACE, [chunk, mpi_type], mpi_op)
                                              for chunk in _chunks(buf if keys is None else keys)],
                                x, async_op, self._finish_reduction(buf, keys, op, writeback), buf)

    def _broadcast(self, x: Any, adapter: ArrayAdapter, dtype: str, src: int,
                   async_op: bool) -> Any:
        buf, writeback = self._buffer(x, adapter, None)
        return self._collective("Bcast", [([chunk, self._byte], src) for chunk in _chunks(_bytes(buf))],
                                x, async_op, writeback, buf)

    def _all_gather(self, x: Any, adapter: ArrayAdapter, dtype: str, out: Any = None,
                    async_op: bool = False) -> Any:
        if adapter is _NUMPY and not async_op and x.flags.c_contiguous and x.nbytes <= MAX_COUNT:
            # The common case in as few steps as raw mpi4py takes (out= is written directly).
            if out is None:
                out = np.empty((self.size, *x.shape), dtype=x.dtype)
            if self.timeout is None:
                self._comm.Allgather([x, self._byte], [out, self._byte])
            else:
                self._wait(self._comm.Iallgather([x, self._byte], [out, self._byte]))
            return out
        if out is None:
            out = adapter.empty(x, (self.size, *x.shape))
        byte = self._byte
        if x.nbytes <= MAX_COUNT:
            return self._move_bytes(x, adapter, out, out, async_op, "Allgather",
                                    lambda send, recv: ([send, byte], [recv, byte]))
        send, _ = self._buffer(x, adapter, None)
        recv, writeback = self._buffer(out, adapter, None)
        send_bytes, recv_bytes = _bytes(send), _bytes(recv)
        count = _size(send_bytes)
        # Each rank's block in MAX_COUNT pieces, gathered into place (blocking, even async).
        if adapter.is_cuda(x):
            raise ValueError("all_gather of more than 2**31-1 bytes per rank on CUDA "
                             "arrays is not supported by the MPI backend")
        blocks = recv_bytes.reshape(self.size, count)
        for start in range(0, count, MAX_COUNT):
            stop = min(start + MAX_COUNT, count)
            piece = np.empty((self.size, stop - start), dtype=np.uint8)
            self._collective("Allgather", [([send_bytes[start:stop], byte], [piece, byte])],
                             None, False)
            blocks[:, start:stop] = piece
        if writeback is not None:
            writeback()
        return Work(out) if async_op else out

    def _reduce_scatter(self, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp,
                        out: Any = None, async_op: bool = False) -> Any:
        if adapter is _NUMPY and not async_op:
            spec = self._native[dtype].get(op)
            if spec is not None and x.flags.c_contiguous and x.size // self.size <= MAX_COUNT:
                if out is None:
                    out = np.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype)
                if self.timeout is None:
                    self._comm.Reduce_scatter_block([x, spec[0]], [out, spec[0]], spec[1])
                else:
                    self._wait(self._comm.Ireduce_scatter_block([x, spec[0]], [out, spec[0]],
                                                                spec[1]))
                if op is _AVG:
                    out /= self.size
                return out
        wire, mpi_type, mpi_op = self._reduce_spec(dtype, op)
        rows = x.shape[0] // self.size
        if out is None:
            out = adapter.empty(x, (rows, *x.shape[1:]))
        send, _ = self._buffer(x, adapter, wire)
        recv, writeback = self._buffer(out, adapter, wire)
        keyed = _nan_ordered(wire, op)
        if keyed:  # float MIN/MAX: see _order_keys; never change the caller's x
            send = self._order_keys(_clone(send), wire, op)
            mpi_type = self._types[_INT_OF_WIDTH[_itemsize(recv)]]
        wire_recv = _int_view(recv) if keyed else recv
        finish = self._finish_reduction(recv, wire_recv if keyed else None, op, writeback)
        block = _size(recv)
        if block <= MAX_COUNT:
            return self._collective("Reduce_scatter_block",
                                    [([send, mpi_type], [wire_recv, mpi_type], mpi_op)],
                                    out, async_op, finish, (send, recv))
        # Reduce the whole thing in pieces, keep this rank's rows (blocking, even async).
        reduced = _clone(send)
        self._collective("Allreduce", [(self._in_place, [chunk, mpi_type], mpi_op)
                                       for chunk in _chunks(reduced)], None, False)
        wire_recv.reshape(-1)[...] = reduced.reshape(-1)[self.rank * block:(self.rank + 1) * block]
        finish()
        return Work(out) if async_op else out

    # -- one MPI call, blocking, with a deadline, or as a handle: the way out of every
    # -- collective but the numpy fast paths above (inline, for their microseconds) -------

    def _collective(self, name: str, calls: list[tuple[Any, ...]], result: Any, async_op: bool,
                    finish: Callable[[], None] | None = None, buffers: Any = None) -> Any:
        """Run the MPI collective ``name`` (``"Gather"``, ...) once per argument tuple of
        ``calls``, then ``finish``; return ``result``. With ``async_op`` the nonblocking
        call (``Igather``): a handle whose ``wait()`` finishes and returns ``result``
        (``buffers``, staging copies, live until then). Without, under a timeout, the
        nonblocking call waited against the deadline; with none, the blocking call."""
        if async_op:
            start = getattr(self._comm, _nonblocking(name))
            return _Request(result, self._MPI, [start(*args) for args in calls],
                            finish or _nothing, self, buffers=buffers)
        if self.timeout is None:
            run = getattr(self._comm, name)
            for args in calls:
                run(*args)
        else:
            start = getattr(self._comm, _nonblocking(name))
            for args in calls:
                self._wait(start(*args))
        if finish is not None:
            finish()
        return result

    def _finish_reduction(self, buf: Any, keys: Any, op: ReduceOp,
                          writeback: Callable[[], None] | None) -> Callable[[], None]:
        """What follows a reduction into ``buf``: order keys decoded, AVG divided, the
        staging copy written back."""
        def finish() -> None:
            if keys is not None:
                _float_order.decode(keys, 8 * _itemsize(buf))
            if op is _AVG:
                _divide(buf, self.size)
            if writeback is not None:
                writeback()
        return finish

    # -- the rest of the set: byte-moving collectives, and reduce ------------------------

    def _move_bytes(self, x: Any, adapter: ArrayAdapter, result: Any, value: Any, async_op: bool,
                    name: str, arguments: Callable[[Any, Any], tuple[Any, ...]],
                    counts: tuple[int, ...] = ()) -> Any:
        """The MPI collective ``name``, moving raw bytes from ``x`` into ``result`` (either may
        be ``None`` on ranks that send or receive nothing), through :meth:`_collective`:
        returns ``value`` once it has completed, or a handle whose ``wait()`` does.
        ``arguments(send_bytes, recv_bytes)`` are the call's arguments. ``counts``: the byte
        counts and displacements the call uses (C ints)."""
        if any(count > MAX_COUNT for count in counts) or (x is not None and _nbytes(x) > MAX_COUNT) \
                or (result is not None and _nbytes(result) > MAX_COUNT):
            raise ValueError(f"{self._operation} of more than 2**31-1 bytes per message is not "
                             "supported by the MPI backend; split the array")
        send = None if x is None else self._buffer(x, adapter, None)[0]
        recv, writeback = (None, None) if result is None else self._buffer(result, adapter, None)
        call = arguments(None if send is None else _bytes(send), None if recv is None else _bytes(recv))
        return self._collective(name, [call], value, async_op, writeback, (send, recv))

    def _gather(self, x: Any, adapter: ArrayAdapter, dtype: str, dst: int, out: Any,
                async_op: bool) -> Any:
        here = self.rank == dst
        result = (out if out is not None else adapter.empty(x, (self.size, *x.shape))) if here else None
        byte = self._byte
        return self._move_bytes(x, adapter, result, result, async_op, "Gather", lambda send, recv: (
            [send, byte], [recv, byte] if here else None, dst))

    def _scatter(self, x: Any, adapter: ArrayAdapter, dtype: str, src: int, out: Any,
                 async_op: bool) -> Any:
        here = self.rank == src
        result = out if out is not None else adapter.empty(x, tuple(x.shape[1:]))
        byte = self._byte
        return self._move_bytes(x if here else None, adapter, result, result, async_op, "Scatter",
                                lambda send, recv: ([send, byte] if here else None, [recv, byte], src))

    def _all_to_all(self, x: Any, adapter: ArrayAdapter, dtype: str, out: Any,
                    async_op: bool) -> Any:
        result = out if out is not None else adapter.empty(x, tuple(x.shape))
        byte = self._byte
        return self._move_bytes(x, adapter, result, result, async_op, "Alltoall",
                                lambda send, recv: ([send, byte], [recv, byte]))

    def _all_gather_v(self, x: Any, adapter: ArrayAdapter, dtype: str, counts: list[int],
                      out: Any, async_op: bool) -> Any:
        result = out if out is not None else adapter.empty(x, (sum(counts), *x.shape[1:]))
        row = _row_bytes(x)
        sizes, offsets = _layout([count * row for count in counts])
        byte = self._byte
        return self._move_bytes(x, adapter, result, (result, counts), async_op, "Allgatherv",
                                lambda send, recv: ([send, byte], [recv, (sizes, offsets), byte]),
                                counts=(*sizes, *offsets))

    def _all_to_all_v(self, x: Any, adapter: ArrayAdapter, dtype: str,
                      splits: list[list[int]], out: Any, async_op: bool) -> Any:
        received = [row[self.rank] for row in splits]
        result = out if out is not None else adapter.empty(x, (sum(received), *x.shape[1:]))
        row = _row_bytes(x)
        send_sizes, send_offsets = _layout([count * row for count in splits[self.rank]])
        recv_sizes, recv_offsets = _layout([count * row for count in received])
        byte = self._byte
        return self._move_bytes(x, adapter, result, result, async_op, "Alltoallv",
                                lambda send, recv: ([send, (send_sizes, send_offsets), byte],
                                                    [recv, (recv_sizes, recv_offsets), byte]),
                                counts=(*send_sizes, *send_offsets, *recv_sizes, *recv_offsets))

    def _reduce(self, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp, dst: int,
                async_op: bool) -> Any:
        wire, mpi_type, mpi_op = self._reduce_spec(dtype, op)
        here = self.rank == dst
        buf, writeback = self._buffer(x, adapter, wire)
        keys = None
        if _nan_ordered(wire, op):  # float MIN/MAX: integer order keys (see _order_keys)
            keys = self._order_keys(buf if here else _clone(buf), wire, op)  # x stays off dst
            mpi_type = self._types[_INT_OF_WIDTH[_itemsize(buf)]]
        data = buf if keys is None else keys
        IN_PLACE = self._MPI.IN_PLACE
        calls = [(IN_PLACE, [chunk, mpi_type], mpi_op, dst) if here else
                 ([chunk, mpi_type], None, mpi_op, dst) for chunk in _chunks(data)]
        # Off dst nothing follows: the other ranks' x is left as it was.
        finish = self._finish_reduction(buf, keys, op, writeback) if here else _nothing
        return self._collective("Reduce", calls, x, async_op, finish, data)

    def _send(self, x: Any, adapter: ArrayAdapter, dtype: str, dst: int, tag: int,
              async_op: bool) -> Work | None:
        buf, _ = self._buffer(x, adapter, None)  # (a staging copy lives as long as the request)
        work: Work | None = self._collective("Send", [([_bytes(buf), self._byte], dst, tag)], None,
                                             async_op, None, buf)
        return work

    def _recv(self, x: Any, adapter: ArrayAdapter, dtype: str, src: int, tag: int,
              async_op: bool) -> Work | None:
        buf, writeback = self._buffer(x, adapter, None)
        data = _bytes(buf)
        status = self._MPI.Status()
        request = self._comm.Irecv([data, self._byte], src, tag)

        def finish() -> None:
            # MPI refuses a longer message (MPI_ERR_TRUNCATE) but takes a shorter one.
            got = status.Get_count(self._byte)
            if got != _size(data):
                raise ValueError(f"recv from rank {src} (tag {tag}) got {got} bytes, but x "
                                 f"holds {_size(data)} (shape {tuple(x.shape)}, {dtype}): the "
                                 "sender's array has another shape or dtype")
            if writeback is not None:
                writeback()

        work = _Request(x, self._MPI, [request], finish, self, statuses=[status], buffers=buf)
        if async_op:
            return work
        work.wait()
        return None

    def _barrier(self) -> None:
        self._collective("Barrier", [()], None, False)

    def _split(self, color: int | None, key: int) -> Communicator | None:
        MPI = self._MPI
        # MPI has no nonblocking split: once every rank is through this barrier, Split
        # (and the new communicator's Dup) completes without waiting on anyone.
        self._barrier()
        new = self._comm.Split(MPI.UNDEFINED if color is None else color, key)
        if new == MPI.COMM_NULL:
            return None
        try:
            return MPICommunicator(new, local_rank=self.local_rank, timeout=self._timeout_arg)
        finally:
            new.Free()  # MPICommunicator keeps its own Dup

    def _close(self) -> None:
        MPI = self._MPI
        if not MPI.Is_finalized() and self._comm != MPI.COMM_NULL:
            self._comm.Free()


# Bound once: on Python 3.11 every ``ReduceOp.X`` attribute read costs ~0.15 us.
_AVG = ReduceOp.AVG
_NUMPY = arrays.NUMPY
_TORCH = arrays.TORCH


def _size(buf: Any) -> int:
    return math.prod(buf.shape)


def _nbytes(x: Any) -> int:
    return _size(x) * _itemsize(x)


def _row_bytes(x: Any) -> int:
    """Bytes of one row (x.shape[1:]) of ``x``."""
    row: int = math.prod(x.shape[1:])
    return row * _itemsize(x)


def _layout(sizes: list[int]) -> tuple[list[int], list[int]]:
    """Byte counts and their displacements, back to back."""
    offsets = [0] * len(sizes)
    for index in range(1, len(sizes)):
        offsets[index] = offsets[index - 1] + sizes[index - 1]
    return sizes, offsets


def _nothing() -> None:
    pass


_INT_OF_WIDTH = {2: "int16", 4: "int32", 8: "int64"}


def _nan_ordered(wire: str, op: ReduceOp) -> bool:
    return op in _float_order.NAN_ORDERED_OPS and wire.startswith("float")


def _itemsize(buf: Any) -> int:
    """Bytes per element of a numpy/CuPy array or torch tensor."""
    return int(buf.itemsize) if hasattr(buf, "itemsize") else int(buf.element_size())


def _int_view(buf: Any) -> Any:
    """``buf``'s memory as signed integers of the same width (numpy, CuPy or torch)."""
    name = _INT_OF_WIDTH[_itemsize(buf)]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        return buf.view(getattr(torch, name))
    return buf.view(name)


def _nonblocking(name: str) -> str:
    """mpi4py's name of the nonblocking form of a collective: Gather -> Igather."""
    return "I" + name[0].lower() + name[1:]


def _check_bytes(name: str, count: int) -> None:
    """MPI counts are C ints: more bytes per rank is a clear error, not an overflow."""
    if count > MAX_COUNT:
        raise ValueError(f"{name} moves {count} bytes per rank in one piece on the MPI backend, "
                         f"more than MPI's count limit of 2**31-1; split the array")


def _counts_and_displacements(rows: list[int], row_bytes: int) -> tuple[list[int], list[int]]:
    counts = [r * row_bytes for r in rows]
    displacements = [0] * len(counts)
    for i in range(1, len(counts)):
        displacements[i] = displacements[i - 1] + counts[i - 1]
    return counts, displacements


def _clone(buf: Any) -> Any:
    return buf.clone() if hasattr(buf, "clone") else buf.copy()


def _chunks(buf: Any) -> list[Any]:
    """``buf`` as pieces of at most MAX_COUNT elements (views, not copies)."""
    count = _size(buf)
    if count <= MAX_COUNT:
        return [buf]
    flat = buf.reshape(-1)
    return [flat[start:start + MAX_COUNT] for start in range(0, count, MAX_COUNT)]


def _bytes(buf: Any) -> Any:
    """A flat uint8 view of a contiguous numpy/cupy array (or of a torch CUDA tensor)."""
    if isinstance(buf, np.ndarray):
        return buf.reshape(-1).view(np.uint8)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        return buf.reshape(-1).view(torch.uint8)
    return buf.reshape(-1).view("uint8")  # cupy


def cupyx_empty_pinned(shape: tuple[int, ...], dtype: Any) -> Any:
    """A numpy array in pinned (page-locked) host memory, from CuPy's pinned pool."""
    import cupyx  # noqa: PLC0415

    return cupyx.empty_pinned(shape, dtype=dtype)


def _divide(buf: Any, size: int) -> None:
    buf /= size  # in place for numpy, cupy and torch alike


def _device_view(t: Any) -> Any:
    """What mpi4py takes for CUDA memory: the tensor itself (it has __cuda_array_interface__),
    with bfloat16 reinterpreted as int16 since only its bytes matter when we get here."""
    torch = sys.modules["torch"]
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t
