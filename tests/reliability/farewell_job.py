"""A job for tests/reliability/test_farewell.py (run by mpiexec or torchrun): ranks that make
different numbers of all_reduces.

    mpiexec -n 3 python tests/reliability/farewell_job.py BACKEND DIR

BACKEND is ``mpi`` or ``torch`` (collectives.init()) or ``c10d`` (torch.distributed over the
"collectives" backend). Rank 0 makes FEWER all_reduces and ends normally (``DONE rank 0``); the
other ranks make MORE: their call FEWER + 1 must raise at once, naming rank 0. Each rank writes
what happened into ``DIR/rank-<R>.txt`` too (the launcher may cut a failing rank's output).
"""

import atexit
import os
import sys
import time

FEWER, MORE = 3, 5
ENDED_NORMALLY: list[bool] = []


def slow_exit() -> None:
    """With FAREWELL_SLOW_EXIT=S, a rank that finished takes S seconds more to end after
    MPI_Finalize (registered before mpi4py is imported, this handler runs after its finalizer),
    as a big interpreter's ending may."""
    if ENDED_NORMALLY and os.environ.get("FAREWELL_SLOW_EXIT"):
        time.sleep(float(os.environ["FAREWELL_SLOW_EXIT"]))


atexit.register(slow_exit)


def main(backend: str, directory: str) -> None:
    if backend == "c10d":
        import torch
        import torch.distributed as dist

        import collectives.c10d

        collectives.c10d.init_process_group()
        rank = dist.get_rank()

        def call() -> None:
            dist.all_reduce(torch.ones(4))
    else:
        import numpy as np

        import collectives

        comm = collectives.init(backend)
        rank = comm.rank

        def call() -> None:
            comm.all_reduce(np.ones(4))

    calls = FEWER if rank == 0 else MORE
    start = time.monotonic()
    try:
        for _ in range(calls):
            call()
            start = time.monotonic()
        line = f"DONE rank {rank} after {calls} calls"
    except Exception as error:
        line = f"RAISED rank {rank} after {time.monotonic() - start:.3f} s: {type(error).__name__}: {error}"
        with open(os.path.join(directory, f"rank-{rank}.txt"), "w") as file:
            file.write(line + "\n")
        print(line, flush=True)
        raise
    with open(os.path.join(directory, f"rank-{rank}.txt"), "w") as file:
        file.write(line + "\n")
    print(line, flush=True)
    ENDED_NORMALLY.append(True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
