"""Dropped async handles (issue 15, item 1) on every backend: the calls still complete,
later results are right, split/close after a dropped handle work, handles waited out of
order return their own results, and many dropped handles run in bounded memory."""

from __future__ import annotations

import resource

import numpy as np
import pytest

from collectives.testing import worlds

BACKENDS = worlds((2,))


def _array(comm, value, n=4):
    if comm.backend == "torch":
        import torch

        return torch.full((n,), float(value))
    return np.full(n, value, np.float32)


def _list(x):
    return [float(v) for v in x.tolist()]


def dropped_job(comm):
    total = sum(range(1, comm.size + 1))
    for _ in range(10):  # the program: temporaries whose handles are dropped
        comm.all_reduce(_array(comm, 1.0), "sum", async_op=True)
        comm.broadcast(_array(comm, comm.rank + 5.0), 0, async_op=True)
    y = comm.all_reduce(_array(comm, comm.rank + 1.0))
    b = comm.broadcast(_array(comm, comm.rank + 7.0), 0)
    # Out of order: the second handle waited first, each returns its own array.
    first = comm.all_reduce(_array(comm, 1.0), async_op=True)
    second = comm.all_reduce(_array(comm, 2.0), async_op=True)
    out_of_order = (_list(second.wait()), _list(first.wait()))
    # A dropped handle, then split and close of the split, then the parent still works.
    comm.all_reduce(_array(comm, 3.0), async_op=True)
    sub = comm.split(0)
    sub.all_reduce(_array(comm, 4.0), async_op=True)
    sub.close()
    after = comm.all_reduce(_array(comm, comm.rank + 1.0))
    return _list(y), _list(b), out_of_order, _list(after), total


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", BACKENDS, indirect=True, ids=[b for b, _ in BACKENDS])
def test_dropped_handles_leave_later_results_right(world):
    for y, b, (second, first), after, total in world.run(dropped_job, [()] * world.size,
                                                         timeout=60):
        assert y == [float(total)] * 4
        assert b == [7.0] * 4
        assert second == [2.0 * world.size] * 4 and first == [1.0 * world.size] * 4
        assert after == [float(total)] * 4


def many_dropped_job(comm, count):
    def rss_mb():
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize() / 2**20

    for _ in range(1000):  # warm up the allocator and the transport
        comm.all_reduce(_array(comm, 1.0), async_op=True)
    comm.barrier()
    start = rss_mb()
    for _ in range(count):
        comm.all_reduce(_array(comm, 1.0), async_op=True)
    y = comm.all_reduce(_array(comm, comm.rank + 1.0))
    return rss_mb() - start, len(comm._pending), _list(y)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [("local", 1), ("mpi", 2)], indirect=True, ids=["local", "mpi"])
def test_many_dropped_handles_run_in_bounded_memory(world):
    """20,000 dropped handles: at most MAX_PENDING kept, RSS grows by a few MB at most.
    (torch keeps its own backlog of Works: docs/reliability.md.)"""
    from collectives.communicator import MAX_PENDING

    total = sum(range(1, world.size + 1))
    for grown, pending, y in world.run(many_dropped_job, [(20_000,)] * world.size, timeout=240):
        print(f"RSS grown by {grown:.1f} MB over 20,000 dropped handles; {pending} pending")
        assert pending <= MAX_PENDING
        assert grown < 20
        assert y == [float(total)] * 4


# A dropped handle's end step (AVG's division, a staged dtype's or a strided view's copy back, the
# float order keys of MIN/MAX) runs when the communicator reaps the completed handle: torch's Gloo
# once left the SUM in x for AVG. (call, op, dtype, contiguous) per case; x is a torch tensor.
FINISHED_CASES = [
    ("all_reduce", "avg", "float32", True),
    ("all_reduce", "avg", "bfloat16", True),
    ("all_reduce", "avg", "float64", False),
    ("all_reduce", "max", "bool", True),
    ("all_reduce", "sum", "int16", True),
    ("all_reduce", "min", "float32", True),
    ("broadcast", None, "float32", False),
]


