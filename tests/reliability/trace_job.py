"""A 3-4 rank job for tests/reliability/test_trace.py (run by mpiexec or torchrun): the flight recorder.

    COLLECTIVES_TRACE_DIR=DIR mpiexec -n 3 python tests/reliability/trace_job.py MODE

Every rank makes CALLS - 1 all_reduces (on a split communicator when MODE ends in ``-split``:
ranks split by ``rank % 2``; the group without the last rank then waits in a world barrier),
prints ``READY rank R pid P``, then by MODE:

- ``hang``: the last rank never enters call CALLS (it waits, printing ``ALIVE rank R`` each
  time its dump appears: SIGUSR1 must not end it); the others enter it (``ENTERING`` once their recorder holds it).
- ``mismatch`` (with ``COLLECTIVES_DEBUG=1``): the last rank calls broadcast where the others
  all_reduce; the mismatch ends the job.
- ``crash``: as ``hang``, but the last rank raises ``RuntimeError`` (uncaught) instead.
- ``thread-crash``: every rank enters call CALLS, except the last, whose worker thread raises
  (uncaught); its main thread waits: the thread's exception must end the job.
- ``profile``: ends after its CALLS - 1 all_reduces (run with ``COLLECTIVES_PROFILE=1``).
- ``hooks``: prints which process-wide hooks are installed (``HOOKS rank R ...``) and ends.
- ``barrier`` / ``call-timeout``: the others call ``barrier(timeout=1)`` / ``all_reduce(x,
  timeout=1)`` (COLLECTIVES_TIMEOUT stays long), the last rank never does; each prints
  ``RAISED rank R after S s: <error>`` (also into ``DIR/raised-<R>.txt``) and lets it end the job.
- ``barrier-late``: as ``barrier``, after three barriers that rank 0 comes to 0.1 s late.
- ``async-hang``: as ``hang``, but call CALLS is ``all_reduce(x, async_op=True)`` and the others
  wait in the handle's ``wait()``.
- ``c10d-timeout`` / ``c10d-crash`` (mpiexec): torch.distributed over the "collectives" backend
  (its calls run on a split communicator of its own); the last rank sleeps past the others'
  COLLECTIVES_TIMEOUT, or raises ``RuntimeError`` after its CALLS - 1 all_reduces.
"""

import os
import sys
import threading
import time

import numpy as np

import collectives

CALLS = 5


def say_when_inside(comms, rank: int) -> None:
    """Print ``ENTERING rank R`` once the flight recorder of one of ``comms`` holds call CALLS
    (or a barrier) as started: the rank is inside its last call."""
    from collectives.diagnostics import recorder

    while True:
        for comm in comms:
            call = comm._ring[-1] if comm._ring else None
            if call is not None and recorder.state(call) in (recorder.STARTED, recorder.POSTED) and (
                    call[recorder.SEQ] == CALLS or call[recorder.OP].name == "barrier"):
                print(f"ENTERING rank {rank}", flush=True)
                return
        time.sleep(0.005)


def c10d(mode: str) -> None:
    import torch
    import torch.distributed as dist

    import collectives.c10d

    collectives.c10d.init_process_group()
    rank, last = dist.get_rank(), dist.get_world_size() - 1
    for _ in range(CALLS - 1):
        dist.all_reduce(torch.ones(4))
    print(f"READY rank {rank} pid {os.getpid()}", flush=True)
    if rank != last:
        dist.all_reduce(torch.ones(4))
    elif mode == "c10d-crash":
        raise RuntimeError("the last rank fails before its call")
    else:
        time.sleep(120)


def main(mode: str) -> None:
    if mode.startswith("c10d-"):
        return c10d(mode)
    comm = collectives.init()
    if mode == "hooks":  # which process-wide hooks are in place
        import signal

        print(f"HOOKS rank {comm.rank} excepthook={sys.excepthook is not sys.__excepthook__} "
              f"thread={threading.excepthook is not threading.__excepthook__} "
              f"exit={getattr(sys.exit, '_collectives_records', False)} "
              f"sigterm={signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL} "
              f"wakeup={signal.set_wakeup_fd(-1) != -1}", flush=True)
        return
    split = mode.endswith("-split")
    mode = mode.removesuffix("-split")
    on = comm.split(comm.rank % 2) if split else comm
    last = comm.size - 1
    x = np.ones(4, np.float32)
    for _ in range(CALLS - 1):
        comm.all_reduce(x) if not split else on.all_reduce(x)
    print(f"READY rank {comm.rank} pid {os.getpid()}", flush=True)
    if mode == "profile":  # COLLECTIVES_PROFILE=1: the table comes at exit
        return
    if mode == "barrier-late":  # rank 0 comes late to three barriers: the others wait, and say so
        for _ in range(3):
            if comm.rank == 0:
                time.sleep(0.1)
            comm.barrier()
        mode = "barrier"
    if mode in ("barrier", "call-timeout") and comm.rank != last:
        start = time.monotonic()
        try:
            on.barrier(timeout=1) if mode == "barrier" else on.all_reduce(x, timeout=1)
        except Exception as error:
            line = f"RAISED rank {comm.rank} after {time.monotonic() - start:.2f} s: {type(error).__name__}: {error}"
            # Also in a file of its own: the launcher may join two ranks' lines into one.
            with open(os.path.join(os.environ["COLLECTIVES_TRACE_DIR"], f"raised-{comm.rank}.txt"), "w") as f:
                f.write(line + "\n")
            print(line, flush=True)
            raise
        print(f"FINISHED rank {comm.rank}: the call returned", flush=True)
        return
    if comm.rank != last:
        threading.Thread(target=say_when_inside, args=({on, comm}, comm.rank), daemon=True).start()
        if mode == "async-hang":
            on.all_reduce(x, async_op=True).wait()
        else:
            on.all_reduce(x)  # the last rank never comes (or comes with another call)
        if split:  # the group without the last rank completed it: it waits for the others here
            comm.barrier()
        print(f"FINISHED rank {comm.rank}: the call returned", flush=True)
        return
    if mode == "mismatch":
        on.broadcast(x, 0)
    elif mode == "crash":
        raise RuntimeError("the last rank fails before its call")
    elif mode in ("barrier", "call-timeout"):
        time.sleep(120)  # the others' timeouts end the job well before
    elif mode == "thread-crash":
        def fail() -> None:
            raise RuntimeError("a worker thread fails")
        threading.Thread(target=fail, name="worker").start()
        time.sleep(120)  # the thread's exception must end the process well before
        print("FINISHED: the thread's exception did not end the process", flush=True)
    else:  # hang: stays out of the call, and says it is alive after each dump
        dump = os.path.join(os.environ["COLLECTIVES_TRACE_DIR"], f"rank-{comm.rank}.json")
        seen = None
        while True:
            stamp = os.stat(dump).st_mtime_ns if os.path.exists(dump) else None
            if stamp != seen and stamp is not None:
                print(f"ALIVE rank {comm.rank}", flush=True)
            seen = stamp
            time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
