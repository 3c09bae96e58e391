"""``COLLECTIVES_PROFILE=1``: a table of the calls per operation and size range, at exit.

Every communicator made while the variable is set gets a hook (``register_hook``) that
counts its calls, their bytes and their time. At exit rank 0 prints one table for the job
(rank 0 aggregates: every rank's counts travel in one all_reduce over the world
communicator, if it is still open; else each rank prints its own). Columns as nccl-tests
prints them: ``algbw = bytes / time`` and ``busbw = algbw * factor``, with factor
``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather, reduce_scatter, gather, scatter and
all_to_all, and 1 for broadcast, reduce and point-to-point (nccl-tests' factors, the same as
collectives-bench's: both read them from the rows of :mod:`collectives.calls`). The
bytes are those of the call's ``x`` (for all_gather: per rank, so multiplied by n as
nccl-tests counts the gathered size). Time is the wall-clock time of the call on the rank,
asynchronous calls until posted only; the mean over ranks is shown.
"""

from __future__ import annotations

import atexit
import sys
import weakref
from typing import Any

from . import calls as _calls
from .diagnostics.recorder import CallRecord

#: Upper bounds of the size ranges (bytes); the last range is open.
SIZE_RANGES = (1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20)
#: The operations, in the order the report lists them (the rows of collectives.calls).
OPERATIONS = _calls.OPERATIONS
# (operation, size range) -> [calls, seconds, bytes], for this process.
_table: dict[tuple[str, int], list[float]] = {}
_world: list[weakref.ref[Any]] = []


def _range(nbytes: int) -> int:
    for index, bound in enumerate(SIZE_RANGES):
        if nbytes <= bound:
            return index
    return len(SIZE_RANGES)


def _range_name(index: int) -> str:
    def size(n: int) -> str:
        for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
            if n >= scale:
                return f"{n // scale} {unit}"
        return f"{n} B"
    low = 0 if index == 0 else SIZE_RANGES[index - 1] + 1
    return f"> {size(SIZE_RANGES[-1])}" if index == len(SIZE_RANGES) else f"{size(low)}-{size(SIZE_RANGES[index])}"


def _count(record: CallRecord) -> None:
    n = record.communicator.size
    nbytes = record.bytes * (n if record.op in ("all_gather", "all_gather_v") else 1)
    entry = _table.setdefault((record.op, _range(nbytes)), [0, 0.0, 0])
    entry[0] += 1
    entry[1] += record.end - record.start
    entry[2] += nbytes


def attach(comm: Any) -> None:
    """Count ``comm``'s calls; the first communicator attached is the one that aggregates."""
    comm.register_hook(_count)
    if not _world:
        _world.append(weakref.ref(comm))
        atexit.register(report)


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw for ``op`` on ``n`` ranks (:func:`collectives.calls.bus_factor`;
    1 on one rank)."""
    return _calls.bus_factor(op, n) if n > 1 else 1.0


def table(counts: dict[tuple[str, int], list[float]], ranks: int, size: int) -> str:
    """The table text; ``counts`` summed over ``ranks`` ranks of a communicator of ``size``."""
    lines = [f"collectives profile ({ranks} rank{'s' if ranks > 1 else ''}; time: mean per rank)",
             f"{'op':>15} {'size range':>17} {'calls':>9} {'total s':>10} {'mean us':>10} "
             f"{'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for (op, index), (calls, seconds, nbytes) in sorted(
            counts.items(), key=lambda item: (OPERATIONS.index(item[0][0])
                                              if item[0][0] in OPERATIONS else 99, item[0][1])):
        if not calls:
            continue
        seconds /= ranks
        calls /= ranks
        nbytes /= ranks
        algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        lines.append(f"{op:>15} {_range_name(index):>17} {calls:9.0f} {seconds:10.4f} "
                     f"{seconds / calls * 1e6:10.2f} {algbw:11.3f} {algbw * bus_factor(op, size):11.3f}")
    return "\n".join(lines)


def report() -> None:
    """At exit: aggregate over the world communicator (when still usable) and print on rank 0."""
    import numpy as np  # noqa: PLC0415

    comm = _world[0]() if _world else None
    keys = [(op, index) for op in OPERATIONS for index in range(len(SIZE_RANGES) + 1)]
    counts = {key: list(_table.get(key, [0, 0.0, 0])) for key in keys}
    ranks, size, rank = 1, 1 if comm is None else comm.size, 0 if comm is None else comm.rank
    if comm is not None and comm.size > 1 and not comm._closed and not comm._why_broken:
        try:
            flat = np.array([value for key in keys for value in counts[key]], np.float64)
            comm.all_reduce(flat)
            counts = {key: list(flat[3 * i:3 * i + 3]) for i, key in enumerate(keys)}
            ranks = comm.size
        except Exception as error:  # noqa: BLE001  (at exit: print what this rank has)
            sys.stderr.write(f"collectives profile: could not aggregate ({error}); this rank's table\n")
            rank = 0
    if rank == 0:
        print(table(counts, ranks, size), file=sys.stderr, flush=True)
