"""send's and recv's fast paths on the MPI transport (``MPITransport._fast_point_to_point``): a
contiguous host x of at most ``MAX_COUNT`` bytes goes to MPI as it is, in as few steps as raw
mpi4py takes.

:class:`PointToPoint` is the one source of both forms: this module runs as Python where nothing
was compiled (or ``COLLECTIVES_COMPILED=0``), and is compiled as it stands by Cython (the module
``collectives.backends._p2p_c``, setup.py's ``COMPILED``, with the types of backends/mpi_p2p.pxd)
where it was built: the same steps, the interpreter's cost of its own gone. A transport keeps the
form it was made with (:func:`point_to_point_class`).

Without a timeout a send is MPI_Send; under one, and for every recv, the nonblocking call on x's
memory, its fast polls (a small message is complete within them: no frame more), then the
channel's own wait (the deadline, the farewells). A recv whose message is shorter than x raises
(MPI refuses a longer one).

Imports: collectives' calls and config, and the MPI backend's mpi_requests (never the channel's
module: the channel is handed in).
"""

from __future__ import annotations

import sys
from typing import Any

from collectives import config
from collectives.calls import NOT_TAKEN

from .mpi_requests import FAST_POLLS


class PointToPoint:
    """send's fast path on ``channel`` (an MPIChannel), or recv's where ``receives``, for x of
    ``dtype`` (what a short message's error names) and at most ``most`` bytes:
    :meth:`run` is the transport's fast path (``run(buf, peer, out, tag)``: None for a send,
    ``buf`` for a recv, or NOT_TAKEN past ``most``)."""

    __slots__ = ("receives", "most", "polls", "channel", "blocking", "start", "byte", "status", "dtype")

    def __init__(self, channel: Any, receives: bool, dtype: str, most: int) -> None:
        comm = channel._comm
        self.receives, self.dtype, self.most, self.channel = receives, dtype, most, channel
        #: Tests of a request before the channel's wait.
        self.polls = FAST_POLLS
        #: The blocking call (a send without a timeout) and the nonblocking one.
        self.blocking: Any = None if receives else comm.Send
        self.start = comm.Irecv if receives else comm.Isend
        self.byte = channel._byte
        #: The MPI.Status a recv's tests fill (who sent, how many bytes).
        self.status: Any = channel._MPI.Status() if receives else None

    def run(self, buf: Any, peer: Any, out: Any, tag: Any) -> Any:
        """``buf`` (x's contiguous host memory) sent to ``peer``, or received from it, with ``tag``."""
        nbytes = buf.nbytes
        if nbytes > self.most:
            return NOT_TAKEN
        channel = self.channel
        if not self.receives:
            if channel.timeout is None:  # (COLLECTIVES_TIMEOUT=0: the blocking call, as it promises)
                self.blocking([buf, self.byte], peer, tag)
                return None
            request = self.start([buf, self.byte], peer, tag)
            test = request.Test
            for _ in range(self.polls):
                if test():
                    return None
            channel._wait(request)
            return None
        status = self.status
        request = self.start([buf, self.byte], peer, tag)
        test = request.Test
        done = False
        for _ in range(self.polls):  # (a message a moment behind: no frame more)
            if test(status):
                done = True
                break
        if not done:
            channel._complete_request(request, channel.context.call, status)
        got = status.Get_count(self.byte)
        if got != nbytes:
            raise short_message(peer, tag, got, nbytes, buf.shape, self.dtype)
        return buf


def short_message(src: int, tag: int, got: int, holds: int, shape: Any, dtype: str) -> ValueError:
    """A recv's error for a message shorter than x (MPI refuses a longer one: MPI_ERR_TRUNCATE)."""
    return ValueError(f"recv from rank {src} (tag {tag}) got {got} bytes, but x holds {holds} (shape "
                      f"{tuple(shape)}, {dtype}): the sender's array has another shape or dtype")


def point_to_point_class() -> type[PointToPoint]:
    """:class:`PointToPoint` compiled (``collectives.backends._p2p_c``) where it was built from
    this source and ``COLLECTIVES_COMPILED`` leaves it on, else this module's."""
    module = config.compiled_extension(f"{__package__}._p2p_c", sys.modules[__name__])
    return PointToPoint if module is None else module.PointToPoint
