"""``SyncBatchNorm``: a drop-in for torch.nn.SyncBatchNorm and BatchNorm1d/2d/3d over any Communicator.

Same constructor arguments, parameters, buffers and state_dict keys as torch's
batch norms (it is a ``torch.nn.modules.batchnorm._BatchNorm``), so checkpoints
load either way. Unlike torch.nn.SyncBatchNorm it runs on CPU as well as CUDA
and needs no torch.distributed: statistics travel through a
:class:`collectives.Communicator` (local, torch, mpi, cupy).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

import collectives
from collectives import Communicator

from . import subclasses
from .function import SyncBatchNormFunction

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _CommRef:
    """Holds a module's communicator: shared (not copied) by ``copy.deepcopy``, and dropped
    by pickling (a communicator cannot cross processes), which leaves the default."""

    __slots__ = ("comm",)

    def __init__(self, comm: Communicator | None) -> None:
        self.comm = comm

    def __deepcopy__(self, memo: dict[int, Any]) -> _CommRef:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_CommRef, (None,))


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the batch of every rank of ``comm``.

    Input ``(N, C)``, ``(N, C, L)``, ``(N, C, H, W)`` or ``(N, C, D, H, W)`` with
    ``C == num_features``; output of the same shape, dtype and memory format. N and
    the spatial sizes may differ between ranks, and may be 0 on some (that rank
    still takes part in every collective and gets an empty output and gradient).

    Training: mean and variance over the union of every rank's batch (one
    all_gather forward, one all_reduce of 2C values backward); running stats get
    the unbiased global variance, identically on every rank; a globally empty
    batch leaves them (and ``num_batches_tracked``) unchanged. Eval with running
    stats communicates nothing; eval with ``track_running_stats=False`` normalizes
    with this rank's batch alone, as torch.nn.SyncBatchNorm does.

    ``comm``: the communicator; ``None`` means ``collectives.init()``, resolved at
    the first training forward (so the model may be built before ``init``).
    float16/bfloat16 input works with float32 parameters (accumulation in float32).
    """

    #: The batch norm class revert_sync_batchnorm makes (set by convert_sync_batchnorm).
    _reverts_to: type[torch.nn.Module]

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 comm: Communicator | None = None, device: Any = None, dtype: Any = None) -> None:
        if comm is not None and not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a collectives.Communicator or None; got {type(comm).__name__}")
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self._comm_ref = _CommRef(comm)

    @property
    def comm(self) -> Communicator | None:
        """The communicator given at construction (``None``: ``collectives.init()``)."""
        return self._comm_ref.comm

    @comm.setter
    def comm(self, comm: Communicator | None) -> None:
        if comm is not None and not isinstance(comm, Communicator):
            raise TypeError(f"comm must be a collectives.Communicator or None; got {type(comm).__name__}")
        self._comm_ref = _CommRef(comm)

    def _resolved_comm(self) -> Communicator:
        comm = self._comm_ref.comm
        return collectives.init() if comm is None else comm

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"input must be a torch.Tensor; got {type(input).__name__}")
        if not 2 <= input.dim() <= 5:
            raise ValueError(f"input must have 2 to 5 dimensions (N, C, *spatial); got shape "
                             f"{tuple(input.shape)}")
        if input.shape[1] != self.num_features:
            raise ValueError(f"input has {input.shape[1]} channels (dimension 1) but num_features="
                             f"{self.num_features}; got shape {tuple(input.shape)}")
        if input.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"input dtype {input.dtype} is not supported; allowed: float16, "
                            "bfloat16, float32, float64")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input``; in training, with statistics of every rank's batch."""
        self._check_input_dim(input)
        use_batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if not use_batch_stats:  # eval with running stats: nothing to communicate
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias,
                                False, 0.0, self.eps)
        tracking = self.training and self.track_running_stats
        comm = self._resolved_comm() if self.training else None
        if input.numel() // input.shape[1] == 1 and (comm is None or comm.size == 1):
            # torch's rule; across ranks a single value per channel is legal (others add more).
            raise ValueError(f"expected more than 1 value per channel when training; got input "
                             f"of shape {tuple(input.shape)}")
        # torch leaves Function.apply unannotated.
        output: torch.Tensor = SyncBatchNormFunction.apply(  # type: ignore[no-untyped-call]
            input, self.weight, self.bias,
            self.running_mean if tracking else None,
            self.running_var if tracking else None,
            self.num_batches_tracked if tracking else None,
            self.momentum, self.eps, comm)
        return output

    def extra_repr(self) -> str:
        comm = self._comm_ref.comm
        where = "collectives.init()" if comm is None else repr(comm)
        torch_repr: str = super().extra_repr()  # type: ignore[no-untyped-call]  # unannotated in torch
        return f"{torch_repr}, comm={where}"


