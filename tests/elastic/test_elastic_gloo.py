"""Fault tolerance on the torch backend (Gloo) under collectives-elastic, for real: ranks of a
4-rank training job die (SIGKILL, os._exit(1), an uncaught exception) or hang (SIGSTOP) in the
middle of a step, and the survivors (and the replacements that join) finish with the weights
of a float64 numpy replay of the same steps over the same memberships.

Each job costs ~15-40 s on 2 cores (most of it torch's import in every process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from collectives.diagnostics import trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import linear_job  # noqa: E402

JOB = str(Path(linear_job.__file__).resolve())
TIMEOUT = 240

pytestmark = pytest.mark.timeout(TIMEOUT + 30)


def run_job(out: Path, *args: str, faults: str, wait_join: str = "", timeout: float = 4,
            env: dict[str, str] | None = None, ranks: int = 4) -> dict[str, dict]:
    command = [sys.executable, "-m", "collectives.elastic.launcher", "-n", str(ranks), "--timeout", str(timeout),
               *args, sys.executable, JOB, str(out), "--faults", faults, "--wait-join", wait_join]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}, **(env or {})}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")}


def reference(sizes: list[int]) -> np.ndarray:
    """The same steps in float64 numpy, each with its step's number of ranks and their shards."""
    w = np.zeros(linear_job.DIM)
    for step, size in enumerate(sizes):
        g = sum(linear_job.partial_gradient(w, step, rank, size) for rank in range(size))
        w = w - linear_job.LR * g / linear_job.BATCH
    return w


def check_final(results: dict[str, dict], size: int) -> list[int]:
    assert len(results) == size, sorted(results)
    first = next(iter(results.values()))
    sizes = first["sizes"]
    assert len(sizes) == linear_job.STEPS
    for result in results.values():
        assert result["sizes"] == sizes
        assert result["size"] == size
        assert result["w"] == first["w"]  # every rank holds the same bits
        assert result["agree"] == [True, False]
    assert sorted(r["rank"] for r in results.values()) == list(range(size))
    np.testing.assert_allclose(first["w"], reference(sizes), rtol=1e-12, atol=1e-14)
    return sizes


def test_survivors_of_a_sigkill_and_an_exit_train_on_and_match_the_reference(tmp_path: Path) -> None:
    traces = tmp_path / "trace"
    results = run_job(tmp_path, "--min", "2", faults="3:kill@4,1:exit@7",
                      env={"COLLECTIVES_TRACE_DIR": str(traces)})
    sizes = check_final(results, 2)
    # The step in flight is redone by the survivors: 4 ranks before step 4, 3 until step 7.
    assert sizes == [4] * 4 + [3] * 3 + [2] * 5
    assert sorted(results) == ["0", "2"]
    history = results["0"]["history"]
    assert [h[:3] for h in history] == [[0, 4, 0], [1, 3, 4], [2, 2, 7]]
    assert [h[3] for h in history] == [[], [3], [1]]  # RankFailure.failed_ranks, per generation
    assert results["2"]["rank"] == 1  # survivors renumbered in order
    # The flight recorder's dumps, read by collectives-trace, name the failed ranks and generations.
    found = trace.analyze(trace.load(str(traces)))
    assert [(f["communicator"], f["generation"], f["failed_ranks"]) for f in found["failures"]] == [
        ("world", 0, [3]), ("world@1", 1, [1])]
    text = subprocess.run([sys.executable, "-m", "collectives.diagnostics.trace", str(traces)],
                          capture_output=True, text=True, timeout=60).stdout
    assert "rank failure: generation 0 of communicator 'world' (size 4) lost rank(s) 3" in text
    assert "rank failure: generation 1 of communicator 'world@1' (size 3) lost rank(s) 1" in text


def test_replacements_join_after_an_exception_and_a_hang_and_hold_the_same_weights(tmp_path: Path) -> None:
    results = run_job(tmp_path, "--replace", faults="2:raise@3,1:stop@8", wait_join="6:4,10:4")
    sizes = check_final(results, 4)
    assert sizes[:3] == [4, 4, 4] and sizes[3] == 3 and sizes[8] == 3 and sizes[10:] == [4, 4]
    assert {"4", "5"} <= set(results)  # the two replacements, with the weights of the rest
    # Each replacement runs on the local slot (LOCAL_RANK: its GPU) of the member it replaces.
    assert {m: results[m]["local_rank"] for m in sorted(results)} == {"0": "0", "3": "3", "4": "2", "5": "1"}


#: Jobs that lose a rank at each point of the loop (linear_job.POINTS), a few points a job: at 3
#: ranks between the step and commit() (the survivors wait inside commit's collective) and while
#: the next generation's group is made; at 4 ranks at the top of a step, inside commit() and
#: inside restore(), then inside the collective, inside shrink() and inside an admission. The
#: launcher's count of the ranks left takes in the replacements started (--min 3 of 3 holds).
KILL_POINTS = [
    pytest.param(3, ("--min", "3", "--replace"), "2:exit@2/commit,1:exit@2/ready", "6:3", ["0", "3", "4"],
                 id="3-commit-ready"),
    pytest.param(4, (), "3:exit@2/incommit,2:exit@2/restore,1:kill@4/top", "", ["0"],
                 id="4-top-incommit-restore"),
    pytest.param(4, ("--replace",), "3:kill@2,2:exit@2/shrink,1:exit@0/admit", "9:4", ["0", "4", "5", "6"],
                 id="4-collective-shrink-admit"),
]


