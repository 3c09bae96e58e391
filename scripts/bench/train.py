"""End-to-end training step time: our DataParallel (+ SyncBatchNorm) against torch DDP over Gloo.

    COLLECTIVES_BACKEND=mpi mpiexec -n 2 python scripts/bench/train.py --json docs/bench/train-mpi-2.json
    torchrun --nproc_per_node 2 scripts/bench/train.py --json docs/bench/train-torch-2.json
    python scripts/bench/train.py --plot-only docs/bench/train-*.json --plot docs/bench/train.png

One job trains three copies of the same CNN (six BatchNorm2d layers, CIFAR-sized
3x32x32 input, ``--batch`` images per rank), initialised identically, on the
same batches with the same optimizer (SGD with momentum), step by step in turn
(a, b, c, a, b, c, ...) so that load on the machine hits all three alike:

    a  syncbn.DataParallel over the collectives communicator, BatchNorm -> SyncBatchNorm
    b  syncbn.DataParallel over the collectives communicator, plain BatchNorm2d
    c  torch.nn.parallel.DistributedDataParallel over a Gloo process group, plain BatchNorm2d

Under torchrun (torch backend) DDP gets a Gloo group of its own (``--ddp-group
new``) or shares the communicator's default group (``default``). Under mpiexec
(mpi backend) torch.distributed is initialised here for DDP: rank 0 serves a
TCPStore whose address reaches the other ranks over MPI.

A step is zero_grad, forward, cross-entropy, backward (which ends with the
gradients averaged over ranks, in both libraries), optimizer step. Ranks meet at a
barrier (not timed) before every step; a step's time is the slowest rank's. The
first ``--warmup`` steps of each variant are not timed. Rank 0 prints the median
and p10/p90 step time of each variant (and of its forward, backward and optimizer
phases), the ratios b/c and a/c, and the machine's load average at the start and
the end. Sanity check: b and c compute the same thing (DDP's mean of the ranks'
gradients), so after training their parameters agree to float32 rounding; a
differs from them by SyncBatchNorm's semantics (statistics over the global batch).

Buffers: each library's default unless ``--broadcast-buffers on|off`` makes both
the same (ours defaults to off, DDP to on: DDP broadcasts rank 0's buffers, the
BatchNorm running stats, before every forward).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import inspect
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from collectives.syncbn import DataParallel, convert_sync_batchnorm
from torch import nn

import collectives
from collectives.communicator import Communicator

VARIANTS = {
    "a": "ours DataParallel + SyncBatchNorm",
    "b": "ours DataParallel + BatchNorm2d",
    "c": "torch DDP (Gloo) + BatchNorm2d",
}
PHASES = ("forward", "backward", "optimizer")
WIDTHS = (16, 16, 32, 32, 64, 64)  # default channels of the six conv + BatchNorm2d layers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40, help="timed steps per variant (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first (default 5)")
    p.add_argument("--batch", type=int, default=32, help="images per rank per step (default 32)")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--widths", type=_widths, default=WIDTHS,
                   help=f"channels of the six conv layers (default {','.join(map(str, WIDTHS))})")
    p.add_argument("--variants", default="abc", help="which of a, b, c to run (default abc)")
    p.add_argument("--broadcast-buffers", choices=("default", "on", "off"), default="default",
                   help="default: each library's own (ours off, DDP on); on/off: both the same")
    p.add_argument("--ddp-group", choices=("new", "default"), default="new",
                   help="torch backend: DDP's Gloo group, a new one or the communicator's")
    p.add_argument("--profile", choices=tuple(VARIANTS), default=None,
                   help="cProfile this variant's timed steps on rank 0 and print the top functions")
    p.add_argument("--collective-times", action="store_true",
                   help="time every SyncBatchNorm collective of variant a on every rank: how much "
                        "of it is waiting for the last rank to arrive; and the same all_gather alone")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a plot (needs matplotlib)")
    p.add_argument("--plot-only", nargs="+", default=None, metavar="JSON",
                   help="no benchmark: plot these JSON results in one figure (needs --plot)")
    args = p.parse_args(argv)
    if args.plot_only and not args.plot:
        p.error("--plot-only needs --plot PNG")
    for name in ("steps", "batch", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0; got {args.warmup}")
    if not args.variants or set(args.variants) - set(VARIANTS) or len(set(args.variants)) != len(args.variants):
        p.error(f"--variants must be distinct letters of {''.join(VARIANTS)}; got {args.variants!r}")
    return args


def _widths(text: str) -> tuple[int, ...]:
    try:
        widths = tuple(int(w) for w in text.split(","))
    except ValueError:
        widths = ()
    if len(widths) != 6 or min(widths) < 1:
        raise argparse.ArgumentTypeError(f"six positive integers separated by commas; got {text!r}")
    return widths


# -- model and data -------------------------------------------------------------------------------


def build_model(seed: int, widths: tuple[int, ...] = WIDTHS) -> nn.Module:
    """A CIFAR-sized CNN: six 3x3 conv + BatchNorm2d + ReLU layers, two max-pools, a linear head."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    channels = 3
    for i, width in enumerate(widths):
        layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
        if i in (1, 3):
            layers.append(nn.MaxPool2d(2))  # 32 -> 16 -> 8
        channels = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 10)]
    return nn.Sequential(*layers)


