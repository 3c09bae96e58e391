"""The call path in its two forms: collectives/callpath.py compiled by Cython (collectives._callpath_c,
where it was built; the test set-up builds it) and as Python, its source (COLLECTIVES_COMPILED=0).

One tour of the call path's routes runs on a split in each form: every collective on carried
(small) and general (large) numpy arrays and torch tensors, out=, async_op=True, a call's own
timeout=, strided x (the general path), the uneven calls, send/recv (blocking and async), the
argument errors (a bad root, a bad out, a shape the call refuses, a bad async_op), a mismatch
between the ranks (carried and not), and a closed communicator. The two tours must see the same
thing: the same results, the same errors with the same messages, the same flight-recorder
records (but their times) and the same hook calls. Results are also held against numpy where the
tour is its own reference, so two forms that agree on nothing cannot pass.
"""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
from collectives.backends.local import LocalCommunicator
from forms import split_in_form

from collectives import front
from collectives.calls import ALL_REDUCE
from collectives.diagnostics.recorder import END, ERROR, START, STATE
from collectives.errors import CollectiveError

WORLDS = pytest.mark.parametrize("world", [("mpi", 2), ("torch", 2), ("mpi", 3)], indirect=True,
                                 ids=lambda w: f"{w[0]}-{w[1]}")


def ran_compiled(comm):
    """Whether ``comm``'s calls run the compiled call path (its ``_run`` and public methods, the
    compiled CallPath's)."""
    module = front.compiled_module()
    return (front.is_compiled(comm) and module is not None and type(comm._path) is module.CallPath
            and comm._run.__self__ is comm._path and comm.all_reduce.__self__ is comm._path)


def plain(value):
    """A result as plain data (arrays as (type, dtype, shape, values))."""
    if isinstance(value, tuple | list):
        return type(value).__name__, [plain(v) for v in value]
    if hasattr(value, "numpy") and hasattr(value, "dtype"):
        return "torch", str(value.dtype), tuple(value.shape), value.numpy().tolist()
    if isinstance(value, np.ndarray):
        return "numpy", str(value.dtype), value.shape, value.tolist()
    return repr(value)


def routes(sub, note, kind, n):
    """The calls of the tour on ``kind`` arrays of ``n`` float32 a row, each through ``note``."""
    import torch  # noqa: PLC0415

    rank, size = sub.rank, sub.size
    base = np.arange(size * n, dtype=np.float32).reshape(size, n) + rank

    def arr(a):
        return torch.from_numpy(np.array(a)) if kind == "torch" else np.array(a)

    tag = f"{kind}-{n}"
    note(f"all_reduce {tag}", lambda: sub.all_reduce(arr(base[0])))
    note(f"all_reduce max {tag}", lambda: sub.all_reduce(arr(base[0]), "max"))
    note(f"reduce {tag}", lambda: sub.reduce(arr(base[0]), dst=size - 1))
    note(f"broadcast {tag}", lambda: sub.broadcast(arr(base[0]), src=size - 1))
    note(f"all_gather {tag}", lambda: sub.all_gather(arr(base[0])))
    note(f"all_gather out {tag}", lambda: sub.all_gather(arr(base[0]), out=arr(np.zeros((size, n), np.float32))))
    note(f"reduce_scatter {tag}", lambda: sub.reduce_scatter(arr(base)))
    note(f"gather {tag}", lambda: sub.gather(arr(base[0]), dst=0))
    note(f"scatter {tag}", lambda: sub.scatter(arr(base), src=0))
    note(f"all_to_all {tag}", lambda: sub.all_to_all(arr(base)))
    note(f"all_gather_v {tag}", lambda: sub.all_gather_v(arr(base[: rank + 1])))
    splits = [(rank + j) % 2 for j in range(size)]
    note(f"all_to_all_v {tag}", lambda: sub.all_to_all(arr(base[: sum(splits)]), splits))
    note(f"async {tag}", lambda: sub.all_reduce(arr(base[0]), async_op=True).wait())
    note(f"async gather {tag}", lambda: sub.all_gather(arr(base[0]), async_op=True).wait())
    note(f"timeout= {tag}", lambda: sub.all_reduce(arr(base[0]), timeout=60))
    if kind == "numpy":  # the general path (no fast path for a strided x), written back into x
        strided = np.array(base)
        note(f"strided {tag}", lambda: (sub.all_reduce(strided[:, ::2]), strided)[1])
    if rank < 2:  # point to point between ranks 0 and 1
        peer = 1 - rank
        sent, box = arr(base[1]), arr(base[0] * 0)
        if rank == 0:
            note(f"send {tag}", lambda: sub.send(sent, peer, tag=3))
            note(f"recv async {tag}", lambda: sub.recv(box, peer, tag=4, async_op=True).wait())
        else:
            note(f"recv {tag}", lambda: sub.recv(box, peer, tag=3))
            note(f"send async {tag}", lambda: sub.send(sent, peer, tag=4, async_op=True).wait())


