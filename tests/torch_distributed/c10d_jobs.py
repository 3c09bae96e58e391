"""Rank-side jobs of tests/torch_distributed/test_c10d.py: torch.distributed over the "collectives" backend.

Every rank builds every rank's inputs from the same seeds, so each computes the numpy
reference of every operation on its own; results travel back as numpy arrays.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import collectives.c10d

_GLOO: dict[str, Any] = {}


def ensure_group(comm: Any) -> int:
    """The default group over "collectives" (once per rank), and a Gloo group beside it."""
    if not dist.is_initialized():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        collectives.c10d.init_process_group()
        _GLOO["world"] = dist.new_group(backend="gloo")
    return dist.get_world_size()


def inputs(rank: int, shape: tuple[int, ...], dtype: Any = np.float64, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng([seed, rank])
    if np.dtype(dtype).kind == "f":
        return g.integers(-8, 9, size=shape).astype(dtype) / 4  # exact in every order of sums
    return g.integers(1, 64, size=shape).astype(dtype)


_NUMPY_OPS = {"SUM": np.sum, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max,
              "BAND": np.bitwise_and.reduce, "BOR": np.bitwise_or.reduce,
              "BXOR": np.bitwise_xor.reduce}


def op_set_job(comm: Any, subgroup: bool) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every operation on the default group (or on this rank's subgroup of a split in two):
    name -> (got, numpy reference)."""
    ensure_group(comm)
    world = dist.get_world_size()
    group = None
    members = list(range(world))
    if subgroup:  # every rank calls new_group for every group; each uses its own
        halves = [h for h in (list(range(0, world, 2)), list(range(1, world, 2))) if h]
        made = [dist.new_group(h, backend="collectives") for h in halves]
        mine = dist.get_rank() % 2
        group, members = made[mine], halves[mine]
    n, me = len(members), members.index(dist.get_rank())
    g = dist.get_global_rank
    results: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def check(name: str, got: Any, want: Any) -> None:
        results[name] = (np.asarray(got.numpy() if isinstance(got, torch.Tensor) else got), np.asarray(want))

    everyone = [inputs(r, (3, 2)) for r in members]
    ints = [inputs(r, (5,), np.int64) for r in members]
    for op, fn in _NUMPY_OPS.items():
        data = ints if op in ("BAND", "BOR", "BXOR") else everyone
        t = torch.from_numpy(data[me].copy())
        work = dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=group, async_op=True)
        work.wait()
        check(f"all_reduce {op}", t, fn(np.stack(data), axis=0))
    t = torch.from_numpy(everyone[me].copy())
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    check("all_reduce AVG", t, np.stack(everyone).sum(0) / n)

    root = n - 1
    t = torch.from_numpy(everyone[me].copy())
    dist.broadcast(t, src=g(group, root) if group else root, group=group)
    check("broadcast", t, everyone[root])

    t = torch.from_numpy(everyone[me].copy())
    dist.reduce(t, dst=g(group, root) if group else root, op=dist.ReduceOp.MAX, group=group)
    check("reduce", t, np.stack(everyone).max(0) if me == root else everyone[me])

    outs = [torch.empty(3, 2, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(outs, torch.from_numpy(everyone[me]), group=group)
    check("all_gather", torch.stack(outs), np.stack(everyone))

    sizes = [inputs(r, (i + 1,), seed=3) for i, r in enumerate(members)]  # rank i sends i + 1
    outs = [torch.empty(i + 1, dtype=torch.float64) for i in range(n)]
    dist.all_gather(outs, torch.from_numpy(sizes[me]), group=group)
    check("all_gather uneven", torch.cat(outs), np.concatenate(sizes))

    out = torch.empty(3 * n, 2, dtype=torch.float64)
    all_gather_single(out, torch.from_numpy(everyone[me]), group=group)
    check("all_gather_into_tensor", out, np.concatenate(everyone))

    rows = [inputs(r, (n, 4), seed=1) for r in members]
    out = torch.empty(4, dtype=torch.float64)
    dist.reduce_scatter(out, [torch.from_numpy(row) for row in rows[me]], group=group)
    check("reduce_scatter", out, np.stack(rows).sum(0)[me])

    out = torch.empty(4, dtype=torch.float64)
    reduce_scatter_single(out, torch.from_numpy(rows[me].reshape(-1)), group=group)
    check("reduce_scatter_tensor", out, np.stack(rows).sum(0)[me])

    # all_to_all_single, uneven: rank i sends i + j + 1 rows to rank j.
    sent = [inputs(r, (sum(i + j + 1 for j in range(n)), 2), seed=2) for i, r in enumerate(members)]
    splits_in = [me + j + 1 for j in range(n)]
    splits_out = [i + me + 1 for i in range(n)]
    out = torch.empty(sum(splits_out), 2, dtype=torch.float64)
    dist.all_to_all_single(out, torch.from_numpy(sent[me]), splits_out, splits_in, group=group)
    expected = [sent[i][sum(i + k + 1 for k in range(me)):][:i + me + 1] for i in range(n)]
    check("all_to_all_single uneven", out, np.concatenate(expected))

    out = torch.empty(n, 2, dtype=torch.float64)
    dist.all_to_all_single(out, torch.from_numpy(rows[me][:, :2].copy()), group=group)
    check("all_to_all_single", out, np.stack([rows[i][me, :2] for i in range(n)]))

    outs = [torch.empty(4, dtype=torch.float64) for _ in range(n)]
    dist.all_to_all(outs, [torch.from_numpy(r) for r in rows[me]], group=group)
    check("all_to_all", torch.stack(outs), np.stack([rows[i][me] for i in range(n)]))

    gathered = [torch.empty(3, 2, dtype=torch.float64) for _ in range(n)] if me == 0 else None
    dist.gather(torch.from_numpy(everyone[me]), gathered, dst=g(group, 0) if group else 0, group=group)
    if me == 0:
        check("gather", torch.stack(gathered), np.stack(everyone))

    out = torch.empty(4, dtype=torch.float64)
    pieces = [torch.from_numpy(r) for r in rows[0]] if me == 0 else None
    dist.scatter(out, pieces, src=g(group, 0) if group else 0, group=group)
    check("scatter", out, rows[0][me])

    if n > 1:  # a ring: send to the next, receive from the previous
        nxt, prev = (me + 1) % n, (me - 1) % n
        gl = (lambda r: g(group, r)) if group else (lambda r: r)
        got = torch.empty(3, 2, dtype=torch.float64)
        if me % 2 == 0:
            dist.send(torch.from_numpy(everyone[me]), gl(nxt), group=group)
            dist.recv(got, gl(prev), group=group)
        else:
            dist.recv(got, gl(prev), group=group)
            dist.send(torch.from_numpy(everyone[me]), gl(nxt), group=group)
        check("send/recv", got, everyone[prev])
        got = torch.empty(3, 2, dtype=torch.float64)
        ops = [dist.P2POp(dist.isend, torch.from_numpy(everyone[me]), gl(nxt), group=group),
               dist.P2POp(dist.irecv, got, gl(prev), group=group)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        check("batch_isend_irecv", got, everyone[prev])
        got = torch.empty(3, 2, dtype=torch.float64)
        works = [dist.irecv(got, gl(prev), group=group),
                 dist.isend(torch.from_numpy(everyone[me]), gl(nxt), group=group)]
        works[0].get_future().wait()
        works[1].wait()
        check("isend/irecv", got, everyone[prev])

    work = dist.barrier(group=group, async_op=True)
    work.wait()
    check("barrier completed", np.array(work.is_completed()), np.array(True))

    objects = [{"rank": r, "data": list(range(r))} for r in members]
    got_objs: list[Any] = [None] * n
    dist.all_gather_object(got_objs, objects[me], group=group)
    check("all_gather_object", np.array(repr(got_objs)), np.array(repr(objects)))
    box = [objects[me]]
    dist.broadcast_object_list(box, src=g(group, root) if group else root, group=group)
    check("broadcast_object_list", np.array(repr(box[0])), np.array(repr(objects[root])))
    gathered_objs: list[Any] | None = [None] * n if me == 0 else None
    dist.gather_object(objects[me], gathered_objs, dst=g(group, 0) if group else 0, group=group)
    if me == 0:
        check("gather_object", np.array(repr(gathered_objs)), np.array(repr(objects)))
    box = [None]
    dist.scatter_object_list(box, objects if me == 0 else None, src=g(group, 0) if group else 0, group=group)
    check("scatter_object_list", np.array(repr(box[0])), np.array(repr(objects[me])))
    return results


# -- training: DDP and FSDP2 against one process on the global batch -----------------------

class Net(nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 16)
        self.head = nn.Linear(16, 3)
        self.unused = nn.Linear(16, 3) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.trunk(x)))


def make_net(unused: bool = False) -> Net:
    torch.manual_seed(0)
    return Net(unused).double()


def global_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randn(4 * n, 6, generator=g, dtype=torch.float64),
            torch.randn(4 * n, 3, generator=g, dtype=torch.float64))


