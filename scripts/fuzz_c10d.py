"""A differential fuzz of the "collectives" torch backend against Gloo, in real ranks.

    python scripts/fuzz_c10d.py --trials 2000 --ranks 3 4 [--seed 1] [--debug] [--json out.json]

Each trial is one ``torch.distributed`` call drawn at random (the operation, dtype, shape,
reduce op, root, list lengths and split sizes), made in the same ranks on a "collectives"
group and on a Gloo group, with the same inputs. A trial is one of:

- valid: both must return the same tensors (and the same future values);
- invalid: the same bad call on every rank (a list of the wrong length, a tensor of the wrong
  shape or dtype, split sizes that do not add up...);
- root: a bad list at the root of a gather/scatter, on that rank alone;
- mismatch: the ranks' calls disagree (their shapes, their split sizes; with ``--debug``,
  also shapes and reduce ops of all_reduce/broadcast, which only the call path's checks see):
  the group must raise on every rank (Gloo is not asked: a size it did not expect makes it
  abort the process);
- extension: what Gloo refuses and the group takes on purpose (int16, all_gather with
  unequal first dimensions): the group's result is checked against numpy instead.

The verdict, per rank: a rank where Gloo raises and the group returns is a failure; where
both return, their tensors must be equal; an invalid call must raise at the call. Where the
group raises and Gloo returns, the trial counts as "stricter" (e.g. SUM of bool). Exit status
1 on any failure. A Gloo group that raised is made anew (Gloo's pairs close on a timeout);
the "collectives" group is used throughout, so it must stay in step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

#: Seconds Gloo waits before it gives up (a bad root list leaves Gloo's other ranks waiting).
GLOO_TIMEOUT = 3.0

FLOATS = ["float32", "float64", "float16", "bfloat16"]
INTS = ["int8", "uint8", "int32", "int64"]
DTYPES = FLOATS + INTS + ["bool"]
OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"]
KINDS = ["all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
         "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "gather", "scatter", "barrier"]
LABELS = {"valid": 60, "invalid": 20, "extension": 8, "root": 6, "mismatch": 6}
#: Operations whose Gloo Work has a future (the others: "getFuture not implemented").
WITH_FUTURES = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_to_all",
                "all_to_all_single", "gather", "scatter", "barrier"}


# -- the trials: what every rank computes alike from (seed, index) --------------------------------

class Trial:
    """One call: ``kind``, ``label``, ``text`` (what it is, for a report), and for each rank
    ``make(rank)``: the call's tensors and a function that makes it on a group. ``gloo_aborts``:
    this torch's Gloo ends the process on the call (a failed CHECK) instead of raising, so only
    ours is run."""

    def __init__(self, kind: str, label: str, text: str, make: Callable[[int], Any],
                 expected: Callable[[int], Any] | None = None, mode: str = "sync", gloo_aborts: bool = False) -> None:
        self.kind, self.label, self.text, self.make, self.expected, self.mode = kind, label, text, make, expected, mode
        self.gloo_aborts = gloo_aborts


def data(seed: int, index: int, rank: int, slot: int, shape: tuple[int, ...], dtype: str) -> Any:
    """Small integers in ``dtype`` (exact under every sum and product the trials make)."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{index}/{rank}/{slot}".encode()))
    low, high = (0, 2) if dtype == "bool" else (0, 4) if dtype == "uint8" else (-3, 4)
    return torch.randint(low, high, shape, generator=g).to(getattr(torch, dtype))


def _shape(rng: random.Random, ndim: int | None = None) -> tuple[int, ...]:
    ndim = rng.choice([1, 1, 2, 3]) if ndim is None else ndim
    return tuple(rng.randint(1, 3) for _ in range(ndim))


