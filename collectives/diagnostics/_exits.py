"""How this process is ending: normally, or through an uncaught ``SystemExit`` (and its code).

The MPI abort hook (``collectives.backends.mpi``) asks at exit: a rank that ends with a non-zero
code while its peers wait in a collective would hang in ``MPI_Finalize``, so it must
call ``MPI_Abort`` instead; a rank that ends normally (even after catching a
``SystemExit``) must not. An uncaught ``SystemExit`` reaches neither ``sys.excepthook``
nor any other hook, so the answer is read from the main module's frame, kept from the
moment the watch starts: when the module ran to its end, the frame's last instruction
is its final ``RETURN_VALUE`` (``RETURN_CONST`` on 3.12+); an exception that left the
module leaves the frame at the instruction that raised it. The exit code comes from
``sys.exit`` (wrapped when ``collectives`` is imported: it records its status and where the
main frame was when it was called) or, on Python 3.12+, from ``sys.monitoring`` (``PY_UNWIND`` of the main module's
code hands over the exception itself, so a bare ``raise SystemExit(n)`` is seen too).
On 3.10/3.11 the code of a ``SystemExit`` raised other than through ``sys.exit`` cannot
be seen: it counts as a failure with code 1.

Standard library only, so the tests run it on every Python version.
"""

from __future__ import annotations

import dis
import os
import sys
import threading
from types import FrameType
from typing import Any, NoReturn

_RETURNS = {dis.opmap[name] for name in ("RETURN_VALUE", "RETURN_CONST") if name in dis.opmap}
#: sys.monitoring tool ids tried in turn (0-2 and 5 are the debugger's, coverage's,
#: profiler's and optimizer's by convention).
_TOOL_IDS = (4, 3)


def _main_module_frame() -> FrameType | None:
    """The outermost frame running ``__main__``'s code on the main thread, or None."""
    main = sys.modules.get("__main__")
    if main is None:
        return None
    frame: FrameType | None
    if threading.current_thread() is threading.main_thread():
        frame = sys._getframe()
    else:
        frame = sys._current_frames().get(threading.main_thread().ident or 0)
    found = None
    while frame is not None:
        if frame.f_globals is main.__dict__:
            found = frame
        frame = frame.f_back
    return found


def _verdict(what: str, code: Any) -> tuple[str, int] | None:
    """(what, exit code) for an exit with ``code`` (as SystemExit takes it), None for success."""
    if code is None or (isinstance(code, int) and code == 0):
        return None
    return what, code if isinstance(code, int) else 1


#: The latest sys.exit call on the main thread: (status, the main module frame, its f_lasti then).
_exit_calls: list[tuple[Any, Any, int]] = []


def record_exit_calls() -> None:
    """Wrap ``sys.exit`` so that it records its status (once per process). Called when
    ``collectives`` is imported: ``sys.exit(main())`` looks ``sys.exit`` up before ``main()``
    runs, so a wrapper installed later, by ``collectives.init()``, would miss it."""
    if getattr(sys.exit, "_collectives_records", False):
        return
    system_exit = sys.exit

    def exit_recording_status(status: str | int | None = None) -> NoReturn:
        if threading.current_thread() is threading.main_thread():  # elsewhere it ends a thread only
            frame = _main_module_frame()
            if frame is not None:
                _exit_calls[:] = [(status, frame, frame.f_lasti)]
        system_exit(status)

    exit_recording_status._collectives_records = True  # type: ignore[attr-defined]
    sys.exit = exit_recording_status


class ExitWatch:
    """Installed once per process; ``failing_exit()`` at exit tells whether the process is
    ending through an uncaught exit with a non-zero code."""

    def __init__(self) -> None:
        record_exit_calls()
        self._frame = _main_module_frame()
        # Python 3.12+: the exception that left the main module's frame.
        self._unwound: BaseException | None = None
        self._watch_unwinding()

    def _watch_unwinding(self) -> None:
        monitoring = getattr(sys, "monitoring", None)
        if monitoring is None or self._frame is None:
            return
        tool = next((tool for tool in _TOOL_IDS if monitoring.get_tool(tool) is None), None)
        if tool is None:
            return
        code = self._frame.f_code

        def unwound(unwinding: Any, offset: int, exception: BaseException) -> None:
            if unwinding is code:
                self._unwound = exception

        monitoring.use_tool_id(tool, "collectives exit status")
        monitoring.register_callback(tool, monitoring.events.PY_UNWIND, unwound)
        monitoring.set_events(tool, monitoring.get_events(tool) | monitoring.events.PY_UNWIND)

    def failing_exit(self) -> tuple[str, int] | None:
        """At exit: ``(what, exit code)`` when this process is ending through an uncaught
        exit with a non-zero code, else None (it ended normally, or with code 0)."""
        frame = self._frame
        if frame is None:  # no main module seen (an embedded interpreter): trust sys.exit
            status = _exit_calls[0][0] if _exit_calls else None
            return _verdict(f"sys.exit({status!r})", status)
        if frame.f_code.co_code[frame.f_lasti] in _RETURNS:
            return None  # the main module ran to its end (a SystemExit it caught included)
        if _exit_calls and _exit_calls[0][1] is frame and _exit_calls[0][2] == frame.f_lasti:
            status = _exit_calls[0][0]  # the latest sys.exit call left the module
            return _verdict(f"sys.exit({status!r})", status)
        if self._unwound is not None:
            if isinstance(self._unwound, SystemExit):
                return _verdict(f"uncaught SystemExit({self._unwound.code!r})", self._unwound.code)
            return f"uncaught {type(self._unwound).__name__}", 1
        version = ".".join(map(str, sys.version_info[:2]))
        return (f"uncaught SystemExit (its code is not visible on Python {version}: "
                "sys.exit(n) keeps it), or an exception a replaced sys.excepthook let pass"), 1


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` is running (a zombie, ended but not reaped yet, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc (macOS): kill(0) said it exists
        return True


def wait_ended(pids: list[int], seconds: float) -> list[int]:
    """Wait up to ``seconds`` for the processes ``pids`` (of this host) to end; the ones still
    running then. Where Linux gives a process file descriptor (``os.pidfd_open``), the wait is
    on its readiness (it becomes readable when the process ends); elsewhere, a look at each
    every 10 ms."""
    import select  # noqa: PLC0415
    import time  # noqa: PLC0415

    deadline = time.monotonic() + seconds
    pidfds: dict[int, int] = {}
    polled: list[int] = []
    for pid in pids:
        try:
            pidfds[os.pidfd_open(pid)] = pid  # type: ignore[attr-defined,unused-ignore]
        except ProcessLookupError:
            pass  # ended already
        except (AttributeError, OSError):
            polled.append(pid)
    try:
        while True:
            polled = [pid for pid in polled if process_alive(pid)]
            if pidfds:
                left = max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select(list(pidfds), [], [], min(left, 0.01) if polled else left)
                for fd in ready:
                    os.close(fd)
                    del pidfds[fd]
            remaining = list(pidfds.values()) + polled
            if not remaining or time.monotonic() >= deadline:
                return remaining
            if not pidfds:
                time.sleep(0.01)
    finally:
        for fd in pidfds:
            os.close(fd)
