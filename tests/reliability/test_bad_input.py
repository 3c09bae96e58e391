"""Bad input, on every backend: every row of the one catalogue (bad_input_catalogue.py) with
the same bad call on every rank. Each rank must raise the documented TypeError/ValueError
before anything is sent (the sequence number did not move, or moved by the check round a refused
collective still takes, its record failed with that error), leave the input untouched, and
the communicator must still work afterwards (a real all_reduce agrees with numpy).
"""

from __future__ import annotations

import numpy as np
import pytest
from bad_input_catalogue import BACKENDS, CATALOGUE, assert_catalogue, catalogue_job


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row", list(CATALOGUE))
@pytest.mark.parametrize("world", BACKENDS, indirect=True, ids=[b for b, _ in BACKENDS])
def test_bad_input_raises_before_sending_on_every_rank(world, row):
    assert_catalogue(world.run(catalogue_job, args=(row,), timeout=30), world.size)


def test_read_only_inputs_may_have_zero_strides():
    """all_gather only reads x: an expanded tensor or a stride-0 view is fine there."""
    import torch

    import collectives

    comm = collectives.init("local")
    expanded = torch.arange(1.0, 2.0).expand(3)
    assert comm.all_gather(expanded).tolist() == [[1.0, 1.0, 1.0]]
    strided = np.lib.stride_tricks.as_strided(np.array([2.0]), shape=(3,), strides=(0,))
    assert comm.all_gather(strided).tolist() == [[2.0, 2.0, 2.0]]


def mismatched_broadcast_job(comm):
    from collectives import CollectiveError

    sub = comm.split(0)  # whatever the failure leaves behind, the pool's communicator is spared
    sub._checking = False  # no check before the call (COLLECTIVES_DEBUG=0): the transport's error
    x = np.zeros(4 if comm.rank == 0 else 2, dtype=np.float64)
    try:
        sub.broadcast(x, 0)
    except CollectiveError as error:
        return "CollectiveError", str(error)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__module__}.{type(error).__name__}", str(error)
    return "no error", ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True)
def test_a_transport_exception_becomes_collective_error(world):
    """A broadcast whose sizes differ (checks off): MPI_ERR_TRUNCATE on the receiver,
    which used to surface as a raw mpi4py.MPI.Exception."""
    results = world.run(mismatched_broadcast_job, [()] * 2, timeout=30)
    receiver_kind, receiver_message = results[1]
    assert receiver_kind == "CollectiveError", results
    assert "broadcast (call #" in receiver_message and "failed in the mpi transport" in receiver_message
    # MPICH's error class ("Other MPI error" for the nonblocking broadcast), not its "error stack:" header
    assert "error stack" not in receiver_message and not receiver_message.endswith(":"), receiver_message
