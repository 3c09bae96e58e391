"""The bad-input catalogue: one row per kind of bad call, run by test_bad_input.py on every
backend (and imported by the ranks for the job).

A row returns the arrays it passes (to check they are untouched) and its calls, each
(thunk, expected exception type, a phrase the message must contain). The rows of
SLIPPED_PAST are bad input that used to slip past the checks: before the checks these ran
the collective and then failed (torch's RuntimeError on a zero-stride write-back,
OverflowError after split's barrier, internal errors on nested tensors), returned a wrong
result (negative bit: -1 instead of -2; an out= of negative bit: the result read negated),
or moved the sequence number (masked arrays to async broadcast on mpi).
"""

from __future__ import annotations

import numpy as np

from collectives.diagnostics.recorder import ERROR, SEQ
from collectives.testing import worlds

BACKENDS = worlds((2,))


def _row_dtype_x_op(comm):
    f = np.arange(2 * comm.size, dtype=np.float32)
    b = np.ones(2 * comm.size, dtype=bool)
    i = np.arange(3, dtype=np.int32)
    return [f, b, i], [
        (lambda: comm.all_reduce(f, "bxor"), TypeError, "op=BXOR is not allowed on dtype float32"),
        (lambda: comm.reduce_scatter(b, "sum"), TypeError, "op=SUM is not allowed on dtype bool"),
        (lambda: comm.all_reduce(i, "avg"), TypeError, "op=AVG is not allowed on dtype int32"),
    ]


def _row_root_out_of_range(comm):
    x = np.arange(3.0)
    return [x], [
        (lambda: comm.broadcast(x, src=comm.size), ValueError, f"src={comm.size} is out of range"),
        (lambda: comm.broadcast(x, src=-1), ValueError, "src=-1 is out of range"),
        (lambda: comm.broadcast(x, src=0.0), TypeError, "src must be an int rank"),
    ]


def _row_unknown_op(comm):
    x = np.arange(2.0 * comm.size)
    return [x], [
        (lambda: comm.all_reduce(x, "mean"), ValueError, "op='mean' is not a reduce op; valid: SUM"),
        (lambda: comm.reduce_scatter(x, "average"), ValueError, "op='average' is not a reduce op"),
        (lambda: comm.all_reduce(x, 3), ValueError, "op=3 is not a reduce op"),
    ]


def _row_array_type(comm):
    values = [1.0, 2.0]
    return [], [
        (lambda: comm.all_reduce(values), TypeError, "x of type builtins.list is not supported"),
        (lambda: comm.all_gather(3.0), TypeError, "x of type builtins.float is not supported"),
    ]


def _row_device(comm):
    import torch

    meta = torch.empty(3, device="meta")
    sparse = torch.eye(2).to_sparse()
    return [sparse.to_dense()], [
        (lambda: comm.all_reduce(meta), ValueError, "on device meta; collectives take CPU or CUDA"),
        (lambda: comm.all_gather(sparse), TypeError, "layout torch.sparse_coo"),
    ]


def _row_read_only(comm):
    x = np.arange(3.0)
    x.setflags(write=False)
    return [x], [
        (lambda: comm.all_reduce(x), ValueError, "x is a read-only numpy array"),
        (lambda: comm.broadcast(x, 0), ValueError, "x is a read-only numpy array"),
    ]


def _row_split_color(comm):
    return [], [
        (lambda: comm.split(1.5), TypeError, "color must be an int or None; got float"),
        (lambda: comm.split("a"), TypeError, "color must be an int or None; got str"),
        (lambda: comm.split(-1), ValueError, "color must be >= 0"),
        (lambda: comm.split(0, key=0.5), TypeError, "key must be an int or None; got float"),
    ]


def _row_closed(comm):
    sub = comm.split(0)
    sub.close()
    x = np.arange(3.0)
    return [x], [
        (lambda: sub.all_reduce(x), ValueError, "is closed; create a new communicator"),
        (lambda: sub.all_gather(x), ValueError, "is closed"),
        (lambda: sub.barrier(), ValueError, "is closed"),
        (lambda: sub.split(0), ValueError, "is closed"),
    ]


