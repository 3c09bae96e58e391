"""torch.distributed over "collectives" under an MPI launcher, the ways users set it up
with torch's environment variables; prints ``C10D rank=R size=N sum=S`` per rank.

    mpiexec -n 2 python c10d_env_check.py master-addr   # MASTER_ADDR set (the store's address)
    mpiexec -n 2 python c10d_env_check.py env           # plain env://: RANK, WORLD_SIZE set too
    mpiexec -n 3 python c10d_env_check.py plain         # torch code unchanged: no variable set
    mpiexec -n 3 python c10d_env_check.py plain-gloo    # the same with backend "gloo"
    mpiexec -n 3 python c10d_env_check.py plain P       # MASTER_PORT=P set by the user: kept

``plain`` also prints ``ENV RANK=.. WORLD_SIZE=.. LOCAL_RANK=.. MASTER_PORT=..`` as the import filled them.
"""

from __future__ import annotations

import os
import sys

if sys.argv[1] == "plain" and len(sys.argv) > 2:  # the user's MASTER_PORT, set before the import
    os.environ["MASTER_PORT"] = sys.argv[2]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import collectives.c10d  # noqa: E402
from collectives.launcher import detect_launcher  # noqa: E402


def main(mode: str) -> None:
    launch = detect_launcher()
    if mode.startswith("plain"):  # torch code unchanged: `import collectives.c10d` filled env://
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
        print("ENV " + " ".join(f"{name}={os.environ.get(name)}" for name in names), flush=True)
        dist.init_process_group("gloo" if mode == "plain-gloo" else "collectives")
        x = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(x)
        print(f"C10D rank={dist.get_rank()} size={dist.get_world_size()} sum={int(x.item())}", flush=True)
        dist.destroy_process_group()
        return
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
