"""The mpi backend, fault-tolerant: Open MPI 5's ULFM (``mpirun --with-ft ulfm``).

A call that fails because a peer died (``MPI_ERR_PROC_FAILED``) or because another survivor
revoked the communicator (``MPI_ERR_REVOKED``) revokes it (``MPIX_Comm_revoke``: every
survivor's pending and next call on it fails too, also where the failure was seen by some
ranks only), shrinks it (``MPIX_Comm_shrink``: the survivors agree on who they are, so every
survivor names the same failed ranks) and raises :class:`~collectives.RankFailure`.
``shrink()`` then hands out that communicator of the survivors; ``agree()`` is
``MPIX_Comm_agree``. A rank that dies without its connections closing, or hangs, is found by
Open MPI's heartbeat detector (``collectives-elastic --mpi`` turns it on: ~2 s).

Refused, naming what works: MPI libraries without ULFM (the MPICH wheel: its revoke and shrink
are stubs), and Open MPI started without ``--with-ft ulfm``. Replacements do not join here
(the job shrinks).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from types import TracebackType
from typing import Any

from collectives.elastic.support import refuse
from collectives.errors import CollectiveTimeout, PeerLeft, RankFailure
from collectives.launcher import LaunchInfo

from .mpi import MPICommunicator, MPITransport
from .mpi_channel import import_mpi
from .mpi_library import library_version


def ulfm_refusal(MPI: Any) -> str | None:
    """Why this MPI cannot go on after a rank dies, or ``None`` when it can."""
    library = library_version(MPI)[:60]
    if "Open MPI" not in library:
        return (f"the mpi backend needs Open MPI 5 with ULFM; this MPI ({library}) has none that "
                "works (the MPICH wheel's revoke and shrink are stubs)")
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes", "on"):
        return ("Open MPI runs without ULFM here: start the job with `mpirun --with-ft ulfm` "
                "(collectives-elastic --mpi does, with the heartbeat detector)")
    return None


class ULFMTransport(MPITransport):
    """A fault-tolerant transport over Open MPI's ULFM (see the module's text)."""

    def __init__(self, comm: Any = None, local_rank: int | None = None, *, generation: int = 0) -> None:
        super().__init__(comm, local_rank)
        # Open MPI's persistent collectives report a dead peer as MPI_ERR_OTHER, not as
        # MPI_ERR_PROC_FAILED: the check's round takes MPI_Iallgather here, the fast paths
        # no persistent requests.
        self.round.free()
        self._persistent = False  # (and so no staged uneven calls: MPIChannel._uneven_bytes)
        self.generation = generation
        self._failure: RankFailure | None = None
        self._survivors: Any = None  # the shrunk MPI communicator, once a failure was seen

    @classmethod
    def from_launcher(cls, launch: LaunchInfo, *, timeout: Any = None) -> MPITransport:
        why = ulfm_refusal(import_mpi())
        if why is not None:
            raise refuse("mpi", "init(fault_tolerant=True)", why)
        _exit_on_uncaught_exception()
        atexit.register(_finalize_within, FINALIZE_SECONDS)  # (before the communicator's own
        transport = super().from_launcher(launch, timeout=timeout)  # exit hooks: it runs after them)
        _Heartbeat.start(transport._MPI)  # (its stop, registered now, runs before MPI_Finalize)
        return transport

    def _rank_failure(self, error: Exception | None) -> RankFailure | None:
        if error is None:
            failure = self._failure
            return None if failure is None else RankFailure(str(failure), failure.failed_ranks,
                                                            failure.generation)
        if self._failure is not None:
            return self._failure
        MPI = self._MPI
        if isinstance(error, MPI.Exception):
            if error.Get_error_class() in _argument_classes(MPI):
                return None  # the call's arguments (the call path's checks make these rare)
        elif not isinstance(error, (PeerLeft, CollectiveTimeout, RankFailure)):
            return None  # (a RankFailure: one of a split of this communicator, on another thread)
        failed = self._revoke_and_shrink()
        text = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        who = (f"rank(s) {', '.join(map(str, failed))} failed" if failed
               else "no rank died (the transport failed)")
        self._failure = RankFailure(
            f"{self.context.call_name()} failed in generation {self.generation}: {who}; call shrink() "
            f"on every survivor to go on without them. MPI said: {text}", failed, self.generation)
        return self._failure

    def _revoke_and_shrink(self) -> list[int]:
        """Revoke this communicator, shrink it to the survivors (kept for ``shrink()``) and
        return the ranks that are not among them (the same list on every survivor)."""
        MPI = self._MPI
        try:
            self._comm.Revoke()
        except MPI.Exception:
            pass  # revoked already
        self._survivors = self._comm.Shrink()
        old = self._comm.Get_group()
        new = self._survivors.Get_group()
        kept = set(MPI.Group.Translate_ranks(new, list(range(new.Get_size())), old))
        new.Free()
        old.Free()
        return [r for r in range(self.size) if r not in kept]

    def _split(self, color: int | None, key: int) -> MPITransport | None:
        child = super()._split(color, key)  # a ULFMTransport: revoked and shrunk on its own failures
        if child is not None:
            child.generation = self.generation
        return child

    def _shrink(self) -> ULFMTransport:
        if self._survivors is None:  # no failure seen: the same ranks, a generation later
            self._revoke_and_shrink()
        survivors, self._survivors = self._survivors, None
        try:
            child = ULFMTransport(survivors, local_rank=self.local_rank, generation=self.generation + 1)
            child._poll = self._poll
        finally:
            survivors.Free()
        return child

    def _close(self) -> None:
        MPI = self._MPI
        if self._failure is not None and not MPI.Is_finalized() and self._comm != MPI.COMM_NULL:
            try:
                self._comm.Free()
            except MPI.Exception:
                pass
            return
        super()._close()

    def _agree(self, flag: bool) -> bool:
        MPI = self._MPI
        while True:
            try:
                self._comm.Ack_failed()  # failures known so far do not fail the agreement
                return bool(self._comm.Agree(int(flag)))
            except MPI.Exception as error:
                if error.Get_error_class() != MPI.ERR_PROC_FAILED:
                    raise self.context.map_error(error) from error


#: Seconds MPI_Finalize may take at exit after a failure before the rank ends without it.
FINALIZE_SECONDS = 3.0


def _finalize_within(seconds: float) -> None:
    """MPI_Finalize, bounded: after a peer failed, Open MPI 5.0.11's finalize sometimes never
    returns (its progress loop waits on the dead peer, holding the GIL); the rank then ends
    with status 1 once ``seconds`` have passed, its work done (faulthandler's watchdog is a C
    thread: it needs no GIL)."""
    import faulthandler  # noqa: PLC0415

    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None or MPI.Is_finalized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    with open(os.devnull, "w") as quiet:
        faulthandler.dump_traceback_later(seconds, exit=True, file=quiet)
        MPI.Finalize()
        faulthandler.cancel_dump_traceback_later()


class _Heartbeat:
    """Open MPI's heartbeat detector (without its own thread, see above) sends this rank's
    heartbeats from MPI's progress loop: a rank that makes no MPI call for the detector's timeout
    (an import, a long forward pass, torch building DDP) would be taken for dead by its peers and
    aborted. A daemon thread enters the progress loop (``MPI_Iprobe`` on a duplicate of
    ``COMM_SELF``) every :data:`HEARTBEAT_PROGRESS` seconds, from ``init()`` until the
    interpreter's exit hooks, before ``MPI_Finalize``."""

    _thread: threading.Thread | None = None
    _stop = threading.Event()

    @classmethod
    def start(cls, MPI: Any) -> None:
        if cls._thread is not None or MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            return
        comm = MPI.COMM_SELF.Dup()
        cls._thread = threading.Thread(target=cls._run, args=(comm,), daemon=True,
                                       name="collectives-ulfm-heartbeat")
        cls._thread.start()
        atexit.register(cls.stop)

    @classmethod
    def _run(cls, comm: Any) -> None:
        try:
            while not cls._stop.wait(HEARTBEAT_PROGRESS):
                comm.Iprobe()
        finally:
            comm.Free()

    @classmethod
    def stop(cls) -> None:
        cls._stop.set()
        if cls._thread is not None:
            cls._thread.join()


