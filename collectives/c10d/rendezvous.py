"""How a "collectives" process group finds its ranks and its communicators.

- :func:`rendezvous_kwargs`: the store torch's ``init_process_group`` needs, from the
  launcher (under an MPI launcher rank 0's store address travels over MPI).
- :func:`create_process_group`: the creator torch calls for every group it makes with
  this backend (the default group and each ``new_group``), on the group's members only.
  The default group's communicator is ``collectives.init()``'s (mpi, local) or a new NCCL
  communicator whose id travels through torch's store (cupy). A subgroup's is made by
  its members alone, since torch never calls the creator on the other ranks (so
  ``Communicator.split``, which every rank must call, cannot make it): MPI's
  ``Comm_create_group`` (mpi), an NCCL id through the group's store (cupy), or a
  communicator of one rank. Each group's worker thread gets ``split(0)`` of it.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

import collectives
from collectives import config
from collectives.communicator import Communicator
from collectives.errors import BackendUnavailable
from collectives.launcher import LaunchInfo, detect_launcher
from collectives.registry import resolve_backend
from collectives.transport import Transport

from .process_group import BACKEND_NAME, ProcessGroupCollectives

#: The transports a "collectives" group can run on.
TRANSPORTS = ("mpi", "cupy", "local")


def mpi_shared_store(launch: LaunchInfo, timeout: datetime.timedelta) -> Any:
    """torch's store for a job started by an MPI launcher: a TCPStore served by rank 0,
    its address shared over MPI (one implementation, with the torch transport's)."""
    from collectives.backends.torch_bootstrap import mpi_shared_tcp_store  # noqa: PLC0415

    return mpi_shared_tcp_store(launch, timeout)


def rendezvous_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for ``dist.init_process_group`` with a store where the launcher needs one."""
    kwargs = dict(kwargs)
    if "init_method" in kwargs or "store" in kwargs:
        return kwargs
    elastic = elastic_communicator()
    if elastic is not None and elastic.backend == "mpi":  # ULFM: no rank may hold the job's store
        kwargs.update(store=dist.HashStore(), rank=elastic.rank, world_size=elastic.size)
        return kwargs
    launch = detect_launcher()
    if launch.launcher == "torchrun" or (os.environ.get("MASTER_ADDR") and os.environ.get("RANK")
                                         and os.environ.get("WORLD_SIZE") and not _filled_here()):
        return kwargs  # env:// as torch reads it (MASTER_ADDR alone: the store's address, below)
    timeout = kwargs.get("timeout") or datetime.timedelta(minutes=30)
    if launch.size == 1:
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    elif launch.is_mpi_launcher:
        from collectives.backends.mpi import install_abort_on_uncaught_exception  # noqa: PLC0415
        from collectives.backends.mpi_channel import import_mpi  # noqa: PLC0415

        install_abort_on_uncaught_exception(import_mpi())
        kwargs.update(store=mpi_shared_store(launch, timeout), rank=launch.rank, world_size=launch.size)
    return kwargs


#: torch's env:// store of an MPI launcher's job, served by rank 0 (see :func:`fill_env_rendezvous`).
_ENV_STORES: list[Any] = []
#: The variables :func:`fill_env_rendezvous` set, and their values. Where they still hold,
#: :func:`init_process_group` makes a store of its own over MPI as without them: a group made
#: again after ``destroy_process_group`` must not meet the keys the one before it left on the
#: filled store (torch's prefixes start again; a rank could read the old ranks' addresses).
_FILLED: dict[str, str] = {}


def _filled_here() -> bool:
    return any(os.environ.get(name) == value for name, value in _FILLED.items())


def fill_env_rendezvous(env: Any = None) -> bool:
    """Under an MPI launcher (mpiexec, mpirun, srun; more than one rank): torch's env://
    variables that the user has not set, so that torch code unchanged works there:
    ``dist.init_process_group("collectives")`` (or ``"gloo"``...) after ``import collectives.c10d``.

    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and ``LOCAL_WORLD_SIZE`` where the launcher says)
    are the launcher's; ``MASTER_ADDR``/``MASTER_PORT``, unless both are set, are those of a
    store rank 0 serves now (on ``MASTER_ADDR``/``MASTER_PORT`` where one is set), its address
    sent to the other ranks over MPI (this initializes MPI: every rank imports the package).
    torch's env:// store on rank 0 then shares that server (a multi-tenant TCPStore on its
    port): no port is chosen twice. Not in a fault-tolerant job (``collectives-elastic``),
    where no rank may hold the job's store, nor once torch's default group exists. Whether it
    filled any. ``env``: the variables (default ``os.environ``)."""
    env = os.environ if env is None else env
    launch = detect_launcher(env)
    if not launch.is_mpi_launcher or launch.size == 1 or config.ELASTIC_STORE in env or dist.is_initialized():
        return False
    filled = False
    launcher_says = {"RANK": launch.rank, "WORLD_SIZE": launch.size, "LOCAL_RANK": launch.local_rank,
                     "LOCAL_WORLD_SIZE": launch.local_size}
    for name, value in launcher_says.items():
        if value is not None and name not in env:
            env[name], filled = str(value), True
            _FILLED[name] = env[name]
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return filled
    from collectives.backends.mpi import install_abort_on_uncaught_exception  # noqa: PLC0415
    from collectives.backends.mpi_channel import import_mpi  # noqa: PLC0415
    from collectives.backends.torch_bootstrap import mpi_shared_tcp_store  # noqa: PLC0415

    install_abort_on_uncaught_exception(import_mpi())
    store = mpi_shared_tcp_store(launch, port=int(env.get("MASTER_PORT") or 0), multi_tenant=True)
    _ENV_STORES.append(store)  # (torch's server lives while a store holds it)
    for name, address in (("MASTER_ADDR", str(store.host)), ("MASTER_PORT", str(store.port))):
        if not env.get(name):
            env[name] = _FILLED[name] = address
    return True


def transport(launch: LaunchInfo | None = None) -> str:
    """The transport ``collectives.init()`` would choose here, if a group can run on it."""
    launch = launch or detect_launcher()
    name = resolve_backend(None, launch)
    # Where each transport runs: mpi under an MPI launcher (CPU and CUDA tensors), cupy under
    # an MPI launcher or torchrun (CUDA tensors), local alone. Each refusal says where to go.
    where = (f"for {BACKEND_NAME!r}, launch with mpiexec/mpirun/srun (the mpi transport: CPU and CUDA "
             f"tensors), or keep torchrun with {config.BACKEND}=cupy (CUDA tensors)")
    if name == "torch":
        raise BackendUnavailable(
            f"the {BACKEND_NAME!r} torch backend runs on collectives' own transports (mpi, cupy, "
            f"local); {config.BACKEND} (or auto under torchrun) chose 'torch', which is torch's "
            f"own Gloo and NCCL: use backend='gloo' or 'nccl' for those; {where}")
    if launch.launcher == "torchrun" and (name == "mpi" or (name == "local" and launch.size > 1)):
        raise BackendUnavailable(
            f"the {BACKEND_NAME!r} torch backend on the {name} transport cannot run under torchrun "
            f"({launch.size} ranks): {where}; for CPU tensors under torchrun, use torch's own "
            "backend='gloo'")
    return name


def create_process_group(options: Any, backend_options: Any = None) -> ProcessGroupCollectives:
    """torch's creator for this backend (``register_backend(..., extended_api=True)``)."""
    rank, size = int(options.group_rank), int(options.group_size)
    ranks = list(options.global_ranks_in_group)
    elastic = elastic_communicator()
    if elastic is not None:  # process_group() in a fault-tolerant job (collectives-elastic)
        name = elastic.backend
        if ranks not in ([], list(range(elastic.size))) or (rank, size) != (elastic.rank, elastic.size):
            raise BackendUnavailable(
                f"in a fault-tolerant job a {BACKEND_NAME!r} group spans the whole generation "
                f"({elastic.size} ranks; this rank is its rank {elastic.rank}); got rank {rank} of "
                f"{size}, ranks {ranks or 'all'}: make it with collectives.c10d.process_group()")
        comm = elastic
    elif not ranks:  # the default group
        name = transport()
        comm = _world_communicator(name, options.store, rank, size)
    else:
        name = transport()
        comm = _subgroup_communicator(name, options.store, rank, ranks)
    pg = group_over(name, comm, options.store, rank, size, options.timeout)
    if name == "mpi" and size > 1 and elastic is None:
        # init_process_group wraps sys.excepthook (to prefix tracebacks with the rank): ours goes
        # around it again, so that an uncaught exception on one rank ends the job (MPI_Abort).
        from collectives.backends.mpi import install_abort_on_uncaught_exception  # noqa: PLC0415
        from collectives.backends.mpi_channel import import_mpi  # noqa: PLC0415

        install_abort_on_uncaught_exception(import_mpi())
    return pg


