"""Every process-wide hook of collectives, installed from one place: ``install``.

``collectives.init()`` calls ``install`` when it creates a communicator for a process
that a launcher started with more than one rank (never for a single process).
``COLLECTIVES_PROCESS_HOOKS=0`` installs none of them, for programs that manage their own
exits and signals. Each hook, what it does and why:

- ``sys.exit`` records its status (MPI launchers): an uncaught ``SystemExit`` reaches no
  other hook, and the exit watch below needs its code (see ``collectives.diagnostics._exits``). The
  one hook installed at ``import collectives`` (``at_import``), and only in a process
  that an MPI launcher started with more than one rank: ``sys.exit(main())`` looks
  ``sys.exit`` up before ``main()`` creates the communicator, and on Python 3.10/3.11
  nothing else can read that exit's code (a wrapper installed later would take a
  ``sys.exit(0)`` for a failure and abort the job).
- ``sys.excepthook`` and an ``atexit`` exit watch (MPI launchers): an uncaught exception, or
  an uncaught ``sys.exit(n)`` with ``n`` not 0, prints the rank and calls ``MPI_Abort``;
  otherwise the other ranks wait for this one in a collective, or in ``MPI_Finalize``, forever.
  On Python 3.12+ the watch also takes a ``sys.monitoring`` tool id (``PY_UNWIND`` of the main
  module's code) to read the code of a bare ``raise SystemExit(n)``.
- ``threading.excepthook``: an uncaught exception in a thread other than the main one ends
  the process (``MPI_Abort(1)`` under MPI, else exit code 1) like one in the main thread;
  otherwise the main thread waits for what that thread would have done, and the job hangs.
- A watcher thread on Python's wakeup fd (``signal.set_wakeup_fd``), with an at-fork hook
  that drops it in forked children: a SIGINT while the main thread is blocked in a transport
  call Python cannot interrupt (Gloo's wait, a blocking MPI call) ends the process after
  ``GRACE`` seconds (exit code 130), instead of after the collective's timeout. With
  ``COLLECTIVES_TRACE_DIR`` it also writes the dump on SIGINT, SIGTERM and SIGUSR1, even while
  the main thread is blocked.
- ``sys.excepthook`` (other launchers: torchrun): writes the dump; after a timeout in this
  process it ends the process with ``os._exit(1)``, since the interpreter's exit would wait
  for the timed-out call that the transport still holds (a Gloo operation cannot be taken back).
- With ``COLLECTIVES_TRACE_DIR``: handlers for SIGTERM (dump, then die of SIGTERM as before)
  and SIGUSR1 (dump; the process goes on: ask a hung job where it is with ``kill -USR1``),
  and the excepthooks above write the dump before the process ends. Installed only where the
  signal still has its default handler.
"""

from __future__ import annotations

import atexit
import ctypes
import io
import os
import signal
import sys
import threading
import time
from types import TracebackType
from typing import Any

from .. import config, farewell
from ..launcher import LaunchInfo
from . import _exits, recorder

#: Seconds a rank waits after writing its last words before MPI_Abort: the abort also ends
#: the launcher's forwarding of the rank's output, which may still hold them.
FORWARDING_GRACE = 0.2
#: Seconds a SIGINT may stay pending in a blocked transport call before the process ends.
GRACE = 2.0
#: Seconds a failing rank that heard a peer finish waits in MPI_Finalize for the others before
#: it calls MPI_Abort after all (see _abort).
FINALIZE_GRACE = 10.0

# What is installed, by name (each once per process).
_installed: dict[str, Any] = {}


def enabled() -> bool:
    """False with ``COLLECTIVES_PROCESS_HOOKS=0``."""
    return config.env_flag(config.PROCESS_HOOKS) is not False


def at_import() -> None:
    """At ``import collectives``: wrap ``sys.exit`` where an MPI launcher started more than one
    rank (reads the launcher's environment variables only; see the module's text)."""
    from ..launcher import detect_launcher  # noqa: PLC0415

    try:
        launch = detect_launcher()
        wanted = launch.is_mpi_launcher and launch.size > 1 and enabled()
    except ValueError:  # a malformed variable: init() reports it
        return
    if wanted:
        _exits.record_exit_calls()
        _installed["sys.exit"] = True


