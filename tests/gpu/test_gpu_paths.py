"""CPU twins of GPU code paths whose mistakes only a GPU would show, each checked here on CPU:

- bfloat16 between CuPy and torch (torch backend): through DLPack, which carries it, not the
  CUDA array interface, where CuPy 14 types it '<V2' (ml_dtypes' dtype.str) and torch refuses
  it; a CuPy-like array on host memory with CuPy 14.2's two interfaces stands in for CuPy's;
- the stream a torch-backend handle of a CuPy array orders at ``wait()``: CuPy's current one
  then, not at the call (a fake stream registry stands in for CUDA's);
- the cupy backend's write-back of a staged async recv: on the call's stream (same registry);
- CUDA-aware MPI: every kernel that writes what MPI reads (staging, order keys) before the
  stream is synchronized, and that before MPI sees the memory, which it gets as raw device
  memory (an ordering probe around a real 1-rank MPI job, its "device" tensors on the host);
  and the device every backend binds;
- the torch backend's asynchronous sends and recvs of CUDA tensors, batched into
  ``batch_isend_irecv`` (run over Gloo here, with the batching switched on);
- which GPU worlds a machine skips, from its NCCL version and GPU count;
- SyncBatchNorm's inference-mode batch-norm backward calls (its one-pass sums, forward and
  backward): CUDA's kernel asserts that the saved statistics are defined tensors, where CPU's
  takes None; a stand-in op with CUDA's precondition runs them here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import numpy as np
import pytest
import torch
from collectives.backends import cupy_handles, torch_dist, torch_handles
from collectives.backends.local import LocalCommunicator
from collectives.backends.torch_dist import TorchTransport

from collectives import arrays, syncbn
from collectives.calls import ALL_REDUCE, REDUCE, REDUCE_SCATTER, Request
from collectives.ops import ReduceOp

#: What CuPy 14.2 puts in __cuda_array_interface__ for its bfloat16 (ml_dtypes') arrays: the
#: dtype's str; torch's own bfloat16 typestr is the same (torch/_tensor.py).
BFLOAT16_TYPESTR = "<V2"


class CupyLikeArray:
    """A bfloat16 array on host memory offering what CuPy 14.2's arrays offer a consumer: the
    CUDA array interface (typestr '<V2') and DLPack (kDLBfloat, from the same memory)."""

    def __init__(self, bits):
        self._bits = bits  # an int16 tensor holding the bfloat16 values
        self.shape = tuple(bits.shape)
        self.strides = tuple(2 * s for s in bits.stride())
        self.device = types.SimpleNamespace(id=0)
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": BFLOAT16_TYPESTR,
                                         "descr": [("", BFLOAT16_TYPESTR)], "strides": None,
                                         "data": (bits.data_ptr(), False), "version": 3}

    def __dlpack__(self, **kwargs):
        return self._bits.view(torch.bfloat16).__dlpack__()

    def __dlpack_device__(self):
        return self._bits.__dlpack_device__()


def fake_cupy(monkeypatch):
    """A ``cupy`` module whose from_dlpack and asarray read a producer as CuPy 14.2 does:
    from_dlpack maps kDLBfloat to bfloat16; asarray takes the CUDA array interface's typestr
    (a void dtype for '<V2', as numpy.dtype gives)."""
    module = types.ModuleType("cupy")

    def from_dlpack(producer):
        tensor = torch.from_dlpack(producer)
        if tensor.dtype != torch.bfloat16:
            raise AssertionError("the stand-in only carries bfloat16")
        return CupyLikeArray(tensor.view(torch.int16))

    def asarray(producer):
        typestr = torch._tensor._dtype_to_typestr(producer.dtype)  # what its CAI would say
        return types.SimpleNamespace(dtype=np.dtype(typestr))

    module.from_dlpack, module.asarray = from_dlpack, asarray
    monkeypatch.setitem(__import__("sys").modules, "cupy", module)
    return module


def test_cuda_array_interface_cannot_carry_bfloat16_to_torch():
    # Why DLPack: the route the torch backend used to take fails as the issue saw on the GPU.
    x = CupyLikeArray(torch.zeros(4, dtype=torch.int16))
    with pytest.raises(TypeError, match="numpy.void"):
        torch.as_tensor(x, device="cuda:0")


def test_torch_backend_takes_a_cupy_bfloat16_array_through_dlpack():
    bits = torch.tensor([0x3F80, -0x4080, 0x7FC0], dtype=torch.int16)  # 1.0, -1.0, nan
    x = CupyLikeArray(bits)
    t = TorchTransport._as_tensor(types.SimpleNamespace(_torch=torch), x, arrays.CUPY)
    assert t.dtype == torch.bfloat16 and t.data_ptr() == bits.data_ptr()  # zero-copy
    assert t[:2].tolist() == [1.0, -1.0]


def test_torch_backend_returns_bfloat16_results_to_cupy_through_dlpack(monkeypatch):
    fake_cupy(monkeypatch)
    result = torch.tensor([1.5, 2.5], dtype=torch.bfloat16)
    back = torch_dist._as_cupy(torch, result)
    assert not isinstance(back, types.SimpleNamespace), "went through the CUDA array interface"
    assert back._bits.data_ptr() == result.data_ptr()
    assert back._bits.view(torch.bfloat16).tolist() == [1.5, 2.5]


# -- streams: a fake registry of current streams --------------------------------------------------------

class StreamRegistry:
    """CuPy's and torch's current streams, as the code under test sets and reads them."""

    def __init__(self, monkeypatch):
        self.cupy_current = 11  # stream pointers
        self.torch_current = "torch default"
        self.log = []
        registry = self

        class Device:
            id = 0

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        class Stream:
            @property
            def ptr(self):
                return registry.cupy_current

        cupy = types.ModuleType("cupy")
        cupy.cuda = types.SimpleNamespace(get_current_stream=lambda device_id=-1: Stream())
        monkeypatch.setitem(__import__("sys").modules, "cupy", cupy)
        self.array = types.SimpleNamespace(device=Device())

        @contextlib.contextmanager
        def stream(s):
            saved, registry.torch_current = registry.torch_current, s
            try:
                yield
            finally:
                registry.torch_current = saved

        monkeypatch.setattr(torch.cuda, "stream", stream)
        self.made = []  # (the torch streams made: one per CuPy stream)
        monkeypatch.setattr(torch.cuda, "ExternalStream",
                            lambda ptr, device=None: self.made.append(ptr) or f"cupy stream {ptr}")
        monkeypatch.setattr(torch_handles, "_torch_streams", {})
        monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: "torch default")


class RecordingWork:
    """A torch.distributed handle: records which stream was torch's current one at its wait()."""

    def __init__(self, registry):
        self.registry = registry

    def wait(self):
        self.registry.log.append(self.registry.torch_current)

    def is_completed(self):
        return True


