# run: python examples/threads_transport.py
"""A whole backend in about 60 lines: the ranks are threads of one process, numpy arrays only.

:class:`ThreadsTransport` implements what collectives.transport.Transport requires
(all_reduce, broadcast, all_gather, reduce_scatter, send, recv, barrier, split, construction)
on one rendezvous, :class:`Room`; a :class:`collectives.Communicator` holds it, and everything
else (reduce, gather, scatter, all_to_all, the uneven collectives, the argument checks,
sequence numbers, fingerprints, timeouts, the flight recorder) comes from the library.
docs/architecture.md walks through it; tests/collective_calls/test_example_transport.py runs
the dtype x op grid over it.
"""

from __future__ import annotations

import functools
import queue
import threading
from typing import Any

import numpy as np

from collectives import Communicator, ReduceOp, Work
from collectives.calls import Request
from collectives.errors import BackendUnavailable
from collectives.transport import Transport

UFUNCS = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
          ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum, ReduceOp.BAND: np.bitwise_and,
          ReduceOp.BOR: np.bitwise_or, ReduceOp.BXOR: np.bitwise_xor}


class Room:
    """What the threads share: a slot per rank and a barrier, plus a mailbox per (src, dst, tag)."""

    def __init__(self, size: int) -> None:
        self.slots: list[Any] = [None] * size
        self.gate = threading.Barrier(size, timeout=60)
        self.mail: dict[tuple[int, int, int], queue.Queue[Any]] = {}
        self.lock = threading.Lock()

    def exchange(self, rank: int, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (collective: every rank calls it)."""
        self.slots[rank] = value
        self.gate.wait()
        everyone = list(self.slots)
        self.gate.wait()  # nobody overwrites a slot before every rank has read them all
        return everyone

    def box(self, src: int, dst: int, tag: int) -> queue.Queue[Any]:
        with self.lock:
            return self.mail.setdefault((src, dst, tag), queue.Queue())


class Receive(Work):
    """A posted recv: ``wait()`` takes the next message of its mailbox into ``x``."""

    def __init__(self, x: Any, box: queue.Queue[Any]) -> None:
        super().__init__(x)
        self.box, self.done = box, False

    def wait(self) -> Any:
        if not self.done:
            self._x[...], self.done = self.box.get(timeout=60), True
        return self._x

    def is_completed(self) -> bool:
        return self.done or not self.box.empty()


class ThreadsTransport(Transport):
    backend = "threads"

    def __init__(self, room: Room, rank: int) -> None:
        super().__init__(rank, len(room.slots), rank)
        self.room = room

    @classmethod
    def from_launcher(cls, launch: Any, *, timeout: Any = None) -> ThreadsTransport:
        raise BackendUnavailable("the threads backend is made in-process: ThreadsTransport(room, rank)")

    def _check_device(self, x: Any, adapter: Any) -> None:
        if not isinstance(x, np.ndarray):
            raise TypeError(f"the threads backend takes numpy arrays; got {type(x).__name__}")

    def _all_reduce(self, r: Request) -> Any:
        result = functools.reduce(UFUNCS[r.op], self.room.exchange(self.rank, r.x.copy()))
        r.x[...] = result / self.size if r.op is ReduceOp.AVG else result
        return Work(r.x) if r.async_op else None

    def _broadcast(self, r: Request) -> Any:
        r.x[...] = self.room.exchange(self.rank, r.x.copy())[r.root]
        return Work(r.x) if r.async_op else None

    def _all_gather(self, r: Request) -> Any:
        gathered = np.stack(self.room.exchange(self.rank, r.x.copy()), out=r.out)
        return Work(gathered) if r.async_op else gathered

    def _reduce_scatter(self, r: Request) -> Any:
        whole = np.ascontiguousarray(r.x).copy()
        self._all_reduce(r._replace(x=whole, async_op=False))
        block = np.array_split(whole, self.size)[self.rank]
        result = block.copy() if r.out is None else r.out
        result[...] = block
        return Work(result) if r.async_op else result

    def _send(self, r: Request) -> Any:
        self.room.box(self.rank, r.root, r.extra).put(r.x.copy())
        return Work(None) if r.async_op else None

    def _recv(self, r: Request) -> Any:
        work = Receive(r.x, self.room.box(r.root, self.rank, r.extra))
        return work if r.async_op else work.wait() and None

    def _barrier(self) -> None:
        self.room.exchange(self.rank, None)

    def _split(self, color: int | None, key: int) -> ThreadsTransport | None:
        groups = self.room.exchange(self.rank, (color, key))
        members = sorted((k, r) for r, (c, k) in enumerate(groups) if c == color and color is not None)
        rooms = self.room.exchange(self.rank, Room(len(members)) if members and members[0][1] == self.rank else None)
        if color is None:
            return None
        return ThreadsTransport(rooms[members[0][1]], [r for _, r in members].index(self.rank))


def run_ranks(size: int, body: Any) -> list[Any]:
    """``body(comm)`` on ``size`` threads, one rank each; their results in rank order."""
    room, results, errors = Room(size), [None] * size, []

    def rank(r: int) -> None:
        try:
            with Communicator(ThreadsTransport(room, r), timeout=60) as comm:
                results[r] = body(comm)
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            errors.append(error)
            room.gate.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if errors:
        raise errors[0]
    return results


if __name__ == "__main__":
    sums = run_ranks(3, lambda comm: comm.all_reduce(np.arange(4.0) + comm.rank))
    assert all((got == np.arange(4.0) * 3 + 3).all() for got in sums), sums
    gathered = run_ranks(3, lambda comm: comm.gather(np.full(2, comm.rank), dst=0))
    assert (gathered[0] == [[0, 0], [1, 1], [2, 2]]).all() and gathered[1] is None
    print(f"threads backend: all_reduce over 3 threads gave {sums[0]}; gather (emulated) gave {gathered[0].tolist()}")