#: Seconds between two entries of the heartbeat thread into MPI's progress loop (the detector's
#: period, as collectives-elastic sets it, is 0.5 s; its timeout 2 s).
HEARTBEAT_PROGRESS = 0.1


def _argument_classes(MPI: Any) -> set[int]:
    """MPI's error classes of a bad call; every other error in a call of a ULFM communicator
    is taken for a failure (revoke and shrink tell whether a peer died: Open MPI reports some
    deaths as MPI_ERR_OTHER, besides MPI_ERR_PROC_FAILED and MPI_ERR_REVOKED)."""
    return {getattr(MPI, name) for name in ("ERR_BUFFER", "ERR_COUNT", "ERR_TYPE", "ERR_TAG", "ERR_RANK",
                                            "ERR_ROOT", "ERR_OP", "ERR_ARG", "ERR_TRUNCATE", "ERR_COMM")
            if hasattr(MPI, name)}


def _exit_on_uncaught_exception() -> None:
    """A rank that raises an uncaught exception ends (status 1) instead of taking the job
    down with MPI_Abort, or waiting in MPI_Finalize for peers that wait for it: the survivors
    see it fail and go on."""
    previous = sys.excepthook

    def exit_on_uncaught_exception(kind: type[BaseException], value: BaseException,
                                   tb: TracebackType | None) -> None:
        if previous is not sys.__excepthook__:
            previous(kind, value, tb)
        else:
            traceback.print_exception(kind, value, tb)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(1)

    sys.excepthook = exit_on_uncaught_exception


class ULFMCommunicator(MPICommunicator):
    """The fault-tolerant communicator of the mpi backend on Open MPI's ULFM
    (``init(fault_tolerant=True)``)."""

    transport_class = ULFMTransport
    _transport: ULFMTransport
