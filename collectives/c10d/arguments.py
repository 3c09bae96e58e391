"""The argument checks of the "collectives" process group: what Gloo refuses, refused alike.

Each check runs on the caller's thread, before the operation is queued, so a bad call
raises at the call (as Gloo's does) and nothing is sent. The messages name the
argument of the ``torch.distributed`` function the user called (``gather_list``,
``scatter_list``, ``tensor_list``, ``input_list``...) and what it must be.

Gloo takes the same list and shape rules; what it refuses and the group takes on purpose,
as NCCL takes it: an ``all_gather`` whose output tensors differ from the input in their
first dimension (each rank sends its own number of rows), an ``all_to_all`` of tensors of
different sizes, and ``int16`` tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed

from collectives import arrays
from collectives.ops import ReduceOp, check_reduction


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


def _same_kind(name: str, index: int | None, t: torch.Tensor, like: torch.Tensor, what: str) -> None:
    """``t`` (``name[index]``) has ``like``'s dtype and device."""
    label = name if index is None else f"{name}[{index}]"
    if t.dtype != like.dtype:
        raise TypeError(f"{label} has dtype {t.dtype}; it must have the {what}'s dtype {like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{label} is on {t.device}; it must be on the {what}'s device {like.device}")


def _same_shape(name: str, index: int | None, t: torch.Tensor, like: torch.Tensor, what: str) -> None:
    _same_kind(name, index, t, like, what)
    if t.shape != like.shape:
        label = name if index is None else f"{name}[{index}]"
        raise ValueError(f"{label} has shape {_shape(t)}; it must have the {what}'s shape {_shape(like)}")


def _dense(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if t.layout != torch.strided:
            raise TypeError(f"the 'collectives' backend takes dense (strided) tensors here; got a {t.layout} "
                            "tensor (call .to_dense() first; sparse COO tensors: all_reduce with SUM alone, as Gloo)")


def _one(name: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{name}: the 'collectives' backend takes one tensor per call; got {len(tensors)}")
    return tensors[0]


def per_rank_list(op: str, name: str, tensors: Sequence[torch.Tensor], size: int) -> None:
    """``tensors`` holds one tensor per rank of the group."""
    if len(tensors) != size:
        raise ValueError(f"{op}: {name} holds {len(tensors)} tensors; it needs {size}, one per rank "
                         "of the group")


def allreduce(tensors: Sequence[torch.Tensor]) -> None:
    if not tensors:
        raise ValueError("all_reduce: the tensor list is empty")
    _dense(tensors)


def sparse_allreduce(tensors: Sequence[torch.Tensor], op: Any) -> None:
    """all_reduce of sparse COO tensors (Gloo's rules): SUM (torch's ``op``), every tensor sparse COO."""
    kind = getattr(op, "op", op)
    if kind != torch.distributed.ReduceOp.SUM:
        raise ValueError(f"all_reduce of sparse tensors takes ReduceOp.SUM alone (as Gloo); got "
                         f"ReduceOp.{getattr(kind, 'name', kind)}")
    for t in tensors:
        if t.layout != torch.sparse_coo:
            raise TypeError(f"all_reduce of sparse tensors takes sparse COO tensors alone; got a {t.layout} tensor "
                            "beside one")


def _paired(op: str, singles: Sequence[torch.Tensor], lists: Sequence[Sequence[torch.Tensor]], single: str,
            name: str, size: int) -> list[tuple[torch.Tensor, Sequence[torch.Tensor]]]:
    """One list of per-rank tensors (``name``) for each tensor of ``singles``; the pairs."""
    if not singles:
        raise ValueError(f"{op}: the {single} list is empty")
    if len(lists) != len(singles):
        raise ValueError(f"{op}: {len(lists)} {name} lists for {len(singles)} {single} tensors; it needs one "
                         f"per {single} tensor")
    _dense(singles)
    for tensors in lists:
        per_rank_list(op, name, tensors, size)
        _dense(tensors)
    return list(zip(singles, lists))


def allgather(outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], size: int) -> None:
    """all_gather: one output per rank, each the input's dtype and trailing shape (the
    first dimension may differ by rank: each rank sends its own number of rows)."""
    for x, tensor_list in _paired("all_gather", inputs, outputs, "input", "tensor_list", size):
        for rank, t in enumerate(tensor_list):
            _same_kind("tensor_list", rank, t, x, "input tensor")
            if t.dim() != x.dim() or t.shape[1:] != x.shape[1:]:
                raise ValueError(f"all_gather: tensor_list[{rank}] has shape {_shape(t)}; it must have the "
                                 f"input tensor's shape {_shape(x)} (its first dimension may differ: the "
                                 f"rows rank {rank} sends)")


def allgather_coalesced(output_lists: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor],
                        size: int) -> None:
    """all_gather_coalesced: ``output_lists[r][i]`` receives rank r's ``inputs[i]``."""
    if len(output_lists) != size:
        raise ValueError(f"all_gather_coalesced: output_tensor_lists holds {len(output_lists)} lists; it "
                         f"needs {size}, one per rank of the group")
    _dense(inputs)
    for rank, outputs in enumerate(output_lists):
        if len(outputs) != len(inputs):
            raise ValueError(f"all_gather_coalesced: output_tensor_lists[{rank}] holds {len(outputs)} "
                             f"tensors; it needs {len(inputs)}, one per input tensor")
        _dense(outputs)
        for index, (t, x) in enumerate(zip(outputs, inputs)):
            _same_shape(f"output_tensor_lists[{rank}]", index, t, x, f"input_tensor_list[{index}]")