class BatchNormXd(_BatchNorm):
    """Plain (unsynchronized) torch batch norm that takes 2- to 5-dimensional input:
    what :func:`revert_sync_batchnorm` returns where the original class is unknown."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if not 2 <= input.dim() <= 5:
            raise ValueError(f"input must have 2 to 5 dimensions (N, C, *spatial); got shape "
                             f"{tuple(input.shape)}")


def _copy_state(source: _BatchNorm, target: _BatchNorm) -> _BatchNorm:
    """Make ``target`` share ``source``'s parameters and buffers and training mode."""
    with torch.no_grad():
        if source.affine:
            target.weight = source.weight
            target.bias = source.bias
        if source.track_running_stats:
            target.running_mean = source.running_mean
            target.running_var = source.running_var
            target.num_batches_tracked = source.num_batches_tracked
    target.training = source.training
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig
    return target


#: The batch norms that do nothing but normalize: converted into a plain SyncBatchNorm.
_PLAIN = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm, _BatchNorm)


def convert_sync_batchnorm(module: torch.nn.Module, comm: Communicator | None = None) -> torch.nn.Module:
    """Replace every batch-norm layer in ``module`` (recursively) by a synchronized one.

    torch.nn.BatchNorm1d/2d/3d, torch.nn.SyncBatchNorm, :class:`BatchNormXd` and our
    SyncBatchNorm become :class:`SyncBatchNorm`. A subclass of any of them that does more
    (timm's ``BatchNormAct2d``: batch norm, dropout, activation) keeps what it does: it
    becomes a ``Sync<Name>``, a subclass of both its class and SyncBatchNorm whose forward
    is its class's with the batch norm synchronized (see ``collectives.syncbn.subclasses``;
    a class whose forward normalizes without ``torch.nn.functional.batch_norm`` raises
    ``TypeError`` naming it at its first training forward). A subclass of our SyncBatchNorm
    keeps its class. The new layers share the old ones' parameters and buffers (no copy)
    and keep their training mode. Returns the converted module (``module`` itself when it
    is not a batch norm, with its children replaced).
    """
    if comm is not None and not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a collectives.Communicator or None; got {type(comm).__name__}")
    if isinstance(module, _BatchNorm):
        cls = type(module)
        if cls in (SyncBatchNorm, BatchNormXd) or cls in _PLAIN:
            converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                      module.track_running_stats, comm=comm)
            # What revert_sync_batchnorm goes back to (torch's BatchNorm1d/2d/3d; else BatchNormXd).
            converted._reverts_to = getattr(module, "_reverts_to", cls)
            return _copy_state(module, converted)
        if isinstance(module, SyncBatchNorm):  # ours already, its own class kept (or a Sync<Name>)
            return subclasses.with_state(cls, module, _comm_ref=_CommRef(comm))
        return subclasses.synchronized(module, _CommRef(comm), SyncBatchNorm)
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, comm))
    return module


_REVERTIBLE = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


def revert_sync_batchnorm(module: torch.nn.Module) -> torch.nn.Module:
    """The reverse of :func:`convert_sync_batchnorm`: every :class:`SyncBatchNorm` (and
    torch.nn.SyncBatchNorm) becomes the torch BatchNorm1d/2d/3d it was converted from,
    else :class:`BatchNormXd`, and a ``Sync<Name>`` the class it was made from; parameters
    and buffers are shared, training mode kept."""
    if isinstance(module, subclasses._Synchronized):
        return subclasses.unsynchronized(module)
    if isinstance(module, (SyncBatchNorm, torch.nn.SyncBatchNorm)):
        original = getattr(module, "_reverts_to", None)
        cls = original if original in _REVERTIBLE else BatchNormXd
        reverted = cls(module.num_features, module.eps, module.momentum, module.affine,
                       module.track_running_stats)
        return _copy_state(module, reverted)
    for name, child in module.named_children():
        module.add_module(name, revert_sync_batchnorm(child))
    return module
