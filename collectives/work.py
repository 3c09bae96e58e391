"""Handles of asynchronous calls: :class:`Work`, and :func:`deliver` for backends.

Every collective takes ``async_op=True`` and then returns a :class:`Work` (or a
subclass a backend defines around its transport's requests); the communicator keeps
the handles that may still be running (see ``Communicator._keep``), so a handle the
caller drops still completes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .arrays import ArrayAdapter


class Work:
    """Handle of an asynchronous collective. ``wait()`` completes it and returns the result
    (``x`` for the in-place collectives, the new array for the others)."""

    def __init__(self, x: Any) -> None:
        self._x = x

    def wait(self) -> Any:
        """Block until the collective has completed; return its result."""
        return self._x

    def is_completed(self) -> bool:
        """Whether the collective has completed (once true, ``wait()`` does not block)."""
        return True


class AllOf(Work):
    """Several handles as one: ``wait()`` waits for each in turn and returns ``None`` (a
    debug-mode send's header and payload; the sends of one torch point-to-point call)."""

    def __init__(self, works: Iterable[Work | None]) -> None:
        super().__init__(None)
        self._works = [work for work in works if work is not None]

    def wait(self) -> Any:
        for work in self._works:
            work.wait()
        return None

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def deliver(adapter: ArrayAdapter, result: Any, out: Any, async_op: bool) -> Any:
    """For backends: ``result`` (copied into ``out`` when the caller passed one), or a
    completed :class:`Work` holding it when ``async_op``."""
    if out is not None and result is not out:
        adapter.copy_(out, result)
        result = out
    return Work(result) if async_op else result

