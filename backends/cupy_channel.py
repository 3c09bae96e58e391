"""One NCCL communicator through CuPy as the cupy backend's channel: what every collective of
:class:`collectives.backends.cupy_nccl.CupyNcclTransport` goes through.

:class:`CupyNcclChannel` holds the ``cupy.cuda.nccl.NcclCommunicator`` and its device, checks
that arrays live there, picks the stream library of an array's kind (CuPy's or torch's), ends
each call (a handle, and its CUDA event on the watchdog's watch: backends/stream_watch.py, with
NCCL's asynchronous error query and ``ncclCommAbort`` past the deadline), keeps this thread's open NCCL group of
asynchronous sends/recvs, moves the small int64 vectors of debug mode and of the counts
exchange through device memory, and makes the barrier and the release. Also here: importing
CuPy's NCCL, the runtime NCCL version, the device binding and the array check. The
collectives, send/recv and split are the subclass's, in backends/cupy_nccl.py.

Imports: the interface (arrays, config, errors, launcher, transport, work) and the cupy
backend's helper modules (cupy_handles, cupy_id, cupy_plans); never backends/cupy_nccl.py.
"""

from __future__ import annotations

import atexit
import logging
import math
import sys
import weakref
from collections.abc import Callable
from typing import Any

from collectives import arrays
from collectives.arrays import ArrayAdapter
from collectives.calls import Call, Request
from collectives.errors import BackendUnavailable, CollectiveError
from collectives.ops import ReduceOp
from collectives.wire import words_agree
from collectives.work import Work

from ._buffers import nbytes
from .cupy_handles import (
    _GROUP,
    OPEN_GROUPS,
    _CupyStreams,
    _launch_group,
    _open_group,
    _StreamWork,
    _TorchStreams,
    wait_for,
)
from .cupy_host import GlooHost, MPIHost
from .cupy_plans import BFLOAT16_SINCE, NCCL_DTYPES, NCCL_OPS, KindPlan, array_check, decode_nccl_version, planned_call
from .posted_checks import PostingTransport, Rounds
from .stream_watch import StreamWatch, unwatch, watch

log = logging.getLogger("collectives")

INSTALL_HINT = ("install CuPy for your CUDA: pip install 'pycollectives[cupy]' (cupy-cuda13x), "
                "or cupy-cuda12x for CUDA 12")


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


