"""send's and recv's fast paths on MPI (backends/mpi_p2p.py's PointToPoint) in both forms: compiled
(collectives.backends._p2p_c, what the test set-up builds) and Python (COLLECTIVES_COMPILED=0),
each under a timeout (the nonblocking calls, their polls, the channel's wait) and without one (a
send's blocking MPI_Send): what arrives is what numpy sent, byte for byte, in the order sent; a
message shorter than x is a ValueError naming both sizes, x untouched past what arrived; ranks of
the two forms talk to each other."""

import numpy as np
import pytest
from forms import split_in_form

WORLDS = pytest.mark.parametrize("world", [("mpi", 2)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
#: (dtype, shape) of the messages, each sent by rank 0 and sent back by rank 1 changed.
MESSAGES = [("float64", (1,)), ("float32", (3, 5)), ("int8", (7,)), ("int64", (2, 2, 2)), ("float64", (512,))]


def sent(rank, dtype, shape, k):
    """What rank ``rank`` sends as message ``k`` (distinct per rank and message)."""
    return (np.arange(int(np.prod(shape))).reshape(shape) * (rank + 2) + k).astype(dtype)


def p2p_job(comm, form, timeout):
    """Messages both ways on a split in ``form`` (``timeout``: seconds, or None: none), then a short
    one: what arrived, the fast paths' modules, the short message's error and x after it."""
    with split_in_form(comm, form) as sub:
        sub.timeout = timeout
        peer, got = 1 - sub.rank, []
        for k, (dtype, shape) in enumerate(MESSAGES):
            x = np.zeros(shape, dtype)
            if sub.rank == 0:
                sub.send(sent(0, dtype, shape, k), peer, tag=k)
                sub.recv(x, peer, tag=k)
            else:
                sub.recv(x, peer, tag=k)
                sub.send(sent(1, dtype, shape, k), peer, tag=k)
            got.append(x.tobytes())
        modules = sorted({type(plan.fast.__self__).__module__ for (call, *_), plan in sub._plans.items()
                          if call.name in ("send", "recv") and plan.fast is not None})
        error, rest = None, None
        if sub.rank == 0:
            sub.send(np.full(3, 7.0), peer, tag=99)
        else:
            x = np.full(5, -1.0)
            try:
                sub.recv(x, peer, tag=99)
            except ValueError as e:
                error = str(e)
            rest = x.tolist()
        sub.barrier()
        return got, modules, error, rest


@WORLDS
@pytest.mark.parametrize("timeout", [30, None], ids=["timeout", "blocking"])
@pytest.mark.parametrize("forms", [("compiled", "compiled"), ("python", "python"), ("compiled", "python")],
                         ids=lambda f: "-".join(f))
def test_send_and_recv_deliver_numpys_bytes_in_both_forms(world, forms, timeout):
    results = world.run(p2p_job, [(form, timeout) for form in forms], timeout=120)
    for rank, (got, modules, error, rest) in enumerate(results):
        peer = 1 - rank
        assert got == [sent(peer, dtype, shape, k).tobytes() for k, (dtype, shape) in enumerate(MESSAGES)]
        assert modules == ["collectives.backends._p2p_c" if forms[rank] == "compiled"
                           else "collectives.backends.mpi_p2p"]
        if rank == 1:
            assert error is not None and "got 24 bytes, but x holds 40" in error and "(5,)" in error, error
            assert rest[:3] == [7.0] * 3 and rest[3:] == [-1.0, -1.0]
