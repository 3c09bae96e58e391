"""Every collective x every dtype of the table x every op x backends local/torch/mpi x world
sizes 1-4, on real ranks, checked against numpy computed from the same per-rank inputs;
the collectives that return an array take out= and async_op=True in turn, and uneven
all_to_all / all_gather_v include zero-length pieces and a rank that sends nothing. Also
point-to-point rings and pairs (both wait orders) and debug-mode recv mismatches. More of
the collective set (all-pairs exchanges, bad arguments, reordered splits) is in
tests/collective_calls/test_collective_set.py."""

from __future__ import annotations

import numpy as np
import pytest
from grid import SHAPE, allowed_pairs, disallowed_pairs, dtypes_for, make_input, tolerance

from collectives.ops import ReduceOp
from collectives.testing import worlds
from collectives.testing.reference import as_array, carrier_dtype, reference_reduce, to_numpy

WORLDS = worlds((1, 2, 3, 4))
KINDS = ["torch", "numpy"]
SEED = 20261202


def world_id(param):
    return f"{param[0]}-{param[1]}"


# -- jobs (run on every rank) -----------------------------------------------------------------

def all_reduce_job(comm, kind, cases):
    """cases: [(dtype, op, values)] -> [(result as numpy, raw bytes)] or the error raised."""
    out = []
    for dtype, op, values in cases:
        x = as_array(values, dtype, kind)
        before = to_numpy(x)
        try:
            returned = comm.all_reduce(x, op)
        except (TypeError, ValueError) as error:
            out.append(("error", type(error).__name__, str(error),
                        np.array_equal(before, to_numpy(x))))
            continue
        assert returned is x, "all_reduce must return its input"
        out.append(("ok", to_numpy(x)))
    return out


def broadcast_job(comm, kind, cases):
    out = []
    for dtype, src, values in cases:
        x = as_array(values, dtype, kind)
        assert comm.broadcast(x, src=src) is x
        out.append(to_numpy(x))
    return out


def _flags(index):
    """(out=, async_op) for case ``index``: every combination, in turn."""
    return index % 2 == 1, index % 4 >= 2


def _zeros_like(x, shape):
    if isinstance(x, np.ndarray):
        return np.zeros(shape, dtype=x.dtype)
    import torch  # noqa: PLC0415

    return torch.zeros(shape, dtype=x.dtype)


def all_gather_job(comm, kind, cases):
    out = []
    for index, (dtype, values) in enumerate(cases):
        x = as_array(values, dtype, kind)
        before = to_numpy(x)
        use_out, async_op = _flags(index)
        given = _zeros_like(x, (comm.size, *x.shape)) if use_out else None
        gathered = comm.all_gather(x, out=given, async_op=async_op)
        if async_op:
            gathered = gathered.wait()
        assert given is None or gathered is given, "all_gather with out= returns out"
        assert type(gathered) is type(x) and gathered.dtype == x.dtype, (type(gathered), gathered.dtype)
        assert np.array_equal(before, to_numpy(x)), "all_gather modified its input"
        out.append(to_numpy(gathered))
    return out


