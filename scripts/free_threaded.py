"""The library on a free-threaded CPython (3.13t, 3.14t): ``make test-free-threaded FT_PYTHON=...``.

    python scripts/free_threaded.py /path/to/python3.13t

A venv of that Python (``build/free-threaded-X.Yt``) gets numpy, mpi4py and the MPICH wheel
from the index and the checkout (its compiled modules built by the machine's C compiler). Then a
2-rank mpiexec job runs the collectives on numpy arrays against numpy's own results, first in the
main thread, then from 4 threads at once, each on a communicator of its own; three times:

- as installed: whether importing the compiled modules turned the GIL back on (a module that does
  not declare it runs without the GIL makes the interpreter enable it, with a RuntimeWarning);
- ``PYTHON_GIL=0``: the GIL stays off whatever the modules declare, the compiled forms without it;
- ``COLLECTIVES_COMPILED=0``: the Python forms, the GIL off.

Each run prints, per rank, the GIL's state at the end and the calls checked; a wrong result or a
run that fails is an error (each job is killed after 300 s).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The job each rank runs (the GIL's state, then the checked calls); make wheels runs it on each wheel too.
JOB = r'''
import sys, threading, warnings
warnings.simplefilter("always")
import numpy as np
import collectives

comm = collectives.init("mpi")
rank, size = comm.rank, comm.size


def check(c, rounds):
    """The collectives on c, each against numpy's result; the number of calls checked."""
    calls = 0
    for i in range(rounds):
        x = np.arange(6, dtype=np.float64) + c.rank + i
        assert np.array_equal(c.all_reduce(x.copy()), sum(np.arange(6.0) + r + i for r in range(c.size)))
        y = np.full(4, c.rank + i, dtype=np.int32)
        assert np.array_equal(c.broadcast(y, src=0), np.full(4, i, dtype=np.int32))
        g = c.all_gather(np.full(3, c.rank, dtype=np.int64))
        assert np.array_equal(g, np.repeat(np.arange(c.size), 3).reshape(c.size, 3))
        rows = np.ones((c.size * 2, 2)) * (c.rank + 1)
        assert np.array_equal(c.reduce_scatter(rows), np.full((2, 2), sum(range(1, c.size + 1)), dtype=float))
        t = c.all_to_all(np.arange(c.size, dtype=np.int32) + 10 * c.rank)
        assert np.array_equal(t, np.arange(c.size, dtype=np.int32) * 10 + c.rank)
        c.barrier()
        calls += 6
    return calls


calls = check(comm, 50)
subs = [comm.split(0) for _ in range(4)]
done = [0] * 4


def work(k):
    subs[k].bind_thread()  # (a communicator takes calls from one thread: this one, from now)
    done[k] = check(subs[k], 50)


threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(timeout=240)
assert all(d == 300 for d in done), done
for sub in subs:
    sub.close()
from collectives.front import is_compiled
gil = sys._is_gil_enabled() if hasattr(sys, "_is_gil_enabled") else True
print(f"rank {rank}: GIL {'on' if gil else 'off'}; call path compiled: {is_compiled(comm)}; "
      f"{calls + sum(done)} calls checked (4 threads at once: {sum(done)})", flush=True)
comm.close()
'''

RUNS = {"as installed": {}, "PYTHON_GIL=0": {"PYTHON_GIL": "0"},
        "COLLECTIVES_COMPILED=0 PYTHON_GIL=0": {"COLLECTIVES_COMPILED": "0", "PYTHON_GIL": "0"}}


def venv_for(python: str) -> Path:
    """The venv of ``python`` with numpy, mpi4py, MPICH and the checkout (made again each time)."""
    version = subprocess.run([python, "-c", "import sys, sysconfig; print('%d.%d' % sys.version_info[:2] + "
                              "('t' if sysconfig.get_config_var('Py_GIL_DISABLED') else ''))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    if not version.endswith("t"):
        raise SystemExit(f"free_threaded: {python} is not a free-threaded build (Python {version})")
    venv = ROOT / "build" / f"free-threaded-{version}"
    subprocess.run([python, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    # (binary wheels only: the newest release that has one for this Python, not a build of numpy)
    subprocess.run([*pip, "--only-binary", ":all:", "numpy", "mpi4py", "mpich"], check=True)
    # (not editable, from a clean build: the compiled modules are the ones of this Python)
    subprocess.run([*pip, "--no-cache-dir", "--force-reinstall", "--no-deps", str(ROOT)], check=True)
    return venv


def main(argv: list[str] | None = None) -> int:
    [python] = argv if argv is not None else sys.argv[1:]
    venv = venv_for(python)
    failed = 0
    for name, extra in RUNS.items():
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHON_GIL", "COLLECTIVES_COMPILED")}
        done = subprocess.run([str(venv / "bin" / "mpiexec"), "-n", "2", str(venv / "bin" / "python"), "-c", JOB],
                              env={**env, **extra}, capture_output=True, text=True, timeout=300, cwd=venv)
        print(f"--- {name}: exit {done.returncode}")
        print(done.stdout.strip())
        warnings = sorted({line.strip() for line in done.stderr.splitlines() if "Warning" in line})
        for line in warnings:
            print(f"  {line}")
        if done.returncode != 0:
            print(done.stderr[-3000:])
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
