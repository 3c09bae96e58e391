"""Small calls carried in the check's round (backends/mpi_carried.py): with the default check on
and up to COUNTS_RANKS ranks, a call whose host x is at most CARRY_BYTES travels in the round's
MPI_Allgather and makes its result from every rank's x, without its data collective.

The call runs in two forms, each test in both: the compiled carry (backends/mpi_carried.py compiled
by Cython; the test set-up builds it) and the Python one (COLLECTIVES_COMPILED=0), its reference.
Every result against numpy (float64 sums, or the same float32 sums in rank order, bit for bit);
that the call did travel is read from the round's gathered words (bit 63 set on every rank's
word: every rank carried); ranks that decide differently (one asynchronous, one
non-contiguous, one too large) run the call as usual and get the same result; a mismatch
between carried calls is CollectiveMismatch on every rank, x untouched; a float overflow is
MPI's inf, with no numpy warning.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from collectives.backends.mpi_carried import CARRY_BYTES
from collectives.backends.mpi_staged import UNEVEN_BYTES
from collectives.backends.mpi_uneven import uneven_block
from forms import split_in_form

from collectives.config import COMPILED

WORLDS = pytest.mark.parametrize("world", [("mpi", 2), ("mpi", 3)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
MPI_2 = pytest.mark.parametrize("world", [("mpi", 2)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
FORMS = pytest.mark.parametrize("form", ["compiled", "python"])
REDUCTIONS = {"int32": ("sum", "prod", "min", "max", "band", "bor", "bxor"), "int64": ("sum", "max"),
              "float32": ("sum", "prod", "avg"), "float64": ("sum", "avg"), "float16": ("sum",),
              "bool": ("min", "max", "bxor")}


def in_form(comm, form, job, *args):
    """``job`` (a name of this module) on a split of ``comm`` in ``form``: its result, and the
    modules of the Carriers whose runs it planned as carried paths (the compiled one:
    collectives.backends._carried_c)."""
    with split_in_form(comm, form) as sub:
        found = globals()[job](sub, *args)
        return found, {type(plan.carry.__self__).__module__ for plan in sub._plans.values() if plan.carry is not None}


def formed(world, form, job, per_rank=None):
    """``job`` run by :func:`in_form` on every rank: the ranks' results; asserts the form ran."""
    per_rank = per_rank or [()] * world.size
    results = world.run(in_form, [(form, job, *args) for args in per_rank], timeout=120)
    for _, paths in results:
        assert paths == ({"collectives.backends._carried_c"} if form == "compiled"
                         else {"collectives.backends.mpi_carried"}), paths
    return [found for found, _ in results]


def everyone_carried(comm):
    """Whether the last round had every rank's x in it (bit 63 of every rank's word; a round of
    one word carries nothing)."""
    words = comm._transport.round.words
    return words is not None and bool((words < 0).all())


def values(rank, n, dtype, salt=0):
    """Rank ``rank``'s ``n`` values of ``dtype``: small, exact in every dtype, different per rank."""
    base = (np.arange(n) * 7 + rank * 3 + salt) % 5 + 1
    return (base % 2).astype(dtype) if dtype == "bool" else base.astype(dtype)


def reference(op, dtype, rows):
    """The reduction of ``rows`` (one per rank) in float64 (bool: logical), as numpy."""
    if dtype == "bool":
        fn = {"min": np.logical_and, "max": np.logical_or, "bxor": np.logical_xor}[op]
        return fn.reduce(np.array(rows), axis=0)
    stacked = np.array(rows, dtype=np.float64 if "float" in dtype else np.int64)
    if op in ("band", "bor", "bxor"):
        return getattr(np, {"band": "bitwise_and", "bor": "bitwise_or", "bxor": "bitwise_xor"}[op]).reduce(stacked)
    out = {"sum": stacked.sum(0), "avg": stacked.mean(0), "prod": stacked.prod(0),
           "min": stacked.min(0), "max": stacked.max(0)}[op]
    return out


