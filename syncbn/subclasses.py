"""Batch-norm subclasses, synchronized with their own behaviour kept.

A subclass of torch's batch norms may do more than normalize: timm's ``BatchNormAct2d``
normalizes, then applies dropout and an activation, all in its own ``forward``. Replacing
it by a plain :class:`~collectives.syncbn.SyncBatchNorm` would drop the rest silently.
:func:`synchronized` converts such a module into an instance of a class made for it,
``Sync<Name>``, a subclass of both its class and SyncBatchNorm: every method is its class's,
and its ``forward`` runs in training with each ``torch.nn.functional.batch_norm`` call on
the module's own weight and running statistics made synchronized over the communicator (a
``TorchFunctionMode`` sees the call). A training forward that makes no such call (a class
that normalizes by other means) raises ``TypeError`` naming the class, never runs
unsynchronized. In eval nothing is communicated, so the class's forward runs as it is.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from collectives import Communicator

from .function import SyncBatchNormFunction

_CLASSES: dict[type[Any], type[Any]] = {}
_LOCK = threading.Lock()


class _SynchronizedCalls(TorchFunctionMode):
    """Inside ``module``'s forward: its batch-norm calls in training become synchronized ones."""

    def __init__(self, module: Any, comm: Communicator | None) -> None:
        super().__init__()
        self.module, self.comm, self.calls = module, comm, 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.batch_norm:
            call = _functional_arguments(*args, **kwargs)
        elif func is torch.batch_norm:
            call = _aten_arguments(*args, **kwargs)
        else:
            return func(*args, **kwargs)
        x, weight, bias, mean, var, training, momentum, eps = call
        if not training or not self._own(weight, bias, mean, var):
            return func(*args, **kwargs)
        self.calls += 1
        if x.numel() // max(x.shape[1], 1) == 1 and (self.comm is None or self.comm.size == 1):
            raise ValueError(f"expected more than 1 value per channel when training; got input of shape "
                             f"{tuple(x.shape)}")
        # The class's forward has counted the batch (num_batches_tracked) and turned momentum
        # into this call's factor already: the running stats are updated with it as given.
        return SyncBatchNormFunction.apply(  # type: ignore[no-untyped-call]  # unannotated in torch
            x, weight, bias, mean, var, None, momentum, eps, self.comm)

    def _own(self, *tensors: Any) -> bool:
        module = self.module
        mine = [module.weight, module.bias, module.running_mean, module.running_var]
        if all(t is None for t in tensors):
            return all(t is None for t in mine)
        return any(t is not None and any(t is m for m in mine) for t in tensors)


def _functional_arguments(input: Any, running_mean: Any, running_var: Any, weight: Any = None, bias: Any = None,
                          training: bool = False, momentum: float = 0.1, eps: float = 1e-5) -> tuple[Any, ...]:
    return input, weight, bias, running_mean, running_var, training, momentum, eps


def _aten_arguments(input: Any, weight: Any, bias: Any, running_mean: Any, running_var: Any, training: bool,
                    momentum: float, eps: float, cudnn_enabled: bool = True) -> tuple[Any, ...]:
    return input, weight, bias, running_mean, running_var, training, momentum, eps


class _Synchronized:
    """What the class made for a batch-norm subclass adds to it (first in its bases)."""

    _synchronized_from: type[Any]
    _synchronized_base: type[Any]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        original = self._synchronized_from
        module: Any = self
        if not module.training:  # eval: nothing is communicated (torch.nn.SyncBatchNorm's rule)
            return original.forward(self, *args, **kwargs)
        with _SynchronizedCalls(self, module._resolved_comm()) as calls:
            output = original.forward(self, *args, **kwargs)
        if not calls.calls:
            raise TypeError(
                f"{original.__module__}.{original.__qualname__}.forward normalized without calling "
                "torch.nn.functional.batch_norm on its own weight and running statistics, so "
                "convert_sync_batchnorm cannot synchronize it; synchronize that class by hand (e.g. a "
                "subclass of collectives.syncbn.SyncBatchNorm that does what its forward does)")
        return output

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The made class is found again from the original (which pickles by name), not by its own name.
        return _new, (self._synchronized_from, self._synchronized_base), dict(vars(self))


def _new(original: type[Any], base: type[Any]) -> Any:
    return object.__new__(synchronized_class(original, base))  # as torch.nn.Module makes one


def synchronized_class(original: type[Any], base: type[Any]) -> type[Any]:
    """``Sync<Name>``: a subclass of ``original`` and of ``base`` (SyncBatchNorm; passed in,
    since its module imports this one), one per class."""
    with _LOCK:
        made = _CLASSES.get(original)
        if made is None:
            made = type(f"Sync{original.__name__}", (_Synchronized, original, base),
                        {"_synchronized_from": original, "_synchronized_base": base,
                         "__module__": original.__module__,
                         "__qualname__": f"Sync{original.__qualname__}"})
            _CLASSES[original] = made
    return made


def with_state(cls: type[Any], module: Any, **attributes: Any) -> torch.nn.Module:
    """A new ``cls`` module with ``module``'s state: the same parameters, buffers, submodules
    and hooks (the dictionaries that hold them copied, so that the two stay apart)."""
    state = {key: value.copy() if isinstance(value, (dict, collections.OrderedDict)) else value
             for key, value in vars(module).items()}
    state.update(attributes)
    new: torch.nn.Module = object.__new__(cls)
    new.__dict__.update(state)
    return new


def synchronized(module: Any, comm_ref: Any, base: type[Any]) -> torch.nn.Module:
    """``module`` (a batch-norm subclass) as its ``Sync<Name>`` class (also a ``base``), sharing
    its state."""
    return with_state(synchronized_class(type(module), base), module, _comm_ref=comm_ref)


def unsynchronized(module: Any) -> torch.nn.Module:
    """The reverse of :func:`synchronized`: the original class, sharing the state."""
    reverted = with_state(module._synchronized_from, module)
    reverted.__dict__.pop("_comm_ref", None)
    return reverted
