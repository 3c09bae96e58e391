"""The CPU twin of the "collectives" process group's CUDA decision over the cupy transport: a group
whose operations on CPU tensors are taken as a CUDA tensor's are there (enqueued on the caller's
stream by the caller's thread, collectives/c10d/streams.py), over a cupy communicator made as the
group's is (collectives/c10d/rendezvous.py: the NCCL id through torch's store, the CPU channel of
the default check a Gloo group on it) around :mod:`collectives.testing.fake_cupy`'s NCCL, whose
calls move the tensors' host memory over Gloo under torchrun (a twin over a real transport).

The fake device's streams and events stand in for torch's CUDA ones (on the group, and on the
transport for torch tensors): what the calling thread asks of the device is counted by
:func:`~collectives.testing.fake_cupy.device` (host waits, event queries by thread). The
transport takes a CPU tensor as a CUDA tensor of its device through the row's method (the planned
fast path tests ``is_cuda``: a real GPU's calls take it). Imported explicitly (it imports torch);
inside ``fake_cupy.installed()``. Checked by tests/torch_distributed/test_c10d_streams.py.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

from collectives import arrays
from collectives.backends.cupy_handles import _TorchStreams, wait_for
from collectives.backends.cupy_nccl import CupyNcclTransport
from collectives.c10d.process_group import ProcessGroupCollectives
from collectives.c10d.rendezvous import _cupy_communicator, group_over
from collectives.c10d.streams import TorchStreams


def _cuda() -> Any:
    return sys.modules["cupy"].cuda


class TwinTorchStreams(_TorchStreams):
    """The cupy transport's stream library of torch tensors, on the fake device's stream and events."""

    def __init__(self, device: int) -> None:
        super().__init__(device)
        self.current_stream = _cuda().get_current_stream

    def use(self, stream: Any) -> Any:
        return contextlib.nullcontext(stream)

    @staticmethod
    def stream_ptr(stream: Any) -> int:
        return int(stream.ptr)

    def new_event(self) -> Any:
        return _cuda().Event()

    def wait_event(self, event: Any, x: Any) -> None:
        _cuda().get_current_stream().wait_event(event)


class TwinTransport(CupyNcclTransport):
    """The cupy transport taking CPU tensors as CUDA tensors of its device."""

    def _check_device(self, x: Any, adapter: Any) -> None:
        if adapter is arrays.TORCH and not x.is_cuda:
            return
        super()._check_device(x, adapter)

    def _library(self, adapter: Any) -> Any:
        if adapter is arrays.TORCH and adapter not in self._libraries:
            self._libraries[adapter] = TwinTorchStreams(self.device)
        return super()._library(adapter)


class TwinStreams(TorchStreams):
    """The group's streams and events (collectives.c10d.streams.TorchStreams) on the fake device."""

    def __init__(self) -> None:
        super().__init__(0)

    def current_stream(self) -> Any:
        return _cuda().get_current_stream()

    @staticmethod
    def new_event() -> Any:
        return _cuda().Event()

    @staticmethod
    def query(event: Any) -> bool:
        return bool(event.done)

    @staticmethod
    def synchronize(event: Any) -> None:
        """(The fake device's events complete when the test resumes it: polled, as the cupy
        transport's host waits poll.)"""
        event.synchronize()
        wait_for(lambda: event.done, 60.0)


class TwinGroup(ProcessGroupCollectives):
    """A "collectives" group over the twin transport, whose every tensor is a device tensor."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._streams = TwinStreams()

    def _on_device(self, t: Any) -> bool:
        return True


def twin_group(store: Any, rank: int, size: int, timeout: Any) -> TwinGroup:
    """A :class:`TwinGroup` of ``size`` ranks (this one ``rank``) on torch's ``store`` (a prefix of
    its own), made as the creator of the "collectives" backend makes a group over cupy;
    ``timeout``: torch's (a ``timedelta``). Collective over the ranks, inside ``fake_cupy.installed()``."""
    comm = _cupy_communicator(store, rank, size, TwinTransport)
    group = group_over("cupy", comm, store, rank, size, timeout, TwinGroup)
    assert isinstance(group, TwinGroup)
    return group