def reductions_job(comm, kind):
    """all_reduce, reduce (every dst) and reduce_scatter of every carried dtype x op: the
    mismatches against numpy, and whether each call was carried."""
    import torch

    wrap = torch.from_numpy if kind == "torch" else np.asarray
    wrong, carried = [], []
    n = 2 * comm.size
    for dtype, ops in REDUCTIONS.items():
        rows = [values(r, n, dtype) for r in range(comm.size)]
        for op in ops:
            expected = reference(op, dtype, rows)
            x = wrap(values(comm.rank, n, dtype))
            got = comm.all_reduce(x, op)
            carried.append(everyone_carried(comm))
            if got is not x or not np.allclose(np.asarray(x), expected, rtol=1e-3):
                wrong.append(("all_reduce", dtype, op, np.asarray(x).tolist(), expected.tolist()))
            for dst in range(comm.size):
                x = wrap(values(comm.rank, n, dtype))
                comm.reduce(x, op, dst=dst)
                carried.append(everyone_carried(comm))
                want = expected if comm.rank == dst else values(comm.rank, n, dtype)
                if not np.allclose(np.asarray(x), want, rtol=1e-3):
                    wrong.append(("reduce", dtype, op, dst, np.asarray(x).tolist()))
            block = comm.reduce_scatter(wrap(values(comm.rank, n, dtype)), op)
            carried.append(everyone_carried(comm))
            rows_here = n // comm.size
            if type(block) is not type(x) or \
                    not np.allclose(np.asarray(block), expected[comm.rank * rows_here:(comm.rank + 1) * rows_here],
                                    rtol=1e-3):
                wrong.append(("reduce_scatter", dtype, op, np.asarray(block).tolist()))
    return wrong, carried


@WORLDS
@FORMS
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_small_reductions_travel_in_the_check_round_and_equal_numpy(world, form, kind):
    for wrong, carried in formed(world, form, "reductions_job", [(kind,)] * world.size):
        assert wrong == [], wrong[:3]
        assert all(carried), carried


def arithmetic_job(comm):
    """all_reduce and reduce_scatter of every (dtype, op) the carried path reduces, on values
    over each dtype's whole range (integer sums and products wrap), in both forms: the
    compiled form's bytes, the Python form's, and numpy's in rank order (rank 0's x first)."""
    from collectives.ops import ALLOWED_OPS

    native = comm._transport._native
    pairs = [(dtype, op.value) for dtype, ops in ALLOWED_OPS.items() if dtype in native
             for op in sorted(ops, key=str) if op in native[dtype]]
    numpy_ops = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum, "avg": np.add,
                 "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}
    bool_ops = {"min": np.logical_and, "max": np.logical_or, "band": np.logical_and, "bor": np.logical_or,
                "bxor": np.logical_xor}

    def rows_of(dtype, seed):
        rng = np.random.default_rng(seed)
        shape = (comm.size, 4 * comm.size)
        if dtype == "bool":
            return rng.integers(0, 2, shape).astype(bool)
        if "float" in dtype:
            return (rng.standard_normal(shape) * 100).astype(dtype)
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)

    found = {}
    for form in ("compiled", "python"):
        with split_in_form(comm, form) as sub:
            for seed, (dtype, op) in enumerate(pairs):
                rows = rows_of(dtype, seed)
                x = rows[comm.rank].copy()
                sub.all_reduce(x, op)
                block = sub.reduce_scatter(rows[comm.rank].copy(), op)
                found[form, dtype, op] = (x.tobytes(), block.tobytes(), everyone_carried(sub))
    wrong = []
    for seed, (dtype, op) in enumerate(pairs):
        rows = rows_of(dtype, seed)
        fn = bool_ops[op] if dtype == "bool" else numpy_ops[op]
        with np.errstate(all="ignore"):
            want = rows[0].copy()
            for row in rows[1:]:
                want = fn(row, want)
            if op == "avg":
                want = want / comm.size
        n = want.size // comm.size
        want_block = want[comm.rank * n:(comm.rank + 1) * n]
        for form in ("compiled", "python"):
            got, block, carried = found[form, dtype, op]
            if got != want.tobytes() or block != want_block.tobytes() or not carried:
                wrong.append((form, dtype, op, carried))
    return wrong, len(pairs)


@WORLDS
def test_both_forms_reduce_every_pair_to_numpys_bits_in_rank_order(world):
    for wrong, pairs in world.run(arithmetic_job, timeout=120):
        assert pairs >= 40 and wrong == [], wrong[:5]


