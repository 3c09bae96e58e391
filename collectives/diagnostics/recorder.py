"""The flight recorder: every communicator remembers its last calls, and a rank writes them down.

Each communicator keeps a ring (a ``deque`` with ``maxlen``: memory stays bounded over any
number of calls) of its last ``COLLECTIVES_TRACE_SIZE`` calls. A call is one small list,
made by the call path when the call starts and updated when it ends (see ``FIELDS``);
nothing in it refers to the caller's arrays. ``dump`` writes every communicator's ring,
and the Python stack of every thread, to ``COLLECTIVES_TRACE_DIR/rank-<R>.json``: on a
timeout, a mismatch, a signal, a crash (see ``collectives.diagnostics.process_hooks``), or when the
program asks (``comm.dump_trace()``). Writing a dump reads only this process's memory (it
never waits on the network) and never leaves a half-written file (write, then rename).
``collectives-trace DIR`` (``collectives.diagnostics.trace``) reads the dumps of every rank.
"""

from __future__ import annotations

import collections
import json
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

from .. import config

#: A call's fields, in the order of its list (``op`` is the row of collectives.calls: its
#: ``name`` is the operation; no string is looked up on the call path).
FIELDS = ("seq", "op", "dtype", "shape", "root", "state", "start", "end", "site", "error", "redop")
SEQ, OP, DTYPE, SHAPE, ROOT, STATE, START, END, SITE, ERROR, REDOP = range(len(FIELDS))
#: States: entered the transport / returned / raised / posted (async_op=True: the handle is
#: not known to have completed; the communicator marks it completed once it learns so).
STARTED, COMPLETED, FAILED, POSTED = "started", "completed", "failed", "posted"
#: Operations outside the sequence numbers (a send or recv records the collectives' number then).
POINT_TO_POINT = ("send", "recv")
#: Version of the dump's layout (collectives-trace refuses others).
FORMAT = 1

_ITEMSIZE = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "float16": 2, "bfloat16": 2,
             "int32": 4, "float32": 4, "int64": 8, "float64": 8}
# Every communicator that has a ring, for the dumps (weak: a dropped one is forgotten).
_RECORDED: weakref.WeakSet[Any] = weakref.WeakSet()
#: Why this process wrote its dumps so far, oldest first.
written: list[str] = []
# Reentrant: a signal handler may dump while the main thread is dumping already.
_dumping = threading.RLock()
_LIBRARY = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),)  # collectives/
#: The recorder's clock (seconds): a dump converts it to wall-clock time. The compiled call path
#: reads the same clock (CLOCK_MONOTONIC) in C: callpath.pxd's ``_clock``.
clock = time.monotonic


def mark_failed(record: list[Any] | None, error: BaseException) -> None:
    """Mark ``record`` (``None``: the recorder is off) failed with ``error`` (once)."""
    if record is not None and record[STATE] is not FAILED:
        record[STATE], record[END] = FAILED, clock()
        record[ERROR] = f"{type(error).__name__}: {str(error)[:300]}"


def _library_directories() -> tuple[str, ...]:
    """collectives/ and the installed backends/ and syncbn/ (their own directories)."""
    found = list(_LIBRARY)
    for name in ("collectives.backends", "collectives.syncbn"):
        path = getattr(sys.modules.get(name), "__file__", None)
        if path:
            found.append(os.path.dirname(os.path.abspath(path)))
    return tuple(found)


class _CallSiteRing(collections.deque):  # type: ignore[type-arg]
    """A ring that also records each call's site (``COLLECTIVES_TRACE_CALLSITE=1``): the
    default ring is a plain deque, so the call path pays for the site only when asked."""

    def append(self, call: list[Any]) -> None:
        call[SITE] = call_site()
        super().append(call)


def new_ring(comm: Any) -> Any:
    """The ring a new communicator keeps (``None`` with ``COLLECTIVES_TRACE_SIZE=0``)."""
    size = config.trace_size()
    if size == 0:
        return None
    _RECORDED.add(comm)
    if config.env_flag(config.TRACE_CALLSITE):
        return _CallSiteRing(maxlen=size)
    return collections.deque(maxlen=size)


def state(call: list[Any]) -> str:
    """A recorded call's state: the call path leaves a completed call "started" with an end time."""
    if call[STATE] == STARTED and call[END]:
        return COMPLETED
    return str(call[STATE])


def call_site() -> str | None:
    """``file:line in function`` of the first frame outside the library (the user's call)."""
    ours = _library_directories()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(ours):
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return None


def nbytes(call: list[Any]) -> int:
    """Bytes of a recorded call's array (0 for calls without one)."""
    count = 1
    for dim in call[SHAPE] or ():
        count *= int(dim)
    return count * _ITEMSIZE.get(call[DTYPE], 0) if call[DTYPE] else 0


class CallRecord:
    """What a hook (``comm.register_hook(fn)``) gets for each completed call. Times are
    ``time.monotonic()`` seconds; ``bytes`` is the size of ``x``."""

    __slots__ = ("op", "seq", "dtype", "shape", "root", "bytes", "start", "end", "state",
                 "communicator")

    def __init__(self, call: list[Any], communicator: Any) -> None:
        self.op: str = call[OP].name
        self.seq: int = call[SEQ]
        self.dtype: str | None = call[DTYPE]
        self.shape: tuple[int, ...] = tuple(call[SHAPE] or ())
        self.root: int = call[ROOT]
        self.bytes: int = nbytes(call)
        self.start: float = call[START]
        self.end: float = call[END]
        self.state: str = state(call)
        self.communicator = communicator

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def __repr__(self) -> str:
        return (f"CallRecord(op={self.op!r}, seq={self.seq}, dtype={self.dtype!r}, "
                f"shape={self.shape}, bytes={self.bytes}, seconds={self.seconds:.6f})")