def one_process(steps: int, n: int, micro: int = 1) -> dict[str, np.ndarray]:
    """The reference: plain torch, one process, the global batch, SGD."""
    model = make_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = global_batch(step * micro + m, n)
            (nn.functional.mse_loss(model(x), y) / micro).backward()
        opt.step()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def ddp_job(comm: Any, steps: int, variant: str) -> dict[str, Any]:
    """DDP over "collectives" and over Gloo, same data; and the one-process reference."""
    n = ensure_group(comm)
    out: dict[str, Any] = {}
    for name, group in (("collectives", None), ("gloo", _GLOO["world"])):
        model = make_net(unused=variant == "find_unused_parameters")
        kwargs: dict[str, Any] = {"process_group": group}
        if variant == "find_unused_parameters":
            kwargs["find_unused_parameters"] = True
        if variant == "static_graph":
            kwargs["static_graph"] = True
        ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
        if variant == "fp16_compress_hook":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415

            ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
        if variant == "powerSGD_hook":  # its callbacks wait for the group's next all_reduce
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd  # noqa: PLC0415

            state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                           start_powerSGD_iter=2, min_compression_rate=1, random_seed=0)
            ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        micro = 2 if variant == "no_sync" else 1
        rank = dist.get_rank()
        for step in range(steps):
            opt.zero_grad()
            for m in range(micro):
                x, y = global_batch(step * micro + m, n)
                shard = slice(4 * rank, 4 * rank + 4)
                loss = nn.functional.mse_loss(ddp(x[shard]), y[shard]) / micro
                if m < micro - 1:
                    with ddp.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
        out[name] = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()
                     if not k.startswith("unused")}
    out["reference"] = one_process(steps, n, 2 if variant == "no_sync" else 1)
    return out


