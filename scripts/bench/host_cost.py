"""Host instructions per call on the torch route, counted by valgrind's callgrind, ours against raw
torch.distributed in the same process: a count, not a time, so a busy machine gives the same numbers.

    python scripts/bench/host_cost.py                     # defaults, then COLLECTIVES_DEBUG=0
    python scripts/bench/host_cost.py --json docs/bench/host-cost.json
    python scripts/bench/host_cost.py --world 2           # two processes over a FakeStore
    python scripts/bench/host_cost.py --cases all_reduce --settings defaults --keep /tmp/cg
    callgrind_annotate --inclusive=yes /tmp/cg/defaults/rank0.*.3   # where one loop's instructions go

The group is torch's own fake process group (``torch.testing._internal.distributed.fake_pg``: every
call completes at once and moves nothing), so what is counted is the host work in front of the
transport: torch.distributed's Python and C++ for raw, and ours on top of it. Each case runs a loop
of ``--calls`` calls inside ``functools.reduce``; callgrind collects only inside that C function
(``--toggle-collect``) and dumps after each loop (``--dump-after``), so one child process gives one
count per loop, and a loop of no-op steps, subtracted, takes the loop's own cost away. The heap made
before the loops is frozen (``gc.freeze``), so that a full collection falling into one loop does not
add its walk of that heap to that loop alone.

Cases (4 KiB float32 CPU tensors): all_reduce; async all_reduce + wait; all_gather(out=) against
``all_gather_into_tensor``; reduce_scatter(out=) against ``reduce_scatter_tensor``; broadcast; and
torch's floor under ``dist.all_reduce``'s Python, ``pg.allreduce([t], opts).wait()``. ``--cases``
picks some (a name's start: ``all_reduce`` is both all_reduce cases), ``--settings`` some settings,
and ``--keep DIR`` keeps callgrind's files (one per loop, numbered in the order the table lists them:
the no-op loop, the floor, then ours and raw of each case) for ``callgrind_annotate``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import glob
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

SETTINGS = {"defaults": {}, "COLLECTIVES_DEBUG=0": {"COLLECTIVES_DEBUG": "0"}}
# (case, ours, raw): what each loop's step calls. ``t``: the tensor, ``out``: a result of the
# right shape, ``comm``: ours, ``dist`` and ``pg``: torch's.
CASES = [
    ("all_reduce", "comm.all_reduce(t)", "dist.all_reduce(t)"),
    ("all_reduce async + wait", "comm.all_reduce(t, async_op=True).wait()",
     "dist.all_reduce(t, async_op=True).wait()"),
    ("all_gather(out=)", "comm.all_gather(t, out=gathered)", "dist.all_gather_into_tensor(gathered, t)"),
    ("reduce_scatter(out=)", "comm.reduce_scatter(rows, out=mine)", "dist.reduce_scatter_tensor(mine, rows)"),
    ("broadcast", "comm.broadcast(t, 0)", "dist.broadcast(t, 0)"),
    ("send", "comm.send(t, peer)", "dist.send(t, peer)"),
    ("recv", "comm.recv(t, peer)", "dist.recv(t, peer)"),
]
P2P = ("send", "recv")  # (counted at --world 2 and more: ``peer`` is the next rank)
FLOOR = ("torch's floor: pg.allreduce([t], opts).wait()", "pg.allreduce([t], opts).wait()")
ELEMENTS = 1024  # 4 KiB of float32


def child(calls: int, world: int, rank: int, cases: list[tuple[str, str, str]], twin: bool = False) -> None:
    """Run under callgrind: set up, warm every call, then one reduce loop per count."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415

    import collectives  # noqa: PLC0415

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    comm = collectives.init("torch")
    if twin:  # every call on a tensor taken as ordered on a device stream: its check posted
        from collectives.testing.torch_twin import StreamOrderedTwin  # noqa: PLC0415

        transport = StreamOrderedTwin()
        transport._posting_backend = "fake"  # (the posted checks' group: fake too)
        comm = type(comm)._adopt(transport, name="twin")
    pg = dist.group.WORLD
    opts = dist.AllreduceOptions()
    names = {"torch": torch, "dist": dist, "comm": comm, "pg": pg, "opts": opts,
             "t": torch.ones(ELEMENTS), "gathered": torch.empty(world, ELEMENTS),
             "rows": torch.ones(world, ELEMENTS), "mine": torch.empty(1, ELEMENTS), "peer": (rank + 1) % world}
    # The heap so far (torch's modules) out of the collector's way: a full collection that falls
    # into one loop would add its walk of that heap to that loop's count alone.
    gc.collect()
    gc.freeze()
    run_loops([FLOOR[1]] + [s for _, ours, raw in cases for s in (ours, raw)], names, calls,
              (lambda: _steady_watch(comm._transport, calls)) if twin else None)
    if twin:  # (the fake group's handles never say they completed: nothing to wait for at close)
        comm._transport._stop_posting(settle=False)
    comm.close()
    dist.destroy_process_group()


def run_loops(statements: list[str], names: dict, calls: int, before_loop: Any = None) -> None:
    """Warm every statement, then a no-op loop and one loop of ``calls`` of each statement, each
    inside ``functools.reduce`` (what callgrind collects and dumps after); ``before_loop()`` runs
    before each loop, uncounted."""
    steps = []
    for statement in statements:
        code = compile(statement, statement, "eval")
        steps.append(functools.partial(_step, code, names))
        for _ in range(50):  # warm: the first calls of a kind build what later calls reuse
            eval(code, names)
    functools.reduce(_noop, range(calls), None)
    for step in steps:
        if before_loop is not None:
            before_loop()
        functools.reduce(step, range(calls), None)


