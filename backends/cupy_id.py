"""Getting one NCCL unique id to every rank, before any NCCL communicator exists.

Rank 0 makes the id (128 opaque bytes); the others receive exactly those bytes:
- under an MPI launcher (mpiexec, mpirun, srun) through ``MPI_Bcast`` of a uint8 array,
- under torchrun through a TCP store at ``MASTER_ADDR:MASTER_PORT`` (torch's TCPStore,
  the one torchrun's agent already serves when it does),
- without a launcher there is one rank and nothing to exchange.

Nothing read from the network is unpickled: the wire format is the id's raw bytes,
checked for length. None of this touches CUDA or CuPy, so it is tested on CPU.
"""

from __future__ import annotations

import datetime
import itertools
import os
import platform
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from collectives.errors import BackendUnavailable, CollectiveError
from collectives.launcher import LaunchInfo, check_world_size

#: ``NCCL_UNIQUE_ID_BYTES`` of nccl.h: the id is this many opaque bytes.
UNIQUE_ID_BYTES = 128
#: Seconds a rank waits for rank 0's id in the store.
STORE_TIMEOUT = datetime.timedelta(minutes=10)
#: Key prefix in the store, so our keys never meet torch's own.
STORE_PREFIX = "collectives/nccl_unique_id"
#: Key prefix in the store of the cupy transport's CPU channels (backends/cupy_host.py).
CHECKS_PREFIX = "collectives/cupy_checks"

# CuPy hands the id around as a tuple of C ``char`` values: signed on x86-64, unsigned on
# the Arm and POWER ABIs. The tuple we rebuild must fit the char of this machine.
_CHAR_IS_SIGNED = platform.machine().lower() not in ("aarch64", "arm64", "armv7l", "ppc64le",
                                                     "s390x")

# Every call of exchange_unique_id in this process, numbered: every rank makes the same calls
# in the same order, so the n-th id has the same key on every rank.
_generation = itertools.count()
# Every CPU channel of a cupy world communicator made in this process (the same on every rank).
_hosts = itertools.count()
_store: Any = None


def id_to_bytes(unique_id: tuple[int, ...] | bytes) -> bytes:
    """The 128 raw bytes of an id as ``cupy.cuda.nccl.get_unique_id()`` returns it."""
    raw = bytes(b & 0xFF for b in unique_id)
    _check_length(raw, "the unique id")
    return raw


def id_from_bytes(raw: bytes) -> tuple[int, ...]:
    """The tuple ``cupy.cuda.nccl.NcclCommunicator`` takes, from the 128 raw bytes."""
    _check_length(raw, "the unique id received")
    if _CHAR_IS_SIGNED:
        return tuple(b - 256 if b > 127 else b for b in raw)
    return tuple(raw)


def comm_id_argument(raw: bytes, cupy_version: str) -> bytes | tuple[int, ...]:
    """What ``cupy.cuda.nccl.NcclCommunicator(ndev, commId, rank)`` takes as ``commId`` in
    the CuPy of ``cupy_version``: the raw bytes from CuPy 14 on (its ``get_unique_id`` returns
    bytes, and a tuple is a TypeError there), the tuple of C chars before."""
    _check_length(raw, "the unique id received")
    match = re.match(r"\d+", cupy_version)
    if match and int(match.group()) >= 14:
        return bytes(raw)
    return id_from_bytes(raw)


def _check_length(raw: bytes, what: str) -> None:
    if len(raw) != UNIQUE_ID_BYTES:
        raise CollectiveError(f"{what} has {len(raw)} bytes; an NCCL unique id has "
                              f"{UNIQUE_ID_BYTES}")


def exchange_route(launch: LaunchInfo) -> str:
    """How the id travels for a process started as ``launch`` says: "single", "mpi" or "store"."""
    if launch.size == 1:
        return "single"
    if launch.is_mpi_launcher:
        return "mpi"
    if launch.launcher == "torchrun":
        return "store"
    raise BackendUnavailable(f"backend 'cupy' cannot exchange an NCCL id under launcher "
                             f"{launch.launcher!r}; use mpiexec/mpirun/srun or torchrun")


