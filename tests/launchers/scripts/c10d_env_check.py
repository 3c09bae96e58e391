"""torch.distributed over "collectives" under an MPI launcher, the two ways users set it up
with torch's environment variables; prints ``C10D rank=R size=N sum=S`` per rank.

    mpiexec -n 2 python c10d_env_check.py master-addr   # MASTER_ADDR set (the store's address)
    mpiexec -n 2 python c10d_env_check.py env           # plain env://: RANK, WORLD_SIZE set too
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import collectives.c10d
from collectives.launcher import detect_launcher


def main(mode: str) -> None:
    launch = detect_launcher()
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    if mode == "env":  # what a user's script does for env:// under mpiexec
        os.environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.size), MASTER_PORT=sys.argv[2])
        dist.init_process_group("collectives")
    else:
        collectives.c10d.init_process_group()
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x)
    print(f"C10D rank={dist.get_rank()} size={dist.get_world_size()} sum={int(x.item())}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
