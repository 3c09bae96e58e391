"""The CPU-checkable parts of the cupy backend: no CUDA here, and none faked.

The NCCL id exchange runs for real over mpiexec (MPI broadcast) and torchrun (TCP
store) with arbitrary 128-byte ids; the dtype x op plan is checked against NCCL's
type table and, on every rank count, against an independent reference computed in
Python integers / float64; the errors are the ones a user without CuPy or with host
arrays gets.
"""

import importlib.util
import os
import sys
import zlib

import numpy as np
import pytest
import torch
from collectives.backends import cupy_nccl, nccl_id
from collectives.backends.cupy_nccl import NCCL_DTYPES, NCCL_OPS, check_cuda_array, reduce_plan, split_members
from reference_ops import FLOAT_TOLERANCE, random_rank_tensors, reference

from collectives import ALLOWED_OPS, DTYPES, BackendUnavailable, CollectiveError, ReduceOp, arrays
from collectives.launcher import LaunchInfo, detect_launcher
from collectives.registry import backend_class

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
        cupy_nccl.nccl_runtime_version()


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


def run_plan(plan, dtype, per_rank):
    """What the backend computes: NCCL's elementwise op in the wire type (two's complement
    wrapping, as NCCL's kernels do), or the local fold, then AVG's division, then the cast back."""
    wire = [t.to(getattr(torch, plan.wire)) for t in per_rank]
    combine = _TORCH_OPS[plan.nccl_op or plan.fold]
    acc = wire[0].clone()
    for t in wire[1:]:
        acc = combine(acc, t)
    if plan.divide:
        acc = acc / len(per_rank)
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


def test_nccl_version_codes_decode_both_layouts():
    assert cupy_nccl.decode_nccl_version(21803) == (2, 18, 3)
    assert cupy_nccl.decode_nccl_version(23000) == (2, 30, 0)
    assert cupy_nccl.decode_nccl_version(2304) == (2, 3, 4)  # before 2.9: major*1000


def test_split_members_orders_by_key_then_rank_and_skips_none():
    everyone = [[1, 5], [0, 0], [1, 5], [1, 2], [-1, 0]]
    assert split_members(everyone, 1) == [3, 0, 2]
    assert split_members(everyone, 0) == [1]
    assert split_members(everyone, None) == []


# -- NCCL unique id: wire format and launchers ------------------------------------------------------

def test_unique_id_bytes_round_trip_through_cupys_char_tuple():
    raw = bytes(range(64, 192))[::-1]  # both halves of the byte range
    as_tuple = nccl_id.id_from_bytes(raw)
    assert len(as_tuple) == 128 and all(-128 <= b <= 255 for b in as_tuple)
    if nccl_id._CHAR_IS_SIGNED:
        assert min(as_tuple) < 0  # what CuPy's get_unique_id returns on x86-64
    assert nccl_id.id_to_bytes(as_tuple) == raw


@pytest.mark.parametrize("length", [0, 127, 129])
def test_unique_id_of_wrong_length_is_refused(length):
    with pytest.raises(CollectiveError, match="128"):
        nccl_id.id_from_bytes(bytes(length))


@pytest.mark.parametrize("launch,route", [
    (LaunchInfo(None, 0, 1, 0, 1), "single"),
    (LaunchInfo("mpi", 1, 4, 1, 4), "mpi"),
    (LaunchInfo("slurm", 3, 8, 1, None), "mpi"),
    (LaunchInfo("torchrun", 0, 2, 0, 2), "store"),
    (LaunchInfo("mpi", 0, 1, 0, 1), "single"),
])
def test_each_launcher_gets_its_id_route(launch, route):
    assert nccl_id.exchange_route(launch) == route


def test_several_ranks_without_a_launcher_cannot_exchange():
    with pytest.raises(BackendUnavailable, match="mpiexec.*torchrun"):
        nccl_id.exchange_route(LaunchInfo(None, 0, 2, 0, 2))


def _refuse():
    raise AssertionError("only rank 0 makes the id")


def exchange_job(comm, ids):
    """Exchange each id of rank 0's list in turn (other ranks pass Nones)."""
    launch = detect_launcher()
    assert launch.rank == comm.rank
    return [nccl_id.exchange_unique_id(launch, (lambda raw=raw: raw) if raw is not None else _refuse)
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
