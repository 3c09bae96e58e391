"""Benchmark collectives against the raw transport underneath, nccl-tests style.

For all_reduce, broadcast, all_gather and reduce_scatter over sizes 4 B .. 64 MiB,
each size is timed through ``collectives`` ("ours") and through the raw transport
("raw": mpi4py, torch.distributed or cupy.cuda.nccl) in the same run, interleaved
call by call (ours, raw, raw, ours, ...) so that load on the machine hits both
alike. Every timed call follows a barrier; the time of an iteration is the slowest
rank's; the table shows the median over iterations, the 10th-90th percentile
spread, algbw and busbw in GB/s (nccl-tests' definitions), ours/raw and the
median paired difference in microseconds.

    mpiexec -n 2 python scripts/bench.py                          # MPI backend, numpy arrays
    torchrun --nproc_per_node 2 scripts/bench.py                  # torch backend (Gloo on CPU)
    mpiexec -n 2 python scripts/bench.py --backend torch          # torch backend under mpiexec
    python scripts/bench.py --backend cupy                        # 1 rank, raw cupy.cuda.nccl
    mpiexec -n 2 python scripts/bench.py --json mpi.json --plot mpi.png
    python scripts/bench.py --plot-only mpi.json torch.json --plot docs/bench.png

Sizes follow nccl-tests: for all_gather the size is the gathered (output) size, for
reduce_scatter the input size; both are rounded to whole elements per rank.
busbw = algbw * 2(n-1)/n for all_reduce, * (n-1)/n for all_gather and
reduce_scatter, * 1 for broadcast.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")
THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")


def parse_size(text: str) -> int:
    """'4', '16K', '1M', '64MiB' -> bytes (powers of 1024)."""
    units = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024**2, "MB": 1024**2,
             "MIB": 1024**2, "G": 1024**3, "GB": 1024**3, "GIB": 1024**3}
    text = text.strip().upper()
    number = text.rstrip("KMGIB")
    unit = text[len(number):]
    if not number or unit not in units:
        raise argparse.ArgumentTypeError(f"size {text!r}: use a number with optional K, M or G")
    return int(float(number) * units[unit])


def human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:g} {unit}" if unit == "B" else f"{nbytes:.0f} {unit}"
        nbytes /= 1024
    raise AssertionError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=None,
                   help="collectives backend (default: COLLECTIVES_BACKEND, else auto from the launcher)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {', '.join(OPS)}")
    p.add_argument("--min-bytes", type=parse_size, default=4, help="smallest size (default 4)")
    p.add_argument("--max-bytes", type=parse_size, default=64 * 1024**2, help="largest size (default 64M)")
    p.add_argument("--step-factor", type=int, default=2, help="size multiplier between rows (default 2)")
    p.add_argument("--dtype", default="float32", help="element type (default float32)")
    p.add_argument("--op", default="sum", help="reduce op of all_reduce and reduce_scatter (default sum)")
    p.add_argument("--array", choices=("numpy", "torch", "cupy"), default=None,
                   help="array library (default: numpy for mpi, torch for torch, cupy for cupy)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="torch tensors' device (default: cuda when available for torch, else cpu)")
    p.add_argument("--time-per-size", type=float, default=0.25,
                   help="seconds of timed calls per size, ours and raw together (default 0.25)")
    p.add_argument("--min-iters", type=int, default=8, help="fewest timed calls per size (default 8)")
    p.add_argument("--max-iters", type=int, default=3000, help="most timed calls per size (default 3000)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed calls of each before timing (default: iters/10, 3 to 100)")
    p.add_argument("--no-raw", action="store_true", help="time only collectives, not the raw transport")
    p.add_argument("--thread-level", choices=THREAD_LEVELS, default=None,
                   help="MPI thread level to initialize MPI with (sets mpi4py.rc.thread_level; "
                        "default: what the MPI backend picks)")
    p.add_argument("--poll", default=None, metavar="FAST,SPIN_US",
                   help="MPI backend: wait with this poll policy instead of the backend's (tests before "
                        "the clock is read, microseconds of tests before they yield): for tuning it")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON ('-': stdout)")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a plot of busbw and ours/raw")
    p.add_argument("--plot-only", nargs="+", default=None, metavar="JSON",
                   help="no benchmark: plot these JSON results (several backends in one figure)")
    p.add_argument("--markdown-only", nargs="+", default=None, metavar="JSON",
                   help="no benchmark: print these JSON results as markdown tables")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    args.ops = [name.strip() for name in args.ops.split(",") if name.strip()]
    unknown = [name for name in args.ops if name not in OPS]
    if unknown:
        p.error(f"--ops: unknown {', '.join(unknown)}; valid: {', '.join(OPS)}")
    if args.step_factor < 2:
        p.error("--step-factor must be >= 2")
    if args.plot_only and not args.plot:
        p.error("--plot-only needs --plot PNG")
    return args


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, n = [], max(1, lo)
    while n <= hi:
        out.append(n)
        n *= factor
    return out


BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


# -- arrays of the chosen library -------------------------------------------------------------

class Arrays:
    """Makes and reads arrays of one library, dtype and device."""

    def __init__(self, lib: str, dtype: str, device: str) -> None:
        self.lib, self.dtype_name, self.device = lib, dtype, device
        if lib == "torch":
            import torch  # noqa: PLC0415

            self.mod = torch
            self.dtype = getattr(torch, dtype)
            self.itemsize = torch.empty(0, dtype=self.dtype).element_size()
        elif lib == "cupy":
            import cupy  # noqa: PLC0415

            self.mod = cupy
            self.dtype = _numpy_dtype(dtype)
            self.itemsize = self.dtype.itemsize
        else:
            self.mod = np
            self.dtype = _numpy_dtype(dtype)
            self.itemsize = self.dtype.itemsize

    def full(self, shape: tuple[int, ...], value: float, dtype: Any = None) -> Any:
        dtype = self.dtype if dtype is None else dtype
        if self.lib == "torch":
            return self.mod.full(shape, value, dtype=dtype, device=self.device)
        return self.mod.full(shape, value, dtype=dtype)

    def empty(self, shape: tuple[int, ...]) -> Any:
        if self.lib == "torch":
            return self.mod.empty(shape, dtype=self.dtype, device=self.device)
        return self.mod.empty(shape, dtype=self.dtype)

    def float64(self, values: np.ndarray) -> Any:
        """A float64 array of this library holding ``values`` (for exchanging statistics)."""
        if self.lib == "torch":
            return self.mod.from_numpy(np.ascontiguousarray(values)).to(self.device)
        if self.lib == "cupy":
            return self.mod.asarray(values)
        return np.array(values, dtype=np.float64)

    def to_numpy(self, x: Any) -> np.ndarray:
        if self.lib == "torch":
            x = x.detach().cpu()
            return (x.float() if x.dtype == self.mod.bfloat16 else x).numpy().astype(np.float64)
        if self.lib == "cupy":
            return self.mod.asnumpy(x).astype(np.float64)
        return np.asarray(x, dtype=np.float64)

    def sync(self) -> Callable[[], None] | None:
        """What completes queued device work (None on the host)."""
        if self.lib == "torch" and self.device.startswith("cuda"):
            return self.mod.cuda.synchronize
        if self.lib == "cupy":
            return lambda: self.mod.cuda.get_current_stream().synchronize()
        return None


def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes  # noqa: PLC0415
        except ImportError:
            raise SystemExit("--dtype bfloat16 with numpy/cupy arrays needs ml_dtypes; "
                             "use --array torch") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# -- the raw transports ------------------------------------------------------------------------

class Raw:
    """The same four collectives written directly against the transport.

    ``bind(op, x, out)`` returns the call with everything that can be prepared once
    (buffer specs, datatypes, pointers) prepared: the strictest baseline, what a tuned
    program on the bare transport would run in its loop.
    """

    name = ""

    def bind(self, op: str, x: Any, out: Any = None) -> Callable[[], Any]:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError


class RawMPI(Raw):
    """mpi4py on the communicator's own ``MPI.Comm``: IN_PLACE Allreduce and Bcast,
    Allgather and Reduce_scatter_block into preallocated outputs."""

    name = "mpi4py"

    def __init__(self, comm: Any, op: str) -> None:
        from mpi4py import MPI  # noqa: PLC0415

        self.MPI, self.comm = MPI, comm.mpi_comm
        self._types = {np.dtype(k): getattr(MPI, v) for k, v in (
            ("bool", "C_BOOL"), ("int8", "INT8_T"), ("uint8", "UINT8_T"), ("int16", "INT16_T"),
            ("int32", "INT32_T"), ("int64", "INT64_T"), ("float32", "FLOAT"), ("float64", "DOUBLE"))}
        float16 = getattr(MPI, "FLOAT16_T", MPI.DATATYPE_NULL)  # MPICH >= 4.x: MPIX_C_FLOAT16
        if float16 != MPI.DATATYPE_NULL:
            self._types[np.dtype("float16")] = float16
        self.op = getattr(MPI, {"band": "BAND", "bor": "BOR", "bxor": "BXOR", "prod": "PROD",
                                "min": "MIN", "max": "MAX"}.get(op, "SUM"))

    def _spec(self, x: Any) -> list[Any]:
        mpi_type = self._types.get(np.dtype(x.dtype))
        if mpi_type is None:
            raise SystemExit(f"raw mpi4py has no datatype for {x.dtype}; run with --no-raw")
        return [x, mpi_type]

    def bind(self, op: str, x: Any, out: Any = None) -> Callable[[], Any]:
        comm, mpi_op, IN_PLACE = self.comm, self.op, self.MPI.IN_PLACE
        if not isinstance(x, np.ndarray) and op in ("all_reduce", "broadcast"):
            # A torch CPU tensor: what a raw mpi4py caller writes, its numpy view each call.
            mpi_type = self._spec(x.numpy())[1]
            if op == "all_reduce":
                return lambda: comm.Allreduce(IN_PLACE, [x.numpy(), mpi_type], mpi_op)
            return lambda: comm.Bcast([x.numpy(), mpi_type], 0)
        spec = self._spec(x)
        if op == "all_reduce":
            return lambda: comm.Allreduce(IN_PLACE, spec, mpi_op)
        if op == "broadcast":
            return lambda: comm.Bcast(spec, 0)
        out_spec = self._spec(out)
        if op == "all_gather":
            return lambda: comm.Allgather(spec, out_spec)
        return lambda: comm.Reduce_scatter_block(spec, out_spec, mpi_op)

    def barrier(self) -> None:
        self.comm.Barrier()


class RawTorch(Raw):
    """torch.distributed on the communicator's process group."""

    name = "torch.distributed"

    def __init__(self, comm: Any, op: str) -> None:
        import torch.distributed as dist  # noqa: PLC0415

        self.dist, self.group = dist, comm.process_group
        self.op = getattr(dist.ReduceOp, {"prod": "PRODUCT"}.get(op, op.upper()))
        self.src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self._comm = comm

    def bind(self, op: str, x: Any, out: Any = None) -> Callable[[], Any]:
        dist, group, reduce_op, src = self.dist, self.group, self.op, self.src
        if op == "all_reduce":
            return lambda: dist.all_reduce(x, reduce_op, group)
        if op == "broadcast":
            return lambda: dist.broadcast(x, src, group)
        # the single-tensor forms (torch >= 2.12 names; the older ones are deprecated there)
        if op == "all_gather":
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            return lambda: gather(out, x, group)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(out, x, reduce_op, group)

    def barrier(self) -> None:
        self._comm.barrier()