def trial(seed: int, index: int, size: int, debug: bool, labels: tuple[str, ...] = tuple(LABELS)) -> Trial:
    """Trial ``index`` of a run, the same on every rank (of one of ``labels``)."""
    rng = random.Random(f"{seed}-{index}-{size}")
    label = rng.choices(list(labels), weights=[LABELS[name] for name in labels])[0]
    kind = rng.choice([k for k in KINDS if label in _LABELS_OF[k] and (debug or (k, label) not in _DEBUG_ONLY)])
    made = _BUILDERS[kind](rng, label, seed, index, size, debug)
    assert made is not None, (kind, label)
    made.mode = rng.choice(["sync", "wait", "future"] if kind in WITH_FUTURES else ["sync", "wait"])
    return made


def _op_allowed(dtype: str, op: str) -> bool:
    """Our dtype x op table (collectives.ops), which Gloo's refusals are a part of."""
    if dtype == "bool":
        return op in ("MIN", "MAX", "BAND", "BOR", "BXOR")
    if dtype in FLOATS:
        return op not in ("BAND", "BOR", "BXOR")
    return op != "AVG"


def _reduce(arrays: list[Any], op: str) -> Any:
    stacked = np.stack(arrays)
    reducer = {"SUM": np.sum, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max,
               "BAND": np.bitwise_and.reduce, "BOR": np.bitwise_or.reduce, "BXOR": np.bitwise_xor.reduce}[op]
    return reducer(stacked, axis=0).astype(stacked.dtype)


def _all_reduce(rng: random.Random, label: str, seed: int, index: int, size: int, debug: bool) -> Trial | None:
    import torch.distributed as dist

    dtype, op = rng.choice(DTYPES), rng.choice(OPS)
    shape = _shape(rng, rng.choice([0, 1, 1, 2]))
    odd = rng.randrange(size)
    if label == "invalid":
        while _op_allowed(dtype, op):
            dtype, op = rng.choice(DTYPES), rng.choice(OPS)
    elif label == "extension":
        dtype, op = "int16", rng.choice(["SUM", "MIN", "MAX", "BAND", "BXOR"])
    else:  # valid, or a mismatch of valid calls (a rank refusing its own call alone would leave
        # the others waiting for it: that is a skipped call, which only a timeout ends)
        while not _op_allowed(dtype, op) or (dtype in ("float16", "bfloat16") and op == "AVG"):
            dtype, op = rng.choice(DTYPES), rng.choice(OPS)
    mismatch = label == "mismatch" and rng.choice(["shape", "op"])

    def make(rank: int) -> Any:
        mine = shape + (1,) if mismatch == "shape" and rank == odd else shape
        mine_op = ("MIN" if op == "MAX" else "MAX") if mismatch == "op" and rank == odd else op
        t = data(seed, index, rank, 0, mine, dtype)
        return (lambda group, async_op: dist.all_reduce(t, op=getattr(dist.ReduceOp, mine_op), group=group,
                                                        async_op=async_op)), [t]

    def expected(rank: int) -> Any:
        return [_reduce([_arrays(data(seed, index, r, 0, shape, dtype)) for r in range(size)], op)]
    return Trial("all_reduce", label, f"all_reduce {op} {dtype} {shape}" + (f" ({mismatch} differs on rank {odd})"
                 if mismatch else ""), make, expected if label == "extension" else None)


def _broadcast(rng: random.Random, label: str, seed: int, index: int, size: int, debug: bool) -> Trial | None:
    import torch.distributed as dist

    if label not in ("valid", "mismatch") or (label == "mismatch" and not debug):
        return None
    dtype, shape, root, odd = rng.choice(DTYPES), _shape(rng, rng.choice([0, 1, 2])), rng.randrange(size), \
        rng.randrange(size)

    def make(rank: int) -> Any:
        t = data(seed, index, rank, 0, shape + (2,) if label == "mismatch" and rank == odd else shape, dtype)
        return (lambda group, async_op: dist.broadcast(t, src=root, group=group, async_op=async_op)), [t]
    return Trial("broadcast", label, f"broadcast {dtype} {shape} from {root}", make)


