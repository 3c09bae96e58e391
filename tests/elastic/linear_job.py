"""A rank of the elastic tests' job: float64 least squares, trained with collectives.elastic.

    collectives-elastic -n 4 --min 2 python linear_job.py OUT --faults 3:kill@4,1:exit@7

Each fault ``member:how@step`` makes that member fail at that step, between its local gradient
and the all_reduce: ``kill`` (SIGKILL), ``exit`` (``os._exit(1)``), ``raise`` (an uncaught
exception), ``stop`` (SIGSTOP: it hangs). ``member:how@step/point`` makes it fail at another
point of the loop (:data:`POINTS`). ``--wait-join S:N`` holds the survivors at step S
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
from collections.abc import Callable
from typing import Any

import numpy as np

import collectives
from collectives import elastic

STEPS, BATCH, DIM, LR = 12, 24, 5, 0.05

#: Where a fault ``member:how@step/point`` strikes (without ``/point``: ``collective``). The
#: points of a recovery strike in the first recovery (or admission) at or after ``step``.
POINTS = {
    "top": "at the top of the step, before its gradient",
    "collective": "between the gradient and the all_reduce: the survivors wait inside it",
    "commit": "after the step, before commit(): the survivors wait inside commit()",
    "incommit": "inside commit(), once its collective returned on this rank",
    "restore": "inside restore(), as a recovery begins: before the shrink",
    "shrink": "inside shrink(), once it voted: the next generation counts it in",
    "ready": "while the next generation's group is made (torch backend; ULFM: as shrink)",
    "admit": "inside commit()'s admission of a replacement, once it voted (torch backend)",
}


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((BATCH, DIM))
    return x, x @ np.arange(1.0, DIM + 1) + 0.1 * rng.standard_normal(BATCH)


def partial_gradient(w: np.ndarray, step: int, rank: int, size: int) -> np.ndarray:
    """This rank's share of the batch's gradient sum: rows rank, rank + size, ..."""
    x, y = batch(step)
    x, y = x[rank::size], y[rank::size]
    return x.T @ (x @ w - y)


def parse_faults(text: str) -> dict[str, tuple[str, int, str]]:
    """``member:how@step[/point],...`` as {member: (how, step, point)}."""
    faults = {}
    for fault in filter(None, text.split(",")):
        member, _, rest = fault.partition(":")
        how, _, step = rest.partition("@")
        step, _, point = step.partition("/")
        assert (point or "collective") in POINTS, point
        faults[member] = (how, int(step), point or "collective")
    return faults


def strike_inside_the_library(how: str, step: int, point: str, state: elastic.State, backend: str) -> None:
    """Make this process fail inside the library's recovery (``shrink``, ``ready``, ``admit``):
    its step (after it voted) ends in ``fail(how)`` from ``step`` on. A test's way to reach
    these points, in this process only; the transports are the real ones."""
    def armed() -> bool:
        return int(state.step) >= step

    if backend == "mpi":
        from collectives.backends.mpi_ulfm import ULFMTransport

        after(ULFMTransport, "_revoke_and_shrink", lambda *_: armed(), how)  # (shrink and ready)
        return
    from collectives.backends.torch_elastic import ElasticTorchTransport

    from collectives.elastic.membership import Membership

    if point == "ready":
        after(Membership, "settle", lambda _, topic, *__: armed() and topic.startswith("ready/"), how)
    else:  # shrink: a generation that failed; admit: one that did not
        before(ElasticTorchTransport, "_next",
               lambda transport, _: armed() and (transport._failure is not None) == (point == "shrink"), how)


def before(cls: type, name: str, when: Callable[..., bool], how: str) -> None:
    original = getattr(cls, name)

    def failing(*args: Any) -> Any:
        if when(*args):
            fail(how)
        return original(*args)

    setattr(cls, name, failing)


def after(cls: type, name: str, when: Callable[..., bool], how: str) -> None:
    original = getattr(cls, name)

    def failing(*args: Any) -> Any:
        result = original(*args)
        if when(*args):
            fail(how)
        return result

    setattr(cls, name, failing)


class FaultyState(elastic.State):
    """A State whose ``restore()`` fails this member as a recovery at or after ``step`` begins."""

    def restore(self) -> None:
        fault = getattr(type(self), "fault", None)
        if fault is not None and fault[2] == "restore" and int(self.step) >= fault[1]:
            fail(fault[0])
        super().restore()


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
    state = FaultyState(w=np.zeros(DIM), step=0, sizes=[])
    how, at, point = faults.get(me, ("", -1, ""))
    FaultyState.fault = faults.get(me)
    if point in ("shrink", "ready", "admit"):
        strike_inside_the_library(how, at, point, state, comm.backend)

    def train(comm: collectives.Communicator, state: elastic.State) -> None:
        while state.step < STEPS:
            while state.step in holds and comm.size < holds[state.step]:
                state.commit()  # admits the replacements that wait (MembershipChange)
                time.sleep(0.01)
            if (at, point) == (state.step, "top"):
                fail(how)
            g = partial_gradient(state.w, state.step, comm.rank, comm.size)
            if (at, point) == (state.step, "collective"):
                fail(how)
            comm.all_reduce(g)
            state.w = state.w - LR * g / BATCH
            state.sizes = [*state.sizes, comm.size]
            state.step += 1
            if (at, point) == (state.step - 1, "commit"):
                fail(how)
            if (at, point) == (state.step - 1, "incommit"):
                comm.register_hook(lambda record: fail(how))  # (commit()'s all_reduce returned)
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