class CupyNcclChannel(PostingTransport):
    """A ``cupy.cuda.nccl.NcclCommunicator`` on one CUDA device as a transport's channel.

    ``nccl_version`` is the runtime libnccl's (major, minor, patch); ``device`` the CUDA
    ordinal every array must live on.
    """

    backend = "cupy"

    def __init__(self, nccl_comm: Any, rank: int, size: int, local_rank: int, device: int,
                 host: MPIHost | GlooHost | None = None) -> None:
        cupy, nccl = import_cupy_nccl()
        self._cupy = cupy
        self._nccl_module = nccl
        self._comm = nccl_comm
        self.device = device
        self.nccl_version = decode_nccl_version(int(nccl.get_version()))
        self._bfloat16_native = self.nccl_version >= BFLOAT16_SINCE
        self._libraries: dict[ArrayAdapter, Any] = {}
        # The plans of the kinds of call seen (see _kind), by (adapter, dtype, id(op)): a ReduceOp
        # member is a singleton, and its hash is Enum's, Python code.
        self._kinds: dict[tuple[ArrayAdapter, str, int], KindPlan] = {}
        # The planned calls (fast path, method) by (row, adapter, dtype, op), None where a kind is
        # not planned, and the per-array check of each library's planned kinds (cupy_plans).
        self._planned: dict[tuple[Any, ...], Any] = {}
        self._array_checks: dict[ArrayAdapter, Callable[[Any, bool], Any]] = {}
        # The calls in flight under a timeout, looked at by the watchdog thread (made at the
        # first such call; see backends/stream_watch.py).
        self._stream_watch: StreamWatch | None = None
        # The CPU channel the default check travels on (backends/cupy_host.py): with one, a call's
        # check word goes beside it, compared by the watchdog thread (made at the first posted
        # check); without, the word would travel through device memory, and reading it back would
        # synchronize the stream on every call: then only COLLECTIVES_DEBUG=1 checks.
        self._host = host
        self._checks_by_default = self._posts_checks = host is not None
        super().__init__(rank, size, local_rank)

    @property
    def nccl_comm(self) -> Any:
        """The underlying ``cupy.cuda.nccl.NcclCommunicator`` (for raw NCCL calls)."""
        return self._comm

    def _check_device(self, x: Any, adapter: ArrayAdapter) -> None:
        # One test for an array on this device (CuPy's device id; torch's get_device(), an int,
        # where x.device would make a torch.device), else the checks that name the fault.
        if adapter is arrays.CUPY:
            if x.device.id == self.device:
                return
        elif adapter is arrays.TORCH and x.get_device() == self.device:  # (-1 on the CPU)
            return
        check_cuda_array(x, adapter, self.device)

    def _enter(self, x: Any, adapter: ArrayAdapter, flush: bool = True) -> tuple[Any, Any]:
        """The array library of ``adapter`` and the stream of ``x`` that a call runs on; the
        grouped point-to-point calls pending are launched first (``flush``), unless the call
        is one of them."""
        lib = self._library(adapter)
        stream = lib.current_stream()
        if flush:
            self._flush_group()
        return lib, stream

    def _kind(self, adapter: ArrayAdapter, dtype: str, op: Any) -> KindPlan:
        """The plan of a kind of call (array library, dtype, reduce op or ``None``), made at
        its first call: what its later calls reuse."""
        kind = self._kinds.get((adapter, dtype, id(op)))
        if kind is None:
            kind = self._kinds[adapter, dtype, id(op)] = KindPlan(self._library(adapter), dtype, op,
                                                              self._bfloat16_native)
        return kind

    # -- the planned calls (backends/cupy_plans.py) ------------------------------------------

    def _array_check(self, adapter: ArrayAdapter) -> Callable[[Any, bool], Any] | None:
        check = self._array_checks.get(adapter)
        if check is None:
            check = self._array_checks[adapter] = array_check(adapter, self.device, self._check_device)
        return check

    def _fast_path(self, call: Call, adapter: ArrayAdapter, dtype: str,
                   reduce_op: ReduceOp | None) -> Callable[[Any, Any, Any, Any], Any] | None:
        planned = self._planned_call(call, adapter, dtype, reduce_op)
        return None if planned is None else planned[0]

    def _method_of(self, call: Call, adapter: ArrayAdapter, dtype: str,
                   reduce_op: ReduceOp | None) -> Callable[[Request], Any]:
        planned = self._planned_call(call, adapter, dtype, reduce_op)
        return super()._method_of(call, adapter, dtype, reduce_op) if planned is None else planned[1]

    def _planned_call(self, call: Call, adapter: ArrayAdapter, dtype: str, reduce_op: ReduceOp | None) -> Any:
        """The fast path and method of a planned kind (``cupy_plans.planned_call``), made once;
        ``None`` for a kind not planned. (The call path checked that x is CUDA memory.)"""
        key = (call, adapter, dtype, reduce_op)
        if key not in self._planned:
            self._planned[key] = planned_call(self, call, self._kind(adapter, dtype, reduce_op),
                                              getattr(self, call.method))
        return self._planned[key]

    def _library(self, adapter: ArrayAdapter) -> Any:
        library = self._libraries.get(adapter)
        if library is None:
            library = (_TorchStreams if adapter is arrays.TORCH else _CupyStreams)(self.device)
            self._libraries[adapter] = library
        return library

    def _gather_rows(self, lib: Any, adapter: ArrayAdapter, buf: Any, stream: Any, out: Any = None
                     ) -> Any:
        """(size, *buf.shape) in buf's dtype (into ``out`` when given), row r from rank r."""
        if out is None:
            out = adapter.empty(buf, (self.size, *buf.shape))
        self._comm.allGather(lib.ptr(buf), lib.ptr(out), nbytes(buf), NCCL_DTYPES["uint8"],
                             lib.stream_ptr(stream))
        return out

    def _done(self, lib: Any, stream: Any, async_op: bool, result: Any, like: Any = None,
              keep: Any = None, writeback: Callable[[], None] | None = None) -> Any:
        """After a call was enqueued on ``stream`` (and ``writeback``, the copy of a staged
        result back into x, enqueued after it): a handle when ``async_op``; else ``result`` at
        once. With a timeout the call's event goes on the watch (a pooled event for a blocking
        call): no host wait; past the deadline the watchdog aborts the communicator."""
        if writeback is not None:
            writeback()
        if async_op:
            work = _StreamWork(result, lib, lib.record(stream), self, like=like, keep=keep)
            self._watch_event(lib, work._event, work._call)
            return work
        timeout = self.timeout
        if timeout is not None:
            self._watch_blocking(lib, stream, timeout)
        return result

    def _watch_blocking(self, lib: Any, stream: Any, timeout: float) -> None:
        """Watch the blocking call just enqueued on ``stream`` against ``timeout``, the
        communicator's (a pooled event recorded after it)."""
        (self._stream_watch or self._start_watch()).post(lib, stream, self.context.call, timeout)

    def _watch_event(self, lib: Any, event: Any, call: tuple[str, int]) -> None:
        """Watch a handle's ``event`` of call ``call`` against the timeout (if there is one)."""
        if self.timeout is not None:
            (self._stream_watch or self._start_watch()).add(lib, event, call, self.timeout)

    def _start_watch(self) -> StreamWatch:
        self._stream_watch = made = watch(self._expired, self._watched_error_query)
        return made

    def _expired(self, call: tuple[str, int]) -> None:
        """The watchdog found ``call`` running past its deadline: abort this communicator's NCCL
        calls; its next call or wait raises the :class:`CollectiveTimeout` naming ``call``."""
        # The failure first: a call that meets the aborted communicator raises it (_map_error).
        self.context.fail_later(self.context.timeout_error(
            "its NCCL calls were aborted (ncclCommAbort) by the watchdog", call=call))
        self._abort()
        if self._stream_watch is not None:
            unwatch(self._stream_watch)

    def _watched_error_query(self) -> None:
        """NCCL's asynchronous error query at each look of the watchdog."""
        try:
            self._check_async_error()
        except CollectiveError as error:
            self.context.fail_later(error)
            if self._stream_watch is not None:
                self._stream_watch.failed = True
                unwatch(self._stream_watch)

    def _map_error(self, error: Exception) -> Exception | None:
        # The watchdog aborted the communicator while this call was enqueued: its failure.
        return self.context.failure() if self.context.broken else None

    def _complete(self, lib: Any, event: Any, call: tuple[str, int] | None = None) -> None:
        """(What needs the result on the host: the small vectors, the barrier.) Return once
        ``event`` has completed; past the timeout abort this communicator's NCCL
        calls (ncclCommAbort) and raise :class:`CollectiveTimeout`."""
        assert self.timeout is not None, "only calls with a timeout wait for their event"
        if wait_for(lambda: lib.query(event), self.timeout, self._check_async_error):
            return
        self._abort()
        raise self.context.timeout_error("its NCCL calls were aborted (ncclCommAbort)", call=call)

    # -- the default check, beside the calls (backends/cupy_host.py, backends/posted_checks.py) --

    #: (every call runs on a CUDA stream: host arrays are refused, their check posted too)
    _all_stream_ordered = True

    def _stream_ordered(self, x: Any) -> bool:
        return True

    def _posting_rounds(self) -> Rounds:
        assert self._host is not None, "only a transport with a CPU channel posts checks"
        _posting.add(self)
        return self._host.rounds

    def _posted_failed(self, error: Exception) -> None:
        # (ncclCommAbort; its calls' timeouts no longer watched)
        self.context.fail_later(error)
        self._abort()
        if self._stream_watch is not None:
            unwatch(self._stream_watch)

    def _agree_word(self, word: int, waiting: Callable[[], None] | None = None) -> int:
        # (the calls checked before they move data: on the CPU channel, within the timeout)
        assert self._host is not None, "only a transport with a CPU channel checks by default"
        if waiting is not None:
            waiting()
        self._flush_group()  # (as every call of this backend: a barrier's word to rank 0 goes out)
        vector, request = self._host.agree(word)
        if self.timeout is None:
            request.Wait()
        elif not wait_for(request.Test, self.timeout, self._check_async_error):
            self._abort()
            raise self.context.timeout_error("the check's round on the CPU channel did not complete; "
                                             "its NCCL calls were aborted (ncclCommAbort)")
        reduced = int(vector[0])
        if self.context.call[0] == "barrier" and words_agree(reduced):
            self._barrier()  # (a barrier, agreed, still waits on the host for this rank's GPU work)
        return reduced

    def _stop_posting(self, settle: bool = True) -> None:
        """Compare what was posted (``settle``: within the timeout, unless the communicator is
        unusable), stop the watchdog's look, and free the CPU channel."""
        posted, self._posted, self._post_to = self._posted, None, None
        _posting.discard(self)
        try:
            if posted is not None:
                if settle and not self.context.broken:
                    posted.settle(math.inf if self.timeout is None else self.timeout)
                posted.stop()
        finally:
            if self._host is not None:
                self._host.free()
                self._host = None

    def _check_async_error(self) -> None:
        """An error NCCL found on its own (a peer's connection lost): abort and raise it."""
        try:
            self._comm.check_async_error()
        except Exception as error:  # noqa: BLE001  (NcclError is cupy's RuntimeError)
            self._abort()
            self.context.mark_broken(f"NCCL reported an asynchronous error ({error}); create a new "
                                     "communicator, or end the job")
            raise CollectiveError(f"{self.context.call_name()} failed: NCCL reported an asynchronous "
                                  f"error ({error}); this communicator is now unusable") from error

    def _abort(self) -> None:
        try:
            self._flush_group()  # nothing of this thread stays queued for an aborted communicator
        except CollectiveError:
            pass
        try:
            self._comm.abort()
        except Exception as error:  # noqa: BLE001  (an NCCL older than 2.4 has no abort)
            log.warning("collectives: ncclCommAbort failed: %s", error)

    def _grouped_p2p(self, lib: Any, stream: Any, result: Any, issue: Callable[[int], None],
                     keep: Any, then: Callable[[], None] | None = None,
                     host: Callable[[], None] | None = None) -> _StreamWork:
        """An asynchronous send/recv, added to this thread's open NCCL group (opened here when
        none is). The group is launched as one by the next wait of any of its handles or the
        next call on any communicator of this backend, so sends and recvs issued in any order
        before their waits cannot deadlock. ``then`` runs on the stream once launched (a
        writeback), ``host`` on the host once complete."""
        works = _open_group(self._nccl_module)
        work = _StreamWork(result, lib, None, self, like=keep, keep=keep)
        work._stream, work._then, work._host = stream, then, host
        works.append(work)
        try:
            issue(lib.stream_ptr(stream))
        except BaseException:
            works.remove(work)
            self._flush_group()
            raise
        return work

    def _flush_group(self) -> None:
        """Launch this thread's open group of asynchronous sends/recvs, if there is one. Every
        NCCL call of this backend does this first: an NCCL group is per thread, and a call
        made while one is open would only be queued in it."""
        if OPEN_GROUPS and _GROUP.works is not None:
            _launch_group(self._nccl_module)

    def _exchange_small(self, vector: Any) -> Any:
        import numpy as np  # noqa: PLC0415

        cupy = self._cupy
        lib = self._library(arrays.CUPY)
        self._flush_group()
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.get_current_stream()
            everyone = self._gather_rows(lib, arrays.CUPY, cupy.asarray(np.ascontiguousarray(vector)), stream)
            if self.timeout is not None:
                self._complete(lib, lib.record(stream))
            return everyone.get(stream=stream)

    def _send_small(self, vector: Any, dst: int, tag: int) -> Work:
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.get_current_stream()
            device = cupy.asarray(vector)
            return self._grouped_p2p(
                self._library(arrays.CUPY), stream, None,
                lambda ptr: self._comm.send(device.data.ptr, device.nbytes, NCCL_DTYPES["uint8"],
                                            dst, ptr), keep=device)

    def _recv_small(self, vector: Any, src: int | None, tag: int) -> Work:
        cupy = self._cupy
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.get_current_stream()
            device = cupy.empty(vector.shape, dtype=vector.dtype)

            def to_host() -> None:
                with cupy.cuda.Device(self.device):
                    vector[...] = device.get(stream=stream)

            return self._grouped_p2p(
                self._library(arrays.CUPY), stream, vector,
                lambda ptr: self._comm.recv(device.data.ptr, device.nbytes, NCCL_DTYPES["uint8"],
                                            src, ptr), keep=device, host=to_host)

    def _scratch_bytes(self, x: Any, adapter: ArrayAdapter, nbytes: int) -> Any:
        return adapter.empty(x, (nbytes,), "uint8")

    def _barrier(self) -> None:
        # A one-element all_reduce, waited for on the host: returns once every rank got there.
        cupy = self._cupy
        self._flush_group()
        with cupy.cuda.Device(self.device):
            flag = cupy.zeros(1, dtype=cupy.int32)
            stream = cupy.cuda.get_current_stream()
            self._comm.allReduce(flag.data.ptr, flag.data.ptr, 1, NCCL_DTYPES["int32"],
                                 NCCL_OPS["sum"], stream.ptr)
            if self.timeout is None:
                stream.synchronize()
            else:
                lib = self._library(arrays.CUPY)
                self._complete(lib, lib.record(stream))

    def _close(self) -> None:
        # The plans hold the NCCL communicator's bound calls: forgotten here and the communicator's.
        self._planned.clear()
        self.context.forget_plans()
        if self._stream_watch is not None:
            unwatch(self._stream_watch)
        try:
            self._flush_group()
            self._stop_posting()
        finally:
            self._comm.destroy()


# The transports whose checks the watchdog thread compares on their CPU channel: it stops before
# MPI is finalized (mpi4py finalizes after the interpreter's atexit functions), where a program
# never closed them.
_posting: weakref.WeakSet[CupyNcclChannel] = weakref.WeakSet()


@atexit.register
def _stop_posting_at_exit() -> None:
    for transport in list(_posting):
        transport._stop_posting(settle=False)


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
