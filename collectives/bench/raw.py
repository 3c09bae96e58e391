"""Every collective written directly against the transport under a communicator: the --raw column.

``bind(case, x, out)`` returns the call with everything that can be prepared once prepared
(buffer specs, datatypes, pointers, counts): what a tuned program on the bare transport runs in
its loop, the strictest baseline. The uneven all_gather_v and all_to_all_v are what a program
must do on the bare transport when the peers' counts are not known: exchange them (one small
Allgather or Alltoall), then the v-collective (NCCL's grouped sends: told the counts). It
returns None where the transport has no such call (MPI has no bfloat16; torch.distributed has
no uneven all_gather; NCCL has no barrier), and the table prints "-" there.

``round(case, x)`` is the stand-in for the default check's price where it is one small round on the
caller's thread before the call (MPI; torch on a Gloo group): the transport's own 8-byte integer
all_reduce, run before the raw call in the "raw+round" column. None where the check costs no such
round (send and recv, barrier; a call checked beside it on a device stream: NCCL).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .cases import Case, ping_pong

#: The collectives whose default check is no round of its own: send_recv's (a header only in
#: debug mode), barrier's (its round is the barrier).
UNROUNDED = ("send_recv", "barrier")


class Raw:
    """The bare transport of one communicator."""

    name = ""

    def bind(self, case: Case, x: Any, out: Any) -> Callable[[], Any] | None:
        raise NotImplementedError

    def round(self, case: Case, x: Any) -> Callable[[], Any] | None:
        """One small round of this transport (see the module's docstring), or None."""
        return None

    def barrier(self) -> None:
        raise NotImplementedError


class RawMPI(Raw):
    """mpi4py on the communicator's own ``MPI.Comm``: IN_PLACE Allreduce, Bcast and Reduce on the
    root; the others into preallocated outputs."""

    name = "mpi4py"

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI  # noqa: PLC0415

        self.MPI, self.comm = MPI, comm.mpi_comm
        self._types = {np.dtype(k): getattr(MPI, v) for k, v in (
            ("bool", "C_BOOL"), ("int8", "INT8_T"), ("uint8", "UINT8_T"), ("int16", "INT16_T"),
            ("int32", "INT32_T"), ("int64", "INT64_T"), ("float32", "FLOAT"), ("float64", "DOUBLE"))}
        float16 = getattr(MPI, "FLOAT16_T", MPI.DATATYPE_NULL)  # MPICH >= 4.x: MPIX_C_FLOAT16
        if float16 != MPI.DATATYPE_NULL:
            self._types[np.dtype("float16")] = float16

    def bind(self, case: Case, x: Any, out: Any) -> Callable[[], Any] | None:
        MPI, comm, op, root, rank = self.MPI, self.comm, case.op, case.root, case.comm.rank
        if op == "barrier":
            return comm.Barrier  # type: ignore[no-any-return]
        T = None if case.arr.dtype_name == "bfloat16" else self._types.get(np.dtype(case.arr.dtype_name))
        on_device = case.arr.lib == "cupy" or (case.arr.lib == "torch" and x.is_cuda)
        if T is None or (on_device and not self._cuda_aware()):
            return None  # no such datatype; device memory that this MPI cannot take
        # AVG is SUM (then a division ours makes); MPI reduces C_BOOL with the logical ops only.
        name = {"avg": "SUM"}.get(case.redop, case.redop.upper())
        if case.arr.dtype_name == "bool":
            name = {"MIN": "LAND", "MAX": "LOR", "BAND": "LAND", "BOR": "LOR", "BXOR": "LXOR"}.get(name, name)
        mpi_op = getattr(MPI, name)
        if case.arr.lib == "torch" and not x.is_cuda and op in ("all_reduce", "broadcast"):
            # A torch CPU tensor: what a raw mpi4py caller writes, its numpy view each call.
            if op == "all_reduce":
                return lambda: comm.Allreduce(MPI.IN_PLACE, [x.numpy(), T], mpi_op)
            return lambda: comm.Bcast([x.numpy(), T], root)
        if case.arr.lib == "torch" and not x.is_cuda:
            x, out = x.numpy(), None if out is None else out.numpy()
        spec, out_spec = [x, T], None if out is None else [out, T]
        n = case.comm.size
        if op == "all_reduce":
            return lambda: comm.Allreduce(MPI.IN_PLACE, spec, mpi_op)
        if op == "broadcast":
            return lambda: comm.Bcast(spec, root)
        if op == "reduce":
            send, recv = (MPI.IN_PLACE, spec) if rank == root else (spec, None)
            return lambda: comm.Reduce(send, recv, mpi_op, root)
        if op == "all_gather":
            return lambda: comm.Allgather(spec, out_spec)
        if op == "all_gather_v":
            # What a program that does not know the other ranks' counts must do: gather them
            # (one int a rank), then the v-collective (mpi4py computes the displacements).
            mine, counts = np.array([len(x)], np.int32), np.empty(n, np.int32)
            count_specs = ([mine, MPI.INT32_T], [counts, MPI.INT32_T])

            def all_gather_v() -> None:
                comm.Allgather(*count_specs)
                comm.Allgatherv(spec, [out, counts, T])
            return all_gather_v
        if op == "reduce_scatter":
            return lambda: comm.Reduce_scatter_block(spec, out_spec, mpi_op)
        if op == "gather":
            return lambda: comm.Gather(spec, out_spec, root)
        if op == "scatter":
            return lambda: comm.Scatter(spec, out_spec, root)
        if op == "all_to_all":
            return lambda: comm.Alltoall(spec, out_spec)
        if op == "all_to_all_v":
            # Each rank knows what it sends; what it receives travels first (one int a pair).
            send_counts, recv_counts = np.array(case.splits[rank], np.int32), np.empty(n, np.int32)
            count_specs = ([send_counts, MPI.INT32_T], [recv_counts, MPI.INT32_T])

            def all_to_all_v() -> None:
                comm.Alltoall(*count_specs)
                comm.Alltoallv([x, send_counts, T], [out, recv_counts, T])
            return all_to_all_v
        if op == "send_recv":
            return ping_pong(rank, n, lambda peer: comm.Send(spec, peer), lambda peer: comm.Recv(out_spec, peer),
                             lambda peer: comm.Send(out_spec, peer))
        return None

    def round(self, case: Case, x: Any) -> Callable[[], Any] | None:
        if case.op in UNROUNDED:
            return None
        MPI, comm, word = self.MPI, self.comm, np.zeros(1, np.int64)
        spec = [word, MPI.INT64_T]
        return lambda: comm.Allreduce(MPI.IN_PLACE, spec, MPI.BAND)

    def _cuda_aware(self) -> bool:
        from collectives.backends.mpi_buffers import mpi_cuda_aware  # noqa: PLC0415

        return bool(mpi_cuda_aware(self.MPI))

    def barrier(self) -> None:
        self.comm.Barrier()


class RawTorch(Raw):
    """torch.distributed on the communicator's process group."""

    name = "torch.distributed"

    def __init__(self, comm: Any) -> None:
        import torch.distributed as dist  # noqa: PLC0415

        self.dist, self.group, self._comm = dist, comm.process_group, comm

    def _global(self, rank: int) -> int:
        return rank if self.group is None else int(self.dist.get_global_rank(self.group, rank))

    def bind(self, case: Case, x: Any, out: Any) -> Callable[[], Any] | None:
        dist, group, op = self.dist, self.group, case.op
        if op == "barrier":
            return lambda: dist.barrier(group)
        dtype, reducing = case.arr.dtype_name, op in ("all_reduce", "reduce", "reduce_scatter")
        if dtype == "int16" or (x.is_cuda and reducing and (dtype == "bool" or case.redop in ("band", "bor", "bxor"))):
            return None  # Gloo and NCCL have no int16; NCCL no bool or bitwise reductions
        # AVG is SUM (then a division ours makes: Gloo has no AVG)
        reduce_op = getattr(dist.ReduceOp, {"prod": "PRODUCT", "avg": "SUM"}.get(case.redop, case.redop.upper()))
        root, rank, n = self._global(case.root), case.comm.rank, case.comm.size
        if op == "all_reduce":
            return lambda: dist.all_reduce(x, reduce_op, group)
        if op == "broadcast":
            return lambda: dist.broadcast(x, root, group)
        if op == "reduce":
            return lambda: dist.reduce(x, root, reduce_op, group)
        # the single-tensor forms (torch >= 2.12 names; the older ones are deprecated there)
        if op == "all_gather":
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            flat = out.view(-1)
            return lambda: gather(flat, x, group)
        if op == "reduce_scatter":
            scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            return lambda: scatter(out, x, reduce_op, group)
        if op == "gather":
            rows = list(out) if out is not None else None
            return lambda: dist.gather(x, rows, root, group)
        if op == "scatter":
            rows = list(x) if rank == case.root else None
            return lambda: dist.scatter(out, rows, root, group)
        if op == "all_to_all":
            return lambda: dist.all_to_all_single(out, x, group=group)
        if op == "all_to_all_v":
            # What it receives travels first (one int a pair), as a program without us must.
            torch = sys.modules["torch"]
            send = case.splits[rank]
            send_counts = torch.tensor(send, dtype=torch.int64, device=x.device)
            recv_counts = torch.empty_like(send_counts)

            def all_to_all_v() -> None:
                dist.all_to_all_single(recv_counts, send_counts, group=group)
                dist.all_to_all_single(out, x, recv_counts.tolist(), send, group=group)
            return all_to_all_v
        if op == "send_recv":
            peer_of = self._global
            return ping_pong(rank, n, lambda peer: dist.send(x, peer_of(peer), group),
                             lambda peer: dist.recv(out, peer_of(peer), group),
                             lambda peer: dist.send(out, peer_of(peer), group))
        return None  # all_gather_v: torch.distributed has no uneven all_gather

    def round(self, case: Case, x: Any) -> Callable[[], Any] | None:
        if case.op in UNROUNDED or x.is_cuda:  # (a CUDA tensor's check goes beside it)
            return None
        dist, group, torch = self.dist, self.group, sys.modules["torch"]
        word = torch.zeros(1, dtype=torch.int64)
        return lambda: dist.all_reduce(word, group=group)

    def barrier(self) -> None:
        self._comm.barrier()


class RawNccl(Raw):
    """cupy.cuda.nccl.NcclCommunicator on the current CuPy stream."""

    name = "cupy.cuda.nccl"

    def __init__(self, comm: Any) -> None:
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        self.cupy, self.nccl, self._comm = cupy, nccl, comm
        self.comm = comm.nccl_comm
        self._types = {np.dtype(k): getattr(nccl, v) for k, v in (
            ("int8", "NCCL_INT8"), ("uint8", "NCCL_UINT8"), ("int32", "NCCL_INT32"),
            ("int64", "NCCL_INT64"), ("float16", "NCCL_FLOAT16"), ("float32", "NCCL_FLOAT32"),
            ("float64", "NCCL_FLOAT64"))}

    def bind(self, case: Case, x: Any, out: Any) -> Callable[[], Any] | None:
        nccl, nc, op = self.nccl, self.comm, case.op
        dtype = self._types.get(np.dtype(x.dtype)) if case.arr.lib == "cupy" else None
        if dtype is None or op == "barrier":
            return None
        redop = getattr(nccl, "NCCL_" + case.redop.upper(), None)
        stream = self.cupy.cuda.get_current_stream
        ptr, count, root, rank, n = x.data.ptr, x.size, case.root, case.comm.rank, case.comm.size
        item = x.itemsize
        out_ptr: Any = None if out is None else out.data.ptr
        if op in ("all_reduce", "reduce", "reduce_scatter") and redop is None:
            return None
        if op == "all_reduce":
            return lambda: nc.allReduce(ptr, ptr, count, dtype, redop, stream().ptr)
        if op == "broadcast":
            return lambda: nc.broadcast(ptr, ptr, count, dtype, root, stream().ptr)
        if op == "reduce":
            return lambda: nc.reduce(ptr, ptr, count, dtype, redop, root, stream().ptr)
        if op == "all_gather":
            return lambda: nc.allGather(ptr, out_ptr, count, dtype, stream().ptr)
        if op == "reduce_scatter":
            return lambda: nc.reduceScatter(ptr, out_ptr, out.size, dtype, redop, stream().ptr)
        if op == "send_recv":
            return ping_pong(rank, n, lambda peer: nc.send(ptr, count, dtype, peer, stream().ptr),
                             lambda peer: nc.recv(out_ptr, count, dtype, peer, stream().ptr),
                             lambda peer: nc.send(out_ptr, count, dtype, peer, stream().ptr))
        # the rest: sends and receives of each piece in one NCCL group
        moves: list[tuple[str, Any, int, int]] = []  # (send|recv, pointer, count, peer)
        if op == "gather":
            moves.append(("send", ptr, count, root))
            if rank == root:
                moves += [("recv", out_ptr + j * count * item, count, j) for j in range(n)]
        elif op == "scatter":
            per = case.per
            if rank == root:
                moves += [("send", ptr + j * per * item, per, j) for j in range(n)]
            moves.append(("recv", out_ptr, per, root))
        elif op == "all_to_all":
            per = case.per
            for j in range(n):
                moves += [("send", ptr + j * per * item, per, j), ("recv", out_ptr + j * per * item, per, j)]
        elif op == "all_gather_v":
            offsets = [sum(case.counts[:j]) for j in range(n)]
            for j in range(n):
                moves += [("send", ptr, count, j), ("recv", out_ptr + offsets[j] * item, case.counts[j], j)]
        elif op == "all_to_all_v":
            send = case.splits[rank]
            recv = [case.splits[j][rank] for j in range(n)]
            for j in range(n):
                moves += [("send", ptr + sum(send[:j]) * item, send[j], j),
                          ("recv", out_ptr + sum(recv[:j]) * item, recv[j], j)]

        def grouped() -> None:
            s = stream().ptr
            nccl.groupStart()
            for kind, pointer, elements, peer in moves:
                if elements:
                    getattr(nc, kind)(pointer, elements, dtype, peer, s)
            nccl.groupEnd()
        return grouped

    def barrier(self) -> None:
        self._comm.barrier()


def raw_for(comm: Any) -> Raw | None:
    """The bare transport of ``comm`` (None for the local backend, which has none)."""
    kind = {"mpi": RawMPI, "torch": RawTorch, "cupy": RawNccl}.get(comm.backend)
    return None if kind is None else kind(comm)