class RawNccl(Raw):
    """cupy.cuda.nccl.NcclCommunicator on the current CuPy stream."""

    name = "cupy.cuda.nccl"

    def __init__(self, comm: Any, op: str) -> None:
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        self.cupy, self.nccl = cupy, nccl
        self.comm = _nccl_comm_of(comm)
        self.op = getattr(nccl, {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "min": "NCCL_MIN",
                                 "max": "NCCL_MAX", "avg": "NCCL_AVG"}[op])
        self._comm_ours = comm
        self._types = {np.dtype(k): getattr(nccl, v) for k, v in (
            ("int8", "NCCL_INT8"), ("uint8", "NCCL_UINT8"), ("int32", "NCCL_INT32"),
            ("int64", "NCCL_INT64"), ("float16", "NCCL_FLOAT16"), ("float32", "NCCL_FLOAT32"),
            ("float64", "NCCL_FLOAT64"))}

    def bind(self, op: str, x: Any, out: Any = None) -> Callable[[], Any]:
        nc, reduce_op, dtype = self.comm, self.op, self._types[x.dtype]
        stream = self.cupy.cuda.get_current_stream
        ptr, n = x.data.ptr, x.size
        if op == "all_reduce":
            return lambda: nc.allReduce(ptr, ptr, n, dtype, reduce_op, stream().ptr)
        if op == "broadcast":
            return lambda: nc.broadcast(ptr, ptr, n, dtype, 0, stream().ptr)
        out_ptr, out_n = out.data.ptr, out.size
        if op == "all_gather":
            return lambda: nc.allGather(ptr, out_ptr, n, dtype, stream().ptr)
        return lambda: nc.reduceScatter(ptr, out_ptr, out_n, dtype, reduce_op, stream().ptr)

    def barrier(self) -> None:
        self._comm_ours.barrier()