def install(launch: LaunchInfo) -> list[str]:
    """Install the hooks a process started as ``launch`` says needs (once each); returns
    the names of those installed. Called by ``collectives.init()`` before the backend starts
    (so a failing bootstrap ends the job) and again after (torch wraps ``sys.excepthook``
    in ``init_process_group``; ours goes around it again so the traceback comes first)."""
    if launch.launcher is None or launch.size <= 1 or not enabled():
        return []
    describe = f"rank {launch.rank} of {launch.size} (pid {os.getpid()})"
    if launch.is_mpi_launcher:
        _exits.record_exit_calls()
        _installed.setdefault("sys.exit", True)
        _abort_mpi_on_uncaught_exception(describe)
    else:
        _dump_on_uncaught_exception()
    _end_process_on_thread_exception(describe)
    _watch_signals(describe)
    _dump_on_signals()
    return sorted(_installed)


# -- uncaught exceptions ------------------------------------------------------------------

def _mpi() -> Any:
    """mpi4py.MPI where MPI is initialized and not finalized, else None."""
    MPI: Any = sys.modules.get("mpi4py.MPI")
    if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
        return MPI
    return None


def _release_output() -> None:
    """Flush stdout and stderr, and where a wrapper of the excepthook that called ours holds
    what the hooks printed (torch's ``_distributed_excepthook`` points ``sys.stderr`` at a
    buffer and prints it after the hook returns), write that out now: the process ends
    before the wrapper would print it, and the traceback would be lost."""
    sys.stdout.flush()
    buffered, real = sys.stderr, sys.__stderr__
    if isinstance(buffered, io.StringIO) and real is not None:
        text = buffered.getvalue()
        buffered.seek(0)
        buffered.truncate()
        sys.stderr = real
        real.write(text)
    sys.stderr.flush()


def _end_process(code: int) -> None:
    """End this process with ``code``. Under MPI through MPI_Abort, which has mpiexec end
    every rank at once (a rank that only ``_exit``s was once not noticed by Hydra within 30 s
    in CI); elsewhere (torchrun watches its workers) ``os._exit``."""
    MPI = _mpi()
    try:
        _release_output()
        if MPI is not None:
            time.sleep(FORWARDING_GRACE)
            MPI.COMM_WORLD.Abort(code)
    finally:
        os._exit(code)


def _abort(what: str, code: int) -> None:
    """Print which rank fails, then MPI_Abort, then end the process (no-op where MPI is not
    running). MPICH's MPI_Abort returns while the launcher ends the job: nothing more runs
    here after it (no atexit hook, no line of a wrapping excepthook).

    Where the failure is that a peer left (a call of this process raised because a peer
    finished: the job is ending, and the peers that finished wait in MPI_Finalize), the rank
    tells its own peers it is leaving and ends through MPI_Finalize instead, so that the ranks
    that finished end cleanly too; MPI_Abort after FINALIZE_GRACE seconds if it does not return."""
    MPI = _mpi()
    if MPI is None:
        return
    world = MPI.COMM_WORLD
    _release_output()
    where = f"on rank {world.Get_rank()} of {world.Get_size()} (pid {os.getpid()})"
    if farewell.heard():
        sys.stderr.write(
            f"collectives: {what} {where} after a peer rank left; ending through MPI_Finalize, "
            f"where the ranks that finished wait (MPI_Abort if it does not return within "
            f"{FINALIZE_GRACE:g} s)\n")
        sys.stderr.flush()
        _finalize_or_abort(MPI, code)
    sys.stderr.write(f"collectives: {what} {where}; calling MPI_Abort so that the other ranks do "
                     "not wait for it forever\n")
    sys.stderr.flush()
    # Abort kills the launcher's output forwarding too: give it a moment to pass on
    # the traceback and this line (a failing job can spare it).
    time.sleep(FORWARDING_GRACE)
    try:
        world.Abort(code)
    finally:
        os._exit(code)


