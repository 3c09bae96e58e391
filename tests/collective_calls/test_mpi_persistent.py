"""MPI-4 persistent collectives cached per kind of call and buffer (backends/mpi_persistent.py):
made only when every rank agrees, started on every rank alike, right against numpy, released
when the buffer goes or the cache closes, and never a warning of MPICH's on stderr."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from collectives.backends.mpi_carried import CARRY_BYTES

BIN = Path(sys.executable).parent
MPI_2 = pytest.mark.parametrize("world", [("mpi", 2)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")


def _address(x):
    return x.__array_interface__["data"][0]


class _Caller:
    """all_reduce (SUM, float64) through the cache when the ranks agree, else MPI_Allreduce:
    the agreement is a plain MPI_Allreduce (BAND) of the bits, as the call path's check word."""

    def __init__(self, comm):
        from collectives.backends.mpi_persistent import PersistentCollectives
        from mpi4py import MPI

        self.MPI, self.comm = MPI, comm.mpi_comm
        self.cache = PersistentCollectives(self.comm, MPI)
        self.starts = 0

    def __call__(self, x, kind=("all_reduce", "float64")):
        MPI, comm = self.MPI, self.comm
        bits = comm.allreduce(self.cache.bits(kind, x, _address(x)), MPI.BAND)
        request = self.cache.agreed(bits, kind, x, _address(x),
                                    lambda: comm.Allreduce_init(MPI.IN_PLACE, [x, MPI.DOUBLE], MPI.SUM))
        if request is None:
            comm.Allreduce(MPI.IN_PLACE, [x, MPI.DOUBLE], MPI.SUM)
            return "plain"
        request.Wait()
        self.starts += 1
        return "persistent"


def same_buffer_job(comm):
    call = _Caller(comm)
    if not call.cache.available:
        return None
    x = np.arange(5, dtype=np.float64) * (comm.rank + 1)
    ways = [call(x) for _ in range(4)]
    return ways, x.copy(), len(call.cache)


@MPI_2
def test_a_buffer_used_twice_goes_persistent_on_every_rank_and_sums_right(world):
    results = world.run(same_buffer_job)
    if results[0] is None:
        pytest.skip("this MPI has no persistent collectives (MPI < 4)")
    # first call: nothing to agree on; second: the same buffer everywhere, made; then started
    want = np.arange(5, dtype=np.float64) * sum(r + 1 for r in range(world.size)) * world.size ** 3
    for ways, x, held in results:
        assert ways == ["plain", "persistent", "persistent", "persistent"]
        np.testing.assert_array_equal(x, want)
        assert held == 1


def one_rank_changes_buffers_job(comm):
    call = _Caller(comm)
    if not call.cache.available:
        return None
    ways, sums = [], []
    x = np.ones(3)
    for _ in range(4):
        if comm.rank == 0:
            x = np.ones(3)  # a new array each call on rank 0 only
        else:
            x[...] = 1
        ways.append(call(x))
        sums.append(x.copy())
    return ways, sums, len(call.cache)


@MPI_2
def test_no_persistent_request_unless_every_rank_keeps_its_buffer(world):
    results = world.run(one_rank_changes_buffers_job)
    if results[0] is None:
        pytest.skip("this MPI has no persistent collectives (MPI < 4)")
    for ways, sums, held in results:
        assert ways == ["plain"] * 4 and held == 0
        for got in sums:
            np.testing.assert_array_equal(got, np.full(3, world.size, dtype=np.float64))


def release_job(comm):
    call = _Caller(comm)
    if not call.cache.available:
        return None
    x = np.ones(2)
    call(x)
    call(x)  # made
    held_before = len(call.cache)
    kept_while_alive = call.cache.sweep()
    y = np.ones(2)
    call(y)
    call(y)  # the kind's request for x is replaced by one for y
    replaced = len(call.cache)
    del x, y
    swept = call.cache.sweep()
    held_after = len(call.cache)
    z = np.ones(4)
    call(z, kind="other")
    call(z, kind="other")
    call.cache.close()
    return held_before, kept_while_alive, replaced, swept, held_after, len(call.cache)


