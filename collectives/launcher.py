"""Launcher discovery: which launcher started this process, and this rank's place in the job.

Nothing is imported and nothing is contacted: only the launchers' environment
variables are read, so this is safe to call before any transport exists.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import BackendUnavailable


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
    #: The variable that gave ``size`` (``"PMI_SIZE"``, ``"SLURM_NTASKS"``, ...): the launcher's
    #: own count of ranks, which the transport's world size must equal; None without a launcher.
    size_variable: str | None = None
    #: Whether a launcher variable gave ``local_rank`` (else it is ``rank``, a guess that
    #: holds on one node only; the MPI backend asks MPI instead).
    local_rank_known: bool = True

    @property
    def is_mpi_launcher(self) -> bool:
        """Started by a launcher that MPI can initialize under (mpiexec, mpirun, srun)."""
        return self.launcher in ("mpi", "slurm")


# launcher name -> (rank, size, local rank, local size) variables, in the order they are tried.
# Slurm's local size is SLURM_STEP_TASKS_PER_NODE, read by _slurm_local_size.
LAUNCHER_VARIABLES: tuple[tuple[str, tuple[str, str, str, str | None]], ...] = (
    ("torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")),
    ("mpi", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),  # MPICH / Hydra, srun --mpi=pmi2
    ("mpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE")),  # Open MPI
    ("mpi", ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE")),  # PMIx launchers
    ("slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None)),
)
_SLURM = LAUNCHER_VARIABLES[-1][1]
#: The launcher a job must be started with when MPI's world does not match the launcher's count.
_HOW_TO_LAUNCH = {
    "slurm": "srun --mpi=pmi2 (MPICH, Intel MPI), or srun --mpi=pmix (Open MPI), so that MPI joins "
             "Slurm's job step; `srun --mpi=list` shows what this Slurm offers",
    "mpi": "the mpiexec/mpirun of the MPI library mpi4py loaded (see `collectives-info`), not another "
           "MPI's launcher",
    "torchrun": "mpiexec/mpirun/srun when the job uses MPI, and RANK/WORLD_SIZE unset or equal to "
                "the MPI launcher's",
}

# -- the variables a launcher sets for one job (and none of the user's settings) ----------------
# torchrun's, which carry no common prefix.
_TORCHRUN_NAMES = frozenset({*LAUNCHER_VARIABLES[0][1], "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
                             "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                             "LOCAL_RANK", "TORCHELASTIC_RUN_ID"})
_OTHER_NAMES = frozenset(name for _, names in LAUNCHER_VARIABLES for name in names if name)
# Whole families: MPICH/Hydra's and Slurm's PMI, PMIx's, Open MPI's own (not the user's
# OMPI_MCA_*/PMIX_MCA_* settings nor OMPI_ALLOW_RUN_AS_ROOT*), PRRTE's, torchelastic's.
_JOB_PREFIXES = ("PMI_", "PMIX_", "OMPI_COMM_WORLD_", "OMPI_WORLD_", "OMPI_MCA_ess_", "OMPI_MCA_orte_",
                 "OMPI_MCA_pmix_", "PRTE_", "TORCHELASTIC_", "MPI_LOCAL")
_JOB_NAMES = frozenset({"OMPI_UNIVERSE_SIZE", "OMPI_FILE_LOCATION", "OMPI_ARGV", "OMPI_COMMAND",
                        "OMPI_NUM_APP_CTX", "OMPI_FIRST_RANKS", "OMPI_APP_CTX_NUM_PROCS", "OMPI_TOOL_NAME",
                        "OMPI_LIBDIR_LOC", "OMPI_MCA_PREFIXES", "OMPI_MCA_num_procs", "OMPI_MCA_initial_wdir",
                        "OMPI_MCA_cpu_type", "OPAL_USER_PARAMS_GIVEN"})
_KEPT = ("PMIX_MCA_",)  # the user's PMIx settings
# Slurm's per-step variables (a job's allocation, SLURM_JOB_*, stays: srun runs new steps in it).
_SLURM_STEP_PREFIXES = ("SLURM_STEP_", "SLURM_SRUN_COMM_", "SLURM_PMIX", "SLURM_CPU_BIND", "SLURM_TOPOLOGY_")
_SLURM_STEP_NAMES = frozenset({"SLURM_STEPID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASK_PID",
                               "SLURM_GTIDS", "SLURM_LAUNCH_NODE_IPADDR", "SLURM_PRIO_PROCESS", "SLURM_UMASK",
                               "SLURM_DISTRIBUTION", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_MPI_TYPE"})


def is_job_variable(name: str) -> bool:
    """Whether ``name`` is a variable a launcher sets for the ranks of one job (their rank,
    size, PMI server, step): what a new job started from inside a rank must not inherit.
    Settings users give launchers and MPI libraries (``OMPI_MCA_*`` but the launcher's own,
    ``PMIX_MCA_*``, ``OMPI_ALLOW_RUN_AS_ROOT*``, ``I_MPI_*``, ``SLURM_CONF``, a job's
    allocation ``SLURM_JOB_*``) are not."""
    if name.startswith(_KEPT):
        return False
    return (name in _TORCHRUN_NAMES or name in _OTHER_NAMES or name in _JOB_NAMES
            or name.startswith(_JOB_PREFIXES) or name in _SLURM_STEP_NAMES
            or name.startswith(_SLURM_STEP_PREFIXES))


def without_launcher_variables(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less the variables a launcher set for this job (:func:`is_job_variable`), for
    starting a new job from inside a process that may be a rank itself."""
    return {name: value for name, value in env.items() if not is_job_variable(name)}


