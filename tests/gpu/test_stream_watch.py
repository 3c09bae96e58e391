"""CPU twins of the cupy backend's stream-ordered calls: CuPy's CUDA and NCCL stood in for by
collectives.testing.fake_cupy (host memory, events whose completion the test decides, an NCCL
communicator that logs its calls and its abort), our own code around them real.

- a blocking call returns once enqueued: no host wait for its event, a pooled event (no event
  made per call), and none of the host's event queries on the caller's thread;
- a call that outlives its timeout: the watchdog aborts the NCCL communicator, the next call (and
  a handle's wait()) raises CollectiveTimeout naming the call, on every rank, and the flight
  recorder dumps.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from collectives import CollectiveTimeout, arrays
from collectives.testing import fake_cupy

pytestmark = pytest.mark.timeout(60)


def wait_for_condition(done, seconds=20.0):
    """Wait until ``done()`` (the watchdog thread's work), at most ``seconds``."""
    changed = threading.Event()
    for _ in range(int(seconds / 0.01)):
        if done():
            return
        changed.wait(0.01)
    raise AssertionError("the condition never came true")


def _communicator(nccl_comm, rank=0, size=1, timeout=30.0):
    from collectives.backends.cupy_nccl import CupyNcclCommunicator

    return CupyNcclCommunicator(nccl_comm, rank, size, 0, 0, timeout=timeout)


def test_a_blocking_cupy_call_returns_once_enqueued_and_the_host_never_waits_for_it():
    with fake_cupy.installed() as device:
        import cupy

        nccl_comm = cupy.cuda.nccl.NcclCommunicator(1, None, 0)
        comm = _communicator(nccl_comm, timeout=2.0)
        x = cupy.asarray(np.arange(6, dtype=np.float32))
        device.stalled = True  # the stream is stuck: every call below is still running on it
        for _ in range(100):
            assert comm.all_reduce(x) is x  # (before: a host wait for the event, then a timeout)
        assert nccl_comm.calls == ["allReduce"] * 100
        np.testing.assert_array_equal(x.host, np.arange(6, dtype=np.float32))  # one rank's sum
        assert device.host_waits == 0
        # The caller's thread never queried an event: the watchdog thread looks at them.
        assert device.queries.get(threading.get_ident(), 0) == 0
        comm.close()


def test_a_blocking_cupy_call_takes_a_pooled_event_not_a_new_one():
    with fake_cupy.installed() as device:
        import cupy

        comm = _communicator(cupy.cuda.nccl.NcclCommunicator(1, None, 0))
        x = cupy.asarray(np.arange(6, dtype=np.float32))
        for _ in range(200):
            comm.all_reduce(x)
        pool = getattr(comm._transport._library(arrays.CUPY), "pool", [])
        wait_for_condition(lambda: len(pool) == device.events_made)  # the watchdog took them back
        made = device.events_made
        for _ in range(made):
            comm.all_reduce(x)
        assert device.events_made == made  # (a new event per call before)
        comm.close()


@pytest.mark.parametrize("timeout", [30.0, 0], ids=["watched", "no-timeout"])
def test_an_asynchronous_cupy_call_takes_a_pooled_event_and_it_goes_back(timeout):
    """Under a timeout the watchdog gives a handle's event back once complete; without one the
    handle does, once the communicator learns it completed (the next call's reaping)."""
    with fake_cupy.installed() as device:
        import cupy

        comm = _communicator(cupy.cuda.nccl.NcclCommunicator(1, None, 0), timeout=timeout)
        x = cupy.asarray(np.arange(6, dtype=np.float32))
        for _ in range(200):
            assert comm.all_reduce(x, async_op=True).wait() is x
        comm.all_reduce(x)  # (reaps the last handle)
        pool = comm._transport._library(arrays.CUPY).pool
        wait_for_condition(lambda: len(pool) == device.events_made)
        made = device.events_made
        for _ in range(made):
            comm.all_reduce(x, async_op=True).wait()
        assert device.events_made == made  # (a new event per call before)
        comm.close()


def test_a_handle_whose_event_went_back_and_was_recorded_again_is_complete():
    """A handle never asks an event a later call recorded again: the watch took its call off
    (complete) before the event went back to the pool."""
    with fake_cupy.installed() as device:
        import cupy

        comm = _communicator(cupy.cuda.nccl.NcclCommunicator(1, None, 0))
        x = cupy.asarray(np.arange(6, dtype=np.float32))
        handle = comm.all_reduce(x, async_op=True)
        pool = comm._transport._library(arrays.CUPY).pool
        wait_for_condition(lambda: len(pool) == device.events_made)  # the watchdog took it back
        device.stalled = True
        comm.all_reduce(x)  # takes that event from the pool: recorded again, never completes
        assert device.events_made == 1 and not pool
        assert handle.is_completed() and handle.wait() is x
        device.resume()
        comm.close()


def test_a_cupy_call_past_its_timeout_aborts_nccl_and_the_next_call_raises_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("COLLECTIVES_TRACE_DIR", str(tmp_path))
    with fake_cupy.installed() as device:
        import cupy

        nccl_comm = cupy.cuda.nccl.NcclCommunicator(1, None, 0)
        comm = _communicator(nccl_comm, timeout=0.2)
        x = cupy.asarray(np.ones(4, dtype=np.float32))
        comm.all_reduce(x)
        device.stalled = True
        comm.broadcast(x, 0)  # call #2: returns at once, and never completes
        handle = comm.all_reduce(x, async_op=True)
        assert nccl_comm.aborted.wait(20), "the watchdog never aborted the communicator"
        for attempt in (lambda: comm.all_reduce(x), handle.wait, lambda: comm.broadcast(x, 0)):
            with pytest.raises(CollectiveTimeout, match=r"broadcast \(call #2\).*timeout=0.2s.*ncclCommAbort"):
                attempt()
        dump = json.loads((tmp_path / "rank-0.json").read_text())
        assert "CollectiveTimeout in broadcast (call #2)" in dump["reason"]
        comm.close()
    assert nccl_comm.destroyed


def test_past_max_pending_a_dropped_cupy_handle_stays_kept_until_its_event_completes(monkeypatch):
    """A cupy handle's wait() only makes the caller's stream wait for the call: the communicator
    keeping more than MAX_PENDING dropped handles keeps the oldest (its record "posted") until its
    event has completed, not once waited."""
    from collectives import work
    from collectives.diagnostics.recorder import END, POSTED, STARTED, STATE

    monkeypatch.setattr(work, "MAX_PENDING", 8)
    with fake_cupy.installed() as device:
        import cupy

        comm = _communicator(cupy.cuda.nccl.NcclCommunicator(1, None, 0), timeout=0)
        x = cupy.asarray(np.ones(4, dtype=np.float32))
        device.stalled = True
        for _ in range(12):
            comm.all_reduce(x, async_op=True)  # dropped, and still running on the stalled stream
        assert len(comm._pending) == 12  # (before: 8, the oldest forgotten as if complete)
        assert [record[STATE] for record in comm._handles.posted] == [POSTED] * 12
        assert device.host_waits == 0
        records = list(comm._handles.posted)
        device.resume()
        comm.all_reduce(x)  # reaps them all
        assert len(comm._pending) == 0
        assert all(record[STATE] is STARTED and record[END] for record in records)
        comm.close()


def stalled_call_job(comm, timeout):
    """Every rank: a cupy communicator over the fake NCCL, one call that never completes; what
    its next call raises."""
    with fake_cupy.installed() as device:
        import cupy

        nccl_comm = cupy.cuda.nccl.NcclCommunicator(comm.size, None, comm.rank)
        gpu = _communicator(nccl_comm, comm.rank, comm.size, timeout=timeout)
        x = cupy.asarray(np.ones(4, dtype=np.float32))
        device.stalled = True
        gpu.all_reduce(x)
        aborted = nccl_comm.aborted.wait(20)
        try:
            gpu.all_reduce(x)
            raised = None
        except CollectiveTimeout as error:
            raised = str(error)
        gpu.close()
        return aborted, raised, device.host_waits


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [("mpi", 2)], indirect=True, ids=["mpi-2"])
def test_every_rank_gets_the_timeout_of_a_stalled_call_at_its_next_call(world):
    results = world.run(stalled_call_job, args=(0.2,), timeout=120)
    assert len(results) == 2
    for rank, (aborted, raised, host_waits) in enumerate(results):
        assert aborted and host_waits == 0, rank
        named = f"all_reduce (call #1) on <CupyNcclCommunicator backend=cupy rank={rank} size=2>"
        assert raised is not None and named in raised, raised


