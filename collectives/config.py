"""Every environment variable collectives reads, in one place (the README's table mirrors it)."""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
from typing import Any

#: Which backend ``init()`` starts: auto (default), local, torch, mpi, cupy.
BACKEND = "COLLECTIVES_BACKEND"
#: MPI backend: 1 hands CUDA memory to MPI directly, 0 stages it through pinned host
#: memory; unset detects whether the MPI library is CUDA-aware.
MPI_CUDA_AWARE = "COLLECTIVES_MPI_CUDA_AWARE"
#: Seconds a blocking collective may take before it raises CollectiveTimeout (default
#: DEFAULT_TIMEOUT); 0, "none" or "inf" turns timeouts off.
TIMEOUT = "COLLECTIVES_TIMEOUT"
#: How much the ranks compare before each collective (CollectiveMismatch on a difference).
#: Unset: the call's kind, reduce op, dtype, shape, root and sequence number, as one 64-bit
#: word in one small all_reduce per collective; 1: the full fingerprint of the call in one
#: small all_gather per collective (and a header ahead of each send); 0: nothing (after the
#: first collective of each communicator, which always compares in full).
DEBUG = "COLLECTIVES_DEBUG"
#: The levels of :data:`DEBUG`: checks off, the default check, the full fingerprint.
CHECKS_OFF, CHECKS_DEFAULT, CHECKS_FULL = 0, 1, 2

#: Calls each communicator remembers for diagnosis (default DEFAULT_TRACE_SIZE; 0 turns
#: the flight recorder off).
TRACE_SIZE = "COLLECTIVES_TRACE_SIZE"
#: A folder: each rank writes ``rank-<R>.json`` there on a timeout, a mismatch, SIGTERM,
#: SIGINT, SIGUSR1 or a crash (read them with ``collectives-trace DIR``). Unset: no dumps.
TRACE_DIR = "COLLECTIVES_TRACE_DIR"
#: 1 records each call's site (the first frame outside the library): costs a frame walk per call.
TRACE_CALLSITE = "COLLECTIVES_TRACE_CALLSITE"
#: 1 prints a table of calls, time, algbw and busbw per op and size range at exit (rank 0).
PROFILE = "COLLECTIVES_PROFILE"
#: 0 installs none of the process-wide hooks (exit, excepthook, signal handlers, the SIGINT
#: watcher; see collectives/diagnostics/process_hooks.py) for programs that manage exits and signals.
PROCESS_HOOKS = "COLLECTIVES_PROCESS_HOOKS"
#: 1: ``init()`` makes a fault-tolerant communicator (a dead peer raises RankFailure, and
#: ``shrink()``/``agree()`` go on without it; see collectives.elastic), as ``init(fault_tolerant=True)``.
FAULT_TOLERANT = "COLLECTIVES_FAULT_TOLERANT"
#: Set by ``collectives-elastic`` in its ranks' environment: the membership store (host:port).
ELASTIC_STORE = "COLLECTIVES_ELASTIC_STORE"
#: Set by ``collectives-elastic`` in its ranks' environment: this process's member id (0 .. n-1
#: for the first ranks; n, n+1, ... for replacements, which wait to join).
ELASTIC_ID = "COLLECTIVES_ELASTIC_ID"
#: 0 runs the pure-Python form of what has a compiled one (the call path, collectives/callpath.py,
#: compiled by Cython; the MPI backend's check round and carried small calls, backends/mpi_round.py
#: and mpi_carried.py, compiled the same way),
#: the reference the compiled form is tested against; read when a communicator is made (it keeps
#: its form).
COMPILED = "COLLECTIVES_COMPILED"

#: Seconds, like torch.distributed's own default.
DEFAULT_TIMEOUT = 1800.0
#: Calls remembered per communicator (each a small list: a few hundred bytes).
DEFAULT_TRACE_SIZE = 2000


def trace_size() -> int:
    """``COLLECTIVES_TRACE_SIZE`` (default :data:`DEFAULT_TRACE_SIZE`; 0: no recorder)."""
    text = os.environ.get(TRACE_SIZE, "").strip()
    if not text:
        return DEFAULT_TRACE_SIZE
    try:
        size = int(text)
    except ValueError:
        size = -1
    if size < 0:
        raise ValueError(f"{TRACE_SIZE}={text!r} is not a number of calls; use e.g. 2000, or 0 for none")
    return size