def _nccl_comm_of(comm: Any) -> Any:
    for name in ("nccl_comm", "nccl_communicator", "_nccl_comm", "_comm"):
        found = getattr(comm, name, None)
        if found is not None and hasattr(found, "allReduce"):
            return found
    raise SystemExit(f"cannot find the NcclCommunicator inside {comm!r} for the raw column")


def raw_for(comm: Any, op: str) -> Raw:
    return {"mpi": RawMPI, "torch": RawTorch, "cupy": RawNccl}[comm.backend](comm, op)


# -- measuring ---------------------------------------------------------------------------------

def time_interleaved(fns: list[Callable[[], Any]], iters: int, barrier: Callable[[], None],
                     sync: Callable[[], None] | None) -> np.ndarray:
    """Seconds per call, shape (len(fns), iters): a barrier before every call, and the order
    of the functions reversed every other iteration so neither always goes first."""
    samples = np.empty((len(fns), iters))
    pc = time.perf_counter
    forward = list(range(len(fns)))
    backward = forward[::-1]
    for i in range(iters):
        for j in forward if i % 2 == 0 else backward:
            fn = fns[j]
            barrier()
            t0 = pc()
            fn()
            if sync is not None:
                sync()
            samples[j, i] = pc() - t0
    return samples


def stats(seconds: np.ndarray, nbytes: int, bus: float) -> dict[str, float]:
    us = seconds * 1e6
    p10, q1, median, q3, p90 = np.percentile(us, [10, 25, 50, 75, 90])
    algbw = nbytes / (median * 1e-6) / 1e9
    return {"median_us": float(median), "p10_us": float(p10), "p25_us": float(q1),
            "p75_us": float(q3), "p90_us": float(p90), "min_us": float(us.min()),
            "algbw_GBps": algbw, "busbw_GBps": algbw * bus}


