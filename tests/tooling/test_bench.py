"""collectives-bench: every collective under no launcher and under mpiexec, its table read back,
#wrong 0 with --check, and --check counting the elements a broken collective gets wrong."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collectives
from collectives.bench import cli, parse_table
from collectives.bench.cases import OPS

BIN = Path(sys.executable).parent
SMALL = ["-b", "64", "-e", "256", "-f", "4", "-n", "3", "-w", "1", "--check"]


def bench(*args: str, launcher: list[str] | None = None, timeout: float = 240, **extra: str) -> str:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **extra}
    env.pop("COLLECTIVES_BACKEND", None)
    done = subprocess.run([*(launcher or []), str(BIN / "collectives-bench"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_every_collective_runs_right_without_a_launcher() -> None:
    rows = parse_table(bench("all", *SMALL))
    ops = {r["op"] for r in rows}
    assert ops == set(OPS) - {"send_recv"}  # one rank has no peer
    assert all(r["wrong"] == 0 for r in rows)
    assert {r["bytes"] for r in rows if r["op"] == "all_reduce"} == {64, 256}
    assert all(r["time_us"] > 0 for r in rows)


def test_every_collective_runs_right_under_mpiexec_against_raw_mpi4py(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    text = bench("all", *SMALL, "--raw", "--json", str(out), launcher=[str(BIN / "mpiexec"), "-n", "2"])
    assert "backend mpi" in text and "raw: mpi4py" in text
    rows = parse_table(text)
    assert {r["op"] for r in rows} == set(OPS)
    assert all(r["wrong"] == 0 for r in rows)
    assert all(r["raw_time_us"] and r["ratio"] for r in rows)  # MPI has every one of them
    # the default check's price beside it: the raw call after one small round, but where the
    # check makes no round of its own
    assert "raw+round" in text
    rounded = {r["op"] for r in rows if r.get("round_time_us")}
    assert rounded == set(OPS) - {"send_recv", "barrier"}
    assert all(r["ratio_round"] == pytest.approx(r["time_us"] / r["round_time_us"], rel=0.01)
               for r in rows if r["op"] in rounded)
    doc = json.loads(out.read_text())
    assert doc["meta"]["ranks"] == 2
    assert [(r["op"], r["bytes"], r["wrong"]) for r in doc["results"]] == \
        [(r["op"], r["bytes"], r["wrong"]) for r in rows]
    # the raw programs are right too (the uneven ones exchange their counts first)
    assert [(r["op"], r["raw_wrong"]) for r in doc["results"]] == [(r["op"], 0) for r in doc["results"]]
    by_op = {r["op"]: r for r in doc["results"] if r["bytes"] in (64, 0, 68)}
    # nccl-tests' bus factors at 2 ranks
    assert by_op["all_reduce"]["ours"]["busbw_GBps"] == pytest.approx(by_op["all_reduce"]["ours"]["algbw_GBps"])
    assert by_op["all_gather"]["ours"]["busbw_GBps"] == pytest.approx(by_op["all_gather"]["ours"]["algbw_GBps"] / 2)


def test_every_collective_runs_right_under_torchrun_against_raw_torch_distributed(tmp_path: Path) -> None:
    """(With the check off: ours without its round, and no raw+round column.)"""
    from collectives.testing.launch import free_port

    port = str(free_port())
    out = tmp_path / "bench.json"
    text = bench("all", *SMALL, "--raw", "--json", str(out), launcher=[
        str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", port, "--no-python"],
        COLLECTIVES_DEBUG="0")
    assert "backend torch" in text and "raw: torch.distributed" in text
    assert "raw+round" not in text
    rows = parse_table(text)
    assert not any("round_time_us" in r for r in rows)
    assert {r["op"] for r in rows} == set(OPS)
    assert all(r["wrong"] == 0 for r in rows)
    # torch.distributed has every one but an uneven all_gather
    assert {r["op"] for r in rows if r["raw_time_us"] is None} == {"all_gather_v"}
    results = json.loads(out.read_text())["results"]
    assert [(r["op"], r.get("raw_wrong")) for r in results] == \
        [(r["op"], None if r["op"] == "all_gather_v" else 0) for r in results]


class Broken:
    """A communicator whose ``op`` returns a float32 result with one element off by one (on top of
    the real call): what --check must notice. The bench's own float64 statistics stay right."""

    def __init__(self, comm: Any, op: str) -> None:
        self._comm, self._op = comm, op

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._comm, name)
        if name != self._op:
            return real

        def broken(x: Any, *args: Any, **kwargs: Any) -> Any:
            result = real(x, *args, **kwargs)
            if x.dtype != np.float32:
                return result
            target = x if name in ("all_reduce", "broadcast", "reduce") else kwargs.get("out", result)
            np.asarray(target).reshape(-1)[0] += 1
            return result
        return broken


@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all"])
def test_check_counts_what_a_broken_collective_gets_wrong(op: str) -> None:
    args = cli.parse_args([op, *SMALL])
    table = io.StringIO()
    cli.run(args, comm=Broken(collectives.init("local"), op), out=table)
    rows = parse_table(table.getvalue())
    assert [r["wrong"] for r in rows] == [1, 1]  # one wrong element at each size
    table = io.StringIO()
    cli.run(args, comm=collectives.init("local"), out=table)
    assert [r["wrong"] for r in parse_table(table.getvalue())] == [0, 0]


@pytest.mark.parametrize("op", OPS)
def test_ours_and_raw_are_timed_on_the_same_buffers(op: str) -> None:
    """The placement of two sets of buffers alone moves a raw call (MPI, from 256 KiB, by up to
    15%): the timed call through collectives and the raw call take the same x and out."""
    from collectives.bench.cases import Arrays, Case

    comm = collectives.init("local")
    case = Case(op, 4096, comm, Arrays("numpy", "float32", "cpu"), "sum", 0)
    assert case.x_raw is case.x_ours and case.out_raw is case.out_ours
    comm.close()


def test_a_reduce_op_the_dtype_does_not_allow_is_refused_naming_the_allowed_ones() -> None:
    with pytest.raises(SystemExit):
        cli.parse_args(["all_reduce", "-d", "float32", "-o", "bxor"])
    done = subprocess.run([str(BIN / "collectives-bench"), "all_reduce", "-o", "bxor"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert "-o bxor is not allowed on -d float32; allowed: sum, prod, min, max, avg" in done.stderr


def test_importing_the_bench_imports_no_transport() -> None:
    code = ("import sys, collectives.bench; "
            "print([m for m in ('torch', 'mpi4py', 'cupy') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stderr


def test_plot_draws_a_grid_that_can_be_read(tmp_path: Path) -> None:
    """Every collective of docs/bench's two runs (11 of them, with raw timings): four to a row,
    a busbw panel over a ratio panel, not one row of 11 panels."""
    pytest.importorskip("matplotlib")
    root = Path(__file__).resolve().parents[2]
    docs = [json.loads((root / "docs" / "bench" / name).read_text()) for name in ("mpi.json", "torch-gloo.json")]
    out = tmp_path / "plot.png"
    cli.plot(docs, str(out))
    width, height = int.from_bytes(out.read_bytes()[16:20], "big"), int.from_bytes(out.read_bytes()[20:24], "big")
    assert cli.plot_grid(11, True) == (6, 4) and cli.plot_grid(3, False) == (1, 3)
    assert width <= 2000 and 0.5 < width / height < 1.5, (width, height)
