"""SyncBatchNorm written once against the collectives interface.

    import collectives, syncbn
    model = syncbn.convert_sync_batchnorm(model)        # before or after collectives.init()
    y = syncbn.SyncBatchNorm(64, comm=comm)(x)          # x: (N, 64, H, W), N may differ per rank

Imports torch (the array library) and collectives only: no torch.distributed,
mpi4py or cupy, so the same module runs over every backend, on CPU and GPU.
"""

from .batchnorm import BatchNormXd, SyncBatchNorm, convert_sync_batchnorm, revert_sync_batchnorm
from .data_parallel import DataParallel
from .function import SyncBatchNormFunction

__all__ = [
    "BatchNormXd",
    "DataParallel",
    "SyncBatchNorm",
    "SyncBatchNormFunction",
    "convert_sync_batchnorm",
    "revert_sync_batchnorm",
]
