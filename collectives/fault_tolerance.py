"""A communicator's fault tolerance (opt-in: ``collectives.init(fault_tolerant=True)``;
:mod:`collectives.elastic`): :class:`FaultTolerance`, the part a
:class:`~collectives.Communicator` holds for ``shrink``, its successors, and what the
call path asks of the transport when a call fails (:meth:`FaultTolerance.rank_failure`). The
transports that can go on after a peer's death implement the hooks (:mod:`collectives.transport`).

Imports: the errors, the transport protocol, the recorder (never the communicator: the one
this part serves is passed in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from .diagnostics import recorder
from .errors import CollectiveError, RankFailure
from .transport import Transport

T = TypeVar("T")


class FaultTolerance:
    """The fault-tolerance state of one communicator ``comm`` over ``transport``: the
    :class:`RankFailure` it raised, its next generation, an error of another thread.

    Of ``comm`` it uses: ``all_reduce`` (admit's count), ``close()``, ``trace_name``,
    ``_timeout_arg``, ``_adopt`` (its class's constructor around a transport), ``_broken``
    (set: unusable) and ``_say_farewell``'s flag."""

    __slots__ = ("_comm", "_transport", "failure", "successor", "_elsewhere")

    def __init__(self, comm: Any, transport: Transport) -> None:
        self._comm, self._transport = comm, transport
        #: The RankFailure the communicator raised (the first), else None.
        self.failure: RankFailure | None = None
        #: The communicator of the next generation (a shrink's or a join's), else None.
        self.successor: Any = None
        # The first error of an operation run for the communicator on another thread (the
        # worker of a "collectives" process group: torch gives its caller a RuntimeError).
        self._elsewhere: CollectiveError | None = None

    def admit(self) -> Any:
        """The next generation with the replacements waiting to join, or the communicator when
        none waits (collective; :meth:`collectives.elastic.State.commit` calls it). A peer lost
        meanwhile is a :class:`RankFailure`: the count the ranks agree on goes through the
        call path, the rest through :meth:`settled`."""
        seen = self._transport._joiners_registered()
        if seen is None:
            return self._comm
        registered = self._comm.all_reduce(np.array([seen], dtype=np.int64), op="max")
        transport = self.settled(self._transport._admit, int(registered[0]))
        return self._comm if transport is None else self.succeed(transport)

    def shrink(self) -> Any:
        """The communicator of the survivors (see ``Communicator.shrink``)."""
        return self.succeed(self.settled(self._transport._shrink))

    def agree(self, flag: bool) -> bool:
        """The AND of ``flag`` over the survivors (see ``Communicator.agree``)."""
        return self.settled(self._transport._agree, flag)

    def settled(self, step: Callable[..., T], *args: Any) -> T:
        """``step(*args)``: a step of the fault-tolerance machinery that talks to the transport
        outside the call path (a shrink, an agreement, an admission). An error the transport
        raised there that means a peer is gone (Gloo's closed connection, MPI's failed process)
        is raised as the :class:`RankFailure` it is, read by :meth:`rank_failure` as the call
        path reads the errors of calls; the library's own errors go on as they are."""
        try:
            return step(*args)
        except (CollectiveError, TypeError, ValueError, MemoryError):
            raise
        except Exception as error:
            failure = self.rank_failure(error)
            if failure is None:
                raise
            raise failure from error

    def succeed(self, transport: Transport) -> Any:
        """Close the communicator; the one of ``transport`` (its next generation) takes over
        (``init()`` returns it from now on)."""
        comm = self._comm
        comm._farewells.said = True  # the survivors know who left: no farewell
        try:
            comm.close()
        except CollectiveError:
            pass  # the failed generation's handles: the transport will not complete them
        name = f"{comm.trace_name.partition('@')[0]}@{transport.generation}"
        self.successor = type(comm)._adopt(transport, timeout=comm._timeout_arg, name=name)
        return self.successor

    def failed_elsewhere(self, error: BaseException) -> None:
        """An operation run for the communicator on another thread raised ``error``."""
        if isinstance(error, CollectiveError) and self._elsewhere is None:
            self._elsewhere = error

    def failure_elsewhere(self) -> RankFailure | None:
        """The :class:`RankFailure` behind an operation that failed on another thread
        (:meth:`failed_elsewhere`), settled by the transport; ``None`` when none failed or the
        transport reads it as no peer's failure."""
        error, self._elsewhere = self._elsewhere, None
        return None if error is None else self.rank_failure(error)

    def rank_failure(self, error: Exception | None) -> RankFailure | None:
        """The transport's reading of ``error`` as a peer's failure (see
        :meth:`Transport._rank_failure`); the first makes the communicator unusable and
        tells the flight recorder which ranks failed, in which generation."""
        failure = self._transport._rank_failure(error)
        if failure is not None and error is not None and self.failure is None:
            self.failure = failure
            self._comm._broken = str(failure)
            recorder.note_failure(self._comm, list(failure.failed_ranks), failure.generation)
        return failure


def check_flag(flag: Any) -> bool:
    """``agree``'s ``flag``: a bool (or 0 or 1), else ``TypeError``."""
    if not isinstance(flag, (bool, int)) or isinstance(flag, int) and flag not in (0, 1):
        raise TypeError(f"flag must be a bool; got {flag!r}")
    return bool(flag)