def tour(comm, form):
    """The routes of the call path on a split in ``form``: what every call returned or raised, the
    flight-recorder records, the hook calls, and whether the call path ran compiled."""
    with split_in_form(comm, form) as sub:
        rank, size = sub.rank, sub.size
        seen, hooked = [], []
        sub.register_hook(lambda r: hooked.append((r.op, r.seq, r.dtype, tuple(r.shape), r.bytes)))

        def note(label, run):
            try:
                seen.append((label, "ok", plain(run())))
            except Exception as error:  # noqa: BLE001  (what it raised is what the tour compares)
                seen.append((label, type(error).__name__, str(error)))

        for kind in ("numpy", "torch"):
            for n in (2, 3000):  # carried in the check's round, and past CARRY_BYTES
                routes(sub, note, kind, n)

        x = np.ones(4, np.float32)
        note("bad root", lambda: sub.broadcast(x, src=size))
        note("bool root", lambda: sub.broadcast(x, src=True))
        note("bad async_op", lambda: sub.all_reduce(x, async_op="yes"))
        note("bad out", lambda: sub.all_gather(x, out=np.zeros((size + 1, 4), np.float32)))
        note("indivisible", lambda: sub.reduce_scatter(np.ones(size + 1, np.float32)))
        note("read-only", lambda: sub.all_reduce(np.broadcast_to(x, (4,))))
        note("op on dtype", lambda: sub.all_reduce(np.ones(2, bool), "avg"))
        other = (rank + 1) % size  # (the bad sends raise before anything is sent)
        for bad in (-1, True, 32765, 32766, 32767, 2**31, 2.0):
            note(f"tag {bad!r}", lambda bad=bad: sub.send(x, other, tag=bad))
        note("send to itself", lambda: sub.send(x, rank))
        note("recv from itself", lambda: sub.recv(x, rank, tag=5))
        note("mismatch carried", lambda: sub.all_reduce(np.ones(2 + rank, np.float32)))
        note("mismatch general", lambda: sub.all_reduce(np.ones(3000 + rank, np.float32)))
        note("after", lambda: sub.all_reduce(np.full(3, rank, np.int64)))
        # the arguments in every form the public methods take (the same results and TypeErrors)
        y = np.full(3, rank + 1.0)
        note("op by name", lambda: sub.all_reduce(y.copy(), op="max"))
        note("op and root by name", lambda: sub.reduce(y.copy(), dst=size - 1, op="min"))
        note("op and root by position", lambda: sub.reduce(y.copy(), "prod", size - 1))
        note("x by name", lambda: sub.all_reduce(x=y.copy()))
        note("op twice", lambda: sub.all_reduce(y.copy(), "max", op="min"))
        note("a positional too many", lambda: sub.all_reduce(y.copy(), "sum", 0))
        note("no x", lambda: sub.all_reduce())
        note("an unknown keyword", lambda: sub.broadcast(y.copy(), root=0))
        note("no peer", lambda: sub.send(y))
        note("out by name", lambda: sub.gather(y, out=np.zeros((size, 3)) if rank == 0 else None))
        ring = [tuple(plain(v) if i not in (START, END) else v > 0 for i, v in enumerate(r)) for r in sub._ring]
        compiled = ran_compiled(sub)
    note("closed", lambda: sub.all_reduce(x))
    return compiled, seen, ring, hooked


