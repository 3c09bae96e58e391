"""The torch backend's plans: what the first call of a kind (row, dtype, op) of plain tensors
binds once, so that the later calls of that kind make one check of the tensor and the process
group's own call.

torch.distributed's functions (``dist.all_reduce`` ...) rebuild the same things on every call: an
options object, the group looked up, the tensor checked again. A plan makes them once: the
process group's bound method (``ProcessGroup.allreduce``, ``broadcast``, ``reduce``,
``all_gather_single``, ``reduce_scatter_single``, ``gather``, ``scatter``, ``alltoall_base``,
``send``, ``recv``), its options objects (one blocking, one asynchronous, with the reduce op or
root set) and torch's reduce op. What ``dist.*`` does besides is done once too (the group is
this transport's, its rank in it); its coalescing manager (``dist._coalescing_manager``) and its
torch-function modes are for torch's own calls, not for a communicator's.

The kinds planned: all_reduce, reduce and reduce_scatter where every torch transport reduces the
dtype x op as it is (``torch_dist._DIRECT``; reduce as backends/torch_reduce.py starts it: off
dst x is never Gloo's scratch), broadcast of every dtype it moves as it is, all_gather, gather, scatter and
the even all_to_all of the dtypes every transport gathers as they are (all of these but
all_reduce, broadcast and reduce only where this communicator's rank order is torch's), and send
and recv from a named rank of those dtypes (``ProcessGroup.send``/``recv``). Every
other kind, array and tensor (numpy and CuPy arrays, a non-contiguous or read-only tensor, a tensor
subclass, an empty x of gather, scatter or all_to_all) takes the row's method.

A plain CUDA tensor of a planned kind on a group with NCCL takes the same plan through the kind's
method (``device_check``), never its fast path: its call is ordered on the caller's current
stream (torch's ``asyncOp`` off: a blocking NCCL call runs there, and its handle's ``wait()`` makes
the stream wait, not the host), its check goes beside it and its timeout is watched after it
(torch_dist's ``_method_of``), as a CUDA tensor's row method does, without ``dist.*``'s Python.

Imports: the interface (arrays, calls) and torch_handles; never torch_dist (which calls these).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collectives import arrays, calls
from collectives.calls import NOT_TAKEN, Request
from collectives.ops import ReduceOp

from . import torch_reduce
from .torch_handles import _TorchWork, launch_batch, pending_batches

_AVG = ReduceOp.AVG
_check_array = arrays.TORCH.check_array


def plain_tensor(torch: Any) -> Callable[[Any], bool]:
    """Whether a tensor is one a plan's process-group call takes as it is: a plain torch tensor,
    dense, contiguous, without a negative bit, not requiring grad (autograd would track the views
    torch's call makes of it); it passes ``TorchAdapter.check_array`` on CPU and CUDA."""
    tensor, strided = torch.Tensor, torch.strided

    def plain(x: Any) -> bool:
        return type(x) is tensor and x.is_contiguous() and not x.requires_grad and x.layout is strided \
            and not x.is_nested and not x.is_neg()

    return plain


def tensor_check(torch: Any, stream_device: str = "cuda") -> Callable[[Any, bool], Any]:
    """The per-array check of the planned kinds (see ``Transport._array_check``): ``x`` itself
    where the plan's fast path takes it as it is (a plain CPU tensor: ``plain_tensor``); ``None``
    for a plain tensor on ``stream_device`` (its checks hold: the kind's method takes it, see
    ``device_check``; "cpu": a CPU twin of CUDA's, every plain tensor); else
    ``TorchAdapter.check_array``'s verdict (its error, or ``None``: the row's method takes x)."""
    plain, twin = plain_tensor(torch), stream_device == "cpu"

    def check(x: Any, in_place: bool) -> Any:
        if plain(x):
            if x.is_cpu and not twin:
                return x
            if twin or x.is_cuda:
                return None
        _check_array(x, in_place)
        return None

    return check


def device_check(torch: Any, stream_device: str = "cuda") -> Callable[[Any], Any]:
    """What a kind's method takes on a device stream (see the module's docstring): ``x`` itself
    where it is a plain tensor (``plain_tensor``) on ``stream_device`` ("cpu": the CPU twin's),
    else ``None`` (the row's method)."""
    plain, on_cpu = plain_tensor(torch), stream_device == "cpu"
    return lambda x: x if plain(x) and (x.is_cpu if on_cpu else x.is_cuda) else None


class _Options:
    """A kind's options objects: blocking and asynchronous (torch's ``asyncOp``: a blocking NCCL
    call runs on the current stream), made once with ``fields`` set; ``rooted`` ones per root."""

    __slots__ = ("make", "fields", "blocking", "asynchronous", "rooted")

    def __init__(self, make: Any, **fields: Any) -> None:
        self.make, self.fields = make, fields
        self.blocking, self.asynchronous = self.new(False), self.new(True)
        self.rooted: dict[tuple[int, bool], Any] = {}

    def new(self, async_op: bool, **more: Any) -> Any:
        options = self.make()
        for name, value in {**self.fields, **more}.items():
            setattr(options, name, value)
        if hasattr(options, "asyncOp"):  # (torch >= 2.7)
            options.asyncOp = async_op
        return options

    def root(self, root: int, async_op: bool) -> Any:
        """The options of a rooted call whose root is torch's group rank ``root``."""
        options = self.rooted.get((root, async_op))
        if options is None:
            fields = {"rootRank": root, "rootTensor": 0} if hasattr(self.blocking, "rootTensor") else {"rootRank": root}
            options = self.rooted[root, async_op] = self.new(async_op, **fields)
        return options


def process_group(transport: Any) -> Any:
    """The transport's torch ProcessGroup object (the default group's where it holds None)."""
    group = transport._group
    return group if group is not None else transport._dist.distributed_c10d._get_default_group()


def fast_path(transport: Any, call: Any, dtype: str, op: ReduceOp | None,
              direct: dict[str, dict[ReduceOp, ReduceOp]], gather_direct: frozenset[str],
              narrow: dict[str, str], batches: Callable[[Any], bool],
              device: Callable[[Any], Any] | None = None
              ) -> tuple[Callable[..., Any], Callable[[Request], Any]] | None:
    """The blocking fast path ``(t, root, out, extra)`` and the method (``Request``) of the
    planned kind (row ``call``, ``dtype``, ``op``) of tensors on ``transport``, or ``None``
    where the kind is not planned. ``direct``, ``gather_direct`` and ``narrow``: what every torch
    transport reduces, gathers and moves as it is (torch_dist's tables); ``batches(t)``: whether
    an asynchronous send or recv of ``t`` joins this thread's batch (torch_handles.batches: the
    row's method takes it); ``device(x)``: the tensor the method takes on a device stream where
    the per-array check gave none (``device_check``; ``None``: no such tensor)."""
    if call is calls.ALL_REDUCE or call is calls.REDUCE_SCATTER or call is calls.REDUCE:
        if op is None or direct[dtype].get(op) is None or (call is calls.REDUCE_SCATTER and transport._reordered):
            return None
        start = _reducing(transport, call, op)
    elif call is calls.BROADCAST and dtype not in narrow:
        broadcast, options, torch_rank = process_group(transport).broadcast, \
            _Options(transport._dist.distributed_c10d.BroadcastOptions), transport._torch_rank

        def start(t: Any, root: Any, out: Any, extra: Any, async_op: bool) -> Started:
            return t, broadcast([t], options.root(torch_rank[root], async_op)), None
    elif (call is calls.ALL_GATHER or call in _MOVING) and dtype in gather_direct and not transport._reordered:
        start = _moving(transport, call)
    elif (call is calls.SEND or call is calls.RECV) and dtype in gather_direct:
        start = _point_to_point(transport, call, batches)
    else:
        return None
    return _planned(transport, start, getattr(transport, call.method), call is calls.SEND or call is calls.RECV,
                    device)


#: What a plan's ``start(t, root, out, extra, async_op)`` returns: the call's result, torch's handle
#: (``None`` where the backend completed the call inside it) and the tensor that AVG divides by
#: the size once the call completed (``None``: none); or ``None`` where it does not take ``t``.
#: (``extra``: the call's, as the call path passes it: send's and recv's tag.)
Started = tuple[Any, Any, Any] | None
Start = Callable[[Any, Any, Any, Any, bool], Started]


def _reducing(transport: Any, call: Any, op: ReduceOp) -> Start:
    """``start`` of all_reduce, reduce_scatter and reduce of a kind torch reduces as it is."""
    c10d, pg, size, empty = transport._dist.distributed_c10d, process_group(transport), transport.size, \
        transport._torch.empty
    divide, torch_op = op is _AVG, transport._ops[op]
    if call is calls.ALL_REDUCE:
        allreduce, options = pg.allreduce, _Options(c10d.AllreduceOptions, reduceOp=torch_op)

        def start(t: Any, root: Any, out: Any, extra: Any, async_op: bool) -> Started:
            return t, allreduce([t], options.asynchronous if async_op else options.blocking), t if divide else None
    elif call is calls.REDUCE_SCATTER:
        scatter = getattr(pg, "reduce_scatter_single", None) or pg._reduce_scatter_base
        options = _Options(c10d.ReduceScatterOptions, reduceOp=torch_op)

        def start(t: Any, root: Any, out: Any, extra: Any, async_op: bool) -> Started:
            shape = t.shape
            result = out if out is not None else empty((shape[0] // size, *shape[1:]), dtype=t.dtype)
            return result, scatter(result, t, options.asynchronous if async_op else options.blocking), \
                result if divide else None
    else:
        return reduce_start(transport, op)
    return start


def reduce_start(transport: Any, op: ReduceOp) -> Start:
    """``start`` of reduce of a kind torch reduces as it is: torch_reduce's (off dst x is never
    the process group's scratch), with this module's options."""
    options = _Options(transport._dist.distributed_c10d.ReduceOptions, reduceOp=transport._ops[op])
    return torch_reduce.reducing(transport, process_group(transport), options, op)


_MOVING = (calls.GATHER, calls.SCATTER, calls.ALL_TO_ALL)


def _moving(transport: Any, call: Any) -> Start:
    """``start`` of all_gather, gather, scatter and all_to_all (even) of a dtype every transport
    moves as it is; an empty x of the last three takes the row's method (Gloo refuses zero-byte
    lists)."""
    c10d, pg, size, empty = transport._dist.distributed_c10d, process_group(transport), transport.size, \
        transport._torch.empty
    torch_rank, rank = transport._torch_rank, transport.rank
    if call is calls.ALL_GATHER:
        all_gather = getattr(pg, "all_gather_single", None) or pg._allgather_base
        options = _Options(c10d.AllgatherOptions)

        def start(t: Any, root: Any, out: Any, extra: Any, async_op: bool) -> Started:
            # Gloo splits the result along its first dimension into parts of x's shape: x goes
            # as x[None], of a row's shape (one view of x, the cheapest: none of the result).
            result = out if out is not None else empty((size, *t.shape), dtype=t.dtype)
            return result, all_gather(result, t[None], options.asynchronous if async_op else options.blocking), None
    elif call is calls.GATHER:
        gather, options = pg.gather, _Options(c10d.GatherOptions)

        def start(t: Any, root: Any, out: Any, extra: Any, async_op: bool) -> Started:
            if not t.numel():
                return None
            if root != rank:
                return None, gather([], [t], options.root(torch_rank[root], async_op)), None
            result = out if out is not None else empty((size, *t.shape), dtype=t.dtype)
            return result, gather([list(result.unbind(0))], [t], options.root(torch_rank[root], async_op)), None
    elif call is calls.SCATTER:
        scatter, options = pg.scatter, _Options(c10d.ScatterOptions)

        def start(t: Any, root: Any, out: Any, extra: Any, async_op: bool) -> Started:
            if not t.numel():
                return None
            result = out if out is not None else empty(t.shape[1:], dtype=t.dtype)
            rows = [list(t.unbind(0))] if root == rank else []
            return result, scatter([result], rows, options.root(torch_rank[root], async_op)), None
    else:
        alltoall, options = pg.alltoall_base, _Options(c10d.AllToAllOptions)
        no_splits: list[int] = []  # (even splits)

        def start(t: Any, root: Any, out: Any, extra: Any, async_op: bool) -> Started:
            if not t.numel():
                return None
            result = out if out is not None else empty(t.shape, dtype=t.dtype)
            return result, alltoall(result, t, no_splits, no_splits,
                                    options.asynchronous if async_op else options.blocking), None
    return start


def _point_to_point(transport: Any, call: Any, batches: Callable[[Any], bool]) -> Start:
    """``start`` of send and recv (``root``: the peer, ``extra``: the tag) of a dtype every
    transport moves as it is; a recv from any source (it learns the sender from torch's handle)
    and an asynchronous call that joins this thread's batch take the row's method."""
    pg, torch_rank, receives = process_group(transport), transport._torch_rank, call is calls.RECV
    move = pg.recv if receives else pg.send

    def start(t: Any, root: Any, out: Any, extra: Any, async_op: bool) -> Started:
        if root is None or async_op and batches(t):
            return None
        # (a blocking send returns None; send's handle, like recv's, gives x back)
        return t if receives or async_op else None, move([t], torch_rank[root], extra), None
    return start


def _planned(transport: Any, start: Start, fallback: Callable[[Request], Any],
             joins_batch: bool, device: Callable[[Any], Any] | None
             ) -> tuple[Callable[..., Any], Callable[[Request], Any]]:
    """A planned kind's fast path (blocking: the call path handed it a checked tensor ``t`` and a
    checked ``out=`` or ``None``) and method around ``start(t, root, out, extra, async_op)`` (see
    ``Started``): the method takes an asynchronous call of a checked tensor (``r.view``) and a call
    of a tensor on a device stream (``device(r.x)``: blocking too, its handle's ``wait()`` a
    stream's); a blocking call of a checked tensor (the fast path did not take it), a tensor
    neither takes and what start does not take go to ``fallback``, the row's method. A batch of
    asynchronous CUDA sends/recvs goes out first, as before any call of this backend but an
    asynchronous send or recv (``joins_batch``: the batch stays open, as the rows' _send and _recv
    leave it); AVG divides the sum once the call completed."""
    size = transport.size

    def fast(t: Any, root: Any, out: Any, extra: Any) -> Any:
        if pending_batches:
            launch_batch()
        started = start(t, root, out, extra, False)
        if started is None:
            return NOT_TAKEN
        result, work, quotient = started
        if work is not None:
            work.wait()
        if quotient is not None:
            quotient.div_(size)
        return result

    def method(r: Request) -> Any:
        t = r.view
        if t is None:
            if device is None or (t := device(r.x)) is None:
                return fallback(r)
            if not r.async_op:  # (the fast path's steps, on a device stream: NCCL's wait() is the stream's)
                result = fast(t, r.root, r.out, r.extra)
                return fallback(r) if result is NOT_TAKEN else result
        elif not r.async_op:
            return fallback(r)
        if pending_batches and not joins_batch:
            launch_batch()
        started = start(t, r.root, r.out, r.extra, True)
        if started is None:
            return fallback(r)
        result, work, quotient = started
        return _TorchWork(result, work, None if quotient is None else (lambda: quotient.div_(size)), transport)

    return fast, method
