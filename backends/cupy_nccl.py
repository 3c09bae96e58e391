"""Raw NCCL through ``cupy.cuda.nccl.NcclCommunicator``, on the caller's CUDA stream.

One NCCL communicator per process, on device ``local_rank % device_count`` (bound
before the communicator exists). Rank 0's NCCL unique id reaches the other ranks as
:mod:`collectives.backends.cupy_id` says (MPI broadcast under mpiexec, TCP store under torchrun).

Arrays: CuPy arrays and torch CUDA tensors, zero-copy: NCCL gets their device
pointers. Every NCCL call and every local step runs on the caller's current stream
(``torch.cuda.current_stream()`` for tensors, CuPy's current stream for CuPy
arrays), so results are ordered with the caller's kernels.

Blocking calls return once enqueued, as on NCCL. Timeouts: NCCL has none of its own for a
blocking communicator, so with a timeout set (the default) each call records a pooled CUDA event
after itself, and the process's watchdog thread (backends/stream_watch.py) looks at the calls in
flight (and NCCL's asynchronous error query) every 50 ms; past a call's deadline it aborts the
communicator's NCCL calls (``ncclCommAbort``), and the rank's next call or ``wait()`` raises the
``CollectiveTimeout`` naming that call; the communicator is unusable. ``wait()`` only makes the
then-current stream wait for the call's event. What the deadline cannot reach: ``ncclCommInitRank``
and ``ncclCommSplit`` (host calls that wait for every rank), and an NCCL call that blocks on the
host while it connects to a peer for the first time.

What NCCL lacks is emulated, as on the torch backend (:func:`reduce_plan` is the table):
- bool is reduced as its uint8 bytes (a view): MIN/MAX, and BAND/BOR as MIN/MAX;
- int16 is reduced in int32 (a copy), which keeps wrapping SUM/PROD and MIN/MAX exact;
- BXOR, and every bitwise op on integers, gathers all ranks' arrays and folds locally;
- AVG is SUM, then a division by size (not ``ncclAvg``, which scales each input first
  and so rounds differently from the other backends);
- float MIN/MAX reduce integer order keys (NCCL's ``fminf``/``fmaxf`` drop NaN);
- bfloat16 is native from NCCL 2.10 on, else reduced in float32.
Broadcast and all_gather move raw bytes; reduce is ``ncclReduce`` (bitwise ops emulated);
gather, scatter, all_to_all (equal and uneven) and all_gather_v are raw-byte sends and recvs
in one NCCL group (:class:`P2PPlan`). Asynchronous sends and recvs join this thread's open
NCCL group and are launched together at the first ``wait()`` of one of them or the next other
call of this backend, so a ring of them cannot deadlock. Debug-mode fingerprints, the counts of
the uneven collectives and debug p2p headers travel through device buffers. Host arrays are
refused with a ``TypeError``. ``split`` uses ncclCommSplit where CuPy wraps it (CuPy >= 14,
NCCL >= 2.18.1), else makes the new communicator through this one (its group leader's id
travels in an all_gather).

The channel every call goes through (the NCCL communicator and its device, the stream
libraries, completion under the deadline, the open group, the small vectors, the barrier) is
:mod:`collectives.backends.cupy_channel`'s :class:`CupyNcclChannel`; this module holds the
collectives, send/recv and split, and the public :class:`CupyNcclCommunicator`.

Imports: the interface, cupy_channel and the cupy backend's helper modules.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from collectives.backends.cupy_id import (
    UNIQUE_ID_BYTES,
    comm_id_argument,
    exchange_unique_id,
    host_channel,
    id_to_bytes,
)

from collectives import config
from collectives.arrays import ArrayAdapter
from collectives.calls import Request
from collectives.communicator import Communicator
from collectives.errors import CollectiveError
from collectives.launcher import LaunchInfo
from collectives.ops import ReduceOp
from collectives.work import Work

from ._buffers import count, divide_, fold_bitwise, nbytes, row_bytes, stage
from .cupy_channel import (
    CupyNcclChannel,
    bind_device,
    import_cupy_nccl,
)
from .cupy_host import GlooHost, MPIHost
from .cupy_plans import (
    NCCL_DTYPES,
    NCCL_OPS,
    P2PPlan,
    ReducePlan,
    all_gather_v_plan,
    all_to_all_plan,
    all_to_all_v_plan,
    from_order_keys,
    gather_plan,
    order_keys,
    scatter_plan,
)

log = logging.getLogger("collectives")

#: First NCCL with ncclCommSplit (CuPy >= 14 wraps it as NcclCommunicator.commSplit).
COMM_SPLIT_SINCE = (2, 18, 1)
#: ``NCCL_SPLIT_NOCOLOR`` of nccl.h: this rank joins no new communicator.
NCCL_SPLIT_NOCOLOR = -1
_NOT_CALLED = object()
#: First NCCL that allows several ranks on one GPU (with NCCL_MULTI_RANK_GPU_ENABLE=1).
MULTI_RANK_GPU_SINCE = (2, 30, 0)


# -- the communicator ---------------------------------------------------------------------------

class CupyNcclTransport(CupyNcclChannel):
    """The transport over a ``cupy.cuda.nccl.NcclCommunicator`` on one CUDA device: the
    collectives, send/recv and split, over :class:`~.cupy_channel.CupyNcclChannel`."""

    @classmethod
    def from_launcher(cls, launch: LaunchInfo, *, timeout: Any = None) -> CupyNcclTransport:
        config.timeout_seconds(timeout)  # a bad value fails before anything starts
        cupy, nccl = import_cupy_nccl()
        device = bind_device(cupy, launch.local_rank)
        raw = exchange_unique_id(launch, lambda: id_to_bytes(nccl.get_unique_id()))
        with cupy.cuda.Device(device):
            comm = nccl.NcclCommunicator(launch.size, comm_id_argument(raw, cupy.__version__),
                                         launch.rank)
        host = host_channel(launch, config.timeout_seconds(timeout))
        made = cls(comm, launch.rank, launch.size, launch.local_rank, device, host)
        log.info("collectives: cupy backend rank %d/%d on CUDA device %d, NCCL %s",
                 launch.rank, launch.size, device, ".".join(map(str, made.nccl_version)))
        return made

    # -- collectives ------------------------------------------------------------------------

    def _all_reduce(self, r: Request) -> Any:
        # (NCCL on a contiguous x of a kind it reduces as it is: the kind's planned call, cupy_plans)
        x, adapter, dtype, op, async_op = r.x, r.adapter, r.dtype, r.op, r.async_op
        plan = self._kind(adapter, dtype, op).reduce
        assert plan is not None
        lib, stream = self._enter(x, adapter)
        buf, writeback = _wire_buffer(x, adapter, dtype, op, plan)
        if plan.nccl_op is None:
            adapter.copy_(buf, fold_bitwise(self._gather_rows(lib, adapter, buf, stream), ReduceOp(plan.fold)))
        else:
            ptr = lib.ptr(buf)
            self._comm.allReduce(ptr, ptr, count(buf), NCCL_DTYPES[plan.wire],
                                 NCCL_OPS[plan.nccl_op], lib.stream_ptr(stream))
        if plan.divide:
            divide_(buf, self.size)
        return self._done(lib, stream, async_op, x, writeback=writeback)

    def _reduce(self, r: Request) -> Any:
        x, adapter, dtype, op, dst, async_op = r.x, r.adapter, r.dtype, r.op, r.root, r.async_op
        plan = self._kind(adapter, dtype, op).reduce
        assert plan is not None
        if plan.nccl_op is None:  # bitwise ops: all_gather and fold, kept on dst
            return super()._reduce(r)
        lib, stream = self._enter(x, adapter)
        buf, writeback = _wire_buffer(x, adapter, dtype, op, plan)
        ptr = lib.ptr(buf)
        # In place: NCCL writes recvbuff on dst only, so x stays as it was on the other ranks.
        self._comm.reduce(ptr, ptr, count(buf), NCCL_DTYPES[plan.wire], NCCL_OPS[plan.nccl_op],
                          dst, lib.stream_ptr(stream))
        if self.rank == dst:
            if plan.divide:
                divide_(buf, self.size)
            if writeback is not None:
                writeback()
        return self._done(lib, stream, async_op, x)

    def _broadcast(self, r: Request) -> Any:
        x, adapter, dtype, src, async_op = r.x, r.adapter, r.dtype, r.root, r.async_op
        lib, stream = self._enter(x, adapter)
        buf, writeback = stage(x, adapter, dtype, None)
        ptr = lib.ptr(buf)
        self._comm.broadcast(ptr, ptr, nbytes(buf), NCCL_DTYPES["uint8"], src,
                             lib.stream_ptr(stream))
        return self._done(lib, stream, async_op, x, writeback=writeback)

    def _all_gather(self, r: Request) -> Any:
        x, adapter, dtype, out, async_op = r.x, r.adapter, r.dtype, r.out, r.async_op
        lib, stream = self._enter(x, adapter)
        buf, _ = stage(x, adapter, dtype, None)
        return self._done(lib, stream, async_op, self._gather_rows(lib, adapter, buf, stream, out))

    def _reduce_scatter(self, r: Request) -> Any:
        x, adapter, dtype, op, out, async_op = r.x, r.adapter, r.dtype, r.op, r.out, r.async_op
        plan = self._kind(adapter, dtype, op).reduce
        assert plan is not None
        lib, stream = self._enter(x, adapter)
        buf, _ = _wire_buffer(x, adapter, dtype, op, plan)  # only read: x stays as it is
        rows = int(x.shape[0]) // self.size
        shape = (rows, *tuple(x.shape)[1:])
        if plan.nccl_op is None:
            folded = fold_bitwise(self._gather_rows(lib, adapter, buf, stream), ReduceOp(plan.fold))
            result = adapter.cast(folded[self.rank * rows:(self.rank + 1) * rows], None)
        else:
            result = out if out is not None and plan.wire == dtype else adapter.empty(buf, shape)
            self._comm.reduceScatter(lib.ptr(buf), lib.ptr(result), count(result),
                                     NCCL_DTYPES[plan.wire], NCCL_OPS[plan.nccl_op],
                                     lib.stream_ptr(stream))
        if plan.divide:
            divide_(result, self.size)
        if plan.keys:
            result = from_order_keys(result, adapter, dtype)
        elif plan.wire != dtype:  # bool's uint8 bytes are a view; int16's int32 a cast
            result = adapter.view(result, dtype) if dtype == "bool" else adapter.cast(result, dtype)
        if out is not None and result is not out:
            adapter.copy_(out, result)
            result = out
        return self._done(lib, stream, async_op, result)

    # -- the collectives NCCL builds from send/recv: one group each ------------------------

    def _exchange(self, lib: Any, stream: Any, plan: P2PPlan, send: Any, recv: Any) -> None:
        """Enqueue ``plan``'s sends (from ``send``'s bytes) and recvs (into ``recv``'s) as one
        NCCL group on ``stream``."""
        self._flush_group()
        uint8, stream_ptr = NCCL_DTYPES["uint8"], lib.stream_ptr(stream)
        nccl = self._nccl_module
        nccl.groupStart()
        try:
            for peer, offset, nbytes in plan.sends:
                self._comm.send(lib.ptr(send) + offset, nbytes, uint8, peer, stream_ptr)
            for peer, offset, nbytes in plan.recvs:
                self._comm.recv(lib.ptr(recv) + offset, nbytes, uint8, peer, stream_ptr)
        finally:
            nccl.groupEnd()

    def _gather(self, r: Request) -> Any:
        x, adapter, dtype, dst, out, async_op = r.x, r.adapter, r.dtype, r.root, r.out, r.async_op
        lib, stream = self._enter(x, adapter, flush=False)
        buf, _ = stage(x, adapter, dtype, None)
        result = None
        if self.rank == dst:
            result = out if out is not None else adapter.empty(buf, (self.size, *buf.shape))
        self._exchange(lib, stream, gather_plan(self.rank, self.size, dst, nbytes(buf)),
                       buf, result)
        return self._done(lib, stream, async_op, result, like=buf, keep=buf)

    def _scatter(self, r: Request) -> Any:
        x, adapter, dtype, src, out, async_op = r.x, r.adapter, r.dtype, r.root, r.out, r.async_op
        lib, stream = self._enter(x, adapter, flush=False)
        buf = stage(x, adapter, dtype, None)[0] if self.rank == src else None
        result = out if out is not None else adapter.empty(x, tuple(x.shape)[1:])
        row_size = row_bytes(x)
        self._exchange(lib, stream, scatter_plan(self.rank, self.size, src, row_size), buf, result)
        return self._done(lib, stream, async_op, result, keep=buf)

    def _all_to_all(self, r: Request) -> Any:
        x, adapter, dtype, out, async_op = r.x, r.adapter, r.dtype, r.out, r.async_op
        lib, stream = self._enter(x, adapter, flush=False)
        buf, _ = stage(x, adapter, dtype, None)
        result = out if out is not None else adapter.empty(buf, tuple(buf.shape))
        row_size = row_bytes(x)
        self._exchange(lib, stream, all_to_all_plan(self.rank, self.size, row_size), buf, result)
        return self._done(lib, stream, async_op, result, keep=buf)

    def _all_to_all_v(self, r: Request) -> Any:
        x, adapter, dtype, splits, out, async_op = r.x, r.adapter, r.dtype, r.extra, r.out, r.async_op
        lib, stream = self._enter(x, adapter, flush=False)
        buf, _ = stage(x, adapter, dtype, None)
        rows = sum(row[self.rank] for row in splits)
        result = out if out is not None else adapter.empty(buf, (rows, *tuple(x.shape)[1:]))
        row_size = row_bytes(x)
        self._exchange(lib, stream, all_to_all_v_plan(self.rank, splits, row_size), buf, result)
        return self._done(lib, stream, async_op, result, like=buf, keep=buf)

    def _all_gather_v(self, r: Request) -> Any:
        x, adapter, dtype, counts, out, async_op = r.x, r.adapter, r.dtype, r.extra, r.out, r.async_op
        lib, stream = self._enter(x, adapter, flush=False)
        buf, _ = stage(x, adapter, dtype, None)
        result = out if out is not None else adapter.empty(buf, (sum(counts), *tuple(x.shape)[1:]))
        row_size = row_bytes(x)
        self._exchange(lib, stream, all_gather_v_plan(self.rank, counts, row_size), buf, result)
        return self._done(lib, stream, async_op, (result, counts), like=buf, keep=buf)

    # -- point-to-point ---------------------------------------------------------------------

    def _send(self, r: Request) -> Work | None:
        return self._point_to_point(r, receive=False)

    def _recv(self, r: Request) -> Work | None:
        return self._point_to_point(r, receive=True)

    def _point_to_point(self, r: Request, receive: bool) -> Work | None:
        """send or recv of x with the peer ``r.root``. NCCL has no tags: calls between two
        ranks match in the order they are made."""
        x, adapter, dtype, peer, async_op = r.x, r.adapter, r.dtype, r.root, r.async_op
        lib, stream = self._enter(x, adapter, flush=False)
        buf, writeback = stage(x, adapter, dtype, None)
        if not receive:
            writeback = None  # (a send only reads its staging copy)
        length, move = nbytes(buf), self._comm.recv if receive else self._comm.send

        def issue(stream_ptr: int) -> None:
            if length:  # the peer knows the size too: both leave a zero-byte call out
                move(lib.ptr(buf), length, NCCL_DTYPES["uint8"], peer, stream_ptr)

        if async_op:
            return self._grouped_p2p(lib, stream, x, issue, keep=buf, then=writeback)
        self._flush_group()
        issue(lib.stream_ptr(stream))
        self._done(lib, stream, False, None, writeback=writeback)
        return None

    def _split(self, color: int | None, key: int) -> CupyNcclTransport | None:
        self._flush_group()
        # (the CPU channel first, split as NCCL's ranks are: every rank of this one is here)
        host = None if self._host is None else self._host.split(color, key)
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
                return CupyNcclTransport(new, int(new.rank_id()), int(new.size()), self.local_rank,
                                         self.device, host)
        return self._split_through_parent(color, key, host)

    def _split_through_parent(self, color: int | None, key: int, host: MPIHost | GlooHost | None
                              ) -> CupyNcclTransport | None:
        # Without ncclCommSplit (CuPy < 14, NCCL < 2.18.1) the new communicator is made through
        # this one: each group's first rank makes an NCCL id, and the ids travel in one exchange.
        import numpy as np  # noqa: PLC0415

        cupy, nccl = self._cupy, self._nccl_module
        members = self._split_groups(color, key)
        raw = bytes(UNIQUE_ID_BYTES)
        if members and members[0] == self.rank:
            raw = id_to_bytes(nccl.get_unique_id())
        all_ids = self._exchange_small(np.frombuffer(raw, dtype=np.int64))
        if not members:
            return None
        unique_id = comm_id_argument(all_ids[members[0]].tobytes(), cupy.__version__)
        try:
            with cupy.cuda.Device(self.device):
                comm = nccl.NcclCommunicator(len(members), unique_id, members.index(self.rank))
        except Exception as error:  # noqa: BLE001  (NcclError is cupy's RuntimeError)
            raise CollectiveError(f"split: NCCL could not create the communicator of color "
                                  f"{color} ({error})") from error
        return CupyNcclTransport(comm, members.index(self.rank), len(members), self.local_rank,
                                 self.device, host)


class CupyNcclCommunicator(Communicator):
    """A communicator over a ``cupy.cuda.nccl.NcclCommunicator`` on one CUDA device.

    ``nccl_version`` is the runtime libnccl's (major, minor, patch); ``device`` the CUDA
    ordinal every array must live on. ``timeout`` as for every communicator (``None`` reads
    ``COLLECTIVES_TIMEOUT``; 0 means none).
    """

    transport_class = CupyNcclTransport
    _transport: CupyNcclTransport

    def __init__(self, nccl_comm: Any, rank: int, size: int, local_rank: int, device: int, *,
                 timeout: Any = None) -> None:
        config.timeout_seconds(timeout)  # a bad value fails before the transport is made
        super().__init__(CupyNcclTransport(nccl_comm, rank, size, local_rank, device), timeout=timeout)

    @property
    def nccl_comm(self) -> Any:
        """The underlying ``cupy.cuda.nccl.NcclCommunicator`` (for raw NCCL calls)."""
        return self._transport.nccl_comm

    @property
    def device(self) -> int:
        """The CUDA ordinal every array must live on."""
        return self._transport.device

    @property
    def nccl_version(self) -> tuple[int, ...]:
        """The runtime libnccl's (major, minor, patch)."""
        return self._transport.nccl_version


def _wire_buffer(x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp, plan: ReducePlan
                 ) -> tuple[Any, Callable[[], None] | None]:
    """The contiguous buffer NCCL reduces for ``plan`` and the copy back into ``x`` (``None``
    when the buffer is x's memory): x's order keys for float MIN/MAX, else ``stage``'s."""
    if not plan.keys:
        return stage(x, adapter, dtype, plan.wire)
    keys = order_keys(x, adapter, dtype, op)
    return keys, lambda: adapter.copy_(x, from_order_keys(keys, adapter, dtype))


