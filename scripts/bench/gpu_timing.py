"""Time our all_reduce against the raw transport on the same GPU buffers; print a markdown table.

    python scripts/bench/gpu_timing.py --backend torch                  # world size 1, no launcher
    COLLECTIVES_TIMEOUT=0 python scripts/bench/gpu_timing.py --backend cupy
    mpiexec -n 2 python scripts/bench/gpu_timing.py --backend mpi
    torchrun --nproc_per_node 2 scripts/bench/gpu_timing.py --backend torch   # NCCL >= 2.30 on one GPU

"raw" is the transport called directly on the same buffer: ``dist.all_reduce`` (torch),
``NcclCommunicator.allReduce`` on the caller's stream (cupy), ``MPI_Allreduce`` on the
device pointer when MPI is CUDA-aware, else the copy to host, ``MPI_Allreduce`` and the
copy back that a user would write by hand (mpi).

Ours and raw are interleaved: each of ``--rounds`` rounds times a loop of each (which goes first
alternates), between two device synchronizations, after warm-up; a row gives the median per call
of the rounds. Each run is one setting, read from the environment or ``--env`` (once per setting):
``defaults``, ``COLLECTIVES_TIMEOUT=0``, ``COLLECTIVES_DEBUG=0``...; its rows say which, and whether
the call path's compiled form ran. Rank 0 prints the rows (and appends them to ``--out``);
``--header`` prints the table's header first. ``--device cpu`` runs the same loops on host tensors
(a rehearsal of the script without a GPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import collectives  # noqa: E402

SIZES = (4 << 10, 1 << 20, 16 << 20, 128 << 20)  # bytes of float32
COLUMNS = ("| backend | ranks | setting | compiled call path | array | bytes | ours (µs/call, median) | "
           "raw (µs/call, median) | ours - raw (µs) | ours / raw | rounds |")
HEADER = COLUMNS + "\n" + "|---" * COLUMNS.count(" | ") + "|---|"
#: The variables a setting is made of (what the rows' "setting" column names).
SETTING_VARIABLES = ("COLLECTIVES_TIMEOUT", "COLLECTIVES_DEBUG", "COLLECTIVES_COMPILED")
DEVICE = "cuda"


def setting() -> str:
    """This run's setting: the variables of :data:`SETTING_VARIABLES` that are set, or "defaults"."""
    chosen = [f"{name}={os.environ[name]}" for name in SETTING_VARIABLES if os.environ.get(name, "") != ""]
    return " ".join(chosen) or "defaults"


def compiled_call_path() -> str:
    """Whether the call path's compiled form runs ("yes"/"no"; "unknown" where this checkout has none)."""
    try:
        from collectives.front import compiled_module
    except ImportError:
        return "unknown"
    return "yes" if compiled_module() is not None else "no"