def test_torch_handle_of_a_cupy_array_orders_cupys_stream_current_at_wait(monkeypatch):
    registry = StreamRegistry(monkeypatch)
    wrap = getattr(torch_handles, "_torch_call", None) or torch_handles._on_cupy_stream

    def _all_reduce(self, r):
        registry.log.append(("called on", registry.torch_current))
        return torch_handles._TorchWork(r.x, RecordingWork(registry))

    call = wrap(_all_reduce)
    work = call(types.SimpleNamespace(_torch=torch),
                Request(ALL_REDUCE, registry.array, arrays.CUPY, "float32", ReduceOp.SUM, async_op=True))
    registry.cupy_current = 22  # the caller moves to another stream, then waits there
    work.wait()
    assert registry.log == [("called on", "cupy stream 11"), "cupy stream 22"]
    assert registry.torch_current == "torch default"
    for _ in range(3):  # later calls on those streams: torch's views of them made once
        call(types.SimpleNamespace(_torch=torch),
             Request(ALL_REDUCE, registry.array, arrays.CUPY, "float32", ReduceOp.SUM, async_op=True)).wait()
        registry.cupy_current = 33 - registry.cupy_current  # 11, 22, 11...
    assert registry.made == [11, 22]


class StreamLibrary:
    """One array library's streams for cupy_handles: a current stream, ``use`` and events."""

    def __init__(self):
        self.current = "stream at launch"

    @contextlib.contextmanager
    def use(self, stream):
        saved, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = saved

    def record(self, stream):
        return f"event on {stream}"


class GroupCalls:
    def groupStart(self):
        pass

    def groupEnd(self):
        pass


def test_cupy_backend_writes_a_staged_async_recv_back_on_the_calls_stream():
    from collectives.backends.local import LocalCommunicator

    library, written_on = StreamLibrary(), []
    work = cupy_handles._StreamWork(None, library, None, LocalCommunicator(timeout=0)._transport)
    work._stream, work._then = "recv's stream", lambda: written_on.append(library.current)
    cupy_handles._open_group(GroupCalls()).append(work)
    cupy_handles._launch_group(GroupCalls())
    assert written_on == ["recv's stream"]  # after NCCL's recv there, not on the launcher's
    assert work._event == "event on recv's stream" and library.current == "stream at launch"