def fsdp_job(comm: Any, steps: int) -> dict[str, Any]:
    """FSDP2 (fully_shard over a 1-D DeviceMesh on CPU) against the one-process reference."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    n = ensure_group(comm)
    mesh = init_device_mesh("cpu", (n,))
    model = make_net()
    fully_shard(model.trunk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(steps):
        opt.zero_grad()
        x, y = global_batch(step, n)
        shard = slice(4 * rank, 4 * rank + 4)
        nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
        opt.step()
    full = {k: v.full_tensor().detach().numpy().copy() for k, v in model.state_dict().items()}
    return {"fsdp": full, "reference": one_process(steps, n), "mesh": mesh.get_group().group_name}


def communicator_job(comm: Any) -> dict[str, Any]:
    """communicator(group) is our Communicator, usable beside torch's calls on the group."""
    ensure_group(comm)
    ours = collectives.c10d.communicator()
    x = np.full(2, float(ours.rank + 1))
    ours.all_reduce(x)
    t = torch.ones(1)
    dist.all_reduce(t)
    try:
        collectives.c10d.communicator(_GLOO["world"])
    except TypeError as error:
        refused = str(error)
    return {"same": ours is comm, "x": x, "t": t.numpy(), "refused": refused,
            "backend": dist.get_backend(), "name": dist.group.WORLD.name()}


def all_gather_single(*args: Any, **kwargs: Any) -> Any:
    """dist.all_gather_single where torch has it (2.12 on: 2.14 deprecates all_gather_into_tensor)."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_single(*args: Any, **kwargs: Any) -> Any:
    """dist.reduce_scatter_single where torch has it (2.14 deprecates reduce_scatter_tensor)."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