# -- the plan of a kind of call: what NCCL is handed -------------------------------------------------

NCCL_TYPES = {"int8": 0, "uint8": 1, "int32": 2, "int64": 4, "float16": 6, "float32": 7, "float64": 8,
              "bfloat16": 9}


@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "avg"])
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"])
def test_every_kind_hands_nccl_the_type_and_op_of_its_wire_twice_over(dtype, op):
    """The first call of a kind builds its plan, the second reuses it: both hand NCCL the same
    call, NCCL's own type for x's dtype only where x goes as it is (int16 travels in int32, float
    MIN/MAX as integer order keys, AVG as SUM then a division)."""
    if op == "avg" and not dtype.startswith("float"):
        pytest.skip("AVG is for floats")
    with fake_cupy.installed():
        import cupy

        nccl_comm = cupy.cuda.nccl.NcclCommunicator(1, None, 0)
        comm = _communicator(nccl_comm, timeout=0)
        values = np.arange(-3, 5).astype(dtype)
        x = cupy.asarray(values)
        comm.all_reduce(x, op)
        comm.all_reduce(x, op)
        np.testing.assert_array_equal(x.host, values)  # one rank: every op leaves x as it is
        first, second = nccl_comm.reductions
        assert first == second
        nccl_type, nccl_op, count = first
        keys = op in ("min", "max") and dtype.startswith("float")
        want_type = {"int16": 2, "float16": 2, "float32": 2, "float64": 4}.get(dtype) if keys else \
            NCCL_TYPES.get(dtype, 2)  # int16: in int32
        assert (nccl_type, count) == (want_type, 8)
        assert nccl_op == {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 0}[op]
        comm.close()


