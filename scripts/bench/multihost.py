"""collectives-bench with its ranks on two hosts joined by a shaped link (root only).

The hosts are network namespaces on this machine (``collectives.testing.hosts.TestBed``),
one rank on each, so every byte of a collective crosses the link. ``--rate`` caps each
host's sending rate with ``tc`` (netem where the kernel has it, else tbf), ``--delay-ms``
adds latency (netem only: without it the script says so and stops). Arguments after ``--``
go to collectives-bench.

    sudo .venv/bin/python scripts/bench/multihost.py --rate 1gbit -- all_reduce -e 16M --raw
    sudo .venv/bin/python scripts/bench/multihost.py --rate 100mbit --launcher torchrun -- all --raw --json t.json
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from collectives.launcher import without_launcher_variables
from collectives.testing.hosts import TestBed, unavailable_reason

BACKENDS = {"mpiexec": "mpi", "torchrun": "torch"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launcher", choices=tuple(BACKENDS), default="mpiexec")
    p.add_argument("--backend", default=None, help="default: mpi under mpiexec, torch under torchrun")
    p.add_argument("--rate", default=None, help="link rate in tc's units (1gbit, 100mbit); default: unshaped")
    p.add_argument("--delay-ms", type=float, default=None, help="added one-way latency (needs sch_netem)")
    p.add_argument("--timeout", type=float, default=1200, help="seconds the benchmark may take")
    p.add_argument("bench_args", nargs="+", help="arguments for collectives-bench (after --): OP [options]")
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"multihost: {reason}", file=sys.stderr)
        return 2
    backend = args.backend or BACKENDS[args.launcher]
    with TestBed(2) as bed:
        if args.rate or args.delay_ms:
            qdisc = bed.shape(delay_ms=args.delay_ms, rate=args.rate)
            if args.delay_ms and not qdisc.startswith("netem"):
                print(f"multihost: this kernel has no sch_netem: latency cannot be added "
                      f"(only `{qdisc}` could be set)", file=sys.stderr)
                return 2
        else:
            qdisc = "none"
        env = {**without_launcher_variables(os.environ), **bed.env, "COLLECTIVES_BACKEND": backend,
               "OMP_NUM_THREADS": "1"}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        commands = bed.launch_commands(args.launcher, ["-m", "collectives.bench", *args.bench_args], 1)
        print(f"# two hosts, one rank each; link shaping on each host's eth0: {qdisc}", flush=True)
        procs = [bed.popen(host, command, env=env, cwd=os.getcwd(), stdin=subprocess.DEVNULL)
                 for host, command in commands.items()]
        try:
            codes = [proc.wait(timeout=args.timeout) for proc in procs]
        except subprocess.TimeoutExpired:
            print(f"multihost: the benchmark did not end within {args.timeout:g} s",
                  file=sys.stderr)
            return 1
        finally:
            bed.close()  # kills whatever is left on the hosts
            for proc in procs:
                proc.wait(timeout=30)
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
