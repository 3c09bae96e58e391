"""backends/_carried.c: backends/mpi_carried.py's carry, compiled (optional)."""

from typing import Any

class Carrier:
    def __init__(self, kind: str, channel: Any, block: Any, blocks: Any, offset: int, polls: int,
                 fallback: Any, not_taken: Any, new_result: Any, local: Any, mpi_type: Any, avg: bool,
                 dtype: str = ..., op: str = ...) -> None: ...
    def __call__(self, view: Any, root: Any, out: Any, extra: Any, word: int) -> tuple[int, Any]: ...
