"""Launcher discovery: which launcher started this process, and this rank's place in the job.

Nothing is imported and nothing is contacted: only the launchers' environment
variables are read, so this is safe to call before any transport exists.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process stands in the job, as its launcher told it."""

    #: "torchrun", "mpi" (mpiexec/mpirun of MPICH/Hydra or Open MPI), "slurm" (srun), or None.
    launcher: str | None
    rank: int
    size: int
    local_rank: int
    #: Ranks on this node, when the launcher says; None when it does not.
    local_size: int | None = None

    @property
    def is_mpi_launcher(self) -> bool:
        """Started by a launcher that MPI can initialize under (mpiexec, mpirun, srun)."""
        return self.launcher in ("mpi", "slurm")


# launcher name -> (rank, size, local rank, local size) variables, in the order they are tried.
LAUNCHER_VARIABLES: tuple[tuple[str, tuple[str, str, str, str | None]], ...] = (
    ("torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")),
    ("mpi", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),  # MPICH / Hydra
    ("mpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE")),  # Open MPI
    ("mpi", ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE")),  # PMIx launchers
    ("slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None)),
)


# Whole families of variables a launcher sets for its ranks (MPI process managers, Slurm).
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "SLURM_")
# torchrun's, which carry no common prefix.
_TORCHRUN_NAMES = frozenset({*LAUNCHER_VARIABLES[0][1], "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                             "ROLE_RANK", "TORCHELASTIC_RUN_ID"})
_OTHER_NAMES = frozenset(name for _, names in LAUNCHER_VARIABLES for name in names if name)


def without_launcher_variables(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less every launcher variable :func:`detect_launcher` reads (and their
    families), for starting a new job from inside a process that may be a rank itself."""
    return {name: value for name, value in env.items()
            if not name.startswith(_LAUNCHER_PREFIXES) and name not in _TORCHRUN_NAMES
            and name not in _OTHER_NAMES}


def _int(env: Mapping[str, str], name: str | None) -> int | None:
    if name is None or name not in env:
        return None
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"launcher variable {name}={env[name]!r} is not an integer") from None


def detect_launcher(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's variables from ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    for launcher, (rank_var, size_var, local_var, local_size_var) in LAUNCHER_VARIABLES:
        rank, size = _int(env, rank_var), _int(env, size_var)
        if rank is None or size is None:
            continue
        if launcher == "torchrun" and "MASTER_ADDR" not in env and "TORCHELASTIC_RUN_ID" not in env:
            continue  # RANK alone is too common a name to trust
        if launcher == "slurm" and "SLURM_STEP_ID" not in env:
            continue  # inside an sbatch script but not under srun
        local_rank = _int(env, local_var)
        return LaunchInfo(launcher, rank, size, rank if local_rank is None else local_rank,
                          _int(env, local_size_var))
    return LaunchInfo(None, 0, 1, 0, 1)