def reduce_scatter_job(comm, kind, cases):
    out = []
    for index, (dtype, op, values) in enumerate(cases):
        x = as_array(values, dtype, kind)
        use_out, async_op = _flags(index)
        given = _zeros_like(x, (x.shape[0] // comm.size, *x.shape[1:])) \
            if use_out and x.ndim and x.shape[0] % comm.size == 0 else None
        try:
            result = comm.reduce_scatter(x, op, out=given, async_op=async_op)
        except (TypeError, ValueError) as error:
            out.append(("error", type(error).__name__, str(error)))
            continue
        if async_op:
            result = result.wait()
        assert given is None or result is given, "reduce_scatter with out= returns out"
        assert type(result) is type(x) and result.dtype == x.dtype
        out.append(("ok", to_numpy(result)))
    return out


# -- checks in the test process --------------------------------------------------------------

def assert_reduced(results, inputs, dtype, op, where):
    ref = reference_reduce(inputs, dtype, op)
    tol = tolerance(inputs, dtype, op, ref)
    first = results[0]
    for rank, got in enumerate(results):
        assert got.shape == ref.shape, where
        assert got.tobytes() == first.tobytes(), f"{where}: rank {rank} differs from rank 0"
    got = first.astype(np.float64) if tol.any() else first
    if tol.any():
        assert np.all(np.abs(got - ref) <= tol), (
            f"{where}: max error {np.max(np.abs(got - ref))} above bound {tol.max()}")
    else:
        np.testing.assert_array_equal(got, ref.astype(got.dtype), err_msg=where)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_all_reduce_matches_numpy_for_every_allowed_pair(world, kind):
    pairs = [(d, op) for d, op in allowed_pairs() if d in dtypes_for(kind)]
    per_rank = [(kind, [(d, op, make_input(SEED, r, d, op)) for d, op in pairs])
                for r in range(world.size)]
    results = world.run(all_reduce_job, per_rank)
    for index, (dtype, op) in enumerate(pairs):
        replies = [results[r][index] for r in range(world.size)]
        assert all(reply[0] == "ok" for reply in replies), (dtype, op, replies[0])
        inputs = [per_rank[r][1][index][2] for r in range(world.size)]
        assert_reduced([reply[1] for reply in replies], inputs, dtype, op,
                       f"{world.backend}/{world.size} {kind} {dtype} {op}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_disallowed_pairs_raise_type_error_on_every_rank_and_leave_input(world, kind):
    pairs = [(d, op) for d, op in disallowed_pairs() if d in dtypes_for(kind)]
    per_rank = [(kind, [(d, op, make_input(SEED, r, d, None)) for d, op in pairs])
                for r in range(world.size)]
    results = world.run(all_reduce_job, per_rank)
    for index, (dtype, op) in enumerate(pairs):
        for rank in range(world.size):
            status, type_name, message, untouched = results[rank][index]
            assert (status, type_name) == ("error", "TypeError"), (dtype, op, rank)
            assert dtype in message and op.name in message, message
            assert untouched, f"{dtype} {op}: input modified on rank {rank}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_broadcast_from_every_root_copies_the_roots_bytes(world, kind):
    cases = [(d, src) for d in dtypes_for(kind) for src in range(world.size)]
    per_rank = [(kind, [(d, src, make_input(SEED + src, r, d, None)) for d, src in cases])
                for r in range(world.size)]
    results = world.run(broadcast_job, per_rank)
    for index, (dtype, src) in enumerate(cases):
        expected = per_rank[src][1][index][2].astype(carrier_dtype(dtype))
        for rank in range(world.size):
            assert results[rank][index].tobytes() == expected.tobytes(), (dtype, src, rank)


def all_gather_1d_job(comm, cases):
    import torch  # noqa: PLC0415

    out = []
    for _, values in cases:
        x = torch.from_numpy(values.copy())
        gathered = comm.all_gather(x)
        assert type(gathered) is torch.Tensor and gathered.dtype == x.dtype and gathered.shape == (comm.size, x.numel())
        assert np.array_equal(x.numpy(), values), "all_gather modified its input"
        out.append(gathered.numpy().copy())
    return out


@pytest.mark.parametrize("world", [("torch", 2), ("torch", 3)], indirect=True, ids=world_id)
def test_torch_all_gather_of_1d_tensors_stacks_rows_in_rank_order(world):
    # SyncBatchNorm's call (a 1-d tensor, no out=, blocking): the torch backend's direct path
    dtypes = ["int8", "uint8", "int32", "int64", "float16", "float32", "float64"]
    per_rank = [([(d, make_input(SEED, r, d, None, shape=(7,))) for d in dtypes],) for r in range(world.size)]
    results = world.run(all_gather_1d_job, per_rank)
    for index, dtype in enumerate(dtypes):
        expected = np.stack([per_rank[r][0][index][1] for r in range(world.size)])
        for rank in range(world.size):
            assert results[rank][index].tobytes() == expected.tobytes(), (dtype, rank)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_all_gather_stacks_every_ranks_input_in_rank_order(world, kind):
    dtypes = dtypes_for(kind)
    per_rank = [(kind, [(d, make_input(SEED, r, d, None)) for d in dtypes]) for r in range(world.size)]
    results = world.run(all_gather_job, per_rank)
    for index, dtype in enumerate(dtypes):
        expected = np.stack([per_rank[r][1][index][1] for r in range(world.size)]).astype(carrier_dtype(dtype))
        for rank in range(world.size):
            assert results[rank][index].shape == (world.size, *SHAPE)
            assert results[rank][index].tobytes() == expected.tobytes(), (dtype, rank)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_reduce_scatter_returns_this_ranks_rows_of_the_reduction(world, kind):
    rows = 2 * world.size
    pairs = [(d, op) for d, op in allowed_pairs() if d in dtypes_for(kind)]
    shape = (rows, 3)
    per_rank = [(kind, [(d, op, make_input(SEED, r, d, op, shape)) for d, op in pairs])
                for r in range(world.size)]
    results = world.run(reduce_scatter_job, per_rank)
    for index, (dtype, op) in enumerate(pairs):
        inputs = [per_rank[r][1][index][2] for r in range(world.size)]
        for rank in range(world.size):
            status, got = results[rank][index]
            assert status == "ok", (dtype, op, got)
            block = slice(2 * rank, 2 * rank + 2)
            assert_reduced([got], [x[block] for x in inputs], dtype, op,
                           f"{world.backend}/{world.size} {kind} {dtype} {op} rank {rank}")


@pytest.mark.parametrize("world", [("local", 1), ("mpi", 3), ("torch", 3)], indirect=True, ids=world_id)
def test_reduce_scatter_refuses_disallowed_pairs_and_indivisible_rows(world):
    per_rank = [("torch", [("float32", ReduceOp.BXOR, np.ones((3, 2), np.float32)),
                           ("int32", ReduceOp.SUM, np.ones((3 * world.size + 1, 2), np.int32))])
                for _ in range(world.size)]
    results = world.run(reduce_scatter_job, per_rank)
    for rank in range(world.size):
        assert results[rank][0][:2] == ("error", "TypeError")
        if world.size > 1:
            assert results[rank][1][:2] == ("error", "ValueError")
            assert "divisible" in results[rank][1][2]


# -- the rest of the collective set: reduce, gather, scatter, all_to_all, all_gather_v ---------
# One job per (world, array kind) and collective runs every case; cases alternate
# async_op=False/True, and some pass out= (of the right shape: it must be returned).

def new_collectives_job(comm, kind, cases):
    """cases: [(collective, dtype, kwargs, values, async_op, out_shape or None)] ->
    [(result as numpy (or (numpy, counts), or None), input untouched, result kind right)]."""
    out = []
    for collective, dtype, kwargs, values, async_op, out_shape in cases:
        x = as_array(values, dtype, kind)
        before = to_numpy(x)
        given = None
        if out_shape is not None:
            given = as_array(np.zeros(out_shape, carrier_dtype(dtype)), dtype, kind)
            kwargs = {**kwargs, "out": given}
        result = getattr(comm, collective)(x, **kwargs, async_op=async_op)
        if async_op:
            result = result.wait()
        counts = None
        if collective == "all_gather_v":
            result, counts = result
        if given is not None and result is not None:
            assert result is given, f"{collective} with out= must return out"
        kind_right = result is None or (type(result) is type(x) and result.dtype == x.dtype)
        got = None if result is None else to_numpy(result)
        out.append(((got, counts) if counts is not None else got,
                    np.array_equal(before, to_numpy(x), equal_nan=before.dtype.kind == "f"),
                    kind_right))
    return out


def _run_cases(world, kind, make_cases):
    """per_rank cases from ``make_cases(rank) -> [(collective, dtype, kwargs, values, out_shape)]``;
    returns (per-rank cases, per-rank results)."""
    per_rank = []
    for rank in range(world.size):
        cases = [(c, d, kw, v, i % 2 == 1, o) for i, (c, d, kw, v, o) in enumerate(make_cases(rank))]
        per_rank.append((kind, cases))
    results = world.run(new_collectives_job, per_rank)
    for rank in range(world.size):
        for index, (_, _, kind_right) in enumerate(results[rank]):
            case = per_rank[rank][1][index]
            assert kind_right, f"{case[0]} {case[1]}: result has another type or dtype (rank {rank})"
    return per_rank, results


def _bytes_of(values, dtype):
    return np.asarray(values).astype(carrier_dtype(dtype)).tobytes()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_reduce_lands_on_dst_and_leaves_the_others_untouched(world, kind):
    pairs = [(d, op) for d, op in allowed_pairs() if d in dtypes_for(kind)]
    per_rank, results = _run_cases(world, kind, lambda r: [
        ("reduce", d, {"op": op, "dst": i % world.size}, make_input(SEED, r, d, op), None)
        for i, (d, op) in enumerate(pairs)])
    for index, (dtype, op) in enumerate(pairs):
        dst = index % world.size
        inputs = [per_rank[r][1][index][3] for r in range(world.size)]
        where = f"{world.backend}/{world.size} {kind} reduce {dtype} {op} dst={dst}"
        assert_reduced([results[dst][index][0]], inputs, dtype, op, where)
        for rank in range(world.size):
            if rank != dst:
                assert results[rank][index][0].tobytes() == _bytes_of(inputs[rank], dtype), \
                    f"{where}: x changed on rank {rank}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_gather_stacks_on_dst_only(world, kind):
    dtypes = dtypes_for(kind)
    n = world.size
    per_rank, results = _run_cases(world, kind, lambda r: [
        ("gather", d, {"dst": i % n}, make_input(SEED, r, d, None),
         (n, *SHAPE) if i % 3 == 0 and r == i % n else None) for i, d in enumerate(dtypes)])
    for index, dtype in enumerate(dtypes):
        dst = index % n
        expected = np.stack([per_rank[r][1][index][3] for r in range(n)])
        for rank in range(n):
            got, untouched, _ = results[rank][index]
            assert untouched, (dtype, rank)
            if rank == dst:
                assert got.shape == (n, *SHAPE) and got.tobytes() == _bytes_of(expected, dtype), (dtype, dst)
            else:
                assert got is None, (dtype, rank)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_scatter_hands_row_rank_of_src(world, kind):
    dtypes = dtypes_for(kind)
    n = world.size
    per_rank, results = _run_cases(world, kind, lambda r: [
        ("scatter", d, {"src": i % n}, make_input(SEED, r, d, None, (n, 2, 3)),
         (2, 3) if i % 3 == 0 else None) for i, d in enumerate(dtypes)])
    for index, dtype in enumerate(dtypes):
        src_x = per_rank[index % n][1][index][3]
        for rank in range(n):
            got, untouched, _ = results[rank][index]
            assert untouched and got.tobytes() == _bytes_of(src_x[rank], dtype), (dtype, rank)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_all_to_all_equal_transposes_rows(world, kind):
    dtypes = dtypes_for(kind)
    n = world.size
    per_rank, results = _run_cases(world, kind, lambda r: [
        ("all_to_all", d, {}, make_input(SEED, r, d, None, (n, 3)), (n, 3) if i % 3 == 0 else None)
        for i, d in enumerate(dtypes)])
    for index, dtype in enumerate(dtypes):
        for rank in range(n):
            got, untouched, _ = results[rank][index]
            expected = np.stack([per_rank[j][1][index][3][rank] for j in range(n)])
            assert untouched and got.tobytes() == _bytes_of(expected, dtype), (dtype, rank)


def splits_matrix(n, variant):
    """splits[i][j]: rows rank i sends to rank j; zero-length pieces, and (n > 1) the last
    rank sends nothing."""
    matrix = [[(i * n + j + i + variant) % 3 for j in range(n)] for i in range(n)]
    if n > 1:
        matrix[n - 1] = [0] * n
    return matrix


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_all_to_all_with_splits_concatenates_what_every_rank_sent_here(world, kind):
    dtypes = dtypes_for(kind)
    n = world.size

    def cases(r):
        out = []
        for i, d in enumerate(dtypes):
            splits = splits_matrix(n, i)
            received = sum(splits[j][r] for j in range(n))
            out.append(("all_to_all", d, {"send_splits": splits[r]},
                        make_input(SEED, r, d, None, (sum(splits[r]), 2)),
                        (received, 2) if i % 3 == 0 else None))
        return out

    per_rank, results = _run_cases(world, kind, cases)
    for index, dtype in enumerate(dtypes):
        splits = splits_matrix(n, index)
        for rank in range(n):
            pieces = []
            for sender in range(n):
                start = sum(splits[sender][:rank])
                pieces.append(per_rank[sender][1][index][3][start:start + splits[sender][rank]])
            got, untouched, _ = results[rank][index]
            expected = np.concatenate(pieces)
            assert untouched and got.shape == expected.shape, (dtype, rank, got.shape)
            assert got.tobytes() == _bytes_of(expected, dtype), (dtype, rank)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_all_gather_v_concatenates_uneven_rows_in_rank_order(world, kind):
    dtypes = dtypes_for(kind)
    n = world.size
    counts_of = [[(3 * r + i) % 4 for r in range(n)] for i in range(len(dtypes))]
    for counts in counts_of:
        if n > 1:
            counts[0] = 0  # a rank that contributes nothing
    per_rank, results = _run_cases(world, kind, lambda r: [
        ("all_gather_v", d, {}, make_input(SEED, r, d, None, (counts_of[i][r], 3)),
         (sum(counts_of[i]), 3) if i % 3 == 0 else None) for i, d in enumerate(dtypes)])
    for index, dtype in enumerate(dtypes):
        expected = np.concatenate([per_rank[r][1][index][3] for r in range(n)])
        first = results[0][index][0][0].tobytes()
        for rank in range(n):
            (got, counts), untouched, _ = results[rank][index]
            assert counts == counts_of[index] and untouched, (dtype, rank, counts)
            assert got.tobytes() == _bytes_of(expected, dtype) == first, (dtype, rank)


# -- out= of the wrong shape and bad arguments: errors on every rank, nothing sent ------------

def bad_call_job(comm, kind, cases):
    """cases: [(collective, x shape, kwargs, out shape or None)] -> [(error type, message,
    input untouched)]; then one all_reduce proves the ranks are still in step."""
    out = []
    for collective, shape, kwargs, out_shape in cases:
        x = as_array(np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape), "float32", kind)
        before = to_numpy(x)
        if out_shape is not None:
            out_shape, out_dtype = out_shape if isinstance(out_shape[0], tuple) else (out_shape, "float32")
            if out_dtype != "float32":  # a good call first: the bad out= meets the kind's plan (its fast checks)
                getattr(comm, collective)(x, **kwargs, out=as_array(np.zeros(out_shape, np.float32), "float32", kind))
            kwargs = {**kwargs, "out": as_array(np.zeros(out_shape, out_dtype), out_dtype, kind)}
        try:
            getattr(comm, collective)(x, **kwargs)
            error = None
        except (TypeError, ValueError) as caught:
            error = (type(caught).__name__, str(caught))
        out.append((error, np.array_equal(before, to_numpy(x))))
    in_step = comm.all_reduce(np.ones(1, np.int64))
    return out, int(in_step[0])


def bad_cases(n, rank):
    """(collective, x shape, kwargs, out shape, words the message must hold)."""
    cases = [
        ("all_gather", (2, 3), {}, (n, 3, 2), ["out", f"({n}, 3, 2)", f"({n}, 2, 3)"]),
        ("reduce_scatter", (2 * n, 3), {}, (2, 2), ["out", "(2, 2)", "(2, 3)"]),
        ("gather", (2, 3), {"dst": 0}, (n + 1, 2, 3), ["out", f"({n + 1}, 2, 3)", f"({n}, 2, 3)"]),
        ("scatter", (n, 4), {}, (5,), ["out", "(5,)", "(4,)"]),
        ("all_to_all", (n, 2), {}, (n, 3), ["out", f"({n}, 3)", f"({n}, 2)"]),
        ("all_to_all", (n, 2), {}, (n, 2, 1), ["out", f"({n}, 2, 1)"]),
        ("scatter", (n + 1, 2), {}, None, ["scatter", f"size={n}", f"({n + 1}, 2)"]),
        ("all_to_all", (n + 1, 2), {}, None, ["all_to_all", f"size={n}"]),
        ("all_to_all", (3, 2), {"send_splits": [3] + [0] * n}, None, ["send_splits", str(n)]),
        ("all_to_all", (3, 2), {"send_splits": [4] + [0] * (n - 1)}, None, ["send_splits", "sum", "3"]),
        ("all_to_all", (3, 2), {"send_splits": [4] + [0] * (n - 2) + [-1]} if n > 1
         else {"send_splits": [-1]}, None, ["send_splits", ">= 0"]),
        ("gather", (2,), {"dst": n}, None, ["dst", str(n), "out of range"]),
        ("gather", (2,), {"dst": -1}, None, ["dst", "-1", "out of range"]),
        ("scatter", (n, 2), {"src": n}, None, ["src", str(n), "out of range"]),
        ("reduce", (2,), {"dst": n}, None, ["dst", str(n), "out of range"]),
        ("reduce", (2,), {"dst": "0"}, None, ["dst", "int"]),
    ]
    # out= of another dtype of the same width, after a good call of the kind
    cases += [(name, shape, {}, (out, "int32"), ["out", "int32", "float32"]) for name, shape, out in (
        ("all_gather", (2, 3), (n, 2, 3)), ("scatter", (n, 4), (4,)), ("reduce_scatter", (2 * n, 3), (2, 3)))]
    # Known only once the counts have travelled: the same error on every rank.
    rows = 2
    cases.append(("all_gather_v", (rows, 3), {}, (rows * n + 1, 3), ["out", str(rows * n + 1), str(rows * n)]))
    splits = [1] * n
    cases.append(("all_to_all", (n, 3), {"send_splits": splits}, (n + 2, 3), ["out", str(n + 2), str(n)]))
    return cases


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", WORLDS, indirect=True, ids=world_id)
def test_wrong_out_and_bad_arguments_raise_on_every_rank_before_anything_is_sent(world, kind):
    n = world.size
    per_rank = [(kind, [c[:4] for c in bad_cases(n, r)]) for r in range(n)]
    results = world.run(bad_call_job, per_rank)
    for rank in range(n):
        errors, in_step = results[rank]
        assert in_step == n, f"rank {rank}: the ranks are out of step after the bad calls"
        for case, (error, untouched) in zip(bad_cases(n, rank), errors):
            assert error is not None, f"{case[:3]} did not raise on rank {rank}"
            assert error[0] in ("ValueError", "TypeError") and untouched, (case[:3], error)
            for word in case[4]:
                assert word in error[1], f"{case[:3]}: {word!r} not in {error[1]!r}"


# -- point-to-point: rings and pairwise exchanges, sync and async, waits in both orders -------

P2P_WORLDS = worlds((2, 3, 4), local=False)


def p2p_job(comm, kind, values, pattern, mode):
    """values: {dtype: this rank's carrier}. pattern "ring" (send to rank+1, receive from
    rank-1) or "pairs" (0<->1, 2<->3, both directions). mode "sync", "async-recv-first"
    (handles waited receives first) or "async-send-first"."""
    n, r = comm.size, comm.rank
    if pattern == "ring":
        to, frm = (r + 1) % n, (r - 1) % n
    else:
        to = frm = r ^ 1
        if to >= n:
            return {}
    sends, recvs, received = [], [], {}
    for tag, (dtype, mine) in enumerate(values.items()):
        x = as_array(mine, dtype, kind)
        box = as_array(np.zeros_like(mine), dtype, kind)
        received[dtype] = box
        if mode == "sync":
            if r % 2 == 0:
                assert comm.send(x, to, tag=tag) is None
                assert comm.recv(box, frm, tag=tag) is box
            else:
                assert comm.recv(box, frm, tag=tag) is box
                comm.send(x, to, tag=tag)
        else:
            recvs.append(comm.recv(box, frm, tag=tag, async_op=True))
            sends.append((comm.send(x, to, tag=tag, async_op=True), x))
    handles = [w for w, _ in sends]
    for work in (recvs + handles if mode == "async-recv-first" else handles + recvs):
        result = work.wait()
        assert work.is_completed()
        assert result is None or any(result is box for box in received.values()) or \
            any(result is x for _, x in sends)
    return {dtype: to_numpy(box) for dtype, box in received.items()}


@pytest.mark.parametrize("mode", ["sync", "async-recv-first", "async-send-first"])
@pytest.mark.parametrize("pattern", ["ring", "pairs"])
@pytest.mark.parametrize("world", P2P_WORLDS, indirect=True, ids=world_id)
def test_send_recv_rings_and_pairs_deliver_every_dtype(world, pattern, mode):
    n = world.size
    kind = "torch" if mode != "async-send-first" else "numpy"
    dtypes = dtypes_for(kind)
    values = [{d: make_input(SEED + 7, r, d, None) for d in dtypes} for r in range(n)]
    results = world.run(p2p_job, [(kind, values[r], pattern, mode) for r in range(n)])
    for r in range(n):
        frm = (r - 1) % n if pattern == "ring" else r ^ 1
        if pattern == "pairs" and frm >= n:
            assert results[r] == {}
            continue
        for dtype in dtypes:
            assert results[r][dtype].tobytes() == _bytes_of(values[frm][dtype], dtype), (r, dtype)


# -- debug mode: a recv that does not match its send is CollectiveMismatch, never garbage -----

@pytest.fixture(scope="module", params=["mpi", "torch"])
def debug_world(request):
    from collectives import config
    from collectives.testing import RankPool

    pool = RankPool(request.param, 2, env={config.DEBUG: "1", config.TIMEOUT: "20"}, job_timeout=60)
    pool.start()
    yield pool
    pool.close()


def p2p_mismatch_job(comm):
    """Rank 0 sends; rank 1 receives some messages into arrays of another shape or dtype.
    Returns rank 1's outcomes: (error type, message, x untouched) or the values received."""
    sub = comm.split(0)
    sends = [np.arange(3, dtype=np.float32), np.arange(4, dtype=np.float32),
             np.arange(4, dtype=np.int64).reshape(2, 2), np.arange(5, dtype=np.int32),
             np.arange(6, dtype=np.int32) * 2, np.arange(2, dtype=np.float64)]
    boxes = [np.full(4, -1, np.float32), np.full(4, -1, np.float32),
             np.full((2, 2), -1, np.float64), np.full(5, -1, np.int32),
             np.full(6, -1, np.int32), np.full(2, -1, np.float64)]
    outcomes = []
    if sub.rank == 0:
        works = [sub.send(x, 1, tag=0, async_op=True) for x in sends]
        for work in reversed(works):
            work.wait()
    else:
        def take(box, work):
            try:
                work.wait()
                outcomes.append(("ok", box.tolist()))
            except Exception as error:  # noqa: BLE001  (which one is what the test checks)
                outcomes.append((type(error).__name__, str(error), bool((box == -1).all())))

        # synchronous: a shape mismatch, then a match (the stream is in step)
        for i in (0, 1):
            take(boxes[i], _Done(lambda i=i: sub.recv(boxes[i], 0, tag=0)))
        # asynchronous, waited in reverse: dtype mismatch (waited last), then two matches
        works = [sub.recv(boxes[i], 0, tag=0, async_op=True) for i in (2, 3, 4, 5)]
        for i, work in reversed(list(zip((2, 3, 4, 5), works))):
            take(boxes[i], work)
    after = sub.all_reduce(np.ones(1))
    sub.close()
    return outcomes, float(after[0])


class _Done:
    def __init__(self, run):
        self._run = run

    def wait(self):
        return self._run()


@pytest.mark.timeout(120)
def test_debug_recv_of_another_shape_or_dtype_raises_and_stays_in_step(debug_world):
    results = debug_world.run(p2p_mismatch_job, timeout=60)
    assert results[0] == ([], 2.0)
    outcomes, after = results[1]
    assert after == 2.0
    first, second = outcomes[0], outcomes[1]
    assert first[0] == "CollectiveMismatch" and first[2], first
    assert "(3,), float32" in first[1] and "(4,), float32" in first[1], first[1]
    assert second == ("ok", [0.0, 1.0, 2.0, 3.0])
    by_index = dict(zip((5, 4, 3, 2), outcomes[2:]))
    assert by_index[5] == ("ok", [0.0, 1.0])
    assert by_index[4] == ("ok", [0, 2, 4, 6, 8, 10])
    assert by_index[3] == ("ok", [0, 1, 2, 3, 4])
    assert by_index[2][0] == "CollectiveMismatch" and by_index[2][2], by_index[2]
    assert "int64" in by_index[2][1] and "float64" in by_index[2][1], by_index[2][1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async-recv-first", "async-send-first"])
def test_debug_mode_send_recv_delivers_in_every_wait_order(debug_world, mode):
    values = [{d: make_input(SEED + 9, r, d, None) for d in dtypes_for("torch")} for r in range(2)]
    results = debug_world.run(p2p_job, [("torch", values[r], "pairs", mode) for r in range(2)],
                              timeout=60)
    for r in range(2):
        for dtype, got in results[r].items():
            assert got.tobytes() == _bytes_of(values[1 - r][dtype], dtype), (r, dtype)


def short_message_job(comm, kind):
    """Rank 0 sends 3 float32; rank 1 receives them into 4 (blocking, then through a handle).
    Returns rank 1's (error type, message) of each, and whether its arrays stayed as they were
    past the 12 bytes received."""
    sub = comm.split(0)
    outcomes = []
    for async_op in (False, True):
        if sub.rank == 0:
            sub.send(as_array(np.arange(3, dtype=np.float32), "float32", kind), 1, tag=5)
        else:
            box = as_array(np.full(4, -1, np.float32), "float32", kind)
            try:
                work = sub.recv(box, 0, tag=5, async_op=async_op)
                if async_op:
                    work.wait()
                outcomes.append(("no error", "", False))
            except Exception as error:  # noqa: BLE001  (which one is what the test checks)
                outcomes.append((type(error).__name__, str(error), float(to_numpy(box)[3]) == -1.0))
    sub.close()
    return outcomes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True, ids=world_id)
def test_recv_of_a_shorter_message_raises_naming_both_sizes(world, kind):
    """Outside debug mode MPI takes a shorter message than x holds: the recv says so (the fast
    path of a blocking recv and the handle of an async one alike) instead of returning x
    partly filled as if it were whole."""
    outcomes = world.run(short_message_job, [(kind,)] * 2, timeout=60)[1]
    for name, message, rest_untouched in outcomes:
        assert name == "ValueError", (name, message)
        assert "recv from rank 0 (tag 5) got 12 bytes, but x holds 16 (shape (4,), float32)" in message, message
        assert rest_untouched


def default_device_job(comm):
    """CPU tensors while torch's default device is another ("meta" here; "cuda" in a GPU
    program): every new result stays on the CPU, beside x."""
    import torch

    torch.set_default_device("meta")
    try:
        x = torch.arange(4, dtype=torch.float32, device="cpu") + comm.rank
        got = {"all_gather": comm.all_gather(x), "reduce_scatter": comm.reduce_scatter(
            torch.ones(2 * comm.size, device="cpu")), "all_to_all": comm.all_to_all(
            torch.arange(comm.size * 2, dtype=torch.float32, device="cpu").reshape(comm.size, 2))}
    finally:
        torch.set_default_device("cpu")
    return {name: (str(t.device), t.tolist()) for name, t in got.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True, ids=world_id)
def test_new_results_of_cpu_tensors_stay_on_the_cpu_whatever_the_default_device(world):
    results = world.run(default_device_job, timeout=60)
    for rank, got in enumerate(results):
        assert got["all_gather"] == ("cpu", [[0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]])
        assert got["reduce_scatter"] == ("cpu", [2.0, 2.0])
        assert got["all_to_all"] == ("cpu", [[2.0 * rank, 2.0 * rank + 1]] * 2), (rank, got)


def split_barriers_close_split_job(comm):
    """Splits whose barriers the other ranks wait in (rank 0 comes late to each: its peers then
    send it the monitored barrier's words, which it takes only now and then), closed; the next
    split's collectives complete."""
    import time

    sums = []
    for round_ in range(3):
        sub = comm.split(0)
        for _ in range(12):
            if comm.rank == 0:  # late: the others wait in the barrier
                end = time.perf_counter() + 0.002
                while time.perf_counter() < end:
                    pass
            sub.barrier()
        sums.append(float(sub.all_reduce(np.full(3, float(round_)))[0]))
        sub.close()
    return sums


def split_close_split_job(comm):
    """Splits made and closed in turn: the first closed unused on every rank, the next ones
    used and closed at each rank's own moment (rank 0 at once, the others after one more call
    on the parent): every split's collectives complete."""
    comm.split(0).close()
    sums = []
    for round_ in range(4):
        sub = comm.split(0)
        sums.append(float(sub.all_reduce(np.full(3, float(round_)))[0]))
        sub.broadcast(np.zeros(2), 0)
        if comm.rank == 0:
            sub.close()
            comm.all_reduce(np.ones(1))
        else:
            comm.all_reduce(np.ones(1))
            sub.close()
    return sums


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [("mpi", 2), ("mpi", 3)], indirect=True, ids=world_id)
def test_a_closed_split_leaves_nothing_for_the_next_one(world):
    """A closed communicator's farewells, left unreceived on a freed MPI communicator, were
    matched on the next one MPI gave the same context id: on Open MPI 5 its first collective
    never completed. Each split's collectives here complete, with the right sums."""
    results = world.run(split_close_split_job, timeout=60)
    for sums in results:
        assert sums == [float(r * world.size) for r in range(4)], sums


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [("mpi", 2), ("mpi", 3)], indirect=True, ids=world_id)
def test_a_closed_split_with_waited_barriers_leaves_nothing_for_the_next_one(world):
    """The monitored barrier's words that rank 0 had not taken when a split closed, left on the
    freed MPI communicator, would be matched on the next one with the same context id (as the
    farewells were): each split's collectives complete, with the right sums."""
    results = world.run(split_barriers_close_split_job, timeout=60)
    for sums in results:
        assert sums == [float(r * world.size) for r in range(3)], sums
