"""scripts/bench/train.py in its smallest mode (2 MPI ranks, 3 steps), so that it cannot rot.

Times are not asserted (speed is the benchmark's business); what is: the three
variants ran, the JSON holds every timed step, our DataParallel with plain
BatchNorm trained to the same parameters as torch's DistributedDataParallel (the
independent reference: the same math), and SyncBatchNorm trained to different ones.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from test_train import ROOT, _free_port, _launch, _tool

BENCH = ROOT / "scripts" / "bench" / "train.py"
SMALL = ["--steps", "3", "--warmup", "1", "--widths", "4,4,8,8,8,8"]


def load_bench():
    spec = importlib.util.spec_from_file_location("collectives_bench_train_script", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_three_variants_under_mpiexec_and_dataparallel_equals_ddp(tmp_path):
    out = tmp_path / "train.json"
    done = _launch([_tool("mpiexec"), "-n", "2", sys.executable, str(BENCH), *SMALL, "--json", str(out)],
                   tmp_path, "mpi")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ratio a/c = " in done.stdout and "ratio b/c = " in done.stdout
    assert "load average" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["meta"]["backend"] == "mpi" and doc["meta"]["ranks"] == 2
    assert sorted(doc["variants"]) == ["a", "b", "c"]
    for result in doc["variants"].values():
        assert len(result["steps_ms"]) == 3 and min(result["steps_ms"]) > 0
        assert result["p10_ms"] <= result["median_ms"] <= result["p90_ms"]
    diffs = doc["max_param_diff"]
    assert diffs["b-c"] <= 1e-6, "our DataParallel must train exactly as torch DDP does"
    assert diffs["a-c"] > 1e-4, "SyncBatchNorm must differ from per-rank BatchNorm"


def test_plot_only_draws_the_json(tmp_path):
    pytest.importorskip("matplotlib")
    bench = load_bench()
    doc = {"meta": {"backend": "mpi", "ranks": 2, "batch": 32, "loadavg_start": [1.0, 1.0, 1.0],
                    "loadavg_end": [2.0, 1.0, 1.0]},
           "variants": {name: {"label": label, "median_ms": 10.0 + k, "p10_ms": 9.0, "p90_ms": 13.0}
                        for k, (name, label) in enumerate(bench.VARIANTS.items())},
           "ratios": {"a/c": 0.83, "b/c": 0.92}}
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    assert bench.main(["--plot-only", str(path), str(path), "--plot", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_torchrun_with_ddp_on_its_own_gloo_group(tmp_path):
    out = tmp_path / "train.json"
    done = _launch([_tool("torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                    "--master_port", _free_port(), str(BENCH), *SMALL, "--variants", "bc",
                    "--json", str(out)], tmp_path, "torch")
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert doc["meta"]["backend"] == "torch" and sorted(doc["variants"]) == ["b", "c"]
    assert doc["max_param_diff"]["b-c"] <= 1e-6
