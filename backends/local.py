"""World size 1 without any transport: the default when no launcher started the process.

Same checks and semantics as every other backend; with one rank every reduction
is the identity (AVG divides by 1), so nothing is computed.
"""

from __future__ import annotations

from typing import Any

from collectives.calls import Request
from collectives.communicator import Communicator
from collectives.errors import BackendUnavailable
from collectives.launcher import LaunchInfo
from collectives.transport import Transport
from collectives.work import Work


class LocalTransport(Transport):
    """One rank, no peer: every collective is a copy at most."""

    backend = "local"

    def __init__(self, local_rank: int = 0) -> None:
        super().__init__(0, 1, local_rank)

    @classmethod
    def from_launcher(cls, launch: LaunchInfo, *, timeout: Any = None) -> LocalTransport:
        if launch.size != 1:
            raise BackendUnavailable(
                f"backend 'local' runs one rank, but {launch.launcher} started {launch.size}; "
                "use COLLECTIVES_BACKEND=mpi (mpiexec/mpirun/srun), torch or cupy, or auto"
            )
        return cls(launch.local_rank)

    def _all_reduce(self, r: Request) -> Work | None:
        return Work(r.x) if r.async_op else None

    def _broadcast(self, r: Request) -> Work | None:
        return Work(r.x) if r.async_op else None

    def _all_gather(self, r: Request) -> Any:
        x, adapter = r.x, r.adapter
        out = adapter.empty(x, (1, *x.shape)) if r.out is None else r.out
        adapter.copy_(out, x)  # broadcasts x over the leading axis of length 1
        return Work(out) if r.async_op else out

    def _reduce_scatter(self, r: Request) -> Any:
        x, adapter = r.x, r.adapter
        out = adapter.empty(x, tuple(x.shape)) if r.out is None else r.out
        adapter.copy_(out, x)
        return Work(out) if r.async_op else out

    # One rank has no peer: the call path refuses send/recv to this rank before it gets here.
    def _no_peer(self, r: Request) -> Work | None:
        raise AssertionError("unreachable: the only rank of a local communicator has no peer")

    _send = _recv = _no_peer

    def _barrier(self) -> None:
        pass

    def _split(self, color: int | None, key: int) -> LocalTransport | None:
        return None if color is None else LocalTransport(self.local_rank)


class LocalCommunicator(Communicator):
    """The communicator of one rank (no launcher): :class:`LocalTransport`'s."""

    transport_class = LocalTransport

    def __init__(self, local_rank: int = 0, *, timeout: Any = None) -> None:
        # One rank waits for nobody: nothing here can time out, but the value is kept
        # (and checked) like everywhere else.
        super().__init__(LocalTransport(local_rank), timeout=timeout)