#: The tour's malformed calls: Python's own binding of the arguments refuses them (compiled: Cython's).
BINDING = {"op twice", "a positional too many", "no x", "an unknown keyword", "no peer"}


def bound(seen):
    """A tour entry as the forms must agree on it: a malformed call's TypeError by its type and the
    method it names (the interpreter and Cython word the rest differently), the rest as it is."""
    if isinstance(seen, tuple) and seen and seen[0] in BINDING:
        return seen[0], seen[1], re.findall(r"(\w+)\(\)", seen[2])
    return seen


@WORLDS
def test_both_forms_of_the_call_path_see_the_same(world):
    python = world.run(tour, [("python",)] * world.size, timeout=240)
    compiled = world.run(tour, [("compiled",)] * world.size, timeout=240)
    size = world.size
    for rank in range(size):
        assert python[rank][0] is False and compiled[rank][0] is True
        for a, b in zip(python[rank][1:], compiled[rank][1:], strict=True):
            assert len(a) == len(b)
            for left, right in zip(a, b, strict=True):
                assert bound(left) == bound(right)
        seen = dict((label, rest) for label, *rest in python[rank][1])
        # the tour against numpy, where its values say what is right
        for kind in ("numpy", "torch"):
            for n in (2, 3000):
                row = np.arange(n, dtype=np.float32)
                total = sum(row + r for r in range(size)).tolist()
                assert seen[f"all_reduce {kind}-{n}"][1][3] == total
                assert seen[f"async {kind}-{n}"][1][3] == total
                assert seen[f"timeout= {kind}-{n}"][1][3] == total
                assert seen[f"broadcast {kind}-{n}"][1][3] == (row + size - 1).tolist()
        for label in ("bad root", "bad out", "indivisible", "read-only"):
            assert seen[label][0] == "ValueError", (label, seen[label])
        for label in ("bool root", "bad async_op", "op on dtype"):
            assert seen[label][0] == "TypeError", (label, seen[label])
        assert seen["mismatch carried"][0] == seen["mismatch general"][0] == "CollectiveMismatch"
        assert seen["after"][1][3] == [sum(range(size))] * 3
        assert seen["closed"][0] == "ValueError"
        assert python[rank][2] and python[rank][3]  # records and hook calls were made


def test_the_public_methods_run_the_communicators_call_path(monkeypatch):
    """A compiled communicator's ``_run`` and public methods are its compiled call path's (the
    methods of callpath.Collectives, compiled); a public method a subclass replaces stays its own,
    and the Python form's are the class's, calling ``self._run``."""
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1")
    seen = []

    class Counting(LocalCommunicator):
        def broadcast(self, x, src=0, **kwargs):
            seen.append("broadcast")
            return super().broadcast(x, src, **kwargs)

    comm = Counting()
    try:
        module = front.compiled_module()
        assert type(comm._path) is module.CallPath and comm._run.__self__ is comm._path
        assert comm.all_reduce.__self__ is comm._path and comm.all_reduce(np.ones(2), "max")[0] == 1.0
        assert "broadcast" not in vars(comm) and comm.broadcast(np.ones(2))[0] == 1.0 and seen == ["broadcast"]
    finally:
        comm.close()
    monkeypatch.setenv("COLLECTIVES_COMPILED", "0")
    comm = LocalCommunicator()
    try:
        calls = []
        python_run = comm._run
        comm._run = lambda *args: calls.append(args[0].name) or python_run(*args)
        assert "all_reduce" not in vars(comm) and comm.all_reduce(np.ones(2), "max")[0] == 1.0
        assert calls == ["all_reduce"]
    finally:
        comm.close()


