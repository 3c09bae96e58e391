"""The torch backend's handles and streams: what an asynchronous torch.distributed call
returns (:class:`_TorchWork`), this thread's batch of asynchronous sends and recvs of CUDA
tensors (:class:`_BatchedP2P`, :func:`launch_batch`), and how a CuPy array's call runs on
CuPy's current stream (:func:`_torch_call`)."""

from __future__ import annotations

import datetime
import functools
import sys
from _thread import get_ident
from collections.abc import Callable
from typing import Any, NoReturn

from collectives import arrays
from collectives.calls import Request
from collectives.errors import PeerLeft
from collectives.work import Work


class _TorchWork(Work):
    """An asynchronous torch.distributed call's handle; ``transport``: the torch transport
    whose communicator's context maps a failure (``None``: raised as torch raised it)."""

    def __init__(self, x: Any, work: Any, finish: Any = None, transport: Any = None) -> None:
        super().__init__(x)
        self._work = work
        self._finish = finish
        self._transport = transport
        #: For CuPy arrays: returns the torch view of the stream that is CuPy's current one when
        #: wait() is called, which wait() makes wait for the call (as it does torch's current
        #: stream for tensors).
        self.stream_at_wait: Callable[[], Any] | None = None

    def wait(self) -> Any:
        if self._work is not None:
            self._complete_on_stream()
        return self._x

    def _complete_on_stream(self) -> None:
        """:meth:`_complete`, for a CuPy array on the stream that is CuPy's current one now."""
        if self.stream_at_wait is None:
            self._complete()
        else:
            with sys.modules["torch"].cuda.stream(self.stream_at_wait()):
                self._complete()

    def _complete(self) -> None:
        """Wait for torch's handle (its error mapped), then run ``finish`` (once)."""
        try:
            self._work.wait()
        except RuntimeError as error:
            if self._transport is None:
                raise
            raise_mapped(self._transport, error)
        self._work = None
        transport = self._transport
        if transport is not None and transport._failed_beside():
            # (a check beside the calls found a mismatch, or a call on a device stream timed out)
            raise transport.context.failure()
        finish, self._finish = self._finish, None  # (taken first: once, whoever completes it)
        if finish is not None:
            finish()

    def is_completed(self) -> bool:
        """Whether the call has completed; once torch's handle has, ``finish`` runs here (the
        division of AVG, a staged result's copy back...), so a handle that is never waited (the
        communicator reaps the dropped ones with this) still leaves the result in place. A
        failure raises here, as from ``wait()``."""
        if self._work is None:
            return True
        if not self._work.is_completed():
            return False
        self._complete_on_stream()
        return True

    def wait_for(self, seconds: float) -> bool:
        """torch's own wait with a timeout (a condition variable: no polling, which holds the GIL
        against the process group's threads and took a Gloo call from 0.2 ms to 2.3 ms)."""
        if self._work is None or self._work.is_completed():
            return True
        if seconds < 0.001:  # torch's wait takes a timeout of 0 for none
            return False
        try:
            self._work.wait(datetime.timedelta(seconds=seconds))
        except RuntimeError as error:
            if "timed out" in str(error).lower():
                # torch's wait gave up at ``seconds``; the call may have completed since (a
                # race with the process group's thread): then wait() says how it ended.
                return bool(self._work.is_completed())
            if self._transport is None:
                raise
            raise_mapped(self._transport, error)
        return True


def raise_mapped(transport: Any, error: Exception) -> NoReturn:
    """Raise what torch's ``error`` becomes (the context's ``map_error``). Where it is a peer's
    farewell (``PeerLeft``), which says why the connection closed, torch's own text (Gloo's
    "Connection closed by peer ... GLHF!", "typically caused by a remote worker crashing") is left
    out of the traceback: the peer did not crash, it left."""
    mapped = transport.context.map_error(error)
    if isinstance(mapped, PeerLeft):
        raise mapped from None
    raise mapped from error


# -- asynchronous sends and recvs of CUDA tensors: one batch per thread -----------------------------

#: Each thread's batch of asynchronous sends/recvs of CUDA tensors not issued yet, by thread id:
#: where no thread has one, the test a call of this backend makes (``if pending_batches:``) is
#: all it pays.
pending_batches: dict[int, list[_BatchedP2P]] = {}


def batches(t: Any) -> bool:
    """Whether an asynchronous send/recv of tensor ``t`` joins this thread's batch: CUDA tensors,
    which go over NCCL. (Gloo's sends and recvs do not wait for each other: issued as they come.)"""
    return bool(t.is_cuda)