def make_batches(seed: int, rank: int, batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches of this rank, cycled through by the steps. Every image gets its own
    brightness and contrast, so batch statistics differ between ranks as real data's do."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    batches = []
    for _ in range(count):
        offset = torch.randn(batch, 1, 1, 1, generator=g) * 0.5
        scale = torch.rand(batch, 1, 1, 1, generator=g) + 0.5
        x = torch.randn(batch, 3, 32, 32, generator=g) * scale + offset
        y = torch.randint(0, 10, (batch,), generator=g)
        batches.append((x, y))
    return batches


# -- the three variants -----------------------------------------------------------------------------


def ddp_process_group(comm: Communicator, which: str) -> Any:
    """A Gloo process group over the same ranks as ``comm``, for torch's DDP."""
    import torch.distributed as dist  # noqa: PLC0415

    if comm.backend == "torch":
        return dist.new_group(backend="gloo") if which == "new" else comm.process_group
    from collectives.backends import torch_bootstrap  # noqa: PLC0415

    from collectives.launcher import detect_launcher  # noqa: PLC0415

    launch = detect_launcher()
    if comm.size == 1:
        store = dist.HashStore()
    else:
        if launch.local_size == launch.size and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # one node: loopback, as the torch backend does
        store = torch_bootstrap.mpi_shared_tcp_store(launch)
    dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size)
    return None  # the default group


def build_variants(comm: Communicator, args: argparse.Namespace, group: Any) -> dict[str, nn.Module]:
    base = build_model(args.seed, args.widths)
    ours_buffers = args.broadcast_buffers == "on"
    # DDP syncs buffers before every forward by default; torch 2.13 names the switch
    # forward_sync_buffers (broadcast_buffers is deprecated there).
    ddp_options = {} if args.broadcast_buffers != "off" else (
        {"forward_sync_buffers": False} if "forward_sync_buffers" in
        inspect.signature(nn.parallel.DistributedDataParallel).parameters else {"broadcast_buffers": False})
    models: dict[str, nn.Module] = {}
    for name in args.variants:
        model = copy.deepcopy(base)
        if name == "a":
            models[name] = DataParallel(convert_sync_batchnorm(model, comm=comm), comm,
                                        broadcast_buffers=ours_buffers)
        elif name == "b":
            models[name] = DataParallel(model, comm, broadcast_buffers=ours_buffers)
        else:
            models[name] = nn.parallel.DistributedDataParallel(model, process_group=group, **ddp_options)
    return models


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor,
               y: torch.Tensor) -> tuple[float, float, float, float]:
    """One training step: seconds of its forward (with the loss), backward and optimizer step,
    and the CPU seconds the whole process (transport threads too) spent on it."""
    cpu = time.process_time()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    forward = time.perf_counter()
    loss.backward()  # both libraries have averaged the gradients when this returns
    backward = time.perf_counter()
    optimizer.step()
    end = time.perf_counter()
    return forward - start, backward - forward, end - backward, time.process_time() - cpu


def parameters_of(model: nn.Module) -> torch.Tensor:
    inner = model.module if hasattr(model, "module") else model
    return torch.cat([p.detach().double().reshape(-1) for p in inner.parameters()])


def param_diffs(comm: Communicator, models: dict[str, nn.Module]) -> dict[str, float]:
    """Largest parameter difference, over ranks, of each pair of variants."""
    params = {name: parameters_of(m) for name, m in models.items()}
    pairs = [(left, right) for left, right in (("b", "c"), ("a", "c"), ("a", "b"))
             if left in params and right in params]
    local = np.array([float((params[left] - params[right]).abs().max()) for left, right in pairs])
    worst = comm.all_reduce(local, "max") if pairs else local
    return {f"{left}-{right}": float(v) for (left, right), v in zip(pairs, worst)}


