"""The cupy backend's CPU channel: what its default check of calls travels on, beside the NCCL calls.

A call on a CUDA stream returns once enqueued; its check (one small all_reduce of the check word,
collectives/reliability.py) made on the GPU would have the host read the result back, a wait for
the stream on every call. Under an MPI launcher the cupy transport gets :class:`MPIHost` instead,
over MPI communicators of its ranks in its rank order (duplicates of COMM_WORLD, split as the NCCL
communicator is): a call's check word is posted beside it and compared off the call path by the
watchdog thread (:class:`~.posted_checks.PostedChecks` on :attr:`MPIHost.rounds`), and the calls
checked before they move data (the first collective, the uneven ones, the barrier, split) agree on
their word on the host (:meth:`MPIHost.agree`). The two run on two communicators, as they run on two
threads.

Without one (torchrun, or a communicator made around a user's NCCL communicator) the cupy
transport checks only with ``COLLECTIVES_DEBUG=1``, as before.

Made by :func:`collectives.backends.cupy_id.host_channel` (beside the NCCL id's exchange).

Imports: numpy, posted_checks (mpi4py's and torch's modules are handed in).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .posted_checks import MPIRounds, TorchRounds


class MPIHost:
    """A cupy transport's CPU channel over ``comm`` (an mpi4py communicator of the transport's
    ranks in its order, this object's own): :meth:`agree` on it, and the posted checks' rounds on a
    duplicate (:attr:`rounds`)."""

    def __init__(self, MPI: Any, comm: Any) -> None:  # noqa: N803  (mpi4py's module name)
        self._MPI, self._comm = MPI, comm
        #: The posted checks' rounds (the watchdog thread's communicator).
        self.rounds = MPIRounds(MPI, comm.Dup())

    def agree(self, word: int) -> Any:
        """The bitwise AND of every rank's ``word`` started: ``(vector, request)``, the result in
        ``vector[0]`` once ``request.Test()``."""
        vector = np.array([word], dtype=np.int64)
        return vector, self._comm.Iallreduce(self._MPI.IN_PLACE, vector, op=self._MPI.BAND)

    def split(self, color: int | None, key: int) -> MPIHost | None:
        """The channel of the ranks that gave ``color``, ordered by ``key`` then rank, as
        ncclCommSplit orders them (collective over this channel's ranks); ``None`` for no color."""
        MPI = self._MPI
        comm = self._comm.Split(MPI.UNDEFINED if color is None else color, key)
        return None if comm == MPI.COMM_NULL else MPIHost(MPI, comm)

    def free(self) -> None:
        """Free the communicators (once the posted checks are compared or given up)."""
        self.rounds.free()
        self._comm.Free()



class GlooHost:
    """A cupy transport's CPU channel under torchrun: Gloo process groups of its ranks (``rank`` of
    ``size``, in its order) on ``store`` (this channel's own prefix of the rendezvous store), one
    for :meth:`agree`, one for the posted checks' rounds (:attr:`rounds`); ``timeout``: a Gloo
    call's (a ``datetime.timedelta``)."""

    def __init__(self, torch: Any, store: Any, rank: int, size: int, timeout: Any) -> None:
        dist = torch.distributed
        self._torch, self._store, self._rank, self._size, self._timeout = torch, store, rank, size, timeout
        self._group = dist.ProcessGroupGloo(dist.PrefixStore("agree", store), rank, size, timeout)
        #: The posted checks' rounds (the watchdog thread's group).
        self.rounds = TorchRounds(torch, dist.ProcessGroupGloo(dist.PrefixStore("rounds", store), rank, size,
                                                               timeout))
        self._splits = 0

    def agree(self, word: int) -> Any:
        """:meth:`MPIHost.agree`'s, on the Gloo group."""
        vector = np.array([word], dtype=np.int64)
        work = self._group.allreduce([self._torch.from_numpy(vector)], self._torch.distributed.ReduceOp.BAND)
        return vector, _GlooRequest(work)

    def split(self, color: int | None, key: int) -> GlooHost | None:
        """:meth:`MPIHost.split`'s: every rank's (color, key) gathered here, the new groups made
        on the store under the split's number and the color."""
        mine = self._torch.tensor([[-1 if color is None else 0, color or 0, key]], dtype=self._torch.int64)
        everyone = self._torch.empty((self._size, 3), dtype=self._torch.int64)
        self._group._allgather_base(everyone, mine).wait()
        self._splits += 1
        if color is None:
            return None
        rows = everyone.tolist()
        members = sorted((row[2], rank) for rank, row in enumerate(rows) if row[0] == 0 and row[1] == color)
        order = [rank for _, rank in members]
        store = self._torch.distributed.PrefixStore(f"split/{self._splits}/{color}", self._store)
        return GlooHost(self._torch, store, order.index(self._rank), len(order), self._timeout)

    def free(self) -> None:
        """Nothing to free: the groups end with their last reference."""


class _GlooRequest:
    """A Gloo ``Work`` as :meth:`MPIHost.agree`'s request (``Test``, ``Wait``)."""

    __slots__ = ("_work",)

    def __init__(self, work: Any) -> None:
        self._work = work

    def Test(self) -> bool:  # noqa: N802  (mpi4py's names)
        return bool(self._work.is_completed())

    def Wait(self) -> None:  # noqa: N802
        self._work.wait()