def _rooted(op: str, lists: Sequence[Sequence[torch.Tensor]], like: torch.Tensor, root: int, rank: int,
            size: int, name: str, role: str, what: str) -> None:
    """A rooted call's list (``gather_list``, ``scatter_list``): on the root, one tensor per
    rank, each exactly like ``like``; on the other ranks, none."""
    _dense([like])
    if rank != root:
        if lists and any(lists):
            raise ValueError(f"{op}: {name} is given on rank {rank}, which is not the {role} (rank {root}); "
                             f"pass it on the {role} only")
        return
    if len(lists) != 1:
        raise ValueError(f"{op}: the {role} (rank {root}) needs {name}, a list of {size} tensors; got none")
    per_rank_list(op, name, lists[0], size)
    _dense(lists[0])
    for index, t in enumerate(lists[0]):
        _same_shape(name, index, t, like, what)


def gather(outputs: Sequence[Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], root: int,
           rank: int, size: int) -> None:
    """gather: the destination's ``gather_list`` holds one tensor per rank, each exactly like
    the input; the other ranks pass none."""
    _rooted("gather", outputs, _one("gather", inputs), root, rank, size, "gather_list", "destination",
            "input tensor")


def scatter(outputs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], root: int,
            rank: int, size: int) -> None:
    """scatter: the source's ``scatter_list`` holds one tensor per rank, each exactly like
    the output tensor; the other ranks pass none."""
    _rooted("scatter", inputs, _one("scatter", outputs), root, rank, size, "scatter_list", "source",
            "output tensor")


def reduce_scatter(outputs: Sequence[torch.Tensor], inputs: Sequence[Sequence[torch.Tensor]], size: int) -> None:
    """reduce_scatter: per output, ``input_list`` holds one tensor per rank, each exactly like it."""
    for output, input_list in _paired("reduce_scatter", outputs, inputs, "output", "input_list", size):
        for index, t in enumerate(input_list):
            _same_shape("input_list", index, t, output, "output tensor")


def all_gather_into_tensor(output: torch.Tensor, x: torch.Tensor, size: int) -> None:
    _dense([output, x])
    _same_kind("output_tensor", None, output, x, "input tensor")
    _size_times("all_gather_into_tensor", "output_tensor", output, "input_tensor", x, size)


def reduce_scatter_tensor(output: torch.Tensor, x: torch.Tensor, size: int) -> None:
    _dense([output, x])
    _same_kind("input", None, x, output, "output tensor")
    _size_times("reduce_scatter_tensor", "input", x, "output", output, size)


