"""The backend toolkit (backends/_buffers.py) that every backend's staging, emulation and
waiting goes through, checked on its own against numpy and a fake clock."""

import functools
import itertools

import numpy as np
import pytest
import torch
from collectives.backends import mpi_requests
from collectives.backends._buffers import (
    bitwise_as_min_max,
    flat_bytes,
    fold_bitwise,
    offsets,
    stage,
)

from collectives import ReduceOp, arrays
from collectives.polling import PollPolicy, wait_until


def as_numpy(x):
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


NUMPY_BITWISE = {ReduceOp.BAND: np.bitwise_and, ReduceOp.BOR: np.bitwise_or,
                 ReduceOp.BXOR: np.bitwise_xor}
NUMPY_MIN_MAX = {ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


@pytest.mark.parametrize("dtype", ["bool", "uint8", "int8", "int16", "int32", "int64"])
@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])
def test_bitwise_as_min_max_only_where_min_max_computes_the_op(dtype, op):
    values = np.array([0, 1] if dtype == "bool" else [0, 1, 2, 3, 5, 6, -1 if dtype != "uint8" else 255],
                      dtype=dtype)
    native = bitwise_as_min_max(dtype, op)
    if native is None:
        return
    for a, b in itertools.product(values, repeat=2):
        assert NUMPY_MIN_MAX[native](a, b) == NUMPY_BITWISE[op](a, b), (dtype, op, a, b)


def test_bitwise_as_min_max_is_found_for_bool_and_and_or():
    assert bitwise_as_min_max("bool", ReduceOp.BAND) is ReduceOp.MIN
    assert bitwise_as_min_max("bool", ReduceOp.BOR) is ReduceOp.MAX


@pytest.mark.parametrize("op", [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR])
@pytest.mark.parametrize("dtype", ["bool", "uint8", "int16", "int64"])
def test_fold_bitwise_matches_numpy_and_leaves_the_rows_untouched(op, dtype):
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 2 if dtype == "bool" else 120, size=(4, 5)).astype(dtype)
    tensor = torch.from_numpy(rows.copy())
    want = functools.reduce(NUMPY_BITWISE[op], rows)
    got = fold_bitwise(tensor, op)
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(tensor.numpy(), rows)


def test_offsets_are_exclusive_prefix_sums():
    assert offsets([]) == []
    assert offsets([3, 0, 4, 2]) == [0, 3, 3, 7]


@pytest.mark.parametrize("x", [np.arange(6, dtype=np.int32).reshape(2, 3),
                               torch.arange(6, dtype=torch.int32).reshape(2, 3)], ids=["numpy", "torch"])
def test_flat_bytes_views_the_memory(x):
    view = flat_bytes(x)
    assert tuple(view.shape) == (24,)
    view[0] = 9  # the same memory: little-endian low byte of element 0
    assert int(x[0, 0]) == 9


# -- staging ---------------------------------------------------------------------------------------

def _arrays(dtype):
    data = np.arange(12).reshape(3, 4) % (2 if dtype == "bool" else 7)
    base = data.astype(dtype)
    return [("numpy", arrays.NUMPY, base.copy()), ("numpy-strided", arrays.NUMPY, base.copy().T),
            ("torch", arrays.TORCH, torch.from_numpy(base.copy())),
            ("torch-strided", arrays.TORCH, torch.from_numpy(base.copy()).T)]


@pytest.mark.parametrize("dtype,wire", [("float32", None), ("float32", "float32"), ("float16", "float32"),
                                        ("bool", "uint8"), ("int16", "int32"), ("int16", None)])
def test_stage_gives_contiguous_wire_memory_and_writes_back(dtype, wire):
    for name, adapter, x in _arrays(dtype):
        before = as_numpy(x).copy()
        buf, writeback = stage(x, adapter, dtype, wire)
        assert adapter.is_contiguous(buf), name
        assert adapter.dtype_name(buf) == (wire or dtype), name
        np.testing.assert_array_equal(as_numpy(buf).astype(dtype), before, err_msg=name)
        shares = np.shares_memory(np.asarray(buf), np.asarray(x)) if adapter is arrays.NUMPY else \
            buf.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        contiguous_already = adapter.is_contiguous(x) and (wire in (None, dtype) or dtype == "bool")
        assert shares == contiguous_already, name
        assert (writeback is None) == contiguous_already, name
        buf[...] = 1  # what a transport writes
        if writeback is not None:
            writeback()
        np.testing.assert_array_equal(as_numpy(x), np.ones_like(before), err_msg=name)


# -- waiting ------------------------------------------------------------------------------------

class FakeClock:
    """Seconds that pass only when the waiter pauses, or ``tick`` per poll."""

    def __init__(self, tick=0.0):
        self.now, self.tick, self.pauses = 0.0, tick, []

    def __call__(self):
        return self.now

    def pause(self, seconds):
        self.pauses.append(seconds)
        self.now += max(seconds, 1e-6)


@pytest.mark.parametrize("clock_every", [1, 8])
def test_a_spinning_policy_polls_without_yielding_for_its_spin_then_yields(clock_every):
    clock = FakeClock()
    seen = []  # (time, yields so far) at each test

    def done():
        seen.append((clock.now, len(clock.pauses)))
        clock.now += 1e-6  # a test costs a microsecond
        return len(seen) > 200

    policy = PollPolicy(fast_polls=4, busy_seconds=1.0, sleep_min=1e-3, sleep_max=1e-3,
                        clock_every=clock_every, spin_seconds=50e-6)
    assert wait_until(done, 10.0, policy, clock=clock, pause=clock.pause)
    spun = [t for t, pauses in seen if pauses == 0]
    assert 50e-6 <= spun[-1] < 50e-6 + (clock_every + 5) * 1e-6  # no yield before the spin was over
    assert clock.pauses and set(clock.pauses) == {0}  # then yields, no sleeps yet


