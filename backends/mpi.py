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

Rank failure: an uncaught exception on one rank would leave the others waiting
in a collective forever, so ``collectives.init()`` under an MPI launcher installs a
``sys.excepthook`` that prints the rank and calls ``MPI_Abort`` (see
:mod:`collectives.diagnostics.process_hooks`); mpiexec then ends every rank.
"""

from __future__ import annotations

import functools
import math
import sys
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from collectives import arrays
from collectives.arrays import ArrayAdapter
from collectives.calls import ALL_REDUCE, BROADCAST, FAREWELL_TAG, Request
from collectives.communicator import Communicator
from collectives.diagnostics import _exits, process_hooks
from collectives.errors import BackendUnavailable, CollectiveError
from collectives.launcher import LaunchInfo, check_world_size
from collectives.ops import ALLOWED_OPS, ReduceOp
from collectives.polling import wait_until
from collectives.transport import Transport
from collectives.work import Work

from . import _float_order
from ._buffers import (
    INT_OF_WIDTH,
    clone,
    count,
    divide_,
    flat_bytes,
    itemsize,
    nbytes,
    row_bytes,
    stage,
)
from .mpi_buffers import (  # noqa: F401  (cupyx_empty_pinned: also importable from here)
    bind_device,
    cupyx_empty_pinned,
    device_buffer,
    hand_over,
    host_view,
    mpi_cuda_aware,
)
from .mpi_library import float16_datatype, library_version, saturates_small_integer_sums, wrapping_wire
from .mpi_requests import (  # noqa: F401  (the poll constants: also importable from here)
    BUSY_POLL_SECONDS,
    FAST_POLLS,
    POLL,
    POLL_INTERVAL,
    SPIN_POLL,
    SPIN_SECONDS,
    _Request,
    poll_policy,
)

#: Elements per MPI call: MPI counts are C ints unless the library has large counts.
MAX_COUNT = 2**31 - 1

#: The MPI thread level MPI is initialized at when this backend initializes it: mpi4py's
#: default, which this backend leaves as it is (mpi4py.rc is the user's to set).
#: Measured with the MPICH wheel on 2 ranks of one node (docs/performance.md): "single"
#: (and funneled/serialized) lets MPICH use its shared-memory collectives, ~1 us faster
#: below ~4 KiB, but 2.5-7x slower from 64 KiB up; "multiple" costs ~1 us at 4 B and wins
#: everywhere else, and it is what threaded callers need.
THREAD_LEVEL = "multiple"


def import_mpi() -> Any:
    """mpi4py's MPI module, or ``BackendUnavailable`` saying how to install it.

    Importing it initializes MPI at mpi4py's thread level (:data:`THREAD_LEVEL` unless the
    program chose another: ``MPI4PY_RC_THREAD_LEVEL`` in the environment, or
    ``mpi4py.rc.thread_level`` set before this call). A program that imported
    ``mpi4py.MPI`` itself keeps the level it got.
    """
    try:
        from mpi4py import MPI  # noqa: PLC0415
    except ImportError as error:
        raise BackendUnavailable(
            f"backend 'mpi' needs mpi4py and an MPI library ({error}); "
            "install them with: pip install 'pycollectives[mpi,mpich]' (only [mpi] where the cluster has an MPI)"
        ) from error
    return MPI




def install_abort_on_uncaught_exception(MPI: Any) -> None:
    """Make an uncaught exception (or an uncaught ``sys.exit(n)``, n not 0) on this rank end
    the whole MPI job with ``MPI_Abort`` (once per process). ``collectives.init()`` installs
    it for jobs started by an MPI launcher; see :mod:`collectives.diagnostics.process_hooks`."""
    _exits.record_exit_calls()
    process_hooks._abort_mpi_on_uncaught_exception()


class MPITransport(Transport):
    """The transport over an ``mpi4py.MPI.Comm`` (by default a duplicate of COMM_WORLD)."""

    backend = "mpi"

    def __init__(self, comm: Any = None, local_rank: int | None = None) -> None:
        """``comm``: the mpi4py communicator to duplicate (default COMM_WORLD)."""
        MPI = import_mpi()
        self._MPI = MPI
        self._comm = (MPI.COMM_WORLD if comm is None else comm).Dup()
        #: How this communicator waits for a request (see poll_policy); a split inherits it.
        self._poll = POLL
        if local_rank is None or comm is None:  # the world's: how many ranks share this node
            node = self._comm.Split_type(MPI.COMM_TYPE_SHARED)
            local_rank = node.Get_rank() if local_rank is None else local_rank
            self._poll = poll_policy(node.Get_size())
            node.Free()
        super().__init__(self._comm.Get_rank(), self._comm.Get_size(), local_rank)
        # Requests abandoned by a timeout: MPI may still write their buffers, so they live on.
        self._abandoned: list[Any] = []
        float16 = float16_datatype(MPI)
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
        # Whether a call of this communicator has handed MPI device memory (see hand_over).
        self._device_memory = False
        #: Open MPI saturates small-integer SUM/PROD: those go through int32 (backends/mpi_library.py).
        self._saturates = saturates_small_integer_sums(library_version(MPI))
        # The fast path's table: dtype -> {op: (MPI datatype, MPI op)} for every allowed
        # pair MPI reduces as it is: no staging through float32, and not the float MIN/MAX
        # that go through order keys (NaN). Nested: a (str, ReduceOp) tuple key costs
        # twice as much to look up.
        self._native = {dtype: {op: (self._types[dtype], self._reduce_spec(dtype, op)[2])
                                for op in allowed
                                if dtype in self._types and self._wire_dtype(dtype, op) == dtype
                                and not _nan_ordered(dtype, op)}
                        for dtype, allowed in ALLOWED_OPS.items()}
        self._in_place = MPI.IN_PLACE
        self._byte = MPI.BYTE
        # The default check's word (see _agree_word): one int64, reduced in place, through a
        # persistent MPI_Allreduce_init where the library has them (collective: every rank
        # makes it here).
        self._word = np.zeros(1, dtype=np.int64)
        self._word_args = (MPI.IN_PLACE, [self._word, MPI.INT64_T], MPI.BAND)
        try:
            self._word_request: Any = self._comm.Allreduce_init(*self._word_args)
        except (NotImplementedError, AttributeError, MPI.Exception):  # MPI < 4
            self._word_request = None

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

    def _wire_dtype(self, dtype: str, op: ReduceOp) -> str:
        """The dtype MPI reduces in: float32 for the float types MPI lacks, except for MIN/MAX,
        which reduce a float's order keys (integers of its own width); int32 for the
        small-integer SUM/PROD a saturating library (Open MPI) would get wrong."""
        if _nan_ordered(dtype, op):
            return dtype
        if dtype == "bfloat16" or (dtype == "float16" and not self._float16_native):
            return "float32"
        return wrapping_wire(dtype, op, self._saturates) or dtype

    def _buffer(self, x: Any, adapter: ArrayAdapter, dtype: str | None, wire: str | None = None
                ) -> tuple[Any, Callable[[], None] | None]:
        """A contiguous buffer MPI can read and write, and the copy back into ``x`` if any.

        ``wire`` is the dtype to stage x (of dtype ``dtype``) through, or ``None`` for x's
        bytes as they are. A CPU torch tensor goes to MPI as a numpy view of its memory."""
        if adapter.is_cuda(x):
            self._device_memory = self._device_memory or self.cuda_aware
            return device_buffer(x, adapter, dtype, wire, self.cuda_aware)
        buf, writeback = stage(x, adapter, dtype, wire)
        if adapter is arrays.TORCH:
            buf = host_view(buf)
        return buf, writeback

    # -- completion with a deadline ------------------------------------------------------

    def _wait(self, request: Any, call: tuple[str, int] | None = None, status: Any = None) -> None:
        """Complete ``request`` within ``timeout`` (none: no deadline), looking for farewells
        while it waits: else :class:`CollectiveTimeout`, or ``PeerLeft`` when a peer left
        before making the call."""
        test = request.Test if status is None else lambda: request.Test(status)
        try:
            done = wait_until(test, math.inf if self.timeout is None else self.timeout, self._poll,
                              check=lambda: self.context.hear_farewells(call))
        except CollectiveError:
            self._abandoned.append(request)  # MPI may still write its buffers
            raise
        if not done:
            self._abandoned.append(request)
            raise self.context.timeout_error(call=call)

    def _complete_request(self, request: Any, call: tuple[str, int] | None, status: Any) -> None:
        """A handle's way to complete one of its requests: ``Wait`` with no timeout, else
        :meth:`_wait` (under the deadline, listening for farewells)."""
        if self.timeout is None:
            request.Wait(status)
        else:
            self._wait(request, call, status)

    def _call(self, blocking: Any, nonblocking: Any, *args: Any) -> None:
        """One MPI call, blocking: the blocking call when there is no timeout, else the
        nonblocking one completed against the deadline (a small one is complete at its
        first test: no _wait frame then)."""
        if self.timeout is None:
            blocking(*args)
        else:
            request = nonblocking(*args)
            if not request.Test():
                self._wait(request)

    def _order_keys(self, buf: Any, wire: str, op: ReduceOp) -> Any:
        """For MIN/MAX of floats: ``buf``'s memory as integer order keys (encoded in place),
        which MPI's integer MIN/MAX reduce exactly and with NaN propagated; else ``None``.

        MPI's float MIN/MAX compare with ``<`` and lose NaNs (see backends/_float_order.py).
        """
        if not _nan_ordered(wire, op):
            return None
        keys = _int_view(buf)
        _float_order.encode(keys, op, wire)
        return keys

    def _reduce_spec(self, dtype: str, op: ReduceOp) -> tuple[str, Any, Any]:
        """(wire dtype, MPI datatype, MPI op) of a reduction; float MIN/MAX reduce integer
        order keys (see _order_keys)."""
        wire = self._wire_dtype(dtype, op)
        mpi_op = self._bool_ops[op] if dtype == "bool" else self._ops[op]
        if _nan_ordered(wire, op):
            return wire, self._types[INT_OF_WIDTH[_float_order.FLOAT_BITS[wire] // 8]], mpi_op
        return wire, self._types[wire], mpi_op

    # -- collectives --------------------------------------------------------------------

    def _fast_path(self, call: Any, adapter: ArrayAdapter, dtype: str,
                   op: ReduceOp | None) -> Callable[[Any, Any], bool] | None:
        """all_reduce (of a dtype x op MPI reduces as it is) and broadcast of a contiguous host
        array in as few steps as raw mpi4py takes: its memory (a CPU tensor's numpy view, as a
        raw caller passes it) is the buffer, bound with the MPI datatype and op once per kind."""
        comm, in_place, size, most, one_call = self._comm, self._in_place, self.size, MAX_COUNT, self._call
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
                one_call(reduce, start_reduce, in_place, [buf, mpi_type], mpi_op)
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
                one_call(bcast, start_bcast, [buf, byte], root)
                return True
            return broadcast
        return None

    def _agree_word(self, word: int) -> int:
        """One MPI_Allreduce (BAND) of one int64, completed by polling, also without a timeout (a
        peer's farewell is heard while it waits). Persistent (MPI_Allreduce_init, started per
        call) where the library has it: at 2 ranks on one node 1.95 us a call, where
        MPI_Iallreduce took 2.47 and MPI_Allreduce 2.94 (and a 2-element reduction 3.3)."""
        self._word[0] = word
        request = self._word_request
        if request is not None:
            request.Start()
        else:
            request = self._comm.Iallreduce(*self._word_args)
        test = request.Test
        for _ in range(FAST_POLLS):  # the peers' words land within microseconds: no frame more
            if test():
                return int(self._word[0])
        self._wait(request)
        return int(self._word[0])

    def _tell_peers_left(self, how: int) -> None:
        """A small message to every peer on this communicator (tag FAREWELL_TAG): [this
        communicator's name hash, calls, how]. Eager: the sends complete without the peers; ones
        that did not within a moment are left to MPI. A peer that closes the communicator too
        never receives it, and MPI may give the freed communicator's context to a new one: the
        name (unique in the split tree) tells such a farewell from one meant for the new one."""
        MPI = self._MPI
        if MPI.Is_finalized() or self._comm == MPI.COMM_NULL:
            return
        word = self._farewell_word = np.array([self._name_hash, self.context.call[1], how], dtype=np.int64)
        requests = [self._comm.Isend([word, MPI.INT64_T], peer, FAREWELL_TAG)
                    for peer in range(self.size) if peer != self.rank]
        if not wait_until(lambda: MPI.Request.Testall(requests), 0.2, self._poll):
            for request in requests:
                if request != MPI.REQUEST_NULL:
                    request.Free()

    def _peers_left(self) -> list[tuple[int, int, int]]:
        MPI, status, found = self._MPI, self._MPI.Status(), []
        while self._comm.Iprobe(MPI.ANY_SOURCE, FAREWELL_TAG, status):
            word, peer = np.zeros(3, dtype=np.int64), status.Get_source()
            self._comm.Recv([word, MPI.INT64_T], peer, FAREWELL_TAG)
            if int(word[0]) == self._name_hash:  # (else a farewell to a freed communicator)
                found.append((peer, int(word[1]), int(word[2])))
        return found

    @property
    def _name_hash(self) -> int:
        return zlib.crc32(self.context.name.encode()) & 0x7FFFFFFF

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
        if adapter is _NUMPY and not async_op and x.flags.c_contiguous and x.nbytes <= MAX_COUNT:
            # The common case in as few steps as raw mpi4py takes (out= is written directly).
            if out is None:
                out = np.empty((self.size, *x.shape), dtype=x.dtype)
            self._call(self._comm.Allgather, self._comm.Iallgather, [x, self._byte], [out, self._byte])
            return out
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
        if adapter is _NUMPY and not async_op:
            spec = self._native[dtype].get(op)
            if spec is not None and x.flags.c_contiguous and x.size // self.size <= MAX_COUNT:
                if out is None:
                    out = np.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype)
                self._call(self._comm.Reduce_scatter_block, self._comm.Ireduce_scatter_block,
                           [x, spec[0]], [out, spec[0]], spec[1])
                if op is _AVG:
                    out /= self.size
                return out
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
        if block <= MAX_COUNT:
            return self._collective("Reduce_scatter_block",
                                    [([send, mpi_type], [wire_recv, mpi_type], mpi_op)],
                                    out, async_op, finish, (send, recv))
        # Reduce the whole thing in pieces, keep this rank's rows (blocking, even async).
        reduced = clone(send)
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
        nonblocking call waited against the deadline; with none, the blocking call.
        Device memory is made ready for MPI first (:func:`hand_over`)."""
        if self._device_memory:
            calls = hand_over(calls)
        if async_op:
            start = getattr(self._comm, _nonblocking(name))
            return _Request(result, self._MPI, [start(*args) for args in calls],
                            finish or _nothing, self._complete_request,
                            self.context.call, buffers=buffers)
        run, start = getattr(self._comm, name), getattr(self._comm, _nonblocking(name))
        for args in calls:
            self._call(run, start, *args)
        if finish is not None:
            finish()
        return result

    def _finish_reduction(self, buf: Any, keys: Any, wire: str, op: ReduceOp,
                          writeback: Callable[[], None] | None) -> Callable[[], None]:
        """What follows a reduction into ``buf`` (of dtype ``wire``): order keys decoded, AVG
        divided, the staging copy written back."""
        def finish() -> None:
            if keys is not None:
                _float_order.decode(keys, wire)
            if op is _AVG:
                divide_(buf, self.size)
            if writeback is not None:
                writeback()
        return finish

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
        send = None if x is None else self._buffer(x, adapter, None)[0]
        recv, writeback = (None, None) if result is None else self._buffer(result, adapter, None)
        call = arguments(None if send is None else flat_bytes(send), None if recv is None else flat_bytes(recv))
        return self._collective(name, [call], value, async_op, writeback, (send, recv))

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
        x, adapter, counts, out, async_op = r.x, r.adapter, r.extra, r.out, r.async_op
        result = out if out is not None else adapter.empty(x, (sum(counts), *x.shape[1:]))
        row = row_bytes(x)
        sizes = [n * row for n in counts]  # (mpi4py lays them out back to back)
        byte = self._byte
        return self._move_bytes(x, adapter, result, (result, counts), async_op, "Allgatherv",
                                lambda send, recv: ([send, byte], [recv, sizes, byte]))

    def _all_to_all_v(self, r: Request) -> Any:
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
        buf, _ = self._buffer(x, adapter, None)  # (a staging copy lives as long as the request)
        work: Work | None = self._collective("Send", [([flat_bytes(buf), self._byte], dst, tag)], None,
                                             async_op, None, buf)
        return work

    def _recv(self, r: Request) -> Work | None:
        x, adapter, dtype, src, tag, async_op = r.x, r.adapter, r.dtype, r.root, r.extra, r.async_op
        buf, writeback = self._buffer(x, adapter, None)
        data = flat_bytes(buf)
        status = self._MPI.Status()
        spec = [data, self._byte]
        if self._device_memory:
            ((spec,),) = hand_over([(spec,)])
        request = self._comm.Irecv(spec, src, tag)

        def finish() -> None:
            # MPI refuses a longer message (MPI_ERR_TRUNCATE) but takes a shorter one.
            got = status.Get_count(self._byte)
            if got != count(data):
                raise ValueError(f"recv from rank {src} (tag {tag}) got {got} bytes, but x "
                                 f"holds {count(data)} (shape {tuple(x.shape)}, {dtype}): the "
                                 "sender's array has another shape or dtype")
            if writeback is not None:
                writeback()

        work = _Request(x, self._MPI, [request], finish, self._complete_request,
                        self.context.call, statuses=[status], buffers=buf)
        if async_op:
            return work
        work.wait()
        return None

    def _barrier(self) -> None:
        self._collective("Barrier", [()], None, False)

    def _split(self, color: int | None, key: int) -> MPITransport | None:
        MPI = self._MPI
        # MPI has no nonblocking split: once every rank is through this barrier, Split
        # (and the new communicator's Dup) completes without waiting on anyone.
        self._barrier()
        new = self._comm.Split(MPI.UNDEFINED if color is None else color, key)
        if new == MPI.COMM_NULL:
            return None
        try:
            child = MPITransport(new, local_rank=self.local_rank)
            child._poll = self._poll
            return child
        finally:
            new.Free()  # MPITransport keeps its own Dup

    def _close(self) -> None:
        MPI = self._MPI
        if not MPI.Is_finalized() and self._comm != MPI.COMM_NULL:
            if self._word_request is not None and not self.context.broken:  # (an active one stays)
                self._word_request.Free()
            self._comm.Free()


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


def _nothing() -> None:
    pass


def _nan_ordered(wire: str, op: ReduceOp) -> bool:
    return op in _float_order.NAN_ORDERED_OPS and wire in _float_order.FLOAT_BITS


def _int_view(buf: Any) -> Any:
    """``buf``'s memory as signed integers of the same width (numpy, CuPy or torch)."""
    name = INT_OF_WIDTH[itemsize(buf)]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        return buf.view(getattr(torch, name))
    return buf.view(name)


@functools.cache
def _nonblocking(name: str) -> str:
    """mpi4py's name of the nonblocking form of a collective: Gather -> Igather."""
    return "I" + name[0].lower() + name[1:]


def _chunks(buf: Any) -> list[Any]:
    """``buf`` as pieces of at most MAX_COUNT elements (views, not copies)."""
    total = count(buf)
    if total <= MAX_COUNT:
        return [buf]
    flat = buf.reshape(-1)
    return [flat[start:start + MAX_COUNT] for start in range(0, total, MAX_COUNT)]
