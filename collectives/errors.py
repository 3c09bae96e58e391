"""Errors raised by collectives.

Bad arguments are ordinary ``TypeError`` / ``ValueError`` raised before anything
is sent. Everything that goes wrong once ranks talk to each other is a
``CollectiveError`` (or one of its subclasses).
"""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective failed in the transport (or could not be set up)."""


class BackendUnavailable(CollectiveError):
    """The requested backend cannot run here (missing package, wrong launcher)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A blocking collective did not complete within the communicator's timeout.

    Its message starts with the words of :func:`collectives.errors.timed_out`."""


def timed_out(call: str, limit: str) -> str:
    """The start of every :class:`CollectiveTimeout`'s message: ``call`` (the call and where)
    ``timed out``, and ``limit`` (e.g. "timeout=3s"), the timeout it did not complete within.
    "timed out" and " timeout " are what torch's callers match (its own suite: " (Timed
    out|closed|timeout) "), as for Gloo's and NCCL's timeouts."""
    return f"{call} timed out: it did not complete within its timeout ({limit})"


class CollectiveMismatch(CollectiveError):
    """Ranks called collectives that do not match (operation, op, root, dtype, shape)."""


class PeerLeft(CollectiveMismatch):
    """A peer rank left the communicator (finished, closed it, or failed) before making the call
    this rank waits in: raised at once, naming that rank, instead of waiting for the timeout.
    (Also ``collectives.farewell.PeerLeft``.)"""

    #: (rank, its count of calls, FINISHED or FAILED) of each peer that left.
    left: list[tuple[int, int, int]]


class RankFailure(CollectiveError):
    """A peer rank died (or hung past the timeout) and the communicator can go on without it.

    Raised, on a fault-tolerant communicator (``collectives.init(fault_tolerant=True)``), by
    the pending and the next call of every surviving rank. ``failed_ranks``: the ranks of this
    communicator that failed, ascending; ``generation``: the communicator's generation (0 for
    the first, one more after each :meth:`~collectives.Communicator.shrink` or join).
    ``comm.shrink()`` then gives the communicator of the survivors.
    """

    def __init__(self, message: str, failed_ranks: tuple[int, ...] | list[int] = (),
                 generation: int = 0) -> None:
        super().__init__(message)
        self.failed_ranks: tuple[int, ...] = tuple(sorted(int(r) for r in failed_ranks))
        self.generation = generation

    def __reduce__(self) -> tuple[type[RankFailure], tuple[str, tuple[int, ...], int]]:
        return (RankFailure, (str(self), self.failed_ranks, self.generation))