def test_a_class_with_a_run_of_its_own_keeps_it(monkeypatch):
    """The compiled call path stands for Communicator._run only: a subclass's own _run runs."""
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1")
    seen = []

    class Wrapped(LocalCommunicator):
        def _run(self, call, *args):
            seen.append(call.name)
            return super()._run(call, *args)

    plain_comm, wrapped = LocalCommunicator(), Wrapped()
    try:
        assert front.is_compiled(plain_comm) and not front.is_compiled(wrapped)
        assert wrapped.all_reduce(np.ones(3))[0] == 1.0
        assert seen == ["all_reduce"]
    finally:
        plain_comm.close()
        wrapped.close()


@pytest.mark.parametrize("form", ["compiled", "python"])
def test_a_transport_error_inside_the_call_is_mapped_the_same_way(monkeypatch, form):
    """An exception from the transport's method (inside the call path's try block) becomes the
    context's CollectiveError, raised from it, its record marked failed, in both forms; nothing of
    it is left as the exception being handled after."""
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1" if form == "compiled" else "0")
    comm = LocalCommunicator()
    try:
        x = np.ones((2, 2))[:, 0]  # strided: the general path, the row's transport method
        comm.all_gather(x)
        key = next(k for k in comm._plans if k[0].name == "all_gather")
        check, fast, carry, adapter, dtype, reduce_op, request, _, out_form = comm._checks.plan(key[0], x, None)

        def boom(request):
            raise RuntimeError("boom")

        comm._plans[key] = type(comm._plans[key])(key[0], check, fast, carry, adapter, dtype, reduce_op, request, boom,
                                                   out_form)
        comm._path.forget_kept()  # (the call path keeps the last kind's plan beside the plans)
        expected = r"all_gather \(call #2\) .* failed in the local transport: builtins.RuntimeError: boom"
        with pytest.raises(CollectiveError, match=expected) as raised:
            comm.all_gather(x)
        assert isinstance(raised.value.__cause__, RuntimeError)
        assert comm._ring[-1][STATE] == "failed" and comm._ring[-1][ERROR] == "RuntimeError: boom"
        assert sys.exc_info() == (None, None, None)
        assert front.is_compiled(comm) == (form == "compiled")
    finally:
        comm.close()


@pytest.mark.parametrize("form", ["compiled", "python"])
def test_the_last_kinds_plan_is_kept_and_forgotten_with_the_plans(monkeypatch, form):
    """A loop of one kind runs the plan kept beside the plans (no lookup); forgetting the plans
    (CallContext.forget_plans) forgets it too: the next call plans its kind again."""
    monkeypatch.setenv("COLLECTIVES_COMPILED", "1" if form == "compiled" else "0")
    comm = LocalCommunicator()
    try:
        x, y = np.ones(4), np.ones(3, dtype=np.int32)
        comm.all_reduce(x)
        [first] = comm._plans.values()
        assert comm._path.kept is first
        comm.all_reduce(y, "max")  # another kind: the kept plan follows it
        assert comm._path.kept is comm._plans[ALL_REDUCE, np.ndarray, y.dtype, "max"]
        comm._context.forget_plans()
        assert comm._path.kept is None and not comm._plans
        np.testing.assert_array_equal(comm.all_reduce(x), np.ones(4))
        [again] = comm._plans.values()
        assert again is not first and comm._path.kept is again
        assert front.is_compiled(comm) == (form == "compiled")
    finally:
        comm.close()


