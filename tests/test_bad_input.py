"""Bad input that used to slip past the checks (issue 15, item 5b), on every backend.

Same contract as the catalogue of tests/test_reliability.py: every rank passes the same
bad call, each raises the documented TypeError/ValueError before anything is sent (the
sequence number did not move), the input is untouched, and a real all_reduce right after
still agrees. Before the checks these ran the collective and then failed (torch's
RuntimeError on a zero-stride write-back, OverflowError after split's barrier, internal
errors on nested tensors), returned a wrong result (negative bit: -1 instead of -2), or
moved the sequence number (masked arrays to async broadcast on mpi).
"""

from __future__ import annotations

import numpy as np
import pytest
from test_reliability import BACKENDS, CATALOGUE, assert_catalogue, catalogue_job


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


ROWS = {
    "zero_stride_in_place": _row_zero_stride,
    "split_color_key_range": _row_split_range,
    "nested_tensor": _row_nested,
    "negative_bit": _row_negative_bit,
    "ndarray_subclass": _row_ndarray_subclass,
    "async_op_not_bool": _row_async_op,
}


# The rows join the catalogue (on the ranks too: they import this module for the job).
CATALOGUE.update(ROWS)


def bad_input_job(comm, row):
    return catalogue_job(comm, row)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row", list(ROWS))
@pytest.mark.parametrize("world", BACKENDS, indirect=True, ids=[b for b, _ in BACKENDS])
def test_bad_input_that_slipped_past_raises_before_sending(world, row):
    assert_catalogue(world.run(bad_input_job, args=(row,), timeout=30), world.size)


def test_read_only_inputs_may_have_zero_strides():
    """all_gather only reads x: an expanded tensor or a stride-0 view is fine there."""
    import torch

    import collectives

    comm = collectives.init("local")
    expanded = torch.arange(1.0, 2.0).expand(3)
    assert comm.all_gather(expanded).tolist() == [[1.0, 1.0, 1.0]]
    strided = np.lib.stride_tricks.as_strided(np.array([2.0]), shape=(3,), strides=(0,))
    assert comm.all_gather(strided).tolist() == [[2.0, 2.0, 2.0]]


def mismatched_broadcast_job(comm):
    from collectives import CollectiveError

    sub = comm.split(0)  # whatever the failure leaves behind, the pool's communicator is spared
    x = np.zeros(4 if comm.rank == 0 else 2, dtype=np.float64)
    try:
        sub.broadcast(x, 0)
    except CollectiveError as error:
        return "CollectiveError", str(error)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__module__}.{type(error).__name__}", str(error)
    return "no error", ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True)
def test_a_transport_exception_becomes_collective_error(world):
    """A broadcast whose sizes differ (no debug mode): MPI_ERR_TRUNCATE on the receiver,
    which used to surface as a raw mpi4py.MPI.Exception."""
    results = world.run(mismatched_broadcast_job, [()] * 2, timeout=30)
    receiver_kind, receiver_message = results[1]
    assert receiver_kind == "CollectiveError", results
    assert "broadcast (call #" in receiver_message and "failed in the mpi transport" in receiver_message
