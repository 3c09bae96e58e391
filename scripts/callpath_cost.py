"""What our call path costs per call on the MPI backend, in CPU time of the calling thread.

    python scripts/callpath_cost.py            # one rank (MPI singleton): no peer to wait for
    mpiexec -n 2 python scripts/callpath_cost.py

Times ``all_reduce`` and ``broadcast`` of 4 bytes (float32) on numpy arrays and CPU torch
tensors (``--ops`` adds ``all_gather`` and ``reduce_scatter``, whose calls take the general
route: the transport's method given the call's request, where all_reduce and broadcast take the
backend's fast path), ours against raw mpi4py on the same buffer (for a tensor: ``t.numpy()`` each call,
as a raw caller writes it), with the default timeout (nonblocking call polled against a
deadline) and with ``timeout=0`` (blocking MPI calls); at the default timeout also with the
flight recorder off (``COLLECTIVES_TRACE_SIZE=0``), on (the default) and on with the call
site (``COLLECTIVES_TRACE_CALLSITE=1``). The variants of one array and op run in interleaved
rounds and the best round counts. ``time.thread_time`` counts only this thread's CPU time, so on a
loaded machine the difference still shows the call path's cost (wall-clock benchmarks are
collectives-bench). Prints microseconds per call and the difference; ``--json PATH`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
from collectives.backends.mpi import MPICommunicator
from mpi4py import MPI


def per_call_us(fn, calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls * 1e6


def raw_call(op: str, x, comm) -> callable:
    IN_PLACE, FLOAT, SUM = MPI.IN_PLACE, MPI.FLOAT, MPI.SUM
    if op == "all_gather":
        out = np.empty((comm.size, *x.shape), np.float32)
        return lambda: comm.Allgather([x if isinstance(x, np.ndarray) else x.numpy(), FLOAT], [out, FLOAT])
    if op == "reduce_scatter":
        out = np.empty(x.shape[0] // comm.size, np.float32)
        return lambda: comm.Reduce_scatter_block([x if isinstance(x, np.ndarray) else x.numpy(), FLOAT],
                                                 [out, FLOAT], SUM)
    if isinstance(x, np.ndarray):
        if op == "all_reduce":
            return lambda: comm.Allreduce(IN_PLACE, [x, FLOAT], SUM)
        return lambda: comm.Bcast([x, FLOAT], 0)
    if op == "all_reduce":
        return lambda: comm.Allreduce(IN_PLACE, [x.numpy(), FLOAT], SUM)
    return lambda: comm.Bcast([x.numpy(), FLOAT], 0)


def ours_call(op: str, x, comm) -> callable:
    if op == "broadcast":
        return lambda: comm.broadcast(x, 0)
    return lambda: getattr(comm, op)(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    parser.add_argument("--ops", default="all_reduce,broadcast",
                        help="comma-separated, of all_reduce, broadcast, all_gather, reduce_scatter")
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rows = []
    # (timeout, recorder): the recorder is read from the environment when a communicator is made.
    variants = [(None, "on"), (0, "on"), (None, "off"), (None, "call site")]
    recorder_env = {"on": {}, "off": {"COLLECTIVES_TRACE_SIZE": "0"},
                    "call site": {"COLLECTIVES_TRACE_CALLSITE": "1"}}
    comms = {}
    for timeout, recorder in variants:
        saved = dict(os.environ)
        os.environ.update(recorder_env[recorder])
        comms[timeout, recorder] = MPICommunicator(timeout=timeout)
        os.environ.clear()
        os.environ.update(saved)
    raw_comm = world.Dup()
    for kind in ("numpy", "torch"):
        for op in args.ops.split(","):
            rows_of_x = world.size if op == "reduce_scatter" else 1  # (one float per rank then)
            x = np.ones(rows_of_x, np.float32) if kind == "numpy" else torch.ones(rows_of_x)
            fns = {variant: ours_call(op, x, comm) for variant, comm in comms.items()}
            fns["raw"] = raw_call(op, x, raw_comm)
            best = {name: float("inf") for name in fns}
            for _ in range(args.rounds):  # interleaved: every variant in every round
                for name, fn in fns.items():
                    world.Barrier()
                    best[name] = min(best[name], per_call_us(fn, args.calls))
            for timeout, recorder in variants:
                ours = best[timeout, recorder]
                rows.append({"timeout": "default" if timeout is None else "0", "recorder": recorder,
                             "array": kind, "op": op, "ours_us": ours, "raw_us": best["raw"],
                             "diff_us": ours - best["raw"]})
    for comm in comms.values():
        comm.close()
    raw_comm.Free()
    if world.rank == 0:
        load = os.getloadavg()
        print(f"ranks={world.size}; CPU time of the calling thread per call, best of "
              f"{args.rounds} rounds of {args.calls}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        print(f"{'timeout':>8} {'recorder':>9} {'array':>6} {'op':>11} {'ours us':>8} {'raw us':>8} {'diff us':>8}")
        for r in rows:
            print(f"{r['timeout']:>8} {r['recorder']:>9} {r['array']:>6} {r['op']:>11} {r['ours_us']:8.2f} "
                  f"{r['raw_us']:8.2f} {r['diff_us']:+8.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": world.size, "load_average": load, "calls": args.calls,
                           "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
