"""GPU checks (marker ``gpu``): run by scripts/gpu_check.sh on a CUDA machine, skipped elsewhere.

Over every transport that the machine allows on its one GPU -- torch (NCCL) and cupy at
world size 1, and at 2 ranks where NCCL >= 2.30 allows several ranks per GPU; mpi at 2 and
4 ranks, staged through pinned host memory and (if the MPI library is) CUDA-aware:
- every op x dtype of the contract on torch CUDA tensors and CuPy arrays, plus broadcast,
  all_gather, reduce_scatter, a strided input and an async handle, against the CPU reference;
- stream ordering: a kernel writes the array right before the collective and another reads
  it right after, on a non-default stream kept busy, with no explicit synchronize;
- SyncBatchNorm on CUDA against torch.nn.BatchNorm2d on the concatenated batch (float64, CPU),
  and against torch.nn.SyncBatchNorm where it runs (the torch backend);
- the cupy backend with one rank on each of two hosts of the multi-host test bed (root only;
  the NCCL id through MPI under mpiexec, through torchrun's agent store under torchrun).
"""

import importlib
import importlib.util
import os
import zlib

import numpy as np
import pytest
import torch
from reference_ops import FLOAT_TOLERANCE, random_rank_tensors, reference

from collectives import ALLOWED_OPS, DTYPES, ReduceOp
from collectives.testing.pool import RankPool

CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available() is "
                                                  "False): run scripts/gpu_check.sh on a GPU machine")]

FLOATS = ("float16", "bfloat16", "float32", "float64")
MULTI_RANK = {"NCCL_MULTI_RANK_GPU_ENABLE": "1"}
STAGED = {"COLLECTIVES_MPI_CUDA_AWARE": "0"}
AWARE = {"COLLECTIVES_MPI_CUDA_AWARE": "1"}
#: Cycles of torch.cuda._sleep that keep a stream busy (tens of milliseconds on an H200).
BUSY_CYCLES = 50_000_000
JOB_TIMEOUT = 120

# (id, backend, ranks, launcher, environment of the ranks)
WORLDS = [
    ("torch-nccl-1", "torch", 1, "torchrun", {}),
    ("torch-nccl-2", "torch", 2, "torchrun", MULTI_RANK),
    ("cupy-1", "cupy", 1, "torchrun", {}),
    ("cupy-2-mpi-id", "cupy", 2, "mpiexec", MULTI_RANK),
    ("cupy-2-store-id", "cupy", 2, "torchrun", MULTI_RANK),
    ("mpi-2-staged", "mpi", 2, "mpiexec", STAGED),
    ("mpi-4-staged", "mpi", 4, "mpiexec", STAGED),
    ("mpi-2-cuda-aware", "mpi", 2, "mpiexec", AWARE),
    ("mpi-4-cuda-aware", "mpi", 4, "mpiexec", AWARE),
]


# -- which worlds this machine can run -----------------------------------------------------------

def _torch_nccl_version():
    version = torch.cuda.nccl.version()
    return tuple(version) if isinstance(version, tuple) else None


def _cupy_nccl_version():
    from collectives.backends.cupy_nccl import nccl_runtime_version

    return nccl_runtime_version()


def _mpi_problem(need_cuda_aware):
    from collectives.info import mpi_report

    report = mpi_report()
    if not report["usable"]:
        return f"MPI is unavailable: {report['why']}"
    if need_cuda_aware:
        from collectives.backends.mpi import mpi_cuda_aware
        from mpi4py import MPI

        saved = os.environ.pop("COLLECTIVES_MPI_CUDA_AWARE", None)
        try:
            aware = mpi_cuda_aware(MPI)
        finally:
            if saved is not None:
                os.environ["COLLECTIVES_MPI_CUDA_AWARE"] = saved
        if not aware:
            return f"{report['library']} is not CUDA-aware (MPIX_Query_cuda_support() is 0)"
    return None


