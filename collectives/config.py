"""Every environment variable collectives reads, in one place (the README's table mirrors it)."""

from __future__ import annotations

import os

#: Which backend ``init()`` starts: auto (default), local, torch, mpi, cupy.
BACKEND = "COLLECTIVES_BACKEND"
#: MPI backend: 1 hands CUDA memory to MPI directly, 0 stages it through pinned host
#: memory; unset detects whether the MPI library is CUDA-aware.
MPI_CUDA_AWARE = "COLLECTIVES_MPI_CUDA_AWARE"


def env_flag(name: str) -> bool | None:
    """``True``/``False`` for 1/0 (also true/false, yes/no, on/off); ``None`` when unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r} is not a flag; use 1 or 0")
