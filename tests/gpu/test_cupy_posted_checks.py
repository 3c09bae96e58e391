"""The cupy route's default check at 2 ranks, beside the calls (backends/cupy_host.py): a call on a
CUDA stream makes no host wait and no CPU collective on the calling thread; the watchdog thread
compares the ranks' check words on a CPU channel of their own (an MPI communicator under mpiexec, a
Gloo group under torchrun); a mismatch aborts the NCCL communicator and every rank raises
CollectiveMismatch at its next call.

CI has no GPU: collectives.testing.fake_cupy stands CuPy in on host memory, its NCCL communicator
at world 2 moving the arrays' bytes over MPI under the pool's mpiexec, over Gloo under its torchrun
(a twin over a real transport); the cupy world communicator is made as collectives.init("cupy")
makes it (the NCCL id over MPI, or through torchrun's store). References: numpy on every rank's inputs, computed here.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from collectives import ReduceOp
from collectives.testing import fake_cupy

pytestmark = pytest.mark.timeout(240)
#: Under mpiexec the CPU channel is an MPI communicator, under torchrun a Gloo group on the store.
WORLDS = pytest.mark.parametrize("world", [("mpi", 2), ("torch", 2)], indirect=True, ids=["mpiexec-2", "torchrun-2"])

SETTLE = 30.0  # seconds a rank waits for the watchdog's verdict at most (a bug fails, not hangs)
#: What would make the calling thread wait or talk to its peers on the host: MPI's calls and the
#: fake device's waits (the twin's own NCCL calls are left out: they stand in for the GPU's work).
HOST_CALLS = {"Allreduce", "Iallreduce", "Allgather", "Iallgather", "allreduce", "allgather", "Barrier",
              "Wait", "Test", "Waitall", "Testall", "synchronize", "sleep", "wait", "all_reduce", "all_gather",
              "_allgather_base", "is_completed"}


def _data(seed, rank, shape, dtype="float32"):
    """Small integers: every sum is exact."""
    return np.random.default_rng([seed, rank]).integers(-4, 5, shape).astype(dtype)


def _cupy_world(timeout=60.0):
    """The cupy world communicator, as collectives.init("cupy") makes it under mpiexec."""
    from collectives.backends.cupy_nccl import CupyNcclCommunicator

    from collectives.launcher import detect_launcher

    return CupyNcclCommunicator.from_launcher(detect_launcher(), timeout=timeout)


def matched_job(comm, calls):
    """The first call (checked before it runs), then ``calls`` blocking all_reduces and
    all_gathers profiled: their results, what the calling thread called on the host, whether a
    barrier then waited for the GPU, and whether the watchdog compared the checks (at close) and
    found nothing."""
    with fake_cupy.installed() as device:
        import cupy

        gpu = _cupy_world()
        r = gpu.rank
        gpu.all_reduce(cupy.asarray(_data(99, r, (3,))))
        xs = [cupy.asarray(_data(i, r, (5,) if i % 2 else (3, 2), "float32" if i % 2 else "int32"))
              for i in range(calls)]
        got, before = [], (device.host_waits, device.queries.get(threading.get_ident(), 0))
        with fake_cupy.host_calls(HOST_CALLS) as called:
            for i, x in enumerate(xs):
                got.append(gpu.all_reduce(x) if i % 2 else gpu.all_gather(x))
        waits, queries = device.host_waits - before[0], device.queries.get(threading.get_ident(), 0) - before[1]
        gpu.barrier()  # (checked on the CPU channel, and still a wait on the host for the GPU)
        barrier_waited = device.queries.get(threading.get_ident(), 0) - before[1] > queries
        posted = getattr(gpu._transport, "_posted", None)
        gpu.close()  # every posted check compared first
        return dict(got=[x.host.copy() for x in got], called=called, waits=waits, queries=queries,
                    compared=getattr(posted, "rounds", 0), failed=getattr(posted, "failed", None),
                    barrier_waited=barrier_waited)


@WORLDS
def test_the_cupy_route_at_two_ranks_equals_numpy_with_no_host_wait_and_no_cpu_collective(world):
    calls = 40
    results = world.run(matched_job, args=(calls,), timeout=120)
    for rank, result in enumerate(results):
        for i, got in enumerate(result["got"]):
            if i % 2:
                want = np.sum([_data(i, peer, (5,)) for peer in range(2)], axis=0)
            else:
                want = np.stack([_data(i, peer, (3, 2), "int32") for peer in range(2)])
            np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}, call {i}")
        # the calling thread neither waited nor made a CPU collective: the checks went beside
        assert result["called"] == [] and result["waits"] == 0 and result["queries"] == 0, result
        assert result["compared"] >= 1 and result["failed"] is False, result
        assert result["barrier_waited"], result


def mismatch_job(comm, how):
    """Two matched calls, then one that differs between the ranks as ``how`` says: whether the
    NCCL communicator was aborted, and what the next call (or the mismatched call's handle's
    wait()) raises."""
    from collectives import CollectiveMismatch
    from collectives.context import poll_until
    from collectives.diagnostics.recorder import clock

    with fake_cupy.installed():
        import cupy

        gpu = _cupy_world()
        r = gpu.rank
        nccl_comm = gpu.nccl_comm
        x = cupy.asarray(_data(1, r, (8,)))
        gpu.all_reduce(x)
        gpu.all_reduce(x)  # a posted check that agrees
        handle = None
        if how == "shape":
            gpu.all_reduce(cupy.asarray(np.ones(8 if r == 0 else 6, dtype=np.float32)))
        elif how == "op":
            gpu.all_reduce(cupy.asarray(np.ones(4, dtype=np.float32)), "sum" if r == 0 else "max")
        else:  # the mismatched call's handle, waited after the verdict
            handle = gpu.all_reduce(cupy.asarray(np.ones(4, dtype=np.float32 if r == 0 else np.int32)),
                                    async_op=True)
        aborted = nccl_comm.aborted.wait(SETTLE)  # (the watchdog found it off this thread)
        assert poll_until(lambda: gpu._broken is not None, clock() + SETTLE), "no verdict"
        with pytest.raises(CollectiveMismatch) as error:
            handle.wait() if handle is not None else gpu.all_reduce(x)
        gpu.close()
        return aborted, str(error.value)


@WORLDS
@pytest.mark.parametrize("how, difference", [
    ("shape", "shape differs: (8,) on rank 0; (6,) on rank 1"),
    ("op", "reduce op differs: SUM on rank 0; MAX on rank 1"),
    ("wait", "dtype differs: float32 on rank 0; int32 on rank 1"),
])
def test_a_cupy_mismatch_aborts_nccl_and_every_rank_raises_it_at_its_next_call(world, how, difference):
    for rank, (aborted, raised) in enumerate(world.run(mismatch_job, args=(how,), timeout=120)):
        assert aborted, rank
        assert "all_reduce call #3" in raised and difference in raised, raised


def kept_kinds_job(comm, calls):
    """After the first call, ``calls`` blocking all_reduces of one kind, then one of another, each
    posted check seen as the transport takes it: (how many, the field counts, whether the words and
    numbers are ints, how many distinct kind objects the loop posted, the last call's kind)."""
    with fake_cupy.installed():
        import cupy

        gpu = _cupy_world()
        r = gpu.rank
        x, y = cupy.asarray(_data(1, r, (8,))), cupy.asarray(_data(2, r, (4,), "int32"))
        gpu.all_reduce(x)  # (checked before it runs)
        gpu.all_reduce(x)  # (the first posted: the transport starts posting)
        transport = gpu._transport
        seen = []
        post_to = transport._post_to

        def spy(fields):
            seen.append(fields)
            post_to(fields)

        transport._post_to = spy
        for _ in range(calls):
            gpu.all_reduce(x)
        gpu.all_reduce(y, "max")
        transport._post_to = post_to
        gpu.close()
        return (len(seen), sorted({len(fields) for fields in seen}),
                all(type(fields[0]) is int and type(fields[1]) is int for fields in seen),
                len({id(fields[2]) for fields in seen[:-1]}), seen[-1][2][:5])


@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True)
def test_a_posted_check_keeps_no_object_of_its_own_but_its_kind_made_once(world):
    """What a posted check leaves on the queue until the watchdog compares it: its word and number
    (ints) and its kind of call, one tuple per kind (so a program's calls in flight make nothing
    the garbage collector walks)."""
    for posted, fields, ints, kinds, last in world.run(kept_kinds_job, args=(20,), timeout=120):
        assert (posted, fields, ints, kinds) == (21, [3], True, 1)
        assert last == ("all_reduce", ReduceOp.MAX, -1, "int32", (4,)), last