def percentiles(values: list[float]) -> dict[str, float]:
    return {"median_ms": 1e3 * statistics.median(values),
            "p10_ms": 1e3 * float(np.percentile(values, 10)),
            "p90_ms": 1e3 * float(np.percentile(values, 90))}


def _now() -> float:
    # CLOCK_MONOTONIC is one clock for every process of a host: ranks' times compare directly.
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class CollectiveTimes:
    """Records when each blocking all_gather / all_reduce on ``comm`` is entered and left,
    while ``recording`` is on (asynchronous calls, DataParallel's, pass through untouched)."""

    KINDS = ("all_gather", "all_reduce")

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self.recording = False
        self.calls: dict[str, list[tuple[float, float]]] = {kind: [] for kind in self.KINDS}
        for kind in self.KINDS:
            setattr(comm, kind, self._timed(kind, getattr(comm, kind)))

    def _timed(self, kind: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.recording or kwargs.get("async_op"):
                return method(*args, **kwargs)
            enter = _now()
            result = method(*args, **kwargs)
            self.calls[kind].append((enter, _now()))
            return result
        return call

    def remove(self) -> None:
        for kind in self.KINDS:
            delattr(self.comm, kind)

    def summary(self) -> dict[str, Any]:
        """Per kind, medians over calls (ms): the call's time on a rank (mean over ranks), the
        part of it spent before the last rank arrived, and the part after."""
        out: dict[str, Any] = {}
        for kind in self.KINDS:
            times = self.comm.all_gather(np.array(self.calls[kind], dtype=np.float64).reshape(-1, 2))
            if times.shape[1] == 0:
                continue
            enter, leave = times[:, :, 0], times[:, :, 1]  # (ranks, calls)
            last_arrival = enter.max(axis=0)
            last = enter.argmax(axis=0)
            calls = np.arange(times.shape[1])
            # The last rank to arrive finds the others there: its own call is the collective's cost;
            # the others leave after the data reached them and they were woken up and scheduled.
            last_in_call = leave[last, calls] - enter[last, calls]
            others = np.ones_like(enter, dtype=bool)
            others[last, calls] = False
            others_after = (leave - last_arrival)[others]
            out[kind] = {"calls": int(times.shape[1]),
                         "in_call_ms": 1e3 * float(np.median((leave - enter).mean(axis=0))),
                         "waiting_for_last_rank_ms": 1e3 * float(np.median((last_arrival - enter).mean(axis=0))),
                         "after_last_arrival_ms": 1e3 * float(np.median((leave - last_arrival).mean(axis=0))),
                         "last_rank_in_call_ms": 1e3 * float(np.median(last_in_call)),
                         "others_after_last_arrival_ms": 1e3 * float(np.median(others_after)),
                         "slowest_rank_last_share": float(np.mean(enter.argmax(axis=0) == 0))}
        return out


def collective_alone(comm: Communicator, channels: int, iterations: int = 50) -> dict[str, float]:
    """Median ms of SyncBatchNorm's forward all_gather (a float64 row of 1 + 3C) after a barrier,
    through the communicator and through the raw transport (torch.distributed or mpi4py)."""
    row = torch.zeros(1 + 3 * channels, dtype=torch.float64)
    raw = None
    if comm.backend == "torch":
        import torch.distributed as dist  # noqa: PLC0415

        gathered = torch.empty(comm.size * row.numel(), dtype=torch.float64)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.12 name
        raw = lambda: gather(gathered, row, group=comm.process_group)  # noqa: E731
    elif comm.backend == "mpi":
        send, gathered = row.numpy(), np.empty(comm.size * row.numel())
        raw = lambda: comm.mpi_comm.Allgather(send, gathered)  # noqa: E731
    calls = {"ours": lambda: comm.all_gather(row), **({"raw": raw} if raw else {})}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(iterations):
        for name, call in calls.items():
            comm.barrier()
            start = _now()
            call()
            times[name].append(_now() - start)
    slowest = comm.all_gather(np.array([times[name] for name in calls])).max(axis=0)
    return {f"{name}_ms": 1e3 * float(np.median(slowest[k])) for k, name in enumerate(calls)}


def run(comm: Communicator, args: argparse.Namespace) -> dict[str, Any]:
    """Train every variant, interleaved step by step; the results (the same dict on every rank)."""
    load_start = os.getloadavg()
    group = ddp_process_group(comm, args.ddp_group) if "c" in args.variants else None
    models = build_variants(comm, args, group)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=args.lr, momentum=args.momentum)
                  for name, m in models.items()}
    batches = make_batches(args.seed, comm.rank, args.batch, count=8)
    # times[name][step] = (forward, backward, optimizer, CPU) seconds on this rank
    times: dict[str, list[tuple[float, ...]]] = {name: [] for name in models}
    first_diffs: dict[str, float] = {}
    profiler = cProfile.Profile() if args.profile and comm.rank == 0 else None
    recorder = CollectiveTimes(comm) if args.collective_times and "a" in models else None
    for step in range(args.warmup + args.steps):
        x, y = batches[step % len(batches)]
        for name, model in models.items():
            comm.barrier()
            profiling = profiler is not None and name == args.profile and step >= args.warmup
            if profiling:
                profiler.enable()
            if recorder is not None:
                recorder.recording = name == "a" and step >= args.warmup
            phases = train_step(model, optimizers[name], x, y)
            if profiling:
                profiler.disable()
            if step >= args.warmup:
                times[name].append(phases)
        if step == 0:
            first_diffs = param_diffs(comm, models)
    load_end = os.getloadavg()
    if profiler is not None:
        print(f"cProfile of variant {args.profile} ({VARIANTS[args.profile]}), rank 0, "
              f"{args.steps} timed steps, by own time:")
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)

    # Step time = the slowest rank's, step by step; CPU time = the ranks' mean.
    results: dict[str, Any] = {}
    slowest: dict[str, np.ndarray] = {}
    for name in models:
        every = comm.all_gather(np.array(times[name], dtype=np.float64))  # (ranks, steps, 4)
        slowest[name] = every[:, :, :3].sum(axis=2).max(axis=0)
        results[name] = {"label": VARIANTS[name], **percentiles(slowest[name].tolist()),
                         "phases_median_ms": {phase: 1e3 * float(np.median(every[:, :, k].max(axis=0)))
                                              for k, phase in enumerate(PHASES)},
                         "cpu_median_ms": 1e3 * float(np.median(every[:, :, 3].mean(axis=0))),
                         "steps_ms": (1e3 * slowest[name]).round(4).tolist()}
    ratios, paired = {}, {}
    if "c" in models:
        for name in models:
            if name != "c":
                ratios[f"{name}/c"] = results[name]["median_ms"] / results["c"]["median_ms"]
                paired[f"{name}/c"] = float(np.median(slowest[name] / slowest["c"]))
    diffs = param_diffs(comm, models)
    collective_report = {}
    if recorder is not None:
        recorder.recording = False
        collective_report = {"inside_syncbn": recorder.summary(),
                             "all_gather_alone": collective_alone(comm, args.widths[0])}
        recorder.remove()
    if group is not None and args.ddp_group == "new":
        import torch.distributed as dist  # noqa: PLC0415

        dist.destroy_process_group(group)
    elif comm.backend != "torch" and "c" in models:
        import torch.distributed as dist  # noqa: PLC0415

        dist.destroy_process_group()
    return {"meta": describe(comm, args, load_start, load_end), "variants": results,
            "ratios": ratios, "paired_ratios": paired, "max_param_diff": diffs,
            "max_param_diff_after_first_step": first_diffs,
            **({"collective_times": collective_report} if collective_report else {})}


