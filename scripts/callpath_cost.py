"""What our call path costs per call on the MPI backend, in CPU time of the calling thread.

    python scripts/callpath_cost.py            # one rank (MPI singleton): no peer to wait for
    mpiexec -n 2 python scripts/callpath_cost.py

Times ``all_reduce`` and ``broadcast`` of 4 bytes (float32) on numpy arrays and CPU torch
tensors, ours against raw mpi4py on the same buffer (for a tensor: ``t.numpy()`` each call,
as a raw caller writes it), with the default timeout (nonblocking call polled against a
deadline) and with ``timeout=0`` (blocking MPI calls). Each pair runs in interleaved rounds
and the best round counts. ``time.thread_time`` counts only this thread's CPU time, so on a
loaded machine the difference still shows the call path's cost (wall-clock benchmarks are
collectives-bench). Prints microseconds per call and the difference; ``--json PATH`` writes them.
"""

from __future__ import annotations

import argparse
import json
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
    if isinstance(x, np.ndarray):
        if op == "all_reduce":
            return lambda: comm.Allreduce(IN_PLACE, [x, FLOAT], SUM)
        return lambda: comm.Bcast([x, FLOAT], 0)
    if op == "all_reduce":
        return lambda: comm.Allreduce(IN_PLACE, [x.numpy(), FLOAT], SUM)
    return lambda: comm.Bcast([x.numpy(), FLOAT], 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rows = []
    for timeout in (None, 0):
        ours_comm = MPICommunicator(timeout=timeout)
        raw_comm = world.Dup()
        for kind in ("numpy", "torch"):
            for op in ("all_reduce", "broadcast"):
                x = np.ones(1, np.float32) if kind == "numpy" else torch.ones(1)
                ours_fn = (lambda c=ours_comm, x=x: c.all_reduce(x)) if op == "all_reduce" else \
                    (lambda c=ours_comm, x=x: c.broadcast(x, 0))
                raw_fn = raw_call(op, x, raw_comm)
                best = {"ours": float("inf"), "raw": float("inf")}
                for _ in range(args.rounds):
                    for name, fn in (("ours", ours_fn), ("raw", raw_fn)):
                        world.Barrier()
                        best[name] = min(best[name], per_call_us(fn, args.calls))
                rows.append({"timeout": "default" if timeout is None else "0", "array": kind,
                             "op": op, "ours_us": best["ours"], "raw_us": best["raw"],
                             "diff_us": best["ours"] - best["raw"]})
        ours_comm.close()
        raw_comm.Free()
    if world.rank == 0:
        print(f"ranks={world.size}; CPU time of the calling thread per call, best of "
              f"{args.rounds} rounds of {args.calls}")
        print(f"{'timeout':>8} {'array':>6} {'op':>11} {'ours us':>8} {'raw us':>8} {'diff us':>8}")
        for r in rows:
            print(f"{r['timeout']:>8} {r['array']:>6} {r['op']:>11} {r['ours_us']:8.2f} "
                  f"{r['raw_us']:8.2f} {r['diff_us']:+8.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"ranks": world.size, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
