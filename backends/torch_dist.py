"""torch.distributed: Gloo for CPU tensors and NCCL for CUDA tensors, in one process group.

Under torchrun the group is made from env://. Under an MPI launcher rank 0 opens a
TCPStore on a free port and its address reaches the other ranks over MPI (an
integer broadcast, nothing unpickled). A process group the user initialized
already is reused as it is. numpy arrays are taken zero-copy through
``torch.from_numpy``; CuPy arrays through DLPack (``torch.from_dlpack``, and
``cupy.from_dlpack`` for the arrays returned), which carries bfloat16.

What the transports lack is emulated, never approximated:
- int16 (neither Gloo nor NCCL) and bool (NCCL) reduce through int32 / uint8;
  MIN/MAX/BAND/BOR/BXOR on 0/1 values and wrapping SUM/PROD survive the round trip.
- bitwise ops on NCCL: BAND/BOR of bool are MIN/MAX; other bitwise reductions
  gather every rank's tensor and reduce locally.
- AVG is SUM, then a division by size, on every transport.
- float MIN/MAX reduce integer order keys (backends/_float_order.py): NaN propagates.
Broadcast and all_gather move raw bytes (uint8 views), so they need no staging.
A contiguous CPU tensor of a kind every transport takes as it is goes straight to the process
group's own call, bound with its options when the kind is first seen (backends/torch_plans.py).
Asynchronous sends and recvs of CUDA tensors go out together, in ``batch_isend_irecv``
(:class:`~.torch_handles._BatchedP2P`).

Timeouts: the communicator's timeout is the process group's (and the bootstrap store's), and
torch's timeout errors become ``CollectiveTimeout``; a call on a CUDA stream (a CUDA tensor on
NCCL) is watched beside it instead (backends/torch_watch.py): past its timeout the NCCL backend
is aborted and the rank's next call or wait raises; the NCCL backend of a group made here gets
a longer timeout (:func:`~.torch_bootstrap.nccl_backstop`), so torch's own watchdog, which ends
the process with torch's defaults, comes second.

How the default process group is made under each launcher, and its security, is
:mod:`collectives.backends.torch_bootstrap`'s; the process group as the transport's channel (its
rank order, torch's errors, the default check's word, farewells, barriers, release) is
:mod:`collectives.backends.torch_group`'s :class:`TorchGroup`. This module holds the collectives,
send/recv and split, and the public :class:`TorchCommunicator`.

Imports: the interface, torch_group and the torch backend's helper modules.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

from collectives import arrays
from collectives.arrays import ArrayAdapter
from collectives.calls import Request
from collectives.communicator import Communicator
from collectives.diagnostics import recorder
from collectives.launcher import LaunchInfo
from collectives.ops import ALLOWED_OPS, ReduceOp
from collectives.work import Work, deliver

from . import _float_order, torch_carried, torch_plans, torch_reduce, torch_watch
from ._buffers import BITWISE, NARROW_WIRE, bitwise_as_min_max, flat_bytes, fold_bitwise, itemsize, stage
from .torch_bootstrap import (
    bootstrap_process_group,
    created_groups,
    group_named,
    import_torch_distributed,
    nccl_backstop,
    planning,
    torch_timeout,
)
from .torch_group import TorchGroup
from .torch_handles import _BatchedP2P, _torch_call, _TorchWork, batches, launch_batch


class TorchTransport(TorchGroup):
    """The transport over a torch.distributed process group (default: the world group): the
    tensors the collectives take, the collectives, send/recv and split, over
    :class:`~.torch_group.TorchGroup`."""

    _recv_any_source = True  # (Gloo's recvAnysource; NCCL's CUDA tensors are refused in _recv)

    @classmethod
    def from_launcher(cls, launch: LaunchInfo, *, timeout: Any = None) -> TorchTransport:
        """The world transport; ``timeout`` (else ``COLLECTIVES_TIMEOUT``) becomes the
        default process group's timeout, unless the user initialized that group already."""
        from collectives import config  # noqa: PLC0415

        dist = import_torch_distributed()
        if not dist.is_initialized():
            bootstrap_process_group(dist, launch, torch_timeout(config.timeout_seconds(timeout)))
        return cls(local_rank=launch.local_rank)

    # -- tensors ------------------------------------------------------------------------

    def _check_device(self, x: Any, adapter: ArrayAdapter) -> None:
        if adapter is arrays.CUPY and not self._torch.cuda.is_available():
            raise ValueError("x is a CuPy array but this torch build has no CUDA")

    # -- the plans of the kinds of CPU tensors (backends/torch_plans.py) ------------------

    _check_device_per_array = False  # (_check_device refuses a kind: CuPy arrays without CUDA)
    _tensor_check: Callable[[Any, bool], Any] | None = None
    _kind_plans: dict[tuple[Any, ...], Any] | None = None
    #: The row's reduce start per op (torch_plans.reduce_start) and the reduces' kept buffer (torch_reduce).
    _reducers: dict[ReduceOp, Any] | None = None
    _reduce_scratch: torch_reduce.Scratch | None = None

    def _array_check(self, adapter: ArrayAdapter) -> Callable[[Any, bool], Any] | None:
        if adapter is not _TORCH:
            return None
        if self._tensor_check is None:
            self._tensor_check = torch_plans.tensor_check(self._torch)
        return self._tensor_check

    def _fast_path(self, call: Any, adapter: ArrayAdapter, dtype: str,
                   reduce_op: ReduceOp | None) -> Callable[[Any, Any, Any, Any], Any] | None:
        plan = self._kind_plan(call, adapter, dtype, reduce_op)
        return None if plan is None else plan[0]

    def _method_of(self, call: Any, adapter: ArrayAdapter, dtype: str,
                   reduce_op: ReduceOp | None) -> Callable[[Request], Any]:
        """The kind's method (its plan's, else the row's); where the group runs calls on device
        streams, followed by the watch of a stream-ordered call (backends/torch_watch.py), but
        for numpy arrays (never on a device)."""
        plan = self._kind_plan(call, adapter, dtype, reduce_op)
        method = super()._method_of(call, adapter, dtype, reduce_op) if plan is None else plan[1]
        return self._watched(method) if self._watches_streams and adapter is not arrays.NUMPY else method

    def _watched(self, method: Callable[[Request], Any]) -> Callable[[Request], Any]:
        """``method``, then the watch of its stream-ordered calls against their timeout."""
        return torch_watch.watched(self, method)

    def _carried_path(self, call: Any, adapter: ArrayAdapter, dtype: str,
                      reduce_op: ReduceOp | None) -> Callable[[Any, Any, Any, Any, int], tuple[int, Any]] | None:
        """A planned kind's carried form (backends/torch_carried.py), where the check's round carries."""
        if adapter is not _TORCH or not self._counts_with_check:
            return None
        return torch_carried.carried_path(self, call, dtype, reduce_op, self._round_bytes)

    def _kind_plan(self, call: Any, adapter: ArrayAdapter, dtype: str, reduce_op: ReduceOp | None) -> Any:
        """The fast path and method of a planned kind of tensors (``torch_plans.fast_path``),
        made once; ``None`` for a kind not planned."""
        if adapter is not _TORCH:
            return None
        if self._kind_plans is None:
            self._kind_plans = {}
            planning.add(self)
        key = (call, dtype, reduce_op)
        if key not in self._kind_plans:
            # (batches looked up at each call, as the rows' _send and _recv do)
            self._kind_plans[key] = torch_plans.fast_path(self, call, dtype, reduce_op, _DIRECT, _GATHER_DIRECT,
                                                          NARROW_WIRE, lambda t: batches(t), self._device_check())
        return self._kind_plans[key]

    def _device_check(self) -> Callable[[Any], Any] | None:
        """What a planned kind's method takes on a device stream (``torch_plans.device_check``: a
        plain CUDA tensor) where the group runs calls on device streams (NCCL); else None."""
        return torch_plans.device_check(self._torch) if self._watches_streams else None

    def _forget_plans(self) -> None:
        """Drop the plans (they hold the group's bound methods), here and the communicator's
        (see ``CallContext.forget_plans``): before the group is destroyed."""
        self._reducers = None
        if self._kind_plans is not None:
            self._kind_plans = None
            self.context.forget_plans()
        super()._forget_plans()

    def _as_tensor(self, x: Any, adapter: ArrayAdapter) -> Any:
        """``x`` as a torch tensor sharing its memory (a copy only when x is read-only
        or has negative strides, which in-place callers handled before)."""
        if adapter is arrays.TORCH:
            return x.detach()
        if adapter is arrays.NUMPY:
            if not x.flags.writeable or _negative_strides(x, adapter):
                x = x.copy()  # torch.from_numpy takes neither
            return self._torch.from_numpy(x)
        # DLPack, zero-copy, on x's own device. Not the CUDA array interface: CuPy gives
        # bfloat16 (ml_dtypes') the typestr '<V2' there, which torch cannot take.
        return self._torch.utils.dlpack.from_dlpack(x)

    @_torch_call
    def _all_reduce(self, r: Request) -> Work | None:
        x, adapter, dtype, op, async_op = r.x, r.adapter, r.dtype, r.op, r.async_op
        direct = _DIRECT[dtype].get(op) if adapter is _TORCH else None
        if direct is not None and x.is_contiguous():
            # The common case, kept free of any extra tensor op (each costs microseconds):
            # x itself goes to the transport (check_writable ruled out autograd).
            work = self._dist.all_reduce(x, self._ops[op], self._group, async_op)
            if async_op:
                return _TorchWork(x, work, (lambda: x.div_(self.size)) if op is _AVG else None,
                                  self)
            if op is _AVG:
                x.div_(self.size)
            return None
        if _negative_strides(x, adapter):  # torch.from_numpy refuses these: reduce a copy
            copy = x.copy()
            self._all_reduce(r._replace(x=copy, async_op=False))
            x[...] = copy
            return Work(x) if async_op else None
        t = self._as_tensor(x, adapter)
        staged, writeback = stage(t, _TORCH, dtype, NARROW_WIRE.get(dtype))
        keys = self._order_keys(staged, op)
        if staged.is_cuda and op in BITWISE:
            self._bitwise_on_nccl(staged, dtype, op)
            work = None
        else:
            work = self._dist.all_reduce(staged if keys is None else keys, self._ops[op],
                                         group=self._group, async_op=async_op)

        def finish() -> None:
            if keys is not None:
                staged.copy_(self._from_keys(keys, staged.dtype))
            if op is _AVG:
                staged.div_(self.size)
            if writeback is not None:
                writeback()

        if work is not None and async_op:
            return _TorchWork(x, work, finish, self)
        finish()
        return Work(x) if async_op else None

    def _order_keys(self, t: Any, op: ReduceOp) -> Any:
        """For MIN/MAX of floats: a new tensor of integer order keys of ``t`` that the
        transport's integer MIN/MAX reduce exactly, NaN propagated; else ``None``.

        Gloo's float MIN/MAX compare with ``<`` and lose NaNs (backends/_float_order.py).
        16-bit floats get int32 keys: Gloo and NCCL have no int16.
        """
        if op not in _float_order.NAN_ORDERED_OPS or not t.is_floating_point():
            return None
        torch = self._torch
        bits = 8 * t.element_size()
        keys = t.contiguous().view(getattr(torch, f"int{bits}")).clone()
        _float_order.encode(keys, op, str(t.dtype).removeprefix("torch."))
        return keys.to(torch.int32) if bits == 16 else keys

    def _from_keys(self, keys: Any, dtype: Any) -> Any:
        """The float tensor of ``dtype`` whose order keys ``keys`` are (see ``_order_keys``)."""
        name = str(dtype).removeprefix("torch.")
        bits = _float_order.FLOAT_BITS[name]
        ints = keys.to(getattr(self._torch, f"int{bits}")) if bits == 16 else keys
        _float_order.decode(ints, name)
        return ints.view(dtype)

    def _bitwise_on_nccl(self, staged: Any, dtype: str, op: ReduceOp) -> None:
        """NCCL has no bitwise ops: bool's AND/OR as MIN/MAX of its 0/1 bytes, the rest
        gathered and folded here."""
        native = bitwise_as_min_max(dtype, op)
        if native is not None:
            self._dist.all_reduce(staged, self._ops[native], group=self._group)
            return
        staged.copy_(fold_bitwise(self._gather_tensor(staged), op))

    @_torch_call
    def _broadcast(self, r: Request) -> Work | None:
        x, adapter, dtype, src, async_op = r.x, r.adapter, r.dtype, r.root, r.async_op
        if adapter is _TORCH and dtype not in NARROW_WIRE and x.is_contiguous():
            # dtypes every torch transport moves as they are: no uint8 view to make.
            work = self._dist.broadcast(x, self._global_ranks[src], self._group, async_op)
            return _TorchWork(x, work, None, self) if async_op else None
        if _negative_strides(x, adapter):
            copy = x.copy()
            self._broadcast(r._replace(x=copy, async_op=False))
            x[...] = copy
            return Work(x) if async_op else None
        t = self._as_tensor(x, adapter)
        staged = t if t.is_contiguous() else t.contiguous()
        work = self._dist.broadcast(flat_bytes(staged), self._global_ranks[src], group=self._group,
                                    async_op=async_op)

        def finish() -> None:
            if staged is not t:
                t.copy_(staged)

        return self._finished(x, work, finish, async_op)

    def _finished(self, x: Any, work: Any, finish: Callable[[], None], async_op: bool) -> Work | None:
        """A call's end: with ``async_op`` a handle that runs ``finish`` once torch's ``work``
        completes, else ``finish()`` now (the call blocked) and ``None``."""
        if async_op:
            return _TorchWork(x, work, finish, self)
        finish()
        return None

    def _gather_tensor(self, t: Any) -> Any:
        """torch tensor of shape (size, *t.shape), row r from our rank r."""
        staged = t if t.is_contiguous() else t.contiguous()
        out = self._torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        self._all_gather_single(flat_bytes(out), flat_bytes(staged), group=self._group)
        return out[self._torch_rank] if self._reordered else out

    def _all_gather(self, r: Request) -> Any:
        x, adapter, dtype, out, async_op = r.x, r.adapter, r.dtype, r.out, r.async_op
        if self._reordered:  # torch's rows, put in our order
            return deliver(adapter, self._all_gather_new(x, adapter, dtype), out, async_op)
        launch_batch()  # (the other paths go through _torch_call, which does too)
        if out is None and not async_op and adapter is _TORCH and dtype in _GATHER_DIRECT \
                and x.dim() == 1 and not x.requires_grad and x.is_contiguous():
            # SyncBatchNorm's forward call: 1-d tensors of the dtypes every transport gathers
            # go straight to torch (no byte views, no wrapper: one output, one call).
            gathered = self._torch.empty((self.size * x.shape[0],), dtype=x.dtype, device=x.device)
            self._all_gather_single(gathered, x, group=self._group)
            return gathered.view(self.size, x.shape[0])
        if out is None and not async_op:
            return deliver(adapter, self._all_gather_new(x, adapter, dtype), out, async_op)
        result = out if out is not None else adapter.empty(x, (self.size, *x.shape))
        return self._move_bytes(x, adapter, result, result, async_op,
                                lambda send, recv, asy: self._all_gather_single(
                                    recv, send, group=self._group, async_op=asy))

    # -- the rest of the set ------------------------------------------------------------

    @_torch_call
    def _move_bytes(self, x: Any, adapter: ArrayAdapter, result: Any, value: Any, async_op: bool,
                    start: Any) -> Any:
        """One torch.distributed call that moves raw bytes (flat uint8 views) from ``x`` into
        ``result`` (``None`` on a rank that sends or receives nothing); returns ``value``, or a
        handle whose ``wait()`` does. ``start(send_bytes, recv_bytes, async_op)`` calls torch.
        Memory is shared with x and result where they are contiguous (numpy and CuPy arrays
        too, through torch.from_numpy / the CUDA array interface), else staged."""
        send = None if x is None else self._as_tensor(x, adapter)
        if send is not None and not send.is_contiguous():
            send = send.contiguous()
        recv: Any = None
        target: Any = None
        if result is not None:
            target = self._as_tensor(result, adapter)
            recv = target if target.is_contiguous() else target.contiguous()

        def finish() -> None:
            if recv is not target:
                target.copy_(recv)

        work = start(None if send is None else flat_bytes(send), None if recv is None else flat_bytes(recv),
                     async_op)
        if async_op:
            return _TorchWork(value, work, finish, self)
        finish()
        return value

    def _gather(self, r: Request) -> Any:
        x, adapter, dst, out, async_op = r.x, r.adapter, r.root, r.out, r.async_op
        # Empty arrays and a reordered group take the emulation.
        if self._reordered or not math.prod(x.shape):  # (Gloo refuses zero-byte lists)
            return super()._gather(r)
        here = self.rank == dst
        result = (out if out is not None else adapter.empty(x, (self.size, *x.shape))) if here else None
        root = self._global_ranks[dst]
        return self._move_bytes(x, adapter, result, result, async_op, lambda send, recv, asy: self._dist.gather(
            send, list(recv.view(self.size, -1).unbind(0)) if here else None, root, self._group, asy))

    def _scatter(self, r: Request) -> Any:
        x, adapter, src, out, async_op = r.x, r.adapter, r.root, r.out, r.async_op
        if self._reordered or not math.prod(x.shape):  # (Gloo refuses zero-byte lists)
            return super()._scatter(r)
        here = self.rank == src
        result = out if out is not None else adapter.empty(x, tuple(x.shape[1:]))
        root = self._global_ranks[src]
        return self._move_bytes(x if here else None, adapter, result, result, async_op,
                                lambda send, recv, asy: self._dist.scatter(
                                    recv, list(send.view(self.size, -1).unbind(0)) if here else None,
                                    root, self._group, asy))

    def _all_to_all(self, r: Request) -> Any:
        x, adapter, out, async_op = r.x, r.adapter, r.out, r.async_op
        if self._reordered or not math.prod(x.shape):  # (Gloo refuses zero-byte lists)
            return super()._all_to_all(r)
        result = out if out is not None else adapter.empty(x, tuple(x.shape))
        return self._move_bytes(x, adapter, result, result, async_op, lambda send, recv, asy:
                                self._all_to_all_base(recv, send, [], [], asy))

    def _all_to_all_v(self, r: Request) -> Any:
        x, adapter, splits, out, async_op = r.x, r.adapter, r.extra, r.out, r.async_op
        if self._reordered:
            return super()._all_to_all_v(r)
        received = [row[self.rank] for row in splits]
        result = out if out is not None else adapter.empty(x, (sum(received), *x.shape[1:]))
        if adapter is _TORCH and r.dtype in _GATHER_DIRECT and (r.view is not None or (  # (rows as they are,
                x.dim() and x.is_contiguous() and result.is_contiguous() and not x.requires_grad)):  # as x's view says)
            work = self._all_to_all_base(result, x, received, splits[self.rank], async_op)
            return _TorchWork(result, work, transport=self) if async_op else result
        row = math.prod(x.shape[1:]) * itemsize(x)
        sent = [count * row for count in splits[self.rank]]
        got = [count * row for count in received]
        return self._move_bytes(x, adapter, result, result, async_op, lambda send, recv, asy:
                                self._all_to_all_base(recv, send, got, sent, asy))

    @_torch_call
    def _reduce(self, r: Request) -> Work | None:
        x, adapter, dtype, op, dst, async_op = r.x, r.adapter, r.dtype, r.op, r.root, r.async_op
        direct = _DIRECT[dtype].get(op)
        if direct is None:  # staged dtypes, NaN-ordered MIN/MAX, bitwise on NCCL: emulated
            return super()._reduce(r)
        t = self._as_tensor(x, adapter)
        # The plan's start (torch_reduce: off dst x is never the process group's scratch), on x
        # itself where contiguous, else on a contiguous copy that dst copies back.
        staged = t if t.is_contiguous() else t.contiguous()
        if self._reducers is None:
            self._reducers = {}
            planning.add(self)
        start = self._reducers.get(op) or self._reducers.setdefault(op, torch_plans.reduce_start(self, op))
        _, work, quotient = start(staged, dst, None, None, async_op)

        def finish() -> None:
            if quotient is not None:
                quotient.div_(self.size)
            if staged is not t and self.rank == dst:
                t.copy_(staged)

        if not async_op:
            work.wait()
        return self._finished(x, work, finish, async_op)

    @_torch_call
    def _all_gather_new(self, x: Any, adapter: ArrayAdapter, dtype: str) -> Any:
        gathered = self._gather_tensor(self._as_tensor(x, adapter))
        if adapter is arrays.TORCH:
            return gathered
        if adapter is arrays.NUMPY:
            return gathered.numpy()
        return _as_cupy(self._torch, gathered)

    def _reduce_scatter(self, r: Request) -> Any:
        x, adapter, dtype, op, out, async_op = r.x, r.adapter, r.dtype, r.op, r.out, r.async_op
        return deliver(adapter, self._reduce_scatter_new(x, adapter, dtype, op, out), out, async_op)

    @_torch_call
    def _reduce_scatter_new(self, x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp,
                            out: Any = None) -> Any:
        """This rank's reduced rows of x: into the caller's ``out`` where x is a tensor torch
        reduces as it is (no staging, no copy: the call raw torch.distributed makes), else a
        new array that the caller's ``out`` then receives."""
        torch = self._torch
        if self._reordered:  # torch hands block i to torch's rank i: x's blocks in its order
            if adapter is _TORCH:
                x = x.detach()
            rows = x.shape[0] // self.size
            order = [0] * self.size
            for ours, theirs in enumerate(self._torch_rank):
                order[theirs] = ours
            x = x.reshape(self.size, rows, *x.shape[1:])[order].reshape(x.shape)
        if (adapter is _TORCH and not x.requires_grad
                and _DIRECT[dtype].get(op) is not None and x.is_contiguous()):
            # x's blocks of rows are its flat blocks: torch reduces them straight into the
            # result (out= is contiguous, of x's dtype and device: the call path checked it).
            if out is None:
                out = torch.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
            self._reduce_scatter_single(out, x, self._ops[op], group=self._group)
            if op is _AVG:
                out.div_(self.size)
            return out
        t = self._as_tensor(x, adapter)
        staged, _ = stage(t, _TORCH, dtype, NARROW_WIRE.get(dtype))
        rows = t.shape[0] // self.size
        if staged.is_cuda and op in BITWISE:
            full = staged.clone()
            self._bitwise_on_nccl(full, dtype, op)
            mine = self._torch_rank[self.rank]  # (torch's rank: x's blocks are in its order)
            out = full[mine * rows:(mine + 1) * rows].clone()
        elif (keys := self._order_keys(staged, op)) is not None:
            out_keys = torch.empty((rows, *t.shape[1:]), dtype=keys.dtype, device=t.device)
            self._reduce_scatter_single(out_keys, keys, self._ops[op], group=self._group)
            out = self._from_keys(out_keys, staged.dtype)
        else:
            out = torch.empty((rows, *t.shape[1:]), dtype=staged.dtype, device=t.device)
            self._reduce_scatter_single(out, staged, self._ops[op], group=self._group)
        if op is _AVG:
            out.div_(self.size)
        out = out.to(t.dtype)
        if adapter is arrays.TORCH:
            return out
        if adapter is arrays.NUMPY:
            return out.numpy()
        return _as_cupy(self._torch, out)

    @_torch_call
    def _send(self, r: Request) -> Work | None:
        x, adapter, dst, tag, async_op = r.x, r.adapter, r.root, r.extra, r.async_op
        t = self._as_tensor(x, adapter)
        staged = flat_bytes(t if t.is_contiguous() else t.contiguous())
        peer = self._global_ranks[dst]
        if async_op:
            if batches(staged):
                return _BatchedP2P(x, self._dist.P2POp(self._dist.isend, staged, peer, self._group, tag),
                                   None, self)
            return _TorchWork(x, self._dist.isend(staged, peer, self._group, tag), None, self)
        self._dist.send(staged, peer, self._group, tag)
        return None

    @_torch_call
    def _recv(self, r: Request) -> Work | None:
        x, adapter, tag, async_op = r.x, r.adapter, r.extra, r.async_op
        src: int | None = r.root  # (None: from any source)
        t = self._as_tensor(x, adapter)
        if src is None and t.is_cuda:  # (checked before anything is sent)
            raise ValueError("recv(src=None), from any source, takes CPU tensors on the torch backend: "
                             "Gloo has it (recvAnysource), NCCL (CUDA tensors) has not; name the src rank")
        staged = t if t.is_contiguous() else t.contiguous()

        def finish() -> None:
            if staged is not t:
                t.copy_(staged)

        if src is None:  # Gloo's recvAnysource; its handle says which (global) rank sent
            received = self._dist.irecv(flat_bytes(staged), None, self._group, tag)

            def finish_any() -> None:
                handle.source = self._global_ranks.index(received._source_rank())
                finish()

            handle = _TorchWork(x, received, finish_any, self)
            if async_op:
                return handle
            handle.wait()
            return None
        peer = self._global_ranks[src]
        if async_op:
            if batches(staged):
                return _BatchedP2P(x, self._dist.P2POp(self._dist.irecv, flat_bytes(staged), peer, self._group,
                                                       tag), finish, self)
            return _TorchWork(x, self._dist.irecv(flat_bytes(staged), peer, self._group, tag), finish,
                              self)
        self._dist.recv(flat_bytes(staged), peer, self._group, tag)
        finish()
        return None


    def _split(self, color: int | None, key: int) -> TorchTransport | None:
        launch_batch()
        members = self._split_groups(color, key)
        self._splits += 1
        if members is None:
            return None
        global_ranks = [self._global_ranks[r] for r in members]
        # Only the members make the group (local synchronization), so splits of splits
        # work and groups of different colors are made concurrently. torch names such a
        # group by its ranks and by how many groups this process has made, which differs
        # between ranks with different split histories (they would wait for each other
        # forever): the name is ours instead, the same on every member by construction.
        name = f"collectives/{self._name}/{self._splits}/{color}"
        with group_named(name):
            group = self._dist.new_group(sorted(global_ranks), use_local_synchronization=True,
                                         timeout=torch_timeout(self.timeout))
        nccl_backstop(self._dist, group, self.timeout)
        created_groups.append(group)
        child = self._split_transport(group, global_ranks)
        child._name = name
        return child

    def _split_transport(self, group: Any, global_ranks: list[int]) -> TorchTransport:
        """The transport of a split's new group (a fault-tolerant transport's is one too)."""
        return TorchTransport(group, ranks=global_ranks, local_rank=self.local_rank)


