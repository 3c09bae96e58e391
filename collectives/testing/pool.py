"""A pool of real ranks, started once with the real launcher and reused for many jobs.

The test process opens a listener on loopback; each rank, started by mpiexec,
torchrun or directly (local), makes its communicator, connects back and waits for
jobs. A job is a module-level function ``fn(comm, *args)`` named by module and
qualified name (the rank imports it: by module name, or from its file), plus
per-rank arguments; each rank sends back its return value, or its exception
with the rank's traceback. The connection is authenticated with a random key
(HMAC challenge of ``multiprocessing.connection``) before anything is unpickled,
so only the processes this pool started can talk to it.

A rank that hangs past the job's timeout, or dies, ends the pool (every rank is
killed) and the job raises :class:`RankTimeout` / :class:`RankCrashed`; the next
job starts a fresh pool, so one bad job never poisons the ones after it.

No rank outlives its pool, its launcher or the test process. Killing the launcher's
process group is not enough: torchrun starts each worker in a session of its own, so
a rank stuck in a job would survive, re-parented to PID 1. So the pool kills every
process whose environment carries its key (the ranks' pids from their hello first),
the launcher (or a local rank) gets ``PR_SET_PDEATHSIG``, each rank sets it for itself
(it dies with its launcher), and a watchdog thread in each rank ends it when the pool's
connection closes (the test process died). :func:`leftover_processes` lists what is
still alive; the pytest plugin fails the session if anything is.
"""

from __future__ import annotations

import atexit
import ctypes
import inspect
import os
import pickle
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import Any, cast

from .. import config
from ..errors import CollectiveError
from ..launcher import without_launcher_variables
from . import launch

POOL_ADDRESS_ENV = config.POOL_ADDRESS
POOL_AUTHKEY_ENV = config.POOL_AUTHKEY
#: Seconds a pool waits for its ranks to start and connect.
START_TIMEOUT = float(os.environ.get(config.POOL_START_TIMEOUT, 120))
#: Seconds one job may take before its pool is killed.
DEFAULT_JOB_TIMEOUT = float(os.environ.get(config.POOL_JOB_TIMEOUT, 60))

#: Seconds the other ranks get to finish once one rank raised.
ERROR_GRACE = 5.0
#: Launchers a pool can use for each backend; the first is the default.
LAUNCHERS = {"mpi": ("mpiexec",), "torch": ("torchrun", "mpiexec"), "local": ("none",),
             "cupy": ("mpiexec", "torchrun")}


def cpu_backends() -> list[str]:
    """The backends of the registry (:data:`collectives.registry.BACKENDS`) that run several
    ranks without a GPU, by name: what a test of every transport runs on."""
    from collectives import registry  # noqa: PLC0415

    return sorted(name for name in registry.BACKENDS
                  if name != "local" and name not in registry.NEEDS_GPU)


def worlds(sizes: Sequence[int], *, local: bool = True) -> list[tuple[str, int]]:
    """``(backend, size)`` for every backend of :func:`cpu_backends` and size of ``sizes``, after
    ``("local", 1)`` when ``local``: the parameters of a test of every transport."""
    return [("local", 1)] * local + [(name, size) for name in cpu_backends() for size in sizes]


# The project root, so ranks import the same collectives as the test process.
_ROOT = str(Path(__file__).resolve().parents[2])


class PoolError(CollectiveError):
    """The pool failed: ranks did not start, crashed, or a job timed out."""


class RankTimeout(PoolError, TimeoutError):
    """A job did not finish on every rank in time; the pool was killed."""


class RankCrashed(PoolError):
    """A rank died while running a job (or before it could start); the pool was killed."""


class RemoteError:
    """One rank's exception: its type name, message and traceback, as text."""

    def __init__(self, rank: int, type_name: str, message: str, traceback: str) -> None:
        self.rank, self.type_name, self.message, self.traceback = rank, type_name, message, traceback

    def __repr__(self) -> str:
        return f"RemoteError(rank={self.rank}, {self.type_name}: {self.message})"


class RankError(PoolError):
    """The job raised on one or more ranks. ``errors`` maps rank -> :class:`RemoteError`;
    ``results`` holds the ranks that returned (rank -> value)."""

    def __init__(self, errors: dict[int, RemoteError], results: dict[int, Any]) -> None:
        self.errors, self.results = errors, results
        details = "\n".join(f"--- rank {r}: {e.type_name}: {e.message}\n{e.traceback}"
                            for r, e in sorted(errors.items()))
        super().__init__(f"job failed on rank(s) {sorted(errors)}:\n{details}")