def group_over(name: str, comm: Communicator, store: Any, rank: int, size: int, timeout: datetime.timedelta,
               group_class: type[ProcessGroupCollectives] = ProcessGroupCollectives) -> ProcessGroupCollectives:
    """The group (of ``group_class``) over ``comm``, a communicator of the ``name`` transport, with
    its worker's communicator and, over cupy, its host backend (Gloo, on ``store``); ``timeout``:
    torch's for the group's operations, unless ``COLLECTIVES_TIMEOUT`` says."""
    worker_comm = comm.split(0)
    assert worker_comm is not None
    if os.environ.get(config.TIMEOUT, "").strip() == "":
        # (over cupy, the group's own communicator runs the operations on CUDA tensors too)
        for runs in (worker_comm, comm) if name == "cupy" else (worker_comm,):
            runs.timeout = timeout.total_seconds()
    host = None
    if name == "cupy":  # NCCL takes CUDA tensors only: CPU tensors go to Gloo (see ProcessGroupCollectives)
        host = dist.ProcessGroupGloo(dist.PrefixStore("host/", store), rank, size, timeout)
    return group_class(comm, worker_comm, rank, size, host)


def elastic_communicator() -> Communicator | None:
    """``collectives.init()``'s communicator (its current generation) when it is a
    fault-tolerant one (``collectives-elastic``): a "collectives" group then runs over it. On
    torch's Gloo, torch's default group is that generation's Gloo group; on Open MPI's ULFM
    (mpi) the generation's "collectives" group is torch's default group."""
    from collectives import registry  # noqa: PLC0415

    comm = registry._default
    while comm is not None and comm._fault.successor is not None:
        comm = comm._fault.successor
    if comm is None or comm._closed or comm.backend not in ("torch", "mpi") or not registry._fault_tolerant(comm):
        return None
    if comm.backend == "mpi" and type(comm._transport)._shrink is Transport._shrink:
        return None  # a plain mpi communicator of one rank
    return comm


