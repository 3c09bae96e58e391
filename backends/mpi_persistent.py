"""MPI-4 persistent collectives, one per kind of call and buffer: repeated calls on the same
memory (DDP's buckets, a loop's fixed buffers) become ``MPI_Start`` + completion, cheaper than
a nonblocking call (the timeout's path) and than a raw caller's blocking one.

A persistent collective is made by a collective call (``MPI_Allreduce_init``, ...) that every
rank must make at the same point, and a started one matches only the same request on the
other ranks: whether a call goes through one must be the same decision on every rank, though
the buffers that decide it are each rank's own. The ranks agree in the word the call path
already exchanges before every collective (the default check): each rank puts in
:meth:`PersistentCollectives.bits` whether it holds a request for this kind of call on this
very buffer (``HAVE``) and whether the buffer is the one of the last call of this kind
(``SAME``); the reduction (bitwise AND) of everyone's bits is then
:meth:`PersistentCollectives.agreed`'s to act on, the same on every rank:

- every rank has one: each starts its own (they come from one ``*_init`` call: a kind's
  request is only ever made by all ranks together, replacing the old one on all);
- every rank has the same buffer as last time, not all a request: every rank makes one
  (the kind's old request freed), and starts it;
- else: the ordinary call (``None``).

A request pins its buffer: it holds the array, so numpy cannot resize it and its memory
stays where the request points. It is released when the buffer goes: :meth:`sweep`
frees the requests whose array nobody but this cache holds any more; it runs before a
request is made, every :data:`SWEEP_EVERY` starts, and the communicator's close frees them
all (:meth:`close`, before the communicator is freed: MPICH prints "freeing inactive
persistent request" for requests left on a communicator it frees, which a user must never
see). At most :data:`MAX_KINDS` kinds of call hold a request; one more frees the oldest.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from typing import Any

#: The bits of :meth:`PersistentCollectives.bits`.
HAVE = 1  # this rank holds a request for this kind of call on this buffer
SAME = 2  # this rank's buffer is the one of its last call of this kind

#: Kinds of call (kind, dtype, op or root, shape) that hold a request at most.
MAX_KINDS = 64
#: Starts between two sweeps for requests whose buffer only this cache still holds.
SWEEP_EVERY = 256


class _Entry:
    __slots__ = ("owner", "address", "request", "ours")

    def __init__(self, owner: Any, address: int, request: Any, ours: int) -> None:
        self.owner, self.address, self.request = owner, address, request
        # References to owner this cache holds (itself and through the request).
        self.ours = ours


class PersistentCollectives:
    """Persistent requests of one ``mpi4py.MPI.Comm``, keyed by kind of call (any hashable:
    the call, dtype, reduce op or root, shape) and bound to one array each.

    ``address(owner)``: where the owner's memory is now (a torch tensor's ``set_`` moves it
    under the same shape); a request is used only while it is where the request points."""

    def __init__(self, comm: Any, MPI: Any) -> None:
        self._comm, self._MPI = comm, MPI
        self._entries: dict[Hashable, _Entry] = {}
        self._last: dict[Hashable, int] = {}  # kind -> id of the last call's owner
        self._starts = 0
        #: Whether the library has persistent collectives (MPI >= 4).
        self.available = hasattr(comm, "Allreduce_init") and _has_persistent_collectives(comm, MPI)

    def __len__(self) -> int:
        return len(self._entries)

    def bits(self, kind: Hashable, owner: Any, address: int) -> int:
        """This rank's :data:`HAVE` and :data:`SAME` for a call of ``kind`` on ``owner``
        (local: no communication), to be reduced with bitwise AND over the ranks."""
        entry = self._entries.get(kind)
        have = entry is not None and entry.owner is owner and entry.address == address
        same = self._last.get(kind) == id(owner)
        self._last[kind] = id(owner)
        return (HAVE if have else 0) | (SAME if same else 0)

    def agreed(self, bits: int, kind: Hashable, owner: Any, address: int,
               make: Callable[[], Any]) -> Any:
        """Act on every rank's :meth:`bits`, reduced (bitwise AND): the started request of
        ``kind`` (the rank's own, or one made now by ``make()``, collective, on every rank),
        or ``None``: the ordinary call. Every rank acts alike, since every rank sees the same
        ``bits``."""
        if bits & HAVE:
            request = self._entries[kind].request
        elif bits & SAME:
            request = self._make(kind, owner, address, make)
        else:
            return None
        request.Start()
        self._starts += 1
        if self._starts % SWEEP_EVERY == 0:
            self.sweep()
        return request

    def _make(self, kind: Hashable, owner: Any, address: int, make: Callable[[], Any]) -> Any:
        self.release(kind)
        self.sweep()
        if len(self._entries) >= MAX_KINDS:
            self.release(next(iter(self._entries)))  # the oldest
        before = sys.getrefcount(owner)
        request = make()
        entry = _Entry(owner, address, request, 0)
        self._entries[kind] = entry
        entry.ours = sys.getrefcount(owner) - before
        return request

    def release(self, kind: Hashable) -> None:
        """Free the request of ``kind`` (local), if there is one."""
        entry = self._entries.pop(kind, None)
        if entry is not None:
            self._free(entry.request)

    def sweep(self) -> int:
        """Free the requests whose array only this cache still holds; returns how many."""
        # (getrefcount's argument is the one reference beyond ours)
        gone = [kind for kind, entry in self._entries.items()
                if sys.getrefcount(entry.owner) - 1 <= entry.ours]
        for kind in gone:
            self.release(kind)
        return len(gone)

    def close(self) -> None:
        """Free every request (before the communicator is freed)."""
        for kind in list(self._entries):
            self.release(kind)
        self._last.clear()

    def _free(self, request: Any) -> None:
        MPI = self._MPI
        if not MPI.Is_finalized() and request != MPI.REQUEST_NULL:
            request.Free()


def _has_persistent_collectives(comm: Any, MPI: Any) -> bool:
    """Whether ``MPI_Barrier_init`` works on ``comm`` (mpi4py has the methods whatever the
    library; an MPI before 4 raises)."""
    try:
        request = comm.Barrier_init()
    except (NotImplementedError, MPI.Exception):
        return False
    request.Free()
    return True