@pytest.mark.parametrize("ranks, args, faults, wait_join, finishers", KILL_POINTS)
def test_a_rank_lost_at_any_point_of_the_loop_is_a_rank_failure_and_the_survivors_match_the_reference(
        tmp_path: Path, ranks: int, args: tuple[str, ...], faults: str, wait_join: str, finishers: list[str]) -> None:
    results = run_job(tmp_path, *args, faults=faults, wait_join=wait_join, ranks=ranks)
    check_final(results, len(finishers))
    assert sorted(results) == finishers  # every member that was to fail did, and no other


def test_the_launcher_names_the_ranks_left_and_those_that_ended_when_too_few_remain() -> None:
    """Members 1 and 2 end (status 1 and 9) while member 0 waits: 1 rank left, fewer than --min 2."""
    code = ("import os, signal, sys\n"
            "member = int(os.environ['COLLECTIVES_ELASTIC_ID'])\n"
            "if member:\n    os._exit({1: 1, 2: 9}[member])\n"
            "signal.pause()\n")
    command = [sys.executable, "-m", "collectives.elastic.launcher", "-n", "3", "--min", "2",
               sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert done.returncode == 128 + 15, done.stderr  # member 0's SIGTERM
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("collectives-elastic: 1 rank(s) left (member 0), fewer than --min 2: ending the job; "
                           "ended: member "), line
    assert "member 1 (status 1)" in line and "member 2 (status 9)" in line, line


def run_torch_job(job: str, out: Path, faults: str, *args: str, ranks: int = 4) -> list[dict]:
    """``job`` (a job of torch modules, beside linear_job.py) under collectives-elastic."""
    command = [sys.executable, "-m", "collectives.elastic.launcher", "-n", str(ranks), "--timeout", "10",
               sys.executable, str(Path(job).resolve()), str(out), "--faults", faults, *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL, cwd=str(Path(job).resolve().parent))
    assert done.returncode == 0, done.stderr[-6000:]
    return [json.loads(path.read_text()) for path in out.glob("*.json")]


def test_dataparallel_and_syncbatchnorm_train_across_a_shrink_like_one_process(tmp_path: Path) -> None:
    import syncbn_job
    import torch

    results = run_torch_job(syncbn_job.__file__, tmp_path, "3:kill@3")
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    expected = syncbn_job.reference(syncbn_job.STEPS)
    for result in results:
        assert result["sizes"] == [4, 4, 4, 3, 3, 3, 3, 3]
        for got, want in zip(result["params"], expected):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-10, atol=1e-12)


def test_torch_ddp_on_the_collectives_backend_trains_across_a_shrink(tmp_path: Path) -> None:
    """DistributedDataParallel over collectives.c10d.process_group(), wrapped again in each
    generation: a SIGKILL in the middle of a step, and the survivors end with the parameters of
    a plain-torch replay (no DDP) of the same steps on the same shards."""
    import ddp_job
    import torch

    results = run_torch_job(ddp_job.__file__, tmp_path, "3:kill@3")
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    sizes = [4, 4, 4, 3, 3, 3, 3, 3]
    expected = ddp_job.reference(sizes)
    for result in results:
        assert result["sizes"] == sizes
        assert result["params"] == results[0]["params"]  # every rank holds the same bits
        for got, want in zip(result["params"], expected):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-10, atol=1e-12)


def test_torch_ddp_goes_on_across_a_shrink_that_no_failure_forced(tmp_path: Path) -> None:
    """The route a generation ends by, without a failure (the CPU twin of the GPU check's NCCL
    run, tests/gpu/test_gpu.py): every group of generation 0 aborted and destroyed, its
    "collectives" group's threads ended, generation 1's groups made, DDP wrapped again, and the
    parameters those of a plain-torch replay."""
    import ddp_job
    import torch

    results = run_torch_job(ddp_job.__file__, tmp_path, "", "--shrink-at", "3", ranks=2)
    assert sorted(r["rank"] for r in results) == [0, 1]
    expected = ddp_job.reference([2] * ddp_job.STEPS)
    for result in results:
        assert result["generation"] == 1 and result["sizes"] == [2] * ddp_job.STEPS
        assert result["backend"] == "gloo" and result["param_device"] == "cpu"
        # Generation 1's group alone has threads: generation 0's ended with it.
        assert result["workers_after_shrink"] == [result["workers"]] and len(result["workers"]) == 1
        for got, want in zip(result["params"], expected):
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), want, rtol=1e-10, atol=1e-12)


def check_split(results: dict[str, dict], split_shrinks: bool) -> None:
    """What split_job.py's survivors saw: the split's RankFailure names split rank 0 (member 3,
    split in reverse order), the world's names world rank 3, and the split made again from the
    world's shrink() (and, where the transport can, the split's own shrink()) sums the survivors'
    world ranks + 1 (1 + 2 + 3)."""
    assert sorted(results) == ["0", "1", "2"], sorted(results)
    for member, seen in results.items():
        rank = int(member)
        assert seen["split_rank"] == 3 - rank and seen["before"] == 10.0
        assert seen["split_failure"] == [0] and seen["world_failure"] == [3]
        assert seen["again"] == [2 - rank, 3, 6.0] and seen["agree"] is True
        if split_shrinks:
            assert seen["split_shrunk"] == [2 - rank, 3, 6.0]
        else:
            assert "split() the result again" in seen["split_shrunk"]


def test_a_split_of_a_fault_tolerant_communicator_raises_rank_failure_and_is_made_again(tmp_path: Path) -> None:
    """A SIGKILLed member's split: the survivors' call on it raises RankFailure in the split's
    numbering (not a plain error, nor a hang), the world's call raises too, and a split of the
    shrunk world works; the split's own shrink() says what to do instead."""
    import split_job

    run_torch_job(split_job.__file__, tmp_path, "")
    check_split({p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}, split_shrinks=False)