# -- the planned calls: what NCCL is handed on the plan, against the row's method -------------------

#: The planned kinds: all_reduce of every (dtype, op) NCCL reduces as it is, broadcast of every dtype.
PLANNED = [("all_reduce", dtype, op) for dtype in ("int8", "uint8", "int32", "int64", "float16", "float32", "float64")
           for op in ("sum", "prod", "min", "max") if op in ("sum", "prod") or not dtype.startswith("float")] + \
          [("broadcast", dtype, None) for dtype in ("bool", "int8", "uint8", "int16", "int32", "int64", "float16",
                                                    "float32", "float64")]


def cuda_looking_tensors(monkeypatch):
    """Plain CPU tensors as the cupy backend's CUDA tensors on device 0 (torch's CUDA stream and
    events stood in for as CuPy's are); returns torch."""
    import torch

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(type(arrays.TORCH), "device_index", lambda self, x: 0)
    stream = type("Stream", (), {"cuda_stream": 0, "wait_event": lambda self, event: None})()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda: fake_cupy.Event())
    return torch


def _planned_kind(comm, row, x, op):
    from collectives import calls

    call = getattr(calls, row.upper())
    return comm._checks.plans[call, type(x), x.dtype, op]


@pytest.mark.parametrize("library", ["cupy", "torch"])
@pytest.mark.parametrize("row, dtype, op", PLANNED)
def test_a_planned_kind_hands_nccl_what_the_rows_method_does_and_gives_numpys_result(library, row, dtype, op,
                                                                                     monkeypatch):
    """Blocking and asynchronous calls of a planned kind (its first call plans it) hand NCCL the
    arguments the row's method derives for the same array from the general steps (staging, the
    kind's reduction plan, the stream library), and leave numpy's result: at one rank, the
    reduction of x alone and rank 0's x."""
    from collectives import calls
    from collectives.calls import Request
    from collectives.checks import _no_fast_path
    from collectives.ops import ReduceOp

    with fake_cupy.installed():
        import cupy

        nccl_comm = cupy.cuda.nccl.NcclCommunicator(1, None, 0)
        comm = _communicator(nccl_comm, timeout=30.0)
        values = np.array([-3, 0, 1, 2, 5, 7], dtype=np.int64).astype(dtype)
        if library == "cupy":
            x, adapter, host = cupy.asarray(values), arrays.CUPY, (lambda a: a.host)
        else:
            torch = cuda_looking_tensors(monkeypatch)
            x, adapter, host = torch.from_numpy(values.copy()), arrays.TORCH, (lambda a: a.numpy())
        run = (lambda **kw: comm.all_reduce(x, op, **kw)) if row == "all_reduce" else \
            (lambda **kw: comm.broadcast(x, 0, **kw))
        assert run() is x
        assert run() is x
        assert run(async_op=True).wait() is x
        planned = nccl_comm.arguments[-3:]
        assert planned[0] == planned[1] == planned[2]
        assert _planned_kind(comm, row, x, op).fast is not _no_fast_path  # (the old code: none)
        reference = {"sum": np.sum, "prod": np.prod, "min": np.min, "max": np.max}[op](values[None], axis=0) \
            if op else values  # (numpy's reduction over the one rank's array; rank 0's x)
        np.testing.assert_array_equal(host(x), reference.astype(dtype))
        call = getattr(calls, row.upper())
        getattr(comm._transport, call.method)(Request(call, x, adapter, dtype, op and ReduceOp(op), root=0))
        assert nccl_comm.arguments[-1] == planned[0]
        comm.close()


