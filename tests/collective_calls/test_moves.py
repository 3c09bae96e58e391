"""The fast paths of the MPI collectives of even shapes (backends/mpi_moves.py's Move) in both forms:
compiled (collectives.backends._moves_c, what the test set-up builds) and Python
(COLLECTIVES_COMPILED=0), under a timeout (the nonblocking calls, their polls, the channel's wait;
a small call through its staged persistent request) and without one (the blocking calls), the
compiled form calling MPI directly, the Python form through mpi4py: every
result equals numpy's on every rank's input, with and without out= (numpy arrays and CPU tensors),
at every root; ranks of the two forms run the same calls together."""

import time

import numpy as np
import pytest
import torch
from forms import made_in_form, split_in_form

WORLDS = pytest.mark.parametrize("world", [("mpi", 2), ("mpi", 3)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
OPS = ["all_reduce", "broadcast", "reduce", "reduce_scatter", "all_gather", "all_to_all", "gather", "scatter"]
#: Elements of float32 a rank's x has: 2 KiB (under a timeout, staged: past the check's carried
#: bytes, within the staged ones) and 24 KiB (the plain MPI call).
COUNTS = [504, 6144]


def given(op, rank, size, count, root):
    """What rank ``rank`` passes to ``op`` (small integers: every sum is exact in float32)."""
    rows = count // (size * 2) * size if op in ("reduce_scatter", "scatter", "all_to_all") else count
    x = (np.arange(rows * 2) % 7 + rank * 3 + root).astype(np.float32).reshape(rows, 2)
    if op == "scatter" or op == "all_to_all":
        x = x.reshape(size, -1, 2)
    return x


def reference(op, inputs, rank, root):
    """numpy's result of ``op`` on every rank's input, on ``rank`` (None where it gets none)."""
    size, stack = len(inputs), np.stack(inputs).astype(np.float64)
    if op == "all_reduce":
        return stack.sum(0)
    if op == "broadcast":
        return stack[root]
    if op == "reduce":
        return stack.sum(0) if rank == root else stack[rank]
    if op == "reduce_scatter":
        total = stack.sum(0)
        n = total.shape[0] // size
        return total[rank * n:(rank + 1) * n]
    if op == "all_gather":
        return stack
    if op == "gather":
        return stack if rank == root else None
    if op == "scatter":
        return stack[root][rank]
    return stack[:, rank]  # all_to_all: row j of the result is what rank j sent here


def moves_job(comm, form, timeout):
    """Every op at every root, size and array kind, with and without out=, on a split in ``form``:
    the results (as float64 lists, None where none) and the fast paths' modules."""
    results, modules = [], set()
    with split_in_form(comm, form) as sub:
        sub.timeout = timeout
        size, rank = sub.size, sub.rank
        for op in OPS:
            for count in COUNTS:
                for root in range(size) if op in ("broadcast", "reduce", "gather", "scatter") else [0]:
                    for kind in ("numpy", "torch"):
                        for with_out in (False, True):
                            x = given(op, rank, size, count, root)
                            want = reference(op, [given(op, r, size, count, root) for r in range(size)], rank, root)
                            out = None
                            if with_out and op not in ("all_reduce", "broadcast", "reduce") and want is not None:
                                out = np.full(want.shape, -1, np.float32)
                            if kind == "torch":
                                x = torch.from_numpy(x)
                                out = None if out is None else torch.from_numpy(out)
                            call = getattr(sub, op)
                            args = (root,) if op in ("broadcast", "gather", "scatter") else \
                                ("sum", root) if op == "reduce" else ()
                            got = call(x, *args) if out is None else call(x, *args, out=out)
                            if out is not None:
                                assert got is out
                            same = got is None and want is None or got is not None and want is not None and \
                                np.array_equal(np.asarray(got, np.float64), want)
                            results.append((op, count, root, kind, with_out, same))
        moves = [plan.fast.__self__ for (call, *_), plan in sub._plans.items()
                 if call.name in OPS and getattr(plan.fast, "__self__", None) is not None]
        modules = sorted({type(move).__module__ for move in moves})
        direct = sorted({move.direct for move in moves})
        staged = sum(len(table) for table in sub._transport._staged_tables.values())
        sub.barrier()
    return results, modules, staged, direct


@WORLDS
@pytest.mark.parametrize("timeout", [30, None], ids=["timeout", "blocking"])
@pytest.mark.parametrize("forms", ["compiled", "python", "mixed"])
def test_the_even_collectives_equal_numpy_in_both_forms(world, timeout, forms):
    size = world.size
    each = [forms if forms != "mixed" else ("compiled", "python")[r % 2] for r in range(size)]
    results = world.run(moves_job, [(form, timeout) for form in each], timeout=120)
    for rank, (rows, modules, staged, direct) in enumerate(results):
        assert (staged > 0) == (timeout is not None)  # (small calls under a timeout: staged)
        assert len(rows) == 8 * (4 + 4 * size)  # (every case ran: 2 counts x 2 kinds x 2 outs a root)
        assert [row[:5] for row in rows if not row[5]] == []  # (numpy's result on every rank)
        assert modules == ["collectives.backends._moves_c" if each[rank] == "compiled"
                           else "collectives.backends.mpi_moves"]
        # (compiled: MPI called directly, on this 64-bit little-endian Linux; Python: mpi4py's calls)
        assert direct == [each[rank] == "compiled"]


#: Communicators left timed out in a job: never freed while a rank's call may still be pending.
_KEEP = []


@pytest.fixture(scope="module")
def timeout_world():
    """Two MPI ranks of their own: a timeout makes every communicator of the rank's transport
    unusable, the pool's own included."""
    from collectives.testing import RankPool

    pool = RankPool("mpi", 2, job_timeout=30)
    pool.start()
    yield pool
    pool.close()


def timeout_job(comm, form):
    """A gather of 24 KiB (the check off: the fast path's MPI call alone) that both ranks make, then
    one that rank 1 never joins: rank 0's fast path waits, times out. What rank 0 saw: the first
    result right, the error, its time, and whether the Move's request is a new one after it (the old
    one kept by the channel, which MPI may still write)."""
    from collectives import CollectiveTimeout

    with made_in_form(form):
        sub = comm.split(0)
    _KEEP.append(sub)
    sub._checking, sub.timeout = False, 1.0  # (COLLECTIVES_DEBUG=0's switch)
    x = np.arange(6144, dtype=np.float32) + comm.rank
    out = np.zeros((2, 6144), np.float32) if comm.rank == 0 else None
    sub.gather(x, 0, out=out)
    right = out is None or np.array_equal(out, np.stack([np.arange(6144), np.arange(6144) + 1]))
    if comm.rank == 1:
        return right, None, None, None
    move = next(plan.fast.__self__ for (call, *_), plan in sub._plans.items() if call.name == "gather")
    before = move.request
    start = time.perf_counter()
    try:
        sub.gather(x, 0, out=out)
        outcome = "no error"
    except CollectiveTimeout:
        outcome = "CollectiveTimeout"
    elapsed = time.perf_counter() - start
    renewed = move.request is not before and any(r is before for r in sub._transport._abandoned)
    return right, outcome, elapsed, (move.direct, renewed)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["compiled", "python"])
def test_a_fast_path_call_a_peer_never_joins_times_out(timeout_world, form):
    results = timeout_world.run(timeout_job, [(form,)] * 2, timeout=60)
    assert results[0][0] and results[1][0]  # (the call both made: numpy's result)
    _, outcome, elapsed, (direct, renewed) = results[0]
    assert outcome == "CollectiveTimeout" and 1.0 <= elapsed < 6.0, results
    # compiled: MPI_Igather's request in the Move's mpi4py Request, handed to the channel, a new one made
    assert direct == (form == "compiled") and renewed == direct, results


def test_a_compiled_move_without_mpi4pys_handle_helpers_makes_mpi4pys_calls():
    """bind_direct on an MPI module without _sizeof, _handleof and _addressof: not bound (the
    Move makes mpi4py's calls), no error."""
    from types import SimpleNamespace

    from collectives.backends import mpi_moves

    from collectives import config

    module = config.compiled_extension("collectives.backends._moves_c", mpi_moves)
    if module is None:
        pytest.skip("backends/mpi_moves.py was not compiled")
    channel = SimpleNamespace(_MPI=SimpleNamespace(Request=object), _byte=None, _in_place=None, rank=0, size=1,
                              _comm=None)

    def Gather(*args):  # (the name a Move binds MPI_Gather by)
        raise AssertionError("not called here")

    move = module.Move(channel, mpi_moves.GATHER, Gather, Gather, None, None, None, True, False, 1 << 30)
    assert move.direct is False
