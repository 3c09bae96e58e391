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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .mpi_carried import CARRIED, CARRY_BYTES, WORD_BITS
from .mpi_requests import FAST_POLLS

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
        #: Whether the round gathers every rank's block (else the one word's MPI_Allreduce).
        self.gathers = gathers
        #: The next round's block (0 the small one, 1 the large one) and the last round's (its readers').
        self.geometry = self.read = 0
        #: Rounds in a row that asked to switch (see :meth:`run`).
        self.streak = 0
        #: Whether this rank's call wants the large block in the next round (:meth:`wants`).
        self.want = False
        #: The small block's payload bytes, and the large one's (0: none; see :meth:`wants`).
        self.rooms = (0, 0)
        if not gathers:
            self._one_word(MPI)
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
        self.requests: list[Any] = []
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
        self.rooms = (self._geometries[0][3].shape[1], self._geometries[-1][3].shape[1] if self.small_bytes else 0)
        #: Whether the library made the round's persistent requests (MPI-4).
        self.persistent = self.requests[0] is not None
        self._start = comm.Iallgather
        self._write_views(0)
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
        ``payloads``."""
        _, self.blocks, self._heads, self.payloads = self._geometries[geometry]
        self.words = self.blocks[:, 0]
        self.read = geometry

    def _write_views(self, geometry: int) -> None:
        """The next round uses block ``geometry``: its request and arguments, and the payload bytes
        its writers may fill (``carry_bytes``)."""
        self.args = self._geometries[geometry][0]
        self.request = self.requests[geometry]
        self.carry_bytes = self.rooms[geometry]

    # (the compiled round's: it keeps these views in step with its own switch)
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
        small, large = self.rooms
        self.want = small < nbytes <= large

    def run(self, word: int, waiting: Callable[[], None] | None = None) -> int:
        """The round with ``word`` in this rank's block (and its want, where there is a large
        block): the bitwise AND of every rank's word, and the switch (every rank switches at the
        same round, from what every rank's block said)."""
        if self.read != self.geometry:  # (the last round switched: its readers' views)
            self._read_views(self.geometry)
        block = self.block
        block[0] = word
        switching = self.small_bytes != 0
        if switching:
            block[self.want_slot] = self.want
            self.want = False
        request = self.start()
        test = request.Test
        for _ in range(FAST_POLLS):  # the peers' words land within microseconds: no frame more
            if test():
                break
        else:
            self._wait(request, waiting)
        if not self.gathers:
            return int(block[0])
        reduced = -1
        if not switching:
            for each in self.words.tolist():  # (a 2-4 item loop costs less than numpy's reduce)
                reduced &= each
            return reduced
        everyone = True
        for each, want in self._heads.tolist():
            reduced &= each
            everyone = everyone and want == 1
        self.streak = self.streak + 1 if (not everyone if self.geometry else everyone) else 0
        if self.streak >= ROUND_STREAK:
            self.streak = 0
            self.geometry ^= 1
            self._write_views(self.geometry)
        return reduced

    def agree_counts(self, word: int, row: list[int], view: Any, run: Callable[[int], int]
                     ) -> tuple[int, list[list[int]], Any]:
        """The round ``run(word)`` (:meth:`run`, or the channel's that wraps it) with this rank's
        ``row`` (and ``view``, x's bytes, if given, in its payload where it fits; with it, bit 63
        of the word, see MPIChannel._uneven_bytes): the AND of every rank's word less bit 63,
        every rank's row, and every rank's payload where every rank marked its word (else None)."""
        block = self.block
        for i, n in enumerate(row):  # (item by item: a slice of a list costs twice as much)
            block[1 + i] = n
        if view is not None:  # (past the payload: marked alone, see MPIChannel._uneven_bytes)
            if view.nbytes <= self.carry_bytes:
                self.payload[:view.nbytes] = view.reshape(-1).view(np.uint8)
            word |= CARRIED
        reduced = run(word)
        rows = self.blocks[:, 1:1 + len(row)].tolist()
        return reduced & WORD_BITS, rows, self.payloads if view is not None and reduced < 0 else None

    def free(self) -> None:
        """Frees the round's persistent requests (made by every rank alike: freed by every rank alike)."""
        for request in self.requests:
            if request is not None:
                request.Free()
        self.requests = [None] * len(self.requests)
        self.request = None

