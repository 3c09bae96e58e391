"""Data-parallel training over any collectives backend: a drop-in for torch's DDP.

    model = syncbn.convert_sync_batchnorm(Net(), comm)
    model = syncbn.DataParallel(model, comm)       # rank 0's parameters and buffers everywhere
    loss = criterion(model(x), y)
    loss.backward()                                # gradients averaged while backward runs
    optimizer.step()

What happens, and when:

- Construction broadcasts every parameter and buffer from rank 0 (one fused
  broadcast per dtype and device), so every rank starts from the same model.
- Parameters that require grad are assigned once, in reverse registration order
  (roughly the order backward produces their gradients), to buckets of about
  ``bucket_cap_mb`` MB of one dtype and device. Membership never changes, so every
  rank runs the same collectives in the same order whatever its graph looks like.
- A ``register_post_accumulate_grad_hook`` on each parameter (bound to its bucket
  and position when the model is wrapped) copies its gradient into its bucket's
  flat buffer as soon as autograd has accumulated it -- no copy when ``grad`` is
  already the bucket's view, kept from the last step and accumulated into in
  place; a full bucket is reduced with ONE ``all_reduce(async_op=True)`` right away
  (buckets are launched in bucket order, the same on every rank), so communication
  overlaps the rest of backward.
- At the end of backward (an autograd engine callback, queued when gradients
  first reach the model's output or one of its parameters) the buckets not yet
  launched are launched -- a parameter that got no gradient on this rank
  contributes zeros -- every bucket is waited on, and ``param.grad`` becomes the
  reduced gradient's copy (``gradient_as_bucket_view=True``: its view into the
  bucket). So after ``loss.backward()`` returns the gradients are final and
  the optimizer can step; nothing else needs calling. :meth:`finish` does the
  same explicitly and is harmless to call again.
- Each bucket carries one extra element per parameter, the number of ranks that
  produced a gradient for it, reduced in the same call: a parameter no rank used
  keeps ``grad`` as it was (``None`` stays ``None``, as in DDP with
  ``find_unused_parameters=True``), one that some rank used gets the reduced value.

Averaging (``grad_reduction``):

- ``"mean"`` (default, DDP's rule): grad = sum over ranks of the local grad / size,
  computed as ``all_reduce(sum)`` of ``grad * (1 / size)`` (one multiply of the
  whole bucket before it goes out), the same arithmetic as DDP. Right when each
  rank's loss is the mean over its own batch and every rank has the same batch size.
- ``"sum"``: grad = sum over ranks of the local grad. Right when each rank's loss
  is already scaled for the global batch, e.g. ``local_loss_sum / global_count``:
  then with SyncBatchNorm the result is exactly the gradient of the mean loss over
  the concatenated global batch, even when ranks hold different numbers of
  samples (what ``scripts/train.py`` does for its uneven last shard).

Transports: the async ``all_reduce`` of the mpi backend is ``MPI_Iallreduce``,
which progresses mostly inside MPI calls, so every hook also tests the pending
requests (``is_completed()``) to let MPI move them along; the torch backend's is a
torch ``Work`` that progresses on its own (Gloo threads / the NCCL stream).

Limits: every rank must run backward through the model's output (a rank whose
loss does not depend on the model at all runs no hook and would leave the others
waiting); sparse gradients are not supported.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

import collectives
from collectives import Communicator, Work

#: Default bucket size, the same as torch DDP's.
DEFAULT_BUCKET_CAP_MB = 25.0
GRAD_REDUCTIONS = ("mean", "sum")


class _Bucket:
    """Parameters of one dtype and device whose gradients travel in one flat all_reduce.

    ``buffer`` is laid out as every parameter's gradient, flattened, in ``params``
    order, followed by one element per parameter: how many ranks used it. The views
    of it (``views``, ``counts``) are made once: a hook only indexes lists.
    """

    def __init__(self, index: int, params: list[nn.Parameter]) -> None:
        self.index = index
        self.params = params
        total = sum(p.numel() for p in params)
        self.buffer = torch.zeros(total + len(params), dtype=params[0].dtype,
                                  device=params[0].device)
        self.views: list[torch.Tensor] = []  # views[i]: params[i]'s gradient in the buffer
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset:offset + p.numel()].view(p.shape))
            offset += p.numel()
        self.grads = self.buffer[:total]
        self.counts = self.buffer[total:]
        self.counts.fill_(1)  # a rank that produced no gradient for params[i] sets counts[i] = 0
        self.ready = [False] * len(params)  # ready[i]: params[i]'s gradient is in the buffer
        self.missing = len(params)
        self.work: Work | None = None

    def reset(self) -> None:
        if self.missing != len(self.params) or self.work is not None:
            self.counts.fill_(1)  # the reduction left the number of users there
            self.ready = [False] * len(self.params)
            self.missing = len(self.params)
        self.work = None


class DataParallel(nn.Module):
    """Wrap ``module`` for data-parallel training over ``comm`` (default ``collectives.init()``).

    :param module: the model; its parameters and buffers are overwritten by rank 0's here.
    :param comm: the communicator of the ranks that train together.
    :param bucket_cap_mb: about how many MB of gradients one all_reduce carries (> 0).
    :param grad_reduction: ``"mean"`` (sum / size, like DDP) or ``"sum"``; see the module docs.
    :param broadcast_buffers: also broadcast rank 0's buffers before every forward in
        training mode, like DDP's default. Off by default: with SyncBatchNorm
        the running statistics are already identical on every rank.
    :param gradient_as_bucket_view: ``True``: after backward each ``param.grad`` is a view
        into its bucket's buffer (DDP's option of that name, off by default as there): no
        copy in or out when the gradient is kept between steps, none out otherwise. The
        next backward writes that buffer, so a ``grad`` kept past it changes. ``False``
        (the default) gives every ``grad`` its own tensor (a copy per parameter per step).

    Raises ``TypeError``/``ValueError`` for bad arguments before any communication.
    ``module`` is reachable as ``.module`` (save ``model.module.state_dict()``).
    """

    def __init__(self, module: nn.Module, comm: Communicator | None = None, *,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, grad_reduction: str = "mean",
                 broadcast_buffers: bool = False, gradient_as_bucket_view: bool = False) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
        if comm is not None and not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a collectives.Communicator or None; got {type(comm).__name__}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a number > 0; got {bucket_cap_mb!r}")
        for name, flag in (("broadcast_buffers", broadcast_buffers),
                           ("gradient_as_bucket_view", gradient_as_bucket_view)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False; got {flag!r}")
        if grad_reduction not in GRAD_REDUCTIONS:
            raise ValueError(f"grad_reduction must be one of {', '.join(GRAD_REDUCTIONS)}; "
                             f"got {grad_reduction!r}")
        for name, p in module.named_parameters():
            if p.requires_grad and p.layout is not torch.strided:
                raise ValueError(f"parameter {name!r} has layout {p.layout}; only dense "
                                 "(strided) parameters are supported")
        self.module = module
        self.comm = collectives.init() if comm is None else comm
        self.grad_reduction = grad_reduction
        self.broadcast_buffers = bool(broadcast_buffers)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.bucket_cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.require_backward_grad_sync = True

        self._broadcast_state()
        self._buckets = self._make_buckets()
        self._scale = 1.0 / self.comm.size if grad_reduction == "mean" else None
        self._next_bucket = 0  # buckets are launched strictly in this order
        self._pending: list[Work] = []  # launched, not yet seen complete: poked by every hook
        self._callback_queued = False
        self._in_backward = False
        # One hook per parameter, bound to its bucket and position: no lookup per gradient.
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_accumulated, bucket, i))
            for bucket in self._buckets for i, p in enumerate(bucket.params)]

    # -- construction -------------------------------------------------------------------

    def _broadcast_state(self) -> None:
        """Rank 0's parameters and buffers on every rank: one broadcast per (device, dtype)."""
        tensors = [p.data for p in self.module.parameters()] + list(self.module.buffers())
        self._broadcast_from_rank0(tensors)

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            if t.numel():
                groups.setdefault((t.device, t.dtype), []).append(t)
        with torch.no_grad():
            for group in groups.values():
                flat = torch.cat([t.reshape(-1) for t in group])
                self.comm.broadcast(flat, src=0)
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _make_buckets(self) -> list[_Bucket]:
        # Reverse registration order approximates the order backward finishes the
        # gradients, so the first bucket fills (and goes out) first.
        params = [p for p in self.module.parameters() if p.requires_grad]
        open_buckets: dict[tuple[torch.device, torch.dtype], tuple[list[nn.Parameter], int]] = {}
        finished: list[list[nn.Parameter]] = []
        for p in reversed(params):
            key = (p.device, p.dtype)
            members, nbytes = open_buckets.get(key, ([], 0))
            members.append(p)
            nbytes += p.numel() * p.element_size()
            if nbytes >= self.bucket_cap_bytes:
                finished.append(members)
                open_buckets.pop(key, None)
            else:
                open_buckets[key] = (members, nbytes)
        finished.extend(members for members, _ in open_buckets.values())
        return [_Bucket(i, members) for i, members in enumerate(finished)]

    # -- forward ------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._in_backward:  # a previous backward was abandoned half-way: start clean
            self._reset()
        if self.broadcast_buffers and self.module.training:
            self._broadcast_from_rank0(list(self.module.buffers()))
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            for t in _tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._on_output_grad)
        return output

    # -- backward -----------------------------------------------------------------------

    def _queue_finish(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        # Gradients reached the output: backward has begun; finish at its end even if
        # no parameter of this rank receives a gradient.
        self._queue_finish()

    def _on_grad_accumulated(self, bucket: _Bucket, position: int, param: nn.Parameter) -> None:
        if not self.require_backward_grad_sync:
            return  # no_sync(): the gradient stays local and accumulates
        if not self._callback_queued:
            self._queue_finish()
        if bucket.ready[position]:
            return  # a second gradient for it in one backward (retain_graph): the first counts
        grad = param.grad
        assert grad is not None, "a post-accumulate-grad hook runs once the gradient is there"
        view = bucket.views[position]
        if grad is not view:  # (it is when grad was kept from the last step and accumulated in place)
            if torch.is_grad_enabled():  # backward(create_graph=True): keep the copy off the graph
                with torch.no_grad():
                    view.copy_(grad)
            else:
                view.copy_(grad)
        bucket.ready[position] = True
        bucket.missing -= 1
        if not bucket.missing and bucket.index == self._next_bucket:
            self._launch_ready_buckets()
        if self._pending:
            self._poke()

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self._buckets):
            bucket = self._buckets[self._next_bucket]
            if bucket.missing:
                return
            if self._scale is not None:
                bucket.grads.mul_(self._scale)  # "mean": one multiply per bucket, not per gradient
            bucket.work = self.comm.all_reduce(bucket.buffer, "sum", async_op=True)
            self._pending.append(bucket.work)
            self._next_bucket += 1

    def _poke(self) -> None:
        """Let the transport progress the pending reductions (MPI needs to be called)."""
        self._pending = [work for work in self._pending if not work.is_completed()]

    def _finish_backward(self) -> None:
        """End of backward: launch what is left (zeros for unused gradients), wait, set grads."""
        try:
            if not self.require_backward_grad_sync:
                return
            with torch.no_grad():
                for bucket in self._buckets[self._next_bucket:]:
                    if not bucket.missing:
                        continue
                    for position, p in enumerate(bucket.params):
                        if not bucket.ready[position]:
                            view = bucket.views[position]
                            if p.grad is view:  # grad is last step's bucket view: keep its value
                                p.grad = view.clone()
                            view.zero_()
                            bucket.counts[position] = 0
                            bucket.ready[position] = True
                    bucket.missing = 0
                self._launch_ready_buckets()
                for bucket in self._buckets:
                    assert bucket.work is not None
                    bucket.work.wait()
                    used = bucket.counts.tolist()
                    for position, p in enumerate(bucket.params):
                        if not used[position]:
                            continue  # no rank produced a gradient: leave grad as it was
                        view = bucket.views[position]
                        if p.grad is view:
                            continue
                        if self.gradient_as_bucket_view:
                            p.grad = view  # no copy: the gradient lives in the bucket
                        elif p.grad is None:
                            p.grad = view.clone()
                        else:
                            p.grad.copy_(view)
        finally:
            self._reset()

    def _reset(self) -> None:
        for bucket in self._buckets:
            bucket.reset()
        self._next_bucket = 0
        self._pending = []
        self._callback_queued = False
        self._in_backward = False

    def finish(self) -> None:
        """Complete the gradient reduction now, if a backward left one pending.

        ``loss.backward()`` already does this at its end (an autograd callback), so
        calling it is never needed after a normal backward; it is idempotent.
        """
        if self._in_backward:
            self._finish_backward()

    # -- gradient accumulation ------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context communicate nothing: gradients accumulate
        locally in ``param.grad``; the first backward outside reduces the accumulated sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    # -- introspection ------------------------------------------------------------------------

    @property
    def bucket_sizes(self) -> list[int]:
        """Number of parameters in each bucket, in launch order."""
        return [len(b.params) for b in self._buckets]

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the module trains locally afterwards)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []


def _tensors_in(output: Any) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from _tensors_in(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors_in(item)