# -- CUDA-aware MPI: the order of writes, synchronization and the hand-over ------------------------------

def handoff_probe_job(comm, case):
    """A 1-rank MPI job: ``case`` on torch tensors the backend takes for CUDA memory (host memory
    here) with MPI taken for CUDA-aware; what happened, in order: "keys" (order keys written),
    "sync" (a stream synchronized), "mpi <call>" with the kinds of buffer MPI was handed."""
    from collectives.backends import _float_order, mpi_buffers

    log = []

    class Stream:
        def synchronize(self):
            log.append("sync")

    class LoggedComm:
        def __init__(self, real):
            self._real = real

        def __getattr__(self, name):
            attribute = getattr(self._real, name)
            if not name[:1].isupper() or not callable(attribute):
                return attribute

            def call(*args, **kwargs):
                kinds = sorted({type(a[0]).__name__ for a in args if isinstance(a, list) and a})
                log.append(f"mpi {name} {kinds}")
                return attribute(*args, **kwargs)
            return call

    encode = _float_order.encode

    def logged_encode(*args):
        log.append("keys")
        encode(*args)

    transport = comm._transport
    saved = (transport._comm, transport._cuda_aware, getattr(transport, "_device_memory", None))
    patches = [(arrays.TORCH, "is_cuda", lambda x: True), (torch.cuda, "current_stream", lambda device=None: Stream()),
               (_float_order, "encode", logged_encode)]
    originals = [(owner, name, owner.__dict__.get(name, getattr(owner, name))) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    comm._transport._comm, comm._transport._cuda_aware = LoggedComm(comm._transport._comm), True
    try:
        x = torch.tensor([3.0, float("nan"), -1.0, 2.0])
        if case == "all_reduce_min":
            comm._transport._all_reduce(Request(ALL_REDUCE, x, arrays.TORCH, "float32", ReduceOp.MIN))
            result = x
        elif case == "reduce_scatter_max":
            result = comm._transport._reduce_scatter(Request(REDUCE_SCATTER, x, arrays.TORCH, "float32", ReduceOp.MAX))
        elif case == "reduce_min_async":
            comm._transport._reduce(Request(REDUCE, x, arrays.TORCH, "float32", ReduceOp.MIN, 0,
                                                 async_op=True)).wait()
            result = x
        else:  # bfloat16 MAX, staged through a contiguous copy (a strided input)
            wide = torch.stack([x, x], dim=-1).to(torch.bfloat16)
            result = wide[:, 0]
            comm._transport._all_reduce(Request(ALL_REDUCE, result, arrays.TORCH, "bfloat16", ReduceOp.MAX))
    finally:
        for owner, name, value in originals:
            if owner is arrays.TORCH:
                del owner.is_cuda  # back to the class's method
            else:
                setattr(owner, name, value)
        comm._transport._comm, comm._transport._cuda_aware = saved[0], saved[1]
        if saved[2] is not None:
            comm._transport._device_memory = saved[2]
    bits = result.float().view(torch.int32).tolist()
    return log, bits, type(mpi_buffers.bind_device).__name__ if hasattr(mpi_buffers, "bind_device") else None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["all_reduce_min", "reduce_scatter_max", "reduce_min_async",
                                  "all_reduce_bf16_strided"])
@pytest.mark.parametrize("world", [("mpi", 1)], indirect=True, ids=["mpi-1"])
def test_cuda_aware_mpi_gets_memory_only_after_every_write_and_the_sync(world, case):
    (log, bits, _), = world.run(handoff_probe_job, args=(case,), timeout=120)
    calls = [i for i, event in enumerate(log) if event.startswith("mpi ")]
    assert calls and "sync" in log, log
    first_call, sync = calls[0], log.index("sync")
    assert all(i < sync for i, event in enumerate(log) if event == "keys"), f"keys written after the sync: {log}"
    assert sync < first_call, f"MPI got the memory before the stream was synchronized: {log}"
    assert all("DeviceMemory" in log[i] and "Tensor" not in log[i] for i in calls), \
        f"MPI was handed a tensor (its __dlpack__ refuses another device's): {log}"
    quiet = 0x7FC0_0000
    want = {"all_reduce_min": [0x40400000, quiet, -0x40800000, 0x40000000],  # 3.0, nan, -1.0, 2.0
            "reduce_scatter_max": [0x40400000, quiet, -0x40800000, 0x40000000],
            "reduce_min_async": [0x40400000, quiet, -0x40800000, 0x40000000],
            "all_reduce_bf16_strided": [0x40400000, quiet, -0x40800000, 0x40000000]}[case]
    assert bits == want, [hex(b & 0xFFFFFFFF) for b in bits]


