"""The blocks of the default check's round (see ``MPIChannel._round``), in two sizes.

Up to ``COUNTS_RANKS`` ranks the round is an MPI_Allgather of one block per rank: the check
word, a row of ``size + 1`` int64 (the uneven collectives' counts), the rank's *want* (one
int64), then the payload (a small call's x). A call whose x fits the payload travels in the
round: one exchange where an unchecked call makes one too. The payload is
:data:`~.mpi_carried.CARRY_BYTES` (1 KiB), where the round costs little more than with none;
a larger one slows every small call (a 4 KiB payload: ~0.5 us a round at 2 ranks on one node).

So the round has two blocks, and every rank uses the same one at every round: the *large* one
(:data:`LARGE_CARRY_BYTES` of payload) once two rounds in a row found every rank's call wanting
it (an x past the small payload that fits the large one: a loop of 2-4 KiB calls), the small
one again once two rounds in a row did not. What the ranks choose comes from the blocks every
rank holds alike after a round, never from a rank's own guess, so a mismatched call cannot make
two ranks start requests of different sizes. Only the compiled round (backends/_carried_round.c)
says it wants the large block; a rank of the Python forms says it never does, so every rank
then stays on the small one.

Both blocks lie in the same memory: this rank's block is the large block's bytes (the small
round sends its first bytes), every rank's blocks one array of the large size, which the small
round fills from its start, block after block (no strided MPI datatype: that cost 1.2 us a round
at 2 ranks, more than the large block). The round's readers take the blocks at the stride of
the round they read (``_read_geometry``, set as a round starts), its writers fill at most the
payload of the next round (``_write_geometry``, set as a round ends).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .mpi_carried import CARRY_BYTES

#: The payload of the round's large block, bytes.
LARGE_CARRY_BYTES = 4096


def make_round(channel: Any, MPI: Any, ranks: int, gathers: bool) -> None:
    """The round of ``channel`` (an MPIChannel of ``ranks`` ranks): its blocks (:func:`make_blocks`)
    up to COUNTS_RANKS ranks (``_counts_with_check``), else a one-word MPI_Allreduce (BAND); its
    persistent request where the library has them (``_persistent``), freed again where the
    library's persistent all_gather is wrong (not ``gathers``: then the small block alone)."""
    if channel._counts_with_check:
        make_blocks(channel, MPI, ranks, gathers)
        #: Whether the fast paths may keep persistent requests (see MPIChannel._staged): the
        #: library has MPI-4's persistent collectives (ULFMTransport turns them off).
        channel._persistent = channel._word_requests[0] is not None
        if not gathers:
            free_requests(channel)
        return
    channel._block = np.full(1, -1, dtype=np.int64)
    channel._words = channel._payloads = channel._payload = None
    channel._word_args = (MPI.IN_PLACE, [channel._block, MPI.INT64_T], MPI.BAND)
    channel._start_round = channel._comm.Iallreduce
    channel._carry_bytes = 0
    channel._persistent = True
    try:
        channel._word_request = channel._comm.Allreduce_init(*channel._word_args)
    except (NotImplementedError, AttributeError, MPI.Exception):  # MPI < 4
        channel._word_request, channel._persistent = None, False


def make_blocks(channel: Any, MPI: Any, ranks: int, large: bool) -> None:
    """Sets ``channel``'s blocks (``_block``, ``_blocks``, ``_words``, ``_payloads``, ``_payload``,
    ``_payload_offset``, ``_carry_bytes``, ``_word_args``, ``_start_round``) and their persistent
    requests (``_word_requests``, ``_word_request``: None where the library has none, MPI < 4),
    with the large block where ``large`` and the library has them (``_small_bytes``: the small
    block's bytes, 0 where there is no large one)."""
    header = 3 + ranks  # the word, the row, the want
    small = header + CARRY_BYTES // 8
    n = header + LARGE_CARRY_BYTES // 8 if large else small
    channel._payload_offset = header * 8
    channel._block = np.full(n, -1, dtype=np.int64)
    channel._block[header - 1] = 0
    channel._payload = channel._block.view(np.uint8)[channel._payload_offset:]
    memory = channel._round_memory = np.full((ranks, n), -1, dtype=np.int64)
    memory[:, header - 1] = 0
    channel._geometries = [_views(channel, MPI, memory.reshape(-1), ranks, k) for k in dict.fromkeys((small, n))]
    read_geometry(channel, 0)  # (before the requests: free_requests reads _words)
    channel._start_round = channel._comm.Iallgather
    channel._word_requests = []
    for geometry in channel._geometries:
        try:
            channel._word_requests.append(channel._comm.Allgather_init(*geometry[0]))
        except (NotImplementedError, AttributeError, MPI.Exception):  # MPI < 4: the small block alone
            free_requests(channel)
            channel._word_requests = [None]
            del channel._geometries[1:]
            break
    channel._small_bytes = small * 8 if len(channel._geometries) > 1 else 0
    write_geometry(channel, 0)


def _views(channel: Any, MPI: Any, memory: Any, ranks: int, n: int) -> tuple[Any, ...]:
    """One block's size (n int64): the round's arguments, every rank's blocks, words and payloads."""
    blocks = memory[:ranks * n].reshape(ranks, n)
    payloads = blocks.view(np.uint8)[:, channel._payload_offset:]
    return ([channel._block[:n], MPI.INT64_T], [blocks, MPI.INT64_T]), blocks, blocks[:, 0], payloads


def read_geometry(channel: Any, geometry: int) -> Any:
    """The round about to run uses block ``geometry``: its readers' ``_blocks``, ``_words`` and
    ``_payloads``; the payloads (the compiled round's)."""
    _, channel._blocks, channel._words, channel._payloads = channel._geometries[geometry]
    return channel._payloads


def write_geometry(channel: Any, geometry: int) -> None:
    """The next round uses block ``geometry``: its request and arguments, and the payload bytes
    its writers may fill (``_carry_bytes``)."""
    channel._word_args = channel._geometries[geometry][0]
    channel._word_request = channel._word_requests[geometry]
    channel._carry_bytes = channel._geometries[geometry][3].shape[1]


def free_requests(channel: Any) -> None:
    """Frees the round's persistent requests (made by every rank alike: freed by every rank alike)."""
    for request in channel._word_requests if channel._words is not None else [channel._word_request]:
        if request is not None:
            request.Free()
    if channel._words is not None:
        channel._word_requests = [None] * len(channel._word_requests)
    channel._word_request = None
