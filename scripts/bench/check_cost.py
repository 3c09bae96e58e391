"""What the default check costs: collectives-bench --raw with the check on (COLLECTIVES_DEBUG
unset) and off (COLLECTIVES_DEBUG=0), in alternating runs.

    python scripts/bench/check_cost.py                        # all_reduce and broadcast, 16 B - 1 MiB, 3 rounds
    python scripts/bench/check_cost.py --ops all_reduce --rounds 5 --json docs/bench/check-cost.json

Each round runs ``mpiexec -n N collectives-bench OP -b MIN -e MAX -f STEP --raw`` once with the
check on and once off (the order alternates between rounds). Every row's cost is measured
against the raw transport of its own run, so that what the machine does between two runs cancels
out: ``check = (ours - raw with the check on) - (ours - raw with it off)``, the median over the
rounds, in microseconds and as a fraction of the unchecked call. Prints one table per collective.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def bench(op: str, args: argparse.Namespace, checks: bool) -> dict[int, tuple[float, float]]:
    """bytes -> (ours, raw) median microseconds, from one collectives-bench run."""
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    env = dict(os.environ)
    env.pop("COLLECTIVES_DEBUG", None)
    if not checks:
        env["COLLECTIVES_DEBUG"] = "0"
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "bench.json")
        subprocess.run([mpiexec, "-n", str(args.ranks), sys.executable, "-m", "collectives.bench", op,
                        "-b", str(args.minbytes), "-e", str(args.maxbytes), "-f", str(args.stepfactor), "--raw",
                        "-t", str(args.seconds), "--json", path],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        with open(path) as file:
            results = json.load(file)["results"]
    return {row["bytes"]: (row["ours"]["median_us"], row["raw"]["median_us"]) for row in results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="+", default=["all_reduce", "broadcast"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--minbytes", default="16")
    parser.add_argument("--maxbytes", default="1M")
    parser.add_argument("--stepfactor", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=0.3, help="collectives-bench -t per size")
    parser.add_argument("--json", help="write every run's medians and the table here")
    args = parser.parse_args()
    document: dict[str, object] = {"command": " ".join(sys.argv), "load": os.getloadavg(), "ops": {}}
    for op in args.ops:
        runs: dict[bool, list[dict[int, tuple[float, float]]]] = {True: [], False: []}
        for round_ in range(args.rounds):
            for checks in ((True, False) if round_ % 2 == 0 else (False, True)):
                runs[checks].append(bench(op, args, checks))
        rows = []
        print(f"\n{op}, {args.ranks} ranks, {args.rounds} rounds (median): size, ours/raw us with the "
              "check, without it, the check's cost (us, % of the unchecked call)")
        for size in sorted(runs[True][0]):
            on = [run[size][0] - run[size][1] for run in runs[True]]
            off = [run[size][0] - run[size][1] for run in runs[False]]
            unchecked = statistics.median(run[size][0] for run in runs[False])
            cost = statistics.median(on) - statistics.median(off)
            row = {"bytes": size, "ours_checked_us": statistics.median(run[size][0] for run in runs[True]),
                   "raw_checked_us": statistics.median(run[size][1] for run in runs[True]),
                   "ours_unchecked_us": unchecked,
                   "raw_unchecked_us": statistics.median(run[size][1] for run in runs[False]),
                   "check_us": cost, "check_fraction": cost / unchecked}
            rows.append(row)
            print(f"{size:>10}  {row['ours_checked_us']:9.2f} / {row['raw_checked_us']:9.2f}  "
                  f"{row['ours_unchecked_us']:9.2f} / {row['raw_unchecked_us']:9.2f}  "
                  f"{cost:+7.2f} us {100 * cost / unchecked:+6.1f} %")
        document["ops"][op] = {"rows": rows, "runs": {"checked": runs[True], "unchecked": runs[False]}}  # type: ignore[index]
    document["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as file:
            json.dump(document, file, indent=1, default=str)


if __name__ == "__main__":
    main()
