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
from collectives import farewell, registry
from collectives.communicator import Communicator
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


def _recoverable() -> bool:
    """Whether every unusable communicator of this rank was made so by a peer that gave up on
    it (a job that raised elsewhere): a new world communicator then serves the next job. A
    timeout leaves requests in the transport that a later call could meet: the pool restarts."""
    from collectives.farewell import LIVE as _LIVE  # noqa: PLC0415

    return all(comm._farewells.left for comm in list(_LIVE) if comm._why_broken)


def _renew(comm: Communicator) -> Communicator:
    """A new world communicator over the same ranks (collective: every rank renews together,
    when the pool says so), made from the transport's own world, not from ``comm`` (which may
    hold a call that a peer gave up on); ``collectives.init()`` returns it from now on."""
    if comm.backend == "mpi":
        from mpi4py import MPI  # noqa: PLC0415

        from collectives.backends.mpi import MPICommunicator  # noqa: PLC0415

        new: Communicator = MPICommunicator(MPI.COMM_WORLD, local_rank=comm.local_rank)
    elif comm.backend == "torch":
        import torch.distributed as dist  # noqa: PLC0415

        from collectives.backends.torch_bootstrap import group_named  # noqa: PLC0415
        from collectives.backends.torch_dist import TorchCommunicator  # noqa: PLC0415

        _renewals.append(len(_renewals))
        name = f"collectives/pool-renewal/{len(_renewals)}"  # the same on every rank
        with group_named(name):
            group = dist.new_group(list(range(comm.size)), use_local_synchronization=True)
        new = TorchCommunicator(group, local_rank=comm.local_rank)
        new._transport._name = name  # (its farewells' keys in torch's store)
    else:
        return comm
    _forget_c10d_groups()
    new.trace_name = "world"
    registry._default = new
    farewell.raised.clear()
    return new


_renewals: list[int] = []


def _forget_c10d_groups() -> None:
    """torch.distributed over the backend "collectives", where an earlier job made it: its
    groups hold communicators split from the world a peer gave up on, so the next job's call on
    them would raise PeerLeft; they are destroyed here (locally: a Python group's destruction
    sends nothing) and the next job makes them anew."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() \
            and str(dist.get_backend()) == "collectives":
        dist.destroy_process_group()


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
        if message[0] == "renew":  # a job raised on some rank: every rank renews, together
            comm = _renew(comm)
            continue
        _, reference, args = message
        busy.set()
        try:
            result = _resolve(*reference)(comm, *args)
            reply: tuple[Any, ...] = ("ok", result)
        except BaseException as error:  # noqa: BLE001  (every failure goes back to the pool)
            reply = ("error", type(error).__name__, str(error), traceback.format_exc())
            # The peers waiting in a call of this rank's (the world's, or a split the job made
            # and the traceback still holds) raise at once, instead of after their timeout.
            farewell.say_farewell(farewell.ABANDONED)
            del error
        busy.clear()
        # A timeout in the job makes this rank's communicators unusable (the world's too):
        # the pool then starts new ranks before its next job. One that a peer gave up on is
        # renewed instead (the pool sends "renew" after a job that raised).
        unusable = comm._broken is not None and not _recoverable()
        try:
            send(conn, (reply, unusable))
        except Exception as error:  # noqa: BLE001  (an unpicklable result)
            send(conn, (("error", type(error).__name__, f"result could not be sent: {error}",
                         traceback.format_exc()), unusable))
    conn.close()


if __name__ == "__main__":
    main()