def _reduce_trial(rng: random.Random, label: str, seed: int, index: int, size: int, debug: bool) -> Trial | None:
    import torch.distributed as dist

    if label not in ("valid", "invalid"):
        return None
    dtype, op, root = rng.choice(DTYPES), rng.choice(["SUM", "PRODUCT", "MIN", "MAX", "BAND"]), rng.randrange(size)
    while _op_allowed(dtype, op) != (label == "valid"):
        dtype, op = rng.choice(DTYPES), rng.choice(["SUM", "PRODUCT", "MIN", "MAX", "BAND"])
    shape = _shape(rng)

    def make(rank: int) -> Any:
        t = data(seed, index, rank, 0, shape, dtype)
        # The other ranks' tensors are scratch to some backends: only the root's is compared.
        return (lambda group, async_op: dist.reduce(t, dst=root, op=getattr(dist.ReduceOp, op), group=group,
                                                    async_op=async_op)), [t] if rank == root else []
    return Trial("reduce", label, f"reduce {op} {dtype} {shape} to {root}", make)


def _all_gather(rng: random.Random, label: str, seed: int, index: int, size: int, debug: bool) -> Trial | None:
    import torch
    import torch.distributed as dist

    if label in ("root", "mismatch"):
        return None
    dtype, shape = rng.choice(DTYPES), _shape(rng)
    fault = label == "invalid" and rng.choice(["count", "trailing", "dtype"])
    count = size + rng.choice([-1, 1]) if fault == "count" else size
    uneven = label == "extension"

    def rows(rank: int) -> tuple[int, ...]:
        return (rank + 1, *shape[1:]) if uneven else shape

    def make(rank: int) -> Any:
        x = data(seed, index, rank, 0, rows(rank), dtype)
        outputs = []
        for r in range(count):
            out_shape, out_dtype = rows(min(r, size - 1)), getattr(torch, dtype)
            if fault == "trailing" and r == size - 1:
                out_shape = (*out_shape, 1)
            if fault == "dtype" and r == 0:
                out_dtype = torch.float64 if dtype != "float64" else torch.float32
            outputs.append(torch.zeros(out_shape, dtype=out_dtype))
        return (lambda group, async_op: dist.all_gather(outputs, x, group=group, async_op=async_op)), outputs

    def expected(rank: int) -> Any:
        return [_arrays(data(seed, index, r, 0, rows(r), dtype)) for r in range(size)]
    return Trial("all_gather", label, f"all_gather {dtype} {shape}" + (f" ({fault})" if fault else "")
                 + (" (first dimension rank + 1)" if uneven else ""), make, expected if uneven else None)


