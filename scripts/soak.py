"""Soak test: many small collectives and async handles, with the memory they leave behind.

    python scripts/soak.py                                       # local (one rank)
    COLLECTIVES_BACKEND=mpi mpiexec -n 2 python scripts/soak.py  # mpi
    torchrun --nproc_per_node 2 scripts/soak.py                  # torch (Gloo)
    ... --calls 2000 --handles 2000 --raw-handles 2000           # the tiny mode the tests run

Phases, one after the other on one communicator, after a warm-up of ``--warmup`` calls of
each kind (the allocator, the transport's buffers, the call path's caches) and enough calls
to fill the flight recorder's ring (``COLLECTIVES_TRACE_SIZE``):

- ``blocking``: ``--calls`` blocking ``all_reduce`` of 4 float32;
- ``awaited``: ``--handles`` ``all_reduce(async_op=True)``, each handle waited at once;
- ``dropped``: ``--handles`` ``all_reduce(async_op=True)`` whose handles are dropped
  (the communicator keeps and reaps them, ``MAX_PENDING`` at most), then ``dropped_again``:
  as many once more (the first burst sets the memory's high-water mark; a leak grows again);
- torch only: ``dropped_more``: ``--raw-handles`` dropped handles of ours, then ``raw_dropped``:
  as many dropped ``torch.distributed.all_reduce(async_op=True)`` Works of raw torch on the
  same process group, for comparison in the same run.

Every call's result is checked (each rank adds 1: the sum is ``size``; a dropped handle's
result is checked through the blocking call that follows it). For each phase every rank
records VmRSS (from ``/proc/self/status``) before, at ``--samples`` intervals and after, the
Python objects the garbage collector tracks before and after (a leak of one object per call
shows as >= 1 object per call; counted after barriers have reaped the handles still kept),
the handles still pending at the phase's end, and the seconds taken. Rank 0
prints a table and writes every rank's records as JSON (``--json``, default stdout only).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
from typing import Any

import numpy as np

import collectives
from collectives import config


def rss_mb() -> float:
    """This process's resident set size in MiB (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def tracked_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


