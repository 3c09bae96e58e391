"""Host instructions per call on the cupy route, counted by valgrind's callgrind: ours against raw
``NcclCommunicator.allReduce`` in the same process, with CuPy's CUDA and NCCL stubbed out
(collectives.testing.fake_cupy: every NCCL call returns at once, every event is complete), so what
is counted is our Python in front of the NCCL call. A count, not a time. The pools of completed
events and the watch's free entries are filled before each loop (the steady state of a program
whose watchdog has given its events and entries back) and the heap made before the loops is frozen
(``gc.freeze``), so that neither the watchdog's timing nor a full collection falling into one loop
moves the counts.

    python scripts/bench/host_cost_cupy.py                  # defaults, then COLLECTIVES_TIMEOUT=0
    python scripts/bench/host_cost_cupy.py --json docs/bench/host-cost-cupy.json
    python scripts/bench/host_cost_cupy.py --world 2        # the check posted beside each call, then none
    python scripts/bench/host_cost_cupy.py --keep /tmp/cg     # keep callgrind's files
    callgrind_annotate --inclusive=yes /tmp/cg/defaults/cupy.*.3   # where one loop's instructions go

Cases (4 KiB float32 arrays, world size 1): all_reduce of a CuPy array and of a torch tensor (the
torch tensor a CPU one taken for CUDA memory on device 0: its is_cuda and get_device() and torch's
CUDA stream calls are stubbed too), async all_reduce + wait, broadcast; raw: ``comm.allReduce(ptr,
ptr, n, ncclFloat32, ncclSum, stream.ptr)`` with the pointer, count and stream read per call as
cupyx.distributed does. The loops
and their subtraction are scripts/bench/host_cost.py's; ``--keep DIR`` keeps callgrind's files, one
per loop under DIR/<setting>/ (numbered in order: the no-op loop, raw, then the cases above), for
``callgrind_annotate``.

``--world 2``: the communicator at world size 2, where the default check of each call is posted
beside it (backends/posted_checks.py), against ``COLLECTIVES_DEBUG=0`` (no check). Its peer is a
stand-in that makes the same calls (:class:`_AgreeingPeer`: the check's rounds on the CPU channel
complete at once, every rank's word the same), as torch's fake process group stands in for the
peers in scripts/bench/host_cost.py; the NCCL calls are the one-rank stub's. What the watchdog
thread does with the posted words is not counted (callgrind counts the calling thread's loops).
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
from typing import Any

from host_cost import _total, run_loops

SETTINGS = {"defaults": {}, "COLLECTIVES_TIMEOUT=0": {"COLLECTIVES_TIMEOUT": "0"}}
#: The settings at world size 2: the check posted beside each call, and no check.
WORLD_SETTINGS = {"defaults": {}, "COLLECTIVES_DEBUG=0": {"COLLECTIVES_DEBUG": "0"}}
RAW = "raw.allReduce(x.data.ptr, x.data.ptr, x.size, 7, 0, cupy.cuda.get_current_stream().ptr)"
CASES = [
    ("all_reduce (CuPy array)", "comm.all_reduce(x)"),
    ("all_reduce async + wait", "comm.all_reduce(x, async_op=True).wait()"),
    ("broadcast", "comm.broadcast(x, 0)"),
    ("all_reduce (torch tensor)", "comm.all_reduce(t)"),
]
ELEMENTS = 1024  # 4 KiB of float32


class _AgreeingPeer:
    """The cupy transport's CPU channel (backends/cupy_host.py's MPIHost) with a peer that makes the
    same calls: every round completes at once, a MIN leaves the words as they are, an all_gather
    puts this rank's row in every row."""

    def __init__(self) -> None:
        import types

        self.rounds = self
        self._done = types.SimpleNamespace(is_completed=lambda: True, wait=lambda: None, Test=lambda: True,
                                           Wait=lambda: None)

    def least(self, words: object) -> object:
        return self._done

    def gather(self, mine: object, everyone: object) -> object:
        everyone[:] = mine  # type: ignore[index]
        return self._done

    def agree(self, word: int) -> tuple[object, object]:
        import numpy as np

        return np.array([word], dtype=np.int64), self._done

    def free(self) -> None:
        pass


