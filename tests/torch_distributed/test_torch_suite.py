"""A representative slice of torch's own distributed tests against the backend "collectives"
(scripts/torch_suite.py under mpiexec; the whole suite, beside Gloo: make test-torch-suite)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("expecttest")  # torch's test base imports it

ROOT = Path(__file__).resolve().parents[2]
SLICE = ["test_all_reduce_sum", "test_all_reduce_max", "test_broadcast", "test_all_gather_object",
         "test_scatter_object_list", "test_all_to_all_single_equal_split", "test_DistributedDataParallelCPU",
         "test_ddp_create_graph", "test_reduce_scatter_tensor", "test_isend", "test_send_recv_any_source",
         "test_sparse_all_reduce_sum"]


def test_a_slice_of_torchs_distributed_tests_passes(tmp_path):
    out = tmp_path / "suite.json"
    command = [sys.executable, str(ROOT / "scripts" / "torch_suite.py"), "--backend", "collectives", "-n", "3",
               "--hang", "90", "--json", str(out)]
    for name in SLICE:
        command += ["-k", name]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    subprocess.run(command, check=True, timeout=280, env=env, capture_output=True)
    result = json.loads(out.read_text())
    failed = {name: r["detail"] for name, r in result["results"].items() if r["outcome"] == "failed"}
    assert not failed, failed
    assert result["counts"]["passed"] >= 15, result["counts"]
