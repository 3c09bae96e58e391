"""The default check's round of one MPI communicator (see ``MPIChannel._round``): :class:`Round`,
its one owner, holds the blocks, their geometry, the persistent requests and the switch between
the two sizes of block; the channel and the carried calls use it through its methods and public
fields.

Up to ``COUNTS_RANKS`` ranks the round is an MPI_Allgather of one block per rank: the check
word, a row of ``size + 1`` int64 (the uneven collectives' counts), the rank's *want* (one
int64), then the payload (a small call's x). A call whose x fits the payload travels in the
round: one exchange where an unchecked call makes one too. The payload is
:data:`~.mpi_carried.CARRY_BYTES` (1 KiB), where the round costs little more than with none;
a larger one slows every small call (a 4 KiB payload: ~0.5 us a round at 2 ranks on one node).

So the round has two blocks, and every rank uses the same one at every round: the *large* one
(:data:`LARGE_CARRY_BYTES` of payload) once :data:`ROUND_STREAK` rounds in a row found every
rank's call wanting it (a carried call whose x is past the small payload and fits the large one:
a loop of 2-4 KiB calls; :meth:`Round.wants`), the small one again once as many rounds in a row
did not (:meth:`Round.run`). What the ranks choose comes from the blocks every rank holds alike
after a round, never from a rank's own guess, so a mismatched call cannot make two ranks start
requests of different sizes.

Both blocks lie in the same memory: this rank's block is the large block's bytes (the small
round sends its first bytes), every rank's blocks one array of the large size, which the small
round fills from its start, block after block (no strided MPI datatype: that cost 1.2 us a round
at 2 ranks, more than the large block). The round's readers take the blocks at the stride of
the round they read (``blocks``, ``payloads``: set as a round starts), its writers fill at most
the payload of the next round (``carry_bytes``: set as a round ends).

Past ``COUNTS_RANKS`` ranks the round is a one-word MPI_Allreduce (BAND): no blocks, no payload.

The compiled form (setup.py's ``COMPILED``: ``collectives.backends._round_c``) is this file,
compiled by Cython with the types of mpi_round.pxd: the Round a ``cdef class``, the helpers
defined below for the Python form (``if not cython.compiled:``) replaced by the .pxd's C forms of
the same names: the words read from the blocks' memory, x's bytes copied by ``memcpy``, and the
persistent request started and tested by MPI_Start and MPI_Test themselves, found as the process
resolves them (its global symbols first, where a PMPI tool preloaded with LD_PRELOAD defines
them: the tool sees the round's calls), else in the library mpi4py loaded. The Python form starts
and tests it through mpi4py (``Prequest.Start``, ``Test``): the same MPI calls, the same blocks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from collectives import config

from .mpi_carried import CARRIED, CARRY_BYTES, WORD_BITS
from .mpi_requests import FAST_POLLS

#: Bit 63 of a word (:data:`CARRIED`) and the rest (:data:`WORD_BITS`), C integers where compiled
#: (mpi_round.pxd): the counts' round marks and unmarks its word without a Python int.
_MARK: int = CARRIED
_WORD: int = WORD_BITS

try:
    import cython
except ImportError:  # (the Python form where Cython is not installed)
    from types import SimpleNamespace

    cython = SimpleNamespace(compiled=False)

#: The payload of the round's large block, bytes.
LARGE_CARRY_BYTES = 4096
#: Rounds in a row whose every block wanted the large one (or, on it, did not) before every rank
#: switches: a loop that alternates small and larger calls stays on the small block.
ROUND_STREAK = 2

#: ``wait(request, waiting)``: the channel's wait for a round that the fast polls did not see
#: complete (``MPIChannel._wait_saying``: the deadline, the farewells, the monitored barrier's word).
Wait = Callable[[Any, "Callable[[], None] | None"], None]


class Round:
    """The check's round of the mpi4py communicator ``comm`` of ``ranks`` ranks (``MPI``: mpi4py's
    module): every rank's block where ``gathers`` (up to COUNTS_RANKS ranks), with the large one
    where ``large`` (the library's persistent all_gather is right) and the library has persistent
    collectives; else a one-word MPI_Allreduce. ``wait`` completes a round the fast polls did not
    (see :data:`Wait`). Made collectively (every rank makes its persistent requests here), freed
    collectively (:meth:`free`)."""

    block: Any  # this rank's block
    payload: Any  # its payload (None: the one word)
    blocks: Any  # the last round's: every rank's block, their words and payloads
    words: Any
    payloads: Any
    request: Any  # the next round's persistent request (None: none), and its arguments
    args: tuple[Any, ...]

    def __init__(self, comm: Any, MPI: Any, ranks: int, gathers: bool, large: bool, wait: Wait) -> None:
        # (``large``: the library's persistent all_gather is right; where not, the round's requests
        # are freed again and the small block alone gathers, by MPI_Iallgather)
        self._comm, self._wait = comm, wait
        self.size, self.rank = ranks, comm.Get_rank()
        #: Tests of a started round before the channel's wait (a direct MPI_Test: as many times more).
        self.polls = FAST_POLLS
        #: Whether the round gathers every rank's block (else the one word's MPI_Allreduce).
        self.gathers = gathers
        #: The next round's block (0 the small one, 1 the large one) and the last round's (its readers').
        self.geometry = self.read = 0
        #: Rounds in a row that asked to switch (see :meth:`run`).
        self.streak = 0
        #: Whether this rank's call wants the large block in the next round (:meth:`wants`).
        self.want = False
        #: Whether the last round's every word had bit 63 (:data:`CARRIED`): every rank runs the
        #: call on its fast path (the channel's staged requests ask).
        self.everyone_fast = False
        #: The small block's payload bytes, and the large one's (0: none; see :meth:`wants`).
        self.rooms = (0, 0)
        self.small_room = self.large_room = 0
        self.memory = None
        #: Whether MPI_Start and MPI_Test are called directly (the compiled form, where found).
        self.direct = bind_mpi(self, MPI)
        if not gathers:
            self._one_word(MPI)
            bind_memory(self)
            return
        header = 3 + ranks  # the word, the row, the want
        small = header + CARRY_BYTES // 8
        n = header + LARGE_CARRY_BYTES // 8 if large else small
        #: Where a block's payload starts (bytes), and where its want sits (int64).
        self.payload_offset, self.want_slot = header * 8, header - 1
        #: This rank's block (the large block's bytes: the small round sends its first), and its payload.
        self.block = np.full(n, -1, dtype=np.int64)
        self.block[self.want_slot] = 0
        self.payload = self.block.view(np.uint8)[self.payload_offset:]
        memory = np.full((ranks, n), -1, dtype=np.int64)
        memory[:, self.want_slot] = 0
        self._geometries = [self._views(MPI, memory.reshape(-1), ranks, k) for k in dict.fromkeys((small, n))]
        self._read_views(0)
        self.requests = []
        for geometry in self._geometries:
            try:
                self.requests.append(comm.Allgather_init(*geometry[0]))
            except (NotImplementedError, AttributeError, MPI.Exception):  # MPI < 4: the small block alone
                self.free()
                self.requests = [None]
                del self._geometries[1:]
                break
        #: The bytes of the small block, where there is a large one (else 0); the memory of every rank's blocks.
        self.small_bytes = small * 8 if len(self._geometries) > 1 else 0
        self.memory = memory
        self.small_room = self._geometries[0][3].shape[1]
        self.large_room = self._geometries[-1][3].shape[1] if self.small_bytes else 0
        self.rooms = (self.small_room, self.large_room)
        #: Whether the library made the round's persistent requests (MPI-4).
        self.persistent = self.requests[0] is not None
        self._start = comm.Iallgather
        self._write_views(0)
        bind_memory(self)
        if not large:
            self.free()

    def _one_word(self, MPI: Any) -> None:
        """Past COUNTS_RANKS ranks: a one-word MPI_Allreduce (BAND), persistent where the library can."""
        self.block = np.full(1, -1, dtype=np.int64)
        self.payload = self.blocks = self.words = self.payloads = None
        self.payload_offset = self.want_slot = self.small_bytes = self.carry_bytes = 0
        self.args = (MPI.IN_PLACE, [self.block, MPI.INT64_T], MPI.BAND)
        self._start = self._comm.Iallreduce
        try:
            self.request = self._comm.Allreduce_init(*self.args)
        except (NotImplementedError, AttributeError, MPI.Exception):  # MPI < 4
            self.request = None
        self.requests = [self.request]
        self.persistent = self.request is not None

    def _views(self, MPI: Any, memory: Any, ranks: int, n: int) -> tuple[Any, ...]:
        """One block's size (n int64): the round's arguments, every rank's blocks, their heads (the
        word and the want), payloads."""
        blocks = memory[:ranks * n].reshape(ranks, n)
        payloads = blocks.view(np.uint8)[:, self.payload_offset:]
        heads = blocks[:, 0:self.want_slot + 1:self.want_slot]
        return ([self.block[:n], MPI.INT64_T], [blocks, MPI.INT64_T]), blocks, heads, payloads

    def _read_views(self, geometry: int) -> None:
        """The round about to run uses block ``geometry``: its readers' ``blocks``, ``words`` and
        ``payloads``, and the stride of its blocks."""
        _, self.blocks, self._heads, self.payloads = self._geometries[geometry]
        self.words = self.blocks[:, 0]
        self.stride = self.blocks.strides[0]
        self.read = geometry

    def _write_views(self, geometry: int) -> None:
        """The next round uses block ``geometry``: its request and arguments, and the payload bytes
        its writers may fill (``carry_bytes``)."""
        self.args = self._geometries[geometry][0]
        self.request = self.requests[geometry]
        self.carry_bytes = self.large_room if geometry else self.small_room

    def read_geometry(self, geometry: int) -> Any:
        """:meth:`_read_views` of ``geometry``; its payloads."""
        self._read_views(geometry)
        self.geometry = geometry
        return self.payloads

    def write_geometry(self, geometry: int) -> None:
        """:meth:`_write_views` of ``geometry``."""
        self._write_views(geometry)
        self.geometry = geometry

    def start(self) -> Any:
        """The round started: its persistent request (MPI_Start), else the nonblocking call."""
        request = self.request
        if request is None:
            return self._start(*self.args)
        request.Start()
        return request

    def wants(self, nbytes: int) -> None:
        """This rank's call of ``nbytes`` of x, carried in the next round, wants the large block:
        its x is past the small payload and fits the large one."""
        self.want = self.small_room < nbytes <= self.large_room

    def agree_word(self, word: int, waiting: Callable[[], None] | None = None) -> int:
        """:meth:`run`'s bitwise AND of every rank's ``word``, less bit 63: the channel's
        ``_agree_word``, which the check calls with no frame of the channel's between."""
        return self.run(word, waiting) & _WORD

    def run(self, word: int, waiting: Callable[[], None] | None = None) -> int:
        """The round with ``word`` in this rank's block (and its want, where there is a large
        block): the bitwise AND of every rank's word, and the switch (every rank switches at the
        same round, from what every rank's block said). Sets :attr:`everyone_fast`."""
        if not made(self):
            raise RuntimeError("a Round is made by Round(...), which every rank calls")
        if self.read != self.geometry:  # (the last round switched: its readers' views)
            self._read_views(self.geometry)
        put(self, 0, word)
        switching = self.small_bytes != 0
        if switching:
            put(self, self.want_slot, self.want)
            self.want = False
        request = self.request
        if request is None:  # (no persistent request: MPI < 4, or a library whose persistent all_gather fails)
            request = self._start(*self.args)
            done = polled(self, request)
        else:
            done = start_direct(self, request, False)
        if not done:
            self._wait(request, waiting)
        reduced = words_and(self)
        self.everyone_fast = reduced < 0
        if switching:
            everyone = everyone_wants(self)
            self.streak = self.streak + 1 if (not everyone if self.geometry else everyone) else 0
            if self.streak >= ROUND_STREAK:
                self.streak = 0
                self.geometry ^= 1
                self._write_views(self.geometry)
        return reduced

    def set_row(self, i: int, value: int) -> None:
        """Item ``i`` of this rank's row (the uneven calls' counts) in the next round's block."""
        if not made(self) or not 0 <= i <= self.size:
            raise IndexError(f"a row holds {self.size + 1} items")
        put(self, 1 + i, value)

    def row_value(self, rank: int, i: int) -> int:
        """Item ``i`` of rank ``rank``'s row in the last round's blocks."""
        if not (0 <= rank < self.size and 0 <= i <= self.size):
            raise IndexError(f"{self.size} rows of {self.size + 1} items")
        return row_item(self, rank, i)

    def agree(self, word: int, view: Any) -> int:
        """The counts' round, this rank's row set (:meth:`set_row`), with ``view`` (x's bytes, if
        given) in its payload where it fits (with it, bit 63 of the word, see
        MPIChannel._uneven_bytes: a larger one is marked alone): the AND of every rank's word,
        bit 63 included."""
        if not made(self):
            raise RuntimeError("a Round is made by Round(...), which every rank calls")
        if view is not None:  # (past the payload: marked alone, see MPIChannel._uneven_bytes)
            if not copy_into_payload(self, view):
                raise ValueError("an uneven call's carried x must be one C-contiguous buffer")
            word |= _MARK
        return self.run(word)

    def agree_counts(self, word: int, row: list[int], view: Any) -> tuple[int, list[list[int]], Any]:
        """The round :meth:`run` with this rank's ``row`` (and ``view``, x's bytes, if given, in
        its payload where it fits; with it, bit 63 of the word, see MPIChannel._uneven_bytes): the
        AND of every rank's word less bit 63, every rank's row, and every rank's payload where
        every rank marked its word (else None)."""
        n = len(row)
        if not made(self) or 2 + n > self.payload_offset // 8:
            raise ValueError("the row must fit the block")
        for i in range(n):  # (item by item: a slice of a list costs twice as much)
            put(self, 1 + i, row[i])
        reduced = self.agree(word, view)
        rows = []
        for k in range(self.size):  # (loops over C integers where compiled: no range objects)
            counts = []
            for i in range(n):
                counts.append(row_item(self, k, i))
            rows.append(counts)
        return reduced & _WORD, rows, self.payloads if view is not None and reduced < 0 else None

    def rows_into(self, got: Any, counts: Any, row: int, rank: int = -1) -> None:
        """The uneven calls' results out of the last round's payloads into ``got`` (a C-contiguous
        buffer), rows of ``row`` bytes: with ``rank`` -1, every rank's first ``counts[k]`` rows back
        to back (all_gather_v); else, ``counts`` being the splits, the rows each rank k sent to
        ``rank`` (``counts[k][rank]`` of them, after its ``counts[k][:rank]``)."""
        if not made(self) or not self.gathers:
            raise RuntimeError("rows_into needs a Round that gathers blocks")
        gathered = rank < 0
        at = 0
        for k in range(self.size):
            if gathered:
                n, start = counts[k], 0
            else:
                sent = counts[k]
                n, start = sent[rank], 0
                for j in range(rank):
                    start += sent[j]
            copy_rows(self, got, at, k, start * row, n * row)
            at += n * row

    def start_staged(self, request: Any) -> bool:
        """A staged persistent request of the channel's fast paths started and completed: MPI_Start
        and the fast polls (directly where bound), then the channel's wait; whether the fast polls
        saw it complete."""
        if not made(self):
            raise RuntimeError("a Round is made by Round(...), which every rank calls")
        done = start_direct(self, request, True)
        if not done:
            self._wait(request, None)
        return done

    def staged(self, request: Any, src: Any, stage: Any, dst: Any) -> None:
        """A staged call (MPIChannel._staged): ``src``'s bytes into the first bytes of ``stage``
        (where ``src`` is not None), ``request`` run (:meth:`start_staged`), the last bytes of
        ``stage`` into ``dst`` (where ``dst`` is not None)."""
        if src is not None:
            copy_staged(src, stage, False)
        self.start_staged(request)
        if dst is not None:
            copy_staged(stage, dst, True)

    def free(self) -> None:
        """Frees the round's persistent requests (made by every rank alike: freed by every rank alike)."""
        for request in self.requests:
            if request is not None:
                request.Free()
        self.requests = [None] * len(self.requests)
        self.request = None
        self.handle_of = self.staged_of = None


