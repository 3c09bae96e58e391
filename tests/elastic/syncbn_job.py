"""A rank of the elastic tests' DataParallel + SyncBatchNorm job (float64), trained with
collectives.elastic across a shrink: the wrapper is made again in each generation (``train``),
SyncBatchNorm (``comm=None``) follows ``collectives.init()``'s communicator, which a shrink
replaces.

    collectives-elastic -n 4 python syncbn_job.py OUT --faults 3:kill@3

Each rank of the last generation writes OUT/<member>.json: its parameters and the sizes.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from collectives.syncbn import DataParallel, SyncBatchNorm
from linear_job import fail, parse_faults
from torch import nn

import collectives
from collectives import elastic

STEPS, BATCH, FEATURES = 8, 24, 4


def model(batchnorm: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 6), batchnorm(6), nn.ReLU(), nn.Linear(6, 1)).double()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, FEATURES, generator=g, dtype=torch.float64)
    return x, x.sum(1, keepdim=True).sin()


def reference(steps: int) -> list[torch.Tensor]:
    """The same steps on one process over the whole batch, with torch's own BatchNorm1d."""
    net = model(nn.BatchNorm1d)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step)
        optimizer.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        optimizer.step()
    return [p.detach() for p in net.parameters()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--faults", default="")
    args = p.parse_args()
    faults = parse_faults(args.faults)
    collectives.init(fault_tolerant=True)
    me = os.environ[collectives.config.ELASTIC_ID]
    net = model(SyncBatchNorm)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    state = elastic.State(model=net, optimizer=optimizer, step=0, sizes=[])

    def train(comm: collectives.Communicator, state: elastic.State) -> None:
        wrapped = DataParallel(state.model, comm)  # one wrapper per generation
        try:
            while state.step < STEPS:
                x, y = batch(state.step)
                x, y = x[comm.rank::comm.size], y[comm.rank::comm.size]  # equal shards: 24 rows
                optimizer.zero_grad()
                loss = ((wrapped(x) - y) ** 2).mean()
                if me in faults and faults[me][1] == state.step:
                    fail(faults[me][0])
                loss.backward()
                optimizer.step()
                state.sizes = [*state.sizes, comm.size]
                state.step += 1
                state.commit()
        finally:
            wrapped.remove_hooks()

    elastic.run(train, state)
    comm = collectives.init()
    with open(os.path.join(args.out, f"{me}.json"), "w") as f:
        json.dump({"rank": comm.rank, "size": comm.size, "sizes": state.sizes,
                   "params": [p.detach().tolist() for p in net.parameters()]}, f)


if __name__ == "__main__":
    main()
