"""A communicator's side of the transport contract: the :class:`~collectives.transport.CallContext`
a :class:`~collectives.Communicator` hands the transport it holds (what the transport and its
handles may ask of it: the running call, its timeout error, the peers that left, what an
error means).

Imports: the transport protocol and the errors (the communicator is passed in, not imported).
"""

from __future__ import annotations

from typing import Any

from .errors import CollectiveError
from .transport import CallContext
from .work import Work


class CommunicatorContext(CallContext):
    """A communicator's side of the contract, as its transport sees it."""

    __slots__ = ("_comm",)

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    @property
    def call(self) -> tuple[str, int]:
        return self._comm._operation, self._comm._seq

    @property
    def name(self) -> str:
        name: str = self._comm.trace_name
        return name

    @property
    def broken(self) -> str | None:
        why: str | None = self._comm._why_broken
        return why

    def call_name(self, call: tuple[str, int] | None = None) -> str:
        name: str = self._comm._call_name(call)
        return name

    def timeout_error(self, detail: str = "", call: tuple[str, int] | None = None) -> Exception:
        error: Exception = self._comm._timeout_error(detail, call)
        return error

    def hear_farewells(self, call: tuple[str, int] | None = None) -> None:
        self._comm._hear_farewells(call)

    def mark_broken(self, why: str) -> None:
        self._comm._broken = f"{self._comm!r} is unusable: {why}"

    def has_left(self, rank: int) -> bool:
        return rank in self._comm._left

    def await_work(self, work: Work, seconds: float) -> None:
        self._comm._await(work, seconds)

    def map_error(self, error: Exception) -> Exception:
        if isinstance(error, CollectiveError):
            return error
        mapped: Exception = self._comm._transport_error(error)
        return mapped