@MPI_2
def test_a_request_is_released_when_its_buffer_goes_and_at_close(world):
    results = world.run(release_job)
    if results[0] is None:
        pytest.skip("this MPI has no persistent collectives (MPI < 4)")
    for held_before, kept_while_alive, replaced, swept, held_after, closed in results:
        assert (held_before, kept_while_alive, replaced) == (1, 0, 1)
        assert (swept, held_after, closed) == (1, 0, 0)


def torch_job(comm):
    import torch
    from collectives.backends.mpi_persistent import PersistentCollectives
    from mpi4py import MPI

    cache = PersistentCollectives(comm.mpi_comm, MPI)
    if not cache.available:
        return None
    t = torch.ones(3, dtype=torch.float64)
    ways = []
    for step in range(4):
        if step == 2:  # the tensor's memory moves (same shape): its request must not be used
            t.set_(torch.ones(3, dtype=torch.float64).untyped_storage())
        view = t.numpy()
        bits = comm.mpi_comm.allreduce(cache.bits("t", t, t.data_ptr()), MPI.BAND)
        spec = [view, MPI.DOUBLE]
        request = cache.agreed(bits, "t", t, t.data_ptr(),
                               lambda spec=spec: comm.mpi_comm.Allreduce_init(MPI.IN_PLACE, spec, MPI.SUM))
        if request is None:
            comm.mpi_comm.Allreduce(MPI.IN_PLACE, [view, MPI.DOUBLE], MPI.SUM)
            ways.append("plain")
        else:
            request.Wait()
            ways.append("persistent")
    cache.close()
    return ways, t.numpy().copy()


@MPI_2
def test_a_torch_tensor_whose_memory_moved_gets_a_new_request(world):
    results = world.run(torch_job)
    if results[0] is None:
        pytest.skip("this MPI has no persistent collectives (MPI < 4)")
    for ways, t in results:
        # 2: made on the first storage; 3: moved (not HAVE), SAME: made again on the new one
        assert ways == ["plain", "persistent", "persistent", "persistent"]
        np.testing.assert_array_equal(t, np.full(3, float(world.size) ** 2))


PROGRAM = textwrap.dedent("""
    import sys
    import numpy as np
    import collectives
    from collectives.backends.mpi_persistent import PersistentCollectives
    from mpi4py import MPI

    how = sys.argv[1]
    comm = collectives.init("mpi")
    mc = MPI.COMM_WORLD if how == "left-on-world" else comm.mpi_comm
    cache = PersistentCollectives(mc, MPI)
    x = np.ones(2)
    for _ in range(3):
        bits = mc.allreduce(cache.bits("k", x, x.__array_interface__["data"][0]), MPI.BAND)
        request = cache.agreed(bits, "k", x, x.__array_interface__["data"][0],
                               lambda: mc.Allreduce_init(MPI.IN_PLACE, [x, MPI.DOUBLE], MPI.SUM))
        if request is None:
            mc.Allreduce(MPI.IN_PLACE, [x, MPI.DOUBLE], MPI.SUM)
        else:
            request.Wait()
    assert len(cache) == 1
    if how == "closed":
        cache.close()
        comm.close()
    print("ok", x.tolist())
""")