def compiled_module() -> Any:
    """This module compiled (``collectives.backends._round_c``: the Round in C), or None where it was
    not built (or from another version of the file) or ``COLLECTIVES_COMPILED=0`` turns it off."""
    return config.compiled_extension(f"{__package__}._round_c", sys.modules[f"{__package__}.mpi_round"])


def polled(r: Round, request: Any) -> bool:
    """The fast polls of a started ``request`` (mpi4py's Test): whether it completed."""
    test = request.Test
    for _ in range(r.polls):  # the peers' words land within microseconds: no frame more
        if test():
            return True
    return False


def binds_mpi(MPI: Any) -> bool:
    """Whether the compiled round calls MPI_Start and MPI_Test itself for mpi4py's module ``MPI``
    (found as the process resolves them, else in mpi4py's library); False in the Python form."""
    return bind_mpi(None, MPI)  # type: ignore[arg-type]


if not cython.compiled:  # the Python form of the .pxd's C helpers (the compiled module has those)
    def bind_mpi(r: Round, MPI: Any) -> bool:
        """Whether MPI_Start and MPI_Test are bound for direct calls: never in the Python form."""
        return False

    def bind_memory(r: Round) -> None:
        """The blocks' addresses (the compiled form's)."""

    def made(r: Round) -> bool:
        """Whether ``r``'s __init__ ran (the compiled form's blocks are bound)."""
        return True

    def put(r: Round, slot: int, value: int) -> None:
        """Int64 ``slot`` of this rank's block."""
        r.block[slot] = value

    def words_and(r: Round) -> int:
        """The AND of every rank's word in the last round's blocks (the one word where it does not gather)."""
        if not r.gathers:
            return int(r.block[0])
        reduced = -1
        for each in r.words.tolist():  # (a 2-4 item loop costs less than numpy's reduce)
            reduced &= each
        return reduced

    def everyone_wants(r: Round) -> bool:
        """Whether every rank's block in the last round wanted the large block."""
        return all(want == 1 for _, want in r._heads.tolist())

    def row_item(r: Round, rank: int, i: int) -> int:
        """Item ``i`` of rank ``rank``'s row in the last round's blocks."""
        return int(r.blocks[rank, 1 + i])

    def start_direct(r: Round, request: Any, staged: bool) -> bool:
        """The persistent ``request`` started and its fast polls (mpi4py's Start and Test)."""
        request.Start()
        return polled(r, request)

    def copy_into_payload(r: Round, view: Any) -> bool:
        """``view``'s bytes into this rank's payload, where they fit the next round's."""
        if view.nbytes <= r.carry_bytes:
            r.payload[:view.nbytes] = view.reshape(-1).view(np.uint8)
        return True

    def copy_rows(r: Round, got: Any, at: int, rank: int, start: int, n: int) -> None:
        """Bytes [start, start + n) of rank ``rank``'s payload into got's bytes from ``at``."""
        into = got.reshape(-1).view(np.uint8) if isinstance(got, np.ndarray) else memoryview(got).cast("B")
        into[at:at + n] = r.payloads[rank, start:start + n]

    def copy_staged(src: Any, dst: Any, at_end: bool) -> None:
        """src's bytes into the first bytes of dst, or (``at_end``) the last bytes of src into dst."""
        a, b = memoryview(src).cast("B"), memoryview(dst).cast("B")
        if at_end:
            b[:] = a[len(a) - len(b):]
        else:
            b[:len(a)] = a
