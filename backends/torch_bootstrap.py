"""How torch.distributed's default process group is made for a process a launcher started.

Under torchrun the group is made from env://. Under an MPI launcher rank 0 opens a
TCPStore on a free port and its address reaches the other ranks over MPI (an
integer broadcast, nothing unpickled). Without a launcher, a group of one.

Security: the store rank 0 serves under an MPI launcher listens on the launcher's
address only (loopback on one node; TCPStore alone would listen on every interface),
and on one node Gloo's sockets use the loopback interface unless
``GLOO_SOCKET_IFNAME`` says otherwise. The store speaks torch's fixed binary protocol;
nothing the project sends is pickled. Under an MPI launcher an uncaught exception
calls ``MPI_Abort`` (see :mod:`collectives.diagnostics.process_hooks`).

Gloo's interface: torch (2.13) builds every Gloo group's device from
``GLOO_SOCKET_IFNAME`` when it makes the group (``init_process_group`` and ``new_group``
take no Gloo device), so the interface chosen here is set in that variable, for this
process's later groups too; a value the user set is never overridden.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import socket
import sys
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from collectives.errors import BackendUnavailable
from collectives.launcher import LaunchInfo, check_world_size

from . import _network

# Minutes torch waits in a collective before it raises (torch's own default).
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
# What "no timeout" is for torch, which always wants one: ten years.
NO_TIMEOUT = datetime.timedelta(days=3650)


def torch_timeout(seconds: float | None) -> datetime.timedelta:
    """A communicator's timeout as torch takes it (``None``: :data:`NO_TIMEOUT`)."""
    return NO_TIMEOUT if seconds is None else datetime.timedelta(seconds=seconds)


def nccl_backstop(dist: Any, group: Any, seconds: float | None) -> None:
    """Give the NCCL backend of ``group`` (one made here; ``None``: the default group) the
    timeout ``2 * seconds + 60``, longer than the communicator's ``seconds``: the calls on CUDA
    streams are watched against ``seconds`` by the communicator (backends/torch_watch.py), which
    aborts the backend and raises ``CollectiveTimeout`` at the rank's next call; torch's own NCCL
    watchdog, which with torch's defaults (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) ends the
    process at its timeout, stays a backstop behind it. Nothing where the group has no NCCL
    backend or there is no timeout."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if seconds is None or nccl is None:
        return
    import torch  # noqa: PLC0415

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        backend = pg._get_backend(torch.device("cuda"))
    except Exception:  # noqa: BLE001  (no backend for CUDA tensors)
        return
    if isinstance(backend, nccl):
        try:
            backend._set_default_timeout(torch_timeout(2 * seconds + 60))
        except (AttributeError, RuntimeError):  # (a torch without it: its watchdog and ours race)
            pass


#: The oldest torch the torch backend runs on: pyproject.toml's floor, the oldest release
#: `make test-torch-versions` passes on. On 2.8 Gloo gives wrong results in some of the
#: backend's reduce_scatter emulations (bool MIN/MAX, bitwise ops): refused, not wrong.
TORCH_FLOOR = (2, 9)


def import_torch_distributed() -> Any:
    try:
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415
    except ImportError as error:
        raise BackendUnavailable(
            f"backend 'torch' needs PyTorch ({error}); install it with: pip install torch"
        ) from error
    if not dist.is_available():
        raise BackendUnavailable("backend 'torch': this PyTorch build has no torch.distributed")
    if _release(torch.__version__) < TORCH_FLOOR:
        floor = ".".join(map(str, TORCH_FLOOR))
        raise BackendUnavailable(
            f"backend 'torch' needs torch >= {floor} (this is {torch.__version__}, which gives wrong "
            f"results in some collectives); pip install 'torch>={floor}', or use COLLECTIVES_BACKEND=mpi")
    return dist


def _release(version: str) -> tuple[int, ...]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``."""
    parts = version.split("+")[0].split(".")[:2]
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in parts)


# Groups this module made (split's), and whether it made the default group: destroyed at
# exit, since Gloo groups still alive when the interpreter ends abort the process
# ("terminate called without an active exception").
created_groups: list[Any] = []
_created_default = False
# The transports whose plans hold a group's bound methods (backends/torch_plans.py): each
# forgets them first, or the group outlives destroy_process_group into the interpreter's end.
planning: weakref.WeakSet[Any] = weakref.WeakSet()
# The transports whose checks of CUDA calls are compared by the watchdog thread over a group of
# their own (backends/posted_checks.py): the watchdog stops before that group is destroyed.
posting: weakref.WeakSet[Any] = weakref.WeakSet()
# The transports whose calls on CUDA streams the watchdog thread watches against their timeout
# (backends/torch_watch.py): it stops looking before their groups are destroyed.
watching: weakref.WeakSet[Any] = weakref.WeakSet()