def _all_gather_into_tensor(rng: random.Random, label: str, seed: int, index: int, size: int,
                            debug: bool) -> Trial | None:
    import torch
    import torch.distributed as dist

    if label not in ("valid", "invalid"):
        return None
    dtype, shape = rng.choice(DTYPES), _shape(rng)
    fault = label == "invalid" and rng.choice(["numel", "dtype"])

    def make(rank: int) -> Any:
        x = data(seed, index, rank, 0, shape, dtype)
        rows = size * shape[0] + (1 if fault == "numel" else 0)
        out_dtype = (torch.float64 if dtype != "float64" else torch.float32) if fault == "dtype" else x.dtype
        out = torch.zeros((rows, *shape[1:]), dtype=out_dtype)
        return (lambda group, async_op: (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(
            out, x, group=group, async_op=async_op)), [out]
    return Trial("all_gather_into_tensor", label, f"all_gather_into_tensor {dtype} {shape}"
                 + (f" ({fault})" if fault else ""), make)


def _reduce_scatter(rng: random.Random, label: str, seed: int, index: int, size: int, debug: bool) -> Trial | None:
    import torch
    import torch.distributed as dist

    if label not in ("valid", "invalid"):
        return None
    dtype, op, shape = rng.choice(FLOATS + INTS), rng.choice(["SUM", "MIN", "MAX"]), _shape(rng)
    fault = label == "invalid" and rng.choice(["count", "shape", "dtype"])

    def make(rank: int) -> Any:
        count = size + 1 if fault == "count" else size
        inputs = [data(seed, index, rank, slot, shape + (2,) if fault == "shape" and slot == 0 else shape, dtype)
                  for slot in range(count)]
        if fault == "dtype":
            inputs[-1] = inputs[-1].to(torch.float64 if dtype != "float64" else torch.float32)
        out = torch.zeros(shape, dtype=getattr(torch, dtype))
        return (lambda group, async_op: dist.reduce_scatter(out, inputs, op=getattr(dist.ReduceOp, op),
                                                            group=group, async_op=async_op)), [out]
    return Trial("reduce_scatter", label, f"reduce_scatter {op} {dtype} {shape}" + (f" ({fault})" if fault else ""),
                 make)


def _reduce_scatter_tensor(rng: random.Random, label: str, seed: int, index: int, size: int,
                           debug: bool) -> Trial | None:
    import torch
    import torch.distributed as dist

    if label not in ("valid", "invalid"):
        return None
    dtype, shape = rng.choice(FLOATS + INTS), _shape(rng)
    fault = label == "invalid" and rng.choice(["numel", "dtype"])

    def make(rank: int) -> Any:
        x = data(seed, index, rank, 0, (size * shape[0] + (1 if fault == "numel" else 0), *shape[1:]), dtype)
        out_dtype = (torch.float64 if dtype != "float64" else torch.float32) if fault == "dtype" else x.dtype
        out = torch.zeros(shape, dtype=out_dtype)
        return (lambda group, async_op: (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(
            out, x, group=group, async_op=async_op)), [out]
    # torch 2.9's Gloo CHECKs the input's rows (outputShape[0] * worldSize ==
    # inputShape[0]) and aborts the process; 2.11's raises (2.10 not tried: treated as 2.9).
    old_gloo = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11)
    return Trial("reduce_scatter_tensor", label, f"reduce_scatter_tensor {dtype} {shape}"
                 + (f" ({fault})" if fault else ""), make, gloo_aborts=fault == "numel" and old_gloo)


def _other(receives: list[int]) -> list[int]:
    """Other sizes than ``receives``: rotated (the same total) where that changes them."""
    rotated = receives[1:] + receives[:1]
    return rotated if rotated != receives else [receives[0] + 1, *receives[1:]]


def _splits(rng: random.Random, size: int) -> list[list[int]]:
    """``S[i][j]``: rows rank i sends to rank j."""
    return [[rng.randint(0, 2) for _ in range(size)] for _ in range(size)]


def _all_to_all_single(rng: random.Random, label: str, seed: int, index: int, size: int,
                       debug: bool) -> Trial | None:
    import torch
    import torch.distributed as dist

    if label in ("root", "extension"):
        return None
    dtype, rest = rng.choice(DTYPES), _shape(rng, rng.choice([0, 1]))
    even = label == "valid" and rng.random() < 0.4
    S = _splits(rng, size)
    fault = label == "invalid" and rng.choice(["sum", "length", "indivisible"])
    odd = rng.randrange(size)

    def make(rank: int) -> Any:
        if even:
            x = data(seed, index, rank, 0, (size * 2, *rest), dtype)
            out = torch.zeros((size * 2, *rest), dtype=x.dtype)
            return (lambda group, async_op: dist.all_to_all_single(out, x, group=group, async_op=async_op)), [out]
        if fault == "indivisible":
            x = data(seed, index, rank, 0, (size + 1, *rest), dtype)
            out = torch.zeros((size + 1, *rest), dtype=x.dtype)
            return (lambda group, async_op: dist.all_to_all_single(out, x, group=group, async_op=async_op)), [out]
        sends = list(S[rank])
        receives = [S[j][rank] for j in range(size)]
        if label == "mismatch" and rank == odd:  # not what the others send
            receives = _other(receives)
        x = data(seed, index, rank, 0, (sum(sends), *rest), dtype)
        out = torch.zeros((sum(receives), *rest), dtype=x.dtype)
        if fault == "sum":
            sends = [s + 1 for s in sends]
        if fault == "length":
            sends, receives = sends + [0], receives + [0]
        return (lambda group, async_op: dist.all_to_all_single(out, x, receives, sends, group=group,
                                                               async_op=async_op)), [out]
    text = "even" if even else f"splits {S}"
    return Trial("all_to_all_single", label, f"all_to_all_single {dtype} rows {rest} {text}"
                 + (f" ({fault})" if fault else "") + (f" (rank {odd} expects other splits)"
                                                       if label == "mismatch" else ""), make)


def _all_to_all(rng: random.Random, label: str, seed: int, index: int, size: int, debug: bool) -> Trial | None:
    import torch
    import torch.distributed as dist

    dtype = rng.choice(DTYPES)
    # Gloo takes one size for every tensor; unequal sizes (as NCCL takes them) are an extension.
    equal = rng.randint(1, 3)
    S = [[rng.randint(1, 3) if label in ("extension", "mismatch") else equal for _ in range(size)]
         for _ in range(size)]
    fault = label == "invalid" and rng.choice(["count", "dtype"])
    odd = rng.randrange(size)

    def make(rank: int) -> Any:
        inputs = [data(seed, index, rank, j, (S[rank][j],), dtype) for j in range(size)]
        receives = [S[j][rank] for j in range(size)]
        if label == "mismatch" and rank == odd:
            receives = _other(receives)
        outputs = [torch.zeros((n,), dtype=getattr(torch, dtype)) for n in receives]
        if fault == "count":
            inputs.append(inputs[0].clone())
            outputs.append(outputs[0].clone())
        if fault == "dtype":
            outputs[0] = outputs[0].to(torch.float64 if dtype != "float64" else torch.float32)
        return (lambda group, async_op: dist.all_to_all(outputs, inputs, group=group, async_op=async_op)), outputs

    def expected(rank: int) -> Any:
        return [_arrays(data(seed, index, j, rank, (S[j][rank],), dtype)) for j in range(size)]
    return Trial("all_to_all", label, f"all_to_all {dtype} sizes {S}" + (f" ({fault})" if fault else "")
                 + (f" (rank {odd} expects other sizes)" if label == "mismatch" else ""), make,
                 expected if label in ("extension", "valid") else None)


def _gather(rng: random.Random, label: str, seed: int, index: int, size: int, debug: bool) -> Trial | None:
    import torch
    import torch.distributed as dist

    if label in ("invalid", "extension"):
        return None
    dtype, shape, root, odd = rng.choice(DTYPES), _shape(rng), rng.randrange(size), rng.randrange(size)
    # (a dtype unlike the tensor's is torch's own refusal, on the root alone, before any backend)
    fault = label == "root" and rng.choice(["fewer", "more", "shape"])

    def make(rank: int) -> Any:
        x = data(seed, index, rank, 0, shape + (2,) if label == "mismatch" and rank == odd else shape, dtype)
        if rank != root:
            return (lambda group, async_op: dist.gather(x, None, dst=root, group=group, async_op=async_op)), []
        count = size - 1 if fault == "fewer" else size + 1 if fault == "more" else size
        out_shape = shape + (1,) if fault == "shape" else shape
        gathered = [torch.zeros(out_shape, dtype=x.dtype) for _ in range(count)]
        return (lambda group, async_op: dist.gather(x, gathered, dst=root, group=group, async_op=async_op)), gathered
    return Trial("gather", label, f"gather {dtype} {shape} to {root}" + (f" ({fault} at the root)" if fault else "")
                 + (f" (rank {odd}'s shape differs)" if label == "mismatch" else ""), make)


def _scatter(rng: random.Random, label: str, seed: int, index: int, size: int, debug: bool) -> Trial | None:
    import torch
    import torch.distributed as dist

    if label in ("invalid", "extension"):
        return None
    dtype, shape, root = rng.choice(DTYPES), _shape(rng), rng.randrange(size)
    odd = rng.choice([r for r in range(size) if r != root])
    # (a dtype unlike the tensor's is torch's own refusal, on the root alone, before any backend)
    fault = label == "root" and rng.choice(["fewer", "more", "shape"])

    def make(rank: int) -> Any:
        out = torch.zeros(shape + (2,) if label == "mismatch" and rank == odd else shape, dtype=getattr(torch, dtype))
        if rank != root:
            return (lambda group, async_op: dist.scatter(out, None, src=root, group=group, async_op=async_op)), [out]
        count = size - 1 if fault == "fewer" else size + 1 if fault == "more" else size
        row_shape = shape + (1,) if fault == "shape" else shape
        rows = [data(seed, index, rank, r, row_shape, dtype) for r in range(count)]
        return (lambda group, async_op: dist.scatter(out, rows, src=root, group=group, async_op=async_op)), [out]
    return Trial("scatter", label, f"scatter {dtype} {shape} from {root}" + (f" ({fault} at the root)" if fault else "")
                 + (f" (rank {odd}'s shape differs)" if label == "mismatch" else ""), make)


def _barrier(rng: random.Random, label: str, seed: int, index: int, size: int, debug: bool) -> Trial | None:
    import torch.distributed as dist

    if label != "valid":
        return None
    return Trial("barrier", "valid", "barrier",
                 lambda rank: ((lambda group, async_op: dist.barrier(group=group, async_op=async_op)), []))


#: The labels each kind has trials of.
_LABELS_OF = {"all_reduce": {"valid", "invalid", "extension", "mismatch"}, "broadcast": {"valid", "mismatch"},
              "reduce": {"valid", "invalid"}, "all_gather": {"valid", "invalid", "extension"},
              "all_gather_into_tensor": {"valid", "invalid"}, "reduce_scatter": {"valid", "invalid"},
              "reduce_scatter_tensor": {"valid", "invalid"}, "all_to_all_single": {"valid", "invalid", "mismatch"},
              "all_to_all": {"valid", "invalid", "extension", "mismatch"}, "gather": {"valid", "root", "mismatch"},
              "scatter": {"valid", "root", "mismatch"}, "barrier": {"valid"}}
#: Mismatches only the call path's checks see (COLLECTIVES_DEBUG=1, --debug).
_DEBUG_ONLY = {("all_reduce", "mismatch"), ("broadcast", "mismatch")}

_BUILDERS: dict[str, Callable[..., Trial | None]] = {
    "all_reduce": _all_reduce, "broadcast": _broadcast, "reduce": _reduce_trial, "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor, "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor, "all_to_all_single": _all_to_all_single,
    "all_to_all": _all_to_all, "gather": _gather, "scatter": _scatter, "barrier": _barrier}


# -- the rank side -----------------------------------------------------------------------------

def _arrays(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.float().numpy() if value.dtype == torch.bfloat16 else value.numpy().copy()
    if isinstance(value, (list, tuple)):
        return [_arrays(v) for v in value]
    return repr(value)


def _run(call: Any, outputs: list[Any], group: Any, mode: str) -> tuple[Any, ...]:
    """What the call did on this rank: ("ok", outputs, future value) or ("raised", type,
    message, raised at the call)."""
    try:
        work = call(group, mode != "sync")
    except Exception as error:  # noqa: BLE001 - the outcome is the fuzz's data
        return ("raised", type(error).__name__, str(error)[:300], True)
    value = None
    try:
        if mode == "wait":
            work.wait()
        elif mode == "future":
            value = _arrays(work.get_future().wait())
    except Exception as error:  # noqa: BLE001
        return ("raised", type(error).__name__, str(error)[:300], False)
    return ("ok", _arrays(outputs), value)


def fuzz_job(comm: Any, seed: int, start: int, count: int, debug: bool, gloo_timeout: float = GLOO_TIMEOUT,
             labels: tuple[str, ...] = tuple(LABELS)) -> list[dict[str, Any]]:
    """Trials ``start`` to ``start + count`` on this rank: each on a "collectives" group and
    on a Gloo group (made anew after Gloo raised anywhere)."""
    import torch
    import torch.distributed as dist

    import collectives.c10d

    if not dist.is_initialized():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        collectives.c10d.init_process_group()
    size, rank = dist.get_world_size(), dist.get_rank()
    ours = dist.new_group(backend="collectives")
    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=gloo_timeout))
    results = []
    for index in range(start, start + count):
        t = trial(seed, index, size, debug, labels)
        record: dict[str, Any] = {"index": index}
        for name, group in (("ours", ours), ("gloo", gloo)):
            if name == "gloo" and (t.label == "mismatch" or t.gloo_aborts):  # Gloo may abort the
                record[name] = ("skipped",)  # process (a size it did not expect: std::terminate)
                continue
            call, outputs = t.make(rank)
            record[name] = _run(call, outputs, group, t.mode)
            if t.kind == "reduce" and not outputs and record[name][0] == "ok":  # another rank's
                record[name] = ("ok", [], None)  # reduce may use this tensor as scratch (Gloo does)
        record["expected"] = t.expected(rank) if t.expected else None
        failed = torch.tensor([record["gloo"][0] == "raised"], dtype=torch.int64)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # on the default group: every rank agrees
        if failed.item():
            dist.destroy_process_group(gloo)
            gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=gloo_timeout))
        results.append(record)
    dist.destroy_process_group(gloo)
    dist.destroy_process_group(ours)
    return results


