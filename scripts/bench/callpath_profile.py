"""Where a small collective's time goes: a per-line profile of the call path, beside the floor
of mpi4py itself, on the MPI backend.

    mpiexec -n 2 python scripts/bench/callpath_profile.py                    # all_reduce, 8 B numpy
    mpiexec -n 2 python scripts/bench/callpath_profile.py --op broadcast --array torch
    mpiexec -n 2 python scripts/bench/callpath_profile.py --json docs/bench/callpath-profile.json

Three parts, rank 0 prints them (every rank runs the same loops, in step):

1. **The floor**: mpi4py's own per-call cost for the same call, wall time per call (median
   of interleaved rounds of ``--calls`` calls): the blocking call with its buffer spec made
   once, the nonblocking call completed by ``Test`` polls (what the timeout uses), the MPI-4
   persistent request (``*_init`` once, then ``Start`` + ``Test``), and the blocking call
   with the spec built per call (``[x, MPI.FLOAT]``), and for torch also with ``t.numpy()``.
2. **Ours**, in the same rounds: the default (timeout, flight recorder, default check),
   and with each of them off (``timeout=0``; ``COLLECTIVES_TRACE_SIZE=0`` is a separate
   process, so the recorder is measured by :mod:`collectives.recorder`'s ring switched off on
   this communicator; the check through ``COLLECTIVES_DEBUG=0``'s switch, ``_checking``).
3. **Per line**: every line the call runs in collectives/ and backends/, in the order it
   first ran, with its mean cost per call (the time from its start to the next line's,
   callees the tracer does not enter included: mpi4py, numpy), less the tracer's own cost
   per line (calibrated on a function of ``pass`` lines). The lines' sum against the call's
   untraced time shows what the frames themselves cost. A line that enters a traced function
   also carries the tracer's handling of that call: read the lines against each other, and
   the ablation of part 2 for what a feature costs. On 2 ranks a line that waits for the peer
   carries the wait (the tracer slows both ranks); one rank (no launcher) shows CPU cost only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRACED = tuple(os.path.join(HERE, part) + os.sep for part in ("collectives", "backends"))


def timed(fns: dict[str, Callable[[], Any]], calls: int, rounds: int, barrier: Callable[[], Any]) -> dict[str, float]:
    """Median over ``rounds`` of the wall time per call (us) of each function, rounds interleaved
    (the order reversed every other round), a barrier before each batch."""
    return batched(fns, calls, rounds, barrier)


def floor_calls(op: str, comm: Any, x: Any, array: str) -> dict[str, Callable[[], Any]]:
    from mpi4py import MPI  # noqa: PLC0415

    mc = comm.mpi_comm
    view = x.numpy() if array == "torch" else x
    T = {np.dtype("float32"): MPI.FLOAT, np.dtype("float64"): MPI.DOUBLE}[view.dtype]
    spec = [view, T]
    if op == "all_reduce":
        IN, SUM = MPI.IN_PLACE, MPI.SUM
        blocking = lambda: mc.Allreduce(IN, spec, SUM)  # noqa: E731
        start = lambda: mc.Iallreduce(IN, spec, SUM)  # noqa: E731
        persistent = mc.Allreduce_init(IN, spec, SUM)
        per_call = lambda: mc.Allreduce(IN, [view, T], SUM)  # noqa: E731
        tensor = lambda: mc.Allreduce(IN, [x.numpy(), T], SUM)  # noqa: E731
    else:
        blocking = lambda: mc.Bcast(spec, 0)  # noqa: E731
        start = lambda: mc.Ibcast(spec, 0)  # noqa: E731
        persistent = mc.Bcast_init(spec, 0)
        per_call = lambda: mc.Bcast([view, T], 0)  # noqa: E731
        tensor = lambda: mc.Bcast([x.numpy(), T], 0)  # noqa: E731

    def nonblocking() -> None:
        request = start()
        while not request.Test():
            pass

    def started() -> None:
        persistent.Start()
        while not persistent.Test():
            pass

    fns = {"mpi4py blocking, spec made once": blocking, "mpi4py Ixxx + Test": nonblocking,
           "mpi4py persistent Start + Test": started, "mpi4py blocking, spec per call": per_call}
    if array == "torch":
        fns["mpi4py blocking, t.numpy() per call"] = tensor
    fns["_persistent"] = persistent  # (freed by the caller)
    return fns


def ours_calls(op: str, comm: Any, x: Any) -> dict[str, Callable[[], Any]]:
    call = comm.all_reduce if op == "all_reduce" else comm.broadcast

    def switched(**off: bool) -> Callable[[], Any]:
        def run() -> Any:
            kept = comm._ring, comm._checking, comm.timeout
            if off.get("recorder"):
                comm._ring = None
            if off.get("check"):
                comm._checking = False
            if off.get("timeout"):
                comm.timeout = None
            try:
                for _ in range(run.calls):  # type: ignore[attr-defined]
                    call(x)
            finally:
                comm._ring, comm._checking, comm.timeout = kept
        run.calls = 1  # type: ignore[attr-defined]
        return run

    return {"ours (default)": lambda: call(x), "ours, no check": switched(check=True),
            "ours, no recorder": switched(recorder=True), "ours, no timeout": switched(timeout=True),
            "ours, none of the three": switched(check=True, recorder=True, timeout=True)}


def batched(fns: dict[str, Callable[[], Any]], calls: int, rounds: int, barrier: Callable[[], Any]) -> dict[str, float]:
    """:func:`timed`, where a function may also run ``calls`` calls itself (``fn.calls``)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            fn = fns[name]
            barrier()
            start = time.perf_counter()
            if hasattr(fn, "calls"):
                fn.calls = calls  # type: ignore[attr-defined]
                fn()
            else:
                for _ in range(calls):
                    fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


