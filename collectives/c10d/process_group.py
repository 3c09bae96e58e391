"""``ProcessGroupCollectives``: a ``torch.distributed.ProcessGroup`` made of a Communicator.

Each torch operation becomes one call (or a few) of the Communicator's collective set,
through its one call path: the same checks, sequence numbers, fingerprints
(``COLLECTIVES_DEBUG=1``) and timeouts (``COLLECTIVES_TIMEOUT``) as every other call.
The operation runs on the group's worker thread (see :mod:`collectives.c10d.worker`);
what can be checked without communicating (the reduce op, dtype x op, the device) is
checked at once, on the caller's thread, so a bad call raises there on every rank.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from collectives import arrays
from collectives.communicator import Communicator
from collectives.ops import ReduceOp, check_reduction
from collectives.work import AllOf

from .worker import CollectivesWork, Started, Worker

#: The name torch knows this backend by (``init_process_group(backend=...)``).
BACKEND_NAME = "collectives"

_RED: Any = dist.ReduceOp.RedOpType
#: torch's reduce ops, by their RedOpType, as ours.
REDUCE_OPS = {_RED.SUM: ReduceOp.SUM, _RED.PRODUCT: ReduceOp.PROD, _RED.MIN: ReduceOp.MIN,
              _RED.MAX: ReduceOp.MAX, _RED.BAND: ReduceOp.BAND, _RED.BOR: ReduceOp.BOR,
              _RED.BXOR: ReduceOp.BXOR, _RED.AVG: ReduceOp.AVG}


def reduce_op(op: Any, tensors: list[torch.Tensor]) -> ReduceOp:
    """Our ReduceOp for torch's ``op``, checked against the dtypes of ``tensors``."""
    kind = getattr(op, "op", op)
    if kind not in REDUCE_OPS:
        names = ", ".join(f"ReduceOp.{t.name}" for t in REDUCE_OPS)
        label = f"ReduceOp.{kind.name}" if hasattr(kind, "name") else repr(op)
        raise ValueError(f"the 'collectives' backend does not take {label}; it takes {names} "
                         "(PREMUL_SUM: multiply by the factor first, then reduce with SUM)")
    ours = REDUCE_OPS[kind]
    for t in tensors:
        check_reduction(arrays.TORCH.dtype_name(t), ours)
    return ours