def test_mpi_backend_binds_local_rank_modulo_device_count(monkeypatch):
    from collectives.backends import mpi_buffers

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.delitem(__import__("sys").modules, "cupy", raising=False)
    assert mpi_buffers.bind_device(7) == 1
    assert chosen == [1]


# -- torch backend: asynchronous sends/recvs of CUDA tensors in one batch ----------------------------

def batched_ring_job(comm, recv_first, n):
    """A ring of async sends and recvs, waited in either order, with the torch backend batching
    them as it does CUDA tensors (here: CPU tensors over Gloo); then a blocking pair exchange
    after an async send that was never waited (the next call issues it). What arrived, the
    sizes of the batches issued, and whether a handle was complete before any wait."""
    import torch.distributed as dist

    batches = []
    issue = dist.batch_isend_irecv

    def spy(ops):
        batches.append(len(ops))
        return issue(ops)

    saved_predicate = getattr(torch_dist, "batches", None)
    torch_dist.batches = lambda t: True
    dist.batch_isend_irecv = spy
    try:
        size, rank = comm.size, comm.rank
        x, y = torch.full((n,), float(rank + 1)), torch.zeros(n)
        sent = comm.send(x, (rank + 1) % size, async_op=True)
        got = comm.recv(y, (rank - 1) % size, async_op=True)
        early = got.is_completed()
        for work in (got, sent) if recv_first else (sent, got):
            work.wait()
        ring = float(y.min()), float(y.max())
        z = torch.zeros(n)
        comm.send(x, (rank + 1) % size, async_op=True)  # dropped: issued by the next call
        comm.recv(z, (rank - 1) % size)
        comm.barrier()
        return ring, (float(z.min()), float(z.max())), batches, early
    finally:
        dist.batch_isend_irecv = issue
        if saved_predicate is None:
            del torch_dist.batches
        else:
            torch_dist.batches = saved_predicate


@pytest.mark.timeout(240)
@pytest.mark.parametrize("recv_first", [False, True], ids=["send-waited-first", "recv-waited-first"])
@pytest.mark.parametrize("world", [("torch", 3)], indirect=True, ids=["torch-3"])
def test_torch_backend_batches_async_sends_and_recvs_of_cuda_tensors(world, recv_first):
    replies = world.run(batched_ring_job, args=(recv_first, 1 << 16), timeout=120)
    for rank, (ring, pair, batches, early) in enumerate(replies):
        sender = float((rank - 1) % world.size + 1)
        assert ring == (sender, sender) and pair == (sender, sender), rank
        assert batches == [2, 1], f"rank {rank}: batches of {batches} operations"  # ring; the dropped send
        assert not early, "a batched recv cannot be complete before its batch is issued"


# -- which worlds a machine skips ----------------------------------------------------------------------

def machine(nccl, gpus=1, **overrides):
    import test_gpu

    fields = {"gpus": gpus, "has_cupy": True, "nccl": {"torch": nccl, "cupy": nccl}, "mpi_problem": None,
              "cuda_aware_problem": "MPICH Version: 5.0.2 is not CUDA-aware (MPIX_Query_cuda_support() is 0)"}
    return test_gpu.Machine(**{**fields, **overrides})


def test_one_gpu_with_nccl_before_2_30_skips_every_nccl_world_of_two_ranks_and_says_so():
    import test_gpu

    reasons = test_gpu.world_skip_reasons(machine((2, 28, 9)))
    two_rank_nccl = {world_id for world_id, backend, size, _, _ in test_gpu.every_world()
                     if backend in ("torch", "cupy") and size > 1}
    assert two_rank_nccl >= {"torch-nccl-2", "cupy-2-mpi-id", "cupy-2-store-id", "c10d-cupy-2", "cupy-timeout-2",
                             "cupy-2-hosts-mpiexec", "cupy-2-hosts-torchrun"}
    for world_id in two_rank_nccl:
        assert reasons[world_id] and "NCCL 2.28.9" in reasons[world_id] and "NCCL >= 2.30" in reasons[world_id], \
            (world_id, reasons[world_id])
        assert "not exercised" in reasons[world_id]
    runs = {world_id for world_id, reason in reasons.items() if reason is None}
    assert runs >= {"torch-nccl-1", "cupy-1", "mpi-2-staged", "mpi-4-staged", "c10d-cupy-1", "c10d-mpi-2-staged",
                    "smoke-torch-nccl-1", "smoke-cupy-1", "smoke-mpi-1-staged"}
    assert "CUDA-aware" in reasons["mpi-2-cuda-aware"] and "CUDA-aware" in reasons["smoke-mpi-1-cuda-aware"]


