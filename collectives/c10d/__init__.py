"""A torch.distributed backend named "collectives", made of a Communicator.

    import collectives.c10d                       # registers the backend (once)
    collectives.c10d.init_process_group()         # rendezvous under mpiexec/mpirun/srun/torchrun
    model = torch.nn.parallel.DistributedDataParallel(model)

or plain ``dist.init_process_group("collectives")`` (env://), or the mixed
``"cpu:gloo,cuda:collectives"``. The transport is the one ``collectives.init()`` picks
(``COLLECTIVES_BACKEND``, else auto): ``mpi`` (CPU and CUDA tensors), ``cupy`` (CUDA
tensors; the NCCL id travels through torch's store) or ``local`` (one rank). torch's
own transports (``torch``: Gloo, NCCL) are refused: use them as torch backends directly;
except in a fault-tolerant job under ``collectives-elastic``, where :func:`process_group`
gives a group over each generation's communicator (see ``collectives.elastic``).

Importing this package imports torch; ``import collectives`` does not import it.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from collectives.communicator import Communicator
from collectives.errors import BackendUnavailable

from .process_group import BACKEND_NAME, ProcessGroupCollectives
from .rendezvous import create_process_group, elastic_communicator, fill_env_rendezvous, rendezvous_kwargs
from .worker import CollectivesWork


def register() -> None:
    """Register the backend "collectives" with torch.distributed (for devices cpu and cuda).
    Importing this package does it; calling it again does nothing."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                  devices=["cpu", "cuda"])
    # From 2.15 torch attaches its flight recorder's hook to every new group that lists its
    # devices, unless the group's backend records its own calls. A Python group has no C++
    # backend for the hook (torch raises "Could not find the default backend type"), and the
    # Communicator's flight recorder records every call of the group: it is one that does.
    recording_itself = getattr(dist.distributed_c10d, "_FR_SELF_RECORDING_BACKENDS", None)
    if isinstance(recording_itself, set):
        recording_itself.add(BACKEND_NAME)


register()
# Under an MPI launcher: torch's env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
# MASTER_PORT) where the user has not set them, so that a plain dist.init_process_group() works.
fill_env_rendezvous()


def init_process_group(backend: str = BACKEND_NAME, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group(backend="collectives", **kwargs)``, with the
    rendezvous taken from whatever launched the job.

    Under mpiexec/mpirun/srun (more than one rank) rank 0 serves torch's store and its
    address reaches the other ranks over MPI: no ``MASTER_ADDR``/``MASTER_PORT`` needed.
    Under torchrun (or with ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set) torch's env://
    is used as it is (``MASTER_ADDR`` alone, under an MPI launcher: the address rank 0's store
    listens on); without
    a launcher the group has one rank. In a fault-tolerant job on the mpi backend (Open MPI's
    ULFM) it is over the current generation's communicator, on a store of this rank's own (see
    :func:`process_group`). ``init_method``/``store``, ``rank``,
    ``world_size``, ``timeout``, ``device_id`` and the rest pass through unchanged.
    """
    register()
    dist.init_process_group(backend=backend, **rendezvous_kwargs(kwargs))


_elastic_group: tuple[Communicator, Any] | None = None


def process_group() -> Any:
    """The "collectives" process group over ``collectives.init()``'s communicator, for
    ``DistributedDataParallel(model, process_group=...)`` and ``dist.*(group=...)``.

    In a fault-tolerant job (``collectives-elastic``) it is a group of the current generation
    (its ranks, its size), made again once per generation after a shrink or a join, so
    ``collectives.elastic.run``'s ``train`` calls it and wraps DDP again. On the torch backend
    torch's default group is the generation's Gloo group, and this one is made with
    ``dist.new_group(backend="collectives")``; on the mpi backend (Open MPI's ULFM) this one is
    torch's default group, made over the generation's communicator (the previous generation's
    is destroyed first; torch's store is each rank's own, since no rank may hold the job's).
    Elsewhere it is the default group, ``init_process_group()``'s (made first if need be).
    """
    global _elastic_group
    register()
    comm = elastic_communicator()
    if comm is None:
        if not dist.is_initialized():
            init_process_group()
        return dist.distributed_c10d._get_default_group()
    if _elastic_group is not None and _elastic_group[0] is comm \
            and _elastic_group[1] in dist.distributed_c10d._world.pg_map:
        return _elastic_group[1]
    if comm.backend == "torch":
        group = dist.new_group(backend=BACKEND_NAME)
    else:
        group = _default_group_over(comm)
    _elastic_group = (comm, group)
    return group


def _default_group_over(comm: Communicator) -> Any:
    """torch's default group, a "collectives" group over ``comm`` (a fault-tolerant mpi
    communicator), made after the previous generation's is destroyed."""
    if dist.is_initialized():
        old = dist.distributed_c10d._get_default_group()
        if isinstance(old, ProcessGroupCollectives) and old.comm is comm:
            return old  # made by init_process_group() in this generation
        if not isinstance(old, ProcessGroupCollectives):
            raise BackendUnavailable(
                f"in a fault-tolerant job on the mpi backend, process_group() makes torch's default "
                f"group itself (a {BACKEND_NAME!r} group over each generation's communicator); torch's "
                f"default group is already one of backend {dist.get_backend(old)!r}: do not call "
                "init_process_group() with another backend")
        old.shutdown()  # its worker's communicator belongs to a past generation
        dist.destroy_process_group()
    init_process_group()  # over comm, on a store of this rank's own (rendezvous_kwargs)
    return dist.distributed_c10d._get_default_group()


def communicator(group: Any = None) -> Communicator:
    """The Communicator behind a "collectives" process group (``None``: the default group),
    for the caller's own collectives (``syncbn.SyncBatchNorm(comm=...)``,
    ``syncbn.DataParallel(..., comm=...)``). It takes calls from the thread that created
    the group; torch's operations on the group run on a communicator of their own."""
    pg = dist.distributed_c10d._get_default_group() if group is None else group
    if pg is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"this rank ({dist.get_rank()}) is not a member of the group: new_group() "
                         "gives the ranks outside it no group, so there is no communicator here; call "
                         "communicator(group) on the group's members only")
    if not isinstance(pg, ProcessGroupCollectives):
        raise TypeError(f"group is a process group of backend {dist.get_backend(pg)!r}, not "
                        f"{BACKEND_NAME!r}; make it with init_process_group(backend={BACKEND_NAME!r}) "
                        f"or new_group(backend={BACKEND_NAME!r})")
    return pg.comm


__all__ = ["BACKEND_NAME", "CollectivesWork", "ProcessGroupCollectives", "communicator", "init_process_group",
           "process_group", "register"]
