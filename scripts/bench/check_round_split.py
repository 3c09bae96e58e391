"""Where the default check's price goes on the torch route (Gloo), measured in ONE job: the raw
call, the raw call after a raw round, the raw call after the check's own round, ours with the check
and ours without it, alternated call by call, a barrier before each; the slowest rank's time of
each iteration and the paired differences (same iteration), which a shared machine's load moves
far less than the medians of separate runs.

    torchrun --nproc_per_node 2 scripts/bench/check_round_split.py                # 8 KiB, 128 KiB, 2 MiB
    torchrun --nproc_per_node 2 scripts/bench/check_round_split.py --ops scatter all_to_all -b 2M

The variants (float32 CPU tensors, collectives-bench's buffers and raw calls, ``out=`` given):

- ``raw``: collectives-bench's raw torch.distributed call;
- ``ar8+raw``: the raw call after an 8-byte ``dist.all_reduce`` (collectives-bench's ``raw+round``);
- ``ar8``: that round alone;
- ``round+raw``: the raw call after the check's own round (``_agree_word``, the word alone);
- ``round``: that round alone;
- ``ours``: the call through collectives, the check on (its round, then the call);
- ``off``: ours with the check off for the call (``COLLECTIVES_DEBUG=0``'s switch, ``_checking``).

So ``ours - ar8+raw`` is what ours adds to a raw program that makes one round before its call, and
``ours - off`` the check's price. Prints one table per collective and size on rank 0.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

#: The collectives with one check round before their data (the uneven ones carry their counts in it).
OPS = ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "gather", "scatter", "all_to_all")


def variants(comm: Any, case: Any, raw: Any, dist: Any, torch: Any) -> dict[str, Callable[[], Any]]:
    ours, raw_call = case.ours(), case.raw(raw)
    word8, agree = torch.zeros(1, dtype=torch.int64), comm._transport._agree_word

    def off() -> None:
        comm._checking = False
        try:
            ours()
        finally:
            comm._checking = True

    def ar8() -> None:
        dist.all_reduce(word8, group=comm.process_group)

    def ar8_raw() -> None:
        ar8()
        raw_call()

    def round_raw() -> None:
        agree(12345)
        raw_call()

    return {"raw": raw_call, "ar8+raw": ar8_raw, "ar8": ar8, "round+raw": round_raw,
            "round": lambda: agree(12345), "ours": ours, "off": off}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("-b", "--bytes", nargs="+", default=["8K", "128K", "2M"],
                   help="sizes (collectives-bench's: K, M suffixes)")
    p.add_argument("-n", "--iters", type=int, default=300, help="iterations (each runs every variant once)")
    args = p.parse_args()

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    import collectives  # noqa: PLC0415
    from collectives.bench.cases import Arrays, Case  # noqa: PLC0415
    from collectives.bench.cli import parse_size  # noqa: PLC0415
    from collectives.bench.raw import RawTorch  # noqa: PLC0415

    comm = collectives.init("torch")
    arr, raw, clock = Arrays("torch", "float32", "cpu"), RawTorch(comm), time.perf_counter
    for size in args.bytes:
        for op in args.ops:
            case = Case(op, parse_size(size), comm, arr, "sum", 0)
            fns = variants(comm, case, raw, dist, torch)
            names, calls = list(fns), list(fns.values())
            k, warm = len(calls), 20
            seconds = np.zeros((k, args.iters))
            for i in range(args.iters + warm):
                for j in range(k) if i % 2 == 0 else reversed(range(k)):  # (neither end always first)
                    comm.barrier()
                    t0 = clock()
                    calls[j]()
                    if i >= warm:
                        seconds[j, i - warm] = clock() - t0
            everyone = comm.all_gather(torch.from_numpy(seconds)).numpy()
            if comm.rank:
                continue
            slowest = everyone.max(axis=0) * 1e6
            raw_i, round_i = names.index("raw"), names.index("ar8+raw")
            print(f"{op} {case.nbytes} B, {comm.size} ranks, {args.iters} iterations; us, the slowest rank: "
                  "median p25 | paired - raw: median p25 | paired - ar8+raw: median p25", flush=True)
            for j, name in enumerate(names):
                d, e = slowest[j] - slowest[raw_i], slowest[j] - slowest[round_i]
                print(f"  {name:10s} {np.median(slowest[j]):8.1f} {np.percentile(slowest[j], 25):8.1f} | "
                      f"{np.median(d):8.1f} {np.percentile(d, 25):8.1f} | {np.median(e):8.1f} "
                      f"{np.percentile(e, 25):8.1f}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
