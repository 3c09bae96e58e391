"""A job whose rank 1 fails, for tests/reliability/test_reliability.py (run by mpiexec or torchrun).

    mpiexec -n 2 python tests/reliability/reliability_crash.py raise|exit|kill

Every rank makes one all_reduce; then rank 1 fails (an uncaught exception, a
non-zero exit, or SIGKILL) while rank 0 enters a second all_reduce that rank 1
never joins. What must happen: the launcher ends every rank within seconds and
exits non-zero, with rank 1 named in the output. Rank 1 prints the wall-clock
time of its failure and its pid (``FAILING AT <time> rank 1 pid <pid>``) so that the test can time the teardown.
"""

import os
import signal
import sys
import time

import numpy as np

import collectives


def main(mode: str) -> None:
    comm = collectives.init()
    x = comm.all_reduce(np.ones(4))
    assert x[0] == comm.size
    if comm.rank == 1:
        print(f"FAILING AT {time.time():.6f} rank {comm.rank} pid {os.getpid()} mode {mode}", flush=True)
        if mode == "raise":
            raise RuntimeError(f"rank {comm.rank} fails on purpose")
        if mode == "exit":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(np.ones(4))  # rank 1 never comes: only the launcher can end this
    print(f"rank {comm.rank}: the second all_reduce returned, which it must not", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
