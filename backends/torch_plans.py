"""The torch backend's plans: what the first call of a kind (row, dtype, op) of plain CPU tensors
binds once, so that the later calls of that kind make one check of the tensor and the process
group's own call.

torch.distributed's functions (``dist.all_reduce`` ...) rebuild the same things on every call: an
options object, the group looked up, the tensor checked again. A plan makes them once: the
process group's bound method (``ProcessGroup.allreduce``, ``broadcast``, ``reduce``,
``all_gather_single``, ``reduce_scatter_single``, ``gather``, ``scatter``, ``alltoall_base``), its
options objects (one blocking, one asynchronous, with the reduce op or root set) and torch's
reduce op. What ``dist.*`` does besides is done once too (the group is
this transport's, its rank in it); its coalescing manager (``dist._coalescing_manager``) and its
torch-function modes are for torch's own calls, not for a communicator's.

The kinds planned: all_reduce, reduce and reduce_scatter where every torch transport reduces the
dtype x op as it is (``torch_dist._DIRECT``; off dst, reduce sends a copy of x: Gloo uses the
buffer as scratch), broadcast of every dtype it moves as it is, all_gather, gather, scatter and
the even all_to_all of the dtypes every transport gathers as they are; all of these but
all_reduce, broadcast and reduce only where this communicator's rank order is torch's. Every
other kind, array and tensor (CUDA tensors, numpy and CuPy arrays, a non-contiguous or read-only
tensor, a tensor subclass, an empty x of gather, scatter or all_to_all) takes the row's method.

Imports: the interface (arrays, calls) and torch_handles; never torch_dist (which calls these).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collectives import arrays, calls
from collectives.calls import NOT_TAKEN, Request
from collectives.ops import ReduceOp

from .torch_handles import _TorchWork, launch_batch, pending_batches

_AVG = ReduceOp.AVG
_check_array = arrays.TORCH.check_array


def tensor_check(torch: Any) -> Callable[[Any, bool], Any]:
    """The per-array check of the planned kinds (see ``Transport._array_check``): ``x`` itself
    where the plan's process-group call takes it as it is (a plain CPU tensor, dense, contiguous,
    without a negative bit, not requiring grad: autograd would track the views torch's call makes
    of it), else ``TorchAdapter.check_array``'s verdict (its error, or ``None``: the row's method
    takes x, detached)."""
    tensor, strided = torch.Tensor, torch.strided

    def check(x: Any, in_place: bool) -> Any:
        if type(x) is tensor and x.is_cpu and x.is_contiguous() and not x.requires_grad \
                and x.layout is strided and not x.is_nested and not x.is_neg():
            return x
        _check_array(x, in_place)
        return None

    return check


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
              narrow: dict[str, str]) -> tuple[Callable[..., Any], Callable[[Request], Any]] | None:
    """The blocking fast path ``(t, root, out, extra)`` and the method (``Request``) of the
    planned kind (row ``call``, ``dtype``, ``op``) of CPU tensors on ``transport``, or ``None``
    where the kind is not planned. ``direct``, ``gather_direct`` and ``narrow``: what every torch
    transport reduces, gathers and moves as it is (torch_dist's tables)."""
    if call is calls.ALL_REDUCE or call is calls.REDUCE_SCATTER or call is calls.REDUCE:
        if op is None or direct[dtype].get(op) is None or (call is calls.REDUCE_SCATTER and transport._reordered):
            return None
        start = _reducing(transport, call, op)
    elif call is calls.BROADCAST and dtype not in narrow:
        broadcast, options, torch_rank = process_group(transport).broadcast, \
            _Options(transport._dist.distributed_c10d.BroadcastOptions), transport._torch_rank

        def start(t: Any, root: Any, out: Any, async_op: bool) -> Started:
            return t, broadcast([t], options.root(torch_rank[root], async_op)), None
    elif (call is calls.ALL_GATHER or call in _MOVING) and dtype in gather_direct and not transport._reordered:
        start = _moving(transport, call)
    else:
        return None
    return _planned(transport, start, getattr(transport, call.method))


#: What a plan's ``start(t, root, out, async_op)`` returns: the call's result, torch's handle
#: (``None`` where the backend completed the call inside it) and the tensor that AVG divides by
#: the size once the call completed (``None``: none); or ``None`` where it does not take ``t``.
Started = tuple[Any, Any, Any] | None


def _reducing(transport: Any, call: Any, op: ReduceOp) -> Callable[[Any, Any, Any, bool], Started]:
    """``start`` of all_reduce, reduce_scatter and reduce of a kind torch reduces as it is."""
    c10d, pg, size, empty = transport._dist.distributed_c10d, process_group(transport), transport.size, \
        transport._torch.empty
    divide, torch_op = op is _AVG, transport._ops[op]
    if call is calls.ALL_REDUCE:
        allreduce, options = pg.allreduce, _Options(c10d.AllreduceOptions, reduceOp=torch_op)

        def start(t: Any, root: Any, out: Any, async_op: bool) -> Started:
            return t, allreduce([t], options.asynchronous if async_op else options.blocking), t if divide else None
    elif call is calls.REDUCE_SCATTER:
        scatter = getattr(pg, "reduce_scatter_single", None) or pg._reduce_scatter_base
        options = _Options(c10d.ReduceScatterOptions, reduceOp=torch_op)

        def start(t: Any, root: Any, out: Any, async_op: bool) -> Started:
            shape = t.shape
            result = out if out is not None else empty((shape[0] // size, *shape[1:]), dtype=t.dtype)
            return result, scatter(result, t, options.asynchronous if async_op else options.blocking), \
                result if divide else None
    else:
        reduce, options, torch_rank, rank = pg.reduce, _Options(c10d.ReduceOptions, reduceOp=torch_op), \
            transport._torch_rank, transport.rank

        def start(t: Any, root: Any, out: Any, async_op: bool) -> Started:
            if root == rank:
                return t, reduce([t], options.root(torch_rank[root], async_op)), t if divide else None
            # Off dst the transport may use its buffer as scratch (Gloo does): a copy goes, x stays.
            return t, reduce([t.clone()], options.root(torch_rank[root], async_op)), None
    return start


_MOVING = (calls.GATHER, calls.SCATTER, calls.ALL_TO_ALL)


def _moving(transport: Any, call: Any) -> Callable[[Any, Any, Any, bool], Started]:
    """``start`` of all_gather, gather, scatter and all_to_all (even) of a dtype every transport
    moves as it is; an empty x of the last three takes the row's method (Gloo refuses zero-byte
    lists)."""
    c10d, pg, size, empty = transport._dist.distributed_c10d, process_group(transport), transport.size, \
        transport._torch.empty
    torch_rank, rank = transport._torch_rank, transport.rank
    if call is calls.ALL_GATHER:
        all_gather = getattr(pg, "all_gather_single", None) or pg._allgather_base
        options = _Options(c10d.AllgatherOptions)

        def start(t: Any, root: Any, out: Any, async_op: bool) -> Started:
            # Gloo splits the result along its first dimension into parts of x's shape: x goes
            # as x[None], of a row's shape (one view of x, the cheapest: none of the result).
            result = out if out is not None else empty((size, *t.shape), dtype=t.dtype)
            return result, all_gather(result, t[None], options.asynchronous if async_op else options.blocking), None
    elif call is calls.GATHER:
        gather, options = pg.gather, _Options(c10d.GatherOptions)

        def start(t: Any, root: Any, out: Any, async_op: bool) -> Started:
            if not t.numel():
                return None
            if root != rank:
                return None, gather([], [t], options.root(torch_rank[root], async_op)), None
            result = out if out is not None else empty((size, *t.shape), dtype=t.dtype)
            return result, gather([list(result.unbind(0))], [t], options.root(torch_rank[root], async_op)), None
    elif call is calls.SCATTER:
        scatter, options = pg.scatter, _Options(c10d.ScatterOptions)

        def start(t: Any, root: Any, out: Any, async_op: bool) -> Started:
            if not t.numel():
                return None
            result = out if out is not None else empty(t.shape[1:], dtype=t.dtype)
            rows = [list(t.unbind(0))] if root == rank else []
            return result, scatter([result], rows, options.root(torch_rank[root], async_op)), None
    else:
        alltoall, options = pg.alltoall_base, _Options(c10d.AllToAllOptions)
        no_splits: list[int] = []  # (even splits)

        def start(t: Any, root: Any, out: Any, async_op: bool) -> Started:
            if not t.numel():
                return None
            result = out if out is not None else empty(t.shape, dtype=t.dtype)
            return result, alltoall(result, t, no_splits, no_splits,
                                    options.asynchronous if async_op else options.blocking), None
    return start


def _planned(transport: Any, start: Callable[[Any, Any, Any, bool], Started],
             fallback: Callable[[Request], Any]) -> tuple[Callable[..., Any], Callable[[Request], Any]]:
    """A planned kind's fast path (blocking: the call path handed it a checked tensor ``t`` and a
    checked ``out=`` or ``None``) and method (an asynchronous call; a tensor the check did not
    take, ``r.view`` None, and a blocking call go to ``fallback``, the row's method) around
    ``start(t, root, out, async_op)`` (see ``Started``); what start does not take goes to the row's
    method too. A batch of asynchronous CUDA sends/recvs goes out first, as before any call of
    this backend; AVG divides the sum once the call completed."""
    size = transport.size

    def fast(t: Any, root: Any, out: Any, extra: Any) -> Any:
        if pending_batches:
            launch_batch()
        started = start(t, root, out, False)
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
        if t is None or not r.async_op:
            return fallback(r)
        if pending_batches:
            launch_batch()
        started = start(t, r.root, r.out, True)
        if started is None:
            return fallback(r)
        result, work, quotient = started
        return _TorchWork(result, work, None if quotient is None else (lambda: quotient.div_(size)), transport)

    return fast, method
