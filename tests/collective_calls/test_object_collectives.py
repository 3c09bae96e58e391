"""Object collectives on Communicator: broadcast_object, all_gather_object, gather_object,
scatter_object, on every backend, against the objects every rank builds from its rank."""

from __future__ import annotations

import numpy as np
import pytest

WORLDS = [("local", 1), ("mpi", 2), ("mpi", 4), ("torch", 3)]


def obj_of(rank: int) -> object:
    """A different object per rank: nested containers, a numpy array, and sizes that differ
    by far between ranks (rank 1's is over a MiB)."""
    return {"rank": rank, "items": list(range(rank)), "array": np.arange(rank, dtype=np.float32),
            "blob": bytes([rank]) * (1 << 20 if rank == 1 else rank)}


def same(a: object, b: object) -> bool:
    return repr(a) == repr(b)


def objects_job(comm, root):
    return {
        "broadcast": comm.broadcast_object(obj_of(comm.rank), src=root),
        "all_gather": comm.all_gather_object(obj_of(comm.rank)),
        "gather": comm.gather_object(obj_of(comm.rank), dst=root),
        "scatter": comm.scatter_object([obj_of(10 + r) for r in range(comm.size)] if comm.rank == root else None,
                                       src=root),
        "sequence": comm.sequence_number,
    }


@pytest.mark.parametrize("world", WORLDS, indirect=True)
def test_object_collectives_deliver_every_ranks_object(world):
    root = world.size - 1
    results = world.run(objects_job, args=(root,), timeout=120)
    for rank, out in enumerate(results):
        assert same(out["broadcast"], obj_of(root))
        assert len(out["all_gather"]) == world.size
        assert all(same(got, obj_of(r)) for r, got in enumerate(out["all_gather"]))
        if rank == root:
            assert all(same(got, obj_of(r)) for r, got in enumerate(out["gather"]))
        else:
            assert out["gather"] is None
        assert same(out["scatter"], obj_of(10 + rank))
    # They are collectives of the call path: numbered alike on every rank.
    assert len({out["sequence"] for out in results}) == 1


def bad_objects_job(comm, case):
    try:
        if case == "unpicklable":
            comm.broadcast_object((lambda: 0) if comm.rank == 0 else None, src=0)
        elif case == "scatter length":
            comm.scatter_object([1] if comm.rank == 0 else None, src=0)
        elif case == "all_gather unpicklable":
            comm.all_gather_object((lambda: 0) if comm.rank == comm.size - 1 else 1)
        elif case == "src":
            comm.broadcast_object(1, src=comm.size)
    except Exception as error:  # noqa: BLE001 - the message is what the test reads
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize("world", [("mpi", 3)], indirect=True)
@pytest.mark.parametrize("case", ["unpicklable", "scatter length", "all_gather unpicklable", "src"])
def test_a_bad_object_is_an_error_on_every_rank(world, case):
    results = world.run(bad_objects_job, args=(case,), timeout=60)
    culprit = {"unpicklable": 0, "scatter length": 0, "all_gather unpicklable": world.size - 1}.get(case)
    for rank, message in enumerate(results):
        if case == "src" or rank == culprit:
            assert message.startswith("ValueError"), message
        else:
            assert message.startswith("CollectiveError") and f"[{culprit}]" in message, message
    # and the communicator still works afterwards
    assert world.run(objects_job, args=(0,), timeout=60)[0]["all_gather"][0]["rank"] == 0

