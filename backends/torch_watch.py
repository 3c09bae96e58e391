"""Timeouts of the torch route's calls on CUDA streams, without a host wait: what the watch of a
torch transport (backends/stream_watch.py's :class:`~.stream_watch.StreamWatch`, looked at by the
process's one watchdog thread) is handed.

A blocking NCCL call through torch returns once it is enqueued on the caller's current stream. Under
a timeout, a stream-ordered call (``Transport._stream_ordered``: a CUDA tensor, or a CuPy array, on
a group with NCCL) is wrapped by :func:`watched`: once the row's method returned, a pooled
``torch.cuda.Event`` (:class:`CudaEvents`) is recorded after it on the stream it ran on and goes on
the transport's watch with the deadline: enqueue time plus the timeout. An asynchronous call's own
handle goes on the watch instead (:data:`WORKS`: torch's ``Work.is_completed()``, which for NCCL
queries the call's end event). Past the deadline the transport aborts the NCCL backend of its
group and hands the :class:`~collectives.CollectiveTimeout` naming the call to
``CallContext.fail_later`` (``TorchGroup._expired``).

Imports: nothing of the library (torch is handed in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CudaEvents:
    """torch's CUDA events as a watch's library: ``pool`` holds the completed ones for the next
    calls, ``made`` counts those made (the pool grows to the calls in flight within one period
    of the watchdog)."""

    __slots__ = ("pool", "made", "_event")

    def __init__(self, torch: Any) -> None:
        self.pool: list[Any] = []
        self.made = 0
        self._event = torch.cuda.Event

    def new_event(self) -> Any:
        self.made += 1
        return self._event()

    @staticmethod
    def query(event: Any) -> bool:
        return bool(event.query())


class _Works:
    """torch's handles of asynchronous calls as a watch's events (added, never pooled)."""

    pool: list[Any] = []  # (unused: a handle is its call's own)

    @staticmethod
    def query(work: Any) -> bool:
        try:
            return bool(work.is_completed())
        except Exception:  # noqa: BLE001  (it failed: completed; its wait() raises)
            return True


#: The library of the handles of asynchronous calls.
WORKS = _Works()


def watched(transport: Any, method: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``method`` (a row's, taking the call's ``Request``), followed, under a timeout, by the watch
    of a stream-ordered call: a blocking call's pooled event recorded on the stream it ran on
    (``transport._stream_of``: ``None`` where the call is not stream-ordered) and posted on the
    transport's watch, here (the call's hot line: no frame more); an asynchronous call's handle
    (``transport._stream_ordered``) by ``transport._watch_handle``. Bound once per kind of call
    (``TorchTransport._method_of``), after the communicator took the transport."""
    stream_ordered, stream_of, watch_handle = transport._stream_ordered, transport._stream_of, \
        transport._watch_handle
    context = transport.context

    def run(r: Any) -> Any:
        result = method(r)
        timeout = transport.timeout
        if timeout is None:
            return result
        if r.async_op:
            if stream_ordered(r.x):
                watch_handle(result, timeout)
            return result
        stream = stream_of(r.x, r.adapter)
        if stream is not None:
            (transport._stream_watch or transport._start_watch()).post(
                transport._events or transport._cuda_events(), stream, context.call, timeout)
        return result

    return run