class _BatchedP2P(_TorchWork):
    """An asynchronous send or recv of a CUDA tensor, held in this thread's batch until the first
    ``wait()`` of any handle in it or the next call of this backend in this thread, then issued
    with the rest of the batch by ``dist.batch_isend_irecv`` (one NCCL group).

    NCCL through torch puts a rank pair's sends and recvs on one stream: issued one by one, a
    send that NCCL cannot buffer (MiBs) waits on the GPU for the peer's recv, which the peer
    queued behind its own send, so a ring of sends then recvs deadlocks. In one group it cannot.
    A CUDA event recorded at the call keeps the batch ordered after the kernels that produced
    the tensor, whichever stream is current when the batch goes out."""

    def __init__(self, x: Any, op: Any, finish: Any, transport: Any) -> None:
        super().__init__(x, None, finish, transport)
        self._op = op
        self._pending = True
        self._error: Exception | None = None
        self._ready: Any = None
        tensor = op.tensor
        if tensor.is_cuda:
            torch = sys.modules["torch"]
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(tensor.device))
        pending_batches.setdefault(get_ident(), []).append(self)

    def wait(self) -> Any:
        launch_batch()
        if self._error is not None:
            raise self._error
        return super().wait()

    def is_completed(self) -> bool:
        if self._error is not None:
            return True
        return not self._pending and super().is_completed()


class _Joined:
    """The handles of a whole batch as one, shared by the batch's handles: NCCL returns one for
    the whole group. Each is waited once (a Gloo recv's handle waited twice never returns)."""

    def __init__(self, works: list[Any]) -> None:
        self._works = list(works)

    def wait(self) -> None:
        while self._works:
            self._works[0].wait()
            self._works.pop(0)

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def launch_batch() -> None:
    """Issue this thread's batch of asynchronous sends/recvs, if there is one: one
    ``batch_isend_irecv`` per process group, in the order they were called. A batch that fails
    fails its handles (their ``wait()`` raises), and those of the batches after it."""
    if not pending_batches:
        return
    pending = pending_batches.pop(get_ident(), None)
    if not pending:
        return
    groups: list[tuple[Any, list[_BatchedP2P]]] = []
    for work in pending:
        for group, members in groups:
            if group is work._op.group:
                members.append(work)
                break
        else:
            groups.append((work._op.group, [work]))
    torch = sys.modules["torch"]
    failure: Exception | None = None
    for _, members in groups:
        if failure is not None:  # a batch before this one failed: none of these was issued
            for work in members:
                work._error, work._pending = failure, False
            continue
        for work in members:
            if work._ready is not None:
                torch.cuda.current_stream(work._op.tensor.device).wait_event(work._ready)
        transport = members[0]._transport
        try:
            handles = transport._dist.batch_isend_irecv([work._op for work in members])
        except RuntimeError as error:
            failure = transport.context.map_error(error)
            for work in members:
                work._error, work._pending = failure, False
            continue
        if len(handles) != len(members):  # one for the whole group (NCCL)
            handles = [_Joined(handles)] * len(members)
        for work, handle in zip(members, handles):
            work._work, work._pending = handle, False


# -- CuPy arrays: torch's work on CuPy's current stream ----------------------------------------------

#: torch's view of each CuPy stream a call ran on, by (device, stream pointer): made once (a
#: torch.cuda.ExternalStream wraps a stream it does not own, so one per pointer serves every call).
_torch_streams: dict[tuple[int, int], Any] = {}
_KEPT_STREAMS = 64


def _cupy_stream_as_torch(torch: Any, x: Any) -> Any:
    """CuPy's current stream (on x's device) as a torch stream."""
    device_id = x.device.id
    ptr = sys.modules["cupy"].cuda.get_current_stream(device_id).ptr
    found = _torch_streams.get((device_id, ptr))
    if found is None:
        device = torch.device("cuda", device_id)
        # CuPy's null stream is the legacy default stream, torch's default one
        found = torch.cuda.default_stream(device) if ptr == 0 else torch.cuda.ExternalStream(ptr, device=device)
        if len(_torch_streams) >= _KEPT_STREAMS:
            _torch_streams.clear()
        _torch_streams[device_id, ptr] = found
    return found


def _torch_call(method: Any) -> Any:
    """Every transport method of the torch backend that takes an array goes through here: the
    collectives, which take the call's :class:`~collectives.calls.Request`, and the helpers,
    which take ``(x, adapter, ...)``.

    First this thread's batch of asynchronous CUDA sends/recvs is issued (:func:`launch_batch`),
    except by an asynchronous send/recv, which joins it. Then, for CuPy arrays, ``method``'s
    torch work runs on CuPy's current stream: torch enqueues NCCL after (and the staging copies
    on) torch's current stream, and for a CuPy array the kernels that produced it and those that
    read it are on CuPy's; the handle's ``wait()`` orders the stream that is CuPy's current one
    then.
    """
    joins_batch = method.__name__ in ("_send", "_recv")

    @functools.wraps(method)
    def call(self: Any, *args: Any) -> Any:
        first = args[0]
        if type(first) is Request:
            x, adapter = first.x, first.adapter
            if not (joins_batch and first.async_op):
                launch_batch()
        else:
            x, adapter = first, args[1]
            launch_batch()
        if adapter is not arrays.CUPY:
            return method(self, *args)
        torch = self._torch
        with torch.cuda.stream(_cupy_stream_as_torch(torch, x)):
            result = method(self, *args)
        if isinstance(result, _TorchWork):
            result.stream_at_wait = lambda: _cupy_stream_as_torch(torch, x)
        return result

    return call