class Case:
    """One collective at one size: its inputs, and the ours/raw calls on them."""

    def __init__(self, op: str, nbytes: int, comm: Any, raw: Raw | None, arr: Arrays,
                 reduce_op: str) -> None:
        n = comm.size
        count = max(1, nbytes // arr.itemsize)
        self.op = op
        if op in ("all_gather", "reduce_scatter"):
            per_rank = max(1, count // n)
            count = per_rank * n
        self.count = count
        self.nbytes = count * arr.itemsize
        self.arr, self.comm, self.raw, self.reduce_op = arr, comm, raw, reduce_op
        # zeros: repeated in-place sums neither overflow nor reach denormals
        if op == "all_reduce":
            self.x_ours, self.x_raw = arr.full((count,), 0), arr.full((count,), 0)
        elif op == "broadcast":
            self.x_ours, self.x_raw = arr.full((count,), 0), arr.full((count,), 0)
        elif op == "all_gather":
            self.x_ours = self.x_raw = arr.full((count // n,), 0)
            self.out_raw = arr.empty((count,))  # flat: what gloo's all_gather_single takes
        else:
            self.x_ours = self.x_raw = arr.full((count,), 0)
            self.out_raw = arr.empty((count // n,))

    def ours(self) -> Callable[[], Any]:
        comm, x, op = self.comm, self.x_ours, self.reduce_op
        return {"all_reduce": lambda: comm.all_reduce(x, op),
                "broadcast": lambda: comm.broadcast(x, 0),
                "all_gather": lambda: comm.all_gather(x),
                "reduce_scatter": lambda: comm.reduce_scatter(x, op)}[self.op]

    def raw_call(self) -> Callable[[], Any]:
        assert self.raw is not None
        return self.raw.bind(self.op, self.x_raw, getattr(self, "out_raw", None))

    def verify(self) -> bool:
        """Run each side once on rank-dependent data and compare with the closed form."""
        arr, comm, n, rank = self.arr, self.comm, self.comm.size, self.comm.rank
        if self.reduce_op != "sum" or arr.dtype_name == "bool":
            return True  # closed form below is for sums of small integers
        total = n * (n + 1) / 2
        ok = True
        for side in ("ours", "raw") if self.raw is not None else ("ours",):
            if self.op == "all_gather":
                x = arr.full((self.count // n,), rank + 1)
                out = comm.all_gather(x) if side == "ours" else self._raw_out(x)
                want = np.repeat(np.arange(1, n + 1, dtype=np.float64)[:, None], self.count // n, 1)
            elif self.op == "reduce_scatter":
                x = arr.full((self.count,), rank + 1)
                out = comm.reduce_scatter(x, "sum") if side == "ours" else self._raw_out(x)
                want = np.full(self.count // n, total)
            else:
                x = arr.full((self.count,), rank + 1)
                if side == "ours":
                    getattr(comm, self.op)(x)
                else:
                    self.raw.bind(self.op, x)()
                out = x
                want = np.full(self.count, total if self.op == "all_reduce" else 1.0)
            ok &= bool(np.array_equal(arr.to_numpy(out).reshape(want.shape), want))
        return ok

    def _raw_out(self, x: Any) -> Any:
        out = self.arr.empty(tuple(self.out_raw.shape))
        self.raw.bind(self.op, x, out)()
        return out


def all_max(comm: Any, arr: Arrays, values: np.ndarray) -> np.ndarray:
    return arr.to_numpy(comm.all_reduce(arr.float64(values), "max"))


def all_gather_np(comm: Any, arr: Arrays, values: np.ndarray) -> np.ndarray:
    return arr.to_numpy(comm.all_gather(arr.float64(values)))


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    comm, arr = case.comm, case.arr
    fns = [case.ours()] + ([case.raw_call()] if case.raw is not None else [])
    barrier = case.raw.barrier if case.raw is not None else comm.barrier
    sync = arr.sync()
    # A few calls to warm caches and estimate the time per call (the slowest rank's).
    probe = time_interleaved(fns, 3, barrier, sync)
    per_iter = float(all_max(comm, arr, np.array([probe.min(axis=1).sum()]))[0])
    iters = int(min(args.max_iters, max(args.min_iters, args.time_per_size / max(per_iter, 1e-7))))
    warmup = args.warmup if args.warmup is not None else min(100, max(3, iters // 10))
    time_interleaved(fns, warmup, barrier, sync)
    samples = time_interleaved(fns, iters, barrier, sync)
    # The time of an iteration is its slowest rank's.
    everyone = all_gather_np(comm, arr, samples.reshape(-1))
    slowest = everyone.reshape(comm.size, len(fns), iters).max(axis=0)
    bus = BUS_FACTOR[case.op](comm.size)
    row: dict[str, Any] = {"op": case.op, "bytes": case.nbytes, "count": case.count,
                           "iters": iters, "ours": stats(slowest[0], case.nbytes, bus)}
    if case.raw is not None:
        row["raw"] = stats(slowest[1], case.nbytes, bus)
        row["ratio"] = row["ours"]["median_us"] / row["raw"]["median_us"]
        row["diff_us"] = float(np.median(slowest[0] - slowest[1]) * 1e6)  # paired: same iteration
    return row


# -- output ------------------------------------------------------------------------------------

class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.start = total, 0, enabled, time.perf_counter()

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{label:<28} {elapsed:5.0f} s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


def table(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    lines = [f"# collectives bench: backend={meta['backend']} ({meta['transport']}), ranks={meta['ranks']}, "
             f"dtype={meta['dtype']}, array={meta['array']}"
             + (f" ({meta['device']})" if meta["array"] == "torch" else "")
             + (f", MPI thread level={meta['thread_level']}" if meta.get("thread_level") else ""),
             f"# raw = {meta['raw']}; time = median over iterations of the slowest rank, "
             "in us; p10-p90 spread; GB/s = 1e9 B/s"]
    has_raw = any("raw" in r for r in doc["results"])
    for op in dict.fromkeys(r["op"] for r in doc["results"]):
        lines.append("")
        head = (f"{op:<15}{'size':>10}{'iters':>6} |{'ours us':>11}{'p10-p90':>21}{'busbw':>8}")
        if has_raw:
            head += f" |{'raw us':>11}{'p10-p90':>21}{'busbw':>8} |{'ours/raw':>9}{'diff us':>11}"
        lines.append(head)
        for r in (r for r in doc["results"] if r["op"] == op):
            o = r["ours"]
            line = (f"{'':<15}{human(r['bytes']):>10}{r['iters']:>6} |{o['median_us']:>11.2f}"
                    f"{_spread(o):>21}{o['busbw_GBps']:>8.3f}")
            if "raw" in r:
                w = r["raw"]
                line += (f" |{w['median_us']:>11.2f}{_spread(w):>21}{w['busbw_GBps']:>8.3f}"
                         f" |{r['ratio']:>9.3f}{r['diff_us']:>+11.2f}")
            lines.append(line)
    return "\n".join(lines)


def markdown(doc: dict[str, Any], ops: list[str] | None = None) -> str:
    """One markdown table per collective: ours and raw median (p10-p90), busbw, ratio."""
    meta = doc["meta"]
    out = [f"**{meta['backend']}** ({meta['transport']}), {meta['ranks']} ranks, {meta['dtype']}, "
           f"{meta['array']} arrays" + (f", thread level {meta['thread_level']}" if meta.get("thread_level") else "")
           + f"; raw = {meta['raw']}; measured {meta['date']}"]
    for op in dict.fromkeys(r["op"] for r in doc["results"]):
        if ops and op not in ops:
            continue
        out += ["", f"`{op}`", "",
                "| size | ours us (p10-p90) | raw us (p10-p90) | ours busbw GB/s | raw busbw GB/s "
                "| ours/raw | diff us |", "|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in doc["results"] if r["op"] == op):
            o, w = r["ours"], r.get("raw")
            if w is None:
                continue
            out.append(f"| {human(r['bytes'])} | {o['median_us']:.2f} ({_spread(o)}) | "
                       f"{w['median_us']:.2f} ({_spread(w)}) | {o['busbw_GBps']:.3f} | "
                       f"{w['busbw_GBps']:.3f} | {r['ratio']:.3f} | {r['diff_us']:+.2f} |")
    return "\n".join(out)


def _spread(s: dict[str, float]) -> str:
    return f"{s['p10_us']:.2f} - {s['p90_us']:.2f}"


def plot(docs: list[dict[str, Any]], path: str) -> None:
    """busbw against size (ours solid, raw dashed) and ours/raw, one column per collective."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ops = [op for op in OPS if any(r["op"] == op for d in docs for r in d["results"])]
    fig, axes = plt.subplots(2, len(ops), figsize=(4.2 * len(ops), 7.5), squeeze=False,
                             sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, doc in enumerate(docs):
        meta, color = doc["meta"], colors[k % len(colors)]
        label = (f"{meta['backend']} ({meta['array']}"
                 + (f" {meta['device']}" if meta["array"] == "torch" else "")
                 + (f", {meta['thread_level']}" if meta.get("thread_level") else "")
                 + (", no timeout" if "timeout_s" in meta and meta["timeout_s"] is None else "")
                 + f", {meta['ranks']} ranks)")
        for col, op in enumerate(ops):
            rows = [r for r in doc["results"] if r["op"] == op]
            if not rows:
                continue
            size = [r["bytes"] for r in rows]
            top, bottom = axes[0][col], axes[1][col]
            top.plot(size, [r["ours"]["busbw_GBps"] for r in rows], "-o", ms=3, color=color,
                     label=f"{label}: collectives")
            if "raw" in rows[0]:
                top.plot(size, [r["raw"]["busbw_GBps"] for r in rows], "--", color=color,
                         label=f"{label}: {meta['raw']}")
                bottom.plot(size, [r["ratio"] for r in rows], "-o", ms=3, color=color, label=label)
    for col, op in enumerate(ops):
        top, bottom = axes[0][col], axes[1][col]
        top.set_title(op)
        top.set_xscale("log", base=2)
        top.set_yscale("log")
        top.grid(True, which="both", alpha=0.3)
        bottom.axhline(1.0, color="black", lw=0.8)
        for level in (1.02, 1.03):
            bottom.axhline(level, color="gray", lw=0.6, ls=":")
        bottom.set_xscale("log", base=2)
        bottom.grid(True, alpha=0.3)
        bottom.set_xlabel("size (bytes)")
    axes[0][0].set_ylabel("busbw (GB/s)")
    axes[1][0].set_ylabel("time ours / raw (median)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(labels))), fontsize=8)
    fig.suptitle("collectives vs the raw transport (busbw: nccl-tests definitions)")
    fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(labels) + 3) // 4), 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- main --------------------------------------------------------------------------------------

def set_poll(spec: str) -> None:
    """Make MPI communicators made from here on wait with ``FAST,SPIN_US``."""
    import dataclasses  # noqa: PLC0415

    from collectives.backends import mpi  # noqa: PLC0415

    fast, spin_us = (float(v) for v in spec.split(","))
    forced = dataclasses.replace(mpi.POLL, fast_polls=int(fast), spin_seconds=spin_us * 1e-6)
    mpi.poll_policy = lambda ranks_on_node: forced


def set_thread_level(level: str | None) -> None:
    if level is None:
        return
    if "mpi4py.MPI" in sys.modules:
        raise SystemExit("--thread-level must be set before MPI is initialized")
    import mpi4py  # noqa: PLC0415

    mpi4py.rc.thread_level = level


def default_array(backend: str) -> str:
    return {"mpi": "numpy", "torch": "torch", "cupy": "cupy"}.get(backend, "numpy")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    set_thread_level(args.thread_level)
    import collectives  # noqa: PLC0415

    if args.poll:
        set_poll(args.poll)
    comm = collectives.init(args.backend)
    if comm.backend == "local":
        raise SystemExit("backend 'local' has no transport to compare with; start the bench "
                         "with mpiexec or torchrun, or pass --backend mpi/torch/cupy")
    lib = args.array or default_array(comm.backend)
    device = args.device
    if device is None:
        device = "cpu"
        if lib == "torch" and comm.backend == "torch":
            import torch  # noqa: PLC0415

            device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    elif device == "cuda":
        import torch  # noqa: PLC0415

        device = f"cuda:{torch.cuda.current_device()}"
    arr = Arrays(lib, args.dtype, device)
    raw = None if args.no_raw else raw_for(comm, args.op)
    meta = describe(comm, arr, raw, args)
    cases = [(op, nbytes) for op in args.ops
             for nbytes in sizes(args.min_bytes, args.max_bytes, args.step_factor)]
    progress = Progress(len(cases), comm.rank == 0 and not args.no_progress)
    results = []
    try:
        for op, nbytes in cases:
            case = Case(op, nbytes, comm, raw, arr, args.op)
            if results and results[-1]["op"] == op and results[-1]["bytes"] == case.nbytes:
                progress.step(f"{op} {human(case.nbytes)}")  # rounded to a size already done
                continue
            ok = all_max(comm, arr, np.array([0.0 if case.verify() else 1.0]))[0] == 0
            if not ok:
                raise SystemExit(f"{op} of {human(case.nbytes)}: wrong result (ours or raw)")
            results.append(run_case(case, args))
            progress.step(f"{op} {human(case.nbytes)}")
            del case
    finally:
        progress.close()
    doc = {"meta": meta, "results": results}
    comm.barrier()
    return doc if comm.rank == 0 else None


def describe(comm: Any, arr: Arrays, raw: Raw | None, args: argparse.Namespace) -> dict[str, Any]:
    import collectives  # noqa: PLC0415
    from collectives.launcher import detect_launcher  # noqa: PLC0415

    meta: dict[str, Any] = {
        "backend": comm.backend, "ranks": comm.size, "dtype": arr.dtype_name, "array": arr.lib,
        "device": arr.device, "reduce_op": args.op, "raw": raw.name if raw else None,
        "launcher": detect_launcher().launcher, "host": platform.node(),
        "cpus": os.cpu_count(), "python": platform.python_version(),
        "numpy": np.__version__, "collectives": getattr(collectives, "__version__", None),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "argv": sys.argv[1:], "time_per_size_s": args.time_per_size,
        "timeout_s": getattr(comm, "timeout", None),
    }
    if comm.backend == "mpi":
        from mpi4py import MPI  # noqa: PLC0415

        meta["transport"] = " ".join(MPI.Get_library_version().splitlines()[0].split())
        meta["thread_level"] = THREAD_LEVELS[MPI.Query_thread()]
        import mpi4py  # noqa: PLC0415

        meta["mpi4py"] = mpi4py.__version__
    elif comm.backend == "torch":
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        group = comm.process_group
        meta["transport"] = f"torch {torch.__version__} {dist.get_backend(group)}"
    else:
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        meta["transport"] = f"cupy {cupy.__version__} NCCL {nccl.get_version()}"
    if arr.lib == "torch":
        import torch  # noqa: PLC0415

        meta["torch"] = torch.__version__
    return meta


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot_only:
        docs = []
        for path in args.plot_only:
            with open(path) as f:
                docs.append(json.load(f))
        plot(docs, args.plot)
        return
    if args.markdown_only:
        for path in args.markdown_only:
            with open(path) as f:
                print(markdown(json.load(f), args.ops if args.ops != list(OPS) else None))
            print()
        return
    doc = run(args)
    if doc is None:
        return
    print(table(doc), flush=True)
    if args.json == "-":
        json.dump(doc, sys.stdout, indent=1)
        print()
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot([doc], args.plot)


if __name__ == "__main__":
    main()