def exchange_unique_id(launch: LaunchInfo, make_id: Callable[[], bytes]) -> bytes:
    """Rank 0's ``make_id()`` on every rank of the launched job (collective over the job).

    ``make_id`` is called on rank 0 only and returns the id's raw bytes.
    """
    route = exchange_route(launch)
    generation = next(_generation)
    if route == "single":
        return _checked(make_id())
    if route == "mpi":
        from collectives.backends.mpi_channel import import_mpi  # noqa: PLC0415

        check_world_size(launch, import_mpi().COMM_WORLD.Get_size())  # srun without --mpi
        return mpi_broadcast_bytes(make_id() if launch.rank == 0 else None)
    key = f"{generation}"
    store = torchrun_store(launch)
    if launch.rank == 0:
        raw = _checked(make_id())
        store.set(key, raw)
        return raw
    return _checked(bytes(store.get(key)))


def host_channel(launch: LaunchInfo, timeout: float | None) -> Any:
    """The CPU channel of the cupy world communicator of a job started as ``launch`` says
    (collective over its ranks; backends/cupy_host.py says what it is for): under an MPI launcher
    an :class:`~collectives.backends.cupy_host.MPIHost` over COMM_WORLD's ranks, under torchrun a
    :class:`~collectives.backends.cupy_host.GlooHost` on the rendezvous store (its Gloo calls
    under ``timeout`` seconds, None: none); ``None`` at one rank."""
    route = exchange_route(launch)
    if route == "mpi":
        from collectives.backends.cupy_host import MPIHost  # noqa: PLC0415
        from collectives.backends.mpi_channel import import_mpi  # noqa: PLC0415

        MPI = import_mpi()
        return MPIHost(MPI, MPI.COMM_WORLD.Dup())
    if route == "store":
        import torch  # noqa: PLC0415

        prefixed = torch.distributed.PrefixStore(f"{CHECKS_PREFIX}/{next(_hosts)}", torchrun_store(launch))
        return gloo_host(prefixed, launch.rank, launch.size, timeout)
    return None


def gloo_host(store: Any, rank: int, size: int, timeout: float | None) -> Any:
    """A :class:`~collectives.backends.cupy_host.GlooHost` of ``size`` ranks (this one ``rank``) on
    ``store``, a prefix of torch's store that is the channel's own (collective over the ranks; its
    Gloo calls under ``timeout`` seconds, None: none): the CPU channel under torchrun, and that of a
    "collectives" process group's cupy communicator (collectives.c10d, on the group's store)."""
    import torch  # noqa: PLC0415
    from collectives.backends.cupy_host import GlooHost  # noqa: PLC0415

    seconds = datetime.timedelta(days=365) if timeout is None else datetime.timedelta(seconds=timeout)
    return GlooHost(torch, store, rank, size, seconds)


def _checked(raw: bytes) -> bytes:
    raw = bytes(raw)
    _check_length(raw, "the unique id")
    return raw


def mpi_broadcast_bytes(raw: bytes | None, comm: Any = None, root: int = 0) -> bytes:
    """Rank ``root``'s 128 bytes on every rank of ``comm`` (default MPI.COMM_WORLD)."""
    if comm is None:
        from collectives.backends.mpi_channel import import_mpi  # noqa: PLC0415

        comm = import_mpi().COMM_WORLD
    buf = np.zeros(UNIQUE_ID_BYTES, dtype=np.uint8)
    if comm.Get_rank() == root:
        if raw is None:
            raise ValueError("the root rank must pass the id's bytes")
        buf[:] = np.frombuffer(_checked(raw), dtype=np.uint8)
    comm.Bcast(buf, root=root)
    return buf.tobytes()


def torchrun_store(launch: LaunchInfo) -> Any:
    """A store at ``MASTER_ADDR:MASTER_PORT`` for this job, opened once per process.

    Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE=True``, torchrun's default)
    the agent serves it and every rank is a client; otherwise rank 0 serves it, as
    torch's env:// rendezvous does.
    """
    global _store
    if _store is not None:
        return _store
    try:
        import torch.distributed as dist  # noqa: PLC0415
    except ImportError as error:
        raise BackendUnavailable(f"backend 'cupy' under torchrun needs torch for its TCP store "
                                 f"({error})") from error
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise BackendUnavailable("backend 'cupy' under torchrun needs MASTER_ADDR and an integer "
                                 "MASTER_PORT (torchrun sets both)") from None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        store = dist.TCPStore(host, port, is_master=False, timeout=STORE_TIMEOUT)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"{STORE_PREFIX}/attempt_{attempt}"
    else:
        store = dist.TCPStore(host, port, launch.size, is_master=launch.rank == 0,
                              timeout=STORE_TIMEOUT, wait_for_workers=False, multi_tenant=True)
        prefix = STORE_PREFIX
    _store = dist.PrefixStore(prefix, store)
    return _store
