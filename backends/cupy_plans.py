"""The NCCL side of the cupy backend that needs no GPU: nccl.h's enum values, how each
dtype x op reduction runs on NCCL (:func:`reduce_plan`; float MIN/MAX through order keys,
:func:`order_keys`, which work on any array library), what the first call of a kind binds for
the later ones (:class:`KindPlan`, and the planned calls: :func:`array_check`,
:func:`planned_call`, made of backends/cupy_fast.py's classes, compiled where built), and which
bytes go to which peer in the collectives NCCL builds from send/recv (:class:`P2PPlan`). Checked on
CPU by tests/gpu/test_cupy_backend.py and (with CuPy stood in for) tests/gpu/test_stream_watch.py.

The planned calls: all_reduce of a kind NCCL reduces as it is (no staging, order keys, fold or
division) and broadcast, of CuPy arrays and CUDA tensors. The first call of the kind binds the
NCCL communicator's call and its constants (ncclDataType_t, ncclRedOp_t) and the library's
current-stream getter; each later call then makes one check of x (:func:`array_check`), reads the
current stream, launches this thread's open group of sends and recvs if there is one, makes the
NCCL call and ends as every call of the backend does: a blocking one with a timeout puts a pooled
event recorded after it on the watchdog's watch (``CupyNcclChannel._watch_blocking``'s line), an
asynchronous one returns ``CupyNcclChannel._done``'s handle.

Imports: the interface (arrays, calls, config, ops), cupy_fast (the planned calls' classes) and
cupy_handles (this thread's open group).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from collectives import arrays, calls, config
from collectives.arrays import ArrayAdapter
from collectives.calls import Request
from collectives.ops import ReduceOp

from . import _float_order, cupy_fast
from ._buffers import BITWISE, INT_OF_WIDTH, NARROW_WIRE, bitwise_as_min_max, offsets
from .cupy_handles import OPEN_GROUPS

#: ncclDataType_t values of nccl.h (a stable ABI); bfloat16 needs NCCL >= 2.10.
NCCL_DTYPES: dict[str, int] = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4,
                               "uint64": 5, "float16": 6, "float32": 7, "float64": 8,
                               "bfloat16": 9}
#: ncclRedOp_t values of nccl.h for the ops we hand to NCCL (ncclAvg=4 is not used: see above).
NCCL_OPS: dict[str, int] = {"sum": 0, "prod": 1, "max": 2, "min": 3}
#: Bytes of an element of each dtype.
ITEMSIZE: dict[str, int] = {"bool": 1, "int8": 1, "uint8": 1, "int16": 2, "float16": 2, "bfloat16": 2,
                            "int32": 4, "float32": 4, "int64": 8, "float64": 8}
#: First NCCL with ncclBfloat16.
BFLOAT16_SINCE = (2, 10, 0)


@dataclass(frozen=True)
class ReducePlan:
    """How one (dtype, op) reduction runs on NCCL.

    ``wire``: the dtype NCCL (or the gather) sees; ``nccl_op``: a key of
    :data:`NCCL_OPS`, or ``None`` to all_gather and fold locally with ``fold``
    (``"band"``, ``"bor"``, ``"bxor"``) in ``wire``; ``divide``: divide by size after (AVG);
    ``keys``: float MIN/MAX, reduced as integer order keys (backends/_float_order.py) in
    ``wire`` (:func:`order_keys`, then :func:`from_order_keys`).
    """

    wire: str
    nccl_op: str | None
    fold: str | None = None
    divide: bool = False
    keys: bool = False


def reduce_plan(dtype: str, op: ReduceOp, bfloat16_native: bool = True) -> ReducePlan:
    """The :class:`ReducePlan` for a pair that :func:`collectives.ops.check_reduction` allowed."""
    if op in BITWISE:
        native = bitwise_as_min_max(dtype, op)
        if native is not None:
            return ReducePlan(NARROW_WIRE[dtype], native.value)
        return ReducePlan(dtype, None, fold=op.value)
    if op in _float_order.NAN_ORDERED_OPS and dtype in _float_order.FLOAT_BITS:
        # NCCL's float MIN/MAX (fminf/fmaxf, __hmin/__hmax) drop NaNs; the order keys' integer
        # MIN/MAX keep them. NCCL has no int16: 16-bit floats' keys go in int32.
        return ReducePlan(_key_wire(dtype), op.value, keys=True)
    wire = NARROW_WIRE.get(dtype, dtype)
    if dtype == "bfloat16" and not bfloat16_native:
        wire = "float32"
    if op is ReduceOp.AVG:
        return ReducePlan(wire, "sum", divide=True)
    return ReducePlan(wire, op.value)


class KindPlan:
    """What every call of one kind (array library, dtype, reduce op) on the cupy backend reuses,
    built at the kind's first call: ``library``, the stream API of the array kind; ``reduce``, the
    :class:`ReducePlan` (``None`` for a call that reduces nothing); ``direct``, whether NCCL runs
    on a contiguous x itself (no staging, no order keys, no fold, no division), and then
    ``nccl_dtype`` and ``nccl_op``, its ncclDataType_t and ncclRedOp_t values."""

    __slots__ = ("library", "reduce", "direct", "nccl_dtype", "nccl_op")

    def __init__(self, library: Any, dtype: str, op: ReduceOp | None, bfloat16_native: bool) -> None:
        self.library = library
        self.reduce = plan = None if op is None else reduce_plan(dtype, op, bfloat16_native)
        self.direct = plan is not None and plan.nccl_op is not None and plan.wire == dtype and \
            not plan.keys and not plan.divide
        self.nccl_dtype = NCCL_DTYPES.get(dtype, -1)
        self.nccl_op = NCCL_OPS[plan.nccl_op] if plan is not None and plan.nccl_op is not None else -1


def compiled_fast_module() -> Any:
    """The compiled form of backends/cupy_fast.py (``collectives.backends._cupy_fast_c``), or None
    where it was not built (or from another version of that file) or the compiled forms are off."""
    return config.compiled_extension(f"{__package__}._cupy_fast_c", cupy_fast)


def fast_module() -> Any:
    """The module of the planned calls' classes: :func:`compiled_fast_module`, else
    backends/cupy_fast.py itself (its Python twin)."""
    return compiled_fast_module() or cupy_fast


def array_check(adapter: ArrayAdapter, device: int, check_device: Callable[[Any, ArrayAdapter], None]
                ) -> Callable[[Any, bool], Any]:
    """The per-array check of the planned kinds of ``adapter``'s arrays (see
    ``Transport._array_check``; cupy_fast's ``ArrayCheck.check``): ``x`` itself where NCCL takes
    its memory as it is, else ``adapter.check_array``'s and ``check_device``'s verdict."""
    module = fast_module()
    if adapter is arrays.CUPY:
        return module.ArrayCheck(adapter, True, device, check_device).check  # type: ignore[no-any-return]
    torch = sys.modules["torch"]
    return module.ArrayCheck(adapter, False, device, check_device,  # type: ignore[no-any-return]
                             torch.Tensor, torch.strided).check


def planned_call(transport: Any, call: calls.Call, kind: KindPlan, fallback: Callable[[Request], Any]
                 ) -> tuple[Callable[[Any, Any, Any, Any], Any], Callable[[Request], Any]] | None:
    """The blocking fast path ``(x, root, out, extra)`` and the method (``Request``) of a planned
    kind (row ``call``, ``kind``) on ``transport`` (a ``CupyNcclChannel``), or ``None`` where the
    kind is not planned: cupy_fast's ``PlannedCall.fast`` and ``PlannedCall.method``. The method
    takes the asynchronous calls of an ``x`` that :func:`array_check` took (``Request.view``);
    every other call goes to ``fallback``, the row's method."""
    nccl = transport.nccl_comm
    if call is calls.ALL_REDUCE and kind.direct and kind.reduce is not None:
        # allReduce(send, recv, count, ncclDataType_t, ncclRedOp_t, stream), in place
        launch, nccl_type, width, rooted = nccl.allReduce, kind.nccl_dtype, ITEMSIZE[kind.reduce.wire], False
    elif call is calls.BROADCAST:
        # broadcast(send, recv, bytes, ncclUint8, root, stream), in place: raw bytes, as the row's method
        launch, nccl_type, width, rooted = nccl.broadcast, NCCL_DTYPES["uint8"], 1, True
    else:
        return None
    planned = fast_module().PlannedCall(transport, launch, nccl_type, width, rooted, kind.nccl_op, kind.library,
                                        kind.library.adapter is arrays.CUPY, OPEN_GROUPS, fallback,
                                        call.name)
    return planned.fast, planned.method


