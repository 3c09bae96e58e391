"""collectives/_front.c: Communicator._run, compiled (optional; collectives/front.py)."""

from typing import Any

VERSION: int

class Front:
    taken: int
    viewed: int
    def __init__(self, comm: Any, python_run: Any, not_taken: Any, started: Any, posted: Any, end: int, state: int,
                 work_type: type, clock: Any, counted: Any, host_view: Any, numpy: Any) -> None: ...
    def __call__(self, call: Any, x: Any, op: Any, root: Any, out: Any, async_op: Any, extra: Any = None,
                 timeout: Any = None) -> Any: ...

class Method:
    def __init__(self, front: Front, dict: dict[str, Any], python: Any, base: tuple[Any, ...],
                 positional: tuple[int, ...], required: int, keywords: tuple[tuple[str, int], ...]) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
