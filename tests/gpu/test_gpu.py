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
- reduce, gather, scatter, all_to_all (equal, with splits) and all_gather_v against numpy, blocking
  and async into out=; async send/recv rings in both wait orders (16 MiB: NCCL needs its group);
- the cupy backend's timeout (a stream held past it; a rank that never joins) and its debug mode
  (fingerprints and p2p headers through device memory); the torch route's timeout of a CUDA
  tensor's call (a stream held past it).
- the cupy backend with one rank on each of two hosts of the multi-host test bed (root only;
  the NCCL id through MPI under mpiexec, through torchrun's agent store under torchrun).
- a fault-tolerant DDP job on CUDA under collectives-elastic (NCCL per generation): one rank
  across a shrink no failure forced, and two ranks where one is SIGKILLed (NCCL >= 2.30 or 2 GPUs).
"""

import dataclasses
import functools
import importlib
import importlib.util
import os
import zlib

import numpy as np
import pytest
import torch

from collectives import ALLOWED_OPS, DTYPES, ReduceOp
from collectives.info import nccl_versions
from collectives.launcher import without_launcher_variables
from collectives.testing.launch import launcher_command
from collectives.testing.pool import RankPool
from collectives.testing.reference import FLOAT_TOLERANCE, random_rank_tensors
from collectives.testing.reference import reference_tensor as reference

CUDA = torch.cuda.is_available()
HAS_CUPY = importlib.util.find_spec("cupy") is not None
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available() is "
                                                  "False): run scripts/gpu_check.sh on a GPU machine")]

FLOATS = ("float16", "bfloat16", "float32", "float64")
MULTI_RANK_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
MULTI_RANK = {MULTI_RANK_ENV: "1"}
STAGED = {"COLLECTIVES_MPI_CUDA_AWARE": "0"}
AWARE = {"COLLECTIVES_MPI_CUDA_AWARE": "1"}
#: Cycles of torch.cuda._sleep that keep a stream busy (tens of milliseconds on an H100 or an H200).
BUSY_CYCLES = 50_000_000
#: Seconds a job may take on the ranks: a hung one fails the test within this, not the check's budget.
JOB_TIMEOUT = 60

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
#: One rank of each backend: scripts/gpu_check.sh runs these first (-k smoke), in seconds, and
#: skips the worlds of a backend whose smoke failed.
SMOKE_WORLDS = [
    ("torch-nccl-1", "torch", 1, "torchrun", {}),
    ("cupy-1", "cupy", 1, "torchrun", {}),
    ("mpi-1-staged", "mpi", 1, "mpiexec", STAGED),
    ("mpi-1-cuda-aware", "mpi", 1, "mpiexec", AWARE),
]


# -- which worlds this machine can run -----------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Machine:
    """What a machine offers the GPU worlds: :meth:`probe` reads this one (once); the CPU tests
    of the skip logic (tests/gpu/test_gpu_paths.py) describe others."""

    gpus: int
    has_cupy: bool
    #: The NCCL of "torch" and of "cupy" that gates several ranks per GPU: (major, minor, patch), or
    #: None if unknown (collectives.info.nccl_versions' "gate": the loaded libnccl's where known).
    nccl: dict
    #: Why MPI cannot run here, or None; why MPI cannot take device memory directly, or None.
    mpi_problem: str | None
    cuda_aware_problem: str | None
    #: backend -> why scripts/gpu_check.sh's 1-rank smoke of it failed (its worlds then skip).
    smoke_failed: dict = dataclasses.field(default_factory=dict)

    @classmethod
    @functools.cache
    def probe(cls):
        return cls(gpus=torch.cuda.device_count(), has_cupy=HAS_CUPY,
                   nccl={"torch": nccl_versions("torch")["gate"],
                         "cupy": nccl_versions("cupy")["gate"] if HAS_CUPY else None},
                   mpi_problem=_mpi_problem(False), cuda_aware_problem=_mpi_problem(True),
                   smoke_failed=smoke_failures(os.environ.get(SMOKE_FAILED_ENV, "")))


#: Set by scripts/gpu_check.sh: "backend: why; ..." for each backend whose 1-rank smoke failed.
SMOKE_FAILED_ENV = "GPU_CHECK_SMOKE_FAILED"


def smoke_failures(text):
    pairs = (item.partition(":") for item in text.split(";") if item.strip())
    return {name.strip(): why.strip() for name, _, why in pairs}


def _mpi_problem(need_cuda_aware):
    from collectives.info import mpi_report

    report = mpi_report()
    if not report["usable"]:
        return f"MPI is unavailable: {report['why']}"
    if need_cuda_aware:
        from collectives.backends.mpi_buffers import mpi_cuda_aware
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


def skip_reason(backend, size, launcher, env, machine=None):
    """Why ``machine`` (default: this one) cannot run the world, or None."""
    from collectives.backends.cupy_nccl import MULTI_RANK_GPU_SINCE

    machine = machine or Machine.probe()
    if backend in machine.smoke_failed:
        return f"the 1-rank smoke of backend {backend} failed ({machine.smoke_failed[backend]})"
    if backend == "cupy" and not machine.has_cupy:
        return "CuPy is not installed"
    if launcher == "mpiexec" or backend == "mpi":
        problem = machine.mpi_problem or (machine.cuda_aware_problem if env is AWARE else None)
        if problem:
            return problem
    if backend in ("torch", "cupy") and size > machine.gpus:
        version = machine.nccl[backend]
        shown = ".".join(map(str, version)) if version else "unknown"
        if version is None or version < MULTI_RANK_GPU_SINCE:
            return (f"{backend}'s NCCL {shown} allows one rank per GPU (several need NCCL >= 2.30 "
                    f"with NCCL_MULTI_RANK_GPU_ENABLE=1), and this machine has {machine.gpus} GPU(s): "
                    f"{size} {backend} ranks not exercised")
        if {**os.environ, **env}.get(MULTI_RANK_ENV) != "1":
            return (f"{backend}'s NCCL {shown} puts several ranks on one GPU only with {MULTI_RANK_ENV}=1, "
                    f"which this world does not set: {size} {backend} ranks on {machine.gpus} GPU(s) not exercised")
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


@pytest.mark.parametrize("world_id, backend, size, launcher, env", SMOKE_WORLDS, ids=[w[0] for w in SMOKE_WORLDS])
def test_smoke_one_rank(world_id, backend, size, launcher, env):
    """The calls a broken set-up fails first, on device memory of each array library: the rank
    starts, a sum, a NaN MIN (the quiet NaN), bfloat16 (CuPy's through DLPack), async, all_gather."""
    reason = skip_reason(backend, size, launcher, env)
    if reason:
        pytest.skip(reason)
    with RankPool(backend, size, launcher=launcher, env=env, job_timeout=JOB_TIMEOUT) as pool:
        (out,) = pool.run(smoke_job, timeout=JOB_TIMEOUT)
    assert "torch" in out["libraries"]
    for library in out["libraries"]:
        assert out[library, "sum"] == list(range(8)), library
        assert out[library, "min-nan"] == [0x7FC0_0000, 1.0, -2.0], library
        assert out[library, "bfloat16"] in ([1.0] * 4, None), library  # None: CuPy without bfloat16
        assert out[library, "all_gather"] == [[3.0, 3.0]], library


def smoke_job(comm):
    libraries = ["torch"] + (["cupy"] if importlib.util.find_spec("cupy") else [])
    out = {"libraries": libraries}
    for library in libraries:
        x = _to_device(library, torch.arange(8, dtype=torch.float32))
        comm.all_reduce(x)
        out[library, "sum"] = _to_cpu(x).tolist()
        y = _to_device(library, torch.tensor([float("nan"), 1.0, -2.0]))
        comm.all_reduce(y, "min")
        got = _to_cpu(y)
        out[library, "min-nan"] = [int(got[:1].view(np.int32)[0]), *got[1:].tolist()]
        z = _to_device(library, torch.ones(4, dtype=torch.bfloat16))
        if z is not None:
            assert comm.all_reduce(z, "max", async_op=True).wait() is z
        out[library, "bfloat16"] = None if z is None else _to_cpu(z).tolist()
        out[library, "all_gather"] = _to_cpu(comm.all_gather(_to_device(library, torch.full((2,), 3.0)))).tolist()
    torch.cuda.synchronize()
    return out


# -- helpers that run on the ranks ---------------------------------------------------------------

def _to_device(library, cpu):
    """The CPU tensor on the GPU, as a torch tensor or a CuPy array; None if CuPy lacks the dtype.

    ``library="cpu"`` keeps it on the host: how tests/gpu/test_gpu_harness.py checks these jobs in CI.
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


def needs_library(library):
    if library == "cupy" and not HAS_CUPY:
        pytest.skip("CuPy is not installed: no CuPy arrays to test")


def _assert_matches(got, want, dtype, size, what):
    if dtype in FLOATS:
        tolerance = FLOAT_TOLERANCE[dtype]
        torch.testing.assert_close(got.to(torch.float64), want.to(torch.float64), rtol=tolerance,
                                   atol=tolerance * size, msg=lambda m: f"{what}: {m}")
    else:
        assert torch.equal(got, want.to(got.dtype)), f"{what}: {got} != {want}"


@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_every_op_and_dtype_matches_the_reference(gpu_world, library):
    needs_library(library)
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
    needs_library(library)
    size = gpu_world.size
    want = 2.0 * size * (size + 1) / 2
    for low, high in gpu_world.run(stream_order_job, args=(library, 1 << 22, async_op),
                                   timeout=JOB_TIMEOUT):
        assert low == high == want


@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_split_groups_reduce_among_themselves(gpu_world, library):
    needs_library(library)
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


# -- the rest of the collective set (issue 11) -----------------------------------------------------

#: dtypes the data-moving collectives run on (reduce runs on every dtype): a plain one, one NCCL
#: lacks (bool), one staged on some transports (bfloat16) and a 2-byte integer.
SET_DTYPES = ("float32", "bool", "bfloat16", "int16")
#: Floats per message of the point-to-point checks: 16 MiB, more than NCCL sends without a
#: posted recv, so sends and recvs issued one by one would deadlock on NCCL without its group.
P2P_FLOATS = 1 << 22


def _empty(library, like, shape):
    if library == "cupy":
        import cupy

        return cupy.empty(shape, dtype=like.dtype)
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _plain(x):
    """A result as it travels back: None, a numpy array, or (array, counts)."""
    if x is None:
        return None
    if isinstance(x, tuple):
        return _to_cpu(x[0]), list(x[1])
    return _to_cpu(x)


def _set_cases(comm, rows, mine, part, splits, counts):
    """name -> (blocking call, async call into out=, out's shape or None) for collective_set_job."""
    size, rank, dst = comm.size, comm.rank, comm.size - 1
    received = sum(row[rank] for row in splits)
    return {
        "gather": (lambda: comm.gather(rows, dst),
                   lambda out: comm.gather(rows, dst, out=out, async_op=True),
                   (size, size, 3) if rank == dst else None),
        "scatter": (lambda: comm.scatter(rows, dst),
                    lambda out: comm.scatter(rows, dst, out=out, async_op=True), (3,)),
        "all_to_all": (lambda: comm.all_to_all(rows),
                       lambda out: comm.all_to_all(rows, out=out, async_op=True), (size, 3)),
        "all_to_all_v": (lambda: comm.all_to_all(mine, splits[rank]),
                         lambda out: comm.all_to_all(mine, splits[rank], out=out, async_op=True),
                         (received, 3)),
        "all_gather_v": (lambda: comm.all_gather_v(part),
                         lambda out: comm.all_gather_v(part, out=out, async_op=True),
                         (sum(counts), 3)),
    }


def collective_set_job(comm, library, inputs, splits, counts):
    """reduce on every dtype x op (dst = last rank); gather, scatter, all_to_all (equal and with
    ``splits``), all_gather_v (``counts`` rows per rank), each blocking, async into out=, and
    gather of a strided input; every result as numpy (None where the rank gets none)."""
    size, rank, dst = comm.size, comm.rank, comm.size - 1
    results = {}
    for dtype, array in inputs.items():
        cpu = from_wire(array, dtype)  # (2 * size, 3)
        like = _to_device(library, cpu)
        if like is None:
            continue
        for op in ReduceOp:
            if op in ALLOWED_OPS[dtype]:
                x = _to_device(library, cpu)
                assert comm.reduce(x, op, dst) is x
                results[("reduce", dtype, op.value)] = _to_cpu(x)
        if dtype not in SET_DTYPES:
            continue
        x = _to_device(library, cpu)
        assert comm.reduce(x, "max", dst, async_op=True).wait() is x
        results[("reduce_async", dtype, "max")] = _to_cpu(x)
        rows = _to_device(library, cpu[:size])
        mine = _to_device(library, cpu[:sum(splits[rank])])
        part = _to_device(library, cpu[:counts[rank]])
        cases = _set_cases(comm, rows, mine, part, splits, counts)
        for name, (blocking, into, out_shape) in cases.items():
            results[(name, dtype, "")] = _plain(blocking())
            out = None if out_shape is None else _empty(library, like, out_shape)
            got = into(out).wait()
            if out is not None:
                assert (got[0] if isinstance(got, tuple) else got) is out, name
            results[(name + "_out_async", dtype, "")] = _plain(got)
        wide = _to_device(library, torch.stack([cpu[:size], cpu[:size]], dim=-1).reshape(size, -1))
        results[("gather_strided", dtype, "")] = _plain(comm.gather(wide[:, ::2], dst))
    if library != "cpu":
        torch.cuda.synchronize()
    return results


def _set_expectation(collective, dtype, op, column, rank, size, splits, counts):
    """What rank ``rank`` must hold, from every rank's input ``column`` (CPU tensors)."""
    dst = size - 1
    base = collective.removesuffix("_out_async").removesuffix("_async").removesuffix("_strided")
    rows = [c[:size] for c in column]
    if base == "reduce":
        return reference(dtype, ReduceOp(op), column) if rank == dst else column[rank]
    if base == "gather":
        return torch.stack(rows) if rank == dst else None
    if base == "scatter":
        return rows[dst][rank]
    if base == "all_to_all":
        return torch.stack([rows[j][rank] for j in range(size)])
    if base == "all_to_all_v":
        return torch.cat([torch.split(column[i][:sum(splits[i])], splits[i])[rank]
                          for i in range(size)])
    assert base == "all_gather_v"
    return torch.cat([column[i][:counts[i]] for i in range(size)]), counts


def check_collective_set(world, library):
    size = world.size
    seed = zlib.crc32(f"set {world.backend} {size} {library}".encode())
    inputs = _inputs(size, seed)
    rng = np.random.default_rng(seed)
    splits = rng.integers(0, 3, (size, size)).tolist()
    splits[0] = [0] * size  # rank 0 sends nothing; zero-length pieces elsewhere too
    counts = [r % 3 for r in range(size)]  # rank 0 has no rows
    wire = [{dtype: to_wire(t) for dtype, t in per_rank.items()} for per_rank in inputs]
    replies = world.run(collective_set_job, [(library, wire[r], splits, counts) for r in range(size)],
                        timeout=JOB_TIMEOUT)
    assert {key[0] for key in replies[0]} >= {"reduce", "gather", "scatter", "all_to_all",
                                              "all_to_all_v", "all_gather_v"}
    for r, reply in enumerate(replies):
        for (collective, dtype, op), got in reply.items():
            column = [inputs[i][dtype] for i in range(size)]
            want = _set_expectation(collective, dtype, op, column, r, size, splits, counts)
            what = f"{collective} {dtype} {op} on rank {r}"
            if want is None:
                assert got is None, what
                continue
            if isinstance(want, tuple):
                (got, got_counts), (want, want_counts) = got, want
                assert got_counts == want_counts, what
            got = from_wire(got, dtype)
            assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)}"
            if collective.startswith("reduce") and r == size - 1:
                _assert_matches(got, want, dtype, size, what)
            else:  # moved, not computed (or untouched off dst): the same bytes
                assert torch.equal(got, want.to(got.dtype)), f"{what}: {got} != {want}"


@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_reduce_gather_scatter_all_to_all_all_gather_v_match_numpy(gpu_world, library):
    needs_library(library)
    check_collective_set(gpu_world, library)


def p2p_job(comm, library, n, recv_first):
    """A ring of async sends and recvs (all issued, then waited, recv or send first), then a
    blocking pairwise exchange (even ranks send first); what arrived, as (min, max)."""
    size, rank = comm.size, comm.rank
    x = _to_device(library, torch.full((n,), float(rank + 1)))
    y = _to_device(library, torch.zeros(n))
    sent = comm.send(x, (rank + 1) % size, async_op=True)
    got = comm.recv(y, (rank - 1) % size, async_op=True)
    for work in (got, sent) if recv_first else (sent, got):
        work.wait()
    ring = float(y.min()), float(y.max())
    partner = rank ^ 1
    pair = None
    if partner < size:
        z = _to_device(library, torch.zeros(n))
        if rank % 2 == 0:
            comm.send(x, partner)
            assert comm.recv(z, partner) is z
        else:
            comm.recv(z, partner)
            comm.send(x, partner)
        pair = float(z.min()), float(z.max())
    if library != "cpu":
        torch.cuda.synchronize()
    return ring, pair


@pytest.mark.parametrize("recv_first", [False, True], ids=["send-waited-first", "recv-waited-first"])
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_async_send_recv_ring_completes_in_any_wait_order(gpu_world, library, recv_first):
    needs_library(library)
    if gpu_world.size == 1:
        pytest.skip("point-to-point needs another rank (the cupy backend's own group is checked "
                    "at size 1 by test_cupy_sends_to_itself_in_one_group)")
    check_p2p(gpu_world, library, recv_first)


def check_p2p(world, library, recv_first, n=P2P_FLOATS):
    size = world.size
    replies = world.run(p2p_job, args=(library, n, recv_first), timeout=JOB_TIMEOUT)
    for rank, (ring, pair) in enumerate(replies):
        sender = float((rank - 1) % size + 1)
        assert ring == (sender, sender), (rank, ring)
        assert pair == ((float((rank ^ 1) + 1),) * 2 if rank ^ 1 < size else None), (rank, pair)


def cupy_self_job(comm, library, n):
    """White-box, at size 1 (no peer to call the public send/recv with): the backend's async
    send and recv to itself, the recv waited first (one NCCL group, else a deadlock at this
    size), and the small-vector hooks of debug mode on device memory."""
    from collectives import arrays
    from collectives.calls import RECV, SEND, Request

    x = _to_device(library, torch.full((n,), 7.0))
    y = _to_device(library, torch.zeros(n))
    adapter = arrays.adapter_for(x)
    dtype = adapter.dtype_name(x)
    got = comm._transport._recv(Request(RECV, y, adapter, dtype, root=0, async_op=True, extra=0))
    sent = comm._transport._send(Request(SEND, x, adapter, dtype, root=0, async_op=True, extra=0))
    assert not got.is_completed()  # queued in the open group until a wait
    got.wait()
    sent.wait()
    vector, into = np.arange(5, dtype=np.int64) - 2**40, np.zeros(5, dtype=np.int64)
    header_sent = comm._transport._send_small(vector, 0, 0)
    comm._transport._recv_small(into, 0, 0).wait()
    header_sent.wait()
    everyone = comm._transport._exchange_small(np.array([3, -1, 2**40], dtype=np.int64))
    scratch = comm._transport._scratch_bytes(x, adapter, 10)
    torch.cuda.synchronize()
    return ((float(y.min()), float(y.max())), into.tolist(), type(everyone).__module__,
            everyone.tolist(), (str(scratch.dtype), tuple(scratch.shape), adapter.is_cuda(scratch)))


@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_cupy_sends_to_itself_in_one_group(gpu_world, library):
    if gpu_world.backend != "cupy" or gpu_world.size != 1:
        pytest.skip("white-box check of the cupy backend at world size 1")
    received, header, kind, everyone, scratch = gpu_world.run(
        cupy_self_job, args=(library, P2P_FLOATS), timeout=JOB_TIMEOUT)[0]
    assert received == (7.0, 7.0)
    assert header == (np.arange(5) - 2**40).tolist()
    assert kind == "numpy" and everyone == [[3, -1, 2**40]]  # host memory, as the base class expects
    assert scratch == ("uint8" if library == "cupy" else "torch.uint8", (10,), True)


# -- the cupy backend's timeout and debug mode (issue 15) -------------------------------------------

#: Cycles of torch.cuda._sleep that hold the stream well past TIMEOUT_SECONDS (3.5-4 s at the
#: 1.7-2 GHz of an H100 or an H200).
HOLD_CYCLES = 7_000_000_000
TIMEOUT_SECONDS = 2.0
# Communicators a job keeps alive after it returns (a peer may still be waiting on them).
_KEEP = []


def _cupy_pool(size, env):
    if not HAS_CUPY:
        pytest.skip("CuPy is not installed")
    env = dict(env)
    if size > 1:
        env.update(MULTI_RANK if torch.cuda.device_count() < size else {})
        reason = skip_reason("cupy", size, "torchrun", env)
        if reason:
            pytest.skip(reason)
    pool = RankPool("cupy", size, launcher="torchrun", env=env, job_timeout=JOB_TIMEOUT)
    pool.start()
    return pool


@pytest.fixture(scope="module")
def cupy_timeout_world():
    pool = _cupy_pool(1, {"COLLECTIVES_TIMEOUT": f"{TIMEOUT_SECONDS:g}"})
    yield pool
    pool.close()


def _until_broken(comm, start, seconds):
    """Wait until the watchdog has made ``comm`` unusable (at most ``seconds`` after ``start``)."""
    import threading
    import time

    pause = threading.Event()
    while not comm._broken and time.perf_counter() - start < seconds:
        pause.wait(0.01)


def held_stream_job(comm, library, case):
    """A collective on a fresh split, queued behind a kernel that holds the stream past the
    timeout: it returns once enqueued (seconds it took), and the watchdog's CollectiveTimeout is
    raised by the next call or the handle's wait: (outcome, seconds until then, the call after's
    error, the world's error)."""
    import time

    import collectives
    from collectives import CollectiveError, CollectiveTimeout

    assert collectives.init("cupy", timeout=TIMEOUT_SECONDS) is comm  # the argument is taken
    sub = comm.split(0)
    _KEEP.append(sub)
    x = _to_device(library, torch.ones(1024))
    torch.cuda._sleep(HOLD_CYCLES)  # on the default stream, which both libraries use here
    start = time.perf_counter()
    work = sub.all_reduce(x, async_op=case != "blocking")
    enqueued = time.perf_counter() - start
    _until_broken(sub, start, TIMEOUT_SECONDS + 30)
    try:
        if case == "blocking":
            sub.all_reduce(x)
        else:
            work.wait()
        outcome = ("no error", "")
    except CollectiveTimeout as error:
        outcome = ("CollectiveTimeout", str(error))
    elapsed = time.perf_counter() - start
    try:
        sub.all_reduce(x)
        after = ("no error", "")
    except CollectiveError as error:
        after = (type(error).__name__, str(error))
    torch.cuda.synchronize()
    try:  # a timeout makes every communicator of the backend unusable (the pool then restarts)
        comm.all_reduce(_to_device(library, torch.full((3,), 2.0)))
        world = ("no error", "")
    except CollectiveError as error:
        world = (type(error).__name__, str(error))
    return comm.timeout, enqueued, outcome, elapsed, after, world


# One case per pool start (a timeout leaves the ranks unusable); barrier takes the same wait.
@pytest.mark.parametrize("library,case", [("cupy", "blocking"), ("torch", "async")])
def test_cupy_collective_past_its_timeout_raises_and_aborts(cupy_timeout_world, library, case):
    timeout, enqueued, (kind, message), elapsed, (after_kind, after), (world_kind, world) = cupy_timeout_world.run(
        held_stream_job, args=(library, case), timeout=JOB_TIMEOUT)[0]
    assert timeout == TIMEOUT_SECONDS  # COLLECTIVES_TIMEOUT, no longer ignored on cupy
    assert enqueued < TIMEOUT_SECONDS / 2, enqueued  # returned once enqueued: no host wait
    assert kind == "CollectiveTimeout", message
    assert "backend=cupy" in message and f"timeout={TIMEOUT_SECONDS:g}s" in message, message
    assert "all_reduce (call #1)" in message and "ncclCommAbort" in message and "now unusable" in message, message
    assert TIMEOUT_SECONDS <= elapsed < TIMEOUT_SECONDS + 8, elapsed  # abort may wait for the held stream
    assert after_kind == "CollectiveTimeout" and "all_reduce (call #1)" in after, after
    assert world_kind == "CollectiveError" and "shares the cupy transport" in world, world
    print(f"TIMING cupy timeout {TIMEOUT_SECONDS:g} s [{case}, {library}]: {elapsed:.3f} s")


@pytest.fixture(scope="module")
def torch_timeout_world():
    env = {"COLLECTIVES_TIMEOUT": f"{TIMEOUT_SECONDS:g}"}
    reason = skip_reason("torch", 1, "torchrun", env)
    if reason:
        pytest.skip(reason)
    pool = RankPool("torch", 1, launcher="torchrun", env=env, job_timeout=JOB_TIMEOUT)
    pool.start()
    yield pool
    pool.close()


def torch_held_stream_job(comm, case):
    """The torch route (NCCL through torch.distributed): a CUDA tensor's all_reduce on a fresh split,
    queued behind a kernel that holds the stream past the timeout: it returns once enqueued (seconds
    it took), and the watchdog's CollectiveTimeout is raised by the next call or the handle's wait
    (the process alive: torch's own NCCL watchdog waits longer): (outcome, seconds until then, the
    call after's error, the world's error)."""
    import time

    from collectives import CollectiveError, CollectiveTimeout

    sub = comm.split(0)
    _KEEP.append(sub)
    x = torch.ones(1024, device="cuda")
    sub.all_reduce(x)  # call #1: the group's NCCL communicator made before the clock starts
    torch.cuda.synchronize()
    torch.cuda._sleep(HOLD_CYCLES)
    start = time.perf_counter()
    work = sub.all_reduce(x, async_op=case != "blocking")  # call #2
    enqueued = time.perf_counter() - start
    _until_broken(sub, start, TIMEOUT_SECONDS + 30)
    try:
        if case == "blocking":
            sub.all_reduce(x)
        else:
            work.wait()
        outcome = ("no error", "")
    except CollectiveTimeout as error:
        outcome = ("CollectiveTimeout", str(error))
    elapsed = time.perf_counter() - start
    try:
        sub.all_reduce(x)
        after = ("no error", "")
    except CollectiveError as error:
        after = (type(error).__name__, str(error))
    torch.cuda.synchronize()
    try:  # a timeout makes every communicator of the backend unusable (the pool then restarts)
        comm.all_reduce(torch.full((3,), 2.0, device="cuda"))
        world = ("no error", "")
    except CollectiveError as error:
        world = (type(error).__name__, str(error))
    return comm.timeout, enqueued, outcome, elapsed, after, world


# One case per pool start (a timeout leaves the ranks unusable).
@pytest.mark.parametrize("case", ["blocking", "async"])
def test_torch_nccl_collective_past_its_timeout_raises_at_the_next_call(torch_timeout_world, case):
    timeout, enqueued, (kind, message), elapsed, (after_kind, after), (world_kind, world) = torch_timeout_world.run(
        torch_held_stream_job, args=(case,), timeout=JOB_TIMEOUT)[0]
    assert timeout == TIMEOUT_SECONDS
    assert enqueued < TIMEOUT_SECONDS / 2, enqueued  # returned once enqueued: no host wait
    assert kind == "CollectiveTimeout", message
    assert "backend=torch" in message and f"timeout={TIMEOUT_SECONDS:g}s" in message, message
    assert "all_reduce (call #2)" in message and "NCCL backend" in message, message
    assert TIMEOUT_SECONDS <= elapsed < TIMEOUT_SECONDS + 8, elapsed  # abort may wait for the held stream
    assert after_kind == "CollectiveTimeout" and "all_reduce (call #2)" in after, after
    assert world_kind == "CollectiveError" and "shares the torch transport" in world, world
    print(f"TIMING torch nccl timeout {TIMEOUT_SECONDS:g} s [{case}]: {elapsed:.3f} s")


@pytest.fixture(scope="module", params=[False, True], ids=["plain", "debug"])
def cupy_pair_world(request):
    # Connections made at creation: a rank's first call to a peer cannot then block on the host.
    env = {"COLLECTIVES_TIMEOUT": f"{TIMEOUT_SECONDS:g}", "NCCL_RUNTIME_CONNECT": "0"}
    if request.param:
        env["COLLECTIVES_DEBUG"] = "1"
    pool = _cupy_pool(2, env)
    yield pool
    pool.close()


def never_joins_job(comm):
    """Rank 1 never makes rank 0's second all_reduce (in debug mode rank 0 then waits in the
    fingerprint exchange, through device memory)."""
    import time

    from collectives import CollectiveTimeout

    sub = comm.split(0)
    _KEEP.append(sub)
    x = _to_device("cupy", torch.ones(8))
    sub.all_reduce(x)
    if comm.rank == 1:
        return sub.debug, None, None
    start = time.perf_counter()
    try:
        sub.all_reduce(x)  # plain: returns once enqueued; debug: its fingerprints wait on the host
        _until_broken(sub, start, TIMEOUT_SECONDS + 30)
        sub.all_reduce(x)  # raises the watchdog's timeout of call #2
        outcome = ("no error", "")
    except CollectiveTimeout as error:
        outcome = ("CollectiveTimeout", str(error))
    return sub.debug, outcome, time.perf_counter() - start


def test_cupy_rank_that_never_joins_times_out(cupy_pair_world):
    (debug, (kind, message), elapsed), (debug1, _, _) = cupy_pair_world.run(never_joins_job,
                                                                             timeout=JOB_TIMEOUT)
    assert debug == debug1
    assert kind == "CollectiveTimeout", message
    assert "all_reduce (call #2)" in message and f"timeout={TIMEOUT_SECONDS:g}s" in message, message
    assert TIMEOUT_SECONDS <= elapsed < TIMEOUT_SECONDS + 5, elapsed
    print(f"TIMING cupy never-joins {TIMEOUT_SECONDS:g} s [debug={debug}]: {elapsed:.3f} s")


def debug_flag_job(comm):
    return comm.debug


def debug_mismatch_job(comm, case):
    from collectives import CollectiveMismatch

    sub = comm.split(0)
    _KEEP.append(sub)
    x = _to_device("cupy", torch.ones(4 + (comm.rank if case == "p2p" else 0)))
    try:
        if case == "collective":
            sub.all_reduce(x) if comm.rank == 0 else sub.broadcast(x, 0)
        elif comm.rank == 0:
            sub.send(x, 1)
        else:
            sub.recv(x, 0)
        outcome = ("no error", "")
    except CollectiveMismatch as error:
        outcome = ("CollectiveMismatch", str(error))
    return sub.debug, outcome, _to_cpu(x).tolist()


@pytest.mark.parametrize("case", ["collective", "p2p"])
def test_cupy_debug_mode_compares_fingerprints_on_the_device(cupy_pair_world, case):
    if not cupy_pair_world.run(debug_flag_job, timeout=JOB_TIMEOUT)[0]:
        pytest.skip("not a debug-mode world: without it a mismatch is a hang or garbage")
    replies = cupy_pair_world.run(debug_mismatch_job, args=(case,), timeout=JOB_TIMEOUT)
    if case == "collective":  # both ranks see it, before anything moves
        for rank, (_, (kind, message), x) in enumerate(replies):
            assert kind == "CollectiveMismatch", (rank, message)
            assert "operation differs: all_reduce on rank 0; broadcast on rank 1" in message, message
            assert x == [1.0] * 4
    else:  # the receiver sees the header's shape differ; its x is untouched
        _, (kind, message), x = replies[1]
        assert kind == "CollectiveMismatch", message
        assert "(4,)" in message and "(5,)" in message, message
        assert x == [1.0] * 5
# -- the cupy backend on two hosts (the multi-host test bed of tests/launchers/test_multihost.py) ---------

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


@pytest.mark.parametrize("how", [
    pytest.param(("cupy", []), id="cupy-1"),
    pytest.param(("torch", []), id="torch-nccl-1"),
    pytest.param(("mpi", ["mpiexec", "-n", "2"]), id="mpi-2-torch-cuda"),
])
def test_collectives_bench_checks_every_collective_on_the_gpu(how):
    """collectives-bench --check --raw on device memory: every collective right, the raw column there."""
    import subprocess
    import sys

    from collectives.bench import parse_table

    backend, launcher = how
    reason = skip_reason(backend, 2 if launcher else 1, launcher[0] if launcher else "torchrun", STAGED)
    if reason:
        pytest.skip(reason)
    args = ["all", "-b", "8", "-e", "1M", "-f", "64", "-n", "3", "-w", "1", "--check", "--raw",
            "--backend", backend] + (["--array", "torch", "--device", "cuda"] if backend != "cupy" else [])
    # python -m: the image's python has no console script of ours; mpiexec where the MPI is.
    # This process is an MPI singleton once a skip reason asked MPI whether it is CUDA-aware:
    # Open MPI 4.1's mpiexec, started with its job variables, exited 1 and printed nothing.
    argv = [*launcher_command(launcher[0]), *launcher[1:]] if launcher else []
    done = subprocess.run([*argv, sys.executable, "-m", "collectives.bench", *args], capture_output=True,
                          text=True, timeout=JOB_TIMEOUT, env=without_launcher_variables(os.environ))
    assert done.returncode == 0, f"exit {done.returncode}: " + done.stdout[-3000:] + done.stderr[-3000:]
    rows = parse_table(done.stdout)
    assert rows and all(row["wrong"] == 0 for row in rows)


# -- torch.distributed over the "collectives" backend (collectives.c10d) on CUDA ----------------

C10D_WORLDS = [
    ("cupy-1", "cupy", 1, "torchrun", {}),
    ("cupy-2", "cupy", 2, "mpiexec", MULTI_RANK),
    ("mpi-2-staged", "mpi", 2, "mpiexec", STAGED),
    ("mpi-2-cuda-aware", "mpi", 2, "mpiexec", AWARE),
]


@pytest.mark.parametrize("world_id, backend, ranks, launcher, env", C10D_WORLDS,
                         ids=[w[0] for w in C10D_WORLDS])
def test_c10d_ddp_with_torch_syncbatchnorm_on_cuda_equals_one_process(world_id, backend, ranks, launcher, env):
    reason = skip_reason(backend, ranks, launcher, env)
    if reason:
        pytest.skip(reason)
    import c10d_jobs

    with RankPool(backend, ranks, launcher=launcher, env=env, job_timeout=JOB_TIMEOUT) as pool:
        for out in pool.run(c10d_jobs.cuda_ddp_syncbn_job, args=(3,), timeout=JOB_TIMEOUT):
            for name, want in out["want"].items():
                np.testing.assert_allclose(out["got"][name], want, rtol=0, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("world_id, backend, ranks, launcher, env", C10D_WORLDS[:2],
                         ids=[w[0] for w in C10D_WORLDS[:2]])
def test_c10d_over_cupy_enqueues_cuda_operations_on_the_callers_stream(world_id, backend, ranks, launcher, env):
    """Its CPU twin's checks (tests/torch_distributed/test_c10d_streams.py) on CUDA tensors: 40
    blocking all_reduces equal numpy with no host wait and no CPU collective on the calling thread,
    a future completed off it; at 2 ranks a reduce op that differs on rank 1 raises
    CollectiveMismatch at the next call and at the mismatched call's wait() on every rank."""
    reason = skip_reason(backend, ranks, launcher, env)
    if reason:
        pytest.skip(reason)
    import test_c10d_streams as streams

    with RankPool(backend, ranks, launcher=launcher, env=env, job_timeout=JOB_TIMEOUT) as pool:
        streams.check_blocking(pool.run(streams.blocking_job, args=(40, True), timeout=JOB_TIMEOUT), 40)
        for wait in (False, True) if ranks > 1 else ():
            streams.check_mismatch(pool.run(streams.mismatch_job, args=("op", wait, True), timeout=JOB_TIMEOUT),
                                   "reduce op differs: SUM on rank 0; MAX on rank 1", cuda=True)


# -- a fault-tolerant job on CUDA (collectives-elastic, torch backend: NCCL per generation) ------

ELASTIC_WORLDS = [
    # (id, ranks, the job's arguments): one rank shrinks though none failed (every group of the
    # generation aborted, NCCL's included, and made again); two lose rank 1 to SIGKILL at step 3.
    ("elastic-torch-nccl-1", 1, ["--shrink-at", "3"]),
    ("elastic-torch-nccl-2", 2, ["--faults", "1:kill@3"]),
]


@pytest.mark.parametrize("world_id, ranks, job_args", ELASTIC_WORLDS, ids=[w[0] for w in ELASTIC_WORLDS])
def test_elastic_ddp_on_cuda_goes_on_across_a_shrink(world_id, ranks, job_args, tmp_path, monkeypatch):
    """DDP over collectives.c10d.process_group() on CUDA under collectives-elastic: each
    generation's group runs NCCL, a shrink aborts the last one's communicators and makes new
    ones, and the survivors end with the parameters of a plain-torch replay on the CPU."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    reason = skip_reason("torch", ranks, "torchrun", MULTI_RANK if ranks > 1 else {})
    if reason:
        pytest.skip(reason)
    jobs = Path(__file__).resolve().parent.parent / "elastic"
    monkeypatch.syspath_prepend(str(jobs))
    import ddp_job

    env = {k: v for k, v in without_launcher_variables(os.environ).items() if not k.startswith("COLLECTIVES_")}
    env.update(MULTI_RANK if ranks > torch.cuda.device_count() else {})
    command = [sys.executable, "-m", "collectives.elastic.launcher", "-n", str(ranks), "--timeout", "20",
               sys.executable, str(jobs / "ddp_job.py"), str(tmp_path), "--device", "cuda", *job_args]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT,
                          stdin=subprocess.DEVNULL, cwd=str(jobs))
    assert done.returncode == 0, f"exit {done.returncode}: " + done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(path.read_text()) for path in tmp_path.glob("*.json")]
    assert len(results) == 1, [r["rank"] for r in results]
    sizes = [ranks] * 3 + [1] * (ddp_job.STEPS - 3)
    expected = ddp_job.reference(sizes)
    for result in results:
        assert result["generation"] == 1 and result["sizes"] == sizes
        assert "nccl" in result["backend"] and result["param_device"].startswith("cuda"), result["backend"]
        assert result["workers"] and len(result["workers"]) == 1
        for got, want in zip(result["params"], expected):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-10, atol=1e-12)


# -- every pool the GPU tests start, and whether a machine can run it (checked on CPU) --------------

def every_world():
    """(id, backend, ranks, launcher, env) of every world the GPU tests start."""
    return (list(WORLDS) + [(f"c10d-{w[0]}", *w[1:]) for w in C10D_WORLDS]
            + [("cupy-timeout-1", "cupy", 1, "torchrun", {}), ("cupy-timeout-2", "cupy", 2, "torchrun", MULTI_RANK),
               ("cupy-2-hosts-mpiexec", "cupy", 2, "mpiexec", MULTI_RANK),
               ("cupy-2-hosts-torchrun", "cupy", 2, "torchrun", MULTI_RANK)]
            + [(f"smoke-{w[0]}", *w[1:]) for w in SMOKE_WORLDS]
            + [(w[0], "torch", w[1], "torchrun", MULTI_RANK if w[1] > 1 else {}) for w in ELASTIC_WORLDS])


def world_skip_reasons(machine):
    """world id -> why ``machine`` cannot run it (None where it can)."""
    return {world_id: skip_reason(backend, size, launcher, env, machine)
            for world_id, backend, size, launcher, env in every_world()}