def test_a_yielding_policy_yields_from_the_first_slow_poll():
    clock = FakeClock()
    count = itertools.count()
    policy = PollPolicy(fast_polls=4, busy_seconds=1.0, sleep_min=1e-3, sleep_max=1e-3)
    assert wait_until(lambda: next(count) > 20, 10.0, policy, clock=clock, pause=clock.pause)
    assert clock.pauses == [0] * 17  # every test after the 4 fast ones, but the last


def test_wait_until_gives_up_at_the_deadline_also_while_spinning():
    clock = FakeClock()
    policy = PollPolicy(fast_polls=1, busy_seconds=0.0, sleep_min=1e-3, sleep_max=1e-3,
                        spin_seconds=10.0)

    def never():
        clock.now += 1e-3
        return False

    assert not wait_until(never, 0.5, policy, clock=clock, pause=clock.pause)
    assert 0.5 <= clock.now < 0.51 and clock.pauses == []


def test_a_spinning_policy_yields_every_n_tests_so_a_peer_on_the_same_core_runs():
    clock = FakeClock()
    seen = []  # yields so far, at each test

    def done():
        seen.append(len(clock.pauses))
        clock.now += 1e-6
        return len(seen) > 100

    policy = PollPolicy(fast_polls=4, busy_seconds=1.0, sleep_min=1e-3, sleep_max=1e-3, clock_every=64,
                        spin_seconds=1.0, spin_yield_every=16)
    assert wait_until(done, 10.0, policy, clock=clock, pause=clock.pause)
    assert set(clock.pauses) == {0}  # yields, no sleeps, within the spin
    assert len(clock.pauses) == (100 - 4) // 16  # one every 16 tests after the fast ones


def test_the_mpi_spinning_policy_ends_a_hung_wait_in_sleeps_not_spins():
    """A call that never completes spins (with its periodic yields) for the busy second only,
    then sleeps a millisecond between tests: it does not burn the core until the deadline."""
    clock = FakeClock()
    tests = itertools.count()

    def never():
        next(tests)
        clock.now += 1e-6
        return False

    policy = mpi_requests.SPIN_POLL
    assert not wait_until(never, 5.0, policy, clock=clock, pause=clock.pause)
    sleeps = [p for p in clock.pauses if p > 0]
    assert sleeps and max(sleeps) == mpi_requests.POLL_INTERVAL  # (the last one: to the deadline)
    # after the busy second nothing but sleeps: ~4000 of them in the 4 s left, one test each
    assert len(sleeps) > 3000 and next(tests) < 1.1e6 + 5000


@pytest.mark.parametrize("ranks,cores,spins", [(2, 2, True), (1, 1, True), (3, 2, False), (4, 2, False)])
def test_mpi_spins_only_where_each_rank_of_the_node_has_a_core(monkeypatch, ranks, cores, spins):
    monkeypatch.setattr(mpi_requests.os, "sched_getaffinity", lambda pid: set(range(cores)))
    policy = mpi_requests.poll_policy(ranks)
    assert (policy.spin_seconds > 0) == spins
    assert policy.fast_polls == mpi_requests.FAST_POLLS and policy.busy_seconds == mpi_requests.BUSY_POLL_SECONDS



# -- the uneven collectives' counts ---------------------------------------------------------------

def test_the_uneven_headers_fast_agreement_finds_exactly_what_the_full_comparison_finds(monkeypatch):
    """wire.uneven_mismatch answers the common case (every rank agrees) in plain Python; the
    full comparison, which words the error, must find a disagreement exactly when it does not."""
    from collectives import wire

    class Comm:
        size, _seq, backend = 3, 1, "mpi"

    rng = np.random.default_rng(7)
    full = wire._uneven_agree
    outcomes = set()
    for trial in range(400):
        with_splits = bool(trial % 2)
        splits = rng.integers(0, 3, size=(3, 3)).tolist()
        shapes = [(int(sum(splits[r])) if with_splits else int(rng.integers(0, 4)), 2, 3) for r in range(3)]
        dtypes = ["float32"] * 3
        outs: list = [None] * 3
        if with_splits:
            outs = [sum(splits[j][r] for j in range(3)) for r in range(3)]
        else:
            outs = [sum(s[0] for s in shapes)] * 3
        fault = trial // 2 % 4  # none, dtype, trailing shape, out rows
        if fault == 1:
            dtypes[1] = "float64"
        elif fault == 2:
            shapes[2] = (shapes[2][0], 2, 4)
        elif fault == 3:
            outs[0] += 1
        rows = np.stack([wire.uneven_header(shapes[r], dtypes[r], outs[r] if trial % 3 else None,
                                             splits[r] if with_splits else None, 3) for r in range(3)])
        fast = wire.uneven_mismatch(rows, Comm(), "op", with_splits)
        monkeypatch.setattr(wire, "_uneven_agree", lambda rows, with_splits: False)
        slow = wire.uneven_mismatch(rows, Comm(), "op", with_splits)
        monkeypatch.setattr(wire, "_uneven_agree", full)
        assert (fast is None) == (slow is None), (trial, rows)
        assert fast is None or str(fast) == str(slow)
        outcomes.add(fast is None)
    assert outcomes == {True, False}
    assert wire.header_rows(rows) == [s[0] for s in shapes]
    assert all(type(v) is int for v in wire.header_rows(rows))