def timeout_seconds(timeout: float | None = None) -> float | None:
    """The timeout in seconds a communicator uses: ``timeout`` if given, else
    ``COLLECTIVES_TIMEOUT``, else :data:`DEFAULT_TIMEOUT`; ``None`` means no timeout.

    ``timeout`` may be a number of seconds or a ``datetime.timedelta``; 0 (or
    ``math.inf``) turns timeouts off. A negative or non-numeric value is a ``ValueError``.
    """
    source = "timeout"
    if timeout is None:
        text = os.environ.get(TIMEOUT, "").strip()
        if not text:
            return DEFAULT_TIMEOUT
        source = TIMEOUT
        if text.lower() in ("none", "inf", "infinity"):
            return None
        try:
            timeout = float(text)
        except ValueError:
            raise ValueError(f"{TIMEOUT}={text!r} is not a number of seconds; use e.g. 600, "
                             "or 0 / none for no timeout") from None
    if hasattr(timeout, "total_seconds"):  # datetime.timedelta
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be seconds (int or float) or a timedelta; "
                        f"got {type(timeout).__name__}")
    seconds = float(timeout)
    if seconds != seconds or seconds < 0:
        raise ValueError(f"{source}={timeout!r}: a timeout is >= 0 seconds (0: none)")
    return None if seconds in (0.0, float("inf")) else seconds


def check_level() -> int:
    """:data:`CHECKS_OFF`, :data:`CHECKS_DEFAULT` or :data:`CHECKS_FULL`, from ``COLLECTIVES_DEBUG``
    (0, unset, 1)."""
    flag = env_flag(DEBUG)
    return CHECKS_DEFAULT if flag is None else CHECKS_FULL if flag else CHECKS_OFF


def compiled() -> bool:
    """Whether the compiled forms run where they were built (``COLLECTIVES_COMPILED``, default 1)."""
    return env_flag(COMPILED) is not False


def compiled_extension(name: str, source: Any) -> Any:
    """The compiled form ``name`` (a module's full name), or None where :func:`compiled` says no,
    it was not built, or it was built from other sources: ``source`` is its Python twin, the module
    it was compiled from (setup.py stamps the compiled module with the sha256 of that file,
    ``__source_sha256__``: a build left from another version of the file is not used)."""
    if not compiled():
        return None
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    stamp = getattr(module, "__source_sha256__", None)
    return module if stamp is not None and stamp == source_sha256(source.__file__) else None


@functools.cache
def source_sha256(path: str) -> str:
    """The sha256 of the file at ``path`` (read once a process)."""
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


def env_flag(name: str) -> bool | None:
    """``True``/``False`` for 1/0 (also true/false, yes/no, on/off); ``None`` when unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a flag; use 1 or 0")

# -- collectives.testing (the rank pool and its pytest plugin) -----------------------------
#: Hypothesis profile of the property tests: ci (default) or dev.
HYPOTHESIS_PROFILE = "COLLECTIVES_HYPOTHESIS_PROFILE"
#: Backend of the ``world`` fixture when a test does not parametrize it (default mpi).
TEST_BACKEND = "COLLECTIVES_TEST_BACKEND"
#: The MPI launcher the pools and launcher tests start ranks with: a command line to which
#: ``-n N`` is appended (default mpiexec; e.g. "mpirun --oversubscribe", "srun --mpi=pmi2").
TEST_LAUNCHER = "COLLECTIVES_TEST_LAUNCHER"
#: Size of the ``world`` fixture when a test does not parametrize it (default 2).
TEST_SIZE = "COLLECTIVES_TEST_SIZE"
#: The rank counts of tests/collective_calls/test_many_ranks.py (default "5 8"; `make test-many-ranks`: "16 32").
MANY_RANKS = "COLLECTIVES_MANY_RANKS"
#: Seconds a pool waits for its ranks to start and connect (default 120).
POOL_START_TIMEOUT = "COLLECTIVES_POOL_START_TIMEOUT"
#: Seconds one pool job may take before the pool is killed (default 60).
POOL_JOB_TIMEOUT = "COLLECTIVES_POOL_JOB_TIMEOUT"
#: How many pools a test session keeps warm at once (default 4).
POOL_MAX_LIVE = "COLLECTIVES_POOL_MAX_LIVE"
#: Set by a pool in its ranks' environment: where to connect back (host:port).
POOL_ADDRESS = "COLLECTIVES_POOL_ADDRESS"
#: Set by a pool in its ranks' environment: the connection's key (it also marks the pool's processes).
POOL_AUTHKEY = "COLLECTIVES_POOL_AUTHKEY"
