"""A call one rank refuses (its arguments fail the checks, nothing sent) while the others make it:
the refusing rank raises its own TypeError/ValueError, the others a CollectiveMismatch naming the
rank that refused the call, its number and why, and the next calls line up on every rank. With
the default check (its one-word round, where MPI carries a small call's data) and in debug mode
(COLLECTIVES_DEBUG=1), in both forms of the call path (compiled and Python), on 3 ranks of MPI and
of torch (Gloo). With COLLECTIVES_DEBUG=0 a refused call sends nothing.

The reference of each result: numpy's sum of what the ranks hold, and the inputs as they were.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from collectives import CollectiveMismatch
from collectives.config import COMPILED, DEBUG
from collectives.testing import get_pool

SIZE = 3


def _split(comm, form, level):
    """A split of ``comm`` made under COLLECTIVES_COMPILED=``form`` and COLLECTIVES_DEBUG=``level``
    (a communicator reads both when it is made), the variables as they were after."""
    settings = {COMPILED: "1" if form == "compiled" else "0", DEBUG: level}
    kept = {name: os.environ.get(name) for name in settings}
    os.environ.update({name: value for name, value in settings.items() if value is not None})
    if level is None:
        os.environ.pop(DEBUG, None)
    try:
        return comm.split(0)
    finally:
        for name, value in kept.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _attempt(thunk):
    try:
        thunk()
    except CollectiveMismatch as error:
        return "CollectiveMismatch", str(error)
    except (TypeError, ValueError) as error:
        return type(error).__name__, str(error)
    return "no error", ""


def refused_job(comm, form, level):
    """Rank 0 refuses calls that ranks 1 and 2 make: an all_reduce "avg" of int32 (the
    communicator's call #1, and again later), a broadcast from a rank out of range and an all_reduce
    into a read-only array (both after a call of the same kind, so the compiled path's own checks
    refuse them), an all_gather_v of a list, a split with a color of the wrong type, a broadcast_object
    from a rank out of range and a gather_object to one. After each, a real all_reduce. Returns what
    each step raised or gave."""
    sub = _split(comm, form, level)
    rank = sub.rank
    floats = np.arange(3, dtype=np.float32) + rank
    ints = np.arange(3, dtype=np.int32)
    read_only = np.ones(3)
    read_only.setflags(write=False)
    kept = [floats.copy(), ints.copy()]
    steps = []

    def after():  # the next call lines up: the sum of every rank's rank + 1
        steps.append(("sum", sub.all_reduce(np.full(2, rank + 1.0)).tolist(), sub.sequence_number))

    steps.append(_attempt(lambda: sub.all_reduce(ints if rank == 0 else floats, "avg")))
    after()
    sub.broadcast(floats.copy(), 0)  # (the kind planned)
    steps.append(_attempt(lambda: sub.broadcast(floats, SIZE + 2 if rank == 0 else 0)))
    after()
    sub.all_reduce(np.ones(3))  # (the kind planned)
    steps.append(_attempt(lambda: sub.all_reduce(read_only if rank == 0 else np.ones(3))))
    after()
    steps.append(_attempt(lambda: sub.all_reduce(ints if rank == 0 else floats, "avg")))
    after()
    rows = np.ones((rank + 1, 2))  # an uneven call (its counts travel in MPI's check round)
    steps.append(_attempt(lambda: sub.all_gather_v(rows.tolist() if rank == 0 else rows)))
    after()
    steps.append(_attempt(lambda: sub.split("a" if rank == 0 else 0)))  # (the peers' split never starts)
    after()
    steps.append(_attempt(lambda: sub.broadcast_object({"from": rank}, SIZE + 2 if rank == 0 else 0)))
    after()
    steps.append(_attempt(lambda: sub.gather_object(rank, -1 if rank == 0 else 0)))  # (after its sizes' round)
    after()
    untouched = bool((floats == kept[0]).all() and (ints == kept[1]).all() and (read_only == 1).all())
    sub.close()
    return steps, untouched


# (call, its number on the split, rank 0's error, a phrase of it)
REFUSALS = [("all_reduce", 1, "TypeError", "op=AVG is not allowed on dtype int32"),
            ("broadcast", 4, "ValueError", f"src={SIZE + 2} is out of range"),
            ("all_reduce", 7, "ValueError", "read-only"),
            ("all_reduce", 9, "TypeError", "op=AVG is not allowed on dtype int32"),
            ("all_gather_v", 11, "TypeError", "x of type builtins.list is not supported"),
            ("split", 13, "TypeError", "color must be an int or None; got str"),
            ("broadcast", 15, "ValueError", f"src={SIZE + 2} is out of range"),  # broadcast_object's first call
            ("gather", 18, "ValueError", "dst=-1 is out of range")]  # gather_object's, after its sizes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", [None, "1"], ids=["default", "debug"])
@pytest.mark.parametrize("form", ["compiled", "python"])
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_a_call_one_rank_refuses_is_named_on_every_rank(backend, form, level):
    results = get_pool(backend, SIZE).run(refused_job, args=(form, level), timeout=60)
    expected_sum = [float(sum(range(1, SIZE + 1)))] * 2
    for rank, (steps, untouched) in enumerate(results):
        assert untouched, f"rank {rank}: an input was modified"
        for index, (name, seq, error, phrase) in enumerate(REFUSALS):
            kind, message = steps[2 * index]
            if rank == 0:
                assert (kind, phrase in message) == (error, True), f"rank 0, {name} #{seq}: {kind}: {message}"
                assert "During handling" not in message
            else:
                assert kind == "CollectiveMismatch", f"rank {rank}, {name} #{seq}: {kind}: {message}"
                assert f"rank 0 refused {name} call #{seq}" in message, message
                assert f"{error}: " in message and phrase in message, message
            # the next call lined up: its sum on every rank, one number after the refused call
            assert steps[2 * index + 1] == ("sum", expected_sum, seq + 1), (rank, steps[2 * index + 1])


def every_rank_refuses_job(comm, level):
    """Every rank makes the same bad call: each raises its own error; the sequence number moves
    by one where the call is checked (its check's round), by none with COLLECTIVES_DEBUG=0."""
    sub = _split(comm, "compiled", level)
    sub.all_reduce(np.ones(1))  # (the first call: checked in full, whatever the level)
    seq = sub.sequence_number
    outcome = _attempt(lambda: sub.all_reduce(np.arange(3, dtype=np.int32), "avg"))
    moved = sub.sequence_number - seq
    total = sub.all_reduce(np.ones(1)).tolist()
    sub.close()
    return outcome, moved, total


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", [None, "1", "0"], ids=["default", "debug", "off"])
def test_the_same_refusal_on_every_rank_raises_everyone_s_own_error(level):
    for outcome, moved, total in get_pool("mpi", SIZE).run(every_rank_refuses_job, args=(level,), timeout=30):
        assert outcome[0] == "TypeError" and "op=AVG is not allowed on dtype int32" in outcome[1], outcome
        assert moved == (0 if level == "0" else 1)
        assert total == [float(SIZE)]