def _row_reduce_scatter_rows(comm):
    scalar = np.array(1.0)
    calls = [(lambda: comm.reduce_scatter(scalar), ValueError, "at least one dimension")]
    uneven = np.arange(2.0 * (comm.size + 1)).reshape(comm.size + 1, 2)
    if comm.size > 1:  # with one rank every first dimension is divisible
        calls.append((lambda: comm.reduce_scatter(uneven), ValueError,
                      f"x.shape[0] divisible by size={comm.size}; got x.shape=({comm.size + 1}, 2)"))
    return [scalar, uneven], calls


def _row_object_dtype(comm):
    objects = np.array([1, "a"], dtype=object)
    complex_ = np.ones(2, dtype=np.complex128)
    return [objects, complex_], [
        (lambda: comm.all_reduce(objects), TypeError, "dtype object of this numpy array is not supported"),
        (lambda: comm.all_gather(objects), TypeError, "dtype object"),
        (lambda: comm.broadcast(complex_), TypeError, "dtype complex128"),
    ]


def _row_requires_grad(comm):
    import torch

    x = torch.ones(3, requires_grad=True)
    return [x], [
        (lambda: comm.all_reduce(x), ValueError, "x requires grad; in-place collectives"),
        (lambda: comm.broadcast(x, 0), ValueError, "x requires grad"),
    ]


CATALOGUE = {
    "dtype_x_op": _row_dtype_x_op,
    "root_out_of_range": _row_root_out_of_range,
    "unknown_op": _row_unknown_op,
    "array_type": _row_array_type,
    "device": _row_device,
    "read_only": _row_read_only,
    "split_color": _row_split_color,
    "closed_communicator": _row_closed,
    "reduce_scatter_rows": _row_reduce_scatter_rows,
    "object_dtype": _row_object_dtype,
    "requires_grad_in_place": _row_requires_grad,
}


def _row_zero_stride(comm):
    import torch

    expanded = torch.ones(1).expand(4)
    strided = np.lib.stride_tricks.as_strided(np.ones(1), shape=(4,), strides=(0,))
    phrase = "with a zero stride"
    return [expanded, strided], [
        (lambda: comm.all_reduce(expanded), ValueError, phrase),
        (lambda: comm.broadcast(expanded, 0), ValueError, "pass x.clone()"),
        (lambda: comm.all_reduce(strided), ValueError, "pass x.copy()"),
        (lambda: comm.broadcast(strided, 0, async_op=True), ValueError, phrase),
        (lambda: comm.reduce(strided), ValueError, phrase),
    ]


def _row_split_range(comm):
    return [], [
        (lambda: comm.split(2**31), ValueError, "color must be at most 2**31 - 1"),
        (lambda: comm.split(2**63), ValueError, "color must be at most 2**31 - 1"),
        (lambda: comm.split(0, 2**31), ValueError, "key must be between -2**31 and 2**31 - 1"),
        (lambda: comm.split(0, -2**31 - 1), ValueError, "key must be between"),
    ]


def _row_nested(comm):
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are a prototype"
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    return [], [
        (lambda: comm.all_reduce(nested), TypeError, "x is a nested torch tensor"),
        (lambda: comm.all_gather(nested), TypeError, "x is a nested torch tensor"),
        (lambda: comm.broadcast(nested, 0), TypeError, "nested"),
    ]


def _row_negative_bit(comm):
    import torch

    negative = torch.ones(3)._neg_view()
    return [negative], [
        (lambda: comm.all_reduce(negative), ValueError, "negative bit set"),
        (lambda: comm.all_gather(negative), ValueError, "x.resolve_neg()"),
    ]


