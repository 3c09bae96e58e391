"""The "collectives" torch backend over the cupy transport at 2 ranks under torchrun: an operation
on CUDA tensors is enqueued on the caller's stream by the caller's thread (no host wait, no CPU
collective on its path: the default check goes beside it on the communicator's CPU channel), and
a mismatch of calls raises CollectiveMismatch at the next call or wait on every rank.

CI has no GPU: collectives.testing.c10d_twin takes CPU tensors as the CUDA tensors of
collectives.testing.fake_cupy's device, whose NCCL moves their bytes over Gloo in the pool's
torchrun ranks; the group is made as the backend's creator makes it over cupy (the NCCL id and
the CPU channel on torch's store). References: numpy on every rank's inputs, computed here. The
same jobs run on real CUDA tensors (``cuda=True``: a ``new_group(backend="collectives")`` over
cupy) in tests/gpu/test_gpu.py.
"""

from __future__ import annotations

import contextlib
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
              "is_completed", "synchronize", "_cuda_synchronize", "query", "sleep", "acquire"}
_groups = itertools.count()  # (every rank makes its groups in the same order: the same store prefixes)


def _data(seed, rank, shape):
    """Small integers: every sum is exact."""
    return np.random.default_rng([seed, rank]).integers(-4, 5, shape).astype(np.float32)


@contextlib.contextmanager
def _group(cuda):
    """A "collectives" group over cupy, and what the device was asked (``host_waits``, ``queries``
    by thread: the fake's; on CUDA the profile of the calls alone tells): the twin's (CPU tensors on
    the fake device), or on CUDA a ``new_group`` over cupy (the default group made first); closed after."""
    import datetime

    import torch.distributed as dist

    from collectives.testing import fake_cupy

    if cuda:
        import collectives.c10d

        if not dist.is_initialized():
            collectives.c10d.init_process_group()
        pg = dist.new_group(backend="collectives")
        try:
            yield pg, fake_cupy.Device()  # (nothing counts on it: the profile does)
        finally:
            dist.destroy_process_group(pg)
            pg.comm.close()
        return
    from collectives.testing.c10d_twin import twin_group

    with fake_cupy.installed() as device:
        store = dist.PrefixStore(f"c10d-streams/{next(_groups)}", dist.distributed_c10d._get_default_store())
        pg = twin_group(store, dist.get_rank(), dist.get_world_size(), datetime.timedelta(seconds=60))
        try:
            yield pg, device
        finally:
            pg.shutdown()
            pg.comm.close()  # (every posted check compared first)


def _tensor(values, cuda):
    import torch

    t = torch.from_numpy(values)
    return t.cuda() if cuda else t


def _stream_waits(function):
    """A CUDA event's ``wait(stream)``: the stream waits for it, the host does not."""
    import torch

    return function.__name__ == "wait" and isinstance(getattr(function, "__self__", None), torch.cuda.Event)


def blocking_job(comm, calls, cuda=False):
    """The first all_reduce (checked before it runs), then ``calls`` blocking all_reduces (each
    ``allreduce(...).wait()``, what ``dist.all_reduce`` does) profiled, then one whose future the
    watchdog completes: results, what the calling thread called on the host and asked of the
    device, and whether the posted checks were compared and agreed (at 2 ranks)."""
    import torch.distributed as dist

    from collectives.testing import fake_cupy

    with _group(cuda) as (pg, device):
        r, opts = pg.rank(), dist.AllreduceOptions()
        pg.allreduce([_tensor(_data(99, r, (3,)), cuda)], opts).wait()
        xs = [_tensor(_data(i, r, (5,)), cuda) for i in range(calls)]
        me = threading.get_ident()
        before = device.host_waits, device.queries.get(me, 0)
        events = []  # (each operation's event: pooled, the one before's once its handle is gone)
        with fake_cupy.host_calls(HOST_CALLS, _stream_waits if cuda else None) as called:
            for x in xs:
                work = pg.allreduce([x], opts)
                work.wait()
                events.append(work._end._event)
                del work
        waits, queries = device.host_waits - before[0], device.queries.get(me, 0) - before[1]
        last = _tensor(_data(calls, r, (4,)), cuda)
        # (the device held busy, so the future cannot complete before its callback is added)
        if cuda:
            import torch

            torch.cuda._sleep(200_000_000)
        else:
            device.stalled = True
        work = pg.allreduce([last], opts)
        future = work.get_future()
        pending, completed_by = not future.done() and not work.is_completed(), []
        chained = future.then(lambda f: completed_by.append(threading.get_ident()))
        device.resume()
        chained.wait()
        value = future.wait()
        pending = pending and work.is_completed() and work.is_success()  # (and completed now)
        posted = pg.comm._transport._posted
        rounds, failed = (posted.rounds, posted.failed) if posted is not None else (0, None)
        return dict(got=[x.cpu().numpy().copy() for x in xs], future=[t.cpu().numpy().copy() for t in value],
                    off_thread=pending and bool(completed_by) and me not in completed_by, called=list(called),
                    waits=waits, queries=queries, compared=rounds, failed=failed, size=pg.size(),
                    events=len({id(event) for event in events}))


