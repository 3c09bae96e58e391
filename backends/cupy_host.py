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

Imports: posted_checks (mpi4py's module is handed in).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .posted_checks import MPIRounds


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

