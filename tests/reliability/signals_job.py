"""A 2-rank job for tests/reliability/test_signals.py (run by mpiexec or torchrun): exits and signals.

    mpiexec -n 2 python tests/reliability/signals_job.py MODE

Every rank makes one all_reduce and prints ``READY rank R pid P``. Then, by MODE:

- ``wait``: rank 0 prints ``ENTERING`` and enters an all_reduce that rank 1 never joins;
  rank 1 sleeps. Once rank 0's main thread has stayed on one instruction of the transport
  call for 0.3 s (a blocking wait: Gloo, MPI without a timeout), a thread prints
  ``BLOCKED rank 0``. The test signals a rank or the launcher: every rank must end.
- ``self-sigint``: as ``wait``, but rank 1 interrupts itself (``signal.raise_signal``).
- ``exit`` / ``raise-exit``: as ``wait``, but rank 1 ends with an uncaught ``sys.exit(3)``
  / ``raise SystemExit(3)``.
- ``caught-exit``: rank 1 catches its ``sys.exit(3)``; both ranks make one more
  all_reduce and finish normally (the job must exit 0).
- ``exit-zero``: both ranks make one more all_reduce and end with ``sys.exit(0)``.
- ``caught-sigint``: both ranks run Python until a SIGINT, catch the KeyboardInterrupt and
  wind down with a barrier that rank 1 joins 3 s late (longer than the SIGINT watcher's
  grace): nothing may cut it short, the job exits 0.

Each rank prints ``FINISHED rank R`` when it ends on its own. Where ``SIGNALS_JOB_STDERR``
names a folder, each rank's stderr goes to ``<pid>.err`` there (the test reads it: Hydra's
forwarding of what a rank writes just before MPI_Abort can be cut off by the abort).
"""

import os
import signal
import sys
import threading
import time

import numpy as np

import collectives


def report_when_blocked(steady: float = 0.3) -> None:
    """Print ``BLOCKED rank 0`` once the main thread's innermost frame is in the library (or
    torch.distributed), or is :func:`main`'s at its all_reduce (the compiled call path and fast
    paths have no Python frame of their own: a call blocked in them leaves main's frame
    innermost), and has not moved for ``steady`` seconds."""
    thread = threading.main_thread().ident
    library = os.path.dirname(os.path.dirname(os.path.abspath(collectives.__file__)))
    last, since = None, time.monotonic()
    while True:
        frame = sys._current_frames().get(thread)
        if frame is None:
            return
        where = (frame.f_code, frame.f_lasti)
        inside = frame.f_code.co_filename.startswith(library) or "distributed" in frame.f_code.co_filename \
            or frame.f_code is main.__code__
        if where != last or not inside:
            last, since = where, time.monotonic()
        elif time.monotonic() - since >= steady:
            print("BLOCKED rank 0", flush=True)
            return
        time.sleep(0.02)


def main(mode: str) -> None:
    if os.environ.get("SIGNALS_JOB_STDERR"):  # the test reads each rank's stderr from a file
        with open(os.path.join(os.environ["SIGNALS_JOB_STDERR"], f"{os.getpid()}.err"), "w") as err:
            os.dup2(err.fileno(), 2)
    comm = collectives.init()
    comm.all_reduce(np.ones(4))
    print(f"READY rank {comm.rank} pid {os.getpid()}", flush=True)
    if mode in ("caught-exit", "exit-zero"):
        if comm.rank == 1 and mode == "caught-exit":
            try:
                sys.exit(3)
            except SystemExit:
                pass
        x = comm.all_reduce(np.ones(4))
        print(f"FINISHED rank {comm.rank} sum {x[0]:.0f}", flush=True)
        if mode == "exit-zero":
            sys.exit(0)
        return
    if mode == "caught-sigint":
        try:
            print(f"LOOPING rank {comm.rank}", flush=True)  # the test signals after both
            while True:
                sum(range(1000))
        except KeyboardInterrupt:
            if comm.rank == 1:
                time.sleep(3)
            comm.barrier()
            print(f"FINISHED rank {comm.rank} sum 2", flush=True)
        return
    if comm.rank == 0:
        threading.Thread(target=report_when_blocked, daemon=True).start()
        print(f"ENTERING rank 0 at {time.time():.6f}", flush=True)
        comm.all_reduce(np.ones(4))  # rank 1 never comes
        print("FINISHED rank 0: the all_reduce returned, which it must not", flush=True)
        return
    if mode == "self-sigint":
        time.sleep(0.5)  # rank 0 gets into its all_reduce
        print(f"FAILING AT {time.time():.6f}", flush=True)
        signal.raise_signal(signal.SIGINT)
    elif mode in ("exit", "raise-exit"):
        time.sleep(0.5)
        print(f"FAILING AT {time.time():.6f}", flush=True)
        if mode == "exit":
            sys.exit(3)
        raise SystemExit(3)
    time.sleep(300)
    print("FINISHED rank 1", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))  # the usual idiom: sys.exit is looked up before main() runs