def _int(env: Mapping[str, str], name: str | None) -> int | None:
    if name is None or name not in env:
        return None
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"launcher variable {name}={env[name]!r} is not an integer") from None


_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def slurm_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed tasks-per-node list, expanded: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"SLURM_STEP_TASKS_PER_NODE={text!r}: {part!r} is not N or N(xK)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def _slurm_local_size(env: Mapping[str, str]) -> int | None:
    """Tasks of this job step on this node: this node's entry of SLURM_STEP_TASKS_PER_NODE."""
    text, node = env.get("SLURM_STEP_TASKS_PER_NODE"), _int(env, "SLURM_NODEID")
    if not text or node is None:
        return None
    counts = slurm_tasks_per_node(text)
    return counts[node] if node < len(counts) else None


def _in_slurm_step(env: Mapping[str, str]) -> bool:
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and "SLURM_NTASKS" in env


def detect_launcher(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's variables from ``env`` (default ``os.environ``).

    torchrun is recognized by its ``TORCHELASTIC_RUN_ID``; an MPI launcher (or srun) by its
    variables, even where the user set ``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` by hand for
    torch's env://; those alone (no launcher) count as torchrun's. Where an MPI launcher
    gives no local rank (srun --mpi=pmi2/pmix), Slurm's step variables give it."""
    env = os.environ if env is None else env
    families = LAUNCHER_VARIABLES
    if "TORCHELASTIC_RUN_ID" not in env:  # MPI launchers first: RANK may be the user's own
        families = (*LAUNCHER_VARIABLES[1:], LAUNCHER_VARIABLES[0])
    for launcher, (rank_var, size_var, local_var, local_size_var) in families:
        rank, size = _int(env, rank_var), _int(env, size_var)
        if rank is None or size is None:
            continue
        if launcher == "torchrun" and "MASTER_ADDR" not in env and "TORCHELASTIC_RUN_ID" not in env:
            continue  # RANK alone is too common a name to trust
        if launcher == "slurm" and "SLURM_STEP_ID" not in env:
            continue  # inside an sbatch script but not under srun
        local_rank = _int(env, local_var)
        local_size = _int(env, local_size_var) if local_size_var else _slurm_local_size(env)
        if launcher == "mpi" and local_rank is None and _in_slurm_step(env) \
                and (_int(env, _SLURM[0]), _int(env, _SLURM[1])) == (rank, size):
            # srun --mpi=pmi2 / pmix: the PMI gives ranks, Slurm the place on the node.
            local_rank, local_size = _int(env, _SLURM[2]), _slurm_local_size(env)
        return LaunchInfo(launcher, rank, size, rank if local_rank is None else local_rank,
                          local_size, size_var, local_rank is not None)
    return LaunchInfo(None, 0, 1, 0, 1)


def check_world_size(launch: LaunchInfo, transport_size: int, transport: str = "MPI") -> None:
    """Refuse a job whose transport sees another number of ranks than its launcher started:
    ``srun -n 3`` without ``--mpi`` starts three MPI jobs of one rank each, which would
    otherwise run as three silent rank-0-of-1 jobs. Raises
    :class:`~collectives.errors.BackendUnavailable` naming the launcher's variable and the fix."""
    if launch.launcher is None or launch.size == transport_size:
        return
    raise BackendUnavailable(
        f"{transport} sees {transport_size} rank(s), but the launcher started {launch.size} "
        f"({launch.size_variable}={launch.size}): each process would run as a job of its own. Launch with "
        f"{_HOW_TO_LAUNCH[launch.launcher or 'mpi']}")
