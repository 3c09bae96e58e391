"""A rank of a :class:`~collectives.testing.pool.RankPool`: run by the launcher, never by hand."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import collectives
from collectives.testing.pool import connect_worker, receive, send

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
    _jobs[key] = target
    return target


def main() -> None:
    comm = collectives.init()
    conn = connect_worker()
    send(conn, {"rank": comm.rank, "size": comm.size, "pid": os.getpid()})
    while True:
        try:
            message = receive(conn)
        except EOFError:
            break
        if message[0] == "exit":
            break
        _, reference, args = message
        try:
            result = _resolve(*reference)(comm, *args)
            reply: tuple[Any, ...] = ("ok", result)
        except BaseException as error:  # noqa: BLE001  (every failure goes back to the pool)
            reply = ("error", type(error).__name__, str(error), traceback.format_exc())
        try:
            send(conn, reply)
        except Exception as error:  # noqa: BLE001  (an unpicklable result)
            send(conn, ("error", type(error).__name__, f"result could not be sent: {error}",
                       traceback.format_exc()))
    conn.close()


if __name__ == "__main__":
    main()
