"""The example backend of docs/architecture.md (examples/threads_transport.py: ranks are
threads of one process) passes the contract: the dtype x op grid of every reduction against
the numpy reference, every collective of the set (the emulated ones included) against
numpy, point-to-point in both modes, split, and the call path's checks (a mismatch between
ranks is CollectiveMismatch on every rank)."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import numpy as np
import pytest
from grid import allowed_pairs, make_input

from collectives import CollectiveMismatch, ReduceOp
from collectives.testing.reference import check_reduction_result
from collectives.transport import Transport

PATH = Path(__file__).resolve().parents[2] / "examples" / "threads_transport.py"
_spec = importlib.util.spec_from_file_location("threads_transport", PATH)
assert _spec is not None and _spec.loader is not None
example = sys.modules["threads_transport"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

SIZES = (1, 2, 3)
PAIRS = [(dtype, op) for dtype, op in allowed_pairs() if dtype != "bfloat16"]  # numpy has none
pytestmark = pytest.mark.timeout(120)


def test_the_example_is_a_whole_backend_of_about_sixty_lines():
    cls = example.ThreadsTransport
    assert issubclass(cls, Transport) and not inspect.isabstract(cls)
    required = set(Transport.__abstractmethods__)
    assert required <= set(vars(cls)), sorted(required - set(vars(cls)))
    source, _ = inspect.getsourcelines(cls)
    assert len(source) <= 70, f"{len(source)} lines"


@pytest.mark.parametrize("size", SIZES)
def test_every_allowed_dtype_and_op_reduces_like_numpy(size):
    # block[j][r]: rank r's rows of reduce_scatter's block j (block 0: the other calls' input)
    inputs = {(d, op): [[make_input(7 + j, r, d, op) for r in range(size)] for j in range(size)]
              for d, op in PAIRS}

    def body(comm):
        got = {}
        for (d, op), blocks in inputs.items():
            got[d, op, "all_reduce"] = comm.all_reduce(blocks[0][comm.rank].copy(), op)
            x = blocks[0][comm.rank].copy()
            comm.reduce(x, op, dst=size - 1)
            got[d, op, "reduce"] = x
            rows = np.concatenate([block[comm.rank] for block in blocks])
            got[d, op, "reduce_scatter"] = comm.reduce_scatter(rows, op)
        return got

    results = run(size, body)
    for (d, op), blocks in inputs.items():
        per_rank = blocks[0]
        for r, got in enumerate(results):
            check_reduction_result(got[d, op, "all_reduce"], per_rank, d, op, f"rank {r} all_reduce")
            check_reduction_result(got[d, op, "reduce_scatter"], blocks[r], d, op, f"rank {r} reduce_scatter")
            if r == size - 1:
                check_reduction_result(got[d, op, "reduce"], per_rank, d, op, "reduce on dst")
            else:
                assert np.array_equal(got[d, op, "reduce"], per_rank[r], equal_nan=d != "bool" and "int" not in d)


@pytest.mark.parametrize("size", SIZES)
def test_the_collectives_that_move_data_match_numpy(size):
    def mine(rank, rows=None):
        return np.arange(size * 2, dtype=np.float32).reshape(size, 2)[: rows or size] + 100 * rank

    def body(comm):
        r = comm.rank
        return {
            "broadcast": comm.broadcast(mine(r), src=size - 1),
            "all_gather": comm.all_gather(mine(r)),
            "gather": comm.gather(mine(r), dst=0),
            "scatter": comm.scatter(mine(r), src=0),
            "all_to_all": comm.all_to_all(mine(r)),
            "all_gather_v": comm.all_gather_v(mine(r, r + 1)),
            "all_to_all_v": comm.all_to_all(np.full(size * (r + 1), r, np.int64),
                                            [r + 1] * size),
            "async": comm.all_gather(mine(r), async_op=True).wait(),
        }

    results = run(size, body)
    everyone = np.stack([mine(r) for r in range(size)])
    for r, got in enumerate(results):
        assert np.array_equal(got["broadcast"], mine(size - 1))
        assert np.array_equal(got["all_gather"], everyone)
        assert np.array_equal(got["async"], everyone)
        assert (got["gather"] is None) == (r != 0)
        if r == 0:
            assert np.array_equal(got["gather"], everyone)
        assert np.array_equal(got["scatter"], mine(0)[r])
        assert np.array_equal(got["all_to_all"], everyone[:, r])
        gathered, counts = got["all_gather_v"]
        assert counts == list(range(1, size + 1))
        assert np.array_equal(gathered, np.concatenate([mine(q, q + 1) for q in range(size)]))
        assert np.array_equal(got["all_to_all_v"], np.repeat(np.arange(size), np.arange(1, size + 1)))


@pytest.mark.parametrize("debug", ["0", "1"])
def test_send_recv_in_a_ring_and_split(debug, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_DEBUG", debug)

    def body(comm):
        n = comm.size
        got = np.zeros(3)
        pending = comm.recv(got, (comm.rank - 1) % n, tag=5, async_op=True)
        comm.send(np.full(3, float(comm.rank)), (comm.rank + 1) % n, tag=5)
        pending.wait()
        comm.barrier()
        half = comm.split(comm.rank % 2, key=-comm.rank)
        members = half.all_gather(np.array([comm.rank]))[:, 0].tolist()
        return got[0], members, half.rank

    results = run(3, body)
    assert [got for got, _, _ in results] == [2.0, 0.0, 1.0]
    assert [members for _, members, _ in results] == [[2, 0], [1], [2, 0]]
    assert [rank for _, _, rank in results] == [1, 0, 0]


def test_a_call_that_differs_between_ranks_is_a_mismatch_on_every_rank():
    def body(comm):
        comm.all_reduce(np.ones(3))
        try:
            comm.all_reduce(np.ones(2 + comm.rank), "max" if comm.rank else "sum")
        except CollectiveMismatch as error:
            return str(error)
        return None

    results = run(2, body)
    assert all(text and "all_reduce" in text for text in results), results


def test_bad_input_is_refused_before_anything_is_sent():
    def body(comm):
        with pytest.raises(TypeError, match="op"):
            comm.all_reduce(np.ones(2, dtype=bool), "sum")
        with pytest.raises(TypeError, match="numpy"):
            comm.all_reduce([1.0, 2.0])
        return comm.all_reduce(np.ones(2)).tolist()

    assert run(2, body) == [[2.0, 2.0], [2.0, 2.0]]


def run(size, body):
    return example.run_ranks(size, body)


def test_reduce_op_names_are_the_library_ones():
    assert set(example.UFUNCS) == set(ReduceOp)
