"""collectives: one collectives interface over torch.distributed, MPI and CuPy NCCL.

    import collectives
    comm = collectives.init()          # backend from COLLECTIVES_BACKEND, else auto
    comm.all_reduce(x, "sum")          # in place, returns x

Importing this package imports no transport (no torch, mpi4py or cupy).
"""

from .communicator import Communicator, Work
from .errors import BackendUnavailable, CollectiveError, CollectiveMismatch, CollectiveTimeout
from .launcher import LaunchInfo, detect_launcher
from .ops import ALLOWED_OPS, DTYPES, ReduceOp
from .registry import BACKENDS, init

__version__ = "0.1.0"

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
    "ReduceOp",
    "Work",
    "detect_launcher",
    "init",
]