def send(conn: Connection, message: Any) -> None:
    """Send with the plain pickler. Connection.send uses multiprocessing's, for which torch
    registers reductions that pass tensors as shared-memory handles: those cannot be opened
    by a process that is not our child, so tensors must travel as bytes."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


def job_reference(fn: Callable[..., Any]) -> tuple[str, str, str]:
    """(module, file, qualified name) by which a rank finds ``fn``."""
    if not callable(fn) or "<locals>" in getattr(fn, "__qualname__", "<locals>"):
        raise TypeError("a job must be a module-level function, so that ranks can import it")
    path = inspect.getsourcefile(fn) or ""
    return fn.__module__, os.path.abspath(path), fn.__qualname__


class RankPool:
    """``size`` ranks of ``backend``, started by ``launcher``, running jobs until closed.

    >>> pool = RankPool("mpi", 4)
    >>> pool.run(my_job, [(a0,), (a1,), (a2,), (a3,)])   # my_job(comm, a_r) on rank r
    [result0, result1, result2, result3]
    """

    def __init__(self, backend: str, size: int, *, launcher: str | None = None,
                 env: dict[str, str] | None = None, job_timeout: float = DEFAULT_JOB_TIMEOUT):
        if backend not in LAUNCHERS:
            raise ValueError(f"backend={backend!r}; valid: {', '.join(LAUNCHERS)}")
        launcher = launcher or LAUNCHERS[backend][0]
        if launcher not in LAUNCHERS[backend]:
            raise ValueError(f"launcher={launcher!r} for backend {backend!r}; valid: "
                             f"{', '.join(LAUNCHERS[backend])}")
        if backend == "local" and size != 1:
            raise ValueError(f"backend 'local' has size 1; got size={size}")
        self.backend, self.size, self.launcher = backend, size, launcher
        self.job_timeout = job_timeout
        self.env = dict(env or {})
        self._process: subprocess.Popen[bytes] | None = None
        self._connections: list[Connection] = []
        self._listener: Listener | None = None
        self._log: Any = None
        self._authkey = ""  # hex; every process of the running pool carries it in its environment
        self._pids: list[int] = []  # the ranks' pids, from their hello
        self.jobs_run = 0
        self.starts = 0
        self._unusable = False  # a job left a rank's communicator unusable: restart first
        self._renew = False  # a job raised: the ranks renew their world communicator first

    # -- life cycle ---------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _command(self) -> list[str]:
        worker = [sys.executable, "-m", "collectives.testing.worker"]
        try:
            if self.launcher == "mpiexec":  # the MPI launcher COLLECTIVES_TEST_LAUNCHER names
                return launch.mpi_command(self.size, worker)
            if self.launcher == "torchrun":
                return launch.torchrun_command(self.size, ["-m", "collectives.testing.worker"])
        except launch.LauncherNotFound as error:
            raise PoolError(str(error)) from None
        return worker

    def start(self) -> None:
        """Start the ranks and wait until every one is connected (``PoolError`` if not)."""
        if self.alive and not self._unusable:
            return
        self.close()
        authkey = secrets.token_bytes(32)
        self._authkey = authkey.hex()
        _authkeys.add(self._authkey)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey, backlog=1024)  # (every rank connects at once)
        host, port = self._listener.address
        env = {**os.environ, **self.env,
               POOL_ADDRESS_ENV: f"{host}:{port}", POOL_AUTHKEY_ENV: self._authkey,
               "COLLECTIVES_BACKEND": self.backend,
               "PYTHONPATH": os.pathsep.join([_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
               "PYTHONUNBUFFERED": "1"}
        env = without_launcher_variables(env)  # the launcher sets this job's own
        self._log = tempfile.TemporaryFile()
        self._process = subprocess.Popen(self._command(), env=env, stdin=subprocess.DEVNULL,
                                         stdout=self._log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_die_with_this_thread())
        self.starts += 1
        connections: dict[int, Connection] = {}
        deadline = time.monotonic() + START_TIMEOUT
        # accept() has no timeout of its own: the listening socket's (private, so untyped).
        sock = self._listener._listener._socket  # type: ignore[attr-defined]
        while len(connections) < self.size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._process.poll() is not None:  # timed out, or the launcher exited
                exited = self._process.poll()
                output = self.output()
                self.close()
                why = (f"did not all start within {START_TIMEOUT:.0f}s" if exited is None else
                       f"did not all start: the launcher exited (status {exited}) after "
                       f"{len(connections)} connected")
                raise PoolError(f"{self.size} {self.backend} ranks under {self.launcher} {why}; "
                                f"their output:\n{output}")
            sock.settimeout(min(remaining, 0.5))
            try:
                conn = self._listener.accept()
            except TimeoutError:
                continue
            hello = receive(conn)
            connections[hello["rank"]] = conn
            self._pids.append(hello["pid"])
        sock.settimeout(None)
        self._connections = [connections[r] for r in range(self.size)]

    def output(self) -> str:
        """Everything the ranks printed so far (last 20,000 characters)."""
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        text: str = self._log.read().decode(errors="replace")
        self._log.seek(0, os.SEEK_END)
        return text[-20000:]

    def close(self) -> None:
        """Stop the ranks (politely, then by force) and release the listener."""
        for conn in self._connections:
            try:
                send(conn, ("exit",))
            except OSError:
                pass
        process, self._process = self._process, None
        if process is not None:
            try:
                process.wait(timeout=10 if self._connections else 0.1)
            except subprocess.TimeoutExpired:
                pass
            _kill_session(process)
        for conn in self._connections:
            conn.close()  # a rank still stuck in a job sees its pool go and exits
        self._connections = []
        if self._authkey:
            _kill_processes_of(self._authkey, self._pids)
        self._authkey, self._pids = "", []
        self._unusable = self._renew = False
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def kill(self) -> None:
        """Kill every rank at once (what a timeout or crash does)."""
        if self._process is not None:
            _kill_session(self._process)
        for conn in self._connections:
            conn.close()
        self._connections = []
        self.close()

    def __enter__(self) -> RankPool:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- jobs ---------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], per_rank: Sequence[Sequence[Any]] | None = None, *,
            args: Sequence[Any] = (), timeout: float | None = None) -> list[Any]:
        """Run ``fn(comm, *args_r)`` on every rank r; return the results in rank order.

        ``per_rank[r]`` are rank r's arguments; without it every rank gets ``args``.
        Raises :class:`RankError` if any rank raised (with every rank's traceback),
        :class:`RankTimeout` past ``timeout`` seconds, :class:`RankCrashed` if a rank died;
        the latter two kill the pool, and the next ``run`` starts a new one.
        """
        if per_rank is None:
            per_rank = [tuple(args)] * self.size
        if len(per_rank) != self.size:
            raise ValueError(f"per_rank has {len(per_rank)} entries for {self.size} ranks")
        reference = job_reference(fn)
        self.start()
        timeout = self.job_timeout if timeout is None else timeout
        try:
            for conn, rank_args in zip(self._connections, per_rank):
                if self._renew:
                    send(conn, ("renew",))
                send(conn, ("job", reference, tuple(rank_args)))
            self._renew = False
        except OSError as error:
            output = self.output()
            self.kill()
            raise RankCrashed(f"could not send the job to the ranks ({error}); output:\n{output}") from None
        replies = self._collect(timeout, fn)
        self.jobs_run += 1
        errors = {r: RemoteError(r, *reply[1:]) for r, reply in replies.items() if reply[0] == "error"}
        results = {r: reply[1] for r, reply in replies.items() if reply[0] == "ok"}
        if errors:  # the ranks live on; their world communicator is renewed before the next job
            self._renew = True
            raise RankError(errors, results)
        return [results[r] for r in range(self.size)]

    def _collect(self, timeout: float, fn: Callable[..., Any]) -> dict[int, tuple[Any, ...]]:
        pending = {conn: rank for rank, conn in enumerate(self._connections)}
        replies: dict[int, tuple[Any, ...]] = {}
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            # wait() returns some of the connections it was given.
            ready = cast(list[Connection], wait(list(pending), timeout=max(remaining, 0)) if remaining > 0 else [])
            if not ready:
                output = self.output()
                self.kill()
                failed = {r: RemoteError(r, *reply[1:]) for r, reply in replies.items()
                          if reply[0] == "error"}
                if failed:  # the others are stuck waiting for the rank that raised
                    raise RankError(failed, {r: reply[1] for r, reply in replies.items()
                                             if reply[0] == "ok"})
                raise RankTimeout(
                    f"job {fn.__qualname__} did not finish within {timeout:g}s on rank(s) "
                    f"{sorted(pending.values())} (finished: {sorted(replies)}); the pool was "
                    f"killed. Ranks' output:\n{output}")
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    replies[rank], unusable = receive(conn)
                    self._unusable |= unusable
                    if replies[rank][0] == "error":  # peers may now wait forever: cut it short
                        deadline = min(deadline, time.monotonic() + ERROR_GRACE)
                except (EOFError, OSError):
                    output = self.output()
                    self.kill()
                    raise RankCrashed(f"rank {rank} died during job {fn.__qualname__}; "
                                      f"the pool was killed. Ranks' output:\n{output}") from None
        return replies


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


# -- no process of a pool outlives it ------------------------------------------------------

#: The keys of every pool this process started: their processes carry one in their environment.
_authkeys: set[str] = set()
_PR_SET_PDEATHSIG = 1
try:  # looked up now: a preexec_fn must not dlopen between fork and exec
    _prctl: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _prctl = None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when the thread that started it ends
    (Linux ``prctl(PR_SET_PDEATHSIG)``; it survives exec). False where it is unavailable."""
    return _prctl is not None and _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _die_with_this_thread() -> Callable[[], None] | None:
    """A ``preexec_fn`` that ties the child's life to the calling thread, if that is the main
    thread (the death signal follows the thread that forked, not the process: a pool started
    from a short-lived thread would lose its ranks when the thread ends)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def preexec() -> None:
        set_parent_death_signal()
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)
    return preexec


def _environment_value(pid: int | str, name: str) -> str | None:
    """``name``'s value in the environment process ``pid`` started with (None: unset,
    gone, a zombie or not ours)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for entry in environ.split(b"\0"):
        if entry.startswith(prefix):
            return entry[len(prefix):].decode(errors="replace")
    return None


