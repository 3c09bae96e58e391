"""Memory and threads of a "collectives" process group whose asynchronous handles are dropped.

    mpiexec -n 2 python scripts/bench/c10d_dropped.py [--calls 100000] [--json out.json]

Every rank posts ``--calls`` all_reduces of a small tensor with ``async_op=True`` and drops
each handle, as a loop that never waits does, then one blocking all_reduce. It prints, per
rank, the growth of the process's resident-set high-water mark (``ru_maxrss``) over the loop,
the most operations the group held pending, and its completer threads right after the loop
and once they have been idle for up to 10 s (they end after ``COMPLETER_IDLE`` seconds idle,
down to one).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time

import torch
import torch.distributed as dist

import collectives.c10d


def completers() -> int:
    """Completer threads alive in this process (every group's)."""
    return sum("-completer-" in thread.name for thread in threading.enumerate())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100_000)
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    collectives.c10d.init_process_group()
    group = dist.group.WORLD
    worker = group._worker
    x = torch.ones(16)
    dist.all_reduce(x)  # warm: the group's threads and buffers exist before the measure
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.perf_counter()
    for _ in range(args.calls):
        dist.all_reduce(torch.ones(16), async_op=True)  # the handle is dropped
    dist.all_reduce(x)
    seconds = time.perf_counter() - started
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    threads_after = completers()
    deadline = time.monotonic() + 10.0
    while completers() > 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # local threads, not another rank
    row = {"rank": dist.get_rank(), "calls": args.calls, "seconds": round(seconds, 2),
           "maxrss_growth_MiB": round(grown / 1024, 1), "most_pending": getattr(worker, "most_pending", None),
           "completer_threads_after_loop": threads_after, "completer_threads_idle": completers()}
    rows: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        for r in rows:
            print(json.dumps(r))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "load": os.getloadavg()}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
