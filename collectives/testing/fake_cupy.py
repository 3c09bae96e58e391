"""A stand-in for CuPy's CUDA and NCCL on host memory: the CPU twin of the cupy backend's GPU
paths (tests/gpu/test_stream_watch.py) and the stub under scripts/bench/host_cost_cupy.py.

:func:`installed` puts a module named ``cupy`` in ``sys.modules`` for the time of a ``with``:
arrays (:class:`ndarray`, numpy memory behind a CuPy-like face), one device, streams, events
whose completion the test decides (:class:`Device`: ``stalled`` keeps the events recorded from
then on from completing, as a stream stuck behind a collective a peer never joins, until
``resume()``), and
``cupy.cuda.nccl`` with a :class:`NcclCommunicator` that keeps a log of its calls, its abort and its
destruction: at world size 1 a reduction of one rank's data leaves it as it is; at world N, under
mpiexec (or torchrun), its calls move the arrays' host memory over MPI (or Gloo): a twin over a real
transport.

What the host waits for is counted: :attr:`Device.host_waits` (event and stream
``synchronize()``, ``ndarray.get()``) and :attr:`Device.queries` (event queries, by thread);
:func:`host_calls` lists the C functions (collectives, waits) a thread calls outside the stand-in.
No CUDA, no NCCL: what this proves is our own bookkeeping around them.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np


class Device:
    """The one fake GPU: which events have completed, and what the host asked of it."""

    def __init__(self) -> None:
        self.stalled = False
        self.host_waits = 0
        self.queries: dict[int, int] = {}  # thread id -> event queries made there
        self.events_made = 0
        self.stuck: list[Event] = []  # events recorded while stalled, not completed yet
        #: The MPI requests of the fake NCCL's grouped sends and recvs (world N) not seen complete:
        #: an event recorded after them completes with them; the host's waits wait for them.
        self.outstanding: list[Any] = []

    def drain(self) -> None:
        """What the host's wait for the stream waits for: the grouped sends and recvs."""
        while self.outstanding:
            self.outstanding.pop().Wait()

    def resume(self) -> None:
        """The stream moves on: every event recorded while stalled completes, later ones too."""
        self.stalled = False
        for event in self.stuck:
            event._complete = True
        self.stuck.clear()


class _Pointer:
    """``cupy.cuda.MemoryPointer``: the address and the device it is on."""

    def __init__(self, ptr: int, device_id: int = 0) -> None:
        self.ptr, self.device_id = ptr, device_id


