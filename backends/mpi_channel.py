"""One MPI communicator as the MPI backend's channel: what every collective of
:class:`collectives.backends.mpi.MPITransport` goes through.

:class:`MPIChannel` holds the duplicated ``mpi4py`` communicator and its tables (the MPI
datatype of each dtype, the MPI op of each reduce op, the dtype x op pairs MPI reduces as
they are), makes the buffers MPI reads and writes (staging where MPI lacks a dtype, device
memory handed over), makes one MPI call blocking, under the deadline or as a handle, reduces
through the wire dtype and order keys and finishes a reduction, and carries the default
check's word and the farewells. The collectives themselves, the fast path and the split are
the subclass's, in backends/mpi.py.

Imports: the interface (arrays, calls, errors, ops, polling, transport, work) and the MPI
backend's helper modules (_buffers, _float_order, mpi_buffers, mpi_carried, mpi_library, mpi_requests);
never backends/mpi.py.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from collectives import arrays, farewell
from collectives.arrays import ArrayAdapter
from collectives.calls import BARRIER_TAG, FAREWELL_TAG
from collectives.errors import BackendUnavailable, CollectiveError
from collectives.info import warn_if_not_compiled
from collectives.ops import ALLOWED_OPS, ReduceOp
from collectives.polling import wait_until
from collectives.transport import Transport

from . import _float_order
from ._buffers import INT_OF_WIDTH, divide_, flat_bytes, itemsize, stage
from .mpi_buffers import device_buffer, hand_over, host_view, mpi_cuda_aware, tensor_address
from .mpi_carried import WORD_BITS, carried_path, compiled_carrier
from .mpi_library import (
    float16_datatype,
    library_version,
    persistent_allgather_works,
    saturates_small_integer_sums,
    wrapping_wire,
)
from .mpi_requests import FAST_POLLS, POLL, _Request, poll_policy
from .mpi_round import Round, compiled_module
from .mpi_staged import UNEVEN_BYTES


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


class MPIChannel(Transport):
    """The MPI communicator a transport moves data over (a duplicate of ``comm``, by default of
    COMM_WORLD), its tables, buffers and calls."""

    backend = "mpi"
    _marks_fast_path = True  # (see _round: every rank on the fast path, for _staged)
    #: The check's round (backends/mpi_round.py): its blocks, requests and the switch of block.
    round: Round
    #: Whether the fast paths may keep persistent requests (see _staged): the library has MPI-4's
    #: persistent collectives (ULFMTransport turns them off).
    _persistent: bool
    _says_waiting = True  # (_agree_word, _barrier_waiting: after their polls)

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
        # The default check's round (see _round). On up to COUNTS_RANKS ranks an MPI_Allgather of
        # one block per rank: the check word, a row of size + 1 int64 (the uneven collectives'
        # counts, see _agree_counts), the rank's want and a payload (a small call's x, see
        # backends/mpi_carried.py), in two sizes (backends/mpi_round.py); on more ranks an
        # MPI_Allreduce (BAND) of the word alone. Persistent (MPI_Allgather_init,
        # MPI_Allreduce_init: collective, every rank makes it here) where the library has them.
        ranks = self._comm.Get_size()
        self._counts_with_check = 1 < ranks <= COUNTS_RANKS
        #: Whether the fast paths stage their gathering calls too (all_gather, gather, scatter,
        #: all_to_all, reduce_scatter; see _staged): not where the library's persistent all_gather
        #: is wrong (persistent_allgather_works).
        self._stages_gathers = persistent_allgather_works(library_version(MPI))
        # (the compiled Round where built: collectives.backends._round_c, setup.py's COMPILED; a
        # communicator keeps its form whatever COLLECTIVES_COMPILED says later)
        compiled = compiled_module()
        kind = Round if compiled is None else compiled.Round
        self.round = kind(self._comm, MPI, ranks, self._counts_with_check, self._stages_gathers, self._wait_saying)
        self._persistent = self.round.persistent
        # The word's and the counts' rounds are the Round's own: the check calls them with no frame
        # of the channel's between.
        self._agree_word = self.round.agree_word  # type: ignore[method-assign]
        self._agree_counts = self.round.agree_counts  # type: ignore[method-assign,assignment]
        # The fast paths' persistent requests of small calls (see _staged): one table per kind
        # of call (row, dtype, op), {shape (and root): (request, its staging array)}.
        self._staged_tables: dict[Any, dict[Any, tuple[Any, Any]]] = {}
        self._unheard: set[int] = set()  # once closed: the peers whose farewell has not arrived
        # The compiled round where it was built (None: the Python forms).
        self._compiled_round: Any = None if compiled is None else self.round
        # (the carried calls compiled beside it: backends/mpi_carried.py's Carrier in C)
        carrier = None if compiled is None else compiled_carrier()
        self._carried_path_of = carried_path if carrier is None else carrier.carried_path
        warn_if_not_compiled()  # (once per process, where they were not built)

    @property
    def _everyone_fast(self) -> bool:
        """Whether every rank runs the running call on its fast path, as its check's round said
        (wire.FAST_BIT; False without one): only then a staged persistent request (see _staged)."""
        return self.round.everyone_fast

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

    def _bytes(self, x: Any, adapter: ArrayAdapter) -> tuple[Any, Any, Callable[[], None] | None]:
        """``x``'s memory as flat bytes MPI can read and write: (what keeps it alive while MPI
        uses it, the bytes, the copy back into ``x`` or ``None``). A contiguous CPU tensor by
        address (:func:`~.mpi_buffers.tensor_address`), else through :meth:`_buffer`."""
        if adapter is arrays.TORCH and x.is_cpu and x.is_contiguous():
            return x, tensor_address(self._MPI, x), None
        buf, writeback = self._buffer(x, adapter, None)
        return buf, flat_bytes(buf), writeback

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
        nonblocking one completed against the deadline (a small one is complete within its
        first FAST_POLLS tests: no _wait frame then)."""
        if self.timeout is None:
            blocking(*args)
        else:
            request = nonblocking(*args)
            test = request.Test
            for _ in range(FAST_POLLS):
                if test():
                    return
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

    def _agree_word(self, word: int, waiting: Callable[[], None] | None = None) -> int:
        """The BAND of every rank's ``word``, from one :meth:`_round` (see there). (Each channel's
        ``__init__`` puts the Round's own ``agree_word``, the same call, in its place.)"""
        return self._round(word, waiting) & WORD_BITS

    def _round(self, word: int, waiting: Callable[[], None] | None = None) -> int:
        """The default check's one small collective, completed by polling, also without a timeout
        (a peer's farewell is heard while it waits): the bitwise AND of every rank's ``word``
        (an int64; bit 63 set: this rank's x travels in its block, see backends/mpi_carried.py).
        Up to COUNTS_RANKS ranks, an MPI_Allgather of every rank's block (the word, the uneven
        collectives' counts, a small call's x): at 2 ranks on one node 0.73 us a call with a
        block of 56 bytes, 0.82 with the 1080 of CARRY_BYTES (MPI_Start and tests, in a loop).
        More ranks: an MPI_Allreduce (BAND) of the word. ``waiting()`` runs when the fast polls
        did not see it complete. The Round then knows whether every rank set bit 63 of its word
        (``_everyone_fast``)."""
        return self.round.run(word, waiting)

    def _wait_saying(self, request: Any, waiting: Callable[[], None] | None) -> None:
        """:meth:`_wait` for ``request`` once the fast polls did not see it complete; with
        ``waiting`` (the monitored barrier's word to rank 0), WAITING_POLLS more tests first (a
        peer a few microseconds behind: no word for it), then ``waiting()``."""
        if waiting is not None:
            test = request.Test
            for _ in range(WAITING_POLLS):
                if test():
                    return
            waiting()
        self._wait(request)

    @property
    def _uneven_bytes(self) -> int:  # type: ignore[override]
        """An uneven call's host x of at most this many bytes marks its word in the counts' round
        (bit 63): carried in its block where every rank's fits there, else, every rank's marked,
        moved by a staged request (backends/mpi_uneven.py), which needs the round's blocks and
        persistent gathering requests (not MPI < 4, ULFM, or Intel MPI's wrong persistent
        all_gather): without them, the block's payload."""
        fixed = self._uneven_bytes_fixed
        return fixed if fixed >= 0 else self.round.carry_bytes

    @property
    def _uneven_bytes_fixed(self) -> int:  # type: ignore[override]
        """UNEVEN_BYTES where the staged requests move what the payload does not take (the round
        gathers blocks, with persistent requests, and the library's persistent all_gather is
        right: none of which changes once the transport is made), else -1: the round's payload,
        which changes with its block."""
        staged = self.round.gathers and self._persistent and self._stages_gathers
        return UNEVEN_BYTES if staged else -1

    @property
    def _carry_bytes(self) -> int:  # type: ignore[override]
        """The payload of the round's next block (see Transport._carry_bytes)."""
        return self.round.carry_bytes

    def _carried_path(self, call: Any, adapter: ArrayAdapter, dtype: str,
                      reduce_op: ReduceOp | None) -> Callable[[Any, Any, Any, Any, int], tuple[int, Any]] | None:
        return self._carried_path_of(self, call, dtype, reduce_op, adapter is not arrays.NUMPY)

    def _agree_counts(self, word: int, row: list[int], view: Any = None) -> tuple[int, list[list[int]], Any]:
        """:meth:`_agree_word` with this rank's ``row`` (and ``view``, x's bytes, if given) in its
        block: every rank's row in rank order, and every rank's x where every rank carried it.
        (Each channel's ``__init__`` puts the Round's own bound method in its place, the same call
        without this frame: this is what the class says the Transport method is.)"""
        return self.round.agree_counts(word, row, view)

    def _tell_peers_left(self, how: int) -> None:
        """A small message to every peer on this communicator (tag FAREWELL_TAG): [this
        communicator's name hash, calls, how, pid, host] (the last two: see
        farewell.wait_for_departed). Eager: the sends complete without the peers; ones
        that did not within a moment are left to MPI. A peer that closes the communicator too
        takes it before it frees the communicator (see :meth:`_free_once_heard`); the name
        (unique in the split tree) still guards against a farewell meant for another one."""
        MPI = self._MPI
        if MPI.Is_finalized() or self._comm == MPI.COMM_NULL:
            return
        word = self._farewell_word = np.array(
            [self._name_hash, self.context.call[1], how, os.getpid(), farewell.host_word()], dtype=np.int64)
        requests = [self._comm.Isend([word, MPI.INT64_T], peer, FAREWELL_TAG)
                    for peer in range(self.size) if peer != self.rank]
        if not wait_until(lambda: MPI.Request.Testall(requests), 0.2, self._poll):
            for request in requests:
                if request != MPI.REQUEST_NULL:
                    request.Free()

    def _peers_left(self) -> list[tuple[int, int, int]]:
        MPI, status, found = self._MPI, self._MPI.Status(), []
        while self._comm.Iprobe(MPI.ANY_SOURCE, FAREWELL_TAG, status):
            word, peer = np.zeros(5, dtype=np.int64), status.Get_source()
            self._comm.Recv([word, MPI.INT64_T], peer, FAREWELL_TAG)
            if int(word[0]) == self._name_hash:  # (the guard: see _tell_peers_left)
                found.append((peer, int(word[1]), int(word[2])))
                farewell.note_departed(int(word[2]), int(word[4]), int(word[3]))
        return found

    @property
    def _name_hash(self) -> int:
        return zlib.crc32(self.context.name.encode()) & 0x7FFFFFFF

    def _barrier(self) -> None:
        self._collective("Barrier", [()], None, False)

    def _barrier_waiting(self, waiting: Callable[[], None]) -> None:
        """MPI_Ibarrier polled as :meth:`_agree_word` polls (the monitored barrier has a timeout),
        ``waiting()`` once this rank waits."""
        request = self._comm.Ibarrier()
        test = request.Test
        for _ in range(FAST_POLLS):
            if test():
                return
        self._wait_saying(request, waiting)

    def _staged(self, kind: Any) -> dict[Any, tuple[Any, Any]] | None:
        """The table of persistent requests of one kind of call (row, dtype, op: what the call
        check compares, whatever the array type), or ``None`` where the library has no
        persistent collectives (MPI < 4; ULFM, whose persistent collectives do not report a
        dead peer as one).

        A small call (up to :data:`STAGED_BYTES`, under a timeout) of a fast path's kind goes
        through a persistent request of its own shape (``MPI_Allreduce_init``, ... on a staging array
        kept for it): the data is copied in, the request started and completed, the result
        copied out. At 2 ranks on one node ``MPI_Start`` + completion takes 0.65 us where
        ``MPI_Iallreduce`` + ``MPI_Test`` takes 1.6 and ``MPI_Allreduce`` 1.95; the two copies
        cost ~0.2. Only where the call's check round said every rank runs it on its fast path
        (wire.FAST_BIT: an asynchronous or non-contiguous x on one rank and a fast one on another
        would meet a persistent request with a nonblocking call, which MPI does not match; with
        the check off or in debug mode, never). Every rank makes the request at the same call
        (its first call of that kind and shape): the call check has compared kind, dtype, op,
        root and shape by then, and
        each rank's table holds the same shapes, made and dropped (the oldest, past
        :data:`STAGED_SHAPES`) in the same order, also where the ranks pass arrays of different
        types (numpy on one, torch on another: one table per kind of call, not per fast path)."""
        if not self._persistent or self.size == 1:  # (one rank: nothing to wait for)
            return None
        return self._staged_tables.setdefault(kind, {})

    def _stage(self, table: dict[Any, tuple[Any, Any]], key: Any, shape: tuple[int, ...], dtype: Any,
               make: Callable[[Any], Any]) -> tuple[Any, Any]:
        """The (request, staging array) of ``key`` in ``table``: made now (``make(array)``,
        collective), the oldest of the table freed first when it is full."""
        if len(table) >= STAGED_SHAPES:
            request, _ = table.pop(next(iter(table)))
            request.Free()
        stage = np.empty(shape, dtype=dtype)
        entry = table[key] = (make(stage), stage)
        return entry

    def _start(self, request: Any) -> None:
        """Start the persistent ``request`` and complete it by polling under the deadline
        (the fast paths take this route only under a timeout)."""
        request.Start()
        if not request.Test():
            self._wait(request)

    def _run_staged(self, request: Any, src: Any, stage: Any, dst: Any) -> None:
        """A staged call (see :meth:`_staged`): ``src``'s bytes into the first bytes of ``stage``
        (where ``src`` is not None), ``request`` run (:meth:`_start`), the last bytes of ``stage``
        into ``dst`` (where ``dst`` is not None). Compiled as the Round's ``staged`` (the copies,
        MPI_Start and the fast polls in C) where the round is."""
        staged = memoryview(stage).cast("B")
        if src is not None:
            data = memoryview(src).cast("B")
            staged[:len(data)] = data
        self._start(request)
        if dst is not None:
            into = memoryview(dst).cast("B")
            into[:] = staged[len(staged) - len(into):]

    def _close(self) -> None:
        MPI = self._MPI
        if not MPI.Is_finalized() and self._comm != MPI.COMM_NULL:
            if not self.context.broken:  # (an active one stays: MPI may still use it)
                self.round.free()
                for table in self._staged_tables.values():
                    for request, _ in table.values():
                        request.Free()
            self._staged_tables.clear()
            self._unheard = {peer for peer in range(self.size)
                             if peer != self.rank and not self.context.has_left(peer)}
            _UNFREED[:] = [channel for channel in _UNFREED if not channel._free_once_heard()]
            if not self._free_once_heard():
                _UNFREED.append(self)

    def _free_once_heard(self) -> bool:
        """Free the MPI communicator of this closed channel if every peer's farewell has arrived
        (taken now); whether the channel is done (freed, or given up: below). A farewell left
        unreceived on a freed communicator can be matched on the next one MPI gives the same
        context id: with Open MPI 5 that communicator's first collective then never completes.
        A channel whose peers have not all said farewell yet waits in ``_UNFREED`` (looked at
        again whenever a channel closes); one whose peers never do (they end without it) is
        left to MPI_Finalize, as is one where looking fails (a peer lost: nothing more
        arrives); both count as done."""
        MPI = self._MPI
        if MPI.Is_finalized():
            return True
        try:
            for peer, _, _ in self._peers_left():
                self._unheard.discard(peer)
        except MPI.Exception:
            return True
        if self._unheard:
            return False
        # The monitored barrier's words that rank 0 had not taken (it takes them now and then:
        # see collectives.reliability.MonitoredBarrier) came before their senders' farewells:
        # taken too, so that none is matched on the next communicator with this context id.
        status, word = MPI.Status(), np.zeros(1, dtype=np.int64)
        while self._comm.Iprobe(MPI.ANY_SOURCE, BARRIER_TAG, status):
            self._comm.Recv([word, MPI.INT64_T], status.Get_source(), BARRIER_TAG)
        self._comm.Free()
        return True


_AVG = ReduceOp.AVG
#: Closed channels whose communicator waits for a peer's farewell before it is freed.
_UNFREED: list[MPIChannel] = []
#: Shapes (and roots) per fast path that keep a persistent request at most.
STAGED_SHAPES = 16
#: Communicators of at most this many ranks gather every rank's block in the check's round (see
#: MPIChannel._round): the uneven collectives' counts and a small call's x travel in it.
COUNTS_RANKS = 4

#: Tests of the agreement after the fast polls before a waiting rank runs ``waiting`` (the
#: monitored barrier's word to rank 0): at 2 ranks on one node a barrier loop's ranks are
#: within these (~10 us) of each other all but rarely, and then send no word.
WAITING_POLLS = 128


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