def moves_job(comm, kind):
    """broadcast, gather and scatter from every root, all_gather, all_to_all, all_gather_v and
    the uneven all_to_all, with and without out=, each against numpy; and whether each carried."""
    import torch

    wrap = torch.from_numpy if kind == "torch" else np.asarray
    size, rank = comm.size, comm.rank
    wrong, carried = [], []

    def note(name, ok):
        carried.append((name, everyone_carried(comm)))
        if not ok:
            wrong.append(name)

    mine = values(rank, 3, "float64").reshape(3, 1)
    everyone = np.stack([values(r, 3, "float64").reshape(3, 1) for r in range(size)])
    for root in range(size):
        y = wrap(mine.copy())
        comm.broadcast(y, root)
        note(("broadcast", root), np.array_equal(np.asarray(y), everyone[root]))
        g = comm.gather(wrap(mine.copy()), dst=root)
        note(("gather", root), (g is None) if rank != root else np.array_equal(np.asarray(g), everyone))
        table = wrap(np.arange(size * 2, dtype=np.int16).reshape(size, 2) + 100 * root)
        s = comm.scatter(table, src=root)
        want = np.arange(2) + 2 * rank + 100 * root
        note(("scatter", root), type(s) is type(table) and np.array_equal(np.asarray(s), want))
    g = comm.all_gather(wrap(mine.copy()))
    note("all_gather", type(g) is type(y) and np.array_equal(np.asarray(g), everyone))
    out = wrap(np.zeros_like(everyone))
    g = comm.all_gather(wrap(mine.copy()), out=out)
    note("all_gather out=", g is out and np.array_equal(np.asarray(out), everyone))
    sent = wrap(np.arange(size, dtype=np.int64) * 10 + rank)
    a = comm.all_to_all(sent)
    note("all_to_all", np.array_equal(np.asarray(a), np.arange(size) + 10 * rank))
    z = comm.all_gather(wrap(np.full((), rank + 0.5, dtype=np.float32)))  # a 0-d x
    note("all_gather 0-d", np.array_equal(np.asarray(z), np.arange(size) + 0.5))
    e = comm.all_gather(wrap(np.zeros((0, 2), dtype=np.float32)))
    note("all_gather empty", tuple(e.shape) == (size, 0, 2))
    # the uneven rows: x travels with the counts (twice: a kind's first call hashes it, in Python
    # in both forms; its later calls take the compiled check of the compiled form)
    for turn in range(2):
        x = wrap(np.arange((rank + 1) * 2, dtype=np.float32).reshape(rank + 1, 2) + 100 * rank + turn)
        got, counts = comm.all_gather_v(x)
        ref = np.concatenate([np.arange((r + 1) * 2, dtype=np.float32).reshape(r + 1, 2) + 100 * r + turn
                              for r in range(size)])
        note(("all_gather_v", turn), counts == list(range(1, size + 1)) and type(got) is type(x)
             and np.array_equal(np.asarray(got), ref))
        splits = [(rank + j) % 3 for j in range(size)]
        v = wrap(np.arange(sum(splits), dtype=np.int32) + 1000 * rank + turn)
        got = comm.all_to_all(v, splits)
        ref = []
        for r in range(size):
            theirs = [(r + j) % 3 for j in range(size)]
            ref += list(np.arange(sum(theirs)) + 1000 * r + turn)[sum(theirs[:rank]):sum(theirs[:rank + 1])]
        note(("all_to_all_v", turn), np.array_equal(np.asarray(got), np.array(ref, dtype=np.int32)))
    return wrong, carried


@WORLDS
@FORMS
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_small_moves_travel_in_the_check_round_and_equal_numpy(world, form, kind):
    for wrong, carried in formed(world, form, "moves_job", [(kind,)] * world.size):
        assert wrong == []
        assert [name for name, was in carried if not was] == []