class TorchCommunicator(Communicator):
    """A communicator over a torch.distributed process group (default: the world group)."""

    transport_class = TorchTransport
    _transport: TorchTransport

    def __init__(self, group: Any = None, ranks: list[int] | None = None,
                 local_rank: int | None = None, *, timeout: Any = None) -> None:
        """``group``: a torch ProcessGroup (None: the default group). ``ranks``: the
        group's global ranks in this communicator's rank order (None: torch's order).
        ``timeout``: the timeout the group was made with (torch enforces it; ``None``
        reads ``COLLECTIVES_TIMEOUT``): for messages and for the groups of ``split``; the
        calls on CUDA streams are watched against it beside them (backends/torch_watch.py)."""
        super().__init__(TorchTransport(group, ranks, local_rank), timeout=timeout)

    @property
    def process_group(self) -> Any:
        """The torch ProcessGroup (None means the default group)."""
        return self._transport.process_group


# Bound once: on Python 3.11 every ``ReduceOp.X`` attribute read costs ~0.15 us.
_TORCH = arrays.TORCH
_AVG = ReduceOp.AVG
# dtypes every torch transport gathers as they are.
_GATHER_DIRECT = frozenset({"int8", "uint8", "int32", "int64", "float16", "float32", "float64"})
# dtype -> the ops every torch transport does on it as it is (no bitwise: NCCL has none).
# Not float MIN/MAX either: those go through order keys (NaN propagates).
_DIRECT: dict[str, dict[ReduceOp, ReduceOp]] = {dtype: {op: op for op in allowed
                   if dtype not in NARROW_WIRE and op not in BITWISE
                   and not (dtype.startswith(("float", "bfloat")) and op in _float_order.NAN_ORDERED_OPS)}
           for dtype, allowed in ALLOWED_OPS.items()}


_clock = recorder.clock


def _as_cupy(torch: Any, t: Any) -> Any:
    """A CUDA tensor as a CuPy array sharing its memory, through DLPack: the CUDA array
    interface would give a bfloat16 tensor (typestr '<V2') a void dtype. torch exports only a
    tensor of the current device, so that device is made current for the export."""
    import cupy  # noqa: PLC0415

    with torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext():
        return cupy.from_dlpack(t)


def _negative_strides(x: Any, adapter: ArrayAdapter) -> bool:
    return adapter is not arrays.TORCH and any(stride < 0 for stride in x.strides)
