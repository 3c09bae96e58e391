"""The planned calls of the cupy backend (backends/cupy_plans.py makes them): what each later call
of a planned kind runs, bound at the kind's first call. :class:`ArrayCheck`, the per-array check
of one array library's planned kinds, and :class:`PlannedCall`, the NCCL call of one planned kind
(all_reduce of a kind NCCL reduces as it is, broadcast): its blocking fast path
(:meth:`PlannedCall.fast`) and its method (:meth:`PlannedCall.method`, the asynchronous calls).

The compiled form (setup.py's ``COMPILED``: ``collectives.backends._cupy_fast_c``) is this file,
compiled by Cython with the types of cupy_fast.pxd: the classes are ``cdef class`` es whose fields
are C reads, so a call crosses no Python frame between the call path and NCCL's call but the
library's own (the stream getter, the event's record). It imports nothing of CuPy
or torch (the array library's calls are handed in), so it is built and counted without them.

Also here, so that it is compiled: :func:`watch_post`, the steps of ``StreamWatch.post``
(backends/stream_watch.py), which the planned calls make without its frame.

Imports: nothing of the library but the recorder's clock and the handles' base (collectives.work);
its parts are handed in by cupy_plans.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collectives.work import Work

try:
    import cython
except ImportError:  # (the Python form where Cython is not installed)
    from types import SimpleNamespace

    cython = SimpleNamespace(compiled=False)

if not cython.compiled:  # (compiled: the call path's _clock, the same clock read in C: cupy_fast.pxd)
    from collectives.diagnostics.recorder import clock as _clock


class ArrayCheck:
    """The per-array check of the planned kinds of one array library (see
    ``Transport._array_check``): :meth:`check`. ``adapter``: the library's ArrayAdapter;
    ``cupy_arrays``: CuPy's arrays, else torch's tensors (``tensor`` and ``strided``:
    torch.Tensor and torch.strided); ``device``: the communicator's CUDA device;
    ``check_device(x, adapter)`` and the adapter's ``check_array``: the checks that name the
    fault, run where the one test fails."""

    def __init__(self, adapter: Any, cupy_arrays: bool, device: int, check_device: Callable[[Any, Any], None],
                 tensor: Any = None, strided: Any = None) -> None:
        self.adapter, self.cupy_arrays, self.device = adapter, cupy_arrays, device
        self.check_array, self.check_device = adapter.check_array, check_device
        self.tensor, self.strided = tensor, strided

    def check(self, x: Any, in_place: bool) -> Any:
        """``x`` itself where NCCL takes its memory as it is (on the device, C-contiguous, so no
        zero stride: writable in place; a tensor dense, without a negative bit, not requiring
        grad), else the checks' verdict, in the call path's order (their error, or ``None``:
        the row's method takes x)."""
        if self.cupy_arrays:
            # (the memory's device id: x.device would make a cupy.cuda.Device per call)
            if x.data.device_id == self.device and x.flags.c_contiguous:
                return x
        # (get_device(), an int: x.device would make a torch.device per call)
        elif x.is_cuda and x.get_device() == self.device and type(x) is self.tensor and \
                x.layout is self.strided and not x.is_nested and x.is_contiguous() and \
                not x.requires_grad and not x.is_neg():
            return x
        self.check_array(x, in_place)
        self.check_device(x, self.adapter)
        return None


class PlannedCall:
    """The NCCL call of one planned kind on a ``CupyNcclChannel`` (``transport``): ``launch``, the
    NCCL communicator's bound call (``allReduce`` or ``broadcast``, in place); ``nccl_type`` its
    ncclDataType_t, ``width`` the bytes of an element of that type; ``rooted``: the call takes
    the root where an all_reduce takes ``nccl_op``, its ncclRedOp_t; ``library``: the stream API
    of the array kind (its ``current_stream``); ``cupy_arrays``: CuPy's arrays, else torch's;
    ``open_groups``: the threads with an open NCCL group (cupy_handles.OPEN_GROUPS); ``fallback``:
    the row's method, for the calls the method does not take; ``operation``: the row's name.

    A watched call names itself as ``context.call`` does, without its property's frame: the
    row's name (the running call's, as this kind runs only in its row's calls) and the number the
    communicator (the context's ``comm``) gave it, its ``_seq``, as the default check reads it."""

    def __init__(self, transport: Any, launch: Callable[..., None], nccl_type: int, width: int, rooted: bool,
                 nccl_op: int, library: Any, cupy_arrays: bool, open_groups: Any,
                 fallback: Callable[[Any], Any], operation: str) -> None:
        self.transport, self.launch, self.nccl_type, self.width = transport, launch, nccl_type, width
        self.rooted, self.nccl_op, self.library, self.cupy_arrays = rooted, nccl_op, library, cupy_arrays
        self.open_groups, self.fallback, self.operation = open_groups, fallback, operation
        self.current_stream, self.context = library.current_stream, transport.context
        self.comm = self.context.comm
        self.inflight: Any = None  # (the watch's calls in flight and free entries, from the first watched call)
        self.free: list[Any] = []

    def fast(self, x: Any, root: Any, out: Any, extra: Any) -> Any:
        """The blocking call of ``x`` (which the check took): enqueued on the current stream,
        then, with a timeout, on the watch (``CupyNcclChannel._watch_blocking``'s line, here:
        a frame less); returns ``x``."""
        stream = self.enqueue(x, root)
        timeout = self.transport.timeout
        if timeout is not None:
            if self.inflight is None:
                self.open_watch()
            watch_post(self.inflight, self.free, self.library, stream, self.operation, self.comm._seq, timeout)
        return x

    def method(self, r: Any) -> Any:
        """The row's method for this kind (a ``Request``): an asynchronous call of an ``x`` the
        check took (``r.view``) records a pooled event after itself and returns its
        :class:`PlannedWork` (with a timeout, the event is on the watch, which gives it back to its
        pool once complete; without, the handle does); every other call goes to ``fallback``."""
        x = r.view
        if x is None or not r.async_op:
            return self.fallback(r)
        stream = self.enqueue(x, r.root)
        library = self.library
        event = pooled_event(library, stream)
        seq = self.comm._seq
        timeout = self.transport.timeout
        entry = None
        if timeout is not None:
            if self.inflight is None:
                self.open_watch()
            entry = watch_entry(self.inflight, self.free, library, event, self.operation, seq, timeout)
        return PlannedWork(x, self, event, entry, seq)

    def open_watch(self) -> None:
        """Keep the transport's watch's calls in flight and free entries (the watch made at the
        transport's first watched call)."""
        watch = self.transport._stream_watch or self.transport._start_watch()
        self.inflight, self.free = watch._inflight, watch._free

    def enqueue(self, x: Any, root: Any) -> Any:
        """NCCL's call on ``x`` on the current stream (this thread's open group of sends and
        recvs launched first, if there is one); the stream."""
        stream = self.current_stream()
        if self.open_groups:
            self.transport._flush_group()
        # x's pointer and the stream's, read as attributes: a getter object's call costs the
        # interpreter more than the rest of the line.
        if self.cupy_arrays:
            ptr, stream_ptr = x.data.ptr, stream.ptr
        else:
            ptr, stream_ptr = x.data_ptr(), stream.cuda_stream
        self.launch(ptr, ptr, x.nbytes // self.width, self.nccl_type, root if self.rooted else self.nccl_op,
                    stream_ptr)
        return stream


def watch_post(inflight: Any, free: list[Any], library: Any, stream: Any, operation: str, seq: int,
               seconds: float) -> Any:
    """``StreamWatch.post`` (backends/stream_watch.py) on the watch's ``inflight`` and ``free``
    entries: an event recorded after call ``seq`` (``operation``) just enqueued on ``stream`` (a
    pooled one of ``library``'s, else a new one), watched against the deadline ``seconds`` from
    now; returns the event."""
    event = pooled_event(library, stream)
    watch_entry(inflight, free, library, event, operation, seq, seconds)
    return event


def pooled_event(library: Any, stream: Any) -> Any:
    """An event of ``library``'s pool (else a new one) recorded on ``stream``."""
    pool = library.pool
    event = pool.pop() if pool else library.new_event()
    event.record(stream)
    return event


def watch_entry(inflight: Any, free: list[Any], library: Any, event: Any, operation: str, seq: int,
                seconds: float) -> list[Any]:
    """The watch's entry of call ``seq`` (``operation``), whose pooled ``event`` (of ``library``)
    was just recorded, on ``inflight`` (a free entry, else a new one) with the deadline ``seconds``
    from now; the watch gives the event back to its pool once complete (and then clears the
    entry's event: see :class:`PlannedWork`)."""
    if free:
        entry: list[Any] = free.pop()
        entry[0], entry[1], entry[2], entry[3], entry[4], entry[5] = \
            library, event, _clock() + seconds, operation, seq, True
    else:
        entry = [library, event, _clock() + seconds, operation, seq, True]
    inflight.append(entry)
    return entry


class PlannedWork(Work):
    """The handle of an asynchronous call of a planned kind (:meth:`PlannedCall.method`): ``x``,
    its ``planned`` call, the pooled ``event`` recorded after it and, under a timeout, its
    watch's ``entry`` (else ``None``: the handle gives the event back to its pool once it learns
    the call completed). As ``_StreamWork`` (backends/cupy_handles.py), ``wait()`` only makes the
    then-current stream wait for the event, and raises the communicator's failure where the
    watchdog found one first.

    The event is the call's while the entry still holds it for call ``seq``: the watch takes a
    completed call's entry off (clearing its event) before the event goes back to the pool, and
    only the communicator's own thread takes events from it, so a handle never waits for or asks
    an event recorded again by a later call (that call completed: so did this one)."""

    __slots__ = ("_planned", "_event", "_entry", "_seq", "_completed")

    def __init__(self, x: Any, planned: PlannedCall, event: Any, entry: list[Any] | None, seq: int) -> None:
        self._x = x
        self._planned, self._event, self._entry, self._seq, self._completed = planned, event, entry, seq, False

    def wait(self) -> Any:
        if not self._completed:
            planned = self._planned
            context = planned.context
            if context.broken:  # aborted: the call may have ended early, its result is not trusted
                raise context.failure()
            if planned.open_groups:  # (launched first: a later wait in the group may need it)
                planned.transport._flush_group()
            entry, event = self._entry, self._event
            if entry is None or (entry[1] is event and entry[4] == self._seq):  # (the event is the call's)
                planned.library.wait_event(event, self._x)
            else:  # (the watch took the call off: it completed)
                self._completed, self._event, self._entry = True, None, None
        return self._x

    def is_completed(self) -> bool:
        if self._completed:
            return True
        entry, event = self._entry, self._event
        library = self._planned.library
        if entry is None:  # (the handle's own event: back to its pool once complete)
            if not library.query(event):
                return False
            library.pool.append(event)
        elif entry[1] is event and entry[4] == self._seq and not library.query(event):
            return False
        self._completed, self._event, self._entry = True, None, None
        return True