def _steady_watch(transport: Any, calls: int) -> None:
    """The twin's watch of calls on a device stream in a program's steady state: nothing left in
    flight (the fake group's handles never say they completed, a real group's do) and a pool of
    events for a loop's calls (a program's pool holds what it has in flight within a period)."""
    watch = transport._stream_watch
    if watch is not None:
        with watch._lock:
            watch._inflight.clear()
    events = transport._events
    events.pool.extend(events.new_event() for _ in range(calls - len(events.pool)))


def _noop(acc: object, _: int) -> object:
    return acc


def _step(code: object, names: dict, acc: object, _: int) -> object:
    eval(code, names)
    return acc


def count(setting: dict[str, str], calls: int, world: int, cases: list[tuple[str, str, str]],
          keep: str | None, twin: bool = False) -> list[float]:
    """Instructions per call of every statement of :func:`child`, in its order; callgrind's files
    go to ``keep`` where given."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = scratch if keep is None else keep
        os.makedirs(folder, exist_ok=True)
        env = dict(os.environ, **setting, PYTHONHASHSEED="0", OMP_NUM_THREADS="1",
                   COLLECTIVES_BACKEND="torch")
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK"):
            env.pop(key, None)
        procs = []
        for rank in range(world):
            out = os.path.join(folder, f"rank{rank}.%p")
            procs.append(subprocess.Popen(
                ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
                 "--dump-after=functools_reduce", f"--callgrind-out-file={out}", sys.executable, __file__,
                 "--child", "--calls", str(calls), "--world", str(world), "--rank", str(rank),
                 *(["--twin"] if twin else []), "--cases", *[case for case, _, _ in cases]],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        for proc in procs:
            _, err = proc.communicate()
            if proc.returncode:
                raise SystemExit(f"host_cost: the child failed ({proc.returncode}):\n{err[-3000:]}")
        dumps = sorted(glob.glob(os.path.join(folder, f"rank0.{procs[0].pid}.*")),
                       key=lambda p: int(p.rsplit(".", 1)[1]))
        totals = [_total(p) for p in dumps]
    loops = 1 + 1 + 2 * len(cases)  # the no-op loop, the floor, ours and raw per case
    if len(totals) < loops:
        raise SystemExit(f"host_cost: {len(totals)} loops counted, {loops} expected")
    totals = totals[-loops:]
    return [(total - totals[0]) / calls for total in totals[1:]]


def _total(path: str) -> int:
    with open(path) as file:
        for line in file:
            if match := re.match(r"(?:summary|totals):\s*(\d+)", line):
                return int(match.group(1))
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--cases", nargs="+", metavar="NAME", help="the cases whose name starts so (default: all)")
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--keep", metavar="DIR", help="keep callgrind's files here (DIR/SETTING/rank0.PID.N)")
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--twin", action="store_true",
                        help="ours through the CPU twin of a CUDA tensor's call (collectives.testing.torch_twin): "
                             "its check posted beside the call (world 2: the check runs at world 2 only), the "
                             "call on the watch of its timeout")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    cases = [case for case in CASES if (args.cases is None or any(case[0].startswith(n) for n in args.cases))
             and (args.world > 1 or case[0] not in P2P)]
    if not cases:
        raise SystemExit(f"host_cost: no case starts with {args.cases}; cases: {[case for case, _, _ in CASES]}")
    if args.child:
        child(args.calls, args.world, args.rank, cases, args.twin)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("host_cost: needs valgrind (apt-get install valgrind)")
    import torch  # noqa: PLC0415

    results = {}
    for name in args.settings:
        keep = None if args.keep is None else os.path.join(args.keep, re.sub(r"\W", "_", name))
        per_call = count(SETTINGS[name], args.calls, args.world, cases, keep, args.twin)
        floor, rest = per_call[0], per_call[1:]
        rows = {case: {"ours": rest[2 * i], "raw": rest[2 * i + 1]} for i, (case, _, _) in enumerate(cases)}
        results[name] = {"floor": floor, "cases": rows}
    print(f"Host instructions a call (callgrind; 4 KiB float32 CPU tensors; torch {torch.__version__}, "
          f"fake process group, world {args.world}; {args.calls} calls a loop"
          f"{'; ours through the CPU twin: checks posted' if args.twin else ''})")
    print(f"{'call':<26} {'setting':<20} {'ours':>9} {'raw':>9} {'ours - raw':>11}")
    for case, _, _ in cases:
        for name, result in results.items():
            ours, raw = result["cases"][case]["ours"] / 1e3, result["cases"][case]["raw"] / 1e3
            print(f"{case:<26} {name:<20} {ours:8.1f}k {raw:8.1f}k {ours - raw:+10.1f}k")
    for name, result in results.items():
        print(f"{FLOOR[0]} ({name}): {result['floor'] / 1e3:.1f}k")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"command": " ".join(["python", "scripts/bench/host_cost.py", *sys.argv[1:]]),
                       "date": time.strftime("%Y-%m-%d", time.gmtime()), "torch": torch.__version__,
                       "python": platform.python_version(), "machine": platform.machine(),
                       "world": args.world, "calls": args.calls, "twin": args.twin, "results": results},
                      file, indent=1)
            file.write("\n")


if __name__ == "__main__":
    main()
