"""Rank-side jobs of test_c10d_strict.py: the "collectives" group refuses what Gloo refuses.

Each job makes the bad call on a group of its own beside the default one, reports what
every rank raised (type and message) and whether the group still gives the right answer
afterwards; the test process compares.
"""

from __future__ import annotations

import datetime
import gc
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from c10d_jobs import all_gather_single, reduce_scatter_single  # torch 2.14 deprecates the old names

import collectives.c10d
from collectives.c10d.worker import COMPLETER_IDLE
from collectives.communicator import MAX_PENDING


def ensure_group(comm: Any) -> int:
    if not dist.is_initialized():
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        collectives.c10d.init_process_group()
    return dist.get_world_size()


def outcome(call: Callable[[], Any]) -> str:
    """``ok`` or ``Type: message`` of what ``call`` raised."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the message is what the test reads
        return f"{type(error).__name__}: {error}"
    return "ok"


def after(group: Any) -> list[float]:
    """An all_reduce of ones on ``group`` (the test checks it sums to the group's size)."""
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    return t.tolist()


def bad_rooted_call_job(comm: Any, case: str) -> dict[str, Any]:
    """A gather or scatter whose root (rank 0) passes a wrong list: ``case`` names which."""
    n = ensure_group(comm)
    group = dist.new_group(backend="collectives")
    rank = dist.get_rank()
    x = torch.full((2,), float(rank))

    def call() -> None:
        if case in ("gather N-1", "gather N+1", "gather shape (3, 2)"):
            count = {"gather N-1": n - 1, "gather N+1": n + 1}.get(case, n)
            shape = (3, 2) if case == "gather shape (3, 2)" else (2,)
            gathered = [torch.zeros(shape) for _ in range(count)] if rank == 0 else None
            dist.gather(x, gathered, dst=0, group=group)
        elif case == "scatter rows (4,) into (2, 2)":
            rows = [torch.full((4,), float(r)) for r in range(n)] if rank == 0 else None
            dist.scatter(torch.zeros(2, 2), rows, src=0, group=group)
        elif case == "group.scatter list on a non-source":  # the group checks both sides itself
            rows = [[torch.full((2,), float(r)) for r in range(n)]]
            group.scatter([torch.zeros(2)], rows, _scatter_options(0)).wait()
        elif case == "group.scatter no list on the source":
            group.scatter([torch.zeros(2)], [], _scatter_options(0)).wait()
        elif case == "group.gather list on a non-destination":
            lists = [[torch.zeros(2) for _ in range(n)]]
            group.gather(lists, [x], _gather_options(0)).wait()
        elif case == "group.gather no list on the destination":
            group.gather([], [x], _gather_options(0)).wait()
        else:
            raise AssertionError(case)
    raised = outcome(call)
    return {"raised": raised, "after": after(group)}


def _scatter_options(root: int) -> Any:
    opts = dist.ScatterOptions()
    opts.rootRank = root
    return opts


def _gather_options(root: int) -> Any:
    opts = dist.GatherOptions()
    opts.rootRank = root
    return opts


def scatter_list_on_the_wrong_ranks_job(comm: Any, case: str) -> dict[str, Any]:
    """torch refuses scatter_list on the rank where it is wrong, before the group sees the
    call; the others' scatter meets that rank's next call (the call path's checks)."""
    n = ensure_group(comm)
    group = dist.new_group(backend="collectives")
    rows = [torch.full((2,), float(r)) for r in range(n)]
    if case == "scatter_list everywhere":
        first = outcome(lambda: dist.scatter(torch.zeros(2), rows, src=0, group=group))
    else:  # missing on the source
        first = outcome(lambda: dist.scatter(torch.zeros(2), None, src=0, group=group))
    wrong = first.startswith("ValueError")  # torch's own refusal: this rank never called the group
    second = outcome(lambda: after(group)) if wrong else "-"
    return {"first": first, "second": second, "after": after(group)}


def reduce_scatter_job(comm: Any) -> dict[str, Any]:
    n = ensure_group(comm)
    group = dist.new_group(backend="collectives")
    raised = outcome(lambda: dist.reduce_scatter(torch.zeros(2), [torch.ones(3) for _ in range(n)], group=group))
    tensor = outcome(lambda: reduce_scatter_single(torch.zeros(2), torch.ones(2 * n + 1), group=group))
    return {"raised": raised, "tensor": tensor, "after": after(group)}


def non_member_job(comm: Any) -> dict[str, Any]:
    """communicator(group) on a rank outside ``group``."""
    n = ensure_group(comm)
    group = dist.new_group(list(range(n - 1)), backend="collectives")
    raised = outcome(lambda: collectives.c10d.communicator(group))
    return {"raised": raised, "member": dist.get_rank() < n - 1}


def wait_timeout_job(comm: Any, seconds: float) -> dict[str, Any]:
    """The last rank joins an all_reduce only once the others' wait(timeout) has expired:
    they raise at the timeout, and the operation completes when it joins."""
    n = ensure_group(comm)
    group = dist.new_group(backend="collectives")
    world = dist.group.WORLD
    t = torch.ones(3)
    if dist.get_rank() == n - 1:
        dist.barrier(group=world)  # the others have timed out
        dist.all_reduce(t, group=group)
        return {"raised": "joined late", "after": t.tolist()}
    work = dist.all_reduce(t, group=group, async_op=True)
    raised = outcome(lambda: work.wait(timeout=datetime.timedelta(seconds=seconds)))
    dist.barrier(group=world)
    work.wait()
    return {"raised": raised, "after": t.tolist()}


def same_error_both_ways_job(comm: Any) -> dict[str, Any]:
    """A bad call with async_op=True: what wait() raises, what get_future().wait() raises."""
    n = ensure_group(comm)
    group = dist.new_group(backend="collectives")
    rank = dist.get_rank()
    at_call = outcome(lambda: all_gather_single(torch.empty(3), torch.ones(2), group=group,
                                                          async_op=True))
    gathered = [torch.zeros(1) for _ in range(n)] if rank == 0 else None  # a refusal on rank 0
    through: dict[str, str] = {}
    for way in ("wait", "future"):
        try:
            work = dist.gather(torch.ones(2), gathered, dst=0, group=group, async_op=True)
        except Exception as error:  # noqa: BLE001 - rank 0 refuses at the call
            through[way] = f"at the call: {type(error).__name__}: {error}"
            continue
        call = work.wait if way == "wait" else work.get_future().wait
        try:
            call()
            through[way] = "ok"
        except Exception as error:  # noqa: BLE001
            through[way] = f"{type(error).__name__} (RuntimeError: {isinstance(error, RuntimeError)}): {error}"
    return {"at_call": at_call, "through": through, "after": after(group)}


def _shape_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.tolist())
    if isinstance(value, list):
        return [_shape_of(v) for v in value]
    return repr(value)