@pytest.mark.parametrize("nccl, gpus", [((2, 30, 3), 1), ((2, 28, 9), 2), ((2, 32, 0), 1)])
def test_nccl_2_30_or_a_gpu_per_rank_runs_the_two_rank_worlds(nccl, gpus):
    import test_gpu

    reasons = test_gpu.world_skip_reasons(machine(nccl, gpus))
    assert reasons["torch-nccl-2"] is None and reasons["cupy-2-mpi-id"] is None and reasons["c10d-cupy-2"] is None


def test_the_probe_gates_on_the_loaded_nccl_not_the_one_torch_was_built_with(monkeypatch):
    """A libnccl 2.30 put in place of the wheel's 2.28 (scripts/gpu_check.sh GPU_CHECK_NCCL) unlocks
    the 2-rank worlds on one GPU: the probe reads the runtime version (collectives.info.nccl_versions)."""
    import test_gpu

    from collectives import info

    readers = {"runtime": lambda: (2, 30, 7), "build": lambda: (2, 28, 9)}
    monkeypatch.setattr(info, "_nccl_readers", lambda library: readers)
    probed = test_gpu.Machine.probe.__func__.__wrapped__(test_gpu.Machine)
    assert probed.nccl["torch"] == (2, 30, 7)
    reasons = test_gpu.world_skip_reasons(dataclasses.replace(probed, gpus=1, has_cupy=True,
                                                              nccl={"torch": (2, 30, 7), "cupy": (2, 30, 7)}))
    assert reasons["torch-nccl-2"] is None and reasons["elastic-torch-nccl-2"] is None
    # several ranks on one GPU also need NCCL_MULTI_RANK_GPU_ENABLE=1 in the world's environment
    alone = test_gpu.skip_reason("torch", 2, "torchrun", {}, machine((2, 30, 7)))
    assert alone and "only with NCCL_MULTI_RANK_GPU_ENABLE=1" in alone


def test_a_failed_smoke_skips_that_backends_worlds_with_its_reason():
    import test_gpu

    failed = test_gpu.smoke_failures("cupy: test_smoke_one_rank[cupy-1] failed; mpi: pool did not start")
    reasons = test_gpu.world_skip_reasons(machine((2, 30, 3), smoke_failed=failed))
    assert "smoke of backend cupy failed (test_smoke_one_rank[cupy-1] failed)" in reasons["cupy-1"]
    assert "pool did not start" in reasons["mpi-2-staged"]
    assert reasons["torch-nccl-1"] is None


@pytest.mark.parametrize("shape", [(6, 3), (4, 3, 5, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_syncbn_gives_the_batch_norm_backward_defined_saved_statistics(monkeypatch, shape, dtype):
    """Far-from-zero data (the shifted route: two one-pass sums) forward and backward, through an
    op that asserts CUDA's precondition (Normalization.cu: ``save_mean should always be defined``);
    the gradients still match torch's BatchNorm in float64."""
    real = torch.ops.aten.native_batch_norm_backward
    calls = []

    def like_cuda(grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask):
        calls.append(train)
        assert save_mean is not None and save_invstd is not None, "save_mean should always be defined"
        return real(grad, x, weight, running_mean, running_var, save_mean, save_invstd, train, eps, mask)

    class LikeCuda:  # the rest (overloads: torch's own BatchNorm) as the real op has it
        __call__ = staticmethod(like_cuda)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(torch.ops.aten, "native_batch_norm_backward", LikeCuda())
    x64 = (torch.randn(shape, dtype=torch.float64) + 20.0).requires_grad_()  # far: |mean| > 3 std
    x = x64.detach().to(dtype).requires_grad_()
    dy = torch.randn(shape, dtype=torch.float64)
    ours = syncbn.SyncBatchNorm(shape[1], comm=LocalCommunicator()).to(dtype)
    plain = (torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d)(shape[1]).double()
    ours(x).backward(dy.to(dtype))
    plain(x64).backward(dy)  # the reference: float64
    assert False in calls  # the inference-mode calls ran through the stand-in
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(x.grad.double(), x64.grad, **tol)
    torch.testing.assert_close(ours.weight.grad.double(), plain.weight.grad, **tol)
