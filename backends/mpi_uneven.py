"""The uneven collectives after their counts' round (all_gather_v, all_to_all with splits): the MPI
transport's ``_all_gather_v`` and ``_all_to_all_v`` where its check's round gathers blocks, one
:class:`Uneven` per kind, handed to the call path as the method.

The counts' round (``MPIChannel._agree_counts``) put every rank's counts in ``r.extra``, and, where
every rank's x is host memory of at most ``MPIChannel._uneven_bytes``, marked every rank's word
(``r.carried``: every rank's payload in the round's blocks). Then the result is made without a
data collective where every rank's x fits its payload: each rank's rows copied out of the payloads;
else (every rank's x within UNEVEN_BYTES, some past the payload) the rows go through the staged
request of padded blocks of ``mpi_staged.uneven_stage``, one per block size
(:func:`uneven_block`: every rank picks the same one from the counts it holds). Where
the round did not mark them, the v-collective on x's and the result's memory (MPI_Allgatherv,
MPI_Alltoallv: blocking with no timeout, else nonblocking and completed under the deadline).

This module is compiled as it stands by Cython (setup.py's COMPILED, with mpi_uneven.pxd: the
counts read as C integers, the rows copied by memcpy); the two forms are the same protocol. What
neither takes (an asynchronous call without marked rows, an array with no host view, a message past
a C int) runs the transport's Python method, ``method``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from collectives import arrays, calls
from collectives.calls import NOT_TAKEN
from collectives.work import Work

from . import mpi_staged
from .mpi_staged import UNEVEN_STAGED

try:
    import cython
except ImportError:  # (the Python form where Cython is not installed)
    from types import SimpleNamespace

    cython = SimpleNamespace(compiled=False)

#: The most ranks an :class:`Uneven` serves (its counts' arrays in mpi_uneven.pxd; the round that
#: gathers counts has COUNTS_RANKS).
MOST_RANKS = 64
#: Bytes of an MPI message at most: a C int.
MAX_MESSAGE = 2**31 - 1
#: The least block of an uneven call's staged request (see uneven_block), in bytes.
LEAST_BLOCK = 256


def uneven_block(need: int) -> int:
    """The block of an uneven call's staged request for ``need`` bytes a rank (all_gather_v) or a
    pair (all_to_all): at least :data:`LEAST_BLOCK`, else ``need`` rounded up to a multiple of an
    eighth of the next power of two (at most a quarter more; a few requests serve counts that vary).
    Every rank computes it from the counts it holds alike, in either form (this function, compiled
    or not): ranks that picked different blocks would start different requests and hang."""
    if need <= LEAST_BLOCK:
        return LEAST_BLOCK
    bits, left = 0, need - 1  # (need - 1).bit_length(), in C integers where compiled
    while left:
        bits += 1
        left >>= 1
    step = 1 << max(0, bits - 3)
    return -(-need // step) * step


class Uneven:
    """``uneven(r)``: ``channel``'s method of the uneven ``call`` (calls.ALL_GATHER_V or
    calls.ALL_TO_ALL_V) on the request ``r``, after the counts' round; ``method`` runs what it does not
    take (the transport's Python body: the v-collective as ``MPITransport._move_bytes`` makes it)."""

    def __init__(self, channel: Any, call: Any, method: Any) -> None:
        size = channel.size
        if size > MOST_RANKS:
            raise ValueError(f"an uneven call's counts are kept for {MOST_RANKS} ranks at most")
        comm = channel._comm
        self.channel, self.call, self.method = channel, call, method
        self.gathered = call is calls.ALL_GATHER_V
        self.size, self.rank = size, channel.rank
        self.numpy_adapter, self.torch_adapter = arrays.NUMPY, arrays.TORCH
        # (the staged requests' table of this kind, where made: mpi_staged.uneven_stage's lookup)
        self.tables, self.kind = channel._staged_tables, (call, *UNEVEN_STAGED)
        self.blocking, self.nonblocking = (comm.Allgatherv, comm.Iallgatherv) if self.gathered else \
            (comm.Alltoallv, comm.Ialltoallv)
        self.byte = channel._byte
        #: The channel's check round (mpi_round.Round: its start_staged runs a staged request).
        self.round = channel.round
        self.empty = np.empty
        if not cython.compiled:  # (compiled: C arrays of MOST_RANKS)
            self.sent, self.got, self.skip, self.mine = [0] * size, [0] * size, [0] * size, [0] * size
        self.most_sent = self.most_block = self.total = 0
        #: x's dimensions (host_row: of the running call's x).
        self.ndim = 0
        #: The round's payloads last read (``r.carried``) and their bytes each (payload_room).
        self.payloads: Any = None
        self.room = 0

    def __call__(self, r: Any) -> Any:
        adapter, carried = r.adapter, r.carried
        if r.async_op or (adapter is not self.numpy_adapter and adapter is not self.torch_adapter):
            if carried is None:
                return self.method(r)
            view = r.view if r.view is not None else adapter.host_view(r.x, False)
            row = -1 if view is None else host_row(self, view)
            if row < 0:
                raise ValueError("an uneven call's rows went in the round but x has no host view")
            return self.rows(r, view, row, carried, -1)
        tensors = adapter is self.torch_adapter
        view = r.view
        if view is None:  # (a call made without the call path's host view)
            try:
                view = r.x.numpy() if tensors else r.x
            except (RuntimeError, TypeError):
                view = None
        row = -1 if view is None else host_row(self, view)
        if row < 0:
            if carried is not None:  # (its rank marked the round: x has a C-contiguous host view)
                raise ValueError("an uneven call's rows went in the round but x has no host view")
            return self.method(r)
        result = self.rows(r, view, row, carried, 1 if tensors else 0)
        return self.method(r) if result is NOT_TAKEN else result

    def rows(self, r: Any, view: Any, row: int, carried: Any, kind: int) -> Any:
        """The call's result: out of ``carried`` (the payloads), through a staged request, else
        (``carried`` None) the v-collective; NOT_TAKEN where a message is past a C int. ``kind``:
        0 numpy, 1 CPU tensor, -1 another (its adapter makes the result; marked rows only)."""
        counts = r.extra
        self.read(counts)
        entry = None
        block = 0
        if carried is not None and self.most_sent * row > payload_room(self, carried):
            # past a payload: the staged request of its block, found, made now (collective), or none
            block = uneven_block(self.most_block * row)
            entry = self.stage_of(block)
            if entry is None:
                if kind < 0:
                    return self.method(r)
                carried = None
        result, got = self.new(r, view, (self.total,) if self.ndim == 1 else (self.total, *view.shape[1:]), kind)
        if carried is None:
            if type(got) is not np.ndarray:  # (an out= tensor the compiled copies write at its address)
                got = got.numpy()
            if not self.plain(view, got, row):
                return NOT_TAKEN
        elif entry is not None:
            staged_rows(self, entry, block, view, got, row)
        else:
            payload_rows(self, carried, got, row)
        if self.gathered:
            result = (result, counts)
        return Work(result) if r.async_op else result

    def read(self, counts: Any) -> None:
        """The counts the round agreed on, read once: per rank k, the rows it sends in all
        (``sent[k]``), the rows this rank gets from it (``got[k]``) and the rows before those in
        its x (``skip[k]``); the rows this rank sends each rank (``mine``, all_to_all); the most
        rows a rank sends, the most of a block (a rank's x, or a pair's share), the result's rows."""
        size, rank = self.size, self.rank
        self.most_sent = self.most_block = self.total = 0
        for k in range(size):
            if self.gathered:
                n = counts[k]
                if n < 0:
                    raise ValueError("a count is negative")
                self.sent[k] = self.got[k] = n
                self.skip[k] = 0
                if n > self.most_block:
                    self.most_block = n
            else:
                splits = counts[k]
                every = 0
                for j in range(size):
                    n = splits[j]
                    if n < 0:
                        raise ValueError("a count is negative")
                    if j == rank:
                        self.got[k] = n
                        self.skip[k] = every
                    if k == rank:
                        self.mine[j] = n
                    if n > self.most_block:
                        self.most_block = n
                    every += n
                self.sent[k] = every
            if self.sent[k] > self.most_sent:
                self.most_sent = self.sent[k]
            self.total += self.got[k]

    def stage_of(self, block: int) -> Any:
        """The staged request of blocks of ``block`` bytes and its staging array: found in its
        table, else made now (collective: mpi_staged.uneven_stage), or None where none is kept."""
        table = self.tables.get(self.kind)
        entry = None if table is None else table.get(block)  # (the request's key: its block)
        if entry is None:
            entry = mpi_staged.uneven_stage(self.channel, self.call, block)
        return entry

    def new(self, r: Any, view: Any, shape: tuple[int, ...], kind: int) -> tuple[Any, Any]:
        """The result (``r.out``, else a new array of x's kind) and its numpy view."""
        out = r.out
        if kind < 0:  # (another kind of host array: its adapter's)
            result = out if out is not None else r.adapter.empty(r.x, shape)
            return result, result if type(result) is np.ndarray else result.numpy()
        if out is not None:
            return out, out if kind == 0 or type(out) is np.ndarray else tensor_target(out)
        got = self.empty(shape, view.dtype)
        return (sys.modules["torch"].from_numpy(got) if kind else got), got

    def plain(self, view: Any, got: Any, row: int) -> bool:
        """The v-collective of ``view``'s rows into ``got`` (MPIChannel._call); False (nothing
        moved) where a message is past a C int."""
        size, byte = self.size, self.byte
        gets = []
        for k in range(size):
            n = self.got[k] * row
            if n > MAX_MESSAGE:
                return False
            gets.append(n)
        if self.gathered:
            send: list[Any] = [view, byte]
        else:
            if self.sent[self.rank] * row > MAX_MESSAGE:
                return False
            sends = []
            for k in range(size):
                sends.append(self.mine[k] * row)
            send = [view, sends, byte]
        self.channel._call(self.blocking, self.nonblocking, send, [got, gets, byte])
        return True


# -- the byte copies: numpy here, memcpy in the compiled form (mpi_uneven.pxd) --------------------

if not cython.compiled:
    def tensor_target(out: Any) -> Any:
        """What the copies write of an out= CPU tensor (checked by the call path: C-contiguous,
        writable, the result's dtype and shape): its numpy view (the compiled form: the tensor
        itself, written at its address)."""
        return out.numpy()

    def host_row(uneven: Uneven, view: Any) -> int:
        """The bytes of a row of ``view`` (a host array), -1 where it is not one C-contiguous numpy
        array; its dimensions in ``uneven.ndim``."""
        if type(view) is not np.ndarray or not view.flags.c_contiguous:
            return -1
        if view.ndim < 1:
            raise ValueError("an uneven call's x has rows")
        uneven.ndim = view.ndim
        return int(view.itemsize * np.prod(view.shape[1:], dtype=np.int64))

    def payload_room(uneven: Uneven, carried: Any) -> int:
        """The bytes of a payload of the round's blocks (``carried``: every rank's), kept with them
        in ``uneven`` (the compiled form keeps where they lie: the round's views outlive calls)."""
        if carried is not uneven.payloads:
            uneven.payloads, uneven.room = carried, int(carried.shape[1])
        return uneven.room

    def _flat(array: Any) -> Any:
        return array.reshape(-1).view(np.uint8)

    def payload_rows(uneven: Uneven, carried: Any, got: Any, row: int) -> None:
        """Every rank's rows for this one out of the round's payloads, back to back into ``got``."""
        into, at = _flat(got), 0
        room = payload_room(uneven, carried)
        for k in range(uneven.size):
            n, start = uneven.got[k] * row, uneven.skip[k] * row
            if start + n > room:
                raise ValueError("the rows are past the payload")
            into[at:at + n] = carried[k, start:start + n]
            at += n

    def staged_rows(uneven: Uneven, entry: tuple[Any, Any], block: int, view: Any, got: Any, row: int) -> None:
        """``entry``'s staged request (its request and staging array, blocks of ``block`` bytes)
        run on x's rows (``view``: all_gather_v, into the first block; all_to_all, the rows for rank
        j into block j), the rows each rank sent this one out of the blocks it got (after the ones
        this rank sends), back to back into ``got``."""
        request, stage = entry
        data, size = _flat(view), uneven.size
        sends = block if uneven.gathered else size * block
        if sends + size * block > stage.size:
            raise ValueError("the blocks are past the staging array")
        if uneven.gathered:
            if data.size > block:
                raise ValueError("the rows are past a block")
            stage[:data.size] = data
        else:
            at = 0
            for j in range(size):
                n = uneven.mine[j] * row
                if n > block or at + n > data.size:
                    raise ValueError("the rows are past a block or x")
                stage[j * block:j * block + n] = data[at:at + n]
                at += n
        uneven.round.start_staged(request)
        into, at = _flat(got), 0
        for k in range(size):
            n, start = uneven.got[k] * row, sends + k * block
            if n > block or at + n > into.size:
                raise ValueError("the rows are past a block or the result")
            into[at:at + n] = stage[start:start + n]
            at += n