def _world_communicator(name: str, store: Any, rank: int, size: int) -> Communicator:
    if name == "cupy":
        return _cupy_communicator(store, rank, size)
    comm = collectives.init(name)
    if (comm.rank, comm.size) != (rank, size):
        raise BackendUnavailable(
            f"torch's rank {rank} of {size} is not the {name} transport's rank {comm.rank} of "
            f"{comm.size}: RANK/WORLD_SIZE (or init_process_group's rank=, world_size=) must be "
            "the launcher's (or use collectives.c10d.init_process_group())")
    return comm


def _subgroup_communicator(name: str, store: Any, rank: int, ranks: list[int]) -> Communicator:
    if name == "cupy":
        return _cupy_communicator(store, rank, len(ranks))
    world = _default_communicator(name)
    if len(ranks) == 1 or world.backend == "local":
        from collectives.backends.local import LocalCommunicator  # noqa: PLC0415

        return LocalCommunicator(world.local_rank, timeout=world._timeout_arg)
    # MPI: made by the members only (MPI_Comm_create_group), ranks as torch numbers them.
    from collectives.backends.mpi import MPICommunicator  # noqa: PLC0415

    parent = world.mpi_comm  # type: ignore[attr-defined]
    group = parent.Get_group().Incl(ranks)
    try:
        sub = parent.Create_group(group)
    finally:
        group.Free()
    try:
        return MPICommunicator(sub, local_rank=world.local_rank, timeout=world._timeout_arg)
    finally:
        sub.Free()


def _default_communicator(name: str) -> Communicator:
    default = dist.distributed_c10d._get_default_group()
    if isinstance(default, ProcessGroupCollectives):
        return default.comm
    return _world_communicator(name, None, dist.get_rank(), dist.get_world_size())


# Bytes of an NCCL unique id (ncclUniqueId).
_NCCL_ID_KEY = "collectives/nccl-unique-id"


def _cupy_communicator(store: Any, rank: int, size: int, transport_class: Any = None) -> Communicator:
    """An NCCL communicator over the group's ranks, its id made by the group's rank 0 and
    handed to the others through torch's store (CUDA device: ``LOCAL_RANK`` % devices, or
    the one ``torch.cuda.set_device`` chose), with its CPU channel (a Gloo group on the store,
    as under torchrun: backends/cupy_host.py), so its default check goes beside its calls (its
    Gloo calls under ``COLLECTIVES_TIMEOUT``). ``transport_class``: the transport's class
    (:class:`~collectives.backends.cupy_nccl.CupyNcclTransport`, or a twin of it)."""
    from collectives.backends.cupy_channel import import_cupy_nccl  # noqa: PLC0415
    from collectives.backends.cupy_id import comm_id_argument, gloo_host, id_to_bytes  # noqa: PLC0415
    from collectives.backends.cupy_nccl import CupyNcclCommunicator  # noqa: PLC0415

    cupy, nccl = import_cupy_nccl()
    launch = detect_launcher()
    device = torch.cuda.current_device() if torch.cuda.is_available() else int(cupy.cuda.Device().id)
    if rank == 0:
        store.set(_NCCL_ID_KEY, id_to_bytes(nccl.get_unique_id()))
    raw = bytes(store.get(_NCCL_ID_KEY))
    with cupy.cuda.Device(device):
        comm = nccl.NcclCommunicator(size, comm_id_argument(raw, cupy.__version__), rank)
    host = gloo_host(dist.PrefixStore("checks/", store), rank, size, config.timeout_seconds()) if size > 1 else None
    made = (transport_class or CupyNcclCommunicator.transport_class)(comm, rank, size, launch.local_rank, device, host)
    return CupyNcclCommunicator._adopt(made)
