"""Backend registry and ``init()``: from ``COLLECTIVES_BACKEND`` and the launcher to a Communicator."""

from __future__ import annotations

import importlib
import os
import threading
from typing import Any

from . import config
from .communicator import Communicator
from .diagnostics import process_hooks
from .errors import BackendUnavailable
from .launcher import LaunchInfo, detect_launcher

#: backend name -> "module:class" of its Communicator, imported only when chosen.
BACKENDS: dict[str, str] = {
    "local": "collectives.backends.local:LocalCommunicator",
    "torch": "collectives.backends.torch_dist:TorchCommunicator",
    "mpi": "collectives.backends.mpi:MPICommunicator",
    "cupy": "collectives.backends.cupy_nccl:CupyNcclCommunicator",
}
#: The backends that need a CUDA device (the others run on any machine).
NEEDS_GPU = frozenset({"cupy"})
#: What "auto" picks for each launcher (None: no launcher).
AUTO_BACKEND: dict[str | None, str] = {"torchrun": "torch", "mpi": "mpi", "slurm": "mpi",
                                       None: "local"}

_lock = threading.Lock()
_default: Communicator | None = None


def resolve_backend(name: str | None, launch: LaunchInfo) -> str:
    """The backend that ``name`` (or ``COLLECTIVES_BACKEND``, or auto) means under ``launch``."""
    if name is None:
        name = os.environ.get(config.BACKEND, "").strip() or "auto"
    if not isinstance(name, str):
        raise TypeError(f"backend must be a str; got {type(name).__name__}")
    key = name.lower()
    if key == "auto":
        return AUTO_BACKEND[launch.launcher]
    if key not in BACKENDS:
        valid = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"unknown backend {name!r} (from the backend argument or "
                         f"{config.BACKEND}); valid: {valid}")
    return key


def backend_class(name: str) -> type[Communicator]:
    return _import_class(name, BACKENDS[name])


def _import_class(name: str, where: str) -> type[Communicator]:
    """The class ``where`` ("module:class") names, imported now; backend ``name`` for the error."""
    module_name, _, class_name = where.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise BackendUnavailable(f"backend {name!r} cannot be imported: {error}") from error
    cls: type[Communicator] = getattr(module, class_name)
    return cls


#: backend name -> "module:class" of its fault-tolerant Communicator (init(fault_tolerant=True)).
FAULT_TOLERANT_BACKENDS: dict[str, str] = {
    "torch": "collectives.backends.torch_elastic:ElasticTorchCommunicator",
    "mpi": "collectives.backends.mpi_ulfm:ULFMCommunicator",
    "local": BACKENDS["local"],
}


def fault_tolerant_class(name: str) -> type[Communicator]:
    """The fault-tolerant communicator of backend ``name``, or the refusal naming what works."""
    if name not in FAULT_TOLERANT_BACKENDS:
        from .elastic.support import refuse  # noqa: PLC0415

        raise refuse(name, "init(fault_tolerant=True)")
    return _import_class(name, FAULT_TOLERANT_BACKENDS[name])


def init(backend: str | None = None, *, timeout: Any = None,
         fault_tolerant: bool | None = None) -> Communicator:
    """The process's default communicator, created on the first call.

    ``backend`` is "auto", "local", "torch", "mpi" or "cupy"; ``None`` reads
    ``COLLECTIVES_BACKEND`` (auto when unset). auto picks torch under torchrun,
    mpi under mpiexec/mpirun/srun and local without a launcher. Later calls return
    the same communicator; naming another backend (or another timeout) then is a
    ``ValueError``.

    ``timeout``: seconds (or a ``datetime.timedelta``) a blocking collective may
    take before it raises ``CollectiveTimeout``; 0 means none; ``None`` reads
    ``COLLECTIVES_TIMEOUT`` (default 1800 s).

    ``fault_tolerant=True`` (``None`` reads ``COLLECTIVES_FAULT_TOLERANT``): a communicator that
    survives a peer's death (:class:`RankFailure`, ``shrink()``, ``agree()``; see
    :mod:`collectives.elastic`), without the process hooks that end the whole job when a rank
    fails; a backend that cannot is :class:`BackendUnavailable` naming the ones that can.
    """
    global _default
    with _lock:
        launch = detect_launcher()
        name = resolve_backend(backend, launch)
        seconds = config.timeout_seconds(timeout)  # a bad value fails before anything starts
        requested = fault_tolerant
        if fault_tolerant is None:
            fault_tolerant = bool(config.env_flag(config.FAULT_TOLERANT))
        while _default is not None and _default._fault.successor is not None:
            _default = _default._fault.successor  # a shrink's (fault tolerance)
        if _default is not None and not _default._closed:
            if backend is not None and name != _default.backend:
                raise ValueError(f"collectives is already initialized with backend "
                                 f"{_default.backend!r}; cannot switch to {name!r}")
            if timeout is not None and seconds != _default.timeout:
                raise ValueError(f"collectives is already initialized with timeout="
                                 f"{_default.timeout}; cannot change it to {seconds}")
            if requested is not None and requested != _fault_tolerant(_default):
                raise ValueError(f"collectives is already initialized with fault_tolerant="
                                 f"{not fault_tolerant}; cannot change it")
            return _default
        if fault_tolerant:  # no process hook: a failing rank must not end the job
            _default = fault_tolerant_class(name).from_launcher(launch, timeout=timeout)
            _default.trace_name = "world"
            return _default
        cls = backend_class(name)
        # The process-wide hooks (collectives/diagnostics/process_hooks.py): before the backend starts, so
        # a failing bootstrap ends the job, and after, around what the transport installed.
        process_hooks.install(launch)
        _default = cls.from_launcher(launch, timeout=timeout)
        _default.trace_name = "world"
        process_hooks.install(launch)
        return _default


def _fault_tolerant(comm: Communicator) -> bool:
    from .transport import Transport  # noqa: PLC0415

    return comm.size == 1 or type(comm._transport)._shrink is not Transport._shrink