@pytest.mark.parametrize("how", ["closed", "left", "left-on-world"])
def test_mpich_never_prints_freeing_inactive_persistent_request(tmp_path, how):
    """Closed before the communicator, or left to the end of the program: nothing on stderr.
    Left on MPI_COMM_WORLD (which MPICH frees at MPI_Finalize) it prints; the test shows it
    sees the warning where there is one."""
    script = tmp_path / "persistent.py"
    script.write_text(PROGRAM)
    done = subprocess.run([str(BIN / "mpiexec"), "-n", "2", sys.executable, str(script), how],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("[8.0, 8.0]") == 2  # plain, made and started, started: 1 -> 8
    warned = "freeing inactive persistent request" in done.stderr
    assert warned == (how == "left-on-world"), done.stderr


# -- the fast paths' staged persistent requests (backends/mpi_channel.py, MPIChannel._staged) --

# Elements past which a float32 call is too large to travel in the check's round (smaller ones
# take no staged request while the default check is on: backends/mpi_carried.py).
PAST_CARRIED = CARRY_BYTES // 4


def staged_mixed_types(comm, sub):
    """Small all_reduces and broadcasts through their staged requests where the ranks pass
    arrays of different types: rank 0 numpy then torch, the others torch throughout (one
    table per kind of call, whatever the array type, so the ranks make the same requests at
    the same calls). Each result against numpy; the mismatches found."""
    import torch

    wrong = []
    for rnd in range(2):
        for kind in ("numpy", "torch"):
            for n in (PAST_CARRIED + 1, PAST_CARRIED + 3, PAST_CARRIED + 7):
                for c in (comm, sub):
                    wrap = torch.from_numpy if kind == "torch" or c.rank else (lambda a: a)
                    x = wrap(np.arange(n, dtype=np.float32) + c.rank + rnd)
                    expected = sum(np.arange(n, dtype=np.float32) + r + rnd for r in range(c.size))
                    if not np.array_equal(np.asarray(c.all_reduce(x)), expected):
                        wrong.append(("all_reduce", kind, n, np.asarray(x).tolist()))
                    apart(c)
                    for root in range(c.size):
                        y = wrap(np.full(n, c.rank * 10 + rnd, dtype=np.float32))
                        c.broadcast(y, root)
                        apart(c)
                        if not (np.asarray(y) == root * 10 + rnd).all():
                            wrong.append(("broadcast", kind, n, root, np.asarray(y).tolist()))
    return wrong


def apart(comm):
    """A call of one element: the check's round stays on its small block (two calls in a row past it
    would switch every rank to the large one, backends/mpi_round.py, and carry x there)."""
    comm.all_reduce(np.zeros(1))


def staged_job(comm):
    """Small all_reduces and broadcasts of more shapes than a table keeps (so the oldest are
    freed and made again), every root, on the world and on a split; each result against numpy."""
    from collectives.backends.mpi_channel import STAGED_SHAPES

    sub = comm.split(comm.rank % 2)
    wrong = []
    for rnd in range(3):
        for n in range(PAST_CARRIED + 1, PAST_CARRIED + STAGED_SHAPES + 5):
            for c in (comm, sub):
                x = np.arange(n, dtype=np.float32) + c.rank + rnd
                expected = sum(np.arange(n, dtype=np.float32) + r + rnd for r in range(c.size))
                got = c.all_reduce(x)
                apart(c)
                if got is not x or not np.array_equal(x, expected):
                    wrong.append(("all_reduce", n, x.tolist()))
                for root in range(c.size):
                    y = np.full((n - PAST_CARRIED + CARRY_BYTES // 16, 2), c.rank * 10 + rnd, dtype=np.int64)
                    c.broadcast(y, root)
                    apart(c)
                    if not (y == root * 10 + rnd).all():
                        wrong.append(("broadcast", n, root, y.tolist()))
    wrong += staged_mixed_types(comm, sub)
    # an AVG and a large call (not staged) between staged ones
    z = np.full(3, float(comm.rank), dtype=np.float64)
    comm.all_reduce(z, op="avg")
    big = np.ones(4096, dtype=np.float64)
    comm.all_reduce(big)
    kept = [len(table) for table in comm._transport._staged_tables.values()]
    alone = comm.split(comm.rank)  # one rank: nothing to wait for, no request
    alone.all_reduce(np.ones(3))
    kept_alone = len(alone._transport._staged_tables)
    alone.close()
    from mpi4py import MPI

    requests = [entry[0] for table in sub._transport._staged_tables.values() for entry in table.values()]
    sub.close()  # frees them (MPICH warns of requests left when it frees a communicator at exit)
    # (a split of one rank keeps none: it has nobody to wait for)
    freed = (bool(requests) or sub.size == 1) and all(request == MPI.REQUEST_NULL for request in requests)
    return wrong, z.tolist(), float(big[0]), kept, freed, kept_alone


@pytest.mark.parametrize("world", [("mpi", 3)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
def test_small_calls_through_staged_persistent_requests_are_exact(world):
    from collectives.backends.mpi_channel import STAGED_SHAPES

    results = world.run(staged_job, timeout=120)
    for rank, (wrong, z, big, kept, freed, kept_alone) in enumerate(results):
        assert wrong == [], (rank, wrong[:3])
        assert z == [1.0, 1.0, 1.0] and big == 3.0
        # the fast paths kept requests (the library has persistent collectives), at most a table's worth each
        assert kept and max(kept) == STAGED_SHAPES and all(0 <= k <= STAGED_SHAPES for k in kept), kept
        assert freed  # close() freed the split's requests
        assert kept_alone == 0