def changed_tensors(comm):
    """Calls on tensors changed in place between calls (values, shape, strides, storage, dtype,
    grad, negative bit, an out= reshaped): what each returned or raised, as plain data."""
    import torch  # noqa: PLC0415

    seen = []

    def note(label, run):
        try:
            seen.append((label, "ok", plain(run())))
        except Exception as error:  # noqa: BLE001  (what it raised is what the test compares)
            seen.append((label, type(error).__name__, str(error)))

    x = torch.arange(4, dtype=torch.float32)
    note("first", lambda: comm.all_gather(x))
    note("again", lambda: comm.all_gather(x))
    x.mul_(2)
    note("values", lambda: comm.all_gather(x))
    x.unsqueeze_(0)
    note("unsqueeze_", lambda: comm.all_gather(x))
    x.resize_(2)  # (the same memory, fewer elements)
    note("resize_", lambda: comm.all_gather(x))
    x.set_(torch.arange(10.0, 14.0).reshape(2, 2))
    note("set_", lambda: comm.all_gather(x))
    note("set_ again", lambda: comm.all_gather(x))
    x.t_()  # (the same shape and memory, other strides)
    note("t_", lambda: comm.all_gather(x))
    x.t_()
    note("t_ back", lambda: comm.all_gather(x))
    x.data = x.view(torch.int32)  # (the same memory and shape, another dtype)
    note("dtype", lambda: comm.all_gather(x))
    note("dtype again", lambda: comm.all_gather(x))
    v = torch.ones(3)
    note("v", lambda: comm.all_gather(v))
    v.set_(torch.full((3,), 7.0))  # (another storage, the same shape)
    note("storage", lambda: comm.all_gather(v))
    y = torch.ones(3)
    note("y", lambda: comm.all_reduce(y))
    note("y again", lambda: comm.all_reduce(y))
    y.data = y._neg_view()  # (the same memory, shape and dtype, its negative bit set)
    note("negative bit", lambda: comm.all_reduce(y))
    z = torch.ones(3)
    note("z", lambda: comm.all_gather(z))
    note("z again", lambda: comm.all_gather(z))
    z.requires_grad_()
    note("requires grad", lambda: (lambda r: (r.requires_grad, r.detach()))(comm.all_gather(z)))
    note("requires grad in place", lambda: comm.all_reduce(z))
    out, w = torch.zeros(comm.size, 3), torch.full((3,), 5.0)
    note("out", lambda: comm.all_gather(w, out=out))
    note("out again", lambda: (comm.all_gather(w + 1, out=out), out)[1])
    out.set_(torch.zeros(comm.size, 3))  # (the same tensor on new memory: a kept view of it is stale)
    note("out storage", lambda: (comm.all_gather(w + 2, out=out), out)[1])
    out.unsqueeze_(0)
    note("out reshaped", lambda: comm.all_gather(w, out=out))
    out.squeeze_(0)
    out.data = out.view(torch.int32)
    note("out dtype", lambda: comm.all_gather(w, out=out))
    many = [torch.full((2,), float(i)) for i in range(6)]  # more tensors than the views kept
    for _ in range(2):
        for i, t in enumerate(many):
            note(f"many {i}", lambda t=t: comm.all_gather(t))
    return seen


def changed_job(comm, form):
    with split_in_form(comm, form) as sub:
        return changed_tensors(sub), ran_compiled(sub)


