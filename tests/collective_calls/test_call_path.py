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


# -- the plans: per-array checks of a remembered kind, and the backends' fast paths -------

def _refused_tensors():
    """Tensors of kinds the checks of an in-place call refuse, with the error's words."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are a prototype", "CSR ... beta"
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
        csr = torch.zeros(2, 2).to_sparse_csr()
    return [
        (torch.zeros(3, requires_grad=True), ValueError, "requires grad"),
        (torch.zeros(3, device="meta"), ValueError, "on device meta"),
        (torch.zeros(3).to_sparse(), TypeError, "layout"),
        (csr, TypeError, "layout"),
        (torch.zeros(3).to_mkldnn(), TypeError, "layout"),
        (nested, TypeError, "nested"),
        (torch.zeros(3)._neg_view(), ValueError, "negative bit"),
        (torch.ones(1).expand(4), ValueError, "zero stride"),
    ]


@pytest.mark.parametrize("case", range(len(_refused_tensors())))
def test_torch_host_view_refuses_what_the_checks_refuse(case):
    """TorchAdapter.host_view starts from x.numpy(): every tensor check_array refuses must
    fail that way too (with our error, not torch's), or the fast path would skip a check."""
    from collectives.arrays import TORCH

    x, error, words = _refused_tensors()[case]
    with pytest.raises(error, match=words):
        TORCH.check_array(x, True)
    with pytest.raises(error, match=words):
        TORCH.host_view(x, True)


def _refused_outs():
    """out= tensors an all_gather of a float32 (2,) tensor into (1, 2) must refuse, with the
    error's words: each names out."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "nested tensors are a prototype"
        nested = torch.nested.nested_tensor([torch.ones(2)])
    return [
        (torch.zeros(1, 2)._neg_view(), ValueError, "out is a torch tensor with its negative bit"),
        (torch.zeros(1, 2, requires_grad=True), ValueError, "out requires grad"),
        (torch.zeros(1, 2, device="meta"), ValueError, "out is a torch tensor on device meta"),
        (torch.zeros(1, 2).to_sparse(), TypeError, "out is a torch tensor with layout"),
        (torch.zeros(1, 2).to_mkldnn(), TypeError, "out is a torch tensor with layout"),
        (nested, TypeError, "out is a nested torch tensor"),
        (torch.zeros(1).expand(1, 2), ValueError, "out is a torch tensor with a zero stride"),
        (torch.zeros(2, 2)[:, :1].t(), ValueError, "out must be contiguous"),
        (torch.zeros(1, 2, dtype=torch.float64), ValueError, "out has dtype"),
        (torch.zeros(2, 2), ValueError, "out has shape"),
    ]


@pytest.mark.parametrize("case", range(len(_refused_outs())))
def test_a_torch_out_is_refused_by_name_on_a_kind_seen_before(case):
    """out= of a tensor kind that passed before (the call path's quick out= check runs first):
    each fault is refused, naming out, with x and out untouched. A negative-bit view (out reads
    minus what is written) was taken, and the result read negated."""
    comm = LocalCommunicator()
    x = torch.ones(2)
    comm.all_gather(x, out=torch.zeros(1, 2))  # the kind, seen
    out, error, words = _refused_outs()[case]
    before = out.to_dense() if out.layout == torch.sparse_coo else None
    with pytest.raises(error, match=words):
        comm.all_gather(x, out=out)
    assert x.tolist() == [1.0, 1.0]
    if before is not None:
        assert torch.equal(out.to_dense(), before)


def test_host_views_of_plain_arrays_are_their_memory():
    from collectives.arrays import CUPY, NUMPY, TORCH, ArrayAdapter

    x = np.zeros((2, 3), np.float32)
    assert NUMPY.host_view(x, True) is x
    assert NUMPY.host_view(x[:, ::2], True) is None  # checked, but no fast path
    frozen = x.copy()
    frozen.flags.writeable = False
    assert NUMPY.host_view(frozen, False) is frozen  # read-only is fine when x is only read
    with pytest.raises(ValueError, match="read-only"):
        NUMPY.host_view(frozen, True)
    t = torch.zeros(2, 3)
    view = TORCH.host_view(t, True)
    assert view.ctypes.data == t.data_ptr() and view.shape == (2, 3)
    assert TORCH.host_view(t.t(), True) is None
    assert TORCH.host_view(torch.zeros(3, dtype=torch.bfloat16), True) is None  # no numpy dtype
    assert type(CUPY).host_view is ArrayAdapter.host_view  # device memory: never a host view


def test_a_zero_stride_on_a_dimension_of_length_one_is_no_overlap():
    """x[None] has stride 0 on its new dimension of length 1; no two elements share memory,
    so in-place collectives take it (they refused it before: "with a zero stride")."""
    comm = LocalCommunicator()
    x = np.arange(3, dtype=np.float32)[None]
    assert 0 in x.strides
    assert comm.all_reduce(x) is x and comm.broadcast(x) is x
    t = torch.arange(3.0).as_strided((1, 3), (0, 1))
    assert comm.all_reduce(t) is t
    np.testing.assert_array_equal(x, [[0, 1, 2]])


def fast_path_job(comm):
    """On a kind seen before (so the backend's fast path is planned): results against numpy,
    the sequence number moves once per call, and a bad array of that kind is still refused
    before anything is sent."""
    out = {}
    n, r = comm.size, comm.rank
    for kind in ("numpy", "torch"):
        wrap = (lambda a: a) if kind == "numpy" else torch.from_numpy
        for attempt in range(3):
            x = wrap(np.arange(4, dtype=np.float32) + r)
            seq = comm.sequence_number
            assert comm.all_reduce(x, "sum") is x
            assert comm.sequence_number == seq + 1
            out[kind, "sum", attempt] = np.asarray(x).copy()
            y = wrap(np.arange(4, dtype=np.float32) + r)
            comm.all_reduce(y, "avg")
            out[kind, "avg", attempt] = np.asarray(y).copy()
            z = wrap(np.full(3, float(r), np.float32))
            assert comm.broadcast(z, n - 1) is z
            out[kind, "bcast", attempt] = np.asarray(z).copy()
        seq = comm.sequence_number
        frozen = np.ones(4, np.float32)
        frozen.flags.writeable = False
        bad = [(frozen, ValueError, "read-only")] if kind == "numpy" else \
            [(t, e, w) for t, e, w in _refused_tensors() if t.dtype == torch.float32
             and t.layout == torch.strided and not t.is_nested]
        for x, error, words in bad:
            for call, args in ((comm.all_reduce, (x,)), (comm.broadcast, (x, 0))):
                with pytest.raises(error, match=words):
                    call(*args)
        with pytest.raises(ValueError, match="out of range"):
            comm.broadcast(wrap(np.zeros(3, np.float32)), n)
        # nothing ran: each refused call took only its number, for its check's round (every rank
        # refused it: no data, see test_refused_calls.py)
        assert comm.sequence_number == seq + 2 * len(bad) + 1
    return out


@pytest.mark.parametrize("timeout", [None, 0])
@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True)
def test_mpi_fast_paths_match_numpy_and_keep_every_check(world, timeout):
    n = world.size
    results = world.run(fast_path_job, [()] * n) if timeout is None else \
        world.run(_with_timeout_zero, [()] * n)
    total = sum(np.arange(4) + r for r in range(n))
    for got in results:
        for (kind, what, attempt), value in got.items():
            want = {"sum": total, "avg": total / n, "bcast": np.full(3, n - 1)}[what]
            np.testing.assert_array_equal(value, want, err_msg=f"{kind} {what} {attempt}")


def _with_timeout_zero(comm):
    """fast_path_job on a split of the pool's communicator with blocking MPI calls."""
    sub = comm.split(0)
    sub.timeout = None
    try:
        return fast_path_job(sub)
    finally:
        sub.close()


def test_empty_arrays_with_zero_strides_are_no_overlap():
    comm = LocalCommunicator()
    for x in (torch.empty(2, 0).as_strided((2, 0), (0, 0)),
              np.lib.stride_tricks.as_strided(np.empty(0, np.float32), (2, 0), (0, 0))):
        assert comm.all_reduce(x) is x


def first_call_job(comm):
    """On a new communicator, whose plans are empty: the general route refuses, so only the
    backend's fast path can run the first all_reduce and broadcast of a kind."""
    sub = comm.split(0)
    try:
        def general_route(*args):
            raise AssertionError("the general route ran a call the fast path takes")
        sub._transport._all_reduce = sub._transport._broadcast = general_route
        x = np.arange(4, dtype=np.float32) + sub.rank
        sub.all_reduce(x)
        y = np.full(3, float(sub.rank), np.float32)
        sub.broadcast(y, 0)
        return x, y
    finally:
        sub.close()


@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True)
def test_the_first_call_of_a_kind_runs_the_same_route_as_the_later_ones(world):
    n = world.size
    for x, y in world.run(first_call_job, [()] * n):
        np.testing.assert_array_equal(x, sum(np.arange(4) + r for r in range(n)))
        np.testing.assert_array_equal(y, np.zeros(3))


def test_the_request_record_keeps_no_array_alive_and_async_handles_keep_their_own():
    """A communicator refills one request record per kind of call (collectives.calls.Request):
    once a call returned, the record holds neither x nor out, so a dropped array is freed; and a
    handle of an earlier asynchronous call of the same kind still returns its own result."""
    import gc
    import weakref

    comm = LocalCommunicator()
    x, out = np.arange(4.0), np.empty((1, 4))
    refs = [weakref.ref(x), weakref.ref(out)]
    comm.all_gather(x, out=out)
    del x, out
    gc.collect()
    assert [ref() for ref in refs] == [None, None]
    first = comm.all_gather(np.arange(4.0), async_op=True)
    second = comm.all_gather(np.arange(4.0) + 10, async_op=True)
    assert np.array_equal(first.wait(), [np.arange(4.0)])
    assert np.array_equal(second.wait(), [np.arange(4.0) + 10])
    comm.close()


def _expected_out_shape(row, checks, shape):
    """The shape of an out= that row ``row`` takes for an x of ``shape``: the result's, and for
    the uneven rows x's trailing shape with a number of rows other than x's (their rows are
    checked once the counts have travelled, so the check at once takes any)."""
    if row.out_shape is None:
        return (shape[0] + 1, *shape[1:])
    return row.out_shape(checks, shape, None)


def _numpy_outs(x, expected):
    """numpy out= arrays for x whose result has shape ``expected``: the one that fits, then each
    fault check_out names (and a subclass, which only check_out takes)."""
    good = np.zeros(expected, x.dtype)
    frozen = good.copy()
    frozen.flags.writeable = False
    wider = expected[:-1] + (expected[-1] + 1,) if expected else (1,)
    return [good, good.astype(np.float64), frozen, np.zeros(wider, x.dtype), np.zeros(wider, x.dtype)[..., :-1],
            np.zeros(expected + (1,), x.dtype), good.view(np.matrix) if good.ndim == 2 else good.view(np.recarray),
            np.zeros(expected + (2,), x.dtype)[..., 0]]  # (strided where it has a dimension)


@pytest.mark.parametrize("form", ["python", "compiled"])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_quick_numpy_out_check_accepts_only_what_check_out_accepts(form, size):
    """The call path's check of a numpy out= at once (host_views.out_fits, by the row's shape
    rule) says yes only where ArgumentChecks.check_out passes, and says yes to the out= of the
    result's own shape, for every row with one, in both forms (the compiled twin is what a compiled
    call path runs)."""
    from collectives import calls, config, host_views
    from collectives.arrays import NUMPY
    from collectives.checks import _OUT_FORMS, ArgumentChecks, _out_form

    module = host_views if form == "python" else config.compiled_extension("collectives._host_views_c", host_views)
    if module is None:
        pytest.skip("collectives._host_views_c was not built")
    checks = ArgumentChecks(LocalCommunicator()._transport, size)
    rows = [calls.ALL_GATHER, calls.GATHER, calls.REDUCE_SCATTER, calls.SCATTER, calls.ALL_TO_ALL,
            calls.ALL_GATHER_V, calls.ALL_TO_ALL_V]
    assert {row.out_shape for row in rows} == set(_OUT_FORMS) | {None}
    tried = 0
    for row in rows:
        for x in (np.ones((size * 2, 3), np.float32), np.ones((size,), np.int64), np.ones((size, 2, 1), np.float32),
                  np.ones((size * 2, 6), np.float32)[:, ::2]):  # (x's shape read from a strided x too)
            expected = _expected_out_shape(row, checks, x.shape)
            for i, out in enumerate(_numpy_outs(x, expected)):
                fits = module.out_fits(out, x, _out_form(row, NUMPY), size)
                try:
                    checks.check_out(row, x, NUMPY, out, None, 0)
                    accepted = True
                except (TypeError, ValueError):
                    accepted = False
                assert not fits or accepted, (row.name, x.shape, i, out.shape)
                if i == 0:
                    assert fits and accepted, (row.name, x.shape)
                tried += 1
    assert tried == 7 * 4 * 8


def _tensor_outs(x, expected):
    """Tensor out= for the tensor x whose result has shape ``expected``: the one that fits, then
    each fault check_out names (and a Parameter, a subclass only check_out takes)."""
    good = torch.zeros(expected, dtype=x.dtype)
    wider = expected[:-1] + (expected[-1] + 1,) if expected else (1,)
    grad_dtype = x.dtype if x.is_floating_point() else torch.float32  # (only floats require grad)
    outs = [good, good.double(), torch.zeros(expected, dtype=grad_dtype, requires_grad=True),
            torch.zeros(expected, dtype=x.dtype)._neg_view(), torch.zeros(wider, dtype=x.dtype),
            torch.zeros(wider, dtype=x.dtype)[..., :-1], torch.zeros(expected + (1,), dtype=x.dtype),
            torch.empty(expected, dtype=x.dtype, device="meta"), torch.nn.Parameter(good.clone(), requires_grad=False),
            torch.zeros(expected + (2,), dtype=x.dtype)[..., 0]]  # (strided where it has a dimension)
    if len(expected) == 2:
        outs.append(good.to_sparse())  # (another layout)
    return outs


@pytest.mark.parametrize("form", ["python", "compiled"])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_the_quick_tensor_out_check_accepts_only_what_check_out_accepts(form, size):
    """The call path's check of a tensor out= at once (host_views.out_fits with the TENSOR bit)
    says yes exactly where ArgumentChecks.check_out passes (but for a subclass: check_out alone),
    for every row with one, in both forms; the plans of tensors take that bit."""
    from collectives import calls, config, host_views
    from collectives.arrays import TORCH
    from collectives.checks import _OUT_FORMS, ArgumentChecks, _out_form

    module = host_views if form == "python" else config.compiled_extension("collectives._host_views_c", host_views)
    if module is None:
        pytest.skip("collectives._host_views_c was not built")
    checks = ArgumentChecks(LocalCommunicator()._transport, size)
    rows = [calls.ALL_GATHER, calls.GATHER, calls.REDUCE_SCATTER, calls.SCATTER, calls.ALL_TO_ALL,
            calls.ALL_GATHER_V, calls.ALL_TO_ALL_V]
    tried = 0
    for row in rows:
        form_of_row = _out_form(row, TORCH)
        assert form_of_row == _OUT_FORMS.get(row.out_shape, host_views.ROWS_LATER) | host_views.TENSOR
        for x in (torch.ones((size * 2, 3)), torch.ones((size,), dtype=torch.int64), torch.ones((size, 2, 1)),
                  torch.ones((size * 2, 6))[:, ::2]):  # (x's shape read from a strided x too)
            expected = _expected_out_shape(row, checks, tuple(x.shape))
            for i, out in enumerate(_tensor_outs(x, expected)):
                fits = module.out_fits(out, x, form_of_row, size)
                try:
                    checks.check_out(row, x, TORCH, out, None, 0)
                    accepted = True
                except (TypeError, ValueError):
                    accepted = False
                assert not fits or accepted, (row.name, tuple(x.shape), i, tuple(out.shape))
                if i == 0:
                    assert fits and accepted, (row.name, tuple(x.shape))
                elif i != 8:  # (the same verdict, but on a subclass, which only check_out takes)
                    assert fits == accepted, (row.name, tuple(x.shape), i)
                tried += 1
    assert tried > 7 * 4 * 10  # (and a sparse out= where the result has two dimensions)
    assert _out_form(calls.ALL_REDUCE, TORCH) == 0 and _out_form(calls.BROADCAST, TORCH) == 0
