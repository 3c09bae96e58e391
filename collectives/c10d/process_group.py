"""``ProcessGroupCollectives``: a ``torch.distributed.ProcessGroup`` made of a Communicator.

Each torch operation becomes one call (or a few) of the Communicator's collective set,
through its one call path: the same checks, sequence numbers, fingerprints
(``COLLECTIVES_DEBUG=1``) and timeouts (``COLLECTIVES_TIMEOUT``) as every other call.
The operation runs on the group's worker thread (see :mod:`collectives.c10d.worker`),
but over the cupy transport an operation on CUDA tensors is enqueued on the caller's stream
by the caller's thread (see ``collectives.c10d.streams``); what can be checked without
communicating (the reduce op, dtype x op, the device) is checked at once, on the caller's
thread, so a bad call raises there on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from collectives import arrays
from collectives.checks import in_backward_pass
from collectives.communicator import Communicator
from collectives.errors import CollectiveMismatch
from collectives.ops import ReduceOp
from collectives.work import AllOf, Work

from . import arguments
from .agreement import agree, agree_splits
from .arguments import REDUCE_OPS, reduce_op
from .streams import FutureWatch, StreamWork, TorchStreams, after_current_stream, after_end
from .worker import CollectivesWork, Started, Worker

#: A handle of the group's: of an operation on its worker, or enqueued on the caller's stream.
GroupWork = CollectivesWork | StreamWork
#: The name torch knows this backend by (``init_process_group(backend=...)``).
BACKEND_NAME = "collectives"

def _refused(call: Callable[[Communicator, torch.Tensor, Any], Any], comm: Communicator, t: torch.Tensor,
             op: Any) -> None:
    """``call(comm, t, op)``, which the communicator refuses after its check's round (see
    ``ProcessGroupCollectives._reduce_op``); its error was raised at the call already."""
    try:
        call(comm, t, op)
    except (TypeError, ValueError):
        pass


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
            if self._host is not None and not any(self._on_device(t) for t in _tensors(args)):
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
    group every device of its group. Over the cupy transport the operations on CUDA tensors
    run on ``comm``, on the thread that made the group (or a backward pass's), enqueued on
    the caller's stream (``collectives.c10d.streams``)."""

    def __init__(self, comm: Communicator, worker_comm: Communicator, rank: int, size: int,
                 host: Any = None) -> None:
        super().__init__(rank, size)
        self.comm = comm
        self._host = host
        # The stream-ordered operations' streams (cupy: NCCL runs on the caller's stream), the
        # thread that may make them (the one that made comm), and their futures' watch.
        self._streams = TorchStreams(comm.device) if comm.backend == "cupy" else None  # type: ignore[attr-defined]
        self._caller = threading.get_ident()
        self._futures = FutureWatch(f"collectives-pg-{comm.backend}-{id(self):x}-stream")
        # A fault-tolerant communicator hears of its group's failed operations: torch hands
        # their errors to the caller as RuntimeError, which collectives.elastic.run reads as a
        # RankFailure through the communicator (its part FaultTolerance.failed_elsewhere).
        fault = getattr(comm, "_fault", None)
        failed = None if fault is None else fault.failed_elsewhere
        self._worker = Worker(worker_comm, f"collectives-pg-{comm.backend}-{id(self):x}", failed)
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

    def __repr__(self) -> str:
        return f"ProcessGroupCollectives(rank={self.rank()}, size={self.size()}, comm={self.comm!r})"

    def shutdown(self) -> None:
        self._worker.stop()
        self._futures.stop()

    def abort(self) -> None:
        self.shutdown()

    # -- what torch asks of a group's devices ---------------------------------------------

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices the group takes tensors on, as torch lists a Gloo group's: torch's own
        code reads them (torch.distributed.checkpoint's broadcast_from_rank0 and async_save,
        object collectives). Every transport takes CPU tensors (cupy's through its host
        backend) and CUDA tensors (mpi stages them through the host where it must)."""
        return [torch.device("cuda"), torch.device("cpu")]

    def _get_backend(self, device: Any) -> Any:
        """The backend torch's code finds for ``device``: the host backend for CPU tensors
        where the group has one, else the group itself (a Python process group is its own
        backend: it has no torch Backend object per device; from 2.14 ``batch_isend_irecv``
        asks every group for its device's backend, to see whether it coalesces)."""
        kind = torch.device(device).type
        if kind not in ("cpu", "cuda"):
            raise RuntimeError(f"No backend type associated with device type {kind}")
        return self._host if kind == "cpu" and self._host is not None else self

    #: What torch's code asks of a backend before it tries a backend-specific path.
    supports_splitting = False
    supports_coalescing = False

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    # -- the operations --------------------------------------------------------------------

    def _submit(self, tensors: list[torch.Tensor], operation: Any, name: str) -> GroupWork:
        for t in tensors:
            self._check_device(t)
            arrays.TORCH.dtype_name(t)  # a dtype the transports take (TypeError, at the call)
        if self._stream_ordered(tensors):
            return self._on_stream(operation, name)
        if any(t.is_cuda for t in tensors):
            operation = after_current_stream(operation, tensors)
        return self._worker.submit(operation, name)

    def _on_device(self, t: torch.Tensor) -> bool:  # (the twin's: every tensor)
        return bool(t.is_cuda)

    def _stream_ordered(self, tensors: list[torch.Tensor]) -> bool:
        """Whether an operation on ``tensors`` is enqueued on the caller's stream by the caller's
        thread (:meth:`_on_stream`): over the cupy transport, device tensors, on the thread that
        may call ``comm``."""
        return self._streams is not None and any(self._on_device(t) for t in tensors) and \
            (threading.get_ident() == self._caller or in_backward_pass())

    def _on_stream(self, operation: Callable[[Communicator], Any], name: str) -> StreamWork:
        """``operation(comm)`` here, enqueued on the current stream: its handle. Errors found once
        the ranks compared their calls: a ``CollectiveMismatch``, as on the worker."""
        try:
            value = operation(self.comm)
        except (TypeError, ValueError) as error:
            raise CollectiveMismatch(str(error)) from error
        if isinstance(value, Started):  # sends and recvs: the communicator's handle ends them
            return StreamWork(value.handle, value.value, name, self.comm, self._futures)
        assert self._streams is not None
        return StreamWork(self._streams.end(), value, name, self.comm, self._futures)

    def _refusal(self, t: torch.Tensor, operation: Callable[[Communicator], Any], name: str) -> None:
        """A refusing rank's part in the call it refused, where the others make it (its own
        error is raised at the call)."""
        if self._stream_ordered([t]):
            with contextlib.suppress(CollectiveMismatch):
                operation(self.comm)
        else:
            self._worker.submit(operation, name)

    def _check_device(self, t: torch.Tensor) -> None:
        if t.is_cuda and self.comm.backend == "local":
            return
        if not self._on_device(t) and self.comm.backend == "cupy":
            raise TypeError(f"the 'collectives' backend over the cupy transport takes CUDA tensors; "
                            f"got a tensor on {t.device} (use 'cpu:gloo,cuda:collectives' for CPU "
                            "tensors, or COLLECTIVES_BACKEND=mpi)")
        if t.device.type not in ("cpu", "cuda"):
            raise TypeError(f"the 'collectives' backend ({self.comm.backend} transport) takes CPU "
                            f"and CUDA tensors; got a tensor on {t.device}")

    def _check_rooted(self, operation: str, check: Any, outputs: Any, inputs: Any, root: int) -> None:
        """``check`` a rooted call's arguments; a rank that refuses it (its list is wrong)
        still takes part in the call's agreement, so the others learn it and raise too (see
        :mod:`collectives.c10d.agreement`), then raises here, at the call."""
        try:
            check(outputs, inputs, root, self.rank(), self.size())
        except (TypeError, ValueError) as error:
            single = inputs if operation == "gather" else outputs  # the tensor every rank passes
            if len(single) == 1:
                t, reason = single[0], str(error)
                self._refusal(t, lambda comm: agree(comm, operation, t, reason), f"{operation} (refused)")
            raise

    def _each_tensor(self, tensors: list[torch.Tensor], call: Callable[[Communicator, torch.Tensor], Any],
                     name: str) -> GroupWork:
        """``call(comm, t)`` for each tensor of ``tensors``, in place (arguments checked)."""
        def run(comm: Communicator) -> Any:
            for t in tensors:
                call(comm, t)
            return tensors
        return self._submit(tensors, run, name)

    def _reduce_op(self, opts: Any, tensors: list[torch.Tensor],
                   call: Callable[[Communicator, torch.Tensor, Any], Any]) -> ReduceOp:
        """:func:`reduce_op` of ``opts``' op on ``tensors``. A rank that refuses it (the op, or
        the op on a tensor's dtype) raises here, at the call; its worker still makes the call of
        its one tensor, ``call(comm, t, op)``, which the communicator refuses in the call's check
        (nothing sent), so the other ranks raise :class:`~collectives.CollectiveMismatch` naming
        this rank and why, and the group stays in step."""
        torch_op = _opt(opts, "reduceOp", dist.ReduceOp.SUM)
        try:
            return reduce_op(torch_op, tensors)
        except (TypeError, ValueError):
            if len(tensors) == 1:
                t, op = tensors[0], REDUCE_OPS.get(getattr(torch_op, "op", torch_op), torch_op)
                self._refusal(t, lambda comm: _refused(call, comm, t, op), "refused reduction")
            raise

    @_operation("allreduce")
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> GroupWork:
        if any(t.layout == torch.sparse_coo for t in tensors):
            arguments.sparse_allreduce(tensors, _opt(opts, "reduceOp", dist.ReduceOp.SUM))

            def run(comm: Communicator) -> Any:
                for t in tensors:
                    _sparse_all_reduce(comm, t)
                return tensors
            return self._submit([t._values() for t in tensors], run, "all_reduce")  # (their devices, dtypes)
        arguments.allreduce(tensors)
        op = self._reduce_op(opts, tensors, lambda comm, t, op: comm.all_reduce(t, op))
        return self._each_tensor(tensors, lambda comm, t: comm.all_reduce(t, op), "all_reduce")

    @_operation("allreduce_coalesced")
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    @_operation("broadcast")
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> GroupWork:
        arguments.allreduce(tensors)
        root = _opt(opts, "rootRank", 0)
        return self._each_tensor(tensors, lambda comm, t: comm.broadcast(t, root), "broadcast")

    @_operation("reduce")
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> GroupWork:
        arguments.allreduce(tensors)
        root = _opt(opts, "rootRank", 0)
        op = self._reduce_op(opts, tensors, lambda comm, t, op: comm.reduce(t, op, root))
        return self._each_tensor(tensors, lambda comm, t: comm.reduce(t, op, root), "reduce")

    @_operation("allgather")
    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> GroupWork:
        arguments.allgather(output_tensors, input_tensors, self.size())

        def run(comm: Communicator) -> Any:
            for outputs, x in zip(output_tensors, input_tensors):
                _gather_into(comm, outputs, x)
            return _gloo_value(output_tensors)
        return self._submit([*input_tensors, *_flat(output_tensors)], run, "all_gather")

    @_operation("allgather_coalesced")
    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
                            opts: Any = None) -> GroupWork:
        arguments.allgather_coalesced(output_lists, input_list, self.size())

        # output_lists[r][i] receives rank r's input_list[i].
        def run(comm: Communicator) -> Any:
            for i, x in enumerate(input_list):
                _gather_into(comm, [outputs[i] for outputs in output_lists], x)
            return _gloo_value(output_lists)
        return self._submit([*input_list, *_flat(output_lists)], run, "all_gather_coalesced")

    @_operation("_allgather_base")
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> GroupWork:
        arguments.all_gather_into_tensor(output, input, self.size())

        def run(comm: Communicator) -> Any:
            _all_gather_single(comm, output, input)
            return _chunks(output, comm.size)
        return self._submit([output, input], run, "all_gather_into_tensor")

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> GroupWork:
        self._check_pairs("all_gather_into_tensor", outputs, inputs, arguments.all_gather_into_tensor)
        return self._each_pair("all_gather_into_tensor", outputs, inputs, _all_gather_single)

    def _check_pairs(self, name: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                     check: Callable[[torch.Tensor, torch.Tensor, int], None]) -> None:
        """The arguments of ``name``_coalesced: one output per input, each pair as ``check`` says."""
        if len(outputs) != len(inputs):
            raise ValueError(f"{name}_coalesced: {len(outputs)} outputs for {len(inputs)} "
                             "inputs; it needs one output per input")
        for output, x in zip(outputs, inputs):
            check(output, x, self.size())

    def _each_pair(self, name: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                   single: Callable[[Communicator, torch.Tensor, torch.Tensor], Any]) -> GroupWork:
        """``name``_coalesced (arguments checked): ``single(comm, output, input)`` for each pair."""
        def run(comm: Communicator) -> Any:
            for output, x in zip(outputs, inputs):
                single(comm, output, x)
            return outputs
        return self._submit([*outputs, *inputs], run, f"{name}_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_operation("reduce_scatter")
    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> GroupWork:
        arguments.reduce_scatter(output_tensors, input_tensors, self.size())
        op = self._reduce_op(opts, output_tensors,
                             lambda comm, t, op: _reduce_scatter_single(comm, t, torch.stack(input_tensors[0]), op))

        def run(comm: Communicator) -> Any:
            for output, inputs in zip(output_tensors, input_tensors):
                _reduce_scatter_single(comm, output, torch.stack(inputs), op)
            return output_tensors
        return self._submit([*output_tensors, *_flat(input_tensors)], run, "reduce_scatter")

    @_operation("_reduce_scatter_base")
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> GroupWork:
        arguments.reduce_scatter_tensor(output, input, self.size())
        op = self._reduce_op(opts, [output], lambda comm, t, op: _reduce_scatter_single(comm, t, input, op))

        def run(comm: Communicator) -> Any:
            _reduce_scatter_single(comm, output, input, op)
            return [output]
        return self._submit([output, input], run, "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> GroupWork:
        self._check_pairs("reduce_scatter_tensor", outputs, inputs, arguments.reduce_scatter_tensor)
        op = reduce_op(_opt(opts, "reduceOp", dist.ReduceOp.SUM), outputs)
        return self._each_pair("reduce_scatter_tensor", outputs, inputs,
                               lambda comm, output, x: _reduce_scatter_single(comm, output, x, op))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    @_operation("alltoall_base")
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> GroupWork:
        output_splits, input_splits = list(output_split_sizes), list(input_split_sizes)
        arguments.all_to_all_single(output, input, output_splits, input_splits, self.size())

        def run(comm: Communicator) -> Any:
            _all_to_all_single(comm, output, input, output_splits, input_splits)
            return [output]
        return self._submit([output, input], run, "all_to_all_single")

    alltoall_base = all_to_all_single

    @_operation("alltoall")
    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> GroupWork:
        arguments.all_to_all(output_tensors, input_tensors, self.size())

        def run(comm: Communicator) -> Any:
            sends = [t.numel() for t in input_tensors]
            receives = [t.numel() for t in output_tensors]
            agree_splits(comm, "all_to_all", sends, receives, input_tensors[0].device)
            flat = torch.cat([t.reshape(-1) for t in input_tensors])
            received = comm.all_to_all(flat, sends)
            for t, piece in zip(output_tensors, received.split(receives)):
                t.copy_(piece.view(t.shape))
            return output_tensors
        return self._submit([*output_tensors, *input_tensors], run, "all_to_all")

    @_operation("gather")
    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> GroupWork:
        def run(comm: Communicator, root: int) -> Any:
            gathered = comm.gather(input_tensors[0], root)
            if gathered is not None:
                for row, t in zip(gathered, output_tensors[0]):
                    t.copy_(row)
            return _gloo_value(output_tensors)
        return self._rooted("gather", arguments.gather, output_tensors, input_tensors, opts, run,
                            lambda: [input_tensors[0], *_flat(output_tensors)])

    @_operation("scatter")
    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> GroupWork:
        def run(comm: Communicator, root: int) -> Any:
            output = output_tensors[0]
            if comm.rank == root:
                rows = torch.stack(input_tensors[0])
            else:  # only the root's rows are read; the others pass the shape
                rows = output.new_empty((comm.size, *output.shape))
            out = output if output.is_contiguous() else None
            result = comm.scatter(rows, root, out=out)
            if out is None:
                output.copy_(result)
            return output_tensors
        return self._rooted("scatter", arguments.scatter, output_tensors, input_tensors, opts, run,
                            lambda: [*output_tensors, *_flat(input_tensors)])

    def _rooted(self, operation: str, check: Any, outputs: Any, inputs: Any, opts: Any,
                body: Callable[[Communicator, int], Any], tensors: Callable[[], list[torch.Tensor]]
                ) -> GroupWork:
        """gather's and scatter's frame: the root from ``opts``, the arguments checked (see
        :meth:`_check_rooted`), then ``body(comm, root)`` once the ranks have agreed on the
        call (:mod:`collectives.c10d.agreement`); ``tensors()``: every tensor of the call."""
        root = _opt(opts, "rootRank", 0)
        self._check_rooted(operation, check, outputs, inputs, root)
        single = (inputs if operation == "gather" else outputs)[0]  # the tensor every rank passes

        def run(comm: Communicator) -> Any:
            agree(comm, operation, single, None)
            return body(comm, root)
        return self._submit(tensors(), run, operation)

    @_operation("send")
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> GroupWork:  # noqa: N803
        return self._point_to_point(tensors, dstRank, tag, "send", f"send to rank {dstRank} (tag {tag})")

    @_operation("recv")
    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> GroupWork:  # noqa: N803
        return self._point_to_point(tensors, srcRank, tag, "recv", f"recv from rank {srcRank} (tag {tag})")

    def _point_to_point(self, tensors: list[torch.Tensor], peer: int, tag: int, method: str,
                        name: str) -> GroupWork:
        """send or recv (``method``) of each tensor with ``peer``, started together: the work
        completes once all have."""
        def run(comm: Communicator) -> Any:
            move = getattr(comm, method)
            return Started(AllOf(move(t, peer, tag=tag, async_op=True) for t in tensors), tensors, name)
        return self._submit(tensors, run, name)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> GroupWork:
        """A recv from any source (``dist.recv(t)`` without ``src``): the work's ``_source_rank()``
        is the group rank that sent, as Gloo's (one tensor, as Gloo takes)."""
        if len(tensors) != 1:
            raise ValueError(f"recv from any source takes one tensor; got {len(tensors)}")
        name = f"recv from any source (tag {tag})"
        received: list[Work] = []

        def run(comm: Communicator) -> Any:
            received.append(comm.recv(tensors[0], None, tag=tag, async_op=True))
            return Started(received[0], tensors, name)
        work = self._submit(tensors, run, name)
        work.received = received
        return work

    def barrier(self, opts: Any = None) -> GroupWork:
        def run(comm: Communicator) -> Any:
            comm.barrier()
            return []
        if self._streams is not None:  # over cupy: after the NCCL calls on the caller's stream (as NCCL's)
            return self._submit([], after_end(run, self._streams.end()), "barrier")
        return self._submit([], run, "barrier")


# -- the operations' bodies (run on the worker) ------------------------------------------------

def _sparse_all_reduce(comm: Communicator, t: torch.Tensor) -> None:
    """The sum of every rank's sparse COO ``t``, into ``t``, as Gloo's: every rank's indices and
    values gathered (in rank order), then coalesced (duplicates summed)."""
    local = t.coalesce()
    indices, _ = comm.all_gather_v(local.indices().t().contiguous())
    values, _ = comm.all_gather_v(local.values().contiguous())
    t.copy_(torch.sparse_coo_tensor(indices.t(), values, t.shape).coalesce())


def _opt(opts: Any, name: str, default: Any) -> Any:
    return default if opts is None else getattr(opts, name, default)


def _flat(lists: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t for inner in lists for t in inner]


def _gloo_value(lists: list[list[torch.Tensor]]) -> Any:
    """A future's value as Gloo gives it: no list, ``[]``; one list, that list; several,
    the list of them."""
    if not lists:
        return []
    return lists if len(lists) > 1 else lists[0]


def _chunks(output: torch.Tensor, size: int) -> list[torch.Tensor]:
    """all_gather_into_tensor's future value, as Gloo's: the output's row blocks, one per rank."""
    if output.dim() and output.shape[0] % size == 0:
        return list(output.chunk(size))
    return [output]


def _gather_into(comm: Communicator, outputs: list[torch.Tensor], x: torch.Tensor) -> None:
    """all_gather of ``x`` into ``outputs`` (one tensor per rank; rows may differ by rank)."""
    if all(t.shape == x.shape for t in outputs):
        gathered = comm.all_gather(x)
        for t, row in zip(outputs, gathered):
            t.copy_(row)
        return
    everything, counts = comm.all_gather_v(x.reshape(-1))
    wrong = [(rank, t.numel(), count) for rank, (t, count) in enumerate(zip(outputs, counts))
             if t.numel() != count]
    if wrong:
        raise CollectiveMismatch(
            "all_gather: the output tensors do not hold what the ranks sent: " + "; ".join(
                f"tensor_list[{rank}] holds {held} elements, rank {rank} sent {count}" for rank, held, count in wrong))
    for t, piece in zip(outputs, everything.split(counts)):
        t.copy_(piece.view(t.shape))


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share memory (the transports refuse aliased send and receive buffers)."""
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _all_gather_single(comm: Communicator, output: torch.Tensor, x: torch.Tensor) -> None:
    if _overlap(x, output):  # in place (FSDP2 gathers from its own shard of the output)
        x = x.clone()
    if output.is_contiguous():
        comm.all_gather(x, out=output.view(comm.size, *x.shape))
    else:
        output.copy_(comm.all_gather(x).view(output.shape))


def _reduce_scatter_single(comm: Communicator, output: torch.Tensor, x: torch.Tensor, op: ReduceOp) -> None:
    rows = x.reshape(comm.size, output.numel())
    if output.is_contiguous() and not _overlap(x, output):
        comm.reduce_scatter(rows, op, out=output.view(1, -1))
    else:
        output.copy_(comm.reduce_scatter(rows, op).view(output.shape))


def _all_to_all_single(comm: Communicator, output: torch.Tensor, x: torch.Tensor,
                       output_splits: list[int], input_splits: list[int]) -> None:
    sends = input_splits or [x.shape[0] // comm.size] * comm.size
    if input_splits or output_splits:  # what each rank sends each rank is what that rank expects
        receives = output_splits or [output.shape[0] // comm.size] * comm.size
        agree_splits(comm, "all_to_all_single", sends, receives, x.device)
    received = comm.all_to_all(x, sends, out=output if output.is_contiguous() else None)
    if received is not output:
        output.copy_(received)