def _case_values(rank, dtype, n=6):
    values = np.arange(n, dtype=np.float64) + 3 * rank - 4  # small integers: exact in every dtype
    return (values % 3 == 0) if dtype == "bool" else values


def dropped_finish_job(comm, cases):
    import torch

    results = []
    for call, op, dtype, contiguous in cases:
        values = torch.from_numpy(_case_values(comm.rank, dtype)).to(getattr(torch, dtype))
        if contiguous:
            x = values
        else:  # a strided view: the backend stages it and copies the result back
            x = torch.zeros(2 * values.numel(), dtype=values.dtype)[::2]
            x.copy_(values)
        if call == "all_reduce":
            comm.all_reduce(x, op, async_op=True)  # the handle dropped: never waited
        else:
            comm.broadcast(x, 0, async_op=True)
        results.append(x)
    # Blocking calls until every rank's communicator has reaped its dropped handles (at a call's
    # start); each rank makes as many as the others.
    for _ in range(10_000):
        if not comm.all_reduce(np.array([len(comm._pending)]), "max")[0]:
            break
    return [x.to(torch.float64).tolist() for x in results], len(comm._pending)


def _expected(call, op, dtype, size):
    import torch

    rows = np.stack([_case_values(rank, dtype) for rank in range(size)])
    if call == "broadcast":
        want = rows[0]
    else:
        want = {"avg": rows.mean(0), "sum": rows.sum(0), "min": rows.min(0), "max": rows.max(0)}[op]
    return torch.from_numpy(want).to(getattr(torch, dtype)).to(torch.float64).tolist()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", BACKENDS, indirect=True, ids=[b for b, _ in BACKENDS])
def test_a_dropped_handle_leaves_the_finished_result(world):
    pytest.importorskip("torch")
    for rank, (results, pending) in enumerate(world.run(dropped_finish_job, [(FINISHED_CASES,)] * world.size,
                                                        timeout=60)):
        assert pending == 0, rank
        for case, got in zip(FINISHED_CASES, results):
            assert got == _expected(*case[:3], world.size), (rank, case)


def dropped_debug_recv_job(comm):
    import os

    from collectives.config import DEBUG

    kept = os.environ.get(DEBUG)
    os.environ[DEBUG] = "1"  # (a communicator reads it when it is made)
    try:
        sub = comm.split(0)
    finally:
        os.environ.pop(DEBUG) if kept is None else os.environ.__setitem__(DEBUG, kept)
    sent = np.arange(5, dtype=np.float64) + 10
    x = np.zeros(5)
    handles = sub._handles.pending_p2p
    if sub.rank == 0:
        sub.send(sent, 1)
        dropped = None
    else:
        sub.recv(x, 0, async_op=True)  # the handle dropped: never waited
        dropped = handles[-1] if handles else None  # (None: reaped already, at its keeping)
    # Async sends and recvs until the dropped recv's handle is reaped (at the next one kept).
    token = np.zeros(1)
    for _ in range(1000):
        if not sub.all_reduce(np.array([dropped is not None and dropped in handles]), "max")[0]:
            break
        if sub.rank == 0:
            sub.send(token, 1, async_op=True)
        else:
            sub.recv(token, 0, async_op=True)
    received = x.tolist()
    sub.close()
    return sent.tolist(), received, sub.debug


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True, ids=["mpi"])
def test_a_dropped_debug_mode_recv_leaves_the_payload_in_x(world):
    """(mpi only: a Gloo recv's handle says it completed only once waited, so torch reaps a
    dropped one at close(), whose wait() copies the payload.)"""
    (sent, _, debug), (_, received, _) = world.run(dropped_debug_recv_job, [()] * world.size, timeout=60)
    assert debug
    assert received == sent