def bad_input_job(comm: Any) -> dict[str, str]:
    """Refused on the caller's thread, before anything is sent: every rank raises the same."""
    ensure_group(comm)
    errors = {}
    for name, call in {
        "premul_sum": lambda: dist.all_reduce(torch.ones(2), op=dist._make_nccl_premul_sum(2.0)),
        "sum of bool": lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool)),
        "band of float": lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
        "all_gather_into_tensor size": lambda: all_gather_single(torch.empty(3), torch.ones(2)),
    }.items():
        try:
            call()
        except Exception as error:  # noqa: BLE001 - its message is what the test reads
            errors[name] = f"{type(error).__name__}: {error}"
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still works
    errors["after"] = str(t.item())
    return errors


def refused_reduction_job(comm: Any) -> list[tuple[str, float]]:
    """Rank 0 refuses an all_reduce (AVG of int32), a reduce and a reduce_scatter_tensor (BAND of
    float32) that the others make: what each raised, and the sum of ones that follows each (the group still in step)."""
    ensure_group(comm)
    rank = dist.get_rank()
    ints, floats = torch.arange(3, dtype=torch.int32), torch.ones(3)
    size = dist.get_world_size()
    rows, row = (torch.ones(size), torch.empty(1)) if rank == 0 else (torch.ones(size, dtype=torch.int32),
                                                                        torch.empty(1, dtype=torch.int32))
    calls = [lambda: dist.all_reduce(ints if rank == 0 else floats, op=dist.ReduceOp.AVG),
             lambda: dist.reduce(floats if rank == 0 else ints, dst=0, op=dist.ReduceOp.BAND),
             lambda: dist.reduce_scatter_tensor(row, rows, op=dist.ReduceOp.BAND)]
    found = []
    for call in calls:
        try:
            call()
            outcome = "no error"
        except Exception as error:  # noqa: BLE001 - its type and text are what the test reads
            outcome = f"{type(error).__name__}: {error}"
        after = torch.ones(1)
        dist.all_reduce(after)
        found.append((outcome, float(after[0])))
    return found


def mismatch_job(comm: Any) -> str:
    """Rank 0 all_reduces while the others broadcast (COLLECTIVES_DEBUG=1): every rank raises."""
    ensure_group(comm)
    t = torch.ones(4)
    try:
        if dist.get_rank() == 0:
            dist.all_reduce(t)
        else:
            dist.broadcast(t, src=0)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "no error"


def _mismatched_calls(case: str, rank: int) -> Any:
    """torch.distributed calls that differ between ranks, by ``case``."""
    t = torch.ones(3)
    if case == "shape":
        return lambda: dist.all_reduce(torch.ones(3 + rank))
    if case == "dtype":
        return lambda: dist.all_reduce(torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64))
    if case == "op":
        return lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX)
    if case == "root":
        return lambda: dist.broadcast(t, src=rank)
    if case == "all_gather shape":
        x = torch.ones(2 + rank)
        return lambda: dist.all_gather([torch.empty(2 + rank) for _ in range(dist.get_world_size())], x)
    if case == "skipped call":  # rank 1 skips the all_reduce that rank 0 makes before the broadcast
        return (lambda: (dist.all_reduce(t), dist.broadcast(t, 0))) if rank == 0 else \
            (lambda: dist.broadcast(t, 0))
    if case == "barrier":  # rank 0's barrier against rank 1's all_reduce
        return dist.barrier if rank == 0 else (lambda: dist.all_reduce(t))
    assert case == "extra call"  # rank 1 makes one all_reduce more
    return (lambda: (dist.all_reduce(t), dist.broadcast(t, 0))) if rank == 0 else \
        (lambda: (dist.all_reduce(t), dist.all_reduce(t), dist.broadcast(t, 0)))


MISMATCH_CASES = ["shape", "dtype", "op", "root", "all_gather shape", "skipped call", "extra call", "barrier"]


def default_mismatch_job(comm: Any) -> dict[str, tuple[str, float]]:
    """Every case of MISMATCH_CASES with default settings: each is an error on every rank, and
    the group works after it (the sum of ones that follows)."""
    ensure_group(comm)
    found = {}
    for case in MISMATCH_CASES:
        try:
            _mismatched_calls(case, dist.get_rank())()
            outcome = "no error"
        except Exception as error:  # noqa: BLE001 - its type and text are what the test reads
            outcome = f"{type(error).__name__}: {error}"
        after = torch.ones(1)
        dist.all_reduce(after)
        found[case] = (outcome, float(after[0]))
    return found


