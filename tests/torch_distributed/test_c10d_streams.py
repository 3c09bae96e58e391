"""The "collectives" torch backend over the cupy transport at 2 ranks under torchrun: an operation
on CUDA tensors is enqueued on the caller's stream by the caller's thread (no host wait, no CPU
collective on its path: the default check goes beside it on the communicator's CPU channel), and
a mismatch of calls raises CollectiveMismatch at the next call or wait on every rank.

CI has no GPU: collectives.testing.c10d_twin takes CPU tensors as the CUDA tensors of
collectives.testing.fake_cupy's device, whose NCCL moves their bytes over Gloo in the pool's
torchrun ranks; the group is made as the backend's creator makes it over cupy (the NCCL id and
the CPU channel on torch's store). References: numpy on every rank's inputs, computed here.
tests/gpu/test_c10d_streams_gpu.py asserts the same on real CUDA tensors.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.timeout(180)
WORLD = pytest.mark.parametrize("world", [("torch", 2)], indirect=True, ids=["torchrun-2"])
SETTLE = 30.0  # seconds a rank waits for the watchdog's verdict at most (a bug fails, not hangs)
#: What would make the calling thread wait for the device or talk to its peers on the host, as C
#: functions (the fake NCCL's own calls are left out: they stand in for the GPU's work).
HOST_CALLS = {"Allreduce", "Iallreduce", "Allgather", "Iallgather", "Barrier", "Wait", "Test", "allreduce",
              "allgather", "_allgather_base", "all_reduce", "all_gather", "broadcast", "barrier", "wait",
              "is_completed", "synchronize", "query", "sleep", "acquire"}
_groups = itertools.count()  # (every rank makes its groups in the same order: the same store prefixes)


def _data(seed, rank, shape):
    """Small integers: every sum is exact."""
    return np.random.default_rng([seed, rank]).integers(-4, 5, shape).astype(np.float32)


def _group():
    import datetime

    import torch.distributed as dist

    from collectives.testing.c10d_twin import twin_group

    store = dist.PrefixStore(f"c10d-streams/{next(_groups)}", dist.distributed_c10d._get_default_store())
    return twin_group(store, dist.get_rank(), dist.get_world_size(), datetime.timedelta(seconds=60))


def _close(pg):
    pg.shutdown()
    pg.comm.close()  # (every posted check compared first)


def blocking_job(comm, calls):
    """The first all_reduce (checked before it runs), then ``calls`` blocking all_reduces (each
    ``allreduce(...).wait()``, what ``dist.all_reduce`` does) profiled, then one whose future the
    watchdog completes: results, what the calling thread called on the host and asked of the
    device, and whether the posted checks were compared and agreed."""
    import torch
    import torch.distributed as dist

    from collectives.testing import fake_cupy

    with fake_cupy.installed() as device:
        pg = _group()
        r, opts = pg.rank(), dist.AllreduceOptions()
        pg.allreduce([torch.from_numpy(_data(99, r, (3,)))], opts).wait()
        xs = [torch.from_numpy(_data(i, r, (5,))) for i in range(calls)]
        me = threading.get_ident()
        before = device.host_waits, device.queries.get(me, 0)
        with fake_cupy.host_calls(HOST_CALLS) as called:
            for x in xs:
                pg.allreduce([x], opts).wait()
        waits, queries = device.host_waits - before[0], device.queries.get(me, 0) - before[1]
        last = torch.from_numpy(_data(calls, r, (4,)))
        future = pg.allreduce([last], opts).get_future()
        completed_by = []
        future.then(lambda f: completed_by.append(threading.get_ident()))
        value = future.wait()
        posted = pg.comm._transport._posted
        rounds, failed = posted.rounds, posted.failed
        _close(pg)
        return dict(got=[x.numpy().copy() for x in xs], future=[t.numpy().copy() for t in value],
                    off_thread=bool(completed_by) and me not in completed_by, called=called,
                    waits=waits, queries=queries, compared=rounds, failed=failed)


@WORLD
def test_blocking_all_reduces_equal_numpy_with_no_host_wait_and_no_cpu_collective(world):
    calls = 40
    for rank, result in enumerate(world.run(blocking_job, args=(calls,), timeout=120)):
        for i, got in enumerate(result["got"]):
            np.testing.assert_array_equal(got, _data(i, 0, (5,)) + _data(i, 1, (5,)), err_msg=f"rank {rank}, call {i}")
        np.testing.assert_array_equal(result["future"][0], _data(calls, 0, (4,)) + _data(calls, 1, (4,)))
        assert result["off_thread"], result  # (the future completed on a completer thread)
        # the calling thread neither waited nor made a CPU collective: the checks went beside
        assert result["called"] == [] and result["waits"] == 0 and result["queries"] == 0, result
        assert result["compared"] >= 1 and result["failed"] is False, result


def mismatch_job(comm, wait):
    """Two matched all_reduces (calls #2 and #3: #1 split the worker's communicator off), then one
    of another shape on rank 1: whether the NCCL communicator was aborted, and what the next call
    (``wait``: the mismatched call's wait()) raises."""
    import torch
    import torch.distributed as dist

    from collectives import CollectiveMismatch
    from collectives.c10d.streams import failure_of
    from collectives.context import poll_until
    from collectives.diagnostics.recorder import clock
    from collectives.testing import fake_cupy

    with fake_cupy.installed():
        pg = _group()
        r, opts = pg.rank(), dist.AllreduceOptions()
        x = torch.from_numpy(_data(1, r, (8,)))
        pg.allreduce([x], opts).wait()
        pg.allreduce([x], opts).wait()  # a posted check that agrees
        work = pg.allreduce([torch.ones(8 if r == 0 else 6)], opts)
        aborted = pg.comm.nccl_comm.aborted.wait(SETTLE)  # (the watchdog found it off this thread)
        assert poll_until(lambda: failure_of(pg.comm) is not None, clock() + SETTLE), "no verdict"
        with pytest.raises(CollectiveMismatch) as error:
            work.wait() if wait else pg.allreduce([x], opts)
        _close(pg)
        return aborted, str(error.value)


@WORLD
@pytest.mark.parametrize("wait", [False, True], ids=["next-call", "wait"])
def test_a_mismatch_on_rank_1_raises_at_the_next_call_or_wait_on_every_rank(world, wait):
    for rank, (aborted, raised) in enumerate(world.run(mismatch_job, args=(wait,), timeout=120)):
        assert aborted, rank
        assert "all_reduce call #4" in raised and "shape differs: (8,) on rank 0; (6,) on rank 1" in raised, raised