@atexit.register
def _destroy_created_groups() -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    # What holds a group lets go first, also where the program destroyed the default group
    # itself (``dist.destroy_process_group()`` with a communicator still open): a bound method
    # kept past that keeps the group alive into the interpreter's end, which aborts the process.
    for transport in list(planning):
        transport._forget_plans()
    for transport in list(posting):
        transport._stop_posting(settle=False)
    for transport in list(watching):
        transport._stop_watch()
    if not dist.is_initialized():
        return
    while created_groups:
        group = created_groups.pop()
        try:
            dist.destroy_process_group(group)
        except (ValueError, RuntimeError):
            pass  # closed already
    if _created_default:
        dist.destroy_process_group()


def bootstrap_process_group(dist: Any, launch: LaunchInfo,
                             timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> None:
    """Initialize torch's default group for a process started as ``launch`` says (its NCCL
    backend's timeout longer: :func:`nccl_backstop`)."""
    _init_default_group(dist, launch, timeout)
    nccl_backstop(dist, None, None if timeout == NO_TIMEOUT else timeout.total_seconds())


def _init_default_group(dist: Any, launch: LaunchInfo, timeout: datetime.timedelta) -> None:
    global _created_default
    _created_default = True
    if launch.size > 1 and launch.local_size == launch.size and "GLOO_SOCKET_IFNAME" not in os.environ \
            and _has_interface("lo"):
        # One node: Gloo's pairs need not listen on the host's public address. (torch takes
        # Gloo's interface from this variable only: see the module's docstring.)
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"

    backend = device_backend(launch.local_rank)
    if launch.launcher == "torchrun":
        _choose_gloo_interface(launch, os.environ.get("MASTER_ADDR"))
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return
    if launch.size == 1:
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return
    # MPI launcher: rank 0's store address travels over MPI. (collectives.init() installed
    # the MPI abort hook before, and installs it again around torch's after: see
    # collectives/diagnostics/process_hooks.py.)
    store = mpi_shared_tcp_store(launch, timeout)
    _choose_gloo_interface(launch, store.host)
    dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.size,
                            timeout=timeout)


def device_backend(local_rank: int) -> str:
    """The backend of a process group of this process: Gloo for CPU tensors and NCCL for CUDA
    tensors where this torch has CUDA (its GPU ``local_rank`` % devices bound first: NCCL takes
    it from there, before any communicator exists), else Gloo alone."""
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        return "gloo"
    torch.cuda.set_device(local_rank % torch.cuda.device_count())
    return "cpu:gloo,cuda:nccl"


def _has_interface(name: str) -> bool:
    try:
        return any(interface == name for _, interface in socket.if_nameindex())
    except OSError:
        return False


