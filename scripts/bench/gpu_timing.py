"""Time our all_reduce against the raw transport on the same GPU buffers; print a markdown table.

    python scripts/bench/gpu_timing.py --backend torch                  # world size 1, no launcher
    python scripts/bench/gpu_timing.py --backend cupy
    mpiexec -n 2 python scripts/bench/gpu_timing.py --backend mpi
    torchrun --nproc_per_node 2 scripts/bench/gpu_timing.py --backend torch   # NCCL >= 2.30 on one GPU

"raw" is the transport called directly on the same buffer: ``dist.all_reduce`` (torch),
``NcclCommunicator.allReduce`` on the caller's stream (cupy), ``MPI_Allreduce`` on the
device pointer when MPI is CUDA-aware, else the copy to host, ``MPI_Allreduce`` and the
copy back that a user would write by hand (mpi). On cupy with a timeout (the default) each of
our blocking calls waits on the host for its CUDA event against the deadline, which raw NCCL
does not; ``COLLECTIVES_TIMEOUT=0`` rows ("no timeout") show the call path without that wait.
Each time is the mean per call over a loop between two device synchronizations, after
warm-up. Rank 0 prints the rows (and appends them to ``--out``); ``--header`` prints the
table's header first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import collectives  # noqa: E402

SIZES = (4 << 10, 1 << 20, 16 << 20, 128 << 20)  # bytes of float32
HEADER = ("| backend | ranks | array | bytes | ours (µs/call) | raw (µs/call) | ours / raw | "
          "ours (GB/s) |\n|---|---|---|---|---|---|---|---|")


def iterations(nbytes: int) -> int:
    return max(5, min(200, int(4e9 // max(nbytes, 1) // 10)))


def make_buffer(library: str, nbytes: int):
    import torch

    count = nbytes // 4
    if library == "torch":
        return torch.zeros(count, dtype=torch.float32, device="cuda")  # zeros: sums stay finite
    import cupy

    return cupy.zeros(count, dtype=cupy.float32)


def synchronize() -> None:
    import torch

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


def time_per_call(fn, x, n: int, comm) -> float:
    for _ in range(3):
        fn(x)
    synchronize()
    comm.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn(x)
    synchronize()
    return (time.perf_counter() - start) / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", required=True, choices=["torch", "cupy", "mpi"])
    parser.add_argument("--libraries", default="torch,cupy", help="array libraries to time")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="bytes per buffer")
    parser.add_argument("--out", help="append the rows to this file (rank 0)")
    parser.add_argument("--header", action="store_true", help="print the table header first")
    args = parser.parse_args()

    import importlib.util

    comm = collectives.init(args.backend)
    label = comm.backend
    if comm.backend == "mpi":
        label += " (CUDA-aware)" if comm.cuda_aware else " (staged)"
    if comm.backend == "cupy" and comm.timeout is None:
        label += " (no timeout)"  # blocking calls return once enqueued, as raw NCCL does
    rows = []
    for library in args.libraries.split(","):
        if library == "cupy" and importlib.util.find_spec("cupy") is None:
            rows.append(f"| {label} | {comm.size} | cupy | - | skipped: CuPy not installed | | | |")
            continue
        raw = raw_all_reduce(comm, library)
        for nbytes in map(int, args.sizes.split(",")):
            x = make_buffer(library, nbytes)
            n = iterations(nbytes)
            ours = time_per_call(lambda b: comm.all_reduce(b), x, n, comm)
            theirs = time_per_call(raw, x, n, comm)
            rows.append(f"| {label} | {comm.size} | {library} | {nbytes} | {ours:.1f} | {theirs:.1f} | "
                        f"{ours / theirs:.2f} | {nbytes / ours / 1e3:.2f} |")
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