def _finalize_or_abort(MPI: Any, code: int) -> None:
    """Say farewell (failing), MPI_Finalize, wait for the peers of this host that finished to
    end, and exit with ``code``; MPI_Abort if MPI_Finalize has not returned within
    FINALIZE_GRACE seconds."""
    started = time.monotonic()
    watchdog = threading.Timer(FINALIZE_GRACE, lambda: MPI.COMM_WORLD.Abort(code))
    watchdog.daemon = True
    watchdog.start()
    try:
        farewell.say_farewell(farewell.FAILED)
        MPI.Finalize()
        watchdog.cancel()
        # The ranks that finished leave MPI_Finalize with this one, and still have their
        # interpreter to end: mpiexec kills them if this rank's non-zero exit comes first.
        farewell.wait_for_departed(max(0.0, FINALIZE_GRACE - (time.monotonic() - started)))
    finally:
        _release_output()
        os._exit(code)


def _abort_mpi_on_uncaught_exception(describe: str = "") -> None:
    """``sys.excepthook`` and the exit watch of the MPI launchers (see the module's text)."""
    if getattr(sys.excepthook, "_collectives_abort", False):
        return
    previous = sys.excepthook  # may be an earlier one of ours, wrapped by someone else

    def abort_on_uncaught_exception(kind: type[BaseException], value: BaseException,
                                    tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        outer = sys.excepthook
        if outer is not abort_on_uncaught_exception and getattr(outer, "_collectives_abort", False):
            # Installed again later around another hook (torch's init_process_group wraps
            # the hook and buffers what it prints): the outer one aborts, once the wrapper
            # has printed; aborting here would lose the traceback in that buffer.
            return
        recorder.dump(f"uncaught {kind.__name__}: {value}")
        # KeyboardInterrupt too: a rank interrupted on its own (SIGINT to its pid) would
        # otherwise wait in MPI_Finalize for peers that wait for it. Code 130 = 128 + SIGINT.
        _abort(f"uncaught {kind.__name__}", 130 if issubclass(kind, KeyboardInterrupt) else 1)

    abort_on_uncaught_exception._collectives_abort = True  # type: ignore[attr-defined]
    sys.excepthook = abort_on_uncaught_exception
    _installed["sys.excepthook"] = abort_on_uncaught_exception
    if "atexit" in _installed:
        return
    # An uncaught SystemExit skips the excepthook, and MPI_Finalize at exit would then wait
    # for peers that wait for this rank: a hang. At exit, abort when the process is really
    # ending through an exit with a non-zero code (collectives/diagnostics/_exits.py tells; an exit that
    # the program caught before finishing normally does not count).
    # (Registered after mpi4py's finalizer, so it runs before it.)
    watch = _exits.ExitWatch()

    def abort_on_failing_exit() -> None:
        failing = watch.failing_exit()
        if failing is not None:
            if not recorder.written:  # a dump that says more (a timeout, a crash) stays
                recorder.dump(failing[0])
            _abort(*failing)

    atexit.register(abort_on_failing_exit)
    _installed["atexit"] = watch


def _dump_on_uncaught_exception() -> None:
    """Where no MPI abort hook is (torchrun): ``sys.excepthook`` writes the dump after the
    traceback (the launcher ends the other ranks when this one exits), and where a call of
    this process timed out ends it at once: the transport may still hold that call (torch
    cannot take a Gloo operation back), and the interpreter's exit would wait for it."""
    if "sys.excepthook" in _installed:
        return
    previous = sys.excepthook

    def dump_on_uncaught_exception(kind: type[BaseException], value: BaseException,
                                   tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        recorder.dump(f"uncaught {kind.__name__}: {value}")
        # A peer that finished may still be exiting: torchrun would end it as this rank fails.
        farewell.wait_for_departed(FINALIZE_GRACE)
        from ..farewell import LIVE as _LIVE  # noqa: PLC0415

        if any(comm._why_broken for comm in list(_LIVE)):
            _release_output()
            os._exit(1)

    sys.excepthook = dump_on_uncaught_exception
    _installed["sys.excepthook"] = dump_on_uncaught_exception


def _end_process_on_thread_exception(describe: str) -> None:
    if "threading.excepthook" in _installed:
        return
    previous = threading.excepthook

    def end_process_on_thread_exception(args: Any) -> None:
        previous(args)
        name = args.thread.name if args.thread is not None else "a thread"
        recorder.dump(f"uncaught {args.exc_type.__name__} in thread {name!r}: {args.exc_value}")
        try:
            sys.stdout.flush()
            sys.stderr.write(
                f"collectives: uncaught {args.exc_type.__name__} in thread {name!r} on {describe}; "
                f"ending the process (exit code 1) so that the other ranks do not wait for it "
                f"(set {config.PROCESS_HOOKS}=0 to keep it running)\n")
            sys.stderr.flush()
        finally:
            _end_process(1)

    threading.excepthook = end_process_on_thread_exception
    _installed["threading.excepthook"] = end_process_on_thread_exception


# -- signals ------------------------------------------------------------------------------

def _watching() -> bool:
    """Whether this process's watcher thread is alive and still hears the signals (nobody,
    an asyncio loop say, took the wakeup fd over). From the main thread only."""
    watcher = _installed.get("watcher")
    if watcher is None or watcher[1] != os.getpid() or not watcher[0].is_alive():
        return False
    current = signal.set_wakeup_fd(-1)  # read it back (there is no getter)
    signal.set_wakeup_fd(current, warn_on_full_buffer=current != watcher[2])
    return bool(current == watcher[2])


def _watch_signals(describe: str) -> bool:
    """Start the watcher thread (see the module's text); False where it cannot be used."""
    if "watcher" in _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler and recorder.dump_path() is None:
        return False  # the program handles SIGINT itself, and there is nothing to dump
    read, write = os.pipe()
    os.set_blocking(write, False)
    try:
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    except ValueError:
        os.close(read)
        os.close(write)
        return False
    if previous != -1:  # someone else's: give it back
        signal.set_wakeup_fd(previous)
        os.close(read)
        os.close(write)
        return False
    watcher = threading.Thread(target=_watch, args=(read, describe), name="collectives-signals",
                               daemon=True)
    watcher.start()
    _installed["watcher"] = (watcher, os.getpid(), write)
    # A forked child (a DataLoader worker) has no watcher, and its signals must not reach
    # this process's pipe: it drops the wakeup fd and the pipe.
    os.register_at_fork(after_in_child=lambda: _forget(read, write))
    return True


def _forget(read: int, write: int) -> None:
    _installed.pop("watcher", None)
    try:
        if signal.set_wakeup_fd(-1) != write:  # someone else's by now: leave it
            signal.set_wakeup_fd(write)
            return
    except ValueError:  # forked from another thread than the main one
        return
    os.close(read)
    os.close(write)


def _watch(read: int, describe: str) -> None:
    main = threading.main_thread().ident
    while True:
        try:
            received = os.read(read, 64)
        except OSError:
            return
        if not received:
            return
        if signal.SIGUSR1 in received and "SIGUSR1" in _installed:
            recorder.dump("SIGUSR1")
        if signal.SIGTERM in received and "SIGTERM" in _installed:
            _die_of(signal.SIGTERM)
        # Only while SIGINT still means KeyboardInterrupt (the program may have set its own).
        if signal.SIGINT in received and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            recorder.dump("SIGINT")
            _end_if_blocked(main, describe)


def _die_of(signum: int) -> None:
    """Write the dump, then end the process by ``signum`` with its default action, as if no
    handler had been installed (the launcher sees the same exit status as before). A dump this
    process wrote that says more (an uncaught exception, a timeout: the launcher's SIGTERM to
    the others can reach the rank that failed while it is still ending) stays; one written on
    request (SIGUSR1) is rewritten."""
    if not recorder.written or recorder.written[-1] == "SIGUSR1":
        recorder.dump(signal.Signals(signum).name)
    sys.stdout.flush()
    sys.stderr.flush()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signum, signal.SIG_DFL)
    else:  # Python lets only the main thread set handlers; the C library lets any thread
        ctypes.CDLL(None).signal(signum, ctypes.c_void_p(0))  # 0: SIG_DFL
    os.kill(os.getpid(), signum)


def _on_signal(signum: int, frame: Any) -> None:
    """The Python-level handler of SIGTERM and SIGUSR1. Where the watcher thread is alive it
    has done the work already (even with the main thread blocked); else it is done here."""
    if _installed.get("pid") != os.getpid():  # a forked child: as if no handler were set
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _watching():
        return
    if signum == signal.SIGTERM:
        _die_of(signum)
    else:
        recorder.dump(signal.Signals(signum).name)


def _dump_on_signals() -> None:
    """With ``COLLECTIVES_TRACE_DIR``: SIGTERM and SIGUSR1 write the dump (see the module's text)."""
    if recorder.dump_path() is None or threading.current_thread() is not threading.main_thread():
        return
    _installed["pid"] = os.getpid()
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        name = signal.Signals(signum).name
        if name not in _installed and signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, _on_signal)
            _installed[name] = _on_signal


