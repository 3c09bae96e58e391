"""A communicator's side of the transport contract: the :class:`~collectives.transport.CallContext`
a :class:`~collectives.Communicator` hands the transport it holds, and the part of the
communicator that owns what goes wrong inside a call: naming the running call, the timeout
error (the communicator and its siblings become unusable), the farewells of peers heard while
waiting, the listening wait of the call path's own exchanges, a call under its own
``timeout=``, and what a transport's error becomes. The communicator's reliability parts
(:mod:`collectives.reliability`) use it too.

Imports: config, errors, farewell, polling, the recorder, the transport protocol and work (the
communicator is passed in, not imported).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NoReturn

from . import config, farewell
from .config import TIMEOUT
from .diagnostics import recorder
from .diagnostics.recorder import END, OP, SEQ, STARTED, STATE, mark_failed
from .errors import CollectiveError, CollectiveMismatch, CollectiveTimeout, PeerLeft, RankFailure, timed_out
from .polling import SPIN_YIELD_EVERY, PollPolicy, wait_until
from .transport import CallContext, Transport
from .work import Work

_clock = recorder.clock
#: Seconds a call path's own exchange waits in one go before it looks for farewells again.
LISTEN_SLICE = 0.05

#: How ``poll_until`` waits: tests without giving up the CPU for SPIN_SECONDS (a peer's answer
#: is seen the moment it lands; a yield every SPIN_YIELD_EVERY tests, for a peer on this core),
#: then tests with a yield until YIELD_SECONDS, then sleeps from 0.1 ms up to 1 ms between
#: tests (a long wait does not burn the CPU).
SPIN_SECONDS = 50e-6
YIELD_SECONDS = 0.002
POLL = PollPolicy(fast_polls=0, busy_seconds=YIELD_SECONDS, sleep_min=1e-4, sleep_max=1e-3,
                  spin_seconds=SPIN_SECONDS, spin_yield_every=SPIN_YIELD_EVERY)


def poll_until(done: Callable[[], bool], deadline: float) -> bool:
    """Poll ``done()`` until it is true (``True``) or ``deadline`` passes (``False``)."""
    return wait_until(done, deadline - _clock(), POLL, clock=_clock)


class CommunicatorContext(CallContext):
    """The side of communicator ``comm`` that its ``transport``, its handles and its parts see.

    Of ``comm`` it reads the running call (``_operation``, ``_seq``), ``trace_name``,
    ``timeout``, why it is unusable (``_why_broken``), its flight-recorder ring (``_ring``), its
    fault tolerance (``_fault``) and ``repr``; it sets ``comm._broken`` (unusable), ``comm._checking`` (see
    :meth:`stop_checking`) and ``comm.timeout`` (for a call's own ``timeout=``: see
    :meth:`run_with_timeout`, which runs the call through ``comm._run``) and clears the plans of
    its argument checks (``comm._checks.plans``, and the call path's kept one: see
    :meth:`forget_plans`), and nothing else."""

    __slots__ = ("comm", "_transport", "farewells", "_abandoned")

    def __init__(self, comm: Any, transport: Transport, farewells: farewell.Farewells) -> None:
        #: The communicator, as messages name it (its ``repr``, ``rank``, running call).
        self.comm = comm
        self._transport, self.farewells = transport, farewells
        # Handles of calls that timed out or lost a peer: kept, the transport may write their buffers.
        self._abandoned: list[Work] = []

    @property
    def call(self) -> tuple[str, int]:
        comm = self.comm  # (the call path's operation read as it is: a frame less, on every GPU call watched)
        return comm._path.operation, comm._seq

    @property
    def name(self) -> str:
        name: str = self.comm.trace_name
        return name

    @property
    def broken(self) -> str | None:
        why: str | None = self.comm._why_broken
        return why

    def call_name(self, call: tuple[str, int] | None = None) -> str:
        operation, seq = call or self.call
        return f"{operation or 'collective'} (call #{seq}) on {self.comm!r}"

    def record_failed(self, seq: int, error: BaseException) -> None:
        """Mark the recorded collective numbered ``seq`` failed with ``error`` (if the ring
        still holds it)."""
        mark_failed(find_record(self.comm._ring, seq), error)

    def raise_failed(self, record: list[Any] | None, error: Exception) -> NoReturn:
        """Raise what ``error``, raised inside the call of ``record``, becomes (the record marked
        failed): our own errors as they are (or the rank failure a timeout or a peer's farewell
        means, where fault tolerance tells one), the transport's through :meth:`transport_error`."""
        mark_failed(record, error)
        if isinstance(error, CollectiveError):
            failure = None if isinstance(error, RankFailure) else self.comm._fault.rank_failure(error)
            if failure is not None:
                raise failure from error
            raise error
        raise self.transport_error(error) from error

    def stop_checking(self) -> None:
        """No more checks before calls (``COLLECTIVES_DEBUG=0`` after the first call)."""
        self.comm._checking = False

    def timeout_error(self, detail: str = "", call: tuple[str, int] | None = None) -> CollectiveTimeout:
        """A :class:`CollectiveTimeout` for the running call (or ``call``: operation and
        sequence number of an asynchronous one); the communicator becomes unusable, and so do
        its live siblings on the same backend.

        Backends call this when their deadline passes (or their transport timed out).
        """
        comm, backend = self.comm, self._transport.backend
        call_name = self.call_name(call)
        seq = call[1] if call is not None else comm._seq
        self.record_failed(seq, CollectiveTimeout(timed_out(call_name, f"timeout={comm.timeout:g}s")))
        recorder.dump(f"CollectiveTimeout in {call_name}")
        comm._broken = (f"{comm!r} is unusable: {call_name} timed out, and the transport cannot "
                        "take it back (some ranks may still be inside it); create a new "
                        "communicator, or end the job")
        for sibling in list(farewell.LIVE):  # a peer may have left requests on any of them
            if sibling is not comm and sibling.backend == backend and not sibling._broken:
                sibling._broken = (
                    f"{sibling!r} is unusable: {call_name} timed out, and this communicator "
                    f"shares the {backend} transport with it (a rank that timed out on "
                    "another communicator may have left a call behind on this one); end the job")
        source = f"timeout={comm.timeout:g}s" if comm.timeout is not None else "the transport's"
        return CollectiveTimeout(
            f"{timed_out(call_name, source)} ({TIMEOUT}): another rank "
            f"skipped this call, called a different collective, or is stuck or dead"
            f"{'; ' + detail if detail else ''}. This communicator is now unusable: "
            "every later call on it raises."
        )

    def hear_farewells(self, call: tuple[str, int] | None = None) -> None:
        """While a call waits (``call``: its operation and number; default the running one):
        :class:`~collectives.errors.PeerLeft` when a peer left before making it."""
        seq = call[1] if call is not None else self.comm._seq
        gone = self.farewells.gone_before(seq)
        if not gone:
            return
        call_name = self.call_name(call)
        error = PeerLeft(
            f"{call_name} cannot complete: {farewell.describe(gone)}, so it will never make this "
            f"call (#{seq}): the ranks made different numbers of collective calls. This "
            "communicator is now unusable: every later call on it raises.")
        error.left = gone
        farewell.raised.extend(gone)
        self.record_failed(seq, error)
        self.comm._broken = (f"{self.comm!r} is unusable: {call_name} waited for a rank that "
                             f"left ({farewell.describe(gone)})")
        recorder.dump(f"PeerLeft in {call_name}")
        raise error

    def mark_broken(self, why: str) -> None:
        self.comm._broken = f"{self.comm!r} is unusable: {why}"

    def fail_later(self, error: Exception) -> None:
        comm = self.comm
        comm._failure = error  # (before _broken: the call that sees the gate closed finds it)
        if not comm._broken:
            comm._broken = f"{comm!r} is unusable: {error}"

    def posted_mismatch(self, everyone: Any, reasons: Any, call: tuple[str, int]) -> Exception | None:
        from .wire import mismatch, refusal_mismatch, refused_ranks  # noqa: PLC0415

        refusing = refused_ranks(everyone)
        if len(refusing) == len(everyone):
            return None
        found = refusal_mismatch(everyone, reasons, self.comm, call) if refusing else \
            mismatch(everyone, self.comm, posted=call)
        if found is None:  # (the hash words differ only where the fingerprints do)
            found = CollectiveMismatch(f"{self.call_name(call)}: the ranks' check words differ, but "
                                       "their fingerprints agree; is COLLECTIVES_DEBUG set the same on every rank?")
        try:
            self.record_failed(call[1], found)
        except RuntimeError:  # (the ring grew meanwhile: this runs beside the calls)
            pass
        recorder.dump(f"CollectiveMismatch in {self.call_name(call)}")
        return found

    def failure(self) -> Exception:
        comm = self.comm
        found: Exception | None = comm._failure
        if found is not None:  # a new one each time: a raised exception keeps its traceback
            return type(found)(*found.args)
        return CollectiveError(comm._broken or f"{comm!r} is unusable")

    def forget_plans(self) -> None:
        self.comm._checks.plans.clear()
        self.comm._path.forget_kept()  # (the call path's plan of the last kind, kept beside them)

    def has_left(self, rank: int) -> bool:
        return rank in self.farewells.left

    def await_work(self, work: Work, seconds: float) -> None:
        """Wait for ``work`` (a call of the call path's own, before any data moves) at most
        ``seconds``, looking for farewells every LISTEN_SLICE: ``PeerLeft`` when a peer left,
        :class:`CollectiveTimeout` past ``seconds``; the handle is then kept (the transport may
        still write its buffers)."""
        deadline = _clock() + seconds
        try:
            while not work.wait_for(min(LISTEN_SLICE, max(deadline - _clock(), 0.0))):
                self.hear_farewells()
                if _clock() >= deadline:
                    raise self.timeout_error()
        except CollectiveError:
            self._abandoned.append(work)
            raise

    def exchange_listening(self, vector: Any) -> Any:
        """The transport's ``_exchange_small``, polled under the communicator's timeout while
        looking for farewells (a peer that left is heard here too, also with no timeout)."""
        work = self._transport._start_exchange_small(vector)
        if work is None:
            return self._transport._exchange_small(vector)
        timeout = self.comm.timeout
        self.await_work(work, math.inf if timeout is None else timeout)
        return work.wait()

    def run_with_timeout(self, call: Any, x: Any, op: Any, root: Any, out: Any, async_op: Any,
                         extra: Any, timeout: Any) -> Any:
        """A call with its own ``timeout=`` (``Communicator._run`` hands it here): the
        communicator's timeout is replaced for it (a backend's deadline reads it); a blocking
        call runs as an asynchronous one whose handle is polled against the deadline, so the
        value holds on transports that take their timeout from elsewhere (torch's process
        group), when it is shorter."""
        comm = self.comm
        seconds = config.timeout_seconds(timeout or 0)  # 0 / None: no timeout for this call
        kept, comm.timeout = comm.timeout, seconds
        try:
            if seconds is None or async_op is not False:
                return comm._run(call, x, op, root, out, async_op, extra)
            deadline = _clock() + seconds
            work = comm._run(call, x, op, root, out, True, extra)
            seq = comm._seq
            if not poll_until(work.is_completed, deadline):
                error = self.timeout_error(call=(call.name, seq))
                self.record_failed(seq, error)
                raise error
            result = work.wait()
            record = find_record(comm._ring, seq) if call.collective else None
            if record is not None:
                record[STATE], record[END] = STARTED, _clock()  # completed (see recorder.state)
            return x if call.in_place else result
        finally:
            comm.timeout = kept

    def map_error(self, error: Exception) -> Exception:
        if isinstance(error, CollectiveError):
            return error
        return self.transport_error(error)

    def transport_error(self, error: Exception) -> Exception:
        """What an exception raised inside the running call becomes.

        Our own ``TypeError``/``ValueError`` (and ``MemoryError``) propagate unchanged;
        anything else came from the transport: a peer's failure (fault tolerance), what the
        transport's ``_map_error`` makes of it (its timeout as :meth:`timeout_error`), else
        :class:`CollectiveError` naming the call.
        """
        if isinstance(error, (TypeError, ValueError, MemoryError)):
            return error
        failure: Exception | None = self.comm._fault.rank_failure(error)  # a peer died
        if failure is not None:
            return failure
        mapped = self._transport._map_error(error)
        if mapped is not None:
            return mapped
        text = str(error).strip()
        # MPICH's first line announces a stack of frames ("Other MPI error, error stack:"): its class is the news.
        first_line = text.splitlines()[0][:300].removesuffix(" error stack:").rstrip(",") if text else ""
        return CollectiveError(f"{self.call_name()} failed in the {self._transport.backend} transport: "
                               f"{type(error).__module__}.{type(error).__qualname__}: {first_line}")


def find_record(ring: Any, seq: int) -> list[Any] | None:
    """The recorded collective numbered ``seq`` in ``ring``, if it still holds it."""
    for record in reversed(ring or ()):
        if record[SEQ] == seq and record[OP].collective:
            found: list[Any] = record
            return found
    return None