@pytest.mark.parametrize("compiled", ["1", "0"], ids=["compiled", "python"])
def test_the_planned_calls_run_in_the_form_the_config_picks_and_hand_nccl_the_same_arguments(compiled, monkeypatch):
    """The planned calls are backends/cupy_fast.py's classes: compiled
    (collectives.backends._cupy_fast_c) where built, the Python twin under COLLECTIVES_COMPILED=0;
    either hands NCCL x's pointer, its count, ncclFloat32 or ncclUint8, the op or root and the
    stream, and leaves numpy's result; and puts a call under a timeout on the watch by its row's
    name and number, due its timeout from now on the recorder's clock (time.monotonic's)."""
    from collectives.backends import cupy_fast, cupy_plans

    monkeypatch.setenv("COLLECTIVES_COMPILED", compiled)
    module = cupy_plans.compiled_fast_module()
    if compiled == "1" and module is None:
        pytest.skip("backends/cupy_fast.py's compiled form was not built here")
    expected = module if compiled == "1" else cupy_fast
    with fake_cupy.installed() as device:
        import cupy

        nccl_comm = cupy.cuda.nccl.NcclCommunicator(1, None, 0)
        comm = _communicator(nccl_comm, timeout=30.0)
        values = np.arange(6, dtype=np.float32)
        x = cupy.asarray(values)
        for _ in range(2):  # (the first call plans the kind; the second runs the plan as it is)
            assert comm.all_reduce(x) is x and comm.broadcast(x, 0) is x
        plan = _planned_kind(comm, "all_reduce", x, "sum")
        assert type(plan.fast.__self__) is expected.PlannedCall
        assert type(plan.check.__self__) is expected.ArrayCheck
        ptr = x.data.ptr
        assert nccl_comm.arguments[-2:] == [("allReduce", (ptr, ptr, 6, 7, 0, 0)),
                                            ("broadcast", (ptr, ptr, 24, 1, 0, 0))]
        np.testing.assert_array_equal(x.host, values)  # (one rank: its sum, its broadcast)
        device.stalled = True  # (their events never complete: the watch keeps their entries)
        before = time.monotonic()
        comm.all_reduce(x), comm.broadcast(x, 0)
        after = time.monotonic()
        watch = comm._transport._stream_watch
        with watch._lock:
            entries = [list(entry) for entry in list(watch._inflight)[-2:]]
        assert [(entry[3], entry[4]) for entry in entries] == [("all_reduce", 5), ("broadcast", 6)]
        assert all(before + 30.0 <= entry[2] <= after + 30.0 for entry in entries)
        device.resume()
        comm.close()


def test_an_array_the_plan_does_not_take_goes_through_the_rows_method_and_a_foreign_device_is_refused():
    """A non-contiguous array of a planned kind is staged by the row's method (NCCL gets a
    contiguous copy, x gets the result); an array on another device is refused with the device
    check's ValueError, before NCCL is called, on the kind's first call and on a later one."""
    with fake_cupy.installed():
        import cupy

        nccl_comm = cupy.cuda.nccl.NcclCommunicator(1, None, 0)
        comm = _communicator(nccl_comm, timeout=30.0)
        values = np.arange(8, dtype=np.float32)
        x = cupy.asarray(values)
        comm.all_reduce(x)  # plans the kind
        strided = x[::2]
        assert comm.all_reduce(strided) is strided
        name, (send, recv, count, nccl_type, nccl_op, _) = nccl_comm.arguments[-1]
        assert (name, count, nccl_type, nccl_op) == ("allReduce", 4, 7, 0) and send != strided.data.ptr
        np.testing.assert_array_equal(x.host, values)
        elsewhere = cupy.asarray(values)
        elsewhere.data.device_id, elsewhere.device = 1, fake_cupy._CudaDevice(1)
        made = len(nccl_comm.arguments)
        for _ in range(2):
            with pytest.raises(ValueError, match="x is on CUDA device 1, but this communicator's NCCL runs on"):
                comm.all_reduce(elsewhere)
        assert len(nccl_comm.arguments) == made
        comm.close()
