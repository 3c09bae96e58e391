"""Object collectives: any picklable Python object, on every backend.

Each is built from the collective set (sizes first, then the pickled bytes as uint8
arrays), so it goes through the one call path: the same checks, sequence numbers,
fingerprints and timeouts as every other call. On the cupy backend, which takes CUDA
arrays only, the bytes travel in CuPy arrays on the communicator's device.

Unpickling what another rank sent runs whatever that rank pickled: these calls trust
every rank of the communicator, as torch's and mpi4py's object collectives do.

A rank whose own argument is bad (an object that does not pickle, ``objs`` of the wrong
length) sends a size of -1 in the first exchange, so that every rank raises, not only
that one, and none waits for bytes that never come. A root out of range is refused by the
first call that takes it (a refused call: the peers are told which rank refused it and why).

Imports: errors and numpy (CuPy when used); the communicator is passed in.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import CollectiveError

#: The size a rank sends when its own argument failed (see the module docstring).
_FAILED = -1


def broadcast_object(comm: Any, obj: Any, src: int = 0) -> Any:
    payload, problem = _pickled(obj) if comm.rank == src else (b"", None)
    size = np.array([_FAILED if problem else len(payload)], dtype=np.int64)
    size = _host(comm, comm.broadcast(_wire(comm, size), src))
    if int(size[0]) == _FAILED:
        raise _failed(comm, "broadcast_object", [src], problem)
    if comm.rank == src:
        comm.broadcast(_wire(comm, _bytes_array(payload)), src)
        return obj
    received = comm.broadcast(_wire(comm, np.empty(int(size[0]), dtype=np.uint8)), src)
    return pickle.loads(_host(comm, received).tobytes())


def all_gather_object(comm: Any, obj: Any) -> list[Any]:
    payload, problem = _pickled(obj)
    sizes = _everyones_size(comm, payload, problem, "all_gather_object")
    gathered, counts = comm.all_gather_v(_wire(comm, _bytes_array(payload)))
    return _unpickled(_host(comm, gathered), [int(c) for c in counts], sizes)


def gather_object(comm: Any, obj: Any, dst: int = 0) -> list[Any] | None:
    payload, problem = _pickled(obj)
    sizes = _everyones_size(comm, payload, problem, "gather_object")
    padded = np.zeros(max(sizes), dtype=np.uint8)
    padded[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    rows = comm.gather(_wire(comm, padded), dst)
    if rows is None:
        return None
    host = _host(comm, rows)
    return [pickle.loads(host[r, :n].tobytes()) for r, n in enumerate(sizes)]


def scatter_object(comm: Any, objs: Sequence[Any] | None, src: int = 0) -> Any:
    payloads: list[bytes] = []
    problem: str | None = None
    if comm.rank == src:
        if isinstance(objs, (str, bytes)) or not hasattr(objs, "__len__") or objs is None:
            problem = f"objs must be a list of {comm.size} objects (one per rank) on src; got {type(objs).__name__}"
        elif len(objs) != comm.size:
            problem = f"objs must hold one object per rank (size={comm.size}) on src; got {len(objs)}"
        else:
            for item in objs:
                data, problem = _pickled(item)
                if problem:
                    break
                payloads.append(data)
    sizes = np.array([len(p) for p in payloads] if payloads and not problem else [_FAILED] * comm.size,
                     dtype=np.int64)
    sizes = _host(comm, comm.broadcast(_wire(comm, sizes), src))
    if int(sizes[0]) == _FAILED:
        raise _failed(comm, "scatter_object", [src], problem)
    rows = np.zeros((comm.size, int(sizes.max())), dtype=np.uint8)
    for r, data in enumerate(payloads):
        rows[r, :len(data)] = np.frombuffer(data, dtype=np.uint8)
    mine = _host(comm, comm.scatter(_wire(comm, rows), src))
    return pickle.loads(mine[:int(sizes[comm.rank])].tobytes())


# -- helpers ---------------------------------------------------------------------------------

def _pickled(obj: Any) -> tuple[bytes, str | None]:
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), None
    except Exception as error:  # noqa: BLE001 - every rank raises it, below
        return b"", f"the object does not pickle: {type(error).__name__}: {error}"


def _everyones_size(comm: Any, payload: bytes, problem: str | None, name: str) -> list[int]:
    mine = np.array([_FAILED if problem else len(payload)], dtype=np.int64)
    sizes = [int(s) for s in _host(comm, comm.all_gather(_wire(comm, mine))).reshape(-1)]
    failed = [r for r, s in enumerate(sizes) if s == _FAILED]
    if failed:
        raise _failed(comm, name, failed, problem)
    return sizes


def _failed(comm: Any, name: str, ranks: list[int], problem: str | None) -> Exception:
    if problem is not None:  # this rank's own argument: the same error as a bad argument
        return ValueError(f"{name}: {problem}")
    return CollectiveError(f"{name} on {comm!r}: rank(s) {ranks} could not send their object "
                           "(it did not pickle, or objs was not one object per rank); see that "
                           "rank's error")


def _unpickled(gathered: np.ndarray, counts: list[int], sizes: list[int]) -> list[Any]:
    if counts != sizes:
        raise CollectiveError(f"all_gather_object: the ranks sent {counts} bytes after announcing {sizes}")
    out, start = [], 0
    for count in counts:
        out.append(pickle.loads(gathered[start:start + count].tobytes()))
        start += count
    return out


def _bytes_array(data: bytes) -> np.ndarray:
    return np.frombuffer(bytearray(data), dtype=np.uint8)  # writable: in-place calls take it


def _wire(comm: Any, array: np.ndarray) -> Any:
    """``array`` as the communicator's transport takes it (CuPy on the cupy backend)."""
    if comm.backend != "cupy":
        return array
    import cupy  # noqa: PLC0415

    with cupy.cuda.Device(comm.device):
        return cupy.asarray(array)


def _host(comm: Any, array: Any) -> np.ndarray:
    if isinstance(array, np.ndarray):
        return array
    return np.asarray(array.get())
