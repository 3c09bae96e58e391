"""``collectives-elastic``: start a fault-tolerant job.

    collectives-elastic -n 4 --min 2 --replace python train.py        # torch backend (Gloo)
    collectives-elastic --mpi -n 4 --min 2 python train.py            # Open MPI's ULFM

torch (the default): this process serves the membership store and starts the ranks, then
replacements for the ranks that fail (``--replace``, at most ``--max-restarts``); see
``collectives/elastic/agent.py``. ``--mpi``: runs ``mpirun`` (``--launcher``) with ULFM on
and Open MPI's heartbeat detector (a rank that ends without closing its connections, or hangs,
is found in ~2 s), the ranks' ``COLLECTIVES_BACKEND=mpi`` and ``COLLECTIVES_FAULT_TOLERANT=1``.
The exit status is 0 when the ranks of the last generation (at least ``--min``) all ended
normally.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from collections.abc import Sequence

from .. import config

#: Open MPI's ULFM, and its heartbeat detector: a rank that dies without its sockets closing
#: (or hangs) is declared failed after ``--detector-timeout`` seconds without a heartbeat. Not
#: its thread (``mpi_ft_detector_thread``): with it, Open MPI 5.0.11's MPI_Finalize spins forever
#: after a peer failed; without it the heartbeats go out from MPI's progress loop, which a thread
#: of ours enters every 0.1 s (backends/mpi_ulfm.py).
ULFM_FLAGS = ("--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true",
              "--mca", "mpi_ft_detector_period", "0.5")
#: Seconds without a heartbeat before the detector declares a rank failed (default).
DETECTOR_TIMEOUT = 2.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="collectives-elastic", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", "--nproc", type=int, required=True, help="ranks to start")
    p.add_argument("--min", type=int, default=1, dest="min_size",
                   help="end the job when fewer ranks remain, replacements started included (default 1)")
    p.add_argument("--replace", action="store_true",
                   help="start a replacement for each rank that fails (torch backend)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="replacements to start at most (default 3)")
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds a collective may take: a rank that hangs longer is failed "
                        f"(sets {config.TIMEOUT}; default: its value, else 60)")
    p.add_argument("--mpi", action="store_true", help="run under Open MPI's mpirun with ULFM")
    p.add_argument("--launcher", default="mpirun",
                   help="with --mpi: the mpirun command line (default mpirun)")
    p.add_argument("--detector-timeout", type=float, default=DETECTOR_TIMEOUT,
                   help=f"with --mpi: seconds without a heartbeat before Open MPI declares a rank "
                        f"failed (a hung rank, or one that ended without closing its connections; "
                        f"default {DETECTOR_TIMEOUT:g}); raise it on a loaded machine, where a rank "
                        "that gets no CPU that long is taken for dead")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        parser().error("give the command to run, e.g. python train.py")
    for name, value, low in (("-n", args.nproc, 1), ("--min", args.min_size, 1),
                             ("--max-restarts", args.max_restarts, 0)):
        if value < low:
            parser().error(f"{name} must be at least {low}; got {value}")
    if args.detector_timeout < 1:
        parser().error(f"--detector-timeout must be at least 1 (the heartbeat period is 0.5 s); "
                       f"got {args.detector_timeout:g}")
    if args.min_size > args.nproc:
        parser().error(f"--min {args.min_size} is more than -n {args.nproc}")
    if args.timeout is not None:
        os.environ[config.TIMEOUT] = f"{args.timeout:g}"
    else:
        os.environ.setdefault(config.TIMEOUT, "60")
    if args.mpi:
        if args.replace:
            parser().error("--replace: replacements join on the torch backend only; on Open MPI "
                           "the job shrinks")
        mpirun = [*shlex.split(args.launcher), *ULFM_FLAGS, "--mca", "mpi_ft_detector_timeout",
                  f"{args.detector_timeout:g}", "-n", str(args.nproc),
                  "-x", f"{config.BACKEND}=mpi", "-x", f"{config.FAULT_TOLERANT}=1",
                  "-x", config.TIMEOUT, *command]
        sys.stdout.flush()
        os.execvp(mpirun[0], mpirun)
    from .agent import Agent  # noqa: PLC0415  (imports torch)

    agent = Agent(args.nproc, command, min_size=args.min_size, replace=args.replace,
                  max_restarts=args.max_restarts)

    def interrupted(signum: int, frame: object) -> None:
        agent.terminate()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    try:
        return agent.run()
    finally:
        agent.close()


if __name__ == "__main__":
    sys.exit(main())
