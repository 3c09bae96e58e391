"""A rank of the elastic tests' split job: a split of a fault-tolerant communicator across a
rank's death.

    collectives-elastic -n 4 python split_job.py OUT            # torch backend (Gloo)
    collectives-elastic --mpi -n 4 python split_job.py OUT      # Open MPI's ULFM

The four ranks split the world in reverse order (split rank ``3 - r``) and all_reduce on the
split; then member 3 is SIGKILLed and the survivors' next all_reduce on the split raises
RankFailure naming split rank 0, and so does a call of the world. On ULFM the split shrinks
itself (3 ranks); on both, the world's shrink() is split again. Each survivor writes
OUT/<member>.json: what it saw.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

import collectives
from collectives import RankFailure


def failure_of(call: object) -> list[int] | str:
    """The failed ranks of the RankFailure that ``call()`` raises (a string when it raises none)."""
    try:
        call()  # type: ignore[operator]
    except RankFailure as failure:
        return list(failure.failed_ranks)
    return "no RankFailure"


def main() -> None:
    out = sys.argv[1]
    world = collectives.init(fault_tolerant=True)
    me = os.environ.get(collectives.config.ELASTIC_ID) or str(world.rank)
    split = world.split(0, key=-world.rank)
    seen: dict[str, object] = {"split_rank": split.rank,
                               "before": float(split.all_reduce(np.array([world.rank + 1.0]))[0])}
    world.barrier()
    if me == "3":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    seen["split_failure"] = failure_of(lambda: split.all_reduce(np.ones(4)))
    seen["world_failure"] = failure_of(lambda: world.all_reduce(np.ones(4)))
    if world.backend == "mpi":  # ULFM shrinks a split itself
        shrunk = split.shrink()
        seen["split_shrunk"] = [shrunk.rank, shrunk.size, float(shrunk.all_reduce(np.array([world.rank + 1.0]))[0])]
    else:
        try:
            split.shrink()
        except collectives.BackendUnavailable as error:
            seen["split_shrunk"] = str(error)
    world = world.shrink()
    again = world.split(0, key=-world.rank)
    seen["again"] = [again.rank, again.size, float(again.all_reduce(np.array([world.rank + 1.0]))[0])]
    seen["agree"] = again.agree(True)
    with open(os.path.join(out, f"{me}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