def timeout_job(comm: Any) -> str:
    """The last rank skips an all_reduce (COLLECTIVES_TIMEOUT): the others time out."""
    ensure_group(comm)
    if dist.get_rank() == dist.get_world_size() - 1:
        return "skipped"
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "no error"


def dead_rank_job(comm: Any) -> None:
    """The last rank dies inside a DDP backward; the job must end, not hang."""
    ensure_group(comm)
    model = nn.parallel.DistributedDataParallel(copy.deepcopy(make_net()))
    if dist.get_rank() == dist.get_world_size() - 1:
        os._exit(3)
    model(torch.randn(2, 6, dtype=torch.float64)).sum().backward()


# -- CUDA (tests/gpu/test_gpu.py): DDP with torch's nn.SyncBatchNorm on the GPU ------------------------

class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def image_batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return (torch.randn(2 * n, 3, 8, 8, generator=g, dtype=torch.float64),
            torch.randn(2 * n, 3, generator=g, dtype=torch.float64))


def cuda_ddp_syncbn_job(comm: Any, steps: int) -> dict[str, Any]:
    """DDP + nn.SyncBatchNorm on CUDA over "collectives", against one process with plain
    BatchNorm on the global batch (CPU, float64)."""
    torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())
    n = ensure_group(comm)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    reference = ConvNet().double()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(reference)).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    opts = [torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)]
    rank = dist.get_rank()
    for step in range(steps):
        for opt in opts:
            opt.zero_grad()
        x, y = image_batch(step, n)
        shard = slice(2 * rank, 2 * rank + 2)
        nn.functional.mse_loss(ddp(x[shard].to(device)), y[shard].to(device)).backward()
        nn.functional.mse_loss(reference(x), y).backward()
        for opt in opts:
            opt.step()
    got = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    want = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    return {"got": got, "want": want}


def host_backend_job(comm: Any) -> dict[str, Any]:
    """The CPU twin of the cupy transport's host backend: a group whose CPU-tensor operations
    go to Gloo, and whose communicators are never used for them."""
    import datetime  # noqa: PLC0415

    from collectives.c10d import ProcessGroupCollectives  # noqa: PLC0415

    ensure_group(comm)
    rank, size = dist.get_rank(), dist.get_world_size()
    store = dist.PrefixStore("host-twin/", dist.distributed_c10d._get_default_store())
    host = dist.ProcessGroupGloo(store, rank, size, datetime.timedelta(seconds=60))
    ours, worker = comm.split(0), comm.split(0)
    pg = ProcessGroupCollectives(ours, worker, rank, size, host)
    t = torch.full((3,), float(rank + 1))
    opts = dist.distributed_c10d.AllreduceOptions()
    pg.allreduce([t], opts).wait()
    out = torch.empty(3 * size)
    pg._allgather_base(out, torch.full((3,), float(rank)), dist.distributed_c10d.AllgatherOptions()).wait()
    sequence = worker.sequence_number
    pg.shutdown()
    ours.close()
    return {"t": t.numpy(), "out": out.numpy(), "worker_calls": sequence}


def functional_job(comm: Any) -> dict[str, np.ndarray]:
    """torch's functional collectives (what compiled code and DTensor use) on the group."""
    import torch.distributed._functional_collectives as fc  # noqa: PLC0415

    n = ensure_group(comm)
    group, rank = dist.group.WORLD, dist.get_rank()
    mine = torch.from_numpy(inputs(rank, (n, 2)))
    compiled = torch.compile(lambda x: fc.all_reduce(x * 2, "sum", group) + 1, backend="eager")
    # The *_single names from torch 2.13 on (2.15 deprecates all_gather_tensor, reduce_scatter_tensor).
    all_gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
    reduce_scatter = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor
    return {name: fc.wait_tensor(value).numpy().copy() for name, value in {
        "all_reduce": fc.all_reduce(mine, "sum", group),
        "all_gather_tensor": all_gather(mine, 0, group),
        "reduce_scatter_tensor": reduce_scatter(mine, "sum", 0, group),
        "all_to_all_single": fc.all_to_all_single(mine, None, None, group),
        "compiled all_reduce": compiled(mine),
    }.items()}