def staged_job(comm, kind):
    """Every collective of even shapes on x past CARRY_BYTES and within STAGED_BYTES (the check's
    round, then the call's staged persistent request), three times each (its first call makes the
    request; the later ones reuse it with new data), from every root, with and without out=, each
    against numpy; and how many staged requests the channel holds after them."""
    import torch
    from collectives.backends.mpi_staged import STAGED_BYTES

    wrap = torch.from_numpy if kind == "torch" else np.asarray
    size, rank = comm.size, comm.rank
    n = (CARRY_BYTES + STAGED_BYTES) // 2 // 8 // size * size  # float64 elements, a multiple of size
    wrong = []

    def check(name, got, want):
        # (then a call of one element: the round stays on its small block, backends/mpi_round.py,
        # which two calls in a row past it would leave for the large one, and x for the staged request)
        comm.all_reduce(np.zeros(1))
        if not (got is None if want is None else np.array_equal(np.asarray(got), want)):
            wrong.append(name)

    for turn in range(3):
        each = [np.arange(n, dtype=np.float64) * (r + 2) + turn for r in range(size)]
        total = np.sum(each, axis=0)
        x = wrap(each[rank].copy())
        comm.all_reduce(x)
        check(("all_reduce", turn), x, total)
        x = wrap(each[rank].copy())
        comm.all_reduce(x, op="avg")
        check(("all_reduce avg", turn), x, total / size)
        rows = total.reshape(size, -1)
        check(("reduce_scatter", turn), comm.reduce_scatter(wrap(each[rank].copy())), rows[rank])
        check(("all_gather", turn), comm.all_gather(wrap(each[rank].copy())), np.stack(each))
        out = wrap(np.zeros((size, n)))
        check(("all_gather out=", turn), comm.all_gather(wrap(each[rank].copy()), out=out), np.stack(each))
        blocks = [e.reshape(size, -1) for e in each]
        check(("all_to_all", turn), comm.all_to_all(wrap(blocks[rank].copy())), np.stack([b[rank] for b in blocks]))
        for root in range(size):
            x = wrap(each[rank].copy())
            comm.broadcast(x, root)
            check(("broadcast", root, turn), x, each[root])
            x = wrap(each[rank].copy())
            comm.reduce(x, dst=root)
            check(("reduce", root, turn), x, total if rank == root else each[rank])
            check(("gather", root, turn), comm.gather(wrap(each[rank].copy()), dst=root),
                  np.stack(each) if rank == root else None)
            check(("scatter", root, turn), comm.scatter(wrap(blocks[rank].copy()), src=root), blocks[root][rank])
    channel = comm._transport
    return wrong, channel._stages_gathers, sum(len(table) for table in channel._staged_tables.values())


@WORLDS
@FORMS
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_calls_past_the_round_go_through_staged_requests_and_equal_numpy(world, form, kind):
    for wrong, gathers, staged in formed(world, form, "staged_job", [(kind,)] * world.size):
        assert wrong == []
        # every kind of call made its request (one per root where rooted); not the gathering
        # calls where the library's persistent all_gather is wrong (Intel MPI)
        assert staged >= (2 + 3 + 2 * world.size if gathers else 2 + 2 * world.size), staged


#: Each rank's rows in the uneven calls of uneven_staged_job, one function a turn: past CARRY_BYTES and
#: within UNEVEN_BYTES (a rank of none among them), then past UNEVEN_BYTES (the v-collective).
UNEVEN_TURNS = [(lambda r: 40 + 30 * r), (lambda r: 0 if r == 1 else 300 + r), (lambda r: 500 - 100 * r),
                (lambda r: 700 + 100 * r)]


def uneven_staged_job(comm, kind):
    """all_gather_v and the uneven all_to_all on x past CARRY_BYTES and within UNEVEN_BYTES (the
    counts' round marks every rank's x, then a staged request of padded blocks moves them), with
    counts that change from call to call (a rank of no rows among them), then past UNEVEN_BYTES
    (the v-collective after the round), with and without out=, one rank asynchronous in a call
    (its method's Python form, the others' compiled one), each against numpy; whether every rank
    marked its word, per call; the blocks of the staged requests made."""
    import torch
    from collectives.backends import mpi_staged

    wrap = torch.from_numpy if kind == "torch" else np.asarray
    size, rank = comm.size, comm.rank
    wrong, marked, staged = [], [], []
    kept = mpi_staged.uneven_stage  # (counted: the method calls it only to make a request)
    mpi_staged.uneven_stage = lambda *args: staged.append(args[2]) or kept(*args)
    try:
        turns(comm, wrap, size, rank, wrong, marked)
    finally:
        mpi_staged.uneven_stage = kept
    blocks = sorted(block for key, table in comm._transport._staged_tables.items() if key[1] == "uint8"
                    for block in table)
    methods = {type(comm._transport._all_gather_v).__module__, type(comm._transport._all_to_all_v).__module__}
    return wrong, marked, blocks, methods, comm._transport._uneven_bytes, len(staged)