class Phase:
    """One phase's measurements on this rank."""

    def __init__(self, name: str, calls: int, samples: int) -> None:
        self.name, self.calls = name, calls
        self.every = max(1, calls // max(1, samples))
        self.wrong = 0
        self.objects_before = tracked_objects()
        self.rss = [rss_mb()]
        self.began = time.perf_counter()

    def sample(self, i: int) -> None:
        if (i + 1) % self.every == 0 and i + 1 < self.calls:
            self.rss.append(rss_mb())

    def end(self, comm: Any) -> dict[str, Any]:
        seconds = time.perf_counter() - self.began
        self.rss.append(rss_mb())
        pending = len(comm._pending)
        # The handles still kept are not a leak: calls reap them before objects are counted
        # (the ranks decide together when to stop: all_reduce of the most still pending).
        kept = np.zeros(1, np.int64)
        for _ in range(1000):
            kept[0] = len(comm._pending)
            if comm.all_reduce(kept, "max")[0] == 0:
                break
        record = {"phase": self.name, "calls": self.calls, "seconds": round(seconds, 3),
                  "us_per_call": round(seconds / max(1, self.calls) * 1e6, 2), "wrong": self.wrong,
                  "rss_mb": [round(v, 2) for v in self.rss],
                  "rss_growth_mb": round(self.rss[-1] - self.rss[0], 2),
                  "objects_growth": tracked_objects() - self.objects_before,
                  "pending_after": pending, "pending_settled": len(comm._pending)}
        if comm.rank == 0:
            print(f"soak: {self.name} done ({self.calls} calls, {seconds:.1f} s)", file=sys.stderr,
                  flush=True)
        return record


def soak(comm: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Run every phase on ``comm``; this rank's record."""
    if comm.backend == "torch":
        import torch  # noqa: PLC0415

        def fresh() -> Any:
            return torch.ones(4)
    else:
        def fresh() -> Any:
            return np.ones(4, np.float32)
    want = float(comm.size)

    def right(y: Any) -> bool:
        return all(float(v) == want for v in y.tolist())

    x = fresh()
    for _ in range(args.warmup):
        x[:] = 1
        comm.all_reduce(x)
        comm.all_reduce(fresh(), async_op=True).wait()
        comm.all_reduce(fresh(), async_op=True)
    # The flight recorder's ring fills up to COLLECTIVES_TRACE_SIZE records and stays there:
    # filled before measuring, it is not counted as growth.
    for _ in range(config.trace_size()):
        comm.all_reduce(x)
    comm.all_reduce(x)
    record: dict[str, Any] = {"rank": comm.rank, "size": comm.size, "backend": comm.backend,
                              "pid": os.getpid(), "rss_start_mb": round(rss_mb(), 2), "phases": []}

    phase = Phase("blocking", args.calls, args.samples)
    for i in range(args.calls):
        x[:] = 1
        comm.all_reduce(x)
        phase.wrong += not right(x)
        phase.sample(i)
    record["phases"].append(phase.end(comm))

    phase = Phase("awaited", args.handles, args.samples)
    for i in range(args.handles):
        phase.wrong += not right(comm.all_reduce(fresh(), async_op=True).wait())
        phase.sample(i)
    record["phases"].append(phase.end(comm))

    def dropped(name: str, count: int) -> None:
        phase = Phase(name, count, args.samples)
        for i in range(count):
            comm.all_reduce(fresh(), async_op=True)
            phase.sample(i)
        x[:] = 1
        comm.all_reduce(x)  # after the dropped handles: still the right answer
        phase.wrong += not right(x)
        record["phases"].append(phase.end(comm))

    dropped("dropped", args.handles)
    # Once more: the first burst set the high-water mark of the handles kept (MAX_PENDING);
    # a leak would grow again here, a high-water mark does not.
    dropped("dropped_again", args.handles)
    if comm.backend == "torch" and args.raw_handles:
        import torch.distributed as dist  # noqa: PLC0415

        dropped("dropped_more", args.raw_handles)
        phase = Phase("raw_dropped", args.raw_handles, args.samples)
        for i in range(args.raw_handles):
            dist.all_reduce(fresh(), async_op=True)  # raw torch.distributed, Work dropped
            phase.sample(i)
        x[:] = 1
        dist.all_reduce(x)
        phase.wrong += not right(x)
        record["phases"].append(phase.end(comm))
    comm.barrier()
    record["rss_end_mb"] = round(rss_mb(), 2)
    record["rss_growth_mb"] = round(record["rss_end_mb"] - record["rss_start_mb"], 2)
    return record


def gather_records(comm: Any, record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's record, on every rank (JSON bytes through all_gather_v)."""
    data = np.frombuffer(json.dumps(record).encode(), dtype=np.uint8).copy()
    if comm.backend == "torch":
        import torch  # noqa: PLC0415

        data = torch.from_numpy(data)
    gathered, counts = comm.all_gather_v(data)
    raw = bytes(np.asarray(gathered).tobytes())
    records, start = [], 0
    for count in counts:
        records.append(json.loads(raw[start:start + count]))
        start += count
    return records


def table(report: dict[str, Any]) -> str:
    lines = [f"soak: backend {report['backend']}, {report['size']} rank(s), load "
             f"{report['load']}, host {report['host']}",
             f"{'phase':>14} {'calls':>8} {'rank':>4} {'us/call':>9} {'wrong':>5} {'RSS start':>10} "
             f"{'RSS end':>9} {'growth MB':>9} {'objects':>8} {'pending':>7}"]
    for rank in report["ranks"]:
        for p in rank["phases"]:
            lines.append(f"{p['phase']:>14} {p['calls']:>8} {rank['rank']:>4} {p['us_per_call']:>9} "
                         f"{p['wrong']:>5} {p['rss_mb'][0]:>10.1f} {p['rss_mb'][-1]:>9.1f} "
                         f"{p['rss_growth_mb']:>+9.2f} {p['objects_growth']:>+8} {p['pending_after']:>7}")
        lines.append(f"{'whole run':>14} {'':>8} {rank['rank']:>4} {'':>9} {'':>5} "
                     f"{rank['rss_start_mb']:>10.1f} {rank['rss_end_mb']:>9.1f} "
                     f"{rank['rss_growth_mb']:>+9.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=200_000, help="blocking all_reduce calls")
    p.add_argument("--handles", type=int, default=20_000, help="awaited and dropped handles, each")
    p.add_argument("--raw-handles", type=int, default=50_000,
                   help="torch: dropped handles of ours and of raw torch.distributed, each (0: skip)")
    p.add_argument("--warmup", type=int, default=1000, help="calls of each kind before measuring")
    p.add_argument("--samples", type=int, default=10, help="RSS samples per phase")
    p.add_argument("--json", help="write the report (every rank's records) here (rank 0)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    comm = collectives.init()
    records = gather_records(comm, soak(comm, args))
    if comm.rank == 0:
        report = {"backend": comm.backend, "size": comm.size, "host": socket.gethostname(),
                  "load": " ".join(f"{v:.2f}" for v in os.getloadavg()),
                  "args": vars(args), "ranks": records}
        print(table(report), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    comm.close()
    return 0 if all(p["wrong"] == 0 for r in records for p in r["phases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