def future_values_job(comm: Any) -> dict[str, Any]:
    """The futures' values of the operations whose values have a shape of their own, on the
    group and on Gloo, from the same calls."""
    n = ensure_group(comm)
    rank = dist.get_rank()
    values: dict[str, Any] = {}
    for backend in ("collectives", "gloo"):
        values[backend] = _future_values(dist.new_group(backend=backend), rank, n)
    return values


def _future_values(group: Any, rank: int, n: int) -> dict[str, Any]:
    mine = torch.full((2,), float(rank))
    calls = {
        "all_gather": lambda: dist.all_gather([torch.zeros(2) for _ in range(n)], mine, group=group,
                                              async_op=True),
        "gather": lambda: dist.gather(mine, [torch.zeros(2) for _ in range(n)] if rank == 0 else None,
                                      dst=0, group=group, async_op=True),
        "all_gather_into_tensor": lambda: all_gather_single(torch.zeros(2 * n), mine, group=group,
                                                                      async_op=True),
        "all_reduce": lambda: dist.all_reduce(mine.clone(), group=group, async_op=True),
        "scatter": lambda: dist.scatter(torch.zeros(2), [torch.full((2,), float(r)) for r in range(n)]
                                        if rank == 0 else None, src=0, group=group, async_op=True),
        "barrier": lambda: dist.barrier(group=group, async_op=True),
    }
    values = {name: _shape_of(call().get_future().wait()) for name, call in calls.items()}
    dist.destroy_process_group(group)
    return values


