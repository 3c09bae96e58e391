"""A rank of a :class:`~collectives.testing.pool.RankPool`: run by the launcher, never by hand.

A rank never outlives its pool: it dies with its launcher (``PR_SET_PDEATHSIG``), and a
watchdog thread ends it when the pool's connection closes, even while a job is stuck.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import select
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import collectives
from collectives.launcher import detect_launcher
from collectives.testing.pool import connect_worker, receive, send, set_parent_death_signal

#: Seconds an idle rank whose pool went away gets to exit on its own (MPI_Finalize, Gloo
#: teardown) before the watchdog ends it.
EXIT_GRACE = 10.0
_HANGUP = select.POLLHUP | select.POLLERR | select.POLLNVAL | getattr(select, "POLLRDHUP", 0)

_jobs: dict[tuple[str, str, str], Callable[..., Any]] = {}


def _resolve(module_name: str, path: str, qualname: str) -> Callable[..., Any]:
    key = (module_name, path, qualname)
    if key in _jobs:
        return _jobs[key]
    if module_name == "__main__":  # a job in the caller's script: ours is this worker
        module_name = "_collectives_job_script"
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            module = None
        if module is None or os.path.abspath(getattr(module, "__file__", "") or "") != path:
            # A test file pytest imported by path (rootdir-relative name), or the caller's
            # script (its `if __name__ == "__main__":` part does not run here): load by path.
            sys.path.insert(0, os.path.dirname(path))
            spec = importlib.util.spec_from_file_location(module_name, path)
            assert spec is not None and spec.loader is not None, path
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    job: Callable[..., Any] = target
    _jobs[key] = job
    return job


def _die_with_launcher() -> None:
    """Under torchrun or mpiexec: die when the launcher's process that started us dies
    (a local rank's pool arms this itself, from the thread that starts it)."""
    if detect_launcher().launcher is None:
        return
    parent = os.getppid()
    if set_parent_death_signal() and os.getppid() != parent:
        os._exit(1)  # it died before the signal was armed


def _watch(conn: Any, busy: threading.Event) -> None:
    """End this rank once the pool's end of ``conn`` closes: at once when a job is running
    (no one waits for its result), else after EXIT_GRACE if the normal exit did not finish."""
    poller = select.poll()
    poller.register(conn.fileno(), _HANGUP)  # no POLLIN: pending jobs do not wake us
    while not any(events & _HANGUP for _, events in poller.poll()):
        pass
    if not busy.is_set():
        threading.Event().wait(EXIT_GRACE)
    os._exit(1)


def main() -> None:
    _die_with_launcher()
    comm = collectives.init()
    conn = connect_worker()
    busy = threading.Event()
    threading.Thread(target=_watch, args=(conn, busy), name="pool-watchdog", daemon=True).start()
    send(conn, {"rank": comm.rank, "size": comm.size, "pid": os.getpid()})
    while True:
        try:
            message = receive(conn)
        except EOFError:
            break
        if message[0] == "exit":
            if comm._broken is not None:  # finalizing over abandoned calls may wait forever
                sys.stdout.flush()
                os._exit(0)
            break
        _, reference, args = message
        busy.set()
        try:
            result = _resolve(*reference)(comm, *args)
            reply: tuple[Any, ...] = ("ok", result)
        except BaseException as error:  # noqa: BLE001  (every failure goes back to the pool)
            reply = ("error", type(error).__name__, str(error), traceback.format_exc())
        busy.clear()
        # A timeout in the job makes this rank's communicators unusable (the world's too):
        # the pool then starts new ranks before its next job.
        unusable = comm._broken is not None
        try:
            send(conn, (reply, unusable))
        except Exception as error:  # noqa: BLE001  (an unpicklable result)
            send(conn, (("error", type(error).__name__, f"result could not be sent: {error}",
                         traceback.format_exc()), unusable))
    conn.close()


if __name__ == "__main__":
    main()