def _key_wire(dtype: str) -> str:
    return "int64" if dtype == "float64" else "int32"


def order_keys(x: Any, adapter: ArrayAdapter, dtype: str, op: ReduceOp) -> Any:
    """A new contiguous array of the order keys of float array ``x`` (of dtype ``dtype``) for
    MIN/MAX ``op``, in the plan's wire dtype; ``x`` is left as it is."""
    ints = adapter.view(adapter.cast(x, None), INT_OF_WIDTH[_float_order.FLOAT_BITS[dtype] // 8])
    _float_order.encode(ints, op, dtype)
    wire = _key_wire(dtype)
    return ints if str(ints.dtype).endswith(wire) else adapter.cast(ints, wire)


def from_order_keys(keys: Any, adapter: ArrayAdapter, dtype: str) -> Any:
    """The float array of dtype ``dtype`` whose order keys ``keys`` are (reduced NaN keys
    become the dtype's quiet NaN); ``keys`` may be overwritten."""
    name = INT_OF_WIDTH[_float_order.FLOAT_BITS[dtype] // 8]
    ints = keys if str(keys.dtype).endswith(name) else adapter.cast(keys, name)
    _float_order.decode(ints, dtype)
    return adapter.view(ints, dtype)


def decode_nccl_version(code: int) -> tuple[int, int, int]:
    """``ncclGetVersion``'s integer as (major, minor, patch): 21803 -> (2, 18, 3)."""
    if code >= 10000:  # NCCL >= 2.9: major*10000 + minor*100 + patch
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100  # older: major*1000 + minor*100 + patch


# -- point-to-point plans of the collectives NCCL has no primitive for -----------------------------

@dataclass(frozen=True)
class P2PPlan:
    """One rank's part of a collective built from send/recv in one NCCL group: ``sends`` and
    ``recvs`` are ``(peer, byte offset, bytes)`` into its send and receive buffers. Zero-byte
    transfers are left out (every rank knows every size, so both sides leave out the same)."""

    sends: tuple[tuple[int, int, int], ...]
    recvs: tuple[tuple[int, int, int], ...]


def _plan(sends: list[tuple[int, int, int]], recvs: list[tuple[int, int, int]]) -> P2PPlan:
    return P2PPlan(tuple(t for t in sends if t[2]), tuple(t for t in recvs if t[2]))


def gather_plan(rank: int, size: int, dst: int, nbytes: int) -> P2PPlan:
    """Every rank's ``nbytes`` to ``dst``, rank r's at offset ``r * nbytes`` there."""
    recvs = [(r, r * nbytes, nbytes) for r in range(size)] if rank == dst else []
    return _plan([(dst, 0, nbytes)], recvs)


def scatter_plan(rank: int, size: int, src: int, row_bytes: int) -> P2PPlan:
    """Row r (``row_bytes`` at ``r * row_bytes``) of ``src``'s buffer to rank r."""
    sends = [(r, r * row_bytes, row_bytes) for r in range(size)] if rank == src else []
    return _plan(sends, [(src, 0, row_bytes)])


def all_to_all_v_plan(rank: int, splits: list[list[int]], row_bytes: int) -> P2PPlan:
    """``splits[i][j]`` rows go from rank i to rank j; rows received are concatenated in rank order."""
    sent = [count * row_bytes for count in splits[rank]]
    got = [row[rank] * row_bytes for row in splits]
    return _plan([(j, offset, n) for j, (offset, n) in enumerate(zip(offsets(sent), sent))],
                 [(i, offset, n) for i, (offset, n) in enumerate(zip(offsets(got), got))])


def all_to_all_plan(rank: int, size: int, row_bytes: int) -> P2PPlan:
    """Row j to rank j; row i of the result from rank i."""
    return all_to_all_v_plan(rank, [[1] * size for _ in range(size)], row_bytes)


def all_gather_v_plan(rank: int, counts: list[int], row_bytes: int) -> P2PPlan:
    """This rank's ``counts[rank]`` rows to every rank; the result is every rank's rows in order."""
    got = [count * row_bytes for count in counts]
    return _plan([(j, 0, got[rank]) for j in range(len(counts))],
                 [(i, offset, n) for i, (offset, n) in enumerate(zip(offsets(got), got))])
