"""``collectives-bench``: the command line, the run over sizes, the table, --json and --plot."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import numpy as np

from collectives import config

from .cases import OPS, REDUCING, ROOTED, Arrays, Case, bus_factor, stats, time_interleaved
from .raw import Raw, raw_for

EPILOG = """\
examples:
  collectives-bench all_reduce                               # no launcher: the local backend, 1 rank
  mpiexec -n 2 collectives-bench all_reduce --raw --check    # mpi, against raw mpi4py in the same run
  torchrun --nproc_per_node 2 -m collectives.bench all -e 1M  # torch (Gloo on CPU, NCCL on GPU)
  COLLECTIVES_BACKEND=cupy mpiexec -n 2 collectives-bench all_reduce -b 8 -e 128M --raw

time: median over iterations of the slowest rank's time, a barrier before every call; with --raw
the raw transport's call runs in the same loop, interleaved (ours, raw, raw, ours, ...), and where
the default check makes a round, "raw+round": the raw call after the transport's 8-byte all_reduce.
algbw = size / time; busbw = algbw x nccl-tests' factor (all_reduce 2(n-1)/n; all_gather,
all_gather_v, reduce_scatter, gather, scatter, all_to_all, all_to_all_v (n-1)/n; others 1).
send_recv is a ping-pong between ranks 0 and 1: time is one round trip.
"""


def parse_size(text: str) -> int:
    """'4', '16K', '1M', '64MiB' -> bytes (powers of 1024)."""
    units = {"": 1, "B": 1, "K": 1024, "KB": 1024, "KIB": 1024, "M": 1024**2, "MB": 1024**2,
             "MIB": 1024**2, "G": 1024**3, "GB": 1024**3, "GIB": 1024**3}
    text = text.strip().upper()
    number = text.rstrip("KMGIB")
    unit = text[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value < 0:
        raise argparse.ArgumentTypeError(f"size {text!r}: use a number of bytes with optional K, M or G")
    return int(value * units[unit])


def sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, n = [], max(1, lo)
    while n <= hi:
        out.append(n)
        n *= factor
    return out


def parser() -> argparse.ArgumentParser:
    from collectives.ops import DTYPES, ReduceOp  # noqa: PLC0415

    p = argparse.ArgumentParser(
        prog="collectives-bench", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Time a collective through collectives over a range of sizes, nccl-tests style, "
                    "optionally against the raw transport in the same run.")
    p.add_argument("op", nargs="?", choices=(*OPS, "all"), metavar="OP",
                   help=f"one of {', '.join(OPS)}, or all")
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"), help="smallest size (default 8)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("32M"), help="largest size (default 32M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2, help="size multiplier between rows (default 2)")
    p.add_argument("-d", "--datatype", default="float32", choices=DTYPES, metavar="DTYPE",
                   help=f"element type: {', '.join(DTYPES)} (default float32)")
    p.add_argument("-o", "--op", dest="redop", default="sum", choices=[o.value for o in ReduceOp],
                   metavar="REDOP", help="reduce op of all_reduce, reduce, reduce_scatter: "
                   + ", ".join(o.value for o in ReduceOp) + " (default sum)")
    p.add_argument("-r", "--root", type=int, default=0, help="root of broadcast, reduce, gather, scatter (default 0)")
    p.add_argument("-n", "--iters", type=int, default=None,
                   help="timed calls per size (default: as many as fit in --time-per-size, 8 to 3000)")
    p.add_argument("-w", "--warmup_iters", dest="warmup", type=int, default=None,
                   help="untimed calls per size first (default: iters/10, 3 to 100)")
    p.add_argument("-t", "--time-per-size", type=float, default=0.25,
                   help="seconds of timed calls per size when -n is not given (default 0.25)")
    p.add_argument("-c", "--check", action="store_true",
                   help="run each size once on known data and count wrong elements (#wrong)")
    p.add_argument("--raw", action="store_true",
                   help="also time the raw transport's call (mpi4py, torch.distributed, cupy.cuda.nccl), and "
                        "where the default check makes a round the raw call after one small round")
    p.add_argument("--backend", default=None,
                   help="collectives backend (default: COLLECTIVES_BACKEND, else auto from the launcher)")
    p.add_argument("--array", choices=("numpy", "torch", "cupy"), default=None,
                   help="array library (default: torch on the torch backend, cupy on cupy, else numpy)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="torch tensors' device (default: cuda where the torch backend has one)")
    p.add_argument("--thread-level", choices=("single", "funneled", "serialized", "multiple"), default=None,
                   help="MPI thread level to initialize MPI with (mpi4py.rc.thread_level)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON ('-': stdout)")
    p.add_argument("--plot", default=None, metavar="FILE", help="write a PNG of busbw (and ours/raw) against size")
    p.add_argument("--plot-only", nargs="+", default=None, metavar="JSON",
                   help="no benchmark: plot these --json results in one figure (needs --plot)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.plot_only:
        if not args.plot:
            p.error("--plot-only needs --plot FILE")
        return args
    if args.op is None:
        p.error("OP is required: " + ", ".join(OPS) + " or all")
    if args.stepfactor < 2:
        p.error(f"-f/--stepfactor must be >= 2; got {args.stepfactor}")
    if args.minbytes > args.maxbytes:
        p.error(f"-b/--minbytes {args.minbytes} is above -e/--maxbytes {args.maxbytes}")
    for name in ("iters", "warmup"):
        if getattr(args, name) is not None and getattr(args, name) < (1 if name == "iters" else 0):
            p.error(f"--{name} must be >= {1 if name == 'iters' else 0}")
    from collectives.ops import ALLOWED_OPS, ReduceOp  # noqa: PLC0415

    ops = OPS if args.op == "all" else (args.op,)
    if any(op in REDUCING for op in ops) and ReduceOp(args.redop) not in ALLOWED_OPS[args.datatype]:
        allowed = ", ".join(o.value for o in ReduceOp if o in ALLOWED_OPS[args.datatype])
        p.error(f"-o {args.redop} is not allowed on -d {args.datatype}; allowed: {allowed}")
    args.ops = list(ops)
    return args


# -- the run -----------------------------------------------------------------------------------

def run(args: argparse.Namespace, comm: Any = None, out: Any = None) -> dict[str, Any] | None:
    """Benchmark ``args.ops`` on ``comm`` (default: ``collectives.init(args.backend)``), printing
    the table on rank 0 as rows complete. Returns the results on rank 0, None elsewhere."""
    if comm is None:
        if args.thread_level is not None:
            import mpi4py  # noqa: PLC0415

            mpi4py.rc.thread_level = args.thread_level
        import collectives  # noqa: PLC0415

        comm = collectives.init(args.backend)
    if not 0 <= args.root < comm.size:
        sys.exit(f"collectives-bench: -r/--root {args.root} is out of range; valid: 0 to {comm.size - 1}")
    arr = arrays_for(comm, args)
    raw = raw_for(comm)
    if args.raw and raw is None:
        sys.exit(f"collectives-bench: --raw: the {comm.backend} backend has no transport to compare "
                         "with; start it with mpiexec or torchrun, or pass --backend mpi/torch/cupy")
    barrier = raw.barrier if raw is not None else comm.barrier
    sync = arr.sync()
    out = out if out is not None else sys.stdout
    lead = comm.rank == 0
    meta = describe(comm, arr, raw if args.raw else None, args)
    # "raw+round": the raw call after one small round, the default check's price (on where it is)
    rounds = args.raw and comm.size > 1 and config.check_level() != config.CHECKS_OFF
    meta["raw_round"] = rounds
    if lead:
        print(header(meta), file=out, flush=True)
    results = []
    for op in args.ops:
        if lead:
            print(columns(op, args.check, args.raw, rounds), file=out, flush=True)
        done: set[int] = set()
        for nbytes in [0] if op == "barrier" else sizes(args.minbytes, args.maxbytes, args.stepfactor):
            case = Case(op, nbytes, comm, arr, args.redop, args.root)
            if case.nbytes in done:
                continue  # rounded to a size already done
            done.add(case.nbytes)
            row = measure(case, raw if args.raw else None, barrier, sync, args, rounds)
            if row is None:
                if lead:
                    print(f"# {op}: needs at least 2 ranks; skipped", file=out, flush=True)
                break
            results.append(row)
            if lead:
                print(format_row(row), file=out, flush=True)
    comm.barrier()
    return {"meta": meta, "results": results} if lead else None


def arrays_for(comm: Any, args: argparse.Namespace) -> Arrays:
    lib = args.array or {"torch": "torch", "cupy": "cupy"}.get(comm.backend, "numpy")
    device = args.device or "cpu"
    if lib == "torch" and (device == "cuda" or (args.device is None and comm.backend == "torch")):
        import torch  # noqa: PLC0415

        if device == "cuda" or torch.cuda.is_available():
            device = f"cuda:{torch.cuda.current_device()}"
    return Arrays(lib, args.datatype, device)


def measure(case: Case, raw: Raw | None, barrier: Any, sync: Any,
            args: argparse.Namespace, rounds: bool = False) -> dict[str, Any] | None:
    comm, arr = case.comm, case.arr
    ours = case.ours()
    if ours is None:
        return None
    wrong = None
    if args.check:
        wrong = int(total(comm, arr, float(case.wrong()), "sum"))
    fns = [ours]
    raw_call = case.raw(raw) if raw is not None else None
    raw_wrong = None
    if args.check and raw_call is not None:  # the baseline is checked too (JSON: raw_wrong)
        raw_wrong = int(total(comm, arr, float(case.wrong(raw)), "sum"))
    if raw_call is not None:
        fns.append(raw_call)
    round_call = case.raw_round(raw, raw_call) if rounds and raw_call is not None else None
    if round_call is not None:
        fns.append(round_call)
    iters = args.iters
    if iters is None:  # as many as fit in --time-per-size, from a few probes (the slowest rank's)
        probe = time_interleaved(fns, 3, barrier, sync)
        per_iter = total(comm, arr, float(probe.min(axis=1).sum()), "max")
        iters = int(min(3000, max(8, args.time_per_size / max(per_iter, 1e-7))))
    warmup = args.warmup if args.warmup is not None else min(100, max(3, iters // 10))
    time_interleaved(fns, warmup, barrier, sync)
    samples = time_interleaved(fns, iters, barrier, sync)
    # The time of an iteration is its slowest rank's.
    everyone = arr.to_numpy(comm.all_gather(arr.float64(samples.reshape(-1))))
    slowest = everyone.reshape(comm.size, len(fns), iters).max(axis=0)
    bus = bus_factor(case.op, comm.size)
    row: dict[str, Any] = {
        "op": case.op, "bytes": case.nbytes, "count": case.count, "type": arr.dtype_name,
        "redop": case.redop if case.op in REDUCING else "none",
        "root": case.root if case.op in ROOTED else -1, "iters": iters, "warmup": warmup,
        "ours": stats(slowest[0], case.nbytes, bus)}
    if wrong is not None:
        row["wrong"] = wrong
    if raw is not None:
        row["raw"] = stats(slowest[1], case.nbytes, bus) if raw_call is not None else None
        if raw_call is not None:
            row["ratio"] = row["ours"]["median_us"] / row["raw"]["median_us"]
            if raw_wrong is not None:
                row["raw_wrong"] = raw_wrong
            row["diff_us"] = float(np.median(slowest[0] - slowest[1]) * 1e6)  # paired: same iteration
        if rounds:
            row["raw_round"] = stats(slowest[2], case.nbytes, bus) if round_call is not None else None
            if round_call is not None:
                row["ratio_round"] = row["ours"]["median_us"] / row["raw_round"]["median_us"]
    return row


def total(comm: Any, arr: Arrays, value: float, op: str) -> float:
    """``value`` reduced over the ranks (float64 of the bench's array library)."""
    return float(arr.to_numpy(comm.all_reduce(arr.float64(np.array([value])), op))[0])


# -- output ------------------------------------------------------------------------------------

def header(meta: dict[str, Any]) -> str:
    lines = [f"# collectives-bench: backend {meta['backend']} ({meta['transport']}), {meta['ranks']} ranks, "
             f"{meta['array']} arrays" + (f" on {meta['device']}" if meta["array"] == "torch" else "")
             + (f", MPI thread level {meta['thread_level']}" if meta.get("thread_level") else "")]
    if meta.get("raw"):
        lines.append(f"# raw: {meta['raw']} in the same run, interleaved")
    if meta.get("raw_round"):
        lines.append("# raw+round: the raw call after one small round (an 8-byte all_reduce of the transport): "
                     "the price of the default check")
    lines.append("# time: median over iterations of the slowest rank (us); algbw, busbw: GB/s (nccl-tests)")
    return "\n".join(lines)


def columns(op: str, check: bool, raw: bool, rounds: bool = False) -> str:
    top = (f"#{'':>11}{'':>14}{'':>10}{'':>8}{'':>8}{'':>9}{'':>8}{'':>8}" + (f"{'':>7}" if check else "")
           + (f"{'raw':>10}{'raw':>8}{'ours/':>9}" if raw else "")
           + (f"{'raw+':>10}{'ours/':>9}" if rounds else ""))
    names = (f"#{'size':>11}{'count':>14}{'type':>10}{'redop':>8}{'root':>8}{'time':>9}{'algbw':>8}"
             f"{'busbw':>8}" + (f"{'#wrong':>7}" if check else "")
             + (f"{'time':>10}{'busbw':>8}{'raw':>9}" if raw else "")
             + (f"{'round':>10}{'raw+rnd':>9}" if rounds else ""))
    units = (f"#{'(B)':>11}{'(elements)':>14}{'':>10}{'':>8}{'':>8}{'(us)':>9}{'(GB/s)':>8}{'(GB/s)':>8}"
             + (f"{'':>7}" if check else "") + (f"{'(us)':>10}{'(GB/s)':>8}{'':>9}" if raw else "")
             + (f"{'(us)':>10}" if rounds else ""))
    return "\n".join([f"# {op}", top.rstrip(), names, units.rstrip()])


def format_row(row: dict[str, Any]) -> str:
    o = row["ours"]
    line = (f"{row['bytes']:>12}{row['count']:>14}{row['type']:>10}{row['redop']:>8}{row['root']:>8}"
            f"{o['median_us']:>9.2f}{o['algbw_GBps']:>8.3f}{o['busbw_GBps']:>8.3f}")
    if "wrong" in row:
        line += f"{row['wrong']:>7}"
    if "raw" in row:
        w = row["raw"]
        line += (f"{w['median_us']:>10.2f}{w['busbw_GBps']:>8.3f}{row['ratio']:>9.3f}" if w is not None
                 else f"{'-':>10}{'-':>8}{'-':>9}")
    if "raw_round" in row:
        w = row["raw_round"]
        line += f"{w['median_us']:>10.2f}{row['ratio_round']:>9.3f}" if w is not None else f"{'-':>10}{'-':>9}"
    return line


def parse_table(text: str) -> list[dict[str, Any]]:
    """The rows of a printed table (comment lines skipped): what a script reads back."""
    rows = []
    op = ""
    for line in text.splitlines():
        if line.startswith("# ") and line[2:].strip() in OPS:
            op = line[2:].strip()
        if not line.strip() or line.startswith("#"):
            continue
        f = line.split()
        row: dict[str, Any] = {"op": op, "bytes": int(f[0]), "count": int(f[1]), "type": f[2], "redop": f[3],
                               "root": int(f[4]), "time_us": float(f[5]), "algbw": float(f[6]),
                               "busbw": float(f[7])}
        rest = f[8:]
        if len(rest) in (1, 4, 6):  # (#wrong; raw: 3 columns; raw+round: 2 more)
            row["wrong"] = int(rest[0])
            rest = rest[1:]
        if len(rest) == 5:
            row["round_time_us"], row["ratio_round"] = (None if v == "-" else float(v) for v in rest[3:])
            rest = rest[:3]
        if rest:
            row["raw_time_us"], row["raw_busbw"], row["ratio"] = (None if v == "-" else float(v) for v in rest)
        rows.append(row)
    return rows


def describe(comm: Any, arr: Arrays, raw: Raw | None, args: argparse.Namespace) -> dict[str, Any]:
    import collectives  # noqa: PLC0415
    from collectives.launcher import detect_launcher  # noqa: PLC0415

    meta: dict[str, Any] = {
        "backend": comm.backend, "ranks": comm.size, "dtype": arr.dtype_name, "array": arr.lib,
        "device": arr.device, "reduce_op": args.redop, "raw": raw.name if raw else None,
        "launcher": detect_launcher().launcher, "host": platform.node(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "numpy": np.__version__, "collectives": collectives.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "argv": sys.argv[1:],
        "timeout_s": getattr(comm, "timeout", None), "transport": comm.backend,
    }
    if comm.backend == "mpi":
        import mpi4py  # noqa: PLC0415
        from mpi4py import MPI  # noqa: PLC0415

        from collectives.backends.mpi_library import library_version  # noqa: PLC0415

        meta["transport"] = " ".join(library_version(MPI).split()[:3])
        meta["thread_level"] = ("single", "funneled", "serialized", "multiple")[MPI.Query_thread()]
        meta["mpi4py"] = mpi4py.__version__
    elif comm.backend == "torch":
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        meta["transport"] = f"torch {torch.__version__} {dist.get_backend(comm.process_group)}"
    elif comm.backend == "cupy":
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        meta["transport"] = f"cupy {cupy.__version__} NCCL {nccl.get_version()}"
    return meta


#: Collectives per row of the plot's grid.
PLOT_COLUMNS = 4


def plot_grid(count: int, has_raw: bool) -> tuple[int, int]:
    """(rows, columns) of the plot's axes for ``count`` collectives: PLOT_COLUMNS per row,
    each a busbw panel over (with raw timings) a ratio panel."""
    columns = max(1, min(PLOT_COLUMNS, count))
    return -(-max(1, count) // columns) * (2 if has_raw else 1), columns


def plot(docs: list[dict[str, Any]], path: str) -> None:
    """busbw against size (ours solid, raw dashed) and ours/raw below it, one cell per
    collective, PLOT_COLUMNS cells per row."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ops = [op for op in OPS if op != "barrier" and any(r["op"] == op for d in docs for r in d["results"])]
    has_raw = any(r.get("raw") for d in docs for r in d["results"])
    rows, columns = plot_grid(len(ops), has_raw)
    panels = 2 if has_raw else 1
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.1 * rows + 1.2), squeeze=False)

    def cell(index: int) -> tuple[Any, Any]:
        """The busbw axes of collective ``index``, and its ratio axes (None without raw)."""
        row, col = divmod(index, columns)
        top = axes[panels * row][col]
        return top, axes[panels * row + 1][col] if has_raw else None

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, doc in enumerate(docs):
        meta, color = doc["meta"], colors[k % len(colors)]
        label = f"{meta['backend']} ({meta['array']}, {meta['ranks']} ranks)"
        for index, op in enumerate(ops):
            rows_of_op = [r for r in doc["results"] if r["op"] == op]
            if not rows_of_op:
                continue
            top, ratio = cell(index)
            top.plot([r["bytes"] for r in rows_of_op], [r["ours"]["busbw_GBps"] for r in rows_of_op], "-o",
                     ms=3, color=color, label=f"{label}: collectives")
            both = [r for r in rows_of_op if r.get("raw")]
            if both and ratio is not None:
                top.plot([r["bytes"] for r in both], [r["raw"]["busbw_GBps"] for r in both], "--",
                         color=color, label=f"{label}: {meta['raw']}")
                ratio.plot([r["bytes"] for r in both], [r["ratio"] for r in both], "-o", ms=3, color=color,
                           label=label)
    for index, op in enumerate(ops):
        top, ratio = cell(index)
        top.set_title(op)
        top.set_yscale("log")
        top.set_ylabel("busbw (GB/s)")
        for axis in (top, ratio):
            if axis is not None:
                axis.set_xscale("log", base=2)
                axis.grid(True, alpha=0.3)
        if ratio is not None:
            ratio.axhline(1.0, color="black", lw=0.8)
            ratio.set_ylabel("ours / raw (median)")
        (ratio if ratio is not None else top).set_xlabel("size (bytes)")
    for index in range(len(ops), rows // panels * columns):  # the last row's empty cells
        for axis in cell(index):
            if axis is not None:
                axis.set_visible(False)
    handles, labels = cell(0)[0].get_legend_handles_labels()
    legend_rows = (len(labels) + 3) // 4
    fig.legend(handles, labels, loc="lower center", ncol=min(4, max(1, len(labels))), fontsize=8)
    fig.suptitle("collectives-bench (busbw: nccl-tests definitions)")
    fig.tight_layout(rect=(0, min(0.3, (0.25 * legend_rows + 0.1) / (3.1 * rows + 1.2)), 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.plot_only:
        docs = []
        for path in args.plot_only:
            with open(path) as f:
                docs.append(json.load(f))
        plot(docs, args.plot)
        return
    doc = run(args)
    if doc is None:
        return
    if args.json == "-":
        json.dump(doc, sys.stdout, indent=1)
        print()
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.plot:
        plot([doc], args.plot)