def ddp_timeout_job(comm: Any) -> str:
    """The last rank skips a DDP backward (COLLECTIVES_TIMEOUT): the others' backward raises."""
    ensure_group(comm)
    model = nn.parallel.DistributedDataParallel(make_net())
    if dist.get_rank() == dist.get_world_size() - 1:
        return "skipped"
    try:
        model(torch.randn(2, 6, dtype=torch.float64)).sum().backward()
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "no error"


class Square(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))

    def forward(self, scale: float) -> torch.Tensor:
        return self.p.pow(2) * scale


def create_graph_job(comm: Any) -> list[float]:
    """DDP's buckets require grad under backward(create_graph=True) (torch's own test's model):
    the backend writes them as torch's backends do."""
    ensure_group(comm)
    ddp = nn.parallel.DistributedDataParallel(Square())
    grads = []
    for _ in range(2):
        ddp.module.p.grad = None
        ddp(float(dist.get_rank() + 1)).backward(create_graph=True)
        grads.append(float(ddp.module.p.grad.detach()))
    return grads


def beside_gloo_job(comm: Any) -> dict[str, Any]:
    """A "collectives" subgroup beside a Gloo default group (made by collectives.c10d's rendezvous)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    collectives.c10d.init_process_group(backend="gloo")
    try:
        group = dist.new_group(backend="collectives")
        t = torch.full((2,), float(dist.get_rank() + 1))
        dist.all_reduce(t, group=group)
        return {"default": dist.get_backend(), "group": dist.get_backend(group), "t": t.numpy(),
                "same": collectives.c10d.communicator(group) is not None}
    finally:
        dist.destroy_process_group()


def failing_c10d_job(comm: Any) -> None:
    """Rank 1 raises while rank 0 waits in an all_reduce of the default group."""
    ensure_group(comm)
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.all_reduce(torch.ones(2))


def c10d_sum_job(comm: Any) -> list[float]:
    ensure_group(comm)
    t = torch.full((2,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return t.tolist()


def recv_any_source_job(comm: Any) -> list[tuple[int, list[float]]] | None:
    """Ranks 1.. send rank 0 their rank; rank 0's ``dist.recv(t)`` without ``src`` takes each,
    over "collectives" then over Gloo (the reference): what each returned (the sender's rank)
    and what it received, per group."""
    ensure_group(comm)
    rank, size = dist.get_rank(), dist.get_world_size()
    found = []
    for group in (None, _GLOO["world"]):
        if rank:
            dist.send(torch.full((3,), float(rank)), 0, group=group, tag=4)
        else:
            for _ in range(size - 1):
                t = torch.full((3,), -1.0)
                found.append((dist.recv(t, group=group, tag=4), t.tolist()))
        dist.barrier()
    return found if rank == 0 else None


def sparse_all_reduce_job(comm: Any) -> dict[str, Any]:
    """Sparse COO all_reduce (SUM) over "collectives" and over Gloo (the reference), on tensors
    of 1-3 sparse and 0-2 dense dimensions whose entries overlap between ranks (and an empty
    one on rank 0); then the refusals: MAX, and a sparse broadcast."""
    ensure_group(comm)
    rank, size = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    found: dict[str, Any] = {}
    for sparse_dims, dense_dims in ((1, 0), (2, 1), (3, 2)):
        nnz = 0 if rank == 0 and sparse_dims == 1 else 2 + rank
        shape = [size + 1] * sparse_dims + [2] * dense_dims
        indices = torch.randint(0, size + 1, (sparse_dims, nnz), generator=g)
        values = torch.randint(-4, 5, (nnz, *[2] * dense_dims), generator=g).to(torch.float32) / 4
        results = []
        for group in (None, _GLOO["world"]):
            t = torch.sparse_coo_tensor(indices, values, shape)
            dist.all_reduce(t, group=group)
            t = t.coalesce()
            results.append((t.indices().tolist(), t.values().tolist(), list(t.shape)))
        found[f"{sparse_dims}-{dense_dims}"] = results
    t = torch.sparse_coo_tensor(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1), [2])
    for name, call in (("max", lambda: dist.all_reduce(t, dist.ReduceOp.MAX)),
                       ("broadcast", lambda: dist.broadcast(t, 0))):
        try:
            call()
            found[name] = "no error"
        except (TypeError, ValueError) as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found