@pytest.mark.parametrize("world", [("mpi", 2), ("torch", 2)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
def test_a_tensor_changed_between_calls_is_read_as_it_is_at_the_call(world):
    """A tensor changed in place between calls (its values, shape, strides, storage, dtype, grad,
    negative bit; an out= on new memory, reshaped or of another dtype) is read as it is at each call. Both forms
    return and raise the same, held against what each tensor held."""
    python = world.run(changed_job, [("python",)] * world.size, timeout=120)
    compiled = world.run(changed_job, [("compiled",)] * world.size, timeout=120)
    for rank in range(world.size):
        assert python[rank][1] is False and compiled[rank][1] is True
        assert python[rank][0] == compiled[rank][0]
        got = {label: rest for label, *rest in compiled[rank][0]}

        def rows(*row):
            return [list(row)] * world.size
        assert got["again"] == ["ok", ("torch", "torch.float32", (2, 4), rows(0.0, 1.0, 2.0, 3.0))]
        assert got["values"][1][3] == rows(0.0, 2.0, 4.0, 6.0)
        assert got["unsqueeze_"][1][2:] == ((2, 1, 4), rows([0.0, 2.0, 4.0, 6.0]))
        assert got["resize_"][1][2:] == ((2, 2), rows(0.0, 2.0))
        assert got["set_ again"][1][3] == rows([10.0, 11.0], [12.0, 13.0])
        assert got["t_"][1][3] == rows([10.0, 12.0], [11.0, 13.0])
        assert got["t_ back"][1][3] == rows([10.0, 11.0], [12.0, 13.0])
        assert got["dtype"][1][:3] == ("torch", "torch.int32", (2, 2, 2))
        bits = np.arange(10.0, 14.0, dtype=np.float32).view(np.int32).reshape(2, 2).tolist()
        assert got["dtype"][1][3] == rows(*bits)
        assert got["dtype again"] == got["dtype"]
        assert got["storage"][1][3] == rows(7.0, 7.0, 7.0)
        assert got["y again"][1][3] == [4.0] * 3  # (in place, twice)
        assert got["negative bit"][0] == "ValueError" and "negative" in got["negative bit"][1]
        assert got["requires grad"][1][1][1] == ("torch", "torch.float32", (2, 3), rows(1.0, 1.0, 1.0))
        assert got["requires grad in place"][0] == "ValueError" and "requires grad" in got["requires grad in place"][1]
        assert got["out again"][1][3] == rows(6.0, 6.0, 6.0)
        assert got["out storage"][1][3] == rows(7.0, 7.0, 7.0)
        assert got["out reshaped"][0] == got["out dtype"][0] == "ValueError"
        for i in range(6):
            assert got[f"many {i}"][1][3] == rows(float(i), float(i))


def mixed_job(comm):
    """The compiled call path over the Python carried calls (where the MPI backend's extension is
    missing): out= tensors and a new result, carried, against numpy."""
    import torch  # noqa: PLC0415
    from collectives.backends import mpi_channel  # noqa: PLC0415

    kept = mpi_channel.compiled_module
    mpi_channel.compiled_module = lambda: None
    try:
        with split_in_form(comm, "compiled") as sub:
            assert front.is_compiled(sub) and sub._transport._compiled_round is None
            rank, size = sub.rank, sub.size
            out, scattered, got = torch.zeros(size, 3), torch.zeros(3), []
            for i in range(3):
                x = torch.full((3,), float(rank + i))
                got.append(sub.all_gather(x, out=out) is out and out.tolist())
                got.append(sub.all_gather(x).tolist())
                got.append(sub.scatter(torch.arange(3.0 * size).reshape(size, 3) + i, src=0, out=scattered) is scattered
                           and scattered.tolist())
            return got, ran_compiled(sub)
    finally:
        mpi_channel.compiled_module = kept


@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True, ids=lambda w: f"{w[0]}-{w[1]}")
def test_the_compiled_call_path_over_the_python_carried_calls(world):
    """An out= tensor goes to the carried call as its numpy view and comes back as itself, also
    where the carried call is the Python one."""
    for rank, (got, compiled) in enumerate(world.run(mixed_job, [()] * world.size, timeout=120)):
        size = world.size
        want = []
        for i in range(3):
            rows = [[float(r + i)] * 3 for r in range(size)]
            want += [rows, rows, (np.arange(3.0 * size) + i)[3 * rank:3 * rank + 3].tolist()]
        assert got == want and compiled
