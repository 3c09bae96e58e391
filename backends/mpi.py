"""MPI through mpi4py.

Host arrays go to MPI without a copy: a numpy array as it is, a CPU torch tensor
through a numpy view of its memory (cheaper than DLPack per call). In-place
reductions use ``MPI.IN_PLACE``. Where MPI lacks a dtype (bfloat16 always,
float16 where the library does not reduce ``MPIX_C_FLOAT16``) the reduction is staged
through float32 and rounded back; broadcast and all_gather move raw bytes, so
they need no staging. AVG is SUM, then a division by size on every rank.

CUDA arrays (torch CUDA tensors, CuPy arrays) are handed to MPI directly when the
library is CUDA-aware, else staged through pinned host memory. MPI knows nothing of
CUDA streams: the host copy is made after whatever produced the array, and device
memory is handed over only once its stream has finished every kernel that wrote it,
the call's own staging copies and order keys included (:func:`hand_over`).
``COLLECTIVES_MPI_CUDA_AWARE=0|1`` overrides the detection. Like every backend, this one
makes device ``local_rank % device_count`` current (in torch and CuPy, where loaded)
before its communicator exists; arrays on any device are taken.

Timeouts: MPI has none, so with a timeout set every collective is the nonblocking
call (``Iallreduce``, ``Ibcast``, ...) completed by polling ``Test`` against a
deadline (:func:`poll_policy`): a few tight polls first (small collectives finish
there), then, when every rank of the node has a core of its own, polls without
yielding but every 16th (a peer's message is seen the moment it lands, and a peer the
scheduler put on this core runs), else polls with ``sched_yield`` each, and after a
second of waiting polls every millisecond (a hung job does not burn the CPU). A collective request cannot be
cancelled, so after a timeout the communicator refuses further calls. With no
timeout (``COLLECTIVES_TIMEOUT=0``) the blocking calls are used. Every MPI call goes
out through :meth:`MPITransport._call` (or, for handles, ``_collective``).

The channel every call goes through (the communicator, its tables, buffers, one MPI call
under the deadline, the reductions' wire dtypes and order keys, the default check's word,
farewells) is :mod:`collectives.backends.mpi_channel`'s :class:`MPIChannel`; this module
holds the collectives, send/recv and split, and the public :class:`MPICommunicator`.

Imports: the interface, the channel and the MPI backend's helper modules.

Rank failure: an uncaught exception on one rank would leave the others waiting
in a collective forever, so ``collectives.init()`` under an MPI launcher installs a
``sys.excepthook`` that prints the rank and calls ``MPI_Abort`` (see
:mod:`collectives.diagnostics.process_hooks`); mpiexec then ends every rank.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from collectives import arrays, calls, config
from collectives.arrays import ArrayAdapter
from collectives.calls import Request
from collectives.communicator import Communicator
from collectives.diagnostics import _exits, process_hooks
from collectives.errors import BackendUnavailable
from collectives.launcher import LaunchInfo, check_world_size
from collectives.ops import ReduceOp
from collectives.work import Work

from . import mpi_uneven
from ._buffers import (
    clone,
    count,
    flat_bytes,
    nbytes,
    row_bytes,
)
from .mpi_buffers import (
    bind_device,
    hand_over,
    tensor_address,
)
from .mpi_channel import MPIChannel, _int_view, _nan_ordered, _nonblocking, _nothing, import_mpi
from .mpi_moves import KINDS, move_class
from .mpi_p2p import point_to_point_class, short_message
from .mpi_requests import _Request
from .mpi_staged import staged, staged_table

#: Elements per MPI call: MPI counts are C ints unless the library has large counts.
MAX_COUNT = 2**31 - 1

#: The MPI thread level MPI is initialized at when this backend initializes it: mpi4py's
#: default, which this backend leaves as it is (mpi4py.rc is the user's to set).
#: Measured with the MPICH wheel on 2 ranks of one node (docs/performance.md): "single"
#: (and funneled/serialized) lets MPICH use its shared-memory collectives, ~1 us faster
#: below ~4 KiB, but 2.5-7x slower from 64 KiB up; "multiple" costs ~1 us at 4 B and wins
#: everywhere else, and it is what threaded callers need.
THREAD_LEVEL = "multiple"


def install_abort_on_uncaught_exception(MPI: Any) -> None:
    """Make an uncaught exception (or an uncaught ``sys.exit(n)``, n not 0) on this rank end
    the whole MPI job with ``MPI_Abort`` (once per process). ``collectives.init()`` installs
    it for jobs started by an MPI launcher; see :mod:`collectives.diagnostics.process_hooks`."""
    _exits.record_exit_calls()
    process_hooks._abort_mpi_on_uncaught_exception()


class MPITransport(MPIChannel):
    """The transport over an ``mpi4py.MPI.Comm`` (by default a duplicate of COMM_WORLD): the
    collectives, send/recv and split, over :class:`~.mpi_channel.MPIChannel`."""

    _recv_any_source = True  # (MPI_ANY_SOURCE; the status says who sent)

    def __init__(self, comm: Any = None, local_rank: int | None = None) -> None:
        super().__init__(comm, local_rank)
        # send's and recv's fast paths, compiled where they were built (a transport keeps its form).
        self._point_to_point = point_to_point_class()
        # The collectives' fast paths (backends/mpi_moves.py), compiled where they were built.
        self._move = move_class()
        # The uneven methods after their counts' round (backends/mpi_uneven.py, compiled where built):
        # instance attributes over this class's functions, which they run for what they do not take,
        # where the round gathers the counts and payloads they read.
        if self.round.gathers:  # (the compiled Uneven runs the compiled Round's methods in C)
            compiled = config.compiled_extension(f"{__package__}._uneven_c", mpi_uneven) \
                if self._compiled_round is not None else None
            uneven = (compiled or mpi_uneven).Uneven
            cls = type(self)
            if cls._all_gather_v is MPITransport._all_gather_v:
                self._all_gather_v = uneven(self, calls.ALL_GATHER_V, self._all_gather_v)  # type: ignore[method-assign]
            if cls._all_to_all_v is MPITransport._all_to_all_v:
                self._all_to_all_v = uneven(self, calls.ALL_TO_ALL_V, self._all_to_all_v)  # type: ignore[method-assign]

    @classmethod
    def from_launcher(cls, launch: LaunchInfo, *, timeout: Any = None) -> MPITransport:
        if launch.launcher == "torchrun":
            raise BackendUnavailable(
                "backend 'mpi' needs an MPI launcher (mpiexec, mpirun or srun), but this "
                "process was started by torchrun; launch with mpiexec -n N, or use "
                "COLLECTIVES_BACKEND=torch (or cupy) under torchrun"
            )
        # The launcher's local rank where it gives one (what the torch and cupy backends
        # use, and what users' scripts read); else MPI's ranks on this node, in rank order.
        # The device is bound before MPI starts where the launcher says which (a CUDA-aware
        # MPI picks its device at MPI_Init), else once MPI has counted the node's ranks.
        if launch.local_rank_known:
            bind_device(launch.local_rank)
        check_world_size(launch, import_mpi().COMM_WORLD.Get_size())
        transport = cls(local_rank=launch.local_rank if launch.local_rank_known else None)
        if not launch.local_rank_known:
            bind_device(transport.local_rank)
        return transport

    # -- collectives --------------------------------------------------------------------

    def _fast_path(self, call: Any, adapter: ArrayAdapter, dtype: str,
                   op: ReduceOp | None) -> Callable[[Any, Any, Any, Any], Any] | None:
        """The collectives of even shapes, send and recv on a contiguous host array in as few steps as raw
        mpi4py takes: backends/mpi_moves.py's :class:`~.mpi_moves.Move` (send's and recv's:
        mpi_p2p.py's), in this transport's form, on x's memory (a CPU tensor's numpy view, as a raw
        caller passes it), bound with the MPI datatype and op once per kind; a new result is
        allocated as a raw caller would (a tensor for a tensor, given to MPI by address). A
        reduction only where MPI reduces the dtype x op as it is. Small calls under a timeout
        through staged persistent requests (backends/mpi_staged.py); without a timeout the
        blocking call, as COLLECTIVES_TIMEOUT=0 promises."""
        if not call.collective:
            return self._fast_point_to_point(call, dtype)
        kind = KINDS.get(call)
        spec = self._native[dtype].get(op) if op is not None else None
        if kind is None or (call.reduces and spec is None):
            return None
        comm, rank, byte, in_place = self._comm, self.rank, self._byte, self._in_place
        mpi_type, mpi_op = spec if spec is not None else (None, None)
        numpy, avg = adapter is _NUMPY, op is _AVG
        new = _new_numpy if numpy else _new_tensor(self._MPI, dtype)
        # (reduce_scatter: MPI_Reduce_scatter with equal counts; MPICH's MPI_Ireduce_scatter_block,
        # what a timeout runs, took 8-11x the blocking call at 512 KiB-1 MiB; see _reduce_scatter)
        name = _MPI_NAMES[call]
        move = self._move(self, kind, getattr(comm, name), getattr(comm, _nonblocking(name)), mpi_type, mpi_op,
                          new, numpy, avg, MAX_COUNT)
        table = staged_table(self, call, dtype, op)
        if table is None:
            return move.run
        # The staged requests' makers (on the staging array's views: send, recv).
        if call is calls.ALL_REDUCE:
            init = comm.Allreduce_init
            move.staged = staged(self, table, lambda send, recv, root: init(in_place, [recv, mpi_type], mpi_op),
                                 rooted=False, avg=avg)
        elif call is calls.BROADCAST:
            init = comm.Bcast_init
            move.staged = staged(self, table, lambda send, recv, root: init([recv, byte], root), rooted=True,
                                 sends=(False, True), gets=(True, False))
        elif call is calls.REDUCE:
            init = comm.Reduce_init
            move.staged = staged(self, table, lambda send, recv, root: init(
                in_place if root == rank else [send, mpi_type], [recv, mpi_type] if root == rank else None,
                mpi_op, root), rooted=True, gets=(False, True), avg=avg)
        elif call is calls.REDUCE_SCATTER:
            init = comm.Reduce_scatter_block_init
            move.staged = staged(self, table, lambda send, recv, root: init([send, mpi_type], [recv, mpi_type], mpi_op),
                                 rooted=False, result_shape=move.result_shape, new=new, avg=avg)
        elif call is calls.ALL_GATHER or call is calls.ALL_TO_ALL:
            init = getattr(comm, f"{name}_init")
            move.staged = staged(self, table, lambda send, recv, root: init([send, byte], [recv, byte]),
                                 rooted=False, result_shape=move.result_shape, new=new)
        elif call is calls.GATHER:
            init = comm.Gather_init
            move.staged = staged(self, table, lambda send, recv, root: init(
                [send, byte], [recv, byte] if root == rank else None, root), rooted=True, gets=(False, True),
                result_shape=move.result_shape, new=new)
        else:  # scatter
            init = comm.Scatter_init
            move.staged = staged(self, table, lambda send, recv, root: init(
                [send, byte] if root == rank else None, [recv, byte], root), rooted=True, sends=(False, True),
                result_shape=move.result_shape, new=new)
        return move.run

    def _fast_point_to_point(self, call: Any, dtype: str) -> Callable[[Any, Any, Any, Any], Any]:
        """send's and recv's fast paths (see _fast_path): backends/mpi_p2p.py's
        :class:`~.mpi_p2p.PointToPoint` on x's memory, in this transport's form."""
        return self._point_to_point(self, call is calls.RECV, dtype, MAX_COUNT).run

    def _all_reduce(self, r: Request) -> Any:
        x, adapter, dtype, op, async_op = r.x, r.adapter, r.dtype, r.op, r.async_op
        wire, mpi_type, mpi_op = self._reduce_spec(dtype, op)
        buf, writeback = self._buffer(x, adapter, dtype, wire)
        IN_PLACE = self._MPI.IN_PLACE
        keys = self._order_keys(buf, wire, op)  # float MIN/MAX: integer keys that propagate NaN
        return self._collective("Allreduce", [(IN_PLACE, [chunk, mpi_type], mpi_op)
                                              for chunk in _chunks(buf if keys is None else keys)],
                                x, async_op, self._finish_reduction(buf, keys, wire, op, writeback), buf)

    def _broadcast(self, r: Request) -> Any:
        x, adapter, src, async_op = r.x, r.adapter, r.root, r.async_op
        buf, writeback = self._buffer(x, adapter, None)
        return self._collective("Bcast", [([chunk, self._byte], src) for chunk in _chunks(flat_bytes(buf))],
                                x, async_op, writeback, buf)

    def _all_gather(self, r: Request) -> Any:
        x, adapter, out, async_op = r.x, r.adapter, r.out, r.async_op
        if out is None:
            out = adapter.empty(x, (self.size, *x.shape))
        byte = self._byte
        if x.nbytes <= MAX_COUNT:
            return self._move_bytes(x, adapter, out, out, async_op, "Allgather",
                                    lambda send, recv: ([send, byte], [recv, byte]))
        send, _ = self._buffer(x, adapter, None)
        recv, writeback = self._buffer(out, adapter, None)
        send_bytes, recv_bytes = flat_bytes(send), flat_bytes(recv)
        total = count(send_bytes)
        # Each rank's block in MAX_COUNT pieces, gathered into place (blocking, even async).
        if adapter.is_cuda(x):
            raise ValueError("all_gather of more than 2**31-1 bytes per rank on CUDA "
                             "arrays is not supported by the MPI backend")
        blocks = recv_bytes.reshape(self.size, total)
        for start in range(0, total, MAX_COUNT):
            stop = min(start + MAX_COUNT, total)
            piece = np.empty((self.size, stop - start), dtype=np.uint8)
            self._collective("Allgather", [([send_bytes[start:stop], byte], [piece, byte])],
                             None, False)
            blocks[:, start:stop] = piece
        if writeback is not None:
            writeback()
        return Work(out) if async_op else out

    def _reduce_scatter(self, r: Request) -> Any:
        x, adapter, dtype, op, out, async_op = r.x, r.adapter, r.dtype, r.op, r.out, r.async_op
        wire, mpi_type, mpi_op = self._reduce_spec(dtype, op)
        rows = x.shape[0] // self.size
        if out is None:
            out = adapter.empty(x, (rows, *x.shape[1:]))
        send, _ = self._buffer(x, adapter, dtype, wire)
        recv, writeback = self._buffer(out, adapter, dtype, wire)
        keyed = _nan_ordered(wire, op)
        if keyed:  # float MIN/MAX: see _order_keys; never change the caller's x
            send = self._order_keys(clone(send), wire, op)
        wire_recv = _int_view(recv) if keyed else recv
        finish = self._finish_reduction(recv, wire_recv if keyed else None, wire, op, writeback)
        block = count(recv)
        if block <= MAX_COUNT:  # (MPI_Reduce_scatter with equal counts: MPICH's nonblocking
            # MPI_Ireduce_scatter_block, what a timeout runs, took 8-11x the blocking call at 512 KiB-1 MiB)
            return self._collective("Reduce_scatter",
                                    [([send, mpi_type], [wire_recv, mpi_type], [block] * self.size, mpi_op)],
                                    out, async_op, finish, (send, recv))
        # Reduce the whole thing in pieces, keep this rank's rows (blocking, even async).
        reduced = clone(send)
        self._collective("Allreduce", [(self._in_place, [chunk, mpi_type], mpi_op)
                                       for chunk in _chunks(reduced)], None, False)
        wire_recv.reshape(-1)[...] = reduced.reshape(-1)[self.rank * block:(self.rank + 1) * block]
        finish()
        return Work(out) if async_op else out


    # -- the rest of the set: byte-moving collectives, and reduce ------------------------

    def _move_bytes(self, x: Any, adapter: ArrayAdapter, result: Any, value: Any, async_op: bool,
                    name: str, arguments: Callable[[Any, Any], tuple[Any, ...]]) -> Any:
        """The MPI collective ``name``, moving raw bytes from ``x`` into ``result`` (either may
        be ``None`` on ranks that send or receive nothing), through :meth:`_collective`:
        returns ``value`` once it has completed, or a handle whose ``wait()`` does.
        ``arguments(send_bytes, recv_bytes)`` are the call's arguments; their byte counts and
        displacements (C ints) lie within ``x`` and ``result``, whose sizes are checked."""
        if adapter is _NUMPY and not async_op and (x is None or (x.flags.c_contiguous and x.nbytes <= MAX_COUNT)) \
                and (result is None or result.nbytes <= MAX_COUNT):
            # Host memory as it is (results and out= are contiguous): the MPI call as raw
            # mpi4py makes it, with no staging to plan.
            comm = self._comm
            self._call(getattr(comm, name), getattr(comm, _nonblocking(name)), *arguments(x, result))
            return value
        if (x is not None and nbytes(x) > MAX_COUNT) or (result is not None and nbytes(result) > MAX_COUNT):
            raise ValueError(f"{self.context.call[0]} of more than 2**31-1 bytes per message is not "
                             "supported by the MPI backend; split the array")
        kept, send, _ = (None, None, None) if x is None else self._bytes(x, adapter)
        kept_result, recv, writeback = (None, None, None) if result is None else self._bytes(result, adapter)
        return self._collective(name, [arguments(send, recv)], value, async_op, writeback, (kept, kept_result))

    def _gather(self, r: Request) -> Any:
        x, adapter, dst, out, async_op = r.x, r.adapter, r.root, r.out, r.async_op
        here = self.rank == dst
        result = (out if out is not None else adapter.empty(x, (self.size, *x.shape))) if here else None
        byte = self._byte
        return self._move_bytes(x, adapter, result, result, async_op, "Gather", lambda send, recv: (
            [send, byte], [recv, byte] if here else None, dst))

    def _scatter(self, r: Request) -> Any:
        x, adapter, src, out, async_op = r.x, r.adapter, r.root, r.out, r.async_op
        here = self.rank == src
        result = out if out is not None else adapter.empty(x, tuple(x.shape[1:]))
        byte = self._byte
        return self._move_bytes(x if here else None, adapter, result, result, async_op, "Scatter",
                                lambda send, recv: ([send, byte] if here else None, [recv, byte], src))

    def _all_to_all(self, r: Request) -> Any:
        x, adapter, out, async_op = r.x, r.adapter, r.out, r.async_op
        result = out if out is not None else adapter.empty(x, tuple(x.shape))
        byte = self._byte
        return self._move_bytes(x, adapter, result, result, async_op, "Alltoall",
                                lambda send, recv: ([send, byte], [recv, byte]))

    def _all_gather_v(self, r: Request) -> Any:
        """The v-collective (MPI_Allgatherv); where the round gathers, :class:`~.mpi_uneven.Uneven`
        runs first (the rows the counts' round carried or marked) and this for what it does not take."""
        x, adapter, counts, out, async_op = r.x, r.adapter, r.extra, r.out, r.async_op
        result = out if out is not None else adapter.empty(x, (sum(counts), *x.shape[1:]))
        row = row_bytes(x)
        sizes = [n * row for n in counts]  # (mpi4py lays them out back to back)
        byte = self._byte
        return self._move_bytes(x, adapter, result, (result, counts), async_op, "Allgatherv",
                                lambda send, recv: ([send, byte], [recv, sizes, byte]))

    def _all_to_all_v(self, r: Request) -> Any:
        """The v-collective (MPI_Alltoallv); see :meth:`_all_gather_v`."""
        x, adapter, splits, out, async_op = r.x, r.adapter, r.extra, r.out, r.async_op
        received = [row[self.rank] for row in splits]
        result = out if out is not None else adapter.empty(x, (sum(received), *x.shape[1:]))
        row = row_bytes(x)
        send_sizes = [n * row for n in splits[self.rank]]  # (laid out back to back)
        recv_sizes = [n * row for n in received]
        byte = self._byte
        return self._move_bytes(x, adapter, result, result, async_op, "Alltoallv",
                                lambda send, recv: ([send, send_sizes, byte], [recv, recv_sizes, byte]))

    def _reduce(self, r: Request) -> Any:
        x, adapter, dtype, op, dst, async_op = r.x, r.adapter, r.dtype, r.op, r.root, r.async_op
        wire, mpi_type, mpi_op = self._reduce_spec(dtype, op)
        here = self.rank == dst
        buf, writeback = self._buffer(x, adapter, dtype, wire)
        keys = None
        if _nan_ordered(wire, op):  # float MIN/MAX: integer order keys (see _order_keys)
            keys = self._order_keys(buf if here else clone(buf), wire, op)  # x stays off dst
        data = buf if keys is None else keys
        IN_PLACE = self._MPI.IN_PLACE
        calls = [(IN_PLACE, [chunk, mpi_type], mpi_op, dst) if here else
                 ([chunk, mpi_type], None, mpi_op, dst) for chunk in _chunks(data)]
        # Off dst nothing follows: the other ranks' x is left as it was.
        finish = self._finish_reduction(buf, keys, wire, op, writeback) if here else _nothing
        return self._collective("Reduce", calls, x, async_op, finish, data)

    def _send(self, r: Request) -> Work | None:
        x, adapter, dst, tag, async_op = r.x, r.adapter, r.root, r.extra, r.async_op
        buf, data, _ = self._bytes(x, adapter)  # (buf, a staging copy, lives as long as the request)
        work: Work | None = self._collective("Send", [([data, self._byte], dst, tag)], None,
                                             async_op, None, buf)
        return work

    def _recv(self, r: Request) -> Work | None:
        x, adapter, dtype, src, tag, async_op = r.x, r.adapter, r.dtype, r.root, r.extra, r.async_op
        buf, data, writeback = self._bytes(x, adapter)
        status = self._MPI.Status()
        spec = [data, self._byte]
        if self._device_memory:
            ((spec,),) = hand_over([(spec,)])
        request = self._comm.Irecv(spec, self._MPI.ANY_SOURCE if src is None else src, tag)

        def finish() -> None:
            work.source = sender = status.Get_source()  # (any source: MPI's status says who sent)
            # MPI refuses a longer message (MPI_ERR_TRUNCATE) but takes a shorter one.
            got, holds = status.Get_count(self._byte), len(data)
            if got != holds:
                raise short_message(sender, tag, got, holds, x.shape, dtype)
            if writeback is not None:
                writeback()

        work = _Request(x, self._MPI, [request], finish, self._complete_request,
                        self.context.call, statuses=[status], buffers=buf)
        if async_op:
            return work
        work.wait()
        return None


    def _split(self, color: int | None, key: int) -> MPITransport | None:
        MPI = self._MPI
        # MPI has no nonblocking split: once every rank is through this barrier, Split
        # (and the new communicator's Dup) completes without waiting on anyone.
        self._barrier()
        new = self._comm.Split(MPI.UNDEFINED if color is None else color, key)
        if new == MPI.COMM_NULL:
            return None
        try:
            child = type(self)(new, local_rank=self.local_rank)  # a ULFM parent's child is ULFM too
            child._poll = self._poll
            return child
        finally:
            new.Free()  # MPITransport keeps its own Dup


class MPICommunicator(Communicator):
    """A communicator over an ``mpi4py.MPI.Comm`` (by default a duplicate of COMM_WORLD)."""

    transport_class = MPITransport
    _transport: MPITransport

    def __init__(self, comm: Any = None, local_rank: int | None = None, *,
                 timeout: Any = None) -> None:
        """``comm``: the mpi4py communicator to duplicate (default COMM_WORLD).
        ``timeout``: seconds (or timedelta) per blocking collective; ``None`` reads
        ``COLLECTIVES_TIMEOUT``; 0 means none."""
        super().__init__(MPITransport(comm, local_rank), timeout=timeout)

    @property
    def mpi_comm(self) -> Any:
        """The underlying ``mpi4py.MPI.Comm`` (for mixing raw mpi4py calls)."""
        return self._transport.mpi_comm

    @property
    def cuda_aware(self) -> bool:
        """Whether CUDA arrays go to MPI directly (else staged through host memory)."""
        return self._transport.cuda_aware


# Bound once: on Python 3.11 every ``ReduceOp.X`` attribute read costs ~0.15 us.
_AVG = ReduceOp.AVG
_NUMPY = arrays.NUMPY


#: MPI's name of the call of each collective's fast path (backends/mpi_moves.py): the blocking
#: call; its nonblocking form is the same name with an I.
_MPI_NAMES = {calls.ALL_REDUCE: "Allreduce", calls.BROADCAST: "Bcast", calls.REDUCE: "Reduce",
              calls.REDUCE_SCATTER: "Reduce_scatter", calls.ALL_GATHER: "Allgather", calls.GATHER: "Gather",
              calls.SCATTER: "Scatter", calls.ALL_TO_ALL: "Alltoall"}


def _new_numpy(buf: Any, shape: tuple[int, ...], out: Any) -> tuple[Any, Any]:
    """A fast path's result for a numpy ``buf`` (``out=`` where given), and its buffer."""
    if out is None:
        out = np.empty(shape, dtype=buf.dtype)
    return out, out


def _new_tensor(MPI: Any, dtype: str) -> Callable[[Any, tuple[int, ...], Any], tuple[Any, Any]]:
    """A fast path's results for the numpy view of a CPU tensor of ``dtype``: a tensor (or the
    caller's ``out=``), and its memory by address (see tensor_address)."""
    torch = sys.modules["torch"]
    empty, torch_dtype, cpu = torch.empty, getattr(torch, dtype), torch.device("cpu")

    def new(buf: Any, shape: tuple[int, ...], out: Any) -> tuple[Any, Any]:
        if out is None:
            # On the CPU whatever torch's default device; size= (a keyword) and a device object
            # cost 1.0 us where a positional tuple and "cpu" cost 1.6.
            out = empty(size=shape, dtype=torch_dtype, device=cpu)
        return out, tensor_address(MPI, out)
    return new



def _chunks(buf: Any) -> list[Any]:
    """``buf`` as pieces of at most MAX_COUNT elements (views, not copies)."""
    total = count(buf)
    if total <= MAX_COUNT:
        return [buf]
    flat = buf.reshape(-1)
    return [flat[start:start + MAX_COUNT] for start in range(0, total, MAX_COUNT)]