# -- the verdict ---------------------------------------------------------------------------------

def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def verdict(t: Trial, per_rank: list[dict[str, Any]]) -> tuple[str, str]:
    """(category, detail) of one trial from every rank's record: category is "failed",
    "stricter", "extension", "both raised", "same", or "gloo timed out" (a valid call that Gloo
    did not complete within its timeout on a loaded machine, which the group completed)."""
    category, details = "same", []
    for rank, record in enumerate(per_rank):
        ours, gloo = record["ours"], record["gloo"]
        if t.label == "extension":
            if ours[0] != "ok" or not _equal([np.asarray(a) for a in ours[1]], [np.asarray(a) for a in
                                                                                 record["expected"]]):
                return "failed", f"rank {rank}: the extension's result is not numpy's: {ours[:3]}"
            category = "extension"
            continue
        if t.label == "invalid" and not (ours[0] == "raised" and ours[3]):
            return "failed", f"rank {rank}: an invalid call did not raise at the call: {ours[:3]}"
        if t.label == "mismatch":  # an error by definition (Gloo is not run: it may abort)
            if ours[0] != "raised":
                return "failed", f"rank {rank}: the ranks' calls disagree and the group returned"
            category = "both raised"
            continue
        if t.label == "valid" and gloo[0] == "raised" and "does not support" in gloo[2] \
                and record["expected"] is not None:
            # A collective this torch's Gloo lacks (2.11's has no list all_to_all): numpy's answer.
            if ours[0] != "ok" or not _equal([np.asarray(a) for a in ours[1]],
                                             [np.asarray(a) for a in record["expected"]]):
                return "failed", f"rank {rank}: Gloo lacks it and the result is not numpy's: {ours[:3]}"
            category = "extension"
            continue
        if gloo[0] == "raised" and ours[0] == "ok":
            if t.label == "valid" and "Timed out" in gloo[2]:  # a right call Gloo did not finish in time
                category = "gloo timed out"
                details.append(f"rank {rank}: {gloo[2][:100]}")
                continue
            return "failed", f"rank {rank}: Gloo raised ({gloo[1]}: {gloo[2][:120]}) and the group returned"
        if gloo[0] == "ok" and ours[0] == "ok":
            if not _equal(ours[1], gloo[1]):
                return "failed", f"rank {rank}: the tensors differ from Gloo's"
            if t.mode == "future" and not _equal(ours[2], gloo[2]):
                return "failed", f"rank {rank}: the future's value differs from Gloo's"
        elif gloo[0] == "ok":
            category = "stricter"
            details.append(f"rank {rank}: {ours[1]}: {ours[2][:100]}")
        elif category == "same":
            category = "both raised"
    return category, "; ".join(details)


