"""The torch backend's plans: what the first call of a kind (row, dtype, op) of plain CPU tensors
binds once, so that the later calls of that kind make one check of the tensor and the process
group's own call.

torch.distributed's functions (``dist.all_reduce`` ...) rebuild the same things on every call: an
options object, the group looked up, the tensor checked again. A plan makes them once: the
process group's bound method (``ProcessGroup.allreduce``, ``broadcast``, ``all_gather_single``,
``reduce_scatter_single``), its options objects (one blocking, one asynchronous, with the reduce
op or root set) and torch's reduce op. What ``dist.*`` does besides is done once too (the group is
this transport's, its rank in it); its coalescing manager (``dist._coalescing_manager``) and its
torch-function modes are for torch's own calls, not for a communicator's.

The kinds planned: all_reduce and reduce_scatter where every torch transport reduces the dtype x
op as it is (``torch_dist._DIRECT``), broadcast of every dtype it moves as it is, all_gather of the
dtypes every transport gathers as they are; all_gather and reduce_scatter only where this
communicator's rank order is torch's. Every other kind, array and tensor (CUDA tensors, numpy and
CuPy arrays, a non-contiguous or read-only tensor, a tensor subclass) takes the row's method.

Imports: the interface (arrays, calls) and torch_handles; never torch_dist (which calls these).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from collectives import arrays, calls
from collectives.calls import Request
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
        """The options of a broadcast from torch's group rank ``root``."""
        options = self.rooted.get((root, async_op))
        if options is None:
            options = self.rooted[root, async_op] = self.new(async_op, rootRank=root, rootTensor=0)
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
    c10d, pg, size, empty = transport._dist.distributed_c10d, process_group(transport), transport.size, \
        transport._torch.empty
    start: Callable[[Any, Any, Any, bool], tuple[Any, Any]]
    divide = op is _AVG
    if call is calls.ALL_REDUCE or call is calls.REDUCE_SCATTER:
        if op is None or direct[dtype].get(op) is None or (call is calls.REDUCE_SCATTER and transport._reordered):
            return None
        if call is calls.ALL_REDUCE:
            allreduce, options = pg.allreduce, _Options(c10d.AllreduceOptions, reduceOp=transport._ops[op])

            def start(t: Any, root: Any, out: Any, async_op: bool) -> tuple[Any, Any]:
                return t, allreduce([t], options.asynchronous if async_op else options.blocking)
        else:
            scatter = getattr(pg, "reduce_scatter_single", None) or pg._reduce_scatter_base
            options = _Options(c10d.ReduceScatterOptions, reduceOp=transport._ops[op])

            def start(t: Any, root: Any, out: Any, async_op: bool) -> tuple[Any, Any]:
                shape = t.shape
                result = out if out is not None else empty((shape[0] // size, *shape[1:]), dtype=t.dtype)
                return result, scatter(result, t, options.asynchronous if async_op else options.blocking)
    elif call is calls.BROADCAST and dtype not in narrow:
        broadcast, options, torch_rank = pg.broadcast, _Options(c10d.BroadcastOptions), transport._torch_rank

        def start(t: Any, root: Any, out: Any, async_op: bool) -> tuple[Any, Any]:
            return t, broadcast([t], options.root(torch_rank[root], async_op))
    elif call is calls.ALL_GATHER and dtype in gather_direct and not transport._reordered:
        gather = getattr(pg, "all_gather_single", None) or pg._allgather_base
        options = _Options(c10d.AllgatherOptions)

        def start(t: Any, root: Any, out: Any, async_op: bool) -> tuple[Any, Any]:
            # Gloo splits the result along its first dimension into parts of x's shape: x goes
            # as x[None], of a row's shape (one view of x, the cheapest: none of the result).
            result = out if out is not None else empty((size, *t.shape), dtype=t.dtype)
            return result, gather(result, t[None], options.asynchronous if async_op else options.blocking)
    else:
        return None
    return _planned(transport, start, divide, size, getattr(transport, call.method))


def _planned(transport: Any, start: Callable[[Any, Any, Any, bool], tuple[Any, Any]], divide: bool, size: int,
             fallback: Callable[[Request], Any]) -> tuple[Callable[..., Any], Callable[[Request], Any]]:
    """A planned kind's fast path (blocking: the call path handed it a checked tensor ``t`` and a
    checked ``out=`` or ``None``) and method (an asynchronous call; a tensor the check did not
    take, ``r.view`` None, and a blocking call go to ``fallback``, the row's method) around
    ``start(t, root, out, async_op)``, which makes the group's call and returns the result and
    torch's handle (``None`` where the backend completed the call inside it). A batch of
    asynchronous CUDA sends/recvs goes out first, as before any call of this backend; AVG divides
    the sum once the call completed."""
    def fast(t: Any, root: Any, out: Any, extra: Any) -> Any:
        if pending_batches:
            launch_batch()
        result, work = start(t, root, out, False)
        if work is not None:
            work.wait()
        if divide:
            result.div_(size)
        return result

    def method(r: Request) -> Any:
        t = r.view
        if t is None or not r.async_op:
            return fallback(r)
        if pending_batches:
            launch_batch()
        result, work = start(t, r.root, r.out, True)
        return _TorchWork(result, work, (lambda: result.div_(size)) if divide else None, transport)

    return fast, method