def child(calls: int, world: int = 1) -> None:
    """Run under callgrind: set up, warm every call, then one reduce loop per statement."""
    import functools
    import gc
    import operator
    import types

    import numpy as np
    import torch
    from collectives.backends.cupy_nccl import CupyNcclCommunicator

    from collectives import arrays
    from collectives.testing import fake_cupy

    stream = types.SimpleNamespace(cuda_stream=0, wait_event=lambda event: None)
    torch.cuda.current_stream = lambda device=None: stream  # torch's CUDA, stubbed as CuPy's is
    torch.cuda.Event = lambda: fake_cupy.Event()
    # Every tensor a CUDA tensor on device 0, read in C as torch's own properties are: is_cuda is
    # `None is not t`, get_device() is int(), 0.
    torch.Tensor.is_cuda = property(functools.partial(operator.is_not, None))
    torch.Tensor.get_device = int
    type(arrays.TORCH).is_cuda = lambda self, x: True
    type(arrays.TORCH).device_index = lambda self, x: 0
    with fake_cupy.installed():
        import cupy

        raw = cupy.cuda.nccl.NcclCommunicator(1, None, 0)
        if world == 1:
            comm = CupyNcclCommunicator(cupy.cuda.nccl.NcclCommunicator(1, None, 0), 0, 1, 0, 0)
        else:
            from collectives.backends.cupy_nccl import CupyNcclTransport

            transport = CupyNcclTransport(cupy.cuda.nccl.NcclCommunicator(1, None, 0), 0, world, 0, 0,
                                          _AgreeingPeer())  # type: ignore[arg-type]
            # (the first collective's fingerprints, every rank's the same)
            transport._exchange_small = lambda vector: np.stack([vector] * world)  # type: ignore[method-assign]
            comm = CupyNcclCommunicator._adopt(transport)
        for logged in (raw, comm.nccl_comm):
            logged.arguments = _Forgetful()
        # The steady state of the events: a program's pools hold as many completed events as its
        # calls in flight within one look of the watchdog; here they hold one per call counted, so
        # that when the watchdog thread runs (valgrind's scheduling) does not change the counts.
        for adapter in (arrays.CUPY, arrays.TORCH):
            library = comm._transport._library(adapter)
            library.pool.extend(library.new_event() for _ in range((calls + 50) * (len(CASES) + 1)))
        names = {"cupy": cupy, "raw": raw, "comm": comm, "x": cupy.asarray(np.ones(ELEMENTS, np.float32)),
                 "t": torch.ones(ELEMENTS)}
        # The heap so far (torch's modules) out of the collector's way: a full collection that
        # falls into one loop would add its walk of that heap to that loop's count alone.
        gc.collect()
        gc.freeze()
        run_loops([RAW] + [ours for _, ours in CASES], names, calls,
                  before_loop=functools.partial(_steady_watch, comm, calls))
        comm.close()


def _steady_watch(comm: Any, calls: int) -> None:
    """Before each loop, a program's steady state: the watch of the calls in flight with every call
    so far given back by the watchdog (its entry to the watch's free entries, its pooled event to
    its pool) and free entries for a loop's calls (a program's watch holds what it has had in
    flight within one look), the flight recorder's ring full (each call's record then replaces the
    oldest), then the heap frozen again, as before the first loop: when the watchdog thread runs
    (valgrind's scheduling) does not change the counts."""
    import gc

    ring = comm._path.ring
    if ring is not None and ring:
        ring.extend(list(ring[-1]) for _ in range(ring.maxlen - len(ring)))
    watch = comm._transport._stream_watch
    if watch is not None:
        with watch._lock:
            for entry in watch._inflight:
                if entry[-1]:  # (pooled)
                    entry[0].pool.append(entry[1])
                watch._free.append(entry)
            watch._inflight.clear()
            watch._free.extend([None] * 6 for _ in range(calls + 50 - len(watch._free)))
    gc.collect()
    gc.freeze()


class _Forgetful(list):  # type: ignore[type-arg]
    """The fake communicator's call log, kept empty (the loops make millions of calls)."""

    def append(self, item: object) -> None:
        pass


def count(setting: dict[str, str], calls: int, keep: str | None = None, world: int = 1) -> list[float]:
    """Instructions per call of raw, then of every case, in order; callgrind's files go to
    ``keep`` where given."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = scratch if keep is None else keep
        os.makedirs(folder, exist_ok=True)
        env = dict(os.environ, **setting, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        out = os.path.join(folder, "cupy.%p")
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
             "--dump-after=functools_reduce", f"--callgrind-out-file={out}", sys.executable, __file__,
             "--child", "--calls", str(calls), "--world", str(world)], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True)
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
    parser.add_argument("--world", type=int, choices=(1, 2), default=1,
                        help="2: the check posted beside each call, then COLLECTIVES_DEBUG=0")
    parser.add_argument("--json", help="write the counts here")
    parser.add_argument("--keep", help="keep callgrind's files under KEEP/<setting>/")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.calls, args.world)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("host_cost_cupy: needs valgrind (apt-get install valgrind)")
    results = {}
    for name, setting in (SETTINGS if args.world == 1 else WORLD_SETTINGS).items():
        keep = None if args.keep is None else os.path.join(args.keep, name.replace("=", "_"))
        raw, *ours = count(setting, args.calls, keep, args.world)
        results[name] = {"raw allReduce": raw, **{case: value for (case, _), value in zip(CASES, ours)}}
        print(f"\n{name}: instructions a call (4 KiB float32, CuPy stubbed, world size {args.world})")
        print(f"{'call':<28} {'ours':>9} {'ours - raw':>11}")
        print(f"{'raw allReduce':<28} {raw / 1e3:8.1f}k")
        for (case, _), value in zip(CASES, ours):
            print(f"{case:<28} {value / 1e3:8.1f}k {(value - raw) / 1e3:+10.1f}k")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"command": " ".join(["python", "scripts/bench/host_cost_cupy.py", *sys.argv[1:]]),
                       "calls": args.calls, "world": args.world, "results": results}, file, indent=1)
            file.write("\n")


if __name__ == "__main__":
    main()
