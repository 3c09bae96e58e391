"""torch DDP over the backend "collectives" (mpi) against DDP over Gloo and our DataParallel.

    mpiexec -n 2 python scripts/bench/c10d.py --json docs/bench/c10d-2.json
    mpiexec -n 4 python scripts/bench/c10d.py --json docs/bench/c10d-4.json

One job under mpiexec trains three copies of the same model, initialised identically, on
the same batches with the same optimizer, step by step in turn (a, b, c, a, b, c, ...) so
that load on the machine hits all three alike:

    a  DistributedDataParallel over the default group, backend "collectives" (mpi transport)
    b  DistributedDataParallel over dist.new_group(backend="gloo") in the same ranks
    c  collectives.syncbn.DataParallel over collectives.c10d.communicator() (the same transport)

A step is zero_grad, forward, loss, backward (ending with the gradients averaged over the
ranks), optimizer step. Ranks meet at a barrier (not timed) before every step; a step's time
is the slowest rank's. Rank 0 prints the median and p10/p90 of each variant, the ratios a/b
and a/c, the largest difference between a's and b's parameters after training, and the
machine's load average before and after (the numbers mean little on a loaded machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from collectives.syncbn import DataParallel
from torch import nn

import collectives.c10d


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def measure_overlap(ddp: Any, optimizer: Any, args: Any, g: torch.Generator, steps: int = 5) -> dict[str, Any]:
    """How much of DDP's bucket all_reduces ran while backward was still computing gradients:
    a comm hook (the default all_reduce, timed) records when each bucket's all_reduce was
    launched and when it completed; the last bucket's launch is when the last gradient was
    ready (backward() then only waits for the all_reduces)."""
    spans: list[tuple[float, float]] = []

    def timed_allreduce(state, bucket):  # type: ignore[no-untyped-def]  (DDP reads annotations)
        tensor = bucket.buffer().div_(dist.get_world_size())
        started = time.perf_counter()

        def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
            spans.append((started, time.perf_counter()))
            return fut.value()[0]
        return dist.all_reduce(tensor, async_op=True).get_future().then(done)

    ddp.register_comm_hook(None, timed_allreduce)
    totals = {"buckets": 0, "buckets_done_while_computing": 0, "allreduce_ms": 0.0,
              "allreduce_ms_while_computing": 0.0, "gradient_compute_ms": 0.0, "backward_ms": 0.0}
    for _ in range(steps):
        x = torch.randn(args.batch, 256, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        spans.clear()
        start = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        optimizer.step()
        computed = max(began for began, _ in spans)  # the last bucket's gradients were ready
        totals["buckets"] += len(spans)
        totals["buckets_done_while_computing"] += sum(done < computed for _, done in spans)
        totals["allreduce_ms"] += 1e3 * sum(done - began for began, done in spans)
        totals["allreduce_ms_while_computing"] += 1e3 * sum(max(0.0, min(done, computed) - began)
                                                            for began, done in spans)
        totals["gradient_compute_ms"] += 1e3 * (computed - start)
        totals["backward_ms"] += 1e3 * (end - start)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=64, help="samples per rank and step")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--overlap-steps", type=int, default=5, help="steps of the overlap measurement")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", help="write the results here (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    load_before = os.getloadavg()
    collectives.c10d.init_process_group()
    comm = collectives.c10d.communicator()
    gloo = dist.new_group(backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()

    models = {name: make_model(args.width, args.depth) for name in ("a", "b", "c")}
    wrapped = {
        "a": nn.parallel.DistributedDataParallel(models["a"]),
        "b": nn.parallel.DistributedDataParallel(models["b"], process_group=gloo),
        "c": DataParallel(models["c"], comm),
    }
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for name, m in wrapped.items()}
    times: dict[str, list[float]] = {name: [] for name in wrapped}
    g = torch.Generator().manual_seed(1 + rank)
    for step in range(args.warmup + args.steps):
        x = torch.randn(args.batch, 256, generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        for name, model in wrapped.items():
            comm.barrier()
            start = time.perf_counter()
            optimizers[name].zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizers[name].step()
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                times[name].append(elapsed)
    slowest = {name: np.max(comm.all_gather(np.array(t)), axis=0) for name, t in times.items()}
    params = {name: torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for name, m in models.items()}
    overlap = measure_overlap(wrapped["a"], optimizers["a"], args, g, args.overlap_steps)
    load_after = os.getloadavg()
    if rank != 0:
        return
    summary: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ranks": size, "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
        "args": vars(args), "load_before": load_before, "load_after": load_after,
        "variants": {"a": "DDP over 'collectives' (mpi)", "b": "DDP over Gloo",
                     "c": "syncbn.DataParallel (mpi)"},
        "parameters_bytes": int(params["a"].numel() * 4),
    }
    for name, t in slowest.items():
        summary[name] = {"median_s": float(np.median(t)), "p10_s": float(np.percentile(t, 10)),
                         "p90_s": float(np.percentile(t, 90)), "steps": [float(v) for v in t]}
        print(f"{name} {summary['variants'][name]:32s} median {summary[name]['median_s'] * 1e3:8.2f} ms  "
              f"p10 {summary[name]['p10_s'] * 1e3:8.2f}  p90 {summary[name]['p90_s'] * 1e3:8.2f}")
    summary["a_over_b"] = summary["a"]["median_s"] / summary["b"]["median_s"]
    summary["a_over_c"] = summary["a"]["median_s"] / summary["c"]["median_s"]
    summary["max_abs_param_diff_a_b"] = float((params["a"] - params["b"]).abs().max())
    summary["overlap"] = overlap
    print(f"overlap (rank 0, DDP over 'collectives', {args.overlap_steps} steps): "
          f"{overlap['buckets_done_while_computing']} of {overlap['buckets']} bucket all_reduces completed while "
          f"backward was still computing gradients; {overlap['allreduce_ms_while_computing']:.1f} of "
          f"{overlap['allreduce_ms']:.1f} ms of all_reduce ran then ({overlap['gradient_compute_ms']:.1f} ms "
          f"computing, {overlap['backward_ms']:.1f} ms backward in all)")
    print(f"a/b (target <= 0.97) {summary['a_over_b']:.3f}   a/c (target <= 1.05) {summary['a_over_c']:.3f}   "
          f"max |a - b| parameters {summary['max_abs_param_diff_a_b']:.3g}   load {load_before[0]:.2f} -> "
          f"{load_after[0]:.2f}   median of medians per step: {statistics.median(slowest['a']) * 1e3:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
