"""SyncBatchNorm written once against the collectives interface::

    import collectives
    from collectives import syncbn
    model = syncbn.convert_sync_batchnorm(model)        # before or after collectives.init()
    y = syncbn.SyncBatchNorm(64, comm=comm)(x)          # x: (N, 64, H, W), N may differ per rank

Imports torch (the array library, on first use of a name) and collectives only: no torch.distributed,
mpi4py or cupy, so the same module runs over every backend, on CPU and GPU.
"""

from __future__ import annotations

from typing import Any

# Installed as collectives.syncbn (pyproject.toml's package-dir): imported under this folder's own
# name (a checkout on sys.path) it would be a second copy of every module, so refuse that.
if __name__ != "collectives.syncbn":
    raise ImportError(f"{__name__!r} is installed as 'collectives.syncbn': import collectives.syncbn instead")

# The names load on first use, so that `import collectives.syncbn` alone imports no torch (the
# interface's import-hygiene rule); `from collectives.syncbn import SyncBatchNorm` works as usual.
_EXPORTS = {
    "BatchNormXd": "batchnorm",
    "DataParallel": "data_parallel",
    "SyncBatchNorm": "batchnorm",
    "convert_sync_batchnorm": "batchnorm",
    "revert_sync_batchnorm": "batchnorm",
    "SyncBatchNormFunction": "function",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib  # noqa: PLC0415

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