def iterations(nbytes: int) -> int:
    return max(5, min(200, int(4e9 // max(nbytes, 1) // 10)))


def make_buffer(library: str, nbytes: int):
    import torch

    count = nbytes // 4
    if library == "torch":
        return torch.zeros(count, dtype=torch.float32, device=DEVICE)  # zeros: sums stay finite
    import cupy

    return cupy.zeros(count, dtype=cupy.float32)


def synchronize() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def raw_all_reduce(comm, library: str):
    """The transport's own all_reduce of a float32 SUM, for ``comm``'s backend."""
    if comm.backend == "torch":
        import torch
        import torch.distributed as dist

        def raw(x):
            t = x if library == "torch" else torch.as_tensor(x, device="cuda")
            dist.all_reduce(t, group=comm.process_group)
        return raw
    if comm.backend == "cupy":
        import cupy
        import torch
        from collectives.backends.cupy_nccl import NCCL_DTYPES, NCCL_OPS

        nccl = comm.nccl_comm

        def raw(x):
            if library == "torch":
                ptr, count = x.data_ptr(), x.numel()
                stream = torch.cuda.current_stream().cuda_stream
            else:
                ptr, count = x.data.ptr, x.size
                stream = cupy.cuda.get_current_stream().ptr
            nccl.allReduce(ptr, ptr, count, NCCL_DTYPES["float32"], NCCL_OPS["sum"], stream)
        return raw
    from mpi4py import MPI

    mpi = comm.mpi_comm
    if comm.cuda_aware:
        def raw(x):
            synchronize()  # MPI knows no streams
            mpi.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], op=MPI.SUM)
        return raw

    def raw(x):  # what a user does without CUDA-aware MPI: to host, reduce, back
        if library == "torch":
            host = x.cpu()
            mpi.Allreduce(MPI.IN_PLACE, [host.numpy(), MPI.FLOAT], op=MPI.SUM)
            x.copy_(host)
        else:
            import cupy

            host = cupy.asnumpy(x)
            mpi.Allreduce(MPI.IN_PLACE, [host, MPI.FLOAT], op=MPI.SUM)
            x.set(host)
    return raw


def time_per_call(fn, x, n: int) -> float:
    """µs per call of a loop of ``n`` calls of ``fn(x)`` between two device synchronizations."""
    synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn(x)
    synchronize()
    return (time.perf_counter() - start) / n * 1e6


def interleaved(ours, raw, x, n: int, rounds: int, comm) -> tuple[float, float]:
    """The medians of ``rounds`` rounds of a loop of ours and one of raw, which goes first
    alternating (a clock boost or a cache warmed by the first does not favour one side)."""
    for _ in range(3):
        ours(x)
        raw(x)
    comm.barrier()
    times: dict[str, list[float]] = {"ours": [], "raw": []}
    for round_ in range(rounds):
        order = (("ours", ours), ("raw", raw)) if round_ % 2 == 0 else (("raw", raw), ("ours", ours))
        for name, fn in order:
            times[name].append(time_per_call(fn, x, n))
    return statistics.median(times["ours"]), statistics.median(times["raw"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=["torch", "cupy", "mpi"])
    parser.add_argument("--libraries", default="torch,cupy", help="array libraries to time")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes per buffer")
    parser.add_argument("--out", help="append the rows to this file (rank 0)")
    parser.add_argument("--header", action="store_true", help="print the table header first")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set before the communicator is made (a setting: COLLECTIVES_TIMEOUT=0...)")
    parser.add_argument("--header-only", action="store_true", help="print the table header and end")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds per row (median)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: host tensors (a rehearsal without a GPU)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if args.header_only:
        print(HEADER)
        return 0
    for assignment in args.env:
        if assignment == "defaults":  # (a setting's name in scripts/gpu_check.sh)
            continue
        name, _, value = assignment.partition("=")
        os.environ[name] = value

    import importlib.util

    if args.backend is None:
        parser.error("--backend is required")
    comm = collectives.init(args.backend)
    label = comm.backend
    if comm.backend == "mpi":
        label += " (CUDA-aware)" if comm.cuda_aware else " (staged)"
    row = f"| {label} | {comm.size} | {setting()} | {compiled_call_path()} |"
    rows = []
    for library in args.libraries.split(","):
        if library == "cupy" and importlib.util.find_spec("cupy") is None:
            rows.append(f"{row} cupy | - | skipped: CuPy not installed | | | | |")
            continue
        raw = raw_all_reduce(comm, library)
        for nbytes in map(int, args.sizes.split(",")):
            x = make_buffer(library, nbytes)
            n = max(5, iterations(nbytes) // 2)
            ours, theirs = interleaved(comm.all_reduce, raw, x, n, args.rounds, comm)
            rows.append(f"{row} {library} | {nbytes} | {ours:.1f} | {theirs:.1f} | {ours - theirs:+.1f} | "
                        f"{ours / theirs:.2f} | {args.rounds} |")
            del x
    if comm.rank == 0:
        text = "\n".join(([HEADER] if args.header else []) + rows)
        print(text, flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(text + "\n")
    comm.barrier()
    comm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
