"""recv(x, src=None): a receive from any source, on MPI (MPI_ANY_SOURCE) and torch's Gloo
(recvAnysource), by default and in debug mode (the header comes from any source, the payload
from its sender); refused by name, before anything is sent, where the transport has none.

The reference: every rank but 0 sends rank 0 an array filled with its own rank, so what each
receive got says who sent it, independently of the handle's ``source``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from collectives import config
from collectives.testing import RankPool, get_pool
from collectives.testing.reference import as_array, to_numpy

pytestmark = pytest.mark.timeout(120)


def any_source_job(comm, kind):
    """Ranks 1.. send rank 0 their rank, twice (tag 7 for the blocking receives, tag 8 for the
    handles); rank 0 receives each from any source. Returns rank 0's (what the blocking receives
    got, the handles' (source, what they got))."""
    sub = comm.split(0)
    n = sub.size
    if sub.rank:
        for tag in (7, 8):
            sub.send(as_array(np.full(3, sub.rank, np.float32), "float32", kind), 0, tag=tag)
        got = None
    else:
        blocking = []
        for _ in range(n - 1):
            box = as_array(np.full(3, -1, np.float32), "float32", kind)
            assert sub.recv(box, None, tag=7) is box
            blocking.append(to_numpy(box).tolist())
        boxes = [as_array(np.full(3, -1, np.float32), "float32", kind) for _ in range(n - 1)]
        works = [sub.recv(box, None, tag=8, async_op=True) for box in boxes]
        for work in reversed(works):
            work.wait()
        got = blocking, [(work.source, to_numpy(box).tolist()) for work, box in zip(works, boxes)]
    after = float(sub.all_reduce(np.ones(1))[0])  # still in step
    sub.close()
    return got, after


def assert_every_sender_once(result, n):
    (blocking, handles), after = result
    everyone = sorted([float(r)] * 3 for r in range(1, n))
    assert sorted(blocking) == everyone, blocking
    for source, values in handles:
        assert values == [float(source)] * 3, (source, values)
    assert sorted(values for _, values in handles) == everyone, handles
    assert after == n


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_recv_from_any_source_takes_every_sender_once_and_names_it(backend, kind):
    results = get_pool(backend, 3).run(any_source_job, [(kind,)] * 3, timeout=60)
    assert_every_sender_once(results[0], 3)


@pytest.fixture(scope="module", params=["mpi", "torch"])
def debug_world(request):
    with RankPool(request.param, 3, env={config.DEBUG: "1", config.TIMEOUT: "20"}, job_timeout=60) as pool:
        yield pool


def test_recv_from_any_source_in_debug_mode(debug_world):
    assert_every_sender_once(debug_world.run(any_source_job, [("numpy",)] * 3, timeout=60)[0], 3)


def any_source_mismatch_job(comm):
    """Rank 1 sends 4 float32 where rank 0 receives 3 from any source: the mismatch names rank 1."""
    sub = comm.split(0)
    outcome = None
    if sub.rank == 1:
        sub.send(np.arange(4, dtype=np.float32), 0, tag=3)
    elif sub.rank == 0:
        box = np.full(3, -1, np.float32)
        try:
            sub.recv(box, None, tag=3)
            outcome = ("no error", "", False)
        except Exception as error:  # noqa: BLE001  (which one is what the test checks)
            outcome = (type(error).__name__, str(error), bool((box == -1).all()))
    after = float(sub.all_reduce(np.ones(1))[0])
    sub.close()
    return outcome, after


def test_a_debug_recv_from_any_source_names_the_sender_of_a_mismatch(debug_world):
    (name, message, untouched), after = debug_world.run(any_source_mismatch_job, timeout=60)[0]
    assert name == "CollectiveMismatch" and untouched, (name, message)
    assert "recv from rank 1 (tag 3)" in message and "(4,), float32" in message, message
    assert after == 3


def test_recv_from_any_source_is_refused_by_name_where_the_transport_has_none():
    """The example transport (threads) has no recv from any source; a one-rank communicator has
    no other rank: both a ValueError before anything is sent, x untouched."""
    path = Path(__file__).resolve().parents[2] / "examples" / "threads_transport.py"
    spec = importlib.util.spec_from_file_location("threads_transport", path)
    assert spec is not None and spec.loader is not None
    example = sys.modules.setdefault("threads_transport", importlib.util.module_from_spec(spec))
    if not hasattr(example, "run_ranks"):
        spec.loader.exec_module(example)

    def body(comm):
        box = np.full(2, -1.0)
        try:
            comm.recv(box, None)
        except ValueError as error:
            return str(error), box.tolist()
        return "no error", box.tolist()

    for message, box in example.run_ranks(2, body):
        assert "recv(src=None), from any source, is not available" in message, message
        assert "name the src rank" in message and box == [-1.0, -1.0], message
    from collectives.backends.local import LocalCommunicator

    with pytest.raises(ValueError, match=r"src=None \(any source\) on a communicator of one rank"):
        LocalCommunicator().recv(np.zeros(2), None)