def _tensors(args: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            found += _tensors(arg)
    return found


def _detached(args: Any) -> Any:
    """``args`` with every tensor detached (same memory): torch's backends write results
    without autograd (DDP's buckets require grad under ``backward(create_graph=True)``),
    where a Communicator refuses in-place writes into autograd tensors."""
    if isinstance(args, torch.Tensor):
        return args.detach() if args.requires_grad else args
    if isinstance(args, (list, tuple)):
        return type(args)(_detached(arg) for arg in args)
    return args


def _operation(host_name: str) -> Callable[[Any], Any]:
    """A torch operation of the group: its tensors detached, and handed to the group's host
    backend (``host_name`` there) when it has one and every tensor is on the CPU (the cupy
    transport takes CUDA tensors only)."""
    def wrap(method: Any) -> Any:
        @functools.wraps(method)
        def operation(self: Any, *args: Any) -> Any:
            args = _detached(args)
            if self._host is not None and not any(t.is_cuda for t in _tensors(args)):
                return getattr(self._host, host_name)(*args)
            return method(self, *args)
        return operation
    return wrap


# torch's stubs overload each operation two ways (the C++ one is what a subclass overrides).
_ProcessGroup: Any = dist.ProcessGroup


class ProcessGroupCollectives(_ProcessGroup):  # type: ignore[misc]
    """A torch process group over ``comm`` (every rank of it); ``worker_comm`` is a
    communicator over the same ranks that only the group's worker thread uses. ``host``: a
    torch backend (Gloo) that takes the operations on CPU tensors, for a transport that
    takes CUDA tensors only (cupy): torch's object collectives and the mixed form
    ``"cpu:gloo,cuda:collectives"`` need CPU tensors, and torch 2.13 gives a Python process
    group every device of its group."""

    def __init__(self, comm: Communicator, worker_comm: Communicator, rank: int, size: int,
                 host: Any = None) -> None:
        super().__init__(rank, size)
        self.comm = comm
        self._host = host
        self._worker = Worker(worker_comm, f"collectives-pg-{comm.backend}-{id(self):x}")
        self._group_name = ""
        self._group_desc = ""

    # -- identity -------------------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def _get_backend(self, device: Any) -> Any:
        """The group itself, for every device: it is its own backend (torch registers none for a
        Python group, and from 2.14 ``batch_isend_irecv`` asks every group for its device's
        backend, to see whether it coalesces: this one does not)."""
        return self

    def __repr__(self) -> str:
        return f"ProcessGroupCollectives(rank={self.rank()}, size={self.size()}, comm={self.comm!r})"

    def shutdown(self) -> None:
        self._worker.stop()

    def abort(self) -> None:
        self._worker.stop()

    # -- the operations --------------------------------------------------------------------

    def _submit(self, tensors: list[torch.Tensor], operation: Any) -> CollectivesWork:
        for t in tensors:
            self._check_device(t)
        if any(t.is_cuda for t in tensors):
            operation = _after_current_stream(operation, tensors)
        return self._worker.submit(operation)

    def _check_device(self, t: torch.Tensor) -> None:
        if t.is_cuda and self.comm.backend == "local":
            return
        if not t.is_cuda and self.comm.backend == "cupy":
            raise TypeError(f"the 'collectives' backend over the cupy transport takes CUDA tensors; "
                            f"got a tensor on {t.device} (use 'cpu:gloo,cuda:collectives' for CPU "
                            "tensors, or COLLECTIVES_BACKEND=mpi)")
        if t.device.type not in ("cpu", "cuda"):
            raise TypeError(f"the 'collectives' backend ({self.comm.backend} transport) takes CPU "
                            f"and CUDA tensors; got a tensor on {t.device}")

    @_operation("allreduce")
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> CollectivesWork:
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), tensors)

        def run(comm: Communicator) -> Any:
            for t in tensors:
                comm.all_reduce(t, op)
            return tensors
        return self._submit(tensors, run)

    @_operation("allreduce_coalesced")
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    @_operation("broadcast")
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> CollectivesWork:
        root = _opt(opts, "rootRank", 0)

        def run(comm: Communicator) -> Any:
            for t in tensors:
                comm.broadcast(t, root)
            return tensors
        return self._submit(tensors, run)

    @_operation("reduce")
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> CollectivesWork:
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), tensors)
        root = _opt(opts, "rootRank", 0)

        def run(comm: Communicator) -> Any:
            for t in tensors:
                comm.reduce(t, op, root)
            return tensors
        return self._submit(tensors, run)

    @_operation("allgather")
    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> CollectivesWork:
        def run(comm: Communicator) -> Any:
            for outputs, x in zip(output_tensors, input_tensors):
                _gather_into(comm, outputs, x)
            return output_tensors
        return self._submit([*input_tensors, *_flat(output_tensors)], run)

    @_operation("allgather_coalesced")
    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> CollectivesWork:
        # output_lists[r][i] receives rank r's input_list[i].
        def run(comm: Communicator) -> Any:
            for i, x in enumerate(input_list):
                _gather_into(comm, [outputs[i] for outputs in output_lists], x)
            return output_lists
        return self._submit([*input_list, *_flat(output_lists)], run)

    @_operation("_allgather_base")
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> CollectivesWork:
        def run(comm: Communicator) -> Any:
            _all_gather_single(comm, output, input)
            return [output]
        return self._submit([output, input], run)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> CollectivesWork:
        def run(comm: Communicator) -> Any:
            for output, x in zip(outputs, inputs):
                _all_gather_single(comm, output, x)
            return outputs
        return self._submit([*outputs, *inputs], run)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_operation("reduce_scatter")
    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> CollectivesWork:
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), output_tensors)

        def run(comm: Communicator) -> Any:
            for output, inputs in zip(output_tensors, input_tensors):
                stacked = torch.stack([t.reshape(output.shape) for t in inputs])
                _reduce_scatter_single(comm, output, stacked, op)
            return output_tensors
        return self._submit([*output_tensors, *_flat(input_tensors)], run)

    @_operation("_reduce_scatter_base")
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> CollectivesWork:
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), [output])

        def run(comm: Communicator) -> Any:
            _reduce_scatter_single(comm, output, input, op)
            return [output]
        return self._submit([output, input], run)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> CollectivesWork:
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), outputs)

        def run(comm: Communicator) -> Any:
            for output, x in zip(outputs, inputs):
                _reduce_scatter_single(comm, output, x, op)
            return outputs
        return self._submit([*outputs, *inputs], run)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    @_operation("alltoall_base")
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> CollectivesWork:
        def run(comm: Communicator) -> Any:
            _all_to_all_single(comm, output, input, list(output_split_sizes), list(input_split_sizes))
            return [output]
        return self._submit([output, input], run)

    alltoall_base = all_to_all_single

    @_operation("alltoall")
    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> CollectivesWork:
        def run(comm: Communicator) -> Any:
            flat = torch.cat([t.reshape(-1) for t in input_tensors])
            received = comm.all_to_all(flat, [t.numel() for t in input_tensors])
            if received.numel() != sum(t.numel() for t in output_tensors):
                raise ValueError(f"alltoall: the output tensors hold {sum(t.numel() for t in output_tensors)} "
                                 f"elements, but the ranks sent {received.numel()} to this rank")
            for t, piece in zip(output_tensors, received.split([t.numel() for t in output_tensors])):
                t.copy_(piece.view(t.shape))
            return output_tensors
        return self._submit([*output_tensors, *input_tensors], run)

    @_operation("gather")
    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> CollectivesWork:
        root = _opt(opts, "rootRank", 0)

        def run(comm: Communicator) -> Any:
            for i, x in enumerate(input_tensors):
                gathered = comm.gather(x, root)
                if gathered is not None:
                    for row, t in zip(gathered, output_tensors[i]):
                        t.copy_(row)
            return output_tensors
        return self._submit([*input_tensors, *_flat(output_tensors)], run)

    @_operation("scatter")
    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> CollectivesWork:
        root = _opt(opts, "rootRank", 0)

        def run(comm: Communicator) -> Any:
            for i, output in enumerate(output_tensors):
                if comm.rank == root:
                    rows = torch.stack([t.reshape(output.shape) for t in input_tensors[i]])
                else:  # only the root's rows are read; the others pass the shape
                    rows = output.new_empty((comm.size, *output.shape))
                out = output if output.is_contiguous() else None
                result = comm.scatter(rows, root, out=out)
                if out is None:
                    output.copy_(result)
            return output_tensors
        return self._submit([*output_tensors, *_flat(input_tensors)], run)

    @_operation("send")
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> CollectivesWork:  # noqa: N803
        def run(comm: Communicator) -> Any:
            return Started(AllOf(comm.send(t, dstRank, tag=tag, async_op=True) for t in tensors),
                           tensors, f"send to rank {dstRank} (tag {tag})")
        return self._submit(tensors, run)

    @_operation("recv")
    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> CollectivesWork:  # noqa: N803
        def run(comm: Communicator) -> Any:
            return Started(AllOf(comm.recv(t, srcRank, tag=tag, async_op=True) for t in tensors),
                           tensors, f"recv from rank {srcRank} (tag {tag})")
        return self._submit(tensors, run)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> CollectivesWork:
        raise ValueError("the 'collectives' backend has no recv from any source; name the src rank")

    def barrier(self, opts: Any = None) -> CollectivesWork:
        def run(comm: Communicator) -> Any:
            comm.barrier()
            return []
        return self._submit([], run)


