"""The CPU-checkable parts of the cupy backend: no CUDA here, and none faked.

The NCCL id exchange runs for real over mpiexec (MPI broadcast) and torchrun (TCP
store) with arbitrary 128-byte ids; the dtype x op plan is checked against NCCL's
type table and, on every rank count, against an independent reference computed in
Python integers / float64; the errors are the ones a user without CuPy or with host
arrays gets.
"""

import datetime
import importlib.util
import os
import sys
import zlib

import numpy as np
import pytest
import torch
from collectives.backends import cupy_channel, cupy_handles, cupy_id, cupy_nccl, cupy_plans
from collectives.backends.cupy_channel import check_cuda_array
from collectives.backends.cupy_plans import NCCL_DTYPES, NCCL_OPS, reduce_plan

import collectives
from collectives import ALLOWED_OPS, DTYPES, BackendUnavailable, CollectiveError, ReduceOp, arrays
from collectives.launcher import LaunchInfo, detect_launcher
from collectives.registry import backend_class
from collectives.testing.reference import FLOAT_TOLERANCE, random_rank_tensors
from collectives.testing.reference import reference_tensor as reference

HAS_CUPY = importlib.util.find_spec("cupy") is not None
SINGLE = LaunchInfo(None, 0, 1, 0, 1)


# -- errors a user meets first -------------------------------------------------------------------

def test_importing_the_backend_imports_no_cupy():
    assert "cupy" not in sys.modules or HAS_CUPY
    assert backend_class("cupy") is cupy_nccl.CupyNcclCommunicator


@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed here: the missing-CuPy error cannot happen")
def test_missing_cupy_is_backend_unavailable_with_install_hint():
    with pytest.raises(BackendUnavailable, match=r"backend 'cupy' needs CuPy.*pip install 'pycollectives\[cupy\]'"):
        backend_class("cupy").from_launcher(SINGLE)
    with pytest.raises(BackendUnavailable, match="cupy-cuda13x"):
        cupy_channel.nccl_runtime_version()


@pytest.mark.parametrize("x", [np.arange(4, dtype=np.float32), torch.arange(4, dtype=torch.float32)],
                         ids=["numpy", "torch-cpu"])
def test_host_arrays_are_refused_with_a_type_error_naming_what_to_pass(x):
    before = x.copy() if isinstance(x, np.ndarray) else x.clone()
    adapter = arrays.adapter_for(x)
    with pytest.raises(TypeError, match=r"CUDA memory only; x is a (numpy\.ndarray|CPU torch\.Tensor).*"
                                        r"cupy\.ndarray or a CUDA torch\.Tensor"):
        check_cuda_array(x, adapter, 0)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(before))


# -- dtype x op plan ------------------------------------------------------------------------------

ALLOWED_PAIRS = [(dtype, op) for dtype in DTYPES for op in ReduceOp if op in ALLOWED_OPS[dtype]]


@pytest.mark.parametrize("bfloat16_native", [True, False])
@pytest.mark.parametrize("dtype,op", ALLOWED_PAIRS)
def test_every_allowed_pair_maps_to_what_nccl_has(dtype, op, bfloat16_native):
    plan = reduce_plan(dtype, op, bfloat16_native)
    if plan.nccl_op is None:  # gathered and folded locally: any dtype, bitwise ops only
        assert op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)
        assert plan.fold == op.value and plan.wire == dtype
        return
    assert plan.wire in NCCL_DTYPES, f"NCCL has no {plan.wire}"
    assert plan.nccl_op in NCCL_OPS
    assert plan.divide == (op is ReduceOp.AVG)
    if not bfloat16_native:
        assert plan.wire != "bfloat16"


