"""The fault-tolerance API without a failure: refusals that name what works, argument checks,
and collectives.elastic.State's commit/restore/sync (one process; the rank-killing tests are
test_elastic_gloo.py and test_elastic_ulfm.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from collectives.backends.local import LocalCommunicator

import collectives
from collectives import elastic, registry

pytestmark = pytest.mark.timeout(120)


def test_rank_failure_is_a_collective_error_with_failed_ranks_and_generation() -> None:
    import pickle

    failure = collectives.RankFailure("lost", [3, 1], generation=2)
    assert isinstance(failure, collectives.CollectiveError)
    assert failure.failed_ranks == (1, 3) and failure.generation == 2
    again = pickle.loads(pickle.dumps(failure))
    assert (again.failed_ranks, again.generation, str(again)) == ((1, 3), 2, "lost")


def test_shrink_and_agree_refuse_on_a_communicator_that_is_not_fault_tolerant() -> None:
    with LocalCommunicator() as comm:
        for call in (comm.shrink, lambda: comm.agree(True)):
            with pytest.raises(collectives.BackendUnavailable, match="collectives-elastic.*ULFM"):
                call()
        with pytest.raises(TypeError, match="flag must be a bool"):
            comm.agree(2)


def test_cupy_refuses_fault_tolerance_naming_what_works() -> None:
    with pytest.raises(collectives.BackendUnavailable, match="cupy backend cannot.*collectives-elastic"):
        registry.fault_tolerant_class("cupy")


def test_torch_refuses_fault_tolerance_outside_collectives_elastic() -> None:
    code = ("import collectives\n"
            "try:\n    collectives.init('torch', fault_tolerant=True)\n"
            "except collectives.BackendUnavailable as e:\n    print('REFUSED', e)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("REFUSED") and "not started by it" in done.stdout, done.stdout + done.stderr


def test_state_commits_restores_and_syncs_objects_and_values() -> None:
    class Counter:  # anything with state_dict/load_state_dict
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.n = state["n"]

    counter = Counter()
    state = elastic.State(counter=counter, w=np.zeros(3), step=0)
    counter.n, state.step = 5, 7
    state.w[:] = 1.0  # in place: the commit holds a copy
    state.commit()
    counter.n, state.step, state.w = 9, 8, np.full(3, 2.0)
    state.restore()
    assert (counter.n, state.step, state.w.tolist()) == (5, 7, [1.0, 1.0, 1.0])
    with LocalCommunicator() as comm:
        state.step = 99
        state.sync(comm)  # rank 0's commit (here: its own)
    assert state.step == 7
    with pytest.raises(AttributeError, match="State has no 'epoch'"):
        state.epoch = 1


def test_run_checks_its_arguments_and_returns_what_train_returns() -> None:
    state = elastic.State(step=0)
    with pytest.raises(ValueError, match="min_size"):
        elastic.run(lambda comm, state: None, state, LocalCommunicator(), min_size=0)
    with LocalCommunicator() as comm:
        assert elastic.run(lambda comm, state: comm.size, state, comm) == 1
    assert [(g.generation, g.size, g.step) for g in state.history] == [(0, 1, 0)]


def test_cuda_fault_tolerance_sets_nccl_error_handling_or_refuses_what_ends_the_process(monkeypatch) -> None:
    """torch's NCCL watchdog must not end a survivor: unset becomes 2 (abort and raise), 0 and 2
    stay, 1 and 3 (which end the process) are refused before any group is made."""
    from collectives.backends import torch_elastic

    name = torch_elastic.NCCL_ERROR_HANDLING
    monkeypatch.delenv(name, raising=False)
    torch_elastic._nccl_keeps_the_process()
    assert os.environ[name] == "2"
    for kept in ("0", "2"):
        monkeypatch.setenv(name, kept)
        torch_elastic._nccl_keeps_the_process()
        assert os.environ[name] == kept
    for ending in ("1", "3"):
        monkeypatch.setenv(name, ending)
        with pytest.raises(collectives.BackendUnavailable, match=rf"{name}={ending} .*allowed: 0 or 2"):
            torch_elastic._nccl_keeps_the_process()


def test_aborts_run_inside_one_nccl_group_as_torchs_abort_process_group_does() -> None:
    """A shrink aborts every backend of the generation; torch's ``_abort_process_group`` brackets
    NCCL aborts in ``_group_start()``/``_group_end()`` (aborts of different communicators can deadlock,
    pytorch#119797), and so must we: the order of the calls on the NCCL-like backends handed to the
    abort, beside a real Gloo backend (which has no such bracket and is aborted inside it)."""
    import torch
    import torch.distributed as dist
    from collectives.backends import torch_elastic

    calls: list[str] = []

    class NcclLike:  # the backend object torch would hand over on CUDA: only the calls are recorded
        def __init__(self, name: str) -> None:
            self.name = name

        def _group_start(self) -> None:
            calls.append("group start")

        def _group_end(self) -> None:
            calls.append("group end")

        def abort(self) -> None:
            calls.append(f"abort {self.name}")

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
        assert not hasattr(gloo, "_group_start")
        torch_elastic._abort_backends([gloo, NcclLike("newest"), NcclLike("oldest")])
        assert calls == ["group start", "abort newest", "abort oldest", "group end"]
        calls.clear()
        torch_elastic._abort_backends([gloo])  # no NCCL backend: no bracket
        assert calls == []
    finally:
        dist.destroy_process_group()