def _choose_gloo_interface(launch: LaunchInfo, store_address: str | None) -> None:
    """Across hosts Gloo binds (and advertises) the address this host's name resolves to;
    where that is a loopback address (Debian's ``127.0.1.1 <hostname>``) no other host could
    connect, so Gloo is given the interface this host reaches the store over instead."""
    if launch.size == 1 or launch.local_size == launch.size or "GLOO_SOCKET_IFNAME" in os.environ \
            or not store_address:
        return
    own = _network.own_address()
    if own is not None and not _network.is_loopback(own):
        return
    source = _network.address_towards([store_address])
    interface = _network.interface_with_address(source) if source else None
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def store_host(launch: LaunchInfo, peers: Sequence[str] | None = None) -> str:
    """The address rank 0's store listens on and advertises: MASTER_ADDR if set; loopback on
    one node (the launcher says so, or no rank is on another host: ``peers`` empty); else
    this host's address as its name resolves, unless that is a loopback address (no other
    host reaches it): then the address this host reaches ``peers`` (the other hosts' names)
    from. ``peers`` ``None``: unknown."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    if (launch.local_size is not None and launch.local_size == launch.size) or (peers is not None and len(peers) == 0):
        return "127.0.0.1"
    peers = list(peers or ())
    own = _network.own_address()
    if own is not None and not _network.is_loopback(own):
        return own
    reachable = _network.address_towards(peers)
    if reachable is None:
        raise BackendUnavailable(
            f"backend 'torch': this host's name {socket.gethostname()!r} resolves to {own or 'nothing'}, "
            f"which the other hosts ({', '.join(peers) or 'unknown'}) cannot reach, and no route to them "
            "was found; set MASTER_ADDR to an address of rank 0's host that they reach")
    return reachable


# Bytes of a host name or address on the wire (DNS names are at most 253).
_HOST_BYTES = 256


def _host_bytes(name: str) -> Any:
    import numpy as np  # noqa: PLC0415

    raw = np.zeros(_HOST_BYTES, dtype=np.uint8)
    encoded = name.encode()[:_HOST_BYTES - 1]
    raw[:len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
    return raw


def _host_from_bytes(raw: Any) -> str:
    host: str = raw.tobytes().split(b"\0", 1)[0].decode()
    return host


def mpi_shared_tcp_store(launch: LaunchInfo, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                         port: int = 0, multi_tenant: bool = False) -> Any:
    """A TCPStore served by rank 0 on a free port of :func:`store_host` (or on ``port``).

    Every rank's host name goes to rank 0 (fixed-size bytes over ``MPI_Gather``) so that it
    can pick an address the other hosts reach; rank 0's address (bytes) and port (one int64)
    go back over ``MPI_Bcast``. Nothing is pickled. Rank 0 binds the listening socket itself
    and hands it to the store, because TCPStore given only a port listens on every interface.
    ``multi_tenant``: rank 0's server is one torch's later stores on its port share (torch's
    env:// makes its store so)."""
    import numpy as np  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from collectives.backends.mpi_channel import import_mpi  # noqa: PLC0415

    MPI = import_mpi()
    comm = MPI.COMM_WORLD
    check_world_size(launch, comm.Get_size())  # srun without --mpi: one-rank MPI jobs
    me = socket.gethostname()
    names = np.zeros((comm.Get_size(), _HOST_BYTES), dtype=np.uint8) if comm.Get_rank() == 0 else None
    comm.Gather(_host_bytes(me), names, root=0)
    chosen, port_word = port, np.zeros(1, dtype=np.int64)
    store = None
    if names is not None:  # rank 0
        peers = list(dict.fromkeys(name for name in map(_host_from_bytes, names) if name != me))
        host = store_host(launch, peers)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.bind((host, chosen))
        listener.listen(max(128, launch.size))
        port_word[0] = listener.getsockname()[1]
        # detach(): the store serves on the descriptor from now on, not the Python object.
        store = dist.TCPStore(host, int(port_word[0]), launch.size, is_master=True, timeout=timeout,
                              wait_for_workers=False, master_listen_fd=listener.detach(),
                              multi_tenant=multi_tenant)
        host_raw = _host_bytes(host)
    else:
        host_raw = np.zeros(_HOST_BYTES, dtype=np.uint8)
    comm.Bcast(host_raw, root=0)
    comm.Bcast(port_word, root=0)
    if comm.Get_rank() != 0:
        store = dist.TCPStore(_host_from_bytes(host_raw), int(port_word[0]), launch.size, is_master=False,
                              timeout=timeout)
    return store


@contextlib.contextmanager
def group_named(name: str) -> Iterator[None]:
    """Make torch.distributed's next new_group take ``name`` (see TorchCommunicator._split).

    A patch of torch's private ``_process_group_name`` because torch (2.13) has no public way
    to name a group: ``new_group`` derives the name from the ranks and from how many groups
    this process has made (``group_desc`` only describes it), and ``split_group`` likewise."""
    import torch.distributed.distributed_c10d as c10d  # noqa: PLC0415

    original = getattr(c10d, "_process_group_name", None)
    if original is None:  # another torch: its own naming
        yield
        return
    def process_group_name(ranks: Any, use_hashed_name: Any) -> Any:
        return c10d.GroupName(name) if hasattr(c10d, "GroupName") else name

    c10d._process_group_name = process_group_name
    try:
        yield
    finally:
        c10d._process_group_name = original


def store_said(store: Any, key: str, deadline: float) -> bool:
    """Whether ``key`` is set in torch's ``store`` by ``deadline`` (``time.monotonic()``)."""
    try:
        store.wait([key], torch_timeout(max(deadline - time.monotonic(), 0.001)))
    except Exception:  # noqa: BLE001 - torch's store raises its own error at the timeout
        return False
    return True
