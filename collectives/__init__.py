"""collectives: one collectives interface over torch.distributed, MPI and CuPy NCCL.

    import collectives
    comm = collectives.init()          # backend from COLLECTIVES_BACKEND, else auto
    comm.all_reduce(x, "sum")          # in place, returns x

Importing this package imports no transport (no torch, mpi4py or cupy).
"""

from .communicator import Communicator, Work
from .errors import (
    BackendUnavailable,
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    PeerLeft,
    RankFailure,
)
from .launcher import LaunchInfo, detect_launcher
from .ops import ALLOWED_OPS, DTYPES, ReduceOp
from .registry import BACKENDS, init

__version__ = "0.1.0"

# The one process-wide hook that cannot wait for init() (collectives/diagnostics/process_hooks.py): under
# an MPI launcher sys.exit records its status, since `sys.exit(main())` looks it up first.
from .diagnostics import process_hooks as _process_hooks  # noqa: E402

_process_hooks.at_import()

__all__ = [
    "ALLOWED_OPS",
    "BACKENDS",
    "DTYPES",
    "BackendUnavailable",
    "CollectiveError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Communicator",
    "LaunchInfo",
    "PeerLeft",
    "RankFailure",
    "ReduceOp",
    "Work",
    "detect_launcher",
    "init",
]
