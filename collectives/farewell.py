"""A rank that is done with a communicator tells its peers, so that a call left without a partner
raises at once instead of waiting out the timeout.

When a rank closes a communicator (``close()``), and for every communicator still open when its
interpreter exits, it leaves a farewell with each peer: how many collectives it made on that
communicator, and whether it finished normally or is ending through an uncaught exception. The
transport carries it (:meth:`~collectives.transport.Transport._tell_peers_left`: a small MPI
message on the communicator with the reserved tag :data:`FAREWELL_TAG`; a key in torch's store).
A rank waiting in a call looks for farewells while it waits
(:meth:`~collectives.transport.Transport._peers_left`, a few times a second at most; never on a
call that completes at once): a peer that left after fewer calls than the one waited on will
never make it, and the call raises :class:`collectives.CollectiveMismatch` naming that rank and
its count of calls. The communicator is unusable after that (its call cannot be taken back).

The rank that finished goes on, and ends as it would have: it waits for nobody.

Each communicator holds a :class:`Farewells`: the peers that left it, and whether this rank said
its own farewell. Imports: calls, errors, diagnostics (the transport protocol for types only).
"""

from __future__ import annotations

import socket
import weakref
import zlib
from typing import TYPE_CHECKING, Any

from .diagnostics import _exits, recorder
from .errors import PeerLeft as PeerLeft  # (a public name of this module: users import it from here too)

if TYPE_CHECKING:
    from .transport import Transport

#: How a rank left: it finished normally (closed the communicator, or its interpreter is
#: ending normally), its process is ending through an uncaught exception or a failing exit, or
#: it gave up on the communicator after an exception and goes on (a pool's rank whose job
#: raised: see collectives.testing.worker).
FINISHED, FAILED, ABANDONED = 0, 1, 2
#: Seconds between two looks for farewells while a call waits.
LISTEN_SECONDS = 0.005

_installed: dict[str, Any] = {}
#: The farewells that made a call of this process raise: (rank, calls, how) (see heard()).
raised: list[tuple[int, int, int]] = []
#: (host, pid) of the peers that finished and said where they run (see wait_for_departed).
departed: list[tuple[str, int]] = []


#: The reason of the dump a rank that ends normally writes (with COLLECTIVES_TRACE_DIR).
ENDED_NORMALLY = "exit: ended normally"


def _at_exit() -> None:
    watch = _installed.get("watch")
    failing = watch.failing_exit() if watch is not None else None
    say_farewell(FINISHED if failing is None else FAILED)
    # With COLLECTIVES_TRACE_DIR, a rank that ends normally says so in its dump (unless it wrote
    # one that says more): collectives-trace then tells it from a rank that was killed.
    if failing is None and all(reason == "SIGUSR1" or reason.startswith("dump_trace")
                               for reason in recorder.written):
        recorder.dump(ENDED_NORMALLY)


#: Every communicator of this process not yet closed (its farewell is said at exit). A timeout
#: leaves requests behind in the transport, and a peer that timed out on ANOTHER communicator
#: left its own behind there: the next call on any communicator of that transport could match
#: one of them and return the peer's abandoned data, so a timeout makes every live
#: communicator of its backend unusable.
LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def say_farewell(how: int) -> None:
    """Every open communicator of this process says farewell (``how``), oldest first."""
    for comm in sorted(LIVE, key=lambda comm: comm._trace_order):
        comm._say_farewell(how)


def heard() -> bool:
    """Whether a call of this process raised because a peer left: the job is ending, and the
    peers that finished wait for this rank in MPI_Finalize (see collectives.diagnostics.process_hooks)."""
    return bool(raised)


def wait_for_departed(seconds: float) -> None:
    """Where a call of this process raised because a peer left: wait up to ``seconds`` for the
    peers that finished and said so from this host to end, so that a launcher that ends the
    other ranks when one fails (torchrun; mpiexec when a rank exits with a non-zero code) does
    not kill a rank that finished while it exits. Peers on other hosts cannot be watched."""
    if raised:
        here = socket.gethostname()
        _exits.wait_ended([pid for host, pid in departed if host == here], seconds)


def host_word() -> int:
    """This host's name as a number that fits a word of a farewell message."""
    return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


def note_departed(how: int, host: str | int, pid: int) -> None:
    """A peer that finished (``how`` FINISHED) runs as ``pid`` on ``host`` (a name, or its
    :func:`host_word`): :func:`wait_for_departed` waits for it."""
    if how == FINISHED and pid > 0:
        if host == host_word():
            host = socket.gethostname()
        departed.append((str(host), pid))


_HOW = {FINISHED: "finished (closed this communicator, or ended normally)",
        FAILED: "is ending through an uncaught exception",
        ABANDONED: "gave up on this communicator after an exception"}


def describe(left: list[tuple[int, int, int]]) -> str:
    """``left`` in words: who left, how, and after how many calls."""
    return "; ".join(f"rank {rank} {_HOW.get(how, 'left')} after {calls} collective "
                     f"call{'s' if calls != 1 else ''} on it" for rank, calls, how in sorted(left))


class Farewells:
    """The peers that left a communicator of ``size`` ranks over ``transport`` (rank -> its
    count of calls, and how it left: see the module's text), and whether this rank
    said its own farewell."""

    __slots__ = ("_transport", "_size", "left", "said")

    def __init__(self, transport: Transport, size: int) -> None:
        self._transport, self._size = transport, size
        self.left: dict[int, tuple[int, int]] = {}
        self.said = False

    def say(self, how: int) -> None:
        """Tell the peers that this rank leaves (once). Best effort: a peer that cannot be told
        waits for its timeout, as before."""
        if self._size > 1 and not self.said:
            self.said = True
            try:
                self._transport._tell_peers_left(how)
            except Exception:  # noqa: BLE001 - the transport is going away already
                pass

    def gone_before(self, seq: int) -> list[tuple[int, int, int]]:
        """The peers known to have left before making call number ``seq``: (rank, its count
        of calls, how), after asking the transport for news."""
        for rank, calls, how in self._transport._peers_left():
            self.left[rank] = (calls, how)
        return [(rank, calls, how) for rank, (calls, how) in self.left.items() if calls < seq]
