"""The cupy backend (NCCL) with ranks on several hosts: all_reduce, broadcast and split by
host on CuPy arrays, checked on each rank against what the values must be; exits 1 on a
difference, rank 0 prints ``CUPY OK ranks=N hosts=H``. For tests/gpu/test_gpu.py on the
multi-host test bed (the NCCL id goes through MPI under mpiexec, the store under torchrun).

    COLLECTIVES_BACKEND=cupy torchrun --nnodes 2 ... tests/launchers/scripts/gpu_multihost_check.py
"""

from __future__ import annotations

import socket
import sys

import cupy as cp

import collectives


def main() -> int:
    comm = collectives.init()
    failures = []
    x = cp.full(1 << 20, comm.rank + 1, dtype=cp.float32)
    comm.all_reduce(x)
    if not bool((x == comm.size * (comm.size + 1) / 2).all()):
        failures.append("all_reduce")
    b = cp.arange(1000, dtype=cp.float64) if comm.rank == 0 else cp.zeros(1000, dtype=cp.float64)
    comm.broadcast(b, src=0)
    if not bool((b == cp.arange(1000, dtype=cp.float64)).all()):
        failures.append("broadcast")
    # Split by host: the ranks of one host sum their ranks among themselves.
    names = cp.asarray(list(socket.gethostname().encode().ljust(64, b"\0")), dtype=cp.uint8)
    every = cp.asnumpy(comm.all_gather(names))
    hosts = [bytes(row).rstrip(b"\0").decode() for row in every]
    color = sorted(set(hosts)).index(hosts[comm.rank])
    local = comm.split(color)
    y = cp.full(4, comm.rank, dtype=cp.int64)
    local.all_reduce(y)
    want = sum(r for r, h in enumerate(hosts) if h == hosts[comm.rank])
    if not bool((y == want).all()):
        failures.append("split by host")
    local.close()
    if failures:
        print(f"CUPY FAILED rank={comm.rank}: {failures}", flush=True)
        return 1
    if comm.rank == 0:
        print(f"CUPY OK ranks={comm.size} hosts={len(set(hosts))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
