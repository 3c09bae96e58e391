"""The check's round in two sizes of block (backends/mpi_round.py): every rank switches to the
large block together once two rounds in a row found every rank's call past the small one (and
within the large one), and back once two did not; calls carried in the large block give what
numpy gives; a mismatch there raises on every rank and leaves x as it was; the Python form and
the compiled one switch alike, also together in one job; a loop that alternates small and larger
calls stays on the small block."""

import numpy as np
import pytest
from collectives.backends.mpi_carried import CARRY_BYTES
from collectives.backends.mpi_round import LARGE_CARRY_BYTES
from forms import split_in_form

from collectives import CollectiveMismatch

WORLDS = pytest.mark.parametrize("world", [("mpi", 2), ("mpi", 3)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
MPI_2 = pytest.mark.parametrize("world", [("mpi", 2)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")


def state(comm):
    """The block the next round uses (1: the large one), and the bytes of every rank's block in
    the last round (the channel's Round: the compiled round keeps it in step)."""
    round_ = comm._transport.round
    return round_.geometry, round_.blocks.shape[1] * 8


def staged(comm):
    """The calls that made a staged persistent request (x past the round's block)."""
    return sorted({key[0].name for key, table in comm._transport._staged_tables.items() if table})


def calls(comm, n, turn, part="all"):
    """Every collective on float32 x of n elements a rank (a multiple of size), each against numpy
    (``part``: "first", all_reduce alone; "uneven", the uneven ones alone): (name, whether it gave
    numpy's result, state after it)."""
    size, rank = comm.size, comm.rank
    each = [np.arange(n, dtype=np.float32) * (r + 2) + turn for r in range(size)]
    total = np.sum(each, axis=0, dtype=np.float64).astype(np.float32)
    blocks = [e.reshape(size, -1) for e in each]
    root = turn % size
    done = []

    def record(name, got, want):
        done.append((name, got is None if want is None else np.array_equal(np.asarray(got), want), state(comm)))

    if part == "uneven":
        uneven(comm, n, turn, record)
        return done
    x = each[rank].copy()
    comm.all_reduce(x)
    record("all_reduce", x, total)
    if part == "first":
        return done
    record("all_gather", comm.all_gather(each[rank].copy()), np.stack(each))
    out = np.zeros((size, n), np.float32)
    record("all_gather out=", comm.all_gather(each[rank].copy(), out=out) is out and out, np.stack(each))
    record("reduce_scatter", comm.reduce_scatter(each[rank].copy()), total.reshape(size, -1)[rank])
    record("all_to_all", comm.all_to_all(blocks[rank].copy()), np.stack([b[rank] for b in blocks]))
    x = each[rank].copy()
    comm.broadcast(x, root)
    record("broadcast", x, each[root])
    x = each[rank].copy()
    comm.reduce(x, dst=root)
    record("reduce", x, total if rank == root else each[rank])
    record("gather", comm.gather(each[rank].copy(), dst=root), np.stack(each) if rank == root else None)
    record("scatter", comm.scatter(blocks[rank].copy(), src=root), blocks[root][rank])
    uneven(comm, n, turn, record)
    return done


def uneven(comm, n, turn, record):
    """all_gather_v and the uneven all_to_all of about n float32 a rank (rows of 2), against numpy."""
    size, rank = comm.size, comm.rank
    rows = [np.arange(2 * (n // 2 + r), dtype=np.float32).reshape(-1, 2) + 1000 * r + turn for r in range(size)]
    got, counts = comm.all_gather_v(rows[rank].copy())
    record("all_gather_v", counts == [len(r) for r in rows] and got, np.concatenate(rows))
    splits = [[(len(rows[r]) + j) // size for j in range(size)] for r in range(size)]
    starts = [np.cumsum([0] + s) for s in splits]
    want = np.concatenate([rows[r][starts[r][rank]:starts[r][rank + 1]] for r in range(size)])
    record("all_to_all_v", comm.all_to_all(rows[rank][:sum(splits[rank])].copy(), splits[rank]), want)


def loop_job(comm, form):
    """Three turns of every call past the small block, then of 2 elements (the small block
    again), then of calls past it alternating with calls of 2 elements, then past it once
    more, then one past it right after the switch back, then the uneven ones right after a
    switch to the large block; under ``form`` (per rank)."""
    n = (CARRY_BYTES + LARGE_CARRY_BYTES) // 2 // 4 // 12 * 12  # float32: 2.5 KiB, a multiple of 2 and 3
    with split_in_form(comm, form) as sub:
        past = [c for turn in range(3) for c in calls(sub, n, turn)]
        small = [c for turn in range(2) for c in calls(sub, 6, turn)]
        made = staged(sub)
        alternating = []
        for turn in range(3):
            for size in (n, 6):
                alternating += calls(sub, size, turn, "first")
        again = calls(sub, n, 5)  # (its last two calls, the uneven ones, did not want the large block)
        back = calls(sub, n, 7, "first")  # (right after the switch back: on the small block)
        ahead = calls(sub, n, 8, "first") + calls(sub, n, 9, "uneven")  # (the first switches: the uneven right after)
        return past, small, alternating, again + back + ahead, made, sub._transport.round.small_bytes > 0


def assert_switching(results, size):
    """What every rank of loop_job's ``results`` saw: numpy's results, and the switches below."""
    small_block, large_block = 8 * (3 + size) + CARRY_BYTES, 8 * (3 + size) + LARGE_CARRY_BYTES
    for past, small, alternating, again, made, large in results:
        assert [name for name, right, _ in past + small + alternating + again if not right] == []
        if not large:  # (the library's persistent all_gather is wrong, Intel MPI: the small block alone)
            assert {s for _, _, s in past + small + alternating + again} == {(0, small_block)}
            continue
        # the loop's first two calls on the small block (x through staged requests), the second
        # round's end switches every rank: every later call carried in the large block
        # (each turn: the uneven calls at its end switch back to the small block)
        turn = [(0, small_block), (1, small_block)] + [(1, large_block)] * 8 + [(0, large_block)]
        assert [s for _, _, s in past] == turn * 3, past
        assert made == ["all_gather", "all_reduce"], made
        # x of 2 elements: back to the small block after two rounds that did not want the large
        # one (the loop's last two calls, the uneven ones, never ask for it)
        assert {s for _, _, s in small} == {(0, small_block)}, small
        # strictly alternating sizes: every rank stays on the small block
        assert {s for _, _, s in alternating} == {(0, small_block)}, alternating
        assert [s for _, _, s in again][:3] == [(0, small_block), (1, small_block), (1, large_block)]
        # the uneven calls switch back; a call past the small block right after: on the small block
        # and the uneven ones right after the next switch to the large block: carried in it
        assert [s for _, _, s in again][-6:] == [(1, large_block), (0, large_block), (0, small_block),
                                                 (1, small_block), (1, large_block), (0, large_block)]
    # every rank on the same block after every call
    assert len({tuple(s for _, _, s in r[0] + r[1] + r[2] + r[3]) for r in results}) == 1


@WORLDS
@pytest.mark.parametrize("form", ["compiled", "python"])
def test_a_loop_of_calls_past_the_small_block_switches_every_rank_to_the_large_one_and_back(world, form):
    assert_switching(world.run(loop_job, [(form,)] * world.size, timeout=120), world.size)


@MPI_2
def test_ranks_of_both_forms_switch_together_and_give_numpys_results(world):
    # (the large block, the want and the switch are the Python form's as much as the compiled one's)
    assert_switching(world.run(loop_job, [("compiled",), ("python",)], timeout=120), world.size)


def mismatch_job(comm, case):
    """Two all_gathers past the small block (the large one from then on), then a mismatch there:
    ``shape`` (rank 1's x of another size, still within the large block), ``kind`` (rank 1 calls
    all_reduce); every rank's error and whether its x is as it was; then a call all ranks agree on,
    against numpy."""
    n = 768  # float32: 3 KiB
    with split_in_form(comm, "compiled") as sub:
        if case == "wanting":  # (on the small block: rank 1's x fits it, so rank 1 never wants the large one)
            errors = []
            for turn in range(3):
                try:
                    sub.all_gather(np.full(n if sub.rank == 0 else 6, turn, np.float32))
                except CollectiveMismatch as e:
                    errors.append(str(e))
            n = 6 * 128  # (then a call past the small block on every rank)
            after = sub.all_gather(np.full(n, sub.rank, np.float32))
            right = np.array_equal(after, np.stack([np.full(n, r, np.float32) for r in range(sub.size)]))
            return state(sub), len(errors), True, right
        for turn in range(2):
            sub.all_gather(np.full(n, turn, np.float32))
        before = state(sub)[0] if sub._transport.round.small_bytes else 1  # (Intel MPI: the small block alone)
        mine = n // 2 if case == "shape" and sub.rank == 1 else n
        x = np.arange(mine, dtype=np.float32) + sub.rank
        kept = x.copy()
        try:
            if case == "kind" and sub.rank == 1:
                sub.all_reduce(x)
            else:
                sub.all_gather(x)
            error = None
        except CollectiveMismatch as e:
            error = str(e)
        after = sub.all_gather(np.full(n, sub.rank, np.float32))
        right = np.array_equal(after, np.stack([np.full(n, r, np.float32) for r in range(sub.size)]))
        return before, error, np.array_equal(x, kept), right


@MPI_2
@pytest.mark.parametrize("case", ["shape", "kind"])
def test_a_mismatch_carried_in_the_large_block_raises_on_every_rank_with_x_untouched(world, case):
    for before, error, untouched, right in world.run(mismatch_job, [(case,)] * world.size, timeout=120):
        assert before == 1
        assert error is not None and ("shape" in error if case == "shape" else "operation" in error), error
        assert untouched and right


@MPI_2
def test_ranks_whose_mismatched_calls_want_different_blocks_stay_on_the_same_one(world):
    results = world.run(mismatch_job, [("wanting",)] * world.size, timeout=120)
    assert [(errors, right) for _, errors, _, right in results] == [(3, True)] * world.size
    assert results[0][0] == results[1][0] == (0, 40 + CARRY_BYTES)
