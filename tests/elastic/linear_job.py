"""A rank of the elastic tests' job: float64 least squares, trained with collectives.elastic.

    collectives-elastic -n 4 --min 2 python linear_job.py OUT --faults 3:kill@4,1:exit@7

Each fault ``member:how@step`` makes that member fail at that step, between its local gradient
and the all_reduce: ``kill`` (SIGKILL), ``exit`` (``os._exit(1)``), ``raise`` (an uncaught
exception), ``stop`` (SIGSTOP: it hangs). ``--wait-join S:N`` holds the survivors at step S
(committing, which admits replacements) until the job has N ranks again. Each rank of the last
generation writes OUT/<member>.json: its weights and the size of the job at each step, for the
numpy reference (tests/elastic/test_elastic_gloo.py).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import numpy as np

import collectives
from collectives import elastic

STEPS, BATCH, DIM, LR = 12, 24, 5, 0.05


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, DIM))
    return x, x @ np.arange(1.0, DIM + 1) + 0.1 * rng.standard_normal(BATCH)


def partial_gradient(w: np.ndarray, step: int, rank: int, size: int) -> np.ndarray:
    """This rank's share of the batch's gradient sum: rows rank, rank + size, ..."""
    x, y = batch(step)
    x, y = x[rank::size], y[rank::size]
    return x.T @ (x @ w - y)


def parse_faults(text: str) -> dict[str, tuple[str, int]]:
    """``member:how@step,...`` as {member: (how, step)}."""
    faults = {}
    for fault in filter(None, text.split(",")):
        member, _, rest = fault.partition(":")
        how, _, step = rest.partition("@")
        faults[member] = (how, int(step))
    return faults


def fail(how: str) -> None:
    sys.stdout.flush()
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(1)
    elif how == "raise":
        raise RuntimeError("a bug in the training step (on purpose)")
    elif how == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--faults", default="")
    p.add_argument("--wait-join", default="")
    args = p.parse_args()
    faults = parse_faults(args.faults)
    holds = dict(tuple(map(int, hold.split(":"))) for hold in filter(None, args.wait_join.split(",")))

    comm = collectives.init(fault_tolerant=True)
    me = os.environ.get(collectives.config.ELASTIC_ID) or str(comm.rank)
    state = elastic.State(w=np.zeros(DIM), step=0, sizes=[])

    def train(comm: collectives.Communicator, state: elastic.State) -> None:
        while state.step < STEPS:
            while state.step in holds and comm.size < holds[state.step]:
                state.commit()  # admits the replacements that wait (MembershipChange)
                time.sleep(0.01)
            g = partial_gradient(state.w, state.step, comm.rank, comm.size)
            if me in faults and faults[me][1] == state.step:
                fail(faults[me][0])
            comm.all_reduce(g)
            state.w = state.w - LR * g / BATCH
            state.sizes = [*state.sizes, comm.size]
            state.step += 1
            state.commit()

    elastic.run(train, state, min_size=1)
    comm = collectives.init(fault_tolerant=True)
    result = {"member": me, "rank": comm.rank, "size": comm.size, "generation": comm.generation,
              "local_rank": os.environ.get("LOCAL_RANK"),
              "w": state.w.tolist(), "sizes": state.sizes,
              "history": [[h.generation, h.size, h.step, list(h.failed)] for h in state.history],
              # agree(): the AND over the ranks, the same everywhere
              "agree": [comm.agree(True), comm.agree(comm.rank != comm.size - 1)]}
    with open(os.path.join(args.out, f"{me}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
