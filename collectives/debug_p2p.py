"""Point-to-point in debug mode (``COLLECTIVES_DEBUG=1``): a header ahead of each payload.

A debug-mode send sends a small header (dtype, shape, tag, bytes; see
:func:`collectives.wire.p2p_header`) ahead of its payload; a recv receives the header
first and compares it, so a send and a recv that disagree raise
:class:`~collectives.CollectiveMismatch` naming both sides instead of corrupting ``x``.
A :class:`collectives.Communicator` holds one :class:`CheckedPointToPoint` (given its
transport, its kept handles, and itself to name in messages); the call path hands it send and
recv when ``comm.debug`` is set.

Imports: arrays, calls, errors, work and the transport protocol (never the communicator);
the wire headers when used.
"""

from __future__ import annotations

from typing import Any

from .arrays import ArrayAdapter
from .calls import RECV, SEND, Call, Request
from .errors import CollectiveError
from .transport import Transport
from .work import AllOf, KeptHandles, Work


class _CheckedRecv(Work):
    """An asynchronous debug-mode recv (see :meth:`CheckedPointToPoint.run`): the header and the
    payload recvs are both posted when the recv is made (so the sender's handles complete in
    any wait order), the payload into a staging array of x's shape; ``wait()`` compares the
    header and copies the payload into ``x`` only when it matches."""

    def __init__(self, p2p: CheckedPointToPoint, x: Any, adapter: ArrayAdapter, dtype: str,
                 src: int, tag: int, header: Any) -> None:
        super().__init__(x)
        self._p2p, self._adapter, self._src, self._tag = p2p, adapter, src, tag
        self._header, self._theirs = header, header.copy()
        transport = p2p.transport
        self._header_work = transport._recv_small(self._theirs, src, tag)
        self._staging = adapter.empty(x, tuple(x.shape))
        self._payload = transport._recv(Request(RECV, self._staging, adapter, dtype, root=src, async_op=True,
                                                 extra=tag)) or Work(self._staging)
        self._done = False
        self._error: Exception | None = None
        # An error the payload's handle raised while polled (it raises it only once).
        self._payload_error: Exception | None = None

    def wait(self) -> Any:
        if not self._done:
            from .wire import p2p_mismatch  # noqa: PLC0415  (debug mode only)

            self._header_work.wait()
            error = p2p_mismatch(self._header, self._theirs, self._p2p.comm, self._src, self._tag)
            try:
                if self._payload_error is not None:
                    raise self._payload_error
                self._payload.wait()
            except CollectiveError:
                raise
            except Exception as transport:  # the sizes differ: the transport refused it
                if error is None:
                    raise
                self._error = error
                raise error from transport
            finally:
                self._done = True
                try:  # waited: close() need not wait (and raise) again
                    self._p2p.handles.pending_p2p.remove(self)
                except ValueError:
                    pass
            if error is None:
                self._adapter.copy_(self._x, self._staging)
            self._error, self._staging = error, None
        if self._error is not None:
            raise self._error
        return self._x

    def is_completed(self) -> bool:
        if self._done or self._payload_error is not None:
            return True
        try:
            return self._header_work.is_completed() and self._payload.is_completed()
        except CollectiveError:
            raise
        except Exception as error:  # kept for wait(), which says what it means
            self._payload_error = error
            return True


class CheckedPointToPoint:
    """send and recv with a header ahead of each payload (debug mode), over ``transport``; a
    send's header handle that completes later is kept in ``handles``; ``comm`` is the
    communicator as a mismatch's message names it (its ``repr`` and ``rank``)."""

    __slots__ = ("transport", "handles", "comm")

    def __init__(self, transport: Transport, handles: KeptHandles, comm: Any) -> None:
        self.transport, self.handles, self.comm = transport, handles, comm

    def run(self, call: Call, x: Any, adapter: ArrayAdapter, dtype: str, peer: int,
                     async_op: bool, tag: int) -> Any:
        """Debug mode: a send sends a small header (dtype, shape, tag, bytes) ahead of its
        payload, without blocking; a recv receives the header first and compares it. On a
        mismatch the recv still takes the payload (into scratch memory) so that the stream
        stays in step, and raises :class:`CollectiveMismatch` naming both sides, ``x``
        untouched. Every recv posts its transport recvs when it is made, in the order made,
        so headers meet headers and no order of waits deadlocks. A synchronous recv waits for
        the header before it receives the payload (scratch of the sender's size on a
        mismatch); an asynchronous one receives both at once (see :class:`_CheckedRecv`: a
        payload of another size is the transport's error, raised as the mismatch)."""
        from .wire import p2p_header  # noqa: PLC0415  (debug mode only)

        header = p2p_header(dtype, tuple(x.shape), tag, _nbytes(x))
        if call is SEND:
            sent = self.transport._send_small(header, peer, tag)
            payload = self.transport._send(Request(SEND, x, adapter, dtype, root=peer, async_op=async_op,
                                                    extra=tag))
            if async_op:
                return AllOf((sent, payload))
            if type(sent) is not Work:  # completes later: kept like a dropped p2p handle
                self.handles.pending_p2p.append(sent)
            return None
        if async_op:
            return _CheckedRecv(self, x, adapter, dtype, peer, tag, header)
        from .wire import p2p_mismatch, p2p_nbytes  # noqa: PLC0415

        theirs = header.copy()
        self.transport._recv_small(theirs, peer, tag).wait()
        error = p2p_mismatch(header, theirs, self.comm, peer, tag)
        if error is None:
            self.transport._recv(Request(RECV, x, adapter, dtype, root=peer, extra=tag))
            return None
        # Take the payload anyway, into scratch memory of the size the header says, so
        # that the stream stays in step; x is untouched.
        scratch = self.transport._scratch_bytes(x, adapter, p2p_nbytes(theirs))
        self.transport._recv(Request(RECV, scratch, adapter, "uint8", root=peer, extra=tag))
        raise error


def _nbytes(x: Any) -> int:
    """Bytes of a numpy/CuPy array or a torch tensor."""
    return int(x.nbytes) if hasattr(x, "nbytes") else int(x.numel() * x.element_size())
