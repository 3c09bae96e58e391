"""SIGINT while a rank is blocked inside a transport call that Python cannot interrupt.

Python raises ``KeyboardInterrupt`` only between bytecodes of the main thread. A rank
blocked in Gloo's wait (torch backend) or in a blocking MPI call (``COLLECTIVES_TIMEOUT=0``)
never gets there while its peer is missing: a SIGINT to that rank (or to torchrun, which
forwards it) was deferred until the collective's timeout, 30 minutes by default.

So a watcher thread learns of every SIGINT through Python's wakeup fd (written by the C
signal handler even while the main thread is blocked). If after :data:`GRACE` seconds the
main thread has not run one more bytecode (same frame, same instruction) and it is inside
this library's call path, the process ends as a SIGINT would: a line on stderr naming the
rank and the call, then ``MPI_Abort(130)`` where MPI is initialized, else
``os._exit(130)``; the launcher (mpiexec, torchrun) ends the other ranks. A main thread
that is running Python, or blocked elsewhere (the program's own numpy call), is left
alone: it gets its ``KeyboardInterrupt`` as before.

Installed only from the main thread, only while SIGINT has Python's default handler, and
only where nothing else uses the wakeup fd (asyncio's loop takes it over when it adds
signal handlers; the watcher then hears nothing and the old behaviour is back).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

import collectives

#: Seconds a rank waits after writing its last words before MPI_Abort: the abort also ends
#: the launcher's forwarding of the rank's output, which may still hold them.
FORWARDING_GRACE = 0.2
#: Seconds a SIGINT may stay pending in a blocked transport call before the process ends.
GRACE = 2.0
#: Where the library's call path lives: the backends' directory and collectives/.
_OURS = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.abspath(collectives.__file__)))
_installed: list[threading.Thread] = []


def rank_of(launch: Any) -> Any:
    """``describe`` for :func:`install`: the rank as the launcher numbered it."""
    return lambda: f"rank {launch.rank} of {launch.size} (pid {os.getpid()})"


def install(describe: Any = None) -> bool:
    """Start the watcher (once per process); False where it cannot be used.
    ``describe()``: a short text naming this rank, for the message."""
    if _installed:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return False  # the program handles SIGINT itself
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
    watcher = threading.Thread(target=_watch, args=(read, describe), name="collectives-sigint",
                               daemon=True)
    watcher.start()
    _installed.append(watcher)
    # A forked child (a DataLoader worker) has no watcher, and its SIGINTs must not reach
    # this process's pipe: it drops the wakeup fd and the pipe.
    os.register_at_fork(after_in_child=lambda: _forget(read, write))
    return True


def _forget(read: int, write: int) -> None:
    _installed.clear()
    try:
        if signal.set_wakeup_fd(-1) != write:  # someone else's by now: leave it
            signal.set_wakeup_fd(write)
            return
    except ValueError:  # forked from another thread than the main one
        return
    os.close(read)
    os.close(write)


def _watch(read: int, describe: Any) -> None:
    main = threading.main_thread().ident
    while True:
        try:
            received = os.read(read, 64)
        except OSError:
            return
        if not received:
            return
        # Only while SIGINT still means KeyboardInterrupt (the program may have set its own).
        if signal.SIGINT in received and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            _end_if_blocked(main, describe)


def _innermost(main: Any) -> tuple[Any, int]:
    frame = sys._current_frames().get(main)
    return frame, -1 if frame is None else frame.f_lasti


def _ours(frame: Any) -> bool:
    return os.path.dirname(os.path.abspath(frame.f_code.co_filename)) in _OURS


def _in_call_path(frame: Any) -> bool:
    """Whether the main thread's innermost frame is a transport call of ours: in our code,
    or in torch.distributed called from it."""
    if not (_ours(frame) or f"torch{os.sep}distributed{os.sep}" in frame.f_code.co_filename):
        return False
    while frame is not None and not _ours(frame):
        frame = frame.f_back
    return frame is not None


def _handling_interrupt(main: Any) -> bool:
    """Whether the main thread is inside an ``except KeyboardInterrupt`` (it got this one:
    a collective it makes there to wind down must not be cut short)."""
    current = getattr(sys, "_current_exceptions", dict)().get(main)
    if isinstance(current, tuple):  # (type, value, traceback) before Python 3.12
        current = current[1]
    return isinstance(current, KeyboardInterrupt)


def _end_if_blocked(main: Any, describe: Any) -> None:
    before = _innermost(main)
    deadline = time.monotonic() + GRACE
    while time.monotonic() < deadline:
        if _innermost(main) != before or _handling_interrupt(main):
            return  # the main thread ran Python: its KeyboardInterrupt is on its way
        time.sleep(0.05)
    frame = before[0]
    if frame is None or not _in_call_path(frame):
        return
    where = f"{frame.f_code.co_name} ({os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"
    rank = describe() if describe is not None else f"pid {os.getpid()}"
    try:
        sys.stdout.flush()
        sys.stderr.write(
            f"collectives: SIGINT on {rank} while blocked for {GRACE:g} s in {where}, a "
            "transport call that Python cannot interrupt; ending the process (exit code 130) "
            "so that the launcher ends the other ranks\n")
        sys.stderr.flush()
    finally:
        _end_process(130)


def _end_process(code: int) -> None:
    """End this process with ``code``. Under MPI through MPI_Abort, which has mpiexec end
    every rank at once (a rank that only ``_exit``s was once not noticed by Hydra within 30 s
    in CI); elsewhere (torchrun watches its workers) ``os._exit``."""
    MPI: Any = sys.modules.get("mpi4py.MPI")
    try:
        if MPI is not None and MPI.Is_initialized() and not MPI.Is_finalized():
            time.sleep(FORWARDING_GRACE)
            MPI.COMM_WORLD.Abort(code)
    finally:
        os._exit(code)