def bounded_queue_job(comm: Any) -> dict[str, Any]:
    """Rank 0 posts MAX_PENDING + 50 all_reduces and drops their handles while rank 1 has not
    started: its caller waits at MAX_PENDING pending operations instead of queueing on."""
    ensure_group(comm)
    group = dist.new_group(backend="collectives")
    worker = group._worker
    calls = MAX_PENDING + 50
    tensors = [torch.ones(1) for _ in range(calls)]
    if dist.get_rank() == 0:
        posted = [0]

        def post() -> None:
            for t in tensors:
                dist.all_reduce(t, group=group, async_op=True)
                posted[0] += 1
        poster = threading.Thread(target=post)
        poster.start()
        deadline = time.monotonic() + 60
        while posted[0] < MAX_PENDING and time.monotonic() < deadline:
            poster.join(0.01)
        # The poster is now inside call MAX_PENDING + 1; it stays there until rank 1 takes part.
        poster.join(0.2)
        waiting = poster.is_alive() and posted[0] == MAX_PENDING
        dist.barrier()
        poster.join(60)
    else:
        dist.barrier()
        waiting = None
        for t in tensors:
            dist.all_reduce(t, group=group, async_op=True)
    dist.barrier(group=group)
    deadline = time.monotonic() + 30  # the barrier's own completion, on a completer thread
    while worker.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"waiting": waiting, "most pending": worker.most_pending, "pending after": worker.pending,
            "sums": sorted({t.item() for t in tensors}), "limit": MAX_PENDING}


def completers_shrink_job(comm: Any) -> dict[str, Any]:
    """Callbacks that block hold completer threads (more start); once released and idle,
    the threads end, down to one."""
    ensure_group(comm)
    group = dist.new_group(backend="collectives")
    worker = group._worker
    prefix = f"{worker._thread.name}-completer-"

    def completers() -> int:
        return sum(thread.name.startswith(prefix) for thread in threading.enumerate())

    release, gate = threading.Event(), threading.Event()
    # The worker waits at a gate of this rank's own until every callback is attached: a then()
    # on a future that has completed would run its callback here, in this thread.
    worker.submit(lambda comm: gate.wait(30))
    works = [dist.all_reduce(torch.ones(1), group=group, async_op=True) for _ in range(4)]
    chained = [work.get_future().then(lambda fut: release.wait(30)) for work in works]
    gate.set()
    deadline = time.monotonic() + 30
    while completers() < 4 and time.monotonic() < deadline:
        time.sleep(0.01)  # a local thread count, not another rank
    grown = completers()
    release.set()
    for fut in chained:
        fut.wait()
    deadline = time.monotonic() + 10 * COMPLETER_IDLE + 10
    while completers() > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    shrunk = completers()
    dist.all_reduce(torch.ones(1), group=group)  # still works with one thread
    gc.collect()
    return {"grown": grown, "shrunk": shrunk}


# -- torch's code that reads the group's devices ---------------------------------------------

def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _trained(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 4, generator=g)).square().sum().backward()
        optimizer.step()


def _numpy(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().numpy().copy()
    if isinstance(state, dict):
        return {k: _numpy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_numpy(v) for v in state]
    return state


def checkpoint_job(comm: Any, path: str) -> dict[str, Any]:
    """torch.distributed.checkpoint on the default "collectives" group: the group's device
    types, rank 0's full state broadcast into every rank (model and optimizer), and an
    async_save read back with dcp.load."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    ensure_group(comm)
    rank = dist.get_rank()
    reference = _model()
    reference_opt = torch.optim.Adam(reference.parameters(), lr=0.1)
    _trained(reference, reference_opt, seed=1)  # what rank 0 holds (every rank computes it)

    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    _trained(model, optimizer, seed=100 + rank)  # something else on every rank
    full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, reference.state_dict() if rank == 0 else {}, options=full)
    set_optimizer_state_dict(model, optimizer, get_optimizer_state_dict(reference, reference_opt)
                             if rank == 0 else {}, options=full)

    saved = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, optimizer)}
    future = dcp.async_save(saved, checkpoint_id=path)
    future.result()
    fresh = _model()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    _trained(fresh, fresh_opt, seed=200 + rank)
    loaded = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(loaded, checkpoint_id=path)
    return {"device_types": [d.type for d in dist.group.WORLD._device_types],
            "model": _numpy(model.state_dict()), "loaded model": _numpy(loaded["model"]),
            "reference model": _numpy(reference.state_dict()),
            "optim": _numpy(get_optimizer_state_dict(model, optimizer)["state"]),
            "loaded optim": _numpy(loaded["optim"]["state"]),
            "reference optim": _numpy(get_optimizer_state_dict(reference, reference_opt)["state"])}