class HookHandle:
    """What ``comm.register_hook(fn)`` returns: ``remove()`` unregisters ``fn``."""

    def __init__(self, hooks: list[Callable[[CallRecord], Any]], fn: Callable[[CallRecord], Any]) -> None:
        self._hooks, self._fn = hooks, fn

    def remove(self) -> None:
        try:
            self._hooks.remove(self._fn)
        except ValueError:
            pass  # removed already


# -- the dump ------------------------------------------------------------------------------

def _world() -> tuple[int, int, str | None]:
    """This process's rank, the job's size and its launcher, as the launcher said (no
    communication)."""
    from ..launcher import detect_launcher  # noqa: PLC0415

    launch = detect_launcher()
    member = os.environ.get(config.ELASTIC_ID, "")  # collectives-elastic's ranks: their member id
    if launch.launcher is None and member.isdigit():
        return int(member), max(int(member) + 1, launch.size), "collectives-elastic"
    return launch.rank, launch.size, launch.launcher


def _call_dict(call: list[Any], wall_minus_monotonic: float) -> dict[str, Any]:
    entry = dict(zip(FIELDS, call))
    entry["op"] = call[OP].name
    entry["state"] = state(call)
    entry["shape"] = None if call[SHAPE] is None else [int(d) for d in call[SHAPE]]
    entry["start"] = round(call[START] + wall_minus_monotonic, 6)
    entry["end"] = round(call[END] + wall_minus_monotonic, 6) if call[END] else None
    entry["bytes"] = nbytes(call)
    entry["redop"] = None if call[REDOP] is None else call[REDOP].name
    return entry


def _communicator_dict(comm: Any, wall_minus_monotonic: float) -> dict[str, Any]:
    if comm._owner == threading.get_ident() and not comm._closed:
        comm._reap()  # (only in the owner's thread: it runs the handles' completions)
    ring = comm._ring
    calls = list(ring) if ring is not None else []  # list(deque) runs in C: one atomic copy
    state = "closed" if comm._closed else "unusable" if comm._why_broken else "open"
    entry = {"name": comm.trace_name, "backend": comm.backend, "rank": comm.rank,
             "size": comm.size, "seq": comm._seq, "state": state,
             "calls": [_call_dict(call, wall_minus_monotonic) for call in calls]}
    # fault tolerance: the communicator's generation, and the ranks a RankFailure named
    entry["generation"] = int(getattr(comm, "generation", 0))
    fault = getattr(comm, "_fault", None)
    failure = None if fault is None else fault.failure
    if failure is not None:
        entry["failed_ranks"] = list(failure.failed_ranks)
    return entry


def note_failure(comm: Any, failed_ranks: list[int], generation: int) -> None:
    """A fault-tolerant communicator raised RankFailure: the dump (with
    ``COLLECTIVES_TRACE_DIR``) names the failed ranks and the generation."""
    _RECORDED.add(comm)
    dump(f"RankFailure: generation {generation} of {comm.trace_name!r} lost rank(s) "
         f"{', '.join(map(str, failed_ranks)) or 'none'}")


def _thread_stacks() -> list[dict[str, Any]]:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
        stacks.append({"thread": names.get(ident, f"thread {ident}"),
                       "main": ident == threading.main_thread().ident,
                       "stack": traceback.format_stack(frame)})
    return stacks


def dump_path(directory: str | None = None) -> str | None:
    """``DIR/rank-<R>.json`` for ``COLLECTIVES_TRACE_DIR`` (or ``directory``); None when unset."""
    directory = directory or os.environ.get(config.TRACE_DIR, "").strip()
    if not directory:
        return None
    return os.path.join(directory, f"rank-{_world()[0]}.json")


def dump(reason: str, path: str | None = None) -> str | None:
    """Write this rank's dump (every recorded communicator, every thread's stack) to ``path``,
    else to ``COLLECTIVES_TRACE_DIR/rank-<R>.json``; returns the path (None: nowhere to write).
    Never raises: a dump is written while something else already went wrong."""
    try:
        path = path or dump_path()
        if path is None:
            return None
        with _dumping:
            rank, world_size, launcher = _world()
            wall_minus_monotonic = time.time() - time.monotonic()
            communicators = sorted(_RECORDED, key=lambda comm: comm._trace_order)
            content = {
                "format": FORMAT, "host": socket.gethostname(), "pid": os.getpid(),
                "rank": rank, "world_size": world_size, "launcher": launcher,
                "backend": communicators[0].backend if communicators else None,
                "reason": reason, "time": round(time.time(), 6),
                "communicators": [_communicator_dict(comm, wall_minus_monotonic)
                                  for comm in communicators],
                "threads": _thread_stacks(),
            }
            directory = os.path.dirname(os.path.abspath(path))
            os.makedirs(directory, exist_ok=True)
            temporary = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(temporary, "w") as file:
                json.dump(content, file, indent=1, default=str)
            os.replace(temporary, path)  # a reader sees the old dump or the new, never half
            written.append(reason)
        return path
    except Exception as error:  # noqa: BLE001  (the dump must not hide the real failure)
        try:
            sys.stderr.write(f"collectives: could not write the trace dump ({reason}): {error}\n")
        except Exception:  # noqa: BLE001
            pass
        return None
