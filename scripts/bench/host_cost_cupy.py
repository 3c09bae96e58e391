"""Host instructions per call on the cupy route, counted by valgrind's callgrind: ours against raw
``NcclCommunicator.allReduce`` in the same process, with CuPy's CUDA and NCCL stubbed out
(collectives.testing.fake_cupy: every NCCL call returns at once, every event is complete), so what
is counted is our Python in front of the NCCL call. A count, not a time.

    python scripts/bench/host_cost_cupy.py                  # defaults, then COLLECTIVES_TIMEOUT=0
    python scripts/bench/host_cost_cupy.py --json docs/bench/host-cost-cupy.json

Cases (4 KiB float32 arrays, world size 1): all_reduce of a CuPy array and of a torch tensor (the
torch tensor a CPU one taken for CUDA memory: torch's CUDA stream calls are stubbed too),
async all_reduce + wait, broadcast; raw: ``comm.allReduce(ptr, ptr, n, ncclFloat32, ncclSum,
stream.ptr)`` with the pointer, count and stream read per call as cupyx.distributed does. The loops
and their subtraction are scripts/bench/host_cost.py's.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

from host_cost import _total, run_loops

SETTINGS = {"defaults": {}, "COLLECTIVES_TIMEOUT=0": {"COLLECTIVES_TIMEOUT": "0"}}
RAW = "raw.allReduce(x.data.ptr, x.data.ptr, x.size, 7, 0, cupy.cuda.get_current_stream().ptr)"
CASES = [
    ("all_reduce (CuPy array)", "comm.all_reduce(x)"),
    ("all_reduce async + wait", "comm.all_reduce(x, async_op=True).wait()"),
    ("broadcast", "comm.broadcast(x, 0)"),
    ("all_reduce (torch tensor)", "comm.all_reduce(t)"),
]
ELEMENTS = 1024  # 4 KiB of float32


def child(calls: int) -> None:
    """Run under callgrind: set up, warm every call, then one reduce loop per statement."""
    import types

    import numpy as np
    import torch
    from collectives.backends.cupy_nccl import CupyNcclCommunicator

    from collectives import arrays
    from collectives.testing import fake_cupy

    stream = types.SimpleNamespace(cuda_stream=0, wait_event=lambda event: None)
    torch.cuda.current_stream = lambda device=None: stream  # torch's CUDA, stubbed as CuPy's is
    torch.cuda.Event = lambda: fake_cupy.Event()
    type(arrays.TORCH).is_cuda = lambda self, x: True
    type(arrays.TORCH).device_index = lambda self, x: 0
    with fake_cupy.installed():
        import cupy

        raw = cupy.cuda.nccl.NcclCommunicator(1, None, 0)
        comm = CupyNcclCommunicator(cupy.cuda.nccl.NcclCommunicator(1, None, 0), 0, 1, 0, 0)
        for logged in (raw, comm.nccl_comm):
            logged.calls, logged.reductions = _Forgetful(), _Forgetful()
        names = {"cupy": cupy, "raw": raw, "comm": comm, "x": cupy.asarray(np.ones(ELEMENTS, np.float32)),
                 "t": torch.ones(ELEMENTS)}
        run_loops([RAW] + [ours for _, ours in CASES], names, calls)
        comm.close()


class _Forgetful(list):  # type: ignore[type-arg]
    """The fake communicator's call log, kept empty (the loops make millions of calls)."""

    def append(self, item: object) -> None:
        pass


def count(setting: dict[str, str], calls: int) -> list[float]:
    """Instructions per call of raw, then of every case, in order."""
    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, **setting, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        out = os.path.join(folder, "cupy.%p")
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
             "--dump-after=functools_reduce", f"--callgrind-out-file={out}", sys.executable, __file__,
             "--child", "--calls", str(calls)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        if proc.returncode:
            raise SystemExit(f"host_cost_cupy: the child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        dumps = sorted(glob.glob(os.path.join(folder, "cupy.*.*")), key=lambda p: int(p.rsplit(".", 1)[1]))
        totals = [_total(p) for p in dumps]
    loops = 2 + len(CASES)  # the no-op loop, raw, ours per case
    if len(totals) < loops:
        raise SystemExit(f"host_cost_cupy: {len(totals)} loops counted, {loops} expected")
    totals = totals[-loops:]
    return [(total - totals[0]) / calls for total in totals[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.calls)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("host_cost_cupy: needs valgrind (apt-get install valgrind)")
    results = {}
    for name, setting in SETTINGS.items():
        raw, *ours = count(setting, args.calls)
        results[name] = {"raw allReduce": raw, **{case: value for (case, _), value in zip(CASES, ours)}}
        print(f"\n{name}: instructions a call (4 KiB float32, CuPy stubbed, world size 1)")
        print(f"{'call':<28} {'ours':>9} {'ours - raw':>11}")
        print(f"{'raw allReduce':<28} {raw / 1e3:8.1f}k")
        for (case, _), value in zip(CASES, ours):
            print(f"{case:<28} {value / 1e3:8.1f}k {(value - raw) / 1e3:+10.1f}k")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"command": " ".join(["python", "scripts/bench/host_cost_cupy.py", *sys.argv[1:]]),
                       "calls": args.calls, "results": results}, file, indent=1)
            file.write("\n")


if __name__ == "__main__":
    main()
