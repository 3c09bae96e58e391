"""The communicator's fault-tolerance methods (opt-in: ``collectives.init(fault_tolerant=True)``;
:mod:`collectives.elastic`): ``shrink``, ``agree``, ``generation``, and what the call path asks
of the transport when a call fails (``_rank_failure``). A mixin of
:class:`~collectives.Communicator`, like :mod:`collectives.reliability`; the transports that can
go on after a peer's death implement the hooks (:mod:`collectives.transport`).

Imports: the errors, the transport protocol, the recorder (never the communicator).
"""

from __future__ import annotations

from typing import Any

from .diagnostics import recorder
from .errors import CollectiveError, RankFailure
from .transport import Transport


class FaultTolerance:
    """``Communicator``'s fault-tolerance methods (see the module's text)."""

    # Set by Communicator.__init__ (declared here for the methods that read them).
    _transport: Transport
    _closed: bool
    _failure: RankFailure | None
    _successor: Any
    _farewell_said: bool
    trace_name: str
    _broken: str | None
    _check_open: Any
    close: Any
    _adopt: Any

    def shrink(self) -> Any:
        """The communicator of the ranks still alive, renumbered in this one's order (rank
        ``r`` of the result is the ``r``-th survivor), a generation later (``generation``).

        Collective over the survivors: every surviving rank calls it, typically after a
        :class:`~collectives.RankFailure`; without a failure it is a new communicator of the
        same ranks. Only on a fault-tolerant communicator (``init(fault_tolerant=True)``); the
        others raise :class:`~collectives.BackendUnavailable` naming the transports that can.
        This communicator is closed by it.
        """
        if self._closed:
            self._check_open()
        return self._succeed(self._transport._shrink())

    def agree(self, flag: bool) -> bool:
        """The AND of ``flag`` over the ranks still alive, the same on every one of them, also
        while peers fail (the failed ones take no part). Collective over the survivors; only on
        a fault-tolerant communicator (see :meth:`shrink`)."""
        if not isinstance(flag, (bool, int)) or isinstance(flag, int) and flag not in (0, 1):
            raise TypeError(f"flag must be a bool; got {flag!r}")
        if self._closed:
            self._check_open()
        return self._transport._agree(bool(flag))

    @property
    def generation(self) -> int:
        """0 for a communicator made by ``init()``; one more after each :meth:`shrink` (or join
        of replacements, :mod:`collectives.elastic`); a ``split()`` has its parent's."""
        return self._transport.generation

    def _admit(self) -> Any:
        """The next generation with the replacements waiting to join, or this communicator when
        none waits (collective; :meth:`collectives.elastic.State.commit` calls it)."""
        transport = self._transport._admit()
        return self if transport is None else self._succeed(transport)

    def _succeed(self, transport: Transport) -> Any:
        """Close this communicator; the one of ``transport`` (its next generation) takes over
        (``init()`` returns it from now on)."""
        self._farewell_said = True  # the survivors know who left: no farewell
        try:
            self.close()
        except CollectiveError:
            pass  # the failed generation's handles: the transport will not complete them
        name = f"{self.trace_name.partition('@')[0]}@{transport.generation}"
        successor = type(self)._adopt(transport, timeout=self._timeout_arg, name=name)  # type: ignore[attr-defined]
        self._successor = successor
        return successor

    #: The first error of an operation run for this communicator on another thread (the
    #: worker of a "collectives" process group: torch gives its caller a RuntimeError).
    _elsewhere: CollectiveError | None = None

    def _failed_elsewhere(self, error: BaseException) -> None:
        if isinstance(error, CollectiveError) and self._elsewhere is None:
            self._elsewhere = error

    def _failure_elsewhere(self) -> RankFailure | None:
        """The :class:`RankFailure` behind an operation that failed on another thread
        (:meth:`_failed_elsewhere`), settled by this communicator's transport; ``None`` when
        none failed or the transport reads it as no peer's failure."""
        error, self._elsewhere = self._elsewhere, None
        return None if error is None else self._rank_failure(error)

    def _rank_failure(self, error: Exception | None) -> RankFailure | None:
        """The transport's reading of ``error`` as a peer's failure (see
        :meth:`Transport._rank_failure`); the first makes this communicator unusable and
        tells the flight recorder which ranks failed, in which generation."""
        failure = self._transport._rank_failure(error)
        if failure is not None and error is not None and self._failure is None:
            self._failure = failure
            self._broken = str(failure)
            recorder.note_failure(self, list(failure.failed_ranks), failure.generation)
        return failure

