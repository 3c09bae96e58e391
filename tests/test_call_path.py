"""The optimized call path: argument checks remembered per kind of array, and the backends'
fast paths for contiguous arrays, give the same results and the same errors as before.

The reference for every result is numpy in float64 (or exact integer arithmetic) on the
inputs of every rank, computed here in the test process.
"""

import numpy as np
import pytest
import torch
from collectives.backends.local import LocalCommunicator

from collectives.ops import ALLOWED_OPS

# dtype -> numpy dtype for the inputs, float16 included (MPI reduces it natively or in float32).
NUMPY_DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"]


def _inputs(dtype, rank, shape):
    rng = np.random.default_rng(1000 + rank)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    if dtype.startswith(("int", "uint")):
        return rng.integers(0, 5, shape).astype(dtype)
    return rng.integers(-4, 5, shape).astype(dtype)  # small integers: sums are exact


def _reference(op, arrays):
    stack = np.stack(arrays)
    if op == "sum":
        return stack.sum(axis=0, dtype=stack.dtype)
    if op == "prod":
        return stack.prod(axis=0, dtype=stack.dtype)
    if op == "min":
        return stack.min(axis=0)
    if op == "max":
        return stack.max(axis=0)
    if op == "avg":
        return (stack.astype(np.float64).sum(axis=0) / len(arrays)).astype(stack.dtype)
    fn = {"band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
    return fn.reduce(stack, axis=0)


def _cases():
    for dtype in NUMPY_DTYPES:
        for op in sorted(o.value for o in ALLOWED_OPS[dtype]):
            yield dtype, op


def _shape(layout, n):
    return (6 * n,) if layout == "flat" else (2 * n, 3)


def every_collective_job(comm, dtype, layout, as_torch):
    """All four collectives on each (dtype, op), twice (the second call hits the caches)."""
    out = {}
    n = comm.size
    for ldtype, op in _cases():
        if ldtype != dtype:
            continue
        for attempt in range(2):
            base = _inputs(dtype, comm.rank, _shape(layout, n))
            x = np.asfortranarray(base) if layout == "F" else base.copy()
            if layout == "strided":
                x = np.repeat(base, 2, axis=-1)[..., ::2]
            x_in = torch.from_numpy(x) if as_torch else x
            comm.all_reduce(x_in, op)
            out[("all_reduce", op, attempt)] = np.asarray(x_in).copy()
            rs = comm.reduce_scatter(torch.from_numpy(base.copy()) if as_torch else base.copy(), op)
            out[("reduce_scatter", op, attempt)] = np.asarray(rs).copy()
        y = _inputs(dtype, comm.rank, _shape(layout, n))
        y = np.asfortranarray(y) if layout == "F" else y
        y_in = torch.from_numpy(y) if as_torch else y
        comm.broadcast(y_in, src=n - 1)
        out[("broadcast",)] = np.asarray(y_in).copy()
        z = _inputs(dtype, comm.rank, _shape(layout, n))
        z = np.asfortranarray(z) if layout == "F" else z
        g = comm.all_gather(torch.from_numpy(z) if as_torch else z)
        out[("all_gather",)] = np.asarray(g).copy()
    return out


def _check_every_collective(world, dtype, layout, as_torch):
    n = world.size
    results = world.run(every_collective_job, [(dtype, layout, as_torch)] * n)
    inputs = [_inputs(dtype, r, _shape(layout, n)) for r in range(n)]
    rows = _shape(layout, n)[0] // n
    for rank, got in enumerate(results):
        for (name, *rest), value in got.items():
            if name == "all_reduce":
                want = _reference(rest[0], inputs)
            elif name == "reduce_scatter":
                want = _reference(rest[0], inputs)[rows * rank:rows * (rank + 1)]
            elif name == "broadcast":
                want = inputs[n - 1]
            else:
                want = np.stack(inputs)
            np.testing.assert_array_equal(value, want, err_msg=f"{name} {rest} {dtype} rank {rank}")


@pytest.mark.parametrize("layout", ["C", "F", "strided", "flat"])
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True)
def test_mpi_numpy_collectives_match_numpy_on_every_layout(world, dtype, layout):
    _check_every_collective(world, dtype, layout, as_torch=False)


@pytest.mark.parametrize("layout", ["C", "flat"])
@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_torch_tensor_collectives_match_numpy(world, dtype, layout):
    _check_every_collective(world, dtype, layout, as_torch=True)


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_torch_non_contiguous_tensors_match_numpy(world):
    _check_every_collective(world, "float32", "strided", as_torch=True)


def bfloat16_job(comm):
    x = torch.arange(6, dtype=torch.bfloat16) + comm.rank
    comm.all_reduce(x, "sum")
    comm.all_reduce(x, "avg")
    y = torch.full((4,), float(comm.rank), dtype=torch.bfloat16)
    comm.broadcast(y, src=1)
    return x.float().numpy(), y.float().numpy()


@pytest.mark.parametrize("world", [("mpi", 2), ("torch", 2)], indirect=True)
def test_bfloat16_tensors_reduce_and_broadcast(world):
    for x, y in world.run(bfloat16_job, [()] * 2):
        np.testing.assert_array_equal(x, 2 * np.arange(6) + 1)  # avg of equal arrays: the sum
        np.testing.assert_array_equal(y, np.ones(4))


# -- the remembered checks still raise, in the same order, in one process ---------------

def test_a_kind_seen_before_still_gets_every_per_array_check():
    comm = LocalCommunicator()
    x = np.zeros(3, np.float32)
    comm.all_reduce(x, "sum")  # remembered: numpy float32 with "sum"
    frozen = np.zeros(3, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(frozen, "sum")
    with pytest.raises(ValueError, match="read-only"):
        comm.broadcast(frozen)
    assert not frozen.any()
    t = torch.zeros(3, requires_grad=True)
    comm.all_reduce(torch.zeros(3))
    with pytest.raises(ValueError, match="requires grad"):
        comm.all_reduce(t)
    for call in (comm.all_reduce, comm.broadcast, comm.all_gather, comm.reduce_scatter):
        call(torch.zeros(2))  # remembered: CPU float32 tensors, for every collective
        with pytest.raises(ValueError, match="on device meta"):
            call(torch.empty(2, device="meta"))  # same type and dtype, other memory
    with pytest.raises(TypeError, match="not allowed on dtype float32"):
        comm.all_reduce(x, "band")
    with pytest.raises(ValueError, match="not a reduce op"):
        comm.all_reduce(x, ["sum"])  # unhashable: never remembered, still checked
    with pytest.raises(ValueError, match="out of range"):
        comm.broadcast(x, src=1)
    with pytest.raises(TypeError, match="src must be an int"):
        comm.broadcast(x, src=True)
    assert comm.broadcast(x, src=np.int64(0)) is x
    comm.close()
    for call in (lambda: comm.all_reduce(x, "sum"), lambda: comm.broadcast(x),
                 lambda: comm.all_gather(x), lambda: comm.reduce_scatter(x)):
        with pytest.raises(ValueError, match="closed"):
            call()


def test_errors_keep_their_order_on_a_remembered_kind():
    comm = LocalCommunicator()
    x = np.zeros(2, np.int32)
    comm.all_reduce(x, "band")
    frozen = np.zeros(2, np.int32)
    frozen.flags.writeable = False
    # read-only is reported before a disallowed op, as on a kind never seen
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(frozen, "avg")
    with pytest.raises(TypeError, match="not supported"):
        comm.all_reduce([1, 2], "sum")
    with pytest.raises(TypeError, match="dtype >f4"):
        comm.all_reduce(np.zeros(2, ">f4"), "sum")
