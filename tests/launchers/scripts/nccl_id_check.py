"""The NCCL unique id exchange of the cupy backend (backends/cupy_id.py) without a GPU.

Rank 0 makes three ids in turn (made-up bytes: the exchange never looks inside); every
other rank must receive exactly those bytes, through MPI_Bcast under an MPI launcher or
through torchrun's agent store. The expected bytes are known to every rank, so each
checks its own and exits 1 on a difference (the job's exit status says whether all got
them); rank 0 prints the route taken:

    NCCL IDS OK route=R ranks=N exchanges=3

    mpiexec -n 2 python tests/launchers/scripts/nccl_id_check.py
    torchrun --nproc_per_node 2 tests/launchers/scripts/nccl_id_check.py
"""

from __future__ import annotations

import hashlib
import sys

from collectives.backends import cupy_id

from collectives.launcher import detect_launcher

EXCHANGES = 3


def made_up_id(n: int) -> bytes:
    return b"".join(hashlib.sha256(f"id {n} part {i}".encode()).digest() for i in range(4))


def refuse() -> bytes:
    raise AssertionError("only rank 0 makes the id")


def main() -> int:
    launch = detect_launcher()
    route = cupy_id.exchange_route(launch)
    bad = []
    for n in range(EXCHANGES):
        got = cupy_id.exchange_unique_id(launch, (lambda n=n: made_up_id(n)) if launch.rank == 0 else refuse)
        if got != made_up_id(n):
            bad.append(n)
    if bad:
        print(f"NCCL IDS DIFFER rank={launch.rank} exchanges={bad}", flush=True)
        return 1
    if launch.rank == 0:
        print(f"NCCL IDS OK route={route} ranks={launch.size} exchanges={EXCHANGES}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
