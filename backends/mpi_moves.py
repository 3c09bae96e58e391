"""The fast paths of the MPI transport's collectives of even shapes (``MPITransport._fast_path``):
all_reduce, broadcast, reduce, reduce_scatter, all_gather, all_to_all, gather and scatter on a
contiguous host x go to MPI as it is, in as few steps as raw mpi4py takes: x's memory (a CPU
tensor's numpy view) is the buffer, bound with its MPI datatype and op once per kind of call; a
result is allocated as a raw caller would (a tensor for a tensor), or is the caller's ``out=``.

:class:`Move` is the one source of both forms: this module runs as Python where nothing was
compiled (or ``COLLECTIVES_COMPILED=0``), and is compiled as it stands by Cython (the module
``collectives.backends._moves_c``, setup.py's ``COMPILED``, with the types of
backends/mpi_moves.pxd) where it was built: the same steps, the interpreter's cost of its own gone.
A transport keeps the form it was made with (:func:`move_class`).

Without a timeout a call is the blocking MPI call; under one, the nonblocking call, its fast polls
(a small call is complete within them), then the channel's own wait (the deadline, the farewells);
a small call under a timeout, where every rank runs it on its fast path, goes through its staged
persistent request (backends/mpi_staged.py, ``staged``).

Imports: collectives' calls and config, and the MPI backend's mpi_requests and mpi_staged (never the
channel's module: the channel is handed in).
"""

from __future__ import annotations

import sys
from typing import Any

from collectives import calls, config
from collectives.calls import NOT_TAKEN

from .mpi_requests import FAST_POLLS
from .mpi_staged import STAGED_BYTES

#: What a Move runs (its ``kind``): the calls whose result is x (ALL_REDUCE, BROADCAST, REDUCE),
#: reduce_scatter's block of rows, all_gather's and gather's rows of every rank (STACKED),
#: all_to_all's (x's shape) and scatter's one row.
ALL_REDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, STACKED, ALL_TO_ALL, GATHER, SCATTER = 0, 1, 2, 3, 4, 5, 6, 7
#: The kind of each row with a Move (all_gather and gather share STACKED's shape; GATHER is rooted).
KINDS = {calls.ALL_REDUCE: ALL_REDUCE, calls.BROADCAST: BROADCAST, calls.REDUCE: REDUCE,
         calls.REDUCE_SCATTER: REDUCE_SCATTER, calls.ALL_GATHER: STACKED, calls.ALL_TO_ALL: ALL_TO_ALL,
         calls.GATHER: GATHER, calls.SCATTER: SCATTER}


class Move:
    """The fast path of one kind of collective (``kind``, one of the above) on ``channel`` (an
    MPIChannel), for x of ``mpi_type`` (with ``mpi_op`` where it reduces; the byte-moving calls go
    as bytes): :meth:`run` is the transport's fast path (``run(buf, root, out, extra)``: the
    result, None on a rank that gets none, or NOT_TAKEN past MPI's count). ``blocking`` and
    ``start``: the mpi4py call and its nonblocking form; ``new(buf, shape, out)``: a result and its
    buffer (``numpy``: the result is a numpy array, an ``out=`` its own buffer); ``avg``: the
    result divided by the size; ``staged``: the staged request's run of a small call under a
    timeout (``mpi_staged.staged``, set once made: it takes :meth:`result_shape`), or None."""

    __slots__ = ("kind", "channel", "blocking", "start", "new", "staged", "spec", "op", "byte", "in_place",
                 "most", "rank", "size", "polls", "avg", "numpy")

    def __init__(self, channel: Any, kind: int, blocking: Any, start: Any, mpi_type: Any, mpi_op: Any,
                 new: Any, numpy: bool, avg: bool, most: int) -> None:
        self.kind, self.channel, self.blocking, self.start, self.new = kind, channel, blocking, start, new
        self.numpy, self.avg, self.most = numpy, avg, most
        self.staged: Any = None
        self.spec, self.op, self.byte, self.in_place = mpi_type, mpi_op, channel._byte, channel._in_place
        self.rank, self.size = channel.rank, channel.size
        #: Tests of a request before the channel's wait.
        self.polls = FAST_POLLS

    def run(self, buf: Any, root: Any, out: Any, extra: Any) -> Any:
        """The call on ``buf`` (x's contiguous host memory), with ``root`` and ``out``."""
        kind, nbytes = self.kind, buf.nbytes
        # MPI's count: a reduction's elements (reduce_scatter's: of a block of rows), else bytes
        if kind == ALL_REDUCE or kind == REDUCE:
            if buf.size > self.most:
                return NOT_TAKEN
        elif kind == REDUCE_SCATTER:
            if buf.size // self.size > self.most:
                return NOT_TAKEN
        elif nbytes > self.most:
            return NOT_TAKEN
        channel = self.channel
        if self.staged is not None and 0 < nbytes <= STAGED_BYTES and channel.timeout is not None and \
                channel._everyone_fast:
            return self.staged(buf, root, out, extra)
        if kind == ALL_REDUCE:
            self.complete((self.in_place, [buf, self.spec], self.op))
            if self.avg:
                buf /= self.size
            return buf
        if kind == BROADCAST:
            self.complete(([buf, self.byte], root))
            return buf
        if kind == REDUCE:
            if root == self.rank:
                self.complete((self.in_place, [buf, self.spec], self.op, root))
                if self.avg:
                    buf /= self.size
            else:  # (MPI leaves the other ranks' x as it is)
                self.complete(([buf, self.spec], None, self.op, root))
            return buf
        if kind == GATHER and root != self.rank:
            self.complete(([buf, self.byte], None, root))
            return None
        if out is not None and self.numpy:  # (the call path checked it: the result's shape)
            result = recv = out
        else:
            result, recv = self.new(buf, self.result_shape(buf.shape), out)
        if kind == REDUCE_SCATTER:
            block = buf.size // self.size
            self.complete(([buf, self.spec], [recv, self.spec], [block] * self.size, self.op))
            if self.avg:
                result /= self.size
        elif kind == STACKED or kind == ALL_TO_ALL:
            self.complete(([buf, self.byte], [recv, self.byte]))
        elif kind == GATHER:
            self.complete(([buf, self.byte], [recv, self.byte], root))
        else:  # SCATTER (only the root's buf is read)
            self.complete(([buf, self.byte] if root == self.rank else None, [recv, self.byte], root))
        return result

    def result_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the result of x's ``shape`` (the calls that make a new array)."""
        kind = self.kind
        if kind == REDUCE_SCATTER:
            return (shape[0] // self.size, *shape[1:])
        if kind == STACKED or kind == GATHER:
            return (self.size, *shape)
        if kind == SCATTER:
            return tuple(shape[1:])
        return tuple(shape)

    def complete(self, args: tuple[Any, ...]) -> None:
        """One MPI call of ``args``, blocking: the blocking call when there is no timeout, else the
        nonblocking one completed against the deadline (a small one is complete within its first
        polls: no wait then), as ``MPIChannel._call``."""
        channel = self.channel
        if channel.timeout is None:
            self.blocking(*args)
            return
        request = self.start(*args)
        test = request.Test
        for _ in range(self.polls):
            if test():
                return
        channel._wait(request)


def move_class() -> type[Move]:
    """:class:`Move` compiled (``collectives.backends._moves_c``) where it was built from this
    source and ``COLLECTIVES_COMPILED`` leaves it on, else this module's."""
    module = config.compiled_extension(f"{__package__}._moves_c", sys.modules[__name__])
    return Move if module is None else module.Move