def test_nccl_enum_values_are_nccl_h():
    # ncclDataType_t / ncclRedOp_t of nccl.h: a typo here would reduce garbage.
    assert NCCL_DTYPES == {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
                           "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
    assert NCCL_OPS == {"sum": 0, "prod": 1, "max": 2, "min": 3}


_TORCH_OPS = {"sum": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum,
              "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
#: NCCL's float MIN/MAX (src/device/reduce_kernel.h: fminf/fmaxf, fmin/fmax, __hmin/__hmax)
#: return the other operand when one is NaN: torch's fmin/fmax.
_NCCL_FLOAT_OPS = {"min": torch.fmin, "max": torch.fmax}


def run_plan(plan, dtype, per_rank):
    """What the backend computes: NCCL's elementwise op in the wire type (two's complement
    wrapping, as NCCL's kernels do), or the local fold, then AVG's division, then the cast back.
    Float MIN/MAX plans with order keys go through the backend's own key functions."""
    if getattr(plan, "keys", False):
        from collectives.backends.cupy_plans import from_order_keys, order_keys

        wire = [order_keys(t, arrays.TORCH, dtype, ReduceOp(plan.nccl_op)) for t in per_rank]
    else:
        wire = [t.to(getattr(torch, plan.wire)) for t in per_rank]
    combine = _TORCH_OPS[plan.nccl_op or plan.fold]
    if wire[0].is_floating_point() and plan.nccl_op in _NCCL_FLOAT_OPS:
        combine = _NCCL_FLOAT_OPS[plan.nccl_op]
    acc = wire[0].clone()
    for t in wire[1:]:
        acc = combine(acc, t)
    if plan.divide:
        acc = acc / len(per_rank)
    if getattr(plan, "keys", False):
        return from_order_keys(acc, arrays.TORCH, dtype)
    return acc.to(getattr(torch, dtype))


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype,op", ALLOWED_PAIRS)
def test_plan_computes_the_contract_on_every_rank_count(dtype, op, size):
    rng = np.random.default_rng(zlib.crc32(f"{dtype} {op} {size}".encode()))
    per_rank = random_rank_tensors(dtype, size, rng)
    got = run_plan(reduce_plan(dtype, op), dtype, per_rank)
    want = reference(dtype, op, per_rank)
    assert got.dtype == getattr(torch, dtype)
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        tolerance = FLOAT_TOLERANCE[dtype]
        torch.testing.assert_close(got.to(torch.float64), want, rtol=tolerance, atol=tolerance * size)
    else:
        assert torch.equal(got, want), (dtype, op, size)


QUIET_NAN = {"float16": 0x7E00, "bfloat16": 0x7FC0, "float32": 0x7FC0_0000, "float64": 0x7FF8_0000_0000_0000}
INT_OF = {"float16": torch.int16, "bfloat16": torch.int16, "float32": torch.int32, "float64": torch.int64}


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("op", [ReduceOp.MIN, ReduceOp.MAX])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_plan_keeps_nan_in_float_min_max_as_the_quiet_nan(dtype, op, size):
    """The GPU tests draw from [-2, 2]: a NaN on one rank (any NaN: negative, with a payload) must
    win MIN/MAX, as in numpy and on the other backends, and come out as the dtype's quiet NaN."""
    rng = np.random.default_rng(size)
    per_rank = [torch.from_numpy(rng.uniform(-2, 2, 6)).to(getattr(torch, dtype)) for _ in range(size)]
    bits_per = torch.finfo(getattr(torch, dtype)).bits
    odd_nans = [QUIET_NAN[dtype] - (1 << (bits_per - 1)), QUIET_NAN[dtype] + 3]  # sign bit set; a payload
    for r, t in enumerate(per_rank):
        bits = t.view(INT_OF[dtype])
        bits[r % 6] = -1  # all ones: a negative NaN with the whole payload set
        bits[5] = odd_nans[r % 2] if r else bits[5]
    got = run_plan(reduce_plan(dtype, op), dtype, per_rank)
    stacked = torch.stack([t.double() for t in per_rank])
    want = stacked.amin(0) if op is ReduceOp.MIN else stacked.amax(0)  # NaN wins (torch propagates it)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), (got, want)
    assert got.view(INT_OF[dtype])[nan].eq(QUIET_NAN[dtype]).all(), got.view(INT_OF[dtype])
    assert torch.equal(got[~nan].double(), want[~nan])


def test_nccl_version_codes_decode_both_layouts():
    assert cupy_plans.decode_nccl_version(21803) == (2, 18, 3)
    assert cupy_plans.decode_nccl_version(23000) == (2, 30, 0)
    assert cupy_plans.decode_nccl_version(2304) == (2, 3, 4)  # before 2.9: major*1000


# -- timeout: the deadline on a collective's CUDA event -------------------------------------------

@pytest.mark.skipif(HAS_CUPY, reason="CuPy is installed here: the missing-CuPy error cannot happen")
@pytest.mark.parametrize("timeout", [5, 0, datetime.timedelta(seconds=2)])
def test_cupy_takes_a_timeout_like_every_backend(timeout, monkeypatch):
    # Before: from_launcher took no timeout, so init("cupy", timeout=5) was a TypeError.
    from collectives import registry

    monkeypatch.setattr(registry, "_default", None)  # an earlier test may have initialized one
    with pytest.raises(BackendUnavailable, match="backend 'cupy' needs CuPy"):
        collectives.init("cupy", timeout=timeout)
    with pytest.raises(ValueError, match="timeout=-1"):  # checked before anything starts
        backend_class("cupy").from_launcher(SINGLE, timeout=-1)


class FakeClock:
    """Seconds that pass only when the waiter pauses (or by ``tick`` per read)."""

    def __init__(self, tick=0.0):
        self.now, self.tick, self.pauses = 0.0, tick, []

    def __call__(self):
        self.now += self.tick
        return self.now

    def pause(self, seconds):
        self.pauses.append(seconds)
        self.now += max(seconds, 1e-6)


class Event:
    """A stand-in for a CUDA event (our own unit, not the transport): done after ``polls`` queries."""

    def __init__(self, polls):
        self.left = polls

    @property
    def done(self):
        self.left -= 1
        return self.left < 0


def test_wait_for_returns_at_once_when_the_event_is_done_in_the_tight_polls():
    clock, event = FakeClock(), Event(3)
    assert cupy_handles.wait_for(lambda: event.done, 5.0, clock=clock, pause=clock.pause)
    assert clock.pauses == []


def test_wait_for_gives_up_at_the_deadline_and_backs_off_first():
    clock, checks = FakeClock(), []
    assert not cupy_handles.wait_for(lambda: False, 2.0, check=lambda: checks.append(clock.now),
                                  clock=clock, pause=clock.pause)
    assert 2.0 <= clock.now < 2.0 + cupy_handles.POLL_MAX_SECONDS + 1e-3
    sleeps = [p for p in clock.pauses if p > 0]
    assert sleeps[0] == cupy_handles.POLL_MIN_SECONDS and max(sleeps) == cupy_handles.POLL_MAX_SECONDS
    assert sleeps == sorted(sleeps[:-1]) + sleeps[-1:]  # doubling, the last cut to the deadline
    assert len(sleeps) < 250  # a hung collective polls about 100 times a second, not in a spin
    assert checks and checks[0] >= cupy_handles.BUSY_POLL_SECONDS  # async errors once it backs off


def test_wait_for_raises_what_the_error_check_raises():
    clock = FakeClock()

    def check():
        raise CollectiveError("NCCL reported an asynchronous error")

    with pytest.raises(CollectiveError, match="asynchronous"):
        cupy_handles.wait_for(lambda: False, 10.0, check=check, clock=clock, pause=clock.pause)


def test_wait_for_sees_an_event_that_completes_while_it_sleeps():
    clock, event = FakeClock(), Event(5000)
    assert cupy_handles.wait_for(lambda: event.done, 60.0, clock=clock, pause=clock.pause)
    assert clock.now < 60.0


# -- the open NCCL group of asynchronous sends/recvs: our bookkeeping around groupStart/groupEnd -----

class GroupCalls:
    """Records ncclGroupStart/End as CuPy's module functions would be called (our unit, not NCCL)."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail

    def groupStart(self):
        self.calls.append("start")

    def groupEnd(self):
        self.calls.append("end")
        if self.fail:
            raise RuntimeError("NCCL_ERROR_INVALID_USAGE: a bad p2p call in the group")


class Library:
    def record(self, stream):
        return f"event on {stream}"


def _grouped_works(nccl, count):
    from collectives.backends.local import LocalCommunicator

    comm = LocalCommunicator(timeout=0)._transport  # (a transport: its context names the call)
    works = []
    for n in range(count):
        work = cupy_handles._StreamWork(n, Library(), None, comm)
        work._stream = f"stream {n}"
        cupy_handles._open_group(nccl).append(work)
        works.append(work)
    return works


def test_async_sends_and_recvs_share_one_group_launched_once():
    nccl = GroupCalls()
    works = _grouped_works(nccl, 3)
    assert nccl.calls == ["start"]  # one group for all three
    assert not any(work.is_completed() for work in works)  # not launched: never done
    cupy_handles._launch_group(nccl)
    assert nccl.calls == ["start", "end"]
    assert [work._event for work in works] == ["event on stream 0", "event on stream 1", "event on stream 2"]
    assert getattr(cupy_handles._GROUP, "works", None) is None  # the next call opens a new group


def test_a_failed_group_fails_every_handle_in_it_with_a_collective_error():
    nccl = GroupCalls(fail=True)
    works = _grouped_works(nccl, 2)
    with pytest.raises(CollectiveError, match="INVALID_USAGE"):
        cupy_handles._launch_group(nccl)
    for work in works:
        assert work.is_completed()
        with pytest.raises(CollectiveError, match="INVALID_USAGE"):
            work.wait()
    assert getattr(cupy_handles._GROUP, "works", None) is None


# -- the collectives built from grouped send/recv: their plans against numpy ------------------------

def deliver_plans(plans, sent, received_bytes):
    """What NCCL does with one group per rank: the k-th send from i to j fills the k-th recv at
    j from i, which must have the same size. Returns every rank's receive buffer."""
    queues = {}
    for i, plan in enumerate(plans):
        for j, offset, nbytes in plan.sends:
            queues.setdefault((i, j), []).append(sent[i][offset:offset + nbytes])
    received = [bytearray(n) for n in received_bytes]
    for j, plan in enumerate(plans):
        for i, offset, nbytes in plan.recvs:
            piece = queues[(i, j)].pop(0)
            assert len(piece) == nbytes, (i, j)
            received[j][offset:offset + nbytes] = piece
    assert not any(queues.values()), "a send nobody received"
    return received


def _rows(rng, count, size):
    return rng.standard_normal((count, 3)).astype(np.float32) + 10 * size


ROW = 3 * 4  # bytes of one float32 row of 3


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_gather_and_scatter_plans_move_every_row_to_its_rank(size):
    rng = np.random.default_rng(size)
    xs = [_rows(rng, 2, r) for r in range(size)]
    for root in range(size):
        plans = [cupy_nccl.gather_plan(r, size, root, xs[r].nbytes) for r in range(size)]
        got = deliver_plans(plans, [x.tobytes() for x in xs],
                            [size * xs[0].nbytes if r == root else 0 for r in range(size)])
        np.testing.assert_array_equal(np.frombuffer(got[root], np.float32).reshape(size, 2, 3),
                                      np.stack(xs))
        table = [_rows(rng, size, r) for r in range(size)]  # only root's is read
        plans = [cupy_nccl.scatter_plan(r, size, root, ROW) for r in range(size)]
        got = deliver_plans(plans, [t.tobytes() for t in table], [ROW] * size)
        for r in range(size):
            np.testing.assert_array_equal(np.frombuffer(got[r], np.float32), table[root][r])


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_all_to_all_plans_match_numpy_with_empty_pieces_and_silent_ranks(size):
    rng = np.random.default_rng(10 + size)
    xs = [_rows(rng, size, r) for r in range(size)]
    plans = [cupy_nccl.all_to_all_plan(r, size, ROW) for r in range(size)]
    got = deliver_plans(plans, [x.tobytes() for x in xs], [size * ROW] * size)
    for r in range(size):
        np.testing.assert_array_equal(np.frombuffer(got[r], np.float32).reshape(size, 3),
                                      np.stack([xs[j][r] for j in range(size)]))
    for _ in range(5):
        splits = rng.integers(0, 3, (size, size)).tolist()
        splits[0] = [0] * size  # rank 0 sends nothing
        xs = [_rows(rng, sum(splits[i]), i) for i in range(size)]
        plans = [cupy_nccl.all_to_all_v_plan(r, splits, ROW) for r in range(size)]
        got = deliver_plans(plans, [x.tobytes() for x in xs],
                            [ROW * sum(row[r] for row in splits) for r in range(size)])
        for r in range(size):
            want = [np.split(xs[i], np.cumsum(splits[i])[:-1])[r] for i in range(size)]
            np.testing.assert_array_equal(np.frombuffer(got[r], np.float32).reshape(-1, 3),
                                          np.concatenate(want))
        assert all(n for plan in plans for _, _, n in plan.sends + plan.recvs)  # no empty calls


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_all_gather_v_plan_concatenates_in_rank_order(size):
    rng = np.random.default_rng(20 + size)
    counts = rng.integers(0, 4, size).tolist()
    counts[-1] = 0  # a rank with no rows
    xs = [_rows(rng, counts[r], r) for r in range(size)]
    plans = [cupy_nccl.all_gather_v_plan(r, counts, ROW) for r in range(size)]
    got = deliver_plans(plans, [x.tobytes() for x in xs], [ROW * sum(counts)] * size)
    for r in range(size):
        np.testing.assert_array_equal(np.frombuffer(got[r], np.float32).reshape(-1, 3),
                                      np.concatenate(xs))


# -- NCCL unique id: wire format and launchers ------------------------------------------------------

def test_unique_id_bytes_round_trip_through_cupys_char_tuple():
    raw = bytes(range(64, 192))[::-1]  # both halves of the byte range
    as_tuple = cupy_id.id_from_bytes(raw)
    assert len(as_tuple) == 128 and all(-128 <= b <= 255 for b in as_tuple)
    if cupy_id._CHAR_IS_SIGNED:
        assert min(as_tuple) < 0  # what CuPy's get_unique_id returns on x86-64
    assert cupy_id.id_to_bytes(as_tuple) == raw


@pytest.mark.parametrize("version,kind", [("14.2.0", bytes), ("14.0.0rc1", bytes), ("15.0.0", bytes),
                                          ("13.6.0", tuple), ("12.3.0", tuple)])
def test_comm_id_argument_is_bytes_from_cupy_14_and_the_char_tuple_before(version, kind):
    # CuPy 14's NcclCommunicator(ndev, bytes commId, rank) raises TypeError on a tuple;
    # CuPy 13's took the tuple get_unique_id returned.
    raw = bytes(range(128))[::-1]
    argument = cupy_id.comm_id_argument(raw, version)
    assert type(argument) is kind and cupy_id.id_to_bytes(argument) == raw


@pytest.mark.parametrize("length", [0, 127, 129])
def test_unique_id_of_wrong_length_is_refused(length):
    with pytest.raises(CollectiveError, match="128"):
        cupy_id.id_from_bytes(bytes(length))


@pytest.mark.parametrize("launch,route", [
    (LaunchInfo(None, 0, 1, 0, 1), "single"),
    (LaunchInfo("mpi", 1, 4, 1, 4), "mpi"),
    (LaunchInfo("slurm", 3, 8, 1, None), "mpi"),
    (LaunchInfo("torchrun", 0, 2, 0, 2), "store"),
    (LaunchInfo("mpi", 0, 1, 0, 1), "single"),
])
def test_each_launcher_gets_its_id_route(launch, route):
    assert cupy_id.exchange_route(launch) == route


def test_several_ranks_without_a_launcher_cannot_exchange():
    with pytest.raises(BackendUnavailable, match="mpiexec.*torchrun"):
        cupy_id.exchange_route(LaunchInfo(None, 0, 2, 0, 2))


def _refuse():
    raise AssertionError("only rank 0 makes the id")


def exchange_job(comm, ids):
    """Exchange each id of rank 0's list in turn (other ranks pass Nones)."""
    launch = detect_launcher()
    assert launch.rank == comm.rank
    return [cupy_id.exchange_unique_id(launch, (lambda raw=raw: raw) if raw is not None else _refuse)
            for raw in ids]


def _ids(count, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, 128, dtype=np.uint8).tobytes() for _ in range(count)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [("mpi", 3), ("torch", 2)], indirect=True,
                         ids=["mpiexec-broadcast", "torchrun-store"])
def test_rank_zeros_id_reaches_every_rank_byte_for_byte(world):
    ids = _ids(3, world.size)
    per_rank = [(ids,)] + [([None] * len(ids),) for _ in range(world.size - 1)]
    results = world.run(exchange_job, per_rank, timeout=120)
    for got in results:
        assert got == ids  # three exchanges in a row: keys of one never meet the next


def store_env_job(comm):
    return {name: os.environ.get(name) for name in ("MASTER_ADDR", "MASTER_PORT",
                                                    "TORCHELASTIC_USE_AGENT_STORE")}


@pytest.mark.parametrize("world", [("torch", 2)], indirect=True)
def test_torchrun_gives_the_store_address(world):
    for env in world.run(store_env_job, timeout=60):
        assert env["MASTER_ADDR"] and int(env["MASTER_PORT"]) > 0