def processes_with(variable: str, values: Iterable[str]) -> list[int]:
    """Pids of live processes (other than this one) whose environment sets ``variable`` to
    one of ``values``."""
    wanted = set(values)
    if not wanted:
        return []
    return [int(entry.name) for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and int(entry.name) != os.getpid()
            and _environment_value(entry.name, variable) in wanted]


def processes_of(authkeys: Iterable[str]) -> list[int]:
    """Pids of live processes started by the pools with these keys: launchers, their
    helpers and ranks all carry the pool's key in their environment."""
    return processes_with(POOL_AUTHKEY_ENV, authkeys)


def leftover_processes() -> list[int]:
    """Pids of processes that any pool of this process started and that are still alive."""
    return processes_of(_authkeys)


def describe_processes(pids: Iterable[int]) -> str:
    """One line per pid: its command line and parent, for an error message."""
    lines = []
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            parent = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if line.startswith("PPid:"))
            lines.append(f"  pid {pid} (parent {parent}): {command}")
        except (OSError, StopIteration):
            lines.append(f"  pid {pid}: gone")
    return "\n".join(lines)


def _kill_processes_of(authkey: str, pids: Iterable[int] = (), grace: float = 5.0) -> list[int]:
    """SIGKILL every process of the pool with ``authkey`` (``pids`` first: the ranks' own,
    which may have left the launcher's session) until none is left or ``grace`` seconds
    passed; returns those still alive then."""
    deadline = time.monotonic() + grace
    for pid in pids:
        if _environment_value(pid, POOL_AUTHKEY_ENV) == authkey:  # not a reused pid
            _signal(pid, signal.SIGKILL)
    while left := processes_of([authkey]):
        if time.monotonic() > deadline:
            return left
        for pid in left:
            _signal(pid, signal.SIGKILL)
        time.sleep(0.01)  # the kernel is tearing them down
    return []


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- pools shared by a test session ---------------------------------------------------------

#: How many pools stay alive at once; the least recently used one is closed beyond that.
MAX_LIVE_POOLS = int(os.environ.get(config.POOL_MAX_LIVE, 4))
_pools: OrderedDict[tuple[str, int, str | None], RankPool] = OrderedDict()


def get_pool(backend: str, size: int, launcher: str | None = None) -> RankPool:
    """The session's shared pool for (backend, size, launcher), started on first use."""
    key = (backend, size, launcher)
    pool = _pools.pop(key, None)
    if pool is None:
        pool = RankPool(backend, size, launcher=launcher)
    _pools[key] = pool
    while len(_pools) > MAX_LIVE_POOLS:
        _, oldest = _pools.popitem(last=False)
        oldest.close()
    pool.start()
    return pool


@atexit.register
def close_all_pools() -> None:
    while _pools:
        _pools.popitem()[1].close()


def connect_worker() -> Connection:
    """In a rank: the connection to the pool that started it (from the environment)."""
    host, _, port = os.environ[POOL_ADDRESS_ENV].rpartition(":")
    return Client((host, int(port)), authkey=bytes.fromhex(os.environ[POOL_AUTHKEY_ENV]))