def check_blocking(results, calls):
    """:func:`blocking_job`'s results: numpy's sums, and nothing on the calling thread."""
    size = len(results)
    for rank, result in enumerate(results):
        for i, got in enumerate(result["got"]):
            want = np.sum([_data(i, peer, (5,)) for peer in range(size)], axis=0)
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}, call {i}")
        want = np.sum([_data(calls, peer, (4,)) for peer in range(size)], axis=0)
        np.testing.assert_array_equal(result["future"][0], want)
        assert result["off_thread"], result  # (the future completed on a completer thread)
        # the calling thread neither waited nor made a CPU collective: the checks went beside
        assert result["called"] == [] and result["waits"] == 0 and result["queries"] == 0, result
        assert result["events"] == 1, result  # one event, reused by every operation
        if size > 1:
            assert result["compared"] >= 1 and result["failed"] is False, result


@WORLD
def test_blocking_all_reduces_equal_numpy_with_no_host_wait_and_no_cpu_collective(world):
    check_blocking(world.run(blocking_job, args=(40,), timeout=120), 40)


def mismatch_job(comm, how, wait, cuda=False):
    """Two matched all_reduces (calls #2 and #3: #1 split the worker's communicator off), then one
    that differs on rank 1 (``how``: its shape, or its reduce op): whether the NCCL communicator was
    aborted, and what the next call (``wait``: the mismatched call's wait()) raises."""
    import torch.distributed as dist

    from collectives import CollectiveMismatch
    from collectives.c10d.streams import failure_of
    from collectives.context import poll_until
    from collectives.diagnostics.recorder import clock

    with _group(cuda) as (pg, _):
        r, opts = pg.rank(), dist.AllreduceOptions()
        x = _tensor(_data(1, r, (8,)), cuda)
        pg.allreduce([x], opts).wait()
        pg.allreduce([x], opts).wait()  # a posted check that agrees
        other = dist.AllreduceOptions()
        if how == "op" and r == 1:
            other.reduceOp = dist.ReduceOp.MAX
        work = pg.allreduce([_tensor(np.ones(8 if how == "op" or r == 0 else 6, np.float32), cuda)], other)
        aborted = pg.comm.nccl_comm.aborted.wait(SETTLE) if not cuda else None  # (the fake's log)
        assert poll_until(lambda: failure_of(pg.comm) is not None, clock() + SETTLE), "no verdict"
        with pytest.raises(CollectiveMismatch) as error:
            work.wait() if wait else pg.allreduce([x], opts)
        return aborted, str(error.value)


def check_mismatch(results, difference, cuda=False):
    for rank, (aborted, raised) in enumerate(results):
        assert cuda or aborted, rank  # (the watchdog found it off the calling thread, and aborted NCCL)
        assert "all_reduce call #4" in raised and difference in raised, raised


@WORLD
@pytest.mark.parametrize("how, wait, difference", [
    ("shape", False, "shape differs: (8,) on rank 0; (6,) on rank 1"),
    ("op", True, "reduce op differs: SUM on rank 0; MAX on rank 1"),
], ids=["shape-next-call", "op-wait"])
def test_a_mismatch_on_rank_1_raises_at_the_next_call_or_wait_on_every_rank(world, how, wait, difference):
    check_mismatch(world.run(mismatch_job, args=(how, wait), timeout=120), difference)


def barrier_job(comm):
    """An all_reduce enqueued on the caller's stream while the device is held, then a barrier (it
    runs on the group's worker, on the worker's communicator: it has no tensor): whether the barrier
    had started (its call number taken) when the worker was first waiting, and after the device
    resumed."""
    import torch.distributed as dist

    from collectives.context import poll_until
    from collectives.diagnostics.recorder import clock

    with _group(False) as (pg, device):
        r, opts = pg.rank(), dist.AllreduceOptions()
        pg.allreduce([_tensor(_data(99, r, (3,)), False)], opts).wait()
        x = _tensor(_data(1, r, (5,)), False)
        device.stalled = True
        pg.allreduce([x], opts)
        worker = pg._worker.comm  # (the worker's communicator, split off the group's)
        seq, waits = worker._seq, device.host_waits
        work = pg.barrier()
        waited = poll_until(lambda: device.host_waits > waits, clock() + SETTLE)  # (the worker's wait)
        started = worker._seq != seq or work.is_completed()
        device.resume()
        work.wait()
        return dict(waited=waited, started=started, after=worker._seq - seq, got=x.numpy().copy())


@WORLD
def test_a_barrier_starts_after_the_nccl_calls_on_the_callers_stream(world):
    """NCCL runs one communicator's calls in the order they were made: a barrier launched beside
    an all_reduce still queued on the caller's stream could hang. The barrier waits for it."""
    results = world.run(barrier_job, timeout=120)
    want = np.sum([_data(1, peer, (5,)) for peer in range(len(results))], axis=0)
    for rank, result in enumerate(results):
        assert result["waited"] and not result["started"], (rank, result)
        assert result["after"] == 1, (rank, result)
        np.testing.assert_array_equal(result["got"], want)
