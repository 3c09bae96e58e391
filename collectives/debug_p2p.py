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
                 src: int | None, tag: int, header: Any) -> None:
        super().__init__(x)
        self._p2p, self._adapter, self._dtype, self._src, self._tag = p2p, adapter, dtype, src, tag
        self._header, self._theirs = header, header.copy()
        self._staging = adapter.empty(x, tuple(x.shape))
        # From any source (src None), the payload's recv is posted once the header said who sent,
        # and the header's once the previous recv from any source has posted its payload (else
        # this header's recv could take that sender's payload: same tag, any source).
        self._before: _CheckedRecv | None = None
        self._header_work: Work | None = None
        if src is None:
            self._before, p2p.last_any = p2p.last_any, self
        self._payload: Work | None = None
        self._header_posted(block=False)
        if src is not None:
            self._payload = self._post_payload(src)
        self._done = False
        self._error: Exception | None = None
        # An error the payload's handle raised while polled (it raises it only once).
        self._payload_error: Exception | None = None

    def _post_payload(self, src: int) -> Work:
        self.source = src
        return self._p2p.transport._recv(Request(RECV, self._staging, self._adapter, self._dtype, root=src,
                                                 async_op=True, extra=self._tag)) or Work(self._staging)

    def _header_posted(self, block: bool) -> Work | None:
        """The header's recv, posted now where the recv before it from any source has posted its
        payload (with ``block``, after waiting for that recv's header); None where not yet."""
        if self._header_work is None:
            before = self._before
            if before is not None and before._payload is None:
                header = before._header_posted(block)
                if not block and (header is None or not header.is_completed()):
                    return None
                before.payload_posted()
            self._before = None
            self._header_work = self._p2p.transport._recv_small(self._theirs, self._src, self._tag)
        return self._header_work

    def payload_posted(self) -> Work:
        """The payload's recv (posted now, from the header's sender, where it came from any source)."""
        if self._payload is None:
            header = self._header_posted(block=True)
            assert header is not None
            header.wait()
            self._payload = self._post_payload(_sender(header, None))
            if self._p2p.last_any is self:
                self._p2p.last_any = None
        return self._payload

    def wait(self) -> Any:
        if not self._done:
            from .wire import p2p_mismatch  # noqa: PLC0415  (debug mode only)

            payload = self.payload_posted()
            header = self._header_posted(block=True)
            assert header is not None
            header.wait()
            error = p2p_mismatch(self._header, self._theirs, self._p2p.comm, _sender(header, self._src), self._tag)
            try:
                if self._payload_error is not None:
                    raise self._payload_error
                payload.wait()
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
            header = self._header_posted(block=False)
            if not (header is not None and header.is_completed() and self.payload_posted().is_completed()):
                return False
        except CollectiveError:
            raise
        except Exception as error:  # kept for wait(), which says what it means
            self._payload_error = error
            return True
        try:  # both arrived: the header compared and the payload copied into x, at once
            self.wait()
        except CollectiveError:
            if self._error is None:
                raise
            # A mismatch stays this handle's: its wait() raises it (x untouched), not the call
            # whose reaping found it.
        return True


class CheckedPointToPoint:
    """send and recv with a header ahead of each payload (debug mode), over ``transport``; a
    send's header handle that completes later is kept in ``handles``; ``comm`` is the
    communicator as a mismatch's message names it (its ``repr`` and ``rank``)."""

    __slots__ = ("transport", "handles", "comm", "last_any")

    def __init__(self, transport: Transport, handles: KeptHandles, comm: Any) -> None:
        self.transport, self.handles, self.comm = transport, handles, comm
        #: The latest asynchronous recv from any source whose payload's recv is not posted yet.
        self.last_any: _CheckedRecv | None = None

    def run(self, call: Call, x: Any, adapter: ArrayAdapter, dtype: str, peer: int | None,
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
            assert peer is not None  # (a send names its peer)
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
        if peer is None and self.last_any is not None:  # (see _CheckedRecv: headers in order)
            self.last_any.payload_posted()
        header_work = self.transport._recv_small(theirs, peer, tag)
        header_work.wait()
        peer = _sender(header_work, peer)  # (from any source: the header's sender sends the payload)
        error = p2p_mismatch(header, theirs, self.comm, peer, tag)
        if error is None:
            self.transport._recv(Request(RECV, x, adapter, dtype, root=peer, extra=tag))
            return None
        # Take the payload anyway, into scratch memory of the size the header says, so
        # that the stream stays in step; x is untouched.
        scratch = self.transport._scratch_bytes(x, adapter, p2p_nbytes(theirs))
        self.transport._recv(Request(RECV, scratch, adapter, "uint8", root=peer, extra=tag))
        raise error


def _sender(header_work: Work, src: int | None) -> int:
    """The rank a completed header's recv from ``src`` received from: ``src``, or from any source
    (``None``) the sender its transport's handle names."""
    source = header_work.source if src is None else src
    assert source is not None, "a transport that receives from any source names the sender"
    return source


def _nbytes(x: Any) -> int:
    """Bytes of a numpy/CuPy array or a torch tensor."""
    return int(x.nbytes) if hasattr(x, "nbytes") else int(x.numel() * x.element_size())