def _row_out_memory(comm):
    import torch

    x = torch.ones(2)
    comm.all_gather(x, out=torch.zeros(comm.size, 2))  # the kind seen: its quick out= check runs first
    negative = torch.zeros(comm.size, 2)._neg_view()
    sparse = torch.zeros(comm.size, 2).to_sparse()
    return [x], [
        (lambda: comm.all_gather(x, out=negative), ValueError, "out is a torch tensor with its negative bit set"),
        (lambda: comm.all_gather(x, out=sparse), TypeError, "out is a torch tensor with layout"),
    ]


def _row_ndarray_subclass(comm):
    masked = np.ma.masked_array(np.arange(3.0), mask=[0, 1, 0])
    matrix = np.asmatrix(np.ones((2, 2)))
    return [], [
        (lambda: comm.broadcast(masked, 0, async_op=True), TypeError, "numpy.ma.MaskedArray"),
        (lambda: comm.all_reduce(masked), TypeError, "subclass of ndarray"),
        (lambda: comm.all_gather(matrix), TypeError, "pass numpy.asarray(x)"),
    ]


def _row_async_op(comm):
    x = np.arange(3.0)
    return [x], [
        (lambda: comm.all_reduce(x, async_op="yes"), TypeError, "async_op must be True or False"),
        (lambda: comm.broadcast(x, 0, async_op=1), TypeError, "async_op must be True or False"),
        (lambda: comm.all_gather(x, async_op=None), TypeError, "async_op must be True or False"),
    ]


SLIPPED_PAST = {
    "zero_stride_in_place": _row_zero_stride,
    "split_color_key_range": _row_split_range,
    "nested_tensor": _row_nested,
    "negative_bit": _row_negative_bit,
    "out_negative_bit_or_sparse": _row_out_memory,
    "ndarray_subclass": _row_ndarray_subclass,
    "async_op_not_bool": _row_async_op,
}

CATALOGUE.update(SLIPPED_PAST)


def _snapshot(x):
    if isinstance(x, np.ndarray):
        return x.copy()
    return x.detach().clone()


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    import torch

    return bool(torch.equal(a.detach(), b))


def catalogue_job(comm, row):
    passed, calls = CATALOGUE[row](comm)
    before = [_snapshot(x) for x in passed]
    outcomes = []
    for thunk, expected, phrase in calls:
        seq = comm.sequence_number
        try:
            thunk()
            outcome = ("no error", "")
        except (TypeError, ValueError) as error:
            inner = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
            outcome = (type(error).__name__, str(error) if inner is None else f"{error} [chained under {inner!r}]")
        moved = comm.sequence_number - seq
        if moved == 1:  # a refused collective takes its number and its check's round (nothing of it sent):
            record = comm._ring[-1]  # the flight recorder says it failed with the error it raised
            moved = 0 if record[SEQ] == comm.sequence_number and record[ERROR].startswith(outcome[0]) else moved
        outcomes.append((outcome, expected.__name__, phrase, moved))
    untouched = [_same(x, b) for x, b in zip(passed, before)]
    # Nothing was half-sent: a real collective right after still agrees on every rank.
    check = comm.all_reduce(np.full(2, comm.rank + 1.0))
    return outcomes, untouched, check.tolist()


def assert_catalogue(results, size):
    """Every rank raised each row's documented error, nothing started, input untouched."""
    expected_sum = sum(range(1, size + 1))
    for rank, (outcomes, untouched, check) in enumerate(results):
        for (kind, message), expected, phrase, seq_moved in outcomes:
            assert kind == expected, f"rank {rank}: {phrase!r}: got {kind}: {message}"
            assert phrase in message, f"rank {rank}: {phrase!r} not in {message!r}"
            assert "[chained under" not in message, f"rank {rank}: an internal error above it: {message}"
            assert seq_moved == 0, f"rank {rank}: the rejected call {phrase!r} was started ({seq_moved})"
        assert all(untouched), f"rank {rank}: an input was modified"
        assert check == [expected_sum] * 2