def describe(comm: Communicator, args: argparse.Namespace, load_start: tuple[float, ...],
             load_end: tuple[float, ...]) -> dict[str, Any]:
    return {
        "backend": comm.backend, "ranks": comm.size, "batch": args.batch, "steps": args.steps,
        "warmup": args.warmup, "threads": args.threads, "broadcast_buffers": args.broadcast_buffers,
        "ddp_group": args.ddp_group if comm.backend == "torch" else "default (own Gloo, store over MPI)",
        "model": f"6x (conv3x3 + BatchNorm2d + ReLU), widths {list(args.widths)}, input 3x32x32",
        "parameters": sum(p.numel() for p in build_model(args.seed, args.widths).parameters()),
        "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
        "torch": torch.__version__, "collectives": getattr(collectives, "__version__", None),
        "timeout_s": getattr(comm, "timeout", None),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "loadavg_start": [round(v, 2) for v in load_start],
        "loadavg_end": [round(v, 2) for v in load_end],
        "argv": sys.argv[1:],
    }


def report(doc: dict[str, Any]) -> str:
    meta = doc["meta"]
    out = [f"backend={meta['backend']} ranks={meta['ranks']} batch={meta['batch']}/rank "
           f"threads/rank={meta['threads']} steps={meta['steps']} (+{meta['warmup']} warm-up) "
           f"buffers={meta['broadcast_buffers']}; load average {_load(meta['loadavg_start'])} at the "
           f"start, {_load(meta['loadavg_end'])} at the end ({meta['cpus']} CPUs)",
           f"{'variant':<40}{'median ms':>10}{'p10':>8}{'p90':>8}   "
           + "  ".join(f"{phase:>9}" for phase in PHASES) + f"{'CPU ms':>9}"]
    for name, r in doc["variants"].items():
        out.append(f"{name}  {r['label']:<37}{r['median_ms']:>10.2f}{r['p10_ms']:>8.2f}{r['p90_ms']:>8.2f}   "
                   + "  ".join(f"{r['phases_median_ms'][phase]:>9.2f}" for phase in PHASES)
                   + f"{r['cpu_median_ms']:>9.2f}")
    targets = {"b/c": 0.97, "a/c": 1.05}
    for key, value in doc["ratios"].items():
        target = targets.get(key)
        verdict = "" if target is None else f"   (target <= {target:.2f}: {'met' if value <= target else 'missed'})"
        out.append(f"ratio {key} = {value:.3f} (of the medians; median of the per-step ratios "
                   f"{doc['paired_ratios'][key]:.3f}){verdict}")
    notes = {"b-c": "same math: float32 rounding only",
             "a-c": "SyncBatchNorm vs per-rank BatchNorm: differ by design",
             "a-b": "SyncBatchNorm vs per-rank BatchNorm: differ by design"}
    first = doc["max_param_diff_after_first_step"]
    for key, value in doc["max_param_diff"].items():
        out.append(f"max |param {key.replace('-', ' - ')}| = {first[key]:.2e} after 1 step, {value:.2e} after "
                   f"{meta['warmup'] + meta['steps']} steps   ({notes[key]})")
    times = doc.get("collective_times")
    if times:
        out.append("SyncBatchNorm's blocking collectives in variant a, median over calls of the ranks' mean (ms):")
        for kind, t in times["inside_syncbn"].items():
            out.append(f"  {kind:<11} {t['calls']:>4} calls: {t['in_call_ms']:.3f} in the call = "
                       f"{t['waiting_for_last_rank_ms']:.3f} waiting for the last rank to arrive + "
                       f"{t['after_last_arrival_ms']:.3f} after it arrived (rank 0 arrived last in "
                       f"{100 * t['slowest_rank_last_share']:.0f}% of the calls); the last rank's own call "
                       f"{t['last_rank_in_call_ms']:.3f}, the others leave {t['others_after_last_arrival_ms']:.3f} "
                       "after it arrived")
        alone = times["all_gather_alone"]
        out.append(f"  the first layer's all_gather alone, after a barrier: {alone['ours_ms']:.3f} ours"
                   + (f", {alone['raw_ms']:.3f} raw" if "raw_ms" in alone else ""))
    return "\n".join(out)