class _CudaDevice:
    """``cupy.cuda.Device``: the current device (always 0 here) and a context manager."""

    def __init__(self, id: int = 0) -> None:  # noqa: A002  (CuPy's name)
        self.id = id

    def use(self) -> None:
        pass

    def __enter__(self) -> _CudaDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class ndarray:  # noqa: N801  (CuPy's name)
    """A CuPy-like array over a numpy array (``host``); its attributes are read once (plain
    attributes cost what CuPy's own do: a benchmark counts our code, not the stand-in's)."""

    def __init__(self, host: np.ndarray) -> None:
        self.host = host
        self.device = _CudaDevice(0)
        self.shape, self.dtype, self.strides = host.shape, host.dtype, host.strides
        self.nbytes, self.size, self.itemsize, self.flags = host.nbytes, host.size, host.itemsize, host.flags
        self.data = _Pointer(host.ctypes.data)

    def view(self, dtype: Any) -> ndarray:
        return ndarray(self.host.view(dtype))

    def astype(self, dtype: Any, order: Any = "C", copy: bool = True) -> ndarray:
        return ndarray(self.host.astype(dtype, order=order, copy=copy))

    def __getitem__(self, key: Any) -> ndarray:
        return ndarray(self.host[_unwrap(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self.host[_unwrap(key)] = _unwrap(value)

    def get(self, stream: Any = None) -> Any:
        _DEVICE.host_waits += 1
        _DEVICE.drain()
        return self.host.copy()


def _unwrap(value: Any) -> Any:
    return value.host if isinstance(value, ndarray) else value


def _operator(name: str) -> Any:
    """numpy's ``name`` dunder on the arrays' memory: in place on x's own, else a new array."""
    def apply(self: ndarray, *args: Any) -> Any:
        result = getattr(self.host, name)(*map(_unwrap, args))
        if result is self.host:
            return self
        return ndarray(result) if isinstance(result, np.ndarray) else result
    return apply


for _name in ("add", "sub", "mul", "truediv", "floordiv", "and", "or", "xor", "lshift", "rshift",
              "lt", "le", "gt", "ge", "eq", "ne"):
    setattr(ndarray, f"__{_name}__", _operator(f"__{_name}__"))
    if _name not in ("lt", "le", "gt", "ge", "eq", "ne"):
        setattr(ndarray, f"__i{_name}__", _operator(f"__i{_name}__"))
for _name in ("__invert__", "__neg__"):
    setattr(ndarray, _name, _operator(_name))


def _copyto(dst: ndarray, src: Any, casting: str = "same_kind") -> None:
    np.copyto(dst.host, _unwrap(src), casting=casting)  # type: ignore[arg-type]


class Event:
    """``cupy.cuda.Event``: completes when recorded, unless the device is stalled then."""

    def __init__(self, disable_timing: bool = False) -> None:
        _DEVICE.events_made += 1
        self._complete = True
        self._requests: list[Any] = []

    def record(self, stream: Any = None) -> None:
        if _DEVICE.outstanding:  # (an event recorded before them, pooled again, had none left)
            self._requests = list(_DEVICE.outstanding)
        self._complete = not _DEVICE.stalled
        if _DEVICE.stalled:
            _DEVICE.stuck.append(self)

    @property
    def done(self) -> bool:
        ident = threading.get_ident()
        _DEVICE.queries[ident] = _DEVICE.queries.get(ident, 0) + 1
        requests = self._requests
        if requests:
            while requests and requests[-1].Test():
                requests.pop()
            return False if requests else self._complete
        return self._complete

    def query(self) -> bool:  # (torch.cuda.Event's name for it)
        return bool(self.done)

    def synchronize(self) -> None:
        _DEVICE.host_waits += 1


class Stream:
    ptr = 0

    def synchronize(self) -> None:
        _DEVICE.host_waits += 1
        _DEVICE.drain()

    def wait_event(self, event: Event) -> None:
        pass


#: numpy's dtype of each ncclDataType_t (bfloat16, 9, has none: the twin refuses it past one rank).
NCCL_NUMPY = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16,
              7: np.float32, 8: np.float64}
#: numpy's ufunc of each ncclRedOp_t we hand NCCL (sum, prod, max, min).
NCCL_UFUNCS = {0: np.add, 1: np.multiply, 2: np.maximum, 3: np.minimum}


class NcclCommunicator:
    """``cupy.cuda.nccl.NcclCommunicator``: ``calls`` logs every call by name, ``arguments`` every
    call's (name, arguments), ``reductions`` the (ncclDataType_t, ncclRedOp_t, count) of every
    ``allReduce``; ``aborted`` is set by ``abort()``.

    At world size 1 a reduction of one rank's data leaves it as it is. At world ``size`` > 1 (under
    mpiexec or torchrun: ``size`` and ``rank`` are the launcher's) the calls run at once on the host
    over a duplicate of MPI's COMM_WORLD (or a Gloo group of torch.distributed's world): every
    collective is one all_gather of each rank's bytes (so calls that differ between ranks never
    hang the twin: each rank makes garbage of the others' bytes, as NCCL would), reduced by numpy
    in rank order; send and recv are the transport's (those between ``groupStart`` and
    ``groupEnd`` are launched at ``groupEnd``: an event recorded after them completes with them)."""

    def __init__(self, size: int = 1, unique_id: Any = None, rank: int = 0) -> None:
        self._size, self._rank = size, rank
        self.arguments: list[tuple[str, tuple[Any, ...]]] = []
        self.aborted = threading.Event()
        self.destroyed = False
        self._host = _host_world(size, rank) if size > 1 else None
        self._loopback: list[np.ndarray] = []  # the bytes sent to this rank itself, in order

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    @property
    def calls(self) -> list[str]:
        return [name for name, _ in self.arguments]

    @property
    def reductions(self) -> list[tuple[int, int, int]]:
        return [(args[3], args[4], args[2]) for name, args in self.arguments if name == "allReduce"]

    def _call(self, name: str, arguments: tuple[Any, ...]) -> None:
        if self.aborted.is_set():
            raise RuntimeError("NCCL_ERROR_INVALID_USAGE: the communicator was aborted")
        self.arguments.append((name, arguments))

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:  # noqa: N802
        self._call("allReduce", (send, recv, count, dtype, op, stream))
        if self._host is not None:
            _store(recv, self._reduced(send, count, dtype, op))

    def reduce(self, send: int, recv: int, count: int, dtype: int, op: int, root: int, stream: int) -> None:
        self._call("reduce", (send, recv, count, dtype, op, root, stream))
        if self._host is not None:
            reduced = self._reduced(send, count, dtype, op)
            if self._rank == root:
                _store(recv, reduced)

    def reduceScatter(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:  # noqa: N802
        self._call("reduceScatter", (send, recv, count, dtype, op, stream))
        if self._host is not None:
            _store(recv, self._reduced(send, count * self._size, dtype, op)[self._rank * count:][:count])

    def broadcast(self, send: int, recv: int, count: int, dtype: int, root: int, stream: int) -> None:
        self._call("broadcast", (send, recv, count, dtype, root, stream))
        if self._host is not None:
            length = count * np.dtype(NCCL_NUMPY[dtype]).itemsize
            _store(recv, _fit(self._everyone(send, length if self._rank == root else 0)[root], length))

    def allGather(self, send: int, recv: int, count: int, dtype: int, stream: int) -> None:  # noqa: N802
        self._call("allGather", (send, recv, count, dtype, stream))
        length = count * np.dtype(NCCL_NUMPY[dtype]).itemsize
        if self._host is not None:
            _store(recv, np.concatenate([_fit(row, length) for row in self._everyone(send, length)]))
        elif send != recv:
            ctypes.memmove(recv, send, length)

    def send(self, send: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._call("send", (send, count, dtype, peer, stream))
        if self._host is not None:
            length = count * np.dtype(NCCL_NUMPY[dtype]).itemsize
            if peer == self._rank:  # (to itself: Gloo has no pair for it)
                self._loopback.append(_bytes_at(send, length).copy())
            else:
                _point_to_point(self._host.Isend(_bytes_at(send, length).copy(), peer))

    def recv(self, recv: int, count: int, dtype: int, peer: int, stream: int) -> None:
        self._call("recv", (recv, count, dtype, peer, stream))
        if self._host is not None:
            length = count * np.dtype(NCCL_NUMPY[dtype]).itemsize
            if peer == self._rank:
                _store(recv, _fit(self._loopback.pop(0), length))
            else:
                _point_to_point(self._host.Irecv(_bytes_at(recv, length), peer))

    def _everyone(self, send: int, length: int) -> list[np.ndarray]:
        """Every rank's ``length`` bytes at ``send`` (each rank's own length), in rank order."""
        assert self._host is not None
        mine = _bytes_at(send, length).copy()
        counts = self._host.allgather(length)
        everyone = np.empty(sum(counts), dtype=np.uint8)
        self._host.Allgatherv(mine, (everyone, counts))
        return np.split(everyone, np.cumsum(counts)[:-1])

    def _reduced(self, send: int, count: int, dtype: int, op: int) -> np.ndarray:
        """The reduction by ``op`` of every rank's ``count`` elements of ``dtype`` at ``send``."""
        if dtype not in NCCL_NUMPY:
            raise NotImplementedError(f"the fake NCCL reduces no ncclDataType_t {dtype} past one rank")
        kind = np.dtype(NCCL_NUMPY[dtype])
        rows = [_fit(row, count * kind.itemsize).view(kind) for row in self._everyone(send, count * kind.itemsize)]
        result: np.ndarray = rows[0].copy()
        for row in rows[1:]:
            NCCL_UFUNCS[op](result, row, out=result)
        return result

    def check_async_error(self) -> None:
        pass

    def abort(self) -> None:
        self.aborted.set()

    def destroy(self) -> None:
        self.destroyed = True
        if self._host is not None:
            self._host.Free()
            self._host = None


def _host_world(size: int, rank: int) -> Any:
    """The fake NCCL's host transport at world ``size``: a duplicate of MPI's COMM_WORLD, or where
    torch.distributed is initialized (torchrun) a Gloo group of its world, as mpi4py's calls."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        world: Any = _GlooWorld(dist)
    else:
        from mpi4py import MPI  # noqa: PLC0415

        world = MPI.COMM_WORLD.Dup()
    if (world.Get_size(), world.Get_rank()) != (size, rank):
        raise ValueError(f"the fake NCCL at world size {size} runs under mpiexec or torchrun, its size and rank "
                         f"the launcher's ({world.Get_size()}, {world.Get_rank()}); got ({size}, {rank})")
    return world


class _GlooWorld:
    """The mpi4py calls the fake NCCL makes, over a Gloo group of torch.distributed's world."""

    def __init__(self, dist: Any) -> None:
        import torch  # noqa: PLC0415

        self._dist, self._torch = dist, torch
        # (sends and recvs on a group of their own: Gloo's tags of point-to-point calls are slots
        # its collectives count through too)
        self._group, self._p2p = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")

    def Get_size(self) -> int:  # noqa: N802  (mpi4py's names)
        return int(self._dist.get_world_size(self._group))

    def Get_rank(self) -> int:  # noqa: N802
        return int(self._dist.get_rank(self._group))

    def allgather(self, value: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.Get_size()
        self._dist.all_gather_object(everyone, value, group=self._group)
        return everyone

    def Allgatherv(self, mine: np.ndarray, spec: tuple[np.ndarray, list[int]]) -> None:  # noqa: N802
        everyone, counts = spec
        rows = self.allgather(mine.tobytes())
        everyone[:] = np.frombuffer(b"".join(rows), dtype=np.uint8)

    def Isend(self, buf: np.ndarray, peer: int) -> Any:  # noqa: N802
        return _Work(self._dist.isend(self._torch.from_numpy(buf), peer, group=self._p2p))

    def Irecv(self, buf: np.ndarray, peer: int) -> Any:  # noqa: N802
        return _Work(self._dist.irecv(self._torch.from_numpy(buf), peer, group=self._p2p))

    def Free(self) -> None:  # noqa: N802
        self._dist.destroy_process_group(self._group)
        self._dist.destroy_process_group(self._p2p)


class _Work:
    """A torch Work as an mpi4py request (a Gloo send or recv completes only in its wait)."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def Wait(self) -> None:  # noqa: N802
        self._work.wait()

    def Test(self) -> bool:  # noqa: N802
        return bool(self._work.is_completed())


def _bytes_at(address: int, length: int) -> np.ndarray:
    """The ``length`` bytes of host memory at ``address`` (a fake device pointer), as a view."""
    if not length:
        return np.empty(0, dtype=np.uint8)
    return np.frombuffer(memoryview((ctypes.c_char * length).from_address(address)).cast("B"), dtype=np.uint8)


def _store(address: int, values: np.ndarray) -> None:
    ctypes.memmove(address, np.ascontiguousarray(values).ctypes.data, values.nbytes)


def _fit(row: np.ndarray, length: int) -> np.ndarray:
    """``row`` cut or zero-padded to ``length`` bytes (a peer that made another call)."""
    return row[:length] if len(row) >= length else np.concatenate([row, np.zeros(length - len(row), np.uint8)])


#: The point-to-point requests of this thread's open NCCL group (``None``: no group is open).
_GROUP_REQUESTS = threading.local()


def _point_to_point(request: Any) -> None:
    pending = getattr(_GROUP_REQUESTS, "requests", None)
    if pending is None:
        request.Wait()
    else:
        pending.append(request)


def _group_start() -> None:
    _GROUP_REQUESTS.requests = []


def _group_end() -> None:
    # (launched, not waited for: the events recorded after them complete with them; Gloo's, which
    # complete only in a wait, are waited for here)
    pending, _GROUP_REQUESTS.requests = getattr(_GROUP_REQUESTS, "requests", None) or [], None
    for request in pending:
        if isinstance(request, _Work):
            request.Wait()
        else:
            _DEVICE.outstanding.append(request)


_DEVICE = Device()
_STREAM = Stream()


def device() -> Device:
    """The fake GPU of the installed module."""
    return _DEVICE


def _current_stream() -> Stream:
    return _STREAM


@contextlib.contextmanager
def host_calls(names: set[str], benign: Callable[[Any], bool] | None = None) -> Iterator[list[str]]:
    """The C functions of ``names`` (MPI's or Gloo's collectives, waits, sleeps...) that the calling
    thread calls inside the ``with`` outside this stand-in (its frames, and what they call: they
    stand in for the GPU's work), in order: a list filled as they are called. ``benign(function)``:
    one of those names that is no host wait (a CUDA event's ``wait``, which makes a stream wait)."""
    called: list[str] = []
    me, here, inside = threading.get_ident(), __file__, [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if threading.get_ident() != me:
            return
        if frame.f_code.co_filename == here and event in ("call", "return"):
            # (never below 0: this function's own frame returns once the profile is on)
            inside[0] = inside[0] + 1 if event == "call" else max(0, inside[0] - 1)
        elif event == "c_call" and not inside[0] and frame.f_code.co_filename != here:
            name = getattr(arg, "__name__", "")
            if name in names and (benign is None or not benign(arg)):
                called.append(name)

    sys.setprofile(profile)
    try:
        yield called
    finally:
        sys.setprofile(None)


def _module() -> Any:
    cupy: Any = types.ModuleType("cupy")
    cupy.__version__ = "14.0.0"
    cupy.ndarray = ndarray
    cupy.asarray = lambda values, dtype=None: ndarray(np.ascontiguousarray(values, dtype=dtype))
    cupy.zeros = lambda shape, dtype=None: ndarray(np.zeros(shape, dtype=dtype))
    cupy.empty = lambda shape, dtype=None: ndarray(np.empty(shape, dtype=dtype))
    cupy.copyto = _copyto
    for name in ("bool_", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"):
        setattr(cupy, name, getattr(np, name))
    cupy.where = lambda condition, a, b: ndarray(np.where(*map(_unwrap, (condition, a, b))))
    nccl: Any = types.ModuleType("cupy.cuda.nccl")
    nccl.available = True
    nccl.get_version = lambda: 22703
    nccl.get_unique_id = lambda: tuple(range(128))
    nccl.groupStart, nccl.groupEnd = _group_start, _group_end
    nccl.NcclCommunicator = NcclCommunicator
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1)
    cuda: Any = types.ModuleType("cupy.cuda")
    cuda.Device, cuda.Event, cuda.nccl, cuda.runtime = _CudaDevice, Event, nccl, runtime
    cuda.get_current_stream = _current_stream
    cupy.cuda = cuda
    return cupy


@contextlib.contextmanager
def installed() -> Iterator[Device]:
    """``cupy`` (and ``cupy.cuda``, ``cupy.cuda.nccl``) are this stand-in inside the ``with``;
    a new fake GPU each time. What was there before comes back after."""
    global _DEVICE
    names = ("cupy", "cupy.cuda", "cupy.cuda.nccl")
    saved = {name: sys.modules.get(name) for name in names}
    _DEVICE = Device()
    cupy = _module()
    sys.modules.update({"cupy": cupy, "cupy.cuda": cupy.cuda, "cupy.cuda.nccl": cupy.cuda.nccl})
    try:
        yield _DEVICE
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