class LineProfile:
    """A settrace profile of the lines under TRACED: ns per (file, line), in first-run order."""

    def __init__(self) -> None:
        self.ns: dict[tuple[str, int, str], int] = {}
        self.hits: dict[tuple[str, int, str], int] = {}
        self._last: tuple[str, int, str] | None = None
        self._since = 0

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        now = time.perf_counter_ns()
        last = self._last
        if last is not None:
            self.ns[last] = self.ns.get(last, 0) + now - self._since
        if event == "line":
            key = (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)
            self.hits[key] = self.hits.get(key, 0) + 1
            self._last = key
        else:
            self._last = None
        self._since = time.perf_counter_ns()
        return self._local

    def _global(self, frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename.startswith(TRACED) or frame.f_code.co_name == "_calibrate":
            return self._local
        return None

    def run(self, fn: Callable[[], Any], calls: int) -> None:
        sys.settrace(self._global)
        try:
            for _ in range(calls):
                fn()
                self._last = None
        finally:
            sys.settrace(None)


def _calibrate() -> None:
    pass
    pass
    pass
    pass
    pass
    pass
    pass
    pass


def overhead_ns(calls: int, rounds: int) -> float:
    """The tracer's own ns per traced line, measured as the lines are (the least over rounds):
    a line of ``pass`` costs ~0 untraced."""
    per_round = max(1, calls // rounds)
    profiles = []
    for _ in range(rounds):
        profiles.append(LineProfile())
        profiles[-1].run(_calibrate, per_round)
    keys = [key for key in profiles[0].ns if key[2] == "_calibrate"]
    return statistics.median(min(p.ns[key] / p.hits[key] for p in profiles) for key in keys)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=("all_reduce", "broadcast"), default="all_reduce")
    p.add_argument("--array", choices=("numpy", "torch"), default="numpy")
    p.add_argument("--bytes", type=int, default=8)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    import collectives  # noqa: PLC0415

    comm = collectives.init("mpi")
    count = max(1, args.bytes // 4)
    if args.array == "torch":
        import torch  # noqa: PLC0415

        x: Any = torch.zeros(count, dtype=torch.float32)
    else:
        x = np.zeros(count, dtype=np.float32)
    barrier = comm.mpi_comm.Barrier
    floor = floor_calls(args.op, comm, x, args.array)
    persistent = floor.pop("_persistent")
    fns: dict[str, Callable[[], Any]] = {**floor, **ours_calls(args.op, comm, x)}
    for fn in fns.values():  # warm up (plans, hashes)
        if hasattr(fn, "calls"):
            fn.calls = 100  # type: ignore[attr-defined]
            fn()
        else:
            for _ in range(100):
                fn()
    times = batched(fns, args.calls, args.rounds, barrier)
    persistent.Free()
    # the per-line profile of the default call, every rank tracing (so the peers stay in step)
    call = comm.all_reduce if args.op == "all_reduce" else comm.broadcast
    per_round = max(1, args.calls // args.rounds)
    profiles = []
    for _ in range(args.rounds):  # a line's cost: its least over the rounds (noise only adds)
        barrier()
        profiles.append(LineProfile())
        profiles[-1].run(lambda: call(x), per_round)
    lines = LineProfile()
    for key in profiles[0].ns:
        lines.hits[key] = profiles[0].hits[key] * args.calls // per_round
        lines.ns[key] = min(p.ns.get(key, 0) * args.calls // per_round for p in profiles)
    tracer = overhead_ns(args.calls, args.rounds)
    if comm.rank != 0:
        return
    load = os.getloadavg()
    print(f"# {args.op}, {args.bytes} B float32 {args.array}, {comm.size} MPI ranks, load {load[0]:.1f}; "
          f"wall us per call, median of {args.rounds} interleaved rounds of {args.calls} calls")
    floor_us = times["mpi4py blocking, spec made once"]
    for name, us in times.items():
        print(f"{name:<40}{us:8.2f}{us - floor_us:+9.2f}")
    print(f"\n# per line of the default call (ns per call, the tracer's {tracer:.0f} ns a line taken off)")
    total = 0.0
    rows = []
    for key, ns in lines.ns.items():
        filename, line, function = key
        per_call = (ns - tracer * lines.hits[key]) / args.calls
        total += per_call
        source = _source(filename, line)
        rows.append({"file": os.path.relpath(filename, HERE), "line": line, "function": function,
                     "ns_per_call": per_call, "hits_per_call": lines.hits[key] / args.calls, "source": source})
        print(f"{os.path.relpath(filename, HERE)}:{line:<5}{function[:22]:<23}{per_call:8.0f}  {source[:70]}")
    print(f"{'sum of the lines':<44}{total:8.0f} ns; the call untraced: {times['ours (default)'] * 1e3:.0f} ns")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"argv": sys.argv[1:], "load": load, "ranks": comm.size,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                       "us_per_call": times, "tracer_ns_per_line": tracer, "lines": rows}, file, indent=1)


def _source(filename: str, line: int) -> str:
    try:
        with open(filename) as file:
            return file.readlines()[line - 1].strip()
    except (OSError, IndexError):
        return ""


if __name__ == "__main__":
    main()
