"""A rank of the elastic tests' torch DDP job (float64) on the c10d backend "collectives",
trained with collectives.elastic across a shrink: ``train`` wraps the model in
DistributedDataParallel over ``collectives.c10d.process_group()``, the "collectives" group of
the current generation (made again after each shrink).

    collectives-elastic -n 4 python ddp_job.py OUT --faults 3:kill@3          # torch backend (Gloo)
    collectives-elastic --mpi -n 4 python ddp_job.py OUT --faults 3:kill@3    # Open MPI's ULFM

Each rank of the last generation writes OUT/<rank>.json: its parameters and the sizes.

``--device cuda`` trains on the GPU ``LOCAL_RANK`` picks (each generation's group then runs
NCCL for CUDA tensors); ``--shrink-at S`` makes every rank call ``shrink()`` at step S though
no rank failed (the generation's groups aborted and destroyed, a new one made): the GPU check
runs it on one rank, where no rank can fail.
"""

from __future__ import annotations

import argparse
import json
import os
import threading

import torch
import torch.distributed as dist
from linear_job import fail, parse_faults
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import collectives
import collectives.c10d
from collectives import elastic

STEPS, BATCH, FEATURES, LR = 8, 24, 4, 0.1


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 6), nn.Tanh(), nn.Linear(6, 1)).double()


def batch(step: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64)
    return x.to(device), x.sum(1, keepdim=True).sin().to(device)


def group_workers() -> list[str]:
    """The "collectives" process groups whose threads (worker, completers) run in this process:
    their names are ``collectives-pg-<backend>-<group id>[-completer-<n>]``."""
    return sorted({t.name.split("-")[3] for t in threading.enumerate() if t.name.startswith("collectives-pg-")})


def reference(sizes: list[int]) -> list[torch.Tensor]:
    """The same steps on one process, without DDP: each step's gradient is the mean over that
    step's ranks of the gradient of each rank's shard (what DDP averages)."""
    net = model()
    for step, size in enumerate(sizes):
        x, y = batch(step)
        grads = [torch.zeros_like(p) for p in net.parameters()]
        for rank in range(size):
            net.zero_grad()
            nn.functional.mse_loss(net(x[rank::size]), y[rank::size]).backward()
            for g, p in zip(grads, net.parameters()):
                g += p.grad / size
        with torch.no_grad():
            for g, p in zip(grads, net.parameters()):
                p -= LR * g
    return [p.detach() for p in net.parameters()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--faults", default="")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shrink-at", type=int, default=-1)
    args = parser.parse_args()
    first = collectives.init(fault_tolerant=True)
    fault = parse_faults(args.faults).get(os.environ.get(collectives.config.ELASTIC_ID) or str(first.rank))
    device = args.device if args.device == "cpu" else f"cuda:{torch.cuda.current_device()}"
    net = model().to(device)
    workers_after_shrink: list[list[str]] = []
    state = elastic.State(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=LR), step=0, sizes=[])

    def train(comm: collectives.Communicator, state: elastic.State) -> None:
        group = collectives.c10d.process_group()  # this generation's "collectives" group
        ddp = DistributedDataParallel(state.model, process_group=group)
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if comm.generation > 0 and args.shrink_at >= 0:
            workers_after_shrink.append(group_workers())
        while state.step < STEPS:
            if state.step == args.shrink_at and comm.generation == 0:
                raise elastic.MembershipChange(comm.shrink())  # no rank failed: the same ranks
            x, y = batch(state.step, device)
            state.optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x[rank::size]), y[rank::size])
            if fault is not None and fault[1] == state.step:
                fail(fault[0])  # after the forward, before DDP's all_reduce in the backward
            loss.backward()
            state.optimizer.step()
            state.sizes = [*state.sizes, size]
            state.step += 1
            state.commit()

    elastic.run(train, state)
    comm = collectives.init(fault_tolerant=True)
    group = collectives.c10d.process_group()
    result = {"rank": comm.rank, "sizes": state.sizes, "group": [dist.get_rank(group), dist.get_world_size(group)],
              "params": [p.detach().cpu().tolist() for p in net.parameters()], "generation": comm.generation,
              "backend": str(dist.get_backend()), "param_device": str(next(net.parameters()).device),
              "workers_after_shrink": workers_after_shrink, "workers": group_workers()}
    with open(os.path.join(args.out, f"{comm.rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