def _innermost(main: Any) -> tuple[Any, int]:
    frame = sys._current_frames().get(main)
    return frame, -1 if frame is None else frame.f_lasti


def _ours(frame: Any) -> bool:
    return os.path.dirname(os.path.abspath(frame.f_code.co_filename)) in recorder._library_directories()


def _in_call_path(frame: Any, main: Any) -> bool:
    """Whether the main thread (``main``, its innermost frame ``frame``) is in a transport call of
    ours: its frame in our code, or in torch.distributed called from it; or a call of a
    communicator it owns is in its transport part (``CallPath.running``), where the compiled call
    path and fast paths leave no frame of their own."""
    if _ours(frame) or f"torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename:
        while frame is not None and not _ours(frame):
            frame = frame.f_back
        if frame is not None:
            return True
    paths = [getattr(comm, "_path", None) for comm in list(farewell.LIVE)]
    return any(path is not None and path.running and path.gate == main for path in paths)


def _handling_interrupt(main: Any) -> bool:
    """Whether the main thread is inside an ``except KeyboardInterrupt`` (it got this one:
    a collective it makes there to wind down must not be cut short)."""
    current = getattr(sys, "_current_exceptions", dict)().get(main)
    if isinstance(current, tuple):  # (type, value, traceback) before Python 3.12
        current = current[1]
    return isinstance(current, KeyboardInterrupt)


