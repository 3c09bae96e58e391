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

The compiled form calls MPI itself where it can bind the calls (mpi_moves.pxd's ``bind_direct``):
MPI_Gather, MPI_Igather and MPI_Test (and the like) as the process resolves them, as the check's
round calls MPI_Start and MPI_Test (backends/mpi_round.py: a PMPI tool preloaded sees them), on the
buffers' memory, the communicator's, datatype's and op's handles read from mpi4py once per Move; a
nonblocking call writes its request into an mpi4py Request kept by the Move (:attr:`request`), so
the channel's wait takes it as it takes mpi4py's. mpi4py's own call is most of a raw call's host
work (its message parsing: ~5k of raw ``Comm.Gather``'s ~10k instructions, MPI's ~1k). The Python
form, and a compiled one that could not bind them, makes mpi4py's calls: the same MPI calls on the
same memory.

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

try:
    import cython
except ImportError:  # (the Python form where Cython is not installed)
    from types import SimpleNamespace

    cython = SimpleNamespace(compiled=False)

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
    ``start``: the mpi4py call and its nonblocking form (the compiled form binds the MPI calls of
    their names); ``new(buf, shape, out)``: a result and its buffer (``numpy``: the result is a
    numpy array, an ``out=`` its own buffer); ``avg``: the result divided by the size;
    ``staged``: the staged request's run of a small call under a timeout (``mpi_staged.staged``,
    set once made: it takes :meth:`result_shape`), or None."""

    __slots__ = ("kind", "channel", "blocking", "start", "new", "staged", "spec", "op", "byte", "in_place",
                 "most", "rank", "size", "polls", "avg", "numpy", "request", "direct")

    def __init__(self, channel: Any, kind: int, blocking: Any, start: Any, mpi_type: Any, mpi_op: Any,
                 new: Any, numpy: bool, avg: bool, most: int) -> None:
        self.kind, self.channel, self.blocking, self.start, self.new = kind, channel, blocking, start, new
        self.numpy, self.avg, self.most = numpy, avg, most
        self.staged: Any = None
        self.spec, self.op, self.byte, self.in_place = mpi_type, mpi_op, channel._byte, channel._in_place
        self.rank, self.size = channel.rank, channel.size
        #: Tests of a request before the channel's wait.
        self.polls = FAST_POLLS
        #: The request a direct nonblocking call writes (an mpi4py Request: the channel's wait takes it).
        self.request: Any = channel._MPI.Request()
        #: Whether the MPI calls are made directly (the compiled form, where bound).
        self.direct = bind_direct(self, channel._MPI)

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
        if kind == ALL_REDUCE or kind == BROADCAST or kind == REDUCE:
            # (x is the result: in place; off a reduce's root MPI leaves x as it is)
            if kind == REDUCE and root != self.rank:
                self.complete(buf, None, root)
            else:
                self.complete(None if kind != BROADCAST else buf, buf, root)
            if self.avg and (kind == ALL_REDUCE or root == self.rank):
                buf /= self.size
            return buf
        if kind == GATHER and root != self.rank:
            self.complete(buf, None, root)
            return None
        if out is not None and self.numpy:  # (the call path checked it: the result's shape)
            result = recv = out
        else:
            result, recv = self.new(buf, self.result_shape(buf.shape), out)
        # (scatter: only the root's buf is read)
        self.complete(buf if kind != SCATTER or root == self.rank else None, recv, root)
        if self.avg:  # (reduce_scatter's)
            result /= self.size
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

    def complete(self, send: Any, recv: Any, root: Any) -> None:
        """The kind's one MPI call from ``send`` into ``recv`` (x's memory and the result's; None
        where the call takes none: in place, or off the root), blocking: the blocking call when
        there is no timeout, else the nonblocking one completed against the deadline (a small one
        is complete within its first polls: no wait then), as ``MPIChannel._call``. Directly where
        bound (compiled: ``call_direct``), else through mpi4py."""
        channel = self.channel
        if self.direct:
            call_direct(self, send, recv, root, channel.timeout is None)
            return
        args = self.arguments(send, recv, root)
        if channel.timeout is None:
            self.blocking(*args)
            return
        request = self.start(*args)
        test = request.Test
        for _ in range(self.polls):
            if test():
                return
        channel._wait(request)

    def arguments(self, send: Any, recv: Any, root: Any) -> tuple[Any, ...]:
        """mpi4py's arguments of the kind's call (``blocking``'s and ``start``'s)."""
        kind, spec = self.kind, self.spec
        if kind == ALL_REDUCE:
            return (self.in_place, [recv, spec], self.op)
        if kind == BROADCAST:
            return ([recv, self.byte], root)
        if kind == REDUCE:
            if recv is None:
                return ([send, spec], None, self.op, root)
            return (self.in_place, [recv, spec], self.op, root)
        if kind == REDUCE_SCATTER:
            return ([send, spec], [recv, spec], [send.size // self.size] * self.size, self.op)
        byte = self.byte
        if kind == STACKED or kind == ALL_TO_ALL:
            return ([send, byte], [recv, byte])
        return (None if send is None else [send, byte], None if recv is None else [recv, byte], root)

    def waited(self) -> None:
        """A direct nonblocking call's :attr:`request`, not complete within its polls, completed
        by the channel's wait; where that raises (a timeout, a peer gone), the request stays with
        the channel (MPI may still write its buffers) and the next call writes a new one."""
        try:
            self.channel._wait(self.request)
        except BaseException:
            self.request = self.channel._MPI.Request()
            rebind_request(self)
            raise


if not cython.compiled:  # the Python form of the .pxd's C helpers (the compiled module has those)
    def bind_direct(m: Move, MPI: Any) -> bool:
        """Whether the MPI calls are bound for direct calls: never in the Python form."""
        return False

    def rebind_request(m: Move) -> None:
        """The address of a new :attr:`Move.request`'s handle (the compiled form's)."""

    def call_direct(m: Move, send: Any, recv: Any, root: Any, blocking: bool) -> None:
        """The kind's MPI call made directly (the compiled form's; never reached here)."""
        raise NotImplementedError


def move_class() -> type[Move]:
    """:class:`Move` compiled (``collectives.backends._moves_c``) where it was built from this
    source and ``COLLECTIVES_COMPILED`` leaves it on, else this module's."""
    module = config.compiled_extension(f"{__package__}._moves_c", sys.modules[__name__])
    return Move if module is None else module.Move