def _load(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


# -- plot --------------------------------------------------------------------------------------------


def plot(docs: list[dict[str, Any]], path: str) -> bool:
    """Median step time (p10-p90 bars) of each variant, one group per run. False without matplotlib."""
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot written",
              file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(2.2 + 2.3 * len(docs), 4.6))
    colors = {"a": "tab:blue", "b": "tab:green", "c": "tab:gray"}
    width = 0.26
    for i, doc in enumerate(docs):
        for k, (name, r) in enumerate(doc["variants"].items()):
            x = i + (k - 1) * width
            ax.bar(x, r["median_ms"], width, color=colors.get(name),
                   yerr=[[r["median_ms"] - r["p10_ms"]], [r["p90_ms"] - r["median_ms"]]], capsize=3,
                   label=f"{name}: {r['label']}" if i == 0 else None)
            ratio = doc["ratios"].get(f"{name}/c")
            if ratio is not None:
                ax.annotate(f"{ratio:.2f}x", (x, r["p90_ms"]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(docs)))
    ax.set_xticklabels([f"{d['meta']['backend']}, {d['meta']['ranks']} ranks\nload "
                        f"{d['meta']['loadavg_start'][0]:.1f}-{d['meta']['loadavg_end'][0]:.1f}" for d in docs])
    ax.set_ylabel("step time, ms (median, p10-p90)")
    ax.set_title(f"training step, batch {docs[0]['meta']['batch']}/rank (ratios: against c)")
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_only:
        return 0 if plot([json.loads(Path(path).read_text()) for path in args.plot_only], args.plot) else 1
    torch.set_num_threads(args.threads)
    comm = collectives.init()
    doc = run(comm, args)
    if comm.rank == 0:
        print(report(doc), flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)
        if args.plot:
            plot([doc], args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
