"""The suite beyond four ranks: 5 and 8 ranks on mpi and torch (and 16, 32 with
``COLLECTIVES_MANY_RANKS``, `make test-many-ranks`).

Above COUNTS_RANKS = 4 the MPI round changes design (backends/mpi_channel.py: a one-word
all_reduce instead of the block all_gather, an uneven call's counts exchanged apart), so each
size runs a slice of the collective grid (every collective, the uneven ones, point-to-point,
from any source too), the check's mismatch cases and a barrier against another call, a
farewell, SyncBN against its one-process reference and DDP over the "collectives"
torch.distributed backend, each through the same jobs and references as the tests of 1-4
ranks. Oversubscribed ranks (8 on 2 cores) yield the core while they wait: the transports'
poll policy (backends/mpi_requests.py: ``poll_policy``) yields when the node has more ranks
than cores. Each test prints one line to the terminal (``-q`` too), so CI's log shows the
sizes that ran and what they cost.
"""

from __future__ import annotations

import os
import time

import c10d_jobs
import numpy as np
import pytest
import test_any_source as any_source
import test_collectives as grid
import test_farewell as farewell
import test_reliability as reliability
import test_syncbn as syncbn

from collectives import config
from collectives.testing import RankPool, get_pool

#: The sizes CI runs; COLLECTIVES_MANY_RANKS="16 32" runs those instead (`make test-many-ranks`).
SIZES = [int(n) for n in os.environ.get(config.MANY_RANKS, "5 8").split()]
WORLDS = [(backend, n) for n in SIZES for backend in ("mpi", "torch")]
IDS = [f"{backend}-{n}" for backend, n in WORLDS]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", params=WORLDS, ids=IDS)
def world(request):
    """The session's pool of each world, module-scoped so that pytest runs every test of one
    world before it starts the next (a pool of 8 ranks starts in seconds, 2 cores or not)."""
    return get_pool(*request.param)


@pytest.fixture
def say(capsys):
    """Print one line to the terminal past pytest's capture (CI's log shows it under -q)."""
    def line(text: str) -> None:
        with capsys.disabled():
            print(f"\nMANY RANKS {text}", flush=True)
    return line


def test_every_collective_matches_numpy(world, say):
    start = time.monotonic()
    grid.test_all_reduce_matches_numpy_for_every_allowed_pair(world, "numpy")
    grid.test_broadcast_from_every_root_copies_the_roots_bytes(world, "torch")
    grid.test_all_gather_stacks_every_ranks_input_in_rank_order(world, "numpy")
    grid.test_reduce_scatter_returns_this_ranks_rows_of_the_reduction(world, "torch")
    grid.test_reduce_lands_on_dst_and_leaves_the_others_untouched(world, "numpy")
    grid.test_gather_stacks_on_dst_only(world, "torch")
    grid.test_scatter_hands_row_rank_of_src(world, "numpy")
    grid.test_all_to_all_equal_transposes_rows(world, "torch")
    grid.test_all_to_all_with_splits_concatenates_what_every_rank_sent_here(world, "numpy")
    grid.test_all_gather_v_concatenates_uneven_rows_in_rank_order(world, "torch")
    grid.test_wrong_out_and_bad_arguments_raise_on_every_rank_before_anything_is_sent(world, "numpy")
    for pattern in ("ring", "pairs"):
        grid.test_send_recv_rings_and_pairs_deliver_every_dtype(world, pattern, "async-recv-first")
    any_source.assert_every_sender_once(world.run(any_source.any_source_job, [("numpy",)] * world.size,
                                                  timeout=120)[0], world.size)
    say(f"{world.backend} {world.size} ranks: the collective grid matches numpy "
        f"({time.monotonic() - start:.1f} s)")


def _assert_mismatch(message, field, value0, value1):
    assert f"{field} differs: " in message, message
    assert f"{value0} on rank" in message and f"{value1} on rank" in message, message


def test_mismatched_calls_and_a_barrier_against_a_call_raise_on_every_rank(world, say):
    start = time.monotonic()
    for case, (_, field, value0, value1) in reliability.MISMATCHES.items():
        for rank, ((kind, message), _, ok) in enumerate(world.run(reliability.mismatch_job, args=(case,),
                                                                  timeout=120)):
            assert kind == "CollectiveMismatch", (case, rank, kind, message)
            _assert_mismatch(message, field, value0, value1)
            assert ok in (True, None), (case, rank)
    reliability.assert_barrier_mismatch(world.run(reliability.barrier_mismatch_job, timeout=120), world.size)
    (closed, _), *others = world.run(farewell.closed_early_job, timeout=120)
    assert closed == "closed"
    for outcome, _, after, everyone in others:
        assert outcome.startswith("PeerLeft: all_reduce (call #2)") and "rank 0 finished" in outcome, outcome
        assert after.startswith("CollectiveError") and everyone == [float(world.size)], after
    say(f"{world.backend} {world.size} ranks: {len(reliability.MISMATCHES)} mismatches, a barrier against "
        f"an all_reduce and a farewell, on every rank ({time.monotonic() - start:.1f} s)")


def test_syncbn_matches_the_one_process_reference(world, say):
    start = time.monotonic()
    syncbn.test_uneven_batches_match_single_process_reference(world)
    say(f"{world.backend} {world.size} ranks: SyncBN equals BatchNorm on the global batch "
        f"({time.monotonic() - start:.1f} s)")


@pytest.mark.parametrize("size", SIZES)
def test_ddp_over_the_collectives_backend_equals_the_reference_and_gloo(size, say):
    start = time.monotonic()
    with RankPool("mpi", size) as pool:  # (its ranks keep torch's default group: a pool of its own)
        for out in pool.run(c10d_jobs.ddp_job, args=(2, "plain"), timeout=300):
            for name, want in out["reference"].items():
                np.testing.assert_allclose(out["collectives"][name], want, rtol=0, atol=1e-10)
                np.testing.assert_allclose(out["collectives"][name], out["gloo"][name], rtol=0, atol=1e-10)
    say(f"mpi {size} ranks: DDP over 'collectives' equals one process and Gloo "
        f"({time.monotonic() - start:.1f} s)")