def _size_times(call: str, big_name: str, big: torch.Tensor, small_name: str, small: torch.Tensor,
                size: int) -> None:
    """``ValueError`` unless ``big`` holds ``size`` times the elements of ``small``."""
    if big.numel() != size * small.numel():
        raise ValueError(f"{call}: {big_name} holds {big.numel()} elements; it needs size * "
                         f"{small_name}.numel() = {size} * {small.numel()} = {size * small.numel()}")


def _splits(name: str, splits: Sequence[int], rows: int, tensor: str, size: int) -> None:
    if len(splits) != size:
        raise ValueError(f"all_to_all_single: {name} has {len(splits)} entries; it needs {size}, one per "
                         "rank of the group")
    if any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"all_to_all_single: {name} {list(splits)} must be non-negative and add up to "
                         f"{tensor}.shape[0] = {rows}")


def all_to_all_single(output: torch.Tensor, x: torch.Tensor, output_splits: Sequence[int],
                      input_splits: Sequence[int], size: int) -> None:
    _dense([output, x])
    _same_kind("output", None, output, x, "input")
    if x.dim() == 0 or output.dim() == 0:
        raise ValueError("all_to_all_single: input and output need at least one dimension (the rows "
                         "split between ranks)")
    if output.shape[1:] != x.shape[1:]:
        raise ValueError(f"all_to_all_single: output has shape {_shape(output)}; its dimensions after the "
                         f"first must be the input's {_shape(x)[1:]}")
    if input_splits:
        _splits("input_split_sizes", input_splits, x.shape[0], "input", size)
    elif x.shape[0] % size:
        raise ValueError(f"all_to_all_single without input_split_sizes needs input.shape[0] divisible by "
                         f"the group's size {size}; got input.shape={_shape(x)}")
    if output_splits:
        _splits("output_split_sizes", output_splits, output.shape[0], "output", size)
    elif output.shape[0] % size:
        raise ValueError(f"all_to_all_single without output_split_sizes needs output.shape[0] divisible "
                         f"by the group's size {size}; got output.shape={_shape(output)}")


def all_to_all(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], size: int) -> None:
    per_rank_list("all_to_all", "input_tensor_list", inputs, size)
    per_rank_list("all_to_all", "output_tensor_list", outputs, size)
    _dense([*outputs, *inputs])
    for name, tensors in (("input_tensor_list", inputs), ("output_tensor_list", outputs)):
        for index, t in enumerate(tensors):
            _same_kind(name, index, t, inputs[0], "input_tensor_list[0]")


_RED: Any = torch.distributed.ReduceOp.RedOpType
#: torch's reduce ops, by their RedOpType, as ours.
REDUCE_OPS = {_RED.SUM: ReduceOp.SUM, _RED.PRODUCT: ReduceOp.PROD, _RED.MIN: ReduceOp.MIN,
              _RED.MAX: ReduceOp.MAX, _RED.BAND: ReduceOp.BAND, _RED.BOR: ReduceOp.BOR,
              _RED.BXOR: ReduceOp.BXOR, _RED.AVG: ReduceOp.AVG}


def reduce_op(op: Any, tensors: list[torch.Tensor]) -> ReduceOp:
    """Our ReduceOp for torch's ``op``, checked against the dtypes of ``tensors``."""
    kind = getattr(op, "op", op)
    if kind not in REDUCE_OPS:
        names = ", ".join(f"ReduceOp.{t.name}" for t in REDUCE_OPS)
        label = f"ReduceOp.{kind.name}" if hasattr(kind, "name") else repr(op)
        raise ValueError(f"the 'collectives' backend does not take {label}; it takes {names} "
                         "(PREMUL_SUM: multiply by the factor first, then reduce with SUM)")
    ours = REDUCE_OPS[kind]
    for t in tensors:
        check_reduction(arrays.TORCH.dtype_name(t), ours)
    return ours