def run(sizes: list[int], trials: int, seed: int, debug: bool, batch: int = 100,
        progress: Callable[[str], None] | None = None, gloo_timeout: float = GLOO_TIMEOUT,
        labels: tuple[str, ...] = tuple(LABELS)) -> dict[str, Any]:
    """The fuzz at every size of ``sizes``: per size, the counts by category and label, and
    the failed trials."""
    from collectives.testing.pool import RankPool

    report: dict[str, Any] = {"seed": seed, "debug": debug, "labels": list(labels), "sizes": {}}
    env = {"COLLECTIVES_TIMEOUT": "60", **({"COLLECTIVES_DEBUG": "1"} if debug else {})}
    for size in sizes:
        counts: Counter[str] = Counter()
        drawn: Counter[str] = Counter()
        failures: list[dict[str, Any]] = []
        stricter: Counter[str] = Counter()
        examples: dict[str, str] = {}
        started = time.monotonic()
        with RankPool("mpi", size, env=env) as pool:
            for start in range(0, trials, batch):
                count = min(batch, trials - start)
                per_rank = pool.run(fuzz_job, args=(seed, start, count, debug, gloo_timeout, labels),
                                    timeout=60 + (gloo_timeout + 5) * count)
                for offset in range(count):
                    index = start + offset
                    t = trial(seed, index, size, debug, labels)
                    category, detail = verdict(t, [results[offset] for results in per_rank])
                    counts[category] += 1
                    drawn[t.label] += 1
                    if category == "failed":
                        failures.append({"index": index, "trial": t.text, "mode": t.mode, "label": t.label,
                                         "detail": detail})
                    if category == "stricter":
                        stricter[f"{t.kind}: {detail.split(': ', 1)[-1][:90]}"] += 1
                        examples.setdefault(t.kind, f"#{index} {t.text} [{t.mode}]: {detail[:200]}")
                if progress:
                    progress(f"{size} ranks: {start + count}/{trials} trials, {dict(counts)}")
        report["sizes"][str(size)] = {"trials": trials, "categories": dict(counts), "labels": dict(drawn),
                                      "failures": failures, "stricter": dict(stricter),
                                      "stricter examples": examples,
                                      "seconds": round(time.monotonic() - started, 1)}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=1000, help="trials per number of ranks")
    parser.add_argument("--ranks", type=int, nargs="+", default=[3, 4])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--debug", action="store_true",
                        help="COLLECTIVES_DEBUG=1, and the mismatches only the call path's checks catch")
    parser.add_argument("--gloo-timeout", type=float, default=GLOO_TIMEOUT, help="seconds (default %(default)s)")
    parser.add_argument("--labels", default=",".join(LABELS), help="the kinds of trial (default %(default)s)")
    parser.add_argument("--json", help="write the report here")
    args = parser.parse_args(argv)
    report = run(args.ranks, args.trials, args.seed, args.debug, progress=lambda line: print(line, flush=True),
                 gloo_timeout=args.gloo_timeout, labels=tuple(args.labels.split(",")))
    for size, part in report["sizes"].items():
        print(f"{size} ranks: {part['trials']} trials in {part['seconds']} s: {part['categories']} "
              f"(labels {part['labels']})")
        for what, n in sorted(part["stricter"].items()):
            print(f"  stricter than Gloo x{n}: {what}")
        for example in part["stricter examples"].values():
            print(f"    e.g. {example}")
        for failure in part["failures"]:
            print(f"  FAILED #{failure['index']} {failure['trial']} [{failure['mode']}]: {failure['detail']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if any(part["failures"] for part in report["sizes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