def turns(comm, wrap, size, rank, wrong, marked):
    for turn, rows_of in enumerate(UNEVEN_TURNS):
        rows = [rows_of(r) for r in range(size)]  # float64 rows of 2: 640 B a row x 40 and up
        mine = [np.arange(n * 2, dtype=np.float64).reshape(n, 2) + 1000 * r + turn for r, n in enumerate(rows)]
        for out in (False, True):
            result = wrap(np.zeros((sum(rows), 2))) if out else None
            got, counts = comm.all_gather_v(wrap(mine[rank].copy()), out=result)
            marked.append(everyone_carried(comm))
            if not (counts == rows and (not out or got is result) and type(got) is type(wrap(mine[0]))
                    and np.array_equal(np.asarray(got), np.concatenate(mine))):
                wrong.append(("all_gather_v", turn, out))
        splits = [[(rows_of(r) + j) // size for j in range(size)] for r in range(size)]
        sent = [np.arange(sum(s) * 3, dtype=np.int32).reshape(sum(s), 3) + 100000 * r for r, s in enumerate(splits)]
        want = np.concatenate([sent[r][sum(splits[r][:rank]):sum(splits[r][:rank + 1])] for r in range(size)])
        done = comm.all_to_all(wrap(sent[rank].copy()), splits[rank], async_op=rank == 0 and turn == 1)
        marked.append(everyone_carried(comm))
        got = done.wait() if rank == 0 and turn == 1 else done
        if not np.array_equal(np.asarray(got), want):
            wrong.append(("all_to_all_v", turn))


@WORLDS
@FORMS
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_uneven_calls_past_the_block_go_staged_or_through_their_v_collective_and_equal_numpy(world, form, kind):
    results = formed(world, form, "uneven_staged_job", [(kind,)] * world.size)
    size = world.size
    expected = set()
    for rows_of in UNEVEN_TURNS[:3]:
        expected.add(uneven_block(max(rows_of(r) for r in range(size)) * 16))  # (each past CARRY_BYTES)
        splits = [[(rows_of(r) + j) // size for j in range(size)] for r in range(size)]
        if max(sum(s) for s in splits) * 12 > CARRY_BYTES:  # (else carried in the round)
            expected.add(uneven_block(max(max(s) for s in splits) * 12))
    # which calls marked every rank's word: every rank's x within _uneven_bytes (UNEVEN_BYTES, or
    # CARRY_BYTES where the library keeps no staged requests of gathering calls: Intel MPI)
    sizes = []
    for rows_of in UNEVEN_TURNS:
        sizes += [max(rows_of(r) for r in range(size)) * 16] * 2
        sizes.append(max(sum((rows_of(r) + j) // size for j in range(size)) for r in range(size)) * 12)
    for wrong, marked, blocks, methods, most, staged in results:
        # uneven_stage: called only to make a request (the method finds a made one itself)
        assert staged == len(blocks)
        assert marked == [n <= most for n in sizes], marked
        assert most in (UNEVEN_BYTES, CARRY_BYTES)
        module = "_uneven_c" if form == "compiled" else "mpi_uneven"  # (backends/mpi_uneven.py, or its build)
        assert methods == {f"collectives.backends.{module}"}, methods
        assert wrong == []
        assert blocks == (sorted(expected) if most == UNEVEN_BYTES else []), blocks  # (none: nothing staged)


def uneven_out_job(comm):
    """all_gather_v and the uneven all_to_all of CPU tensors into out= tensors, carried in the
    round's payloads (small), staged (past CARRY_BYTES) and through the v-collective (past
    UNEVEN_BYTES): what is wrong against numpy (empty: nothing), and whether out is the result."""
    import torch

    size, rank, wrong = comm.size, comm.rank, []
    for rows in (1, 40, 200, 3000):  # float64 rows of 2: 16 B, 640 B (carried), 3.2 KB (staged), 48 KB
        mine = [np.arange((rows + r) * 2, dtype=np.float64).reshape(rows + r, 2) + 1000 * r for r in range(size)]
        out = torch.full((sum(rows + r for r in range(size)), 2), -1.0, dtype=torch.float64)
        got, counts = comm.all_gather_v(torch.from_numpy(mine[rank].copy()), out=out)
        if got is not out or counts != [rows + r for r in range(size)] or \
                not np.array_equal(out.numpy(), np.concatenate(mine)):
            wrong.append(("all_gather_v", rows))
        splits = [[rows + (r + j) % 2 for j in range(size)] for r in range(size)]
        sent = [np.arange(sum(s), dtype=np.int32) + 100000 * r for r, s in enumerate(splits)]
        want = np.concatenate([sent[r][sum(splits[r][:rank]):sum(splits[r][:rank + 1])] for r in range(size)])
        out = torch.full(want.shape, -1, dtype=torch.int32)
        got = comm.all_to_all(torch.from_numpy(sent[rank].copy()), splits[rank], out=out)
        if got is not out or not np.array_equal(out.numpy(), want):
            wrong.append(("all_to_all_v", rows))
    return wrong


@WORLDS
@FORMS
def test_uneven_calls_write_an_out_tensor_carried_staged_or_through_their_v_collective(world, form):
    """The compiled form writes an out= tensor at its address (no numpy view a call): the same
    results as numpy in both forms."""
    assert all(wrong == [] for wrong in formed(world, form, "uneven_out_job"))


def deciding_job(comm, n):
    """Calls of ``n`` float64 where rank 0 does not take the fast path (asynchronous, then a
    non-contiguous x, twice: a second call of a shape is where a staged persistent request of
    the others would meet rank 0's nonblocking call), and the others do; then an uneven x past
    CARRY_BYTES on rank 0 only: every rank's results, and whether the round had every rank's x."""
    rank = comm.rank
    results = []
    for _ in range(2):
        x = np.full(n, rank + 1.0)
        done = comm.all_reduce(x, async_op=rank == 0)
        if rank == 0:
            done.wait()
        results.append(("async", x.tolist(), everyone_carried(comm)))
        wide = np.full((n, 2), rank + 1.0)
        x = wide[:, 0] if rank == 0 else np.full(n, rank + 1.0)  # rank 0: a strided view
        comm.all_reduce(x)
        results.append(("strided", x.tolist(), everyone_carried(comm)))
    rows = UNEVEN_BYTES // 8 + 1 if rank == 0 else 1  # rank 0's x is too large to travel or be staged
    got, counts = comm.all_gather_v(np.full((rows, 1), float(rank)))
    results.append(("uneven", [counts, got[:, 0].tolist() == sum(([float(r)] * n for r, n in enumerate(counts)), [])],
                    everyone_carried(comm)))
    return results


@WORLDS
@FORMS
@pytest.mark.parametrize("n", [4, 2 * CARRY_BYTES // 8], ids=["carried", "staged"])
def test_ranks_that_decide_differently_run_the_call_as_usual(world, form, n):
    """(``staged``: past CARRY_BYTES, where the fast path's staged persistent requests serve a
    small call only if every rank's word said it runs the fast path.)"""
    results = formed(world, form, "deciding_job", [(n,)] * world.size)
    total = float(sum(range(1, world.size + 1)))
    for rank, found in enumerate(results):
        *calls, (_, (counts, right), carried_u) = found
        for name, got, carried in calls:
            assert got == [total] * n and not carried, (rank, name, got[:4])
        assert counts == [UNEVEN_BYTES // 8 + 1] + [1] * (world.size - 1) and right and not carried_u


def switched_job(comm):
    """COLLECTIVES_COMPILED switched after ``comm`` was made: a new kind of call is planned in
    ``comm``'s own form and runs right (before, a compiled communicator's new plans failed)."""
    os.environ[COMPILED] = "0" if os.environ[COMPILED] == "1" else "1"
    x = np.full(3, comm.rank + 1, dtype=np.int32)  # (carried on every MPI: Open MPI stages int16 sums)
    comm.all_reduce(x)
    return x.tolist(), everyone_carried(comm)


@MPI_2
@FORMS
def test_a_communicator_keeps_its_form_when_the_variable_changes(world, form):
    for got, carried in formed(world, form, "switched_job"):
        assert got == [3, 3, 3] and carried


def mismatch_job(comm, case):
    """A carried call whose shape differs between ranks (``small``: both carried; ``large``: rank
    0's too large to travel): the error's type on every rank, and whether x is untouched."""
    from collectives.errors import CollectiveMismatch

    n = 3 + comm.rank if case == "small" else (CARRY_BYTES // 4 + 8 if comm.rank == 0 else 2)
    for m in range(3, 3 + comm.size):  # every shape's kind of call hashed already (as on the later calls)
        comm.all_reduce(np.zeros(m, dtype=np.float32))
    x = np.arange(n, dtype=np.float32) + comm.rank
    kept = x.copy()
    try:
        comm.all_reduce(x)
    except CollectiveMismatch as error:
        return "CollectiveMismatch", np.array_equal(x, kept), "shape" in str(error)
    return None, np.array_equal(x, kept), False


@MPI_2
@FORMS
@pytest.mark.parametrize("case", ["small", "large"])
def test_a_mismatch_between_carried_calls_raises_on_every_rank_with_x_untouched(world, form, case):
    for error, untouched, names_shape in formed(world, form, "mismatch_job", [(case,)] * world.size):
        assert error == "CollectiveMismatch" and untouched and names_shape


def rank_order_job(comm):
    """float32 sums of random values at 3 ranks: every rank's bits, and numpy's float32 sum in
    rank order (rank 0's x first); a float32 overflow with warnings turned into errors."""
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((comm.size, 16)).astype(np.float32) * np.float32(1e3)
    x = rows[comm.rank].copy()
    comm.all_reduce(x)
    expected = rows[0].copy()
    for row in rows[1:]:
        expected = expected + row
    big = np.full(2, np.finfo(np.float32).max, dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        comm.all_reduce(big)
    return x.tobytes(), expected.tobytes(), big.tolist(), everyone_carried(comm)


@pytest.mark.parametrize("world", [("mpi", 3)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
@FORMS
def test_a_carried_sum_is_the_same_bits_on_every_rank_in_rank_order_and_overflows_to_inf_quietly(world, form):
    results = formed(world, form, "rank_order_job")
    assert len({bits for bits, _, _, _ in results}) == 1
    for bits, expected, big, carried in results:
        assert bits == expected
        assert big == [float("inf")] * 2 and carried


def one_word_job(comm):
    """On a communicator made while COUNTS_RANKS is 1 (as past 4 ranks: the check's round is the
    MPI_Allreduce (BAND) of one word, nothing carried): results of small and staged-size calls,
    rank 0 asynchronous or strided as in deciding_job, and a mismatch."""
    from collectives.backends import mpi_channel

    from collectives.errors import CollectiveMismatch

    kept = mpi_channel.COUNTS_RANKS
    mpi_channel.COUNTS_RANKS = 1
    try:
        sub = comm.split(0)
    finally:
        mpi_channel.COUNTS_RANKS = kept
    try:
        one_word = not sub._transport.round.gathers and sub._transport.round.carry_bytes == 0
        found = deciding_job(sub, 4) + deciding_job(sub, 2 * CARRY_BYTES // 8)
        try:
            sub.all_reduce(np.ones(2 + sub.rank, dtype=np.float32))
            mismatch = False
        except CollectiveMismatch:
            mismatch = True
    finally:
        sub.close()
    return one_word, found, mismatch


@MPI_2
def test_past_counts_ranks_the_one_word_check_keeps_mixed_routes_right(world):
    total = float(sum(range(1, world.size + 1)))
    for one_word, found, mismatch in world.run(one_word_job, timeout=120):
        assert one_word and mismatch
        for name, got, _ in found:
            if name != "uneven":
                assert got[:4] == [total] * 4 and len(set(got)) == 1, (name, got[:4])


def test_the_compiled_check_word_is_wires(monkeypatch):
    """The test set-up builds collectives/wire.py compiled (collectives._wire_c, whose check_word and
    words_agree the compiled CallCheck calls in C): its word is the Python form's over hashes of
    every width and sequence numbers past 31 bits, and so is its verdict over words with and
    without bit 63; COLLECTIVES_COMPILED=0 turns the module off."""
    from collectives import config, wire

    monkeypatch.setenv(COMPILED, "1")  # (whatever the caller's environment says)
    module = config.compiled_extension("collectives._wire_c", wire)
    assert module is not None, "collectives/wire.py was not compiled (or is stale): reinstall the checkout"
    rng = np.random.default_rng(3)
    hashes = [wire.call_hash("all_reduce", None, -1, "float32", (n,)) for n in range(50)]
    hashes += [int(h) for h in rng.integers(0, 2**63, 200, dtype=np.int64)] + [0, 2**31 - 1, 2**31, 2**64 - 1]
    seqs = [1, 2, 2**31 - 1, 2**31, 2**40 + 5] + [int(s) for s in rng.integers(1, 2**62, 50, dtype=np.int64)]
    wrong = [(h, s) for h in hashes for s in seqs if module.check_word(h, s) != wire.check_word(h, s)]
    assert wrong == []
    words = [wire.check_word(h, s) for h in hashes[:20] for s in seqs[:5]]
    reduced = words + [w & v for w, v in zip(words, words[1:])] + [w | wire.FAST_BIT for w in words]
    reduced += [int(r) for r in rng.integers(-2**63, 2**63 - 1, 500, dtype=np.int64)] + [-1, 0, wire.FAST_BIT]
    assert [module.words_agree(r) for r in reduced] == [wire.words_agree(r) for r in reduced]
    assert sum(wire.words_agree(r) for r in reduced) > len(words)  # (both verdicts among them)
    monkeypatch.setenv(COMPILED, "0")
    assert config.compiled_extension("collectives._wire_c", wire) is None


def direct_job(comm):
    """The compiled round (on a split in the compiled form) with its persistent request started and
    tested by MPI_Start and MPI_Test themselves (``direct``, as bind_mpi found them) and through
    mpi4py: for each, the results of carried calls and of a larger all_reduce (checked by the round
    only), and whether each round carried; then whether the round was direct to begin with."""
    with split_in_form(comm, "compiled") as sub:
        rnd = sub._transport._compiled_round
        was_direct, found = rnd.direct, {}
        size, rank = sub.size, sub.rank
        for direct in (True, False):
            rnd.direct = direct
            small = np.full(3, rank + 1.0)
            sub.all_reduce(small)
            large = np.full(2 * CARRY_BYTES // 8, rank + 1.0)
            sub.all_reduce(large)
            got, counts = sub.all_gather_v(np.full((rank + 1, 2), float(rank)))
            b = sub.broadcast(np.full(2, float(rank)), src=size - 1)
            found[direct] = (small.tolist(), float(large.sum()), counts, got[:, 0].tolist(), b.tolist(),
                             everyone_carried(sub))
        sub.barrier()  # (its check: CallCheck.check compiled)
        return was_direct, type(sub._call_check).__module__, found


@WORLDS
def test_the_round_started_by_mpi_itself_gives_what_mpi4pys_calls_give(world):
    total = float(sum(range(1, world.size + 1)))
    rows = sum(([float(r)] * (r + 1) for r in range(world.size)), [])
    for was_direct, check, found in world.run(direct_job, timeout=120):
        assert was_direct  # (every MPI of the test beds: MPI_Start and MPI_Test in mpi4py's library)
        assert check == "collectives._reliability_c"  # (CallCheck compiled)
        assert found[True] == found[False] == (
            [total] * 3, total * 2 * CARRY_BYTES // 8, list(range(1, world.size + 1)), rows,
            [float(world.size - 1)] * 2, True)


def test_both_forms_pick_the_same_block_for_an_uneven_staged_request():
    """uneven_block, compiled and not, against its rule written out (ranks in different forms
    that picked different blocks would start different requests and hang)."""
    from collectives.backends import mpi_uneven

    from collectives import config

    compiled = config.compiled_extension("collectives.backends._uneven_c", mpi_uneven)
    forms = [mpi_uneven.uneven_block] + ([compiled.uneven_block] if compiled is not None else [])
    for need in [*range(0, 3000), 4095, 4096, 4097, 8191, 8192, 8193, 10**6 + 1]:
        step = 1 << max(0, (need - 1).bit_length() - 3)
        want = 256 if need <= 256 else (need + step - 1) // step * step
        assert [block(need) for block in forms] == [want] * len(forms), need
    assert os.environ.get(COMPILED) == "0" or compiled is not None  # (the install builds it)