def skip_reason(backend, size, launcher, env):
    """Why this machine cannot run the world, or None."""
    from collectives.backends.cupy_nccl import MULTI_RANK_GPU_SINCE

    if backend == "cupy" and not HAS_CUPY:
        return "CuPy is not installed"
    if launcher == "mpiexec" or backend == "mpi":
        problem = _mpi_problem(env is AWARE)
        if problem:
            return problem
    if backend in ("torch", "cupy") and size > 1:
        version = _torch_nccl_version() if backend == "torch" else _cupy_nccl_version()
        if version is None or version < MULTI_RANK_GPU_SINCE:
            shown = ".".join(map(str, version)) if version else "unknown"
            return (f"{backend}'s NCCL {shown} allows one rank per GPU (several need NCCL >= 2.30 "
                    "with NCCL_MULTI_RANK_GPU_ENABLE=1), and this machine has "
                    f"{torch.cuda.device_count()} GPU(s)")
    return None


@pytest.fixture(scope="module", params=WORLDS, ids=[w[0] for w in WORLDS])
def gpu_world(request):
    _, backend, size, launcher, env = request.param
    if size > 1 and backend in ("torch", "cupy") and torch.cuda.device_count() >= size:
        env = {}  # one GPU per rank: nothing special needed
    reason = skip_reason(backend, size, launcher, env)
    if reason:
        pytest.skip(reason)
    pool = RankPool(backend, size, launcher=launcher, env=env, job_timeout=JOB_TIMEOUT)
    pool.start()
    yield pool
    pool.close()


# -- helpers that run on the ranks ---------------------------------------------------------------

def _to_device(library, cpu):
    """The CPU tensor on the GPU, as a torch tensor or a CuPy array; None if CuPy lacks the dtype.

    ``library="cpu"`` keeps it on the host: how tests/test_gpu_harness.py checks these jobs in CI.
    """
    if library == "cpu":
        return cpu.clone()
    if library == "torch":
        return cpu.cuda()
    import cupy

    if cpu.dtype == torch.bfloat16:
        try:
            import ml_dtypes

            return cupy.asarray(cpu.float().numpy().astype(ml_dtypes.bfloat16))
        except Exception:  # noqa: BLE001  (no ml_dtypes, or a CuPy without bfloat16)
            return None
    return cupy.asarray(cpu.numpy())