def _end_if_blocked(main: Any, describe: str) -> None:
    before = _innermost(main)
    deadline = time.monotonic() + GRACE
    while time.monotonic() < deadline:
        if _innermost(main) != before or _handling_interrupt(main):
            return  # the main thread ran Python: its KeyboardInterrupt is on its way
        time.sleep(0.05)
    frame = before[0]
    if frame is None or not _in_call_path(frame, main):
        return
    where = f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"
    try:
        sys.stdout.flush()
        sys.stderr.write(
            f"collectives: SIGINT on {describe} while blocked for {GRACE:g} s in {where}, a "
            "transport call that Python cannot interrupt; ending the process (exit code 130) "
            "so that the launcher ends the other ranks\n")
        sys.stderr.flush()
    finally:
        _end_process(130)


def install_farewell() -> None:
    """Once per process, when its first communicator of more than one rank is made: at
    interpreter exit every open communicator says farewell (registered after the transport's
    own exit handlers, so it runs before them). A process-wide hook: not with
    ``COLLECTIVES_PROCESS_HOOKS=0`` (``close()`` still says farewell)."""
    installed = farewell._installed
    if "atexit" in installed or not enabled():
        return
    # How the process is ending: the MPI exit watch's, else one of its own (main thread only).
    watch = _installed.get("atexit")
    if watch is None and threading.current_thread() is threading.main_thread():
        watch = _exits.ExitWatch()
    installed["watch"] = watch
    atexit.register(farewell._at_exit)
    installed["atexit"] = True