# -- the operations' bodies (run on the worker) ------------------------------------------------

def _opt(opts: Any, name: str, default: Any) -> Any:
    return default if opts is None else getattr(opts, name, default)


def _flat(lists: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for inner in lists for t in inner]


def _gather_into(comm: Communicator, outputs: list[torch.Tensor], x: torch.Tensor) -> None:
    """all_gather of ``x`` into ``outputs`` (one tensor per rank; sizes may differ by rank)."""
    if len(outputs) != comm.size:
        raise ValueError(f"all_gather needs a list of {comm.size} output tensors (one per rank); "
                         f"got {len(outputs)}")
    if all(t.shape == x.shape for t in outputs):
        gathered = comm.all_gather(x)
        for t, row in zip(outputs, gathered):
            t.copy_(row)
        return
    everything, counts = comm.all_gather_v(x.reshape(-1))
    for rank, (t, piece) in enumerate(zip(outputs, everything.split(counts))):
        if t.numel() != piece.numel():
            raise ValueError(f"all_gather: output tensor {rank} holds {t.numel()} elements, but rank "
                             f"{rank} sent {piece.numel()}")
        t.copy_(piece.view(t.shape))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share memory (the transports refuse aliased send and receive buffers)."""
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _all_gather_single(comm: Communicator, output: torch.Tensor, x: torch.Tensor) -> None:
    if output.numel() != comm.size * x.numel():
        raise ValueError(f"all_gather_into_tensor needs an output of size * input.numel() = "
                         f"{comm.size * x.numel()} elements; got {output.numel()}")
    if _overlap(x, output):  # in place (FSDP2 gathers from its own shard of the output)
        x = x.clone()
    if output.is_contiguous():
        comm.all_gather(x, out=output.view(comm.size, *x.shape))
    else:
        output.copy_(comm.all_gather(x).view(output.shape))


def _reduce_scatter_single(comm: Communicator, output: torch.Tensor, x: torch.Tensor, op: ReduceOp) -> None:
    if x.numel() != comm.size * output.numel():
        raise ValueError(f"reduce_scatter_tensor needs an input of size * output.numel() = "
                         f"{comm.size * output.numel()} elements; got {x.numel()}")
    rows = x.reshape(comm.size, output.numel())
    if output.is_contiguous() and not _overlap(x, output):
        comm.reduce_scatter(rows, op, out=output.view(1, -1))
    else:
        output.copy_(comm.reduce_scatter(rows, op).view(output.shape))


def _all_to_all_single(comm: Communicator, output: torch.Tensor, x: torch.Tensor,
                       output_splits: list[int], input_splits: list[int]) -> None:
    if not input_splits:
        if x.shape[0] % comm.size if x.dim() else True:
            raise ValueError(f"all_to_all_single without split sizes needs input.shape[0] divisible "
                             f"by size={comm.size}; got input.shape={tuple(x.shape)}")
        input_splits = [x.shape[0] // comm.size] * comm.size
    # output_split_sizes need not travel: every rank's input splits do (our all_to_all
    # exchanges them first), and an output of another length is an error on every rank.
    received = comm.all_to_all(x, input_splits, out=output if output.is_contiguous() else None)
    if received is not output:
        output.copy_(received)




def _after_current_stream(operation: Any, tensors: list[torch.Tensor]) -> Any:
    """``operation``, run once the caller's current CUDA stream has produced ``tensors``
    (the worker's stream knows nothing of it); the worker waits for its own stream after."""
    device = next(t.device for t in tensors if t.is_cuda)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))

    def on_device(comm: Communicator) -> Any:
        with torch.cuda.device(device):
            ready.synchronize()
            value = operation(comm)
            torch.cuda.current_stream(device).synchronize()
        return value
    return on_device