def _to_cpu(x):
    """A numpy array for the trip back (torch tensors do not cross the pool's connection;
    bfloat16 travels as float32, which holds it exactly)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    import cupy

    host = cupy.asnumpy(x)
    return host.astype(np.float32) if host.dtype.name == "bfloat16" else host


def to_wire(t):
    """A CPU tensor as what travels to a rank: numpy, bfloat16 as float32."""
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def from_wire(a, dtype):
    return torch.from_numpy(np.ascontiguousarray(a)).to(getattr(torch, dtype))


def _same_kind(result, like):
    assert type(result) is type(like), (type(result), type(like))
    assert result.dtype == like.dtype and result.device == like.device


def grid_job(comm, library, inputs, root):
    """Every collective on every dtype (and op) of ``inputs``; results as CPU tensors."""
    results = {}
    for dtype, array in inputs.items():
        cpu = from_wire(array, dtype)
        like = _to_device(library, cpu)
        if like is None:
            continue
        for op in ReduceOp:
            if op not in ALLOWED_OPS[dtype]:
                continue
            x = _to_device(library, cpu)
            assert comm.all_reduce(x, op) is x
            results[("all_reduce", dtype, op.value)] = _to_cpu(x)
            y = comm.reduce_scatter(_to_device(library, cpu), op)
            _same_kind(y, like)
            results[("reduce_scatter", dtype, op.value)] = _to_cpu(y)
        wide = _to_device(library, torch.stack([cpu, cpu], dim=-1).reshape(cpu.shape[0], -1))
        strided = wide[:, ::2]  # non-contiguous: reduced through a copy, written back
        comm.all_reduce(strided, "max")
        results[("all_reduce_strided", dtype, "max")] = _to_cpu(strided)
        results[("untouched_columns", dtype, "")] = _to_cpu(wide[:, 1::2])
        x = _to_device(library, cpu)
        work = comm.all_reduce(x, "max", async_op=True)
        assert work.wait() is x
        results[("all_reduce_async", dtype, "max")] = _to_cpu(x)
        x = _to_device(library, cpu)
        comm.broadcast(x, src=root)
        results[("broadcast", dtype, "")] = _to_cpu(x)
        gathered = comm.all_gather(_to_device(library, cpu))
        _same_kind(gathered, like)
        results[("all_gather", dtype, "")] = _to_cpu(gathered)
    if library != "cpu":
        torch.cuda.synchronize()
    return results


def split_job(comm, library):
    """split into even and odd ranks (the last of 3+ ranks joins none), keys reversing the order;
    (rank, size, all_reduce of rank+1) in the new communicator, or None."""
    size = comm.size
    color = None if (size > 2 and comm.rank == size - 1) else comm.rank % 2
    sub = comm.split(color, key=size - comm.rank)
    if sub is None:
        return None
    x = _to_device(library, torch.full((3,), float(comm.rank + 1)))
    sub.all_reduce(x)
    reply = (sub.rank, sub.size, _to_cpu(x).tolist())
    sub.close()
    return reply


def check_split(world, library):
    size = world.size
    replies = world.run(split_job, args=(library,), timeout=JOB_TIMEOUT)
    last_alone = size > 2
    for rank, reply in enumerate(replies):
        if last_alone and rank == size - 1:
            assert reply is None
            continue
        members = sorted((r for r in range(size) if r % 2 == rank % 2 and not (last_alone and r == size - 1)),
                         key=lambda r: size - r)
        assert reply == (members.index(rank), len(members), [float(sum(r + 1 for r in members))] * 3)


def stream_order_job(comm, library, n, async_op):
    """all_reduce of rank+1 written on a busy stream, read right after; (min, max) of 2*result."""
    if library == "torch":
        s, other = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(s):
            x = torch.zeros(n, device="cuda")
            torch.cuda._sleep(BUSY_CYCLES)  # a collective that ran ahead would read zeros
            x.fill_(comm.rank + 1)
            if async_op:
                work = comm.all_reduce(x, async_op=True)
                with torch.cuda.stream(other):
                    work.wait()
                    y = x * 2
            else:
                comm.all_reduce(x)
                y = x * 2
        torch.cuda.synchronize()
        assert not async_op or work.is_completed()
        return float(y.min()), float(y.max())
    import cupy

    s, other = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.zeros(n, dtype=cupy.float32)
        with torch.cuda.stream(torch.cuda.ExternalStream(s.ptr)):
            torch.cuda._sleep(BUSY_CYCLES)
        x.fill(comm.rank + 1)
        if async_op:
            work = comm.all_reduce(x, async_op=True)
            with other:
                work.wait()
                y = x * 2
        else:
            comm.all_reduce(x)
            y = x * 2
    cupy.cuda.Device().synchronize()
    assert not async_op or work.is_completed()
    return float(y.min()), float(y.max())


def syncbn_job(comm, x_part, dy_part, with_torch_syncbn, device="cuda"):
    """Training forward/backward of syncbn.SyncBatchNorm on ``device`` (and torch's, if asked)."""
    from collectives import syncbn

    channels = x_part.shape[1]
    outputs = {}
    modules = {"ours": syncbn.SyncBatchNorm(channels, comm=comm, device=device)}
    if with_torch_syncbn:
        modules["torch"] = torch.nn.SyncBatchNorm(channels).to(device)
    for name, bn in modules.items():
        bn.train()
        x = torch.from_numpy(x_part).to(device).requires_grad_()
        y = bn(x)
        (y * torch.from_numpy(dy_part).to(device)).sum().backward()
        outputs[name] = {key: _to_cpu(value) for key, value in (
            ("y", y), ("dx", x.grad), ("dw", bn.weight.grad), ("db", bn.bias.grad),
            ("mean", bn.running_mean), ("var", bn.running_var))}
    return outputs


# -- the tests -------------------------------------------------------------------------------------

def _inputs(size, seed):
    rng = np.random.default_rng(seed)
    per_dtype = {dtype: random_rank_tensors(dtype, size, rng, shape=(2 * size, 3)) for dtype in DTYPES}
    return [{dtype: tensors[r] for dtype, tensors in per_dtype.items()} for r in range(size)]


def _assert_matches(got, want, dtype, size, what):
    if dtype in FLOATS:
        tolerance = FLOAT_TOLERANCE[dtype]
        torch.testing.assert_close(got.to(torch.float64), want.to(torch.float64), rtol=tolerance,
                                   atol=tolerance * size, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want.to(got.dtype)), f"{what}: {got} != {want}"


@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_every_op_and_dtype_matches_the_reference(gpu_world, library):
    if library == "cupy" and not HAS_CUPY:
        pytest.skip("CuPy is not installed: no CuPy arrays to test")
    check_grid(gpu_world, library)


def check_grid(world, library):
    """Run grid_job on ``world`` and compare every result with the CPU reference."""
    size = world.size
    inputs = _inputs(size, zlib.crc32(f"{world.backend} {size} {library}".encode()))
    root = size - 1
    wire = [{dtype: to_wire(t) for dtype, t in per_rank.items()} for per_rank in inputs]
    replies = world.run(grid_job, [(library, wire[r], root) for r in range(size)],
                        timeout=JOB_TIMEOUT)
    results = [{key: from_wire(value, key[1]) for key, value in reply.items()} for reply in replies]
    ran = {key[1] for key in results[0]}
    expected = set(DTYPES) if library != "cupy" else set(DTYPES) - {"bfloat16"}
    assert expected <= ran, f"dtypes not run: {sorted(expected - ran)}"
    for key, got0 in results[0].items():
        collective, dtype, op = key
        column = [inputs[r][dtype] for r in range(size)]
        if collective not in ("reduce_scatter", "untouched_columns"):  # every rank holds the same bytes
            for r in range(1, size):
                assert torch.equal(results[r][key].view(torch.uint8), got0.view(torch.uint8)), (key, r)
        for r in range(size):
            got = results[r][key]
            if collective in ("all_reduce", "all_reduce_async", "all_reduce_strided"):
                want = reference(dtype, ReduceOp(op), column)
            elif collective == "reduce_scatter":
                rows = column[0].shape[0] // size
                want = reference(dtype, ReduceOp(op), column)[r * rows:(r + 1) * rows]
            elif collective == "broadcast":
                want = column[root]
            elif collective == "all_gather":
                want = torch.stack(column)
            else:  # the odd columns of the strided input: not written
                want = column[r]
            assert got.dtype == column[0].dtype, key
            _assert_matches(got, want, dtype, size, f"{key} on rank {r}")


@pytest.mark.parametrize("async_op", [False, True], ids=["blocking", "async"])
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_collective_is_ordered_with_the_callers_kernels(gpu_world, library, async_op):
    if library == "cupy" and not HAS_CUPY:
        pytest.skip("CuPy is not installed: no CuPy arrays to test")
    size = gpu_world.size
    want = 2.0 * size * (size + 1) / 2
    for low, high in gpu_world.run(stream_order_job, args=(library, 1 << 22, async_op),
                                   timeout=JOB_TIMEOUT):
        assert low == high == want


@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_split_groups_reduce_among_themselves(gpu_world, library):
    if library == "cupy" and not HAS_CUPY:
        pytest.skip("CuPy is not installed: no CuPy arrays to test")
    check_split(gpu_world, library)


def _syncbn_available():
    try:
        module = importlib.import_module("collectives.syncbn")
    except ImportError:
        return False
    return hasattr(module, "SyncBatchNorm")


def test_syncbn_on_cuda_matches_batchnorm_on_the_concatenated_batch(gpu_world):
    if not _syncbn_available():
        pytest.skip("syncbn.SyncBatchNorm does not exist in this checkout yet (issue 3)")
    check_syncbn(gpu_world, "cuda", with_torch=gpu_world.backend == "torch")


def check_syncbn(world, device, with_torch):
    """SyncBatchNorm on ``world`` (uneven batches) vs BatchNorm2d on the whole batch in float64;
    also torch.nn.SyncBatchNorm when ``with_torch`` (it needs torch.distributed and CUDA)."""
    size = world.size
    generator = torch.Generator().manual_seed(size)
    channels, counts = 5, [r + 2 for r in range(size)]  # uneven batches
    x = torch.randn(sum(counts), channels, 4, 3, generator=generator, dtype=torch.float64) * 3 + 1
    dy = torch.randn(x.shape, generator=generator, dtype=torch.float64)
    parts = [(xp.numpy(), dp.numpy()) for xp, dp in zip(x.float().split(counts), dy.float().split(counts))]
    replies = world.run(syncbn_job, [(xp, dp, with_torch, device) for xp, dp in parts], timeout=JOB_TIMEOUT)
    results = [{name: {key: torch.from_numpy(v) for key, v in out.items()} for name, out in reply.items()}
               for reply in replies]

    reference_bn = torch.nn.BatchNorm2d(channels, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    yr = reference_bn(xr)
    (yr * dy).sum().backward()
    for name in ("ours", "torch") if with_torch else ("ours",):
        ys = torch.cat([results[r][name]["y"] for r in range(size)]).double()
        dxs = torch.cat([results[r][name]["dx"] for r in range(size)]).double()
        torch.testing.assert_close(ys, yr.detach(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dxs, xr.grad, rtol=1e-4, atol=1e-4)
        # weight/bias grads are per rank (as in torch.nn.SyncBatchNorm): they sum to the reference
        dw = sum(results[r][name]["dw"].double() for r in range(size))
        db = sum(results[r][name]["db"].double() for r in range(size))
        torch.testing.assert_close(dw, reference_bn.weight.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(db, reference_bn.bias.grad, rtol=1e-4, atol=1e-4)
        for r in range(size):
            torch.testing.assert_close(results[r][name]["mean"].double(), reference_bn.running_mean,
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(results[r][name]["var"].double(), reference_bn.running_var,
                                       rtol=1e-5, atol=1e-5)


# -- the cupy backend on two hosts (the multi-host test bed of tests/test_multihost.py) ---------

@pytest.mark.parametrize("launcher, id_route", [("mpiexec", "MPI_Bcast"), ("torchrun", "agent store")])
def test_cupy_backend_with_one_rank_on_each_of_two_hosts(launcher, id_route):
    """NCCL across two hosts (network namespaces, root only), the id through ``id_route``.
    Both hosts' ranks take device 0 (local_rank 0 on each): NCCL_MULTI_RANK_GPU_ENABLE."""
    from collectives.testing.hosts import TestBed, unavailable_reason

    reason = unavailable_reason() or skip_reason("cupy", 2, launcher, MULTI_RANK)
    if reason:
        pytest.skip(reason)
    from test_multihost import SCRIPTS, run_job

    with TestBed(2) as bed:
        codes, text = run_job(bed, launcher, [str(SCRIPTS / "gpu_multihost_check.py")], "cupy",
                              ranks_per_host=1, env=MULTI_RANK)
    assert set(codes.values()) == {0}, text
    assert "CUPY OK ranks=2 hosts=2" in text, text
