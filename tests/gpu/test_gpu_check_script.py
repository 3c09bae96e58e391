"""scripts/gpu_check.sh on a machine without CUDA: a dry run that says what it skipped, exit 0."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: gpu_check.sh would run for real")
@pytest.mark.timeout(300)
def test_dry_run_without_cuda_reports_every_skip_and_passes(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable,
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "gpu_report.md").read_text()
    assert "DRY RUN: no CUDA device here" in report
    assert "cupy   unavailable" in report or "cupy   usable" in report
    assert "SKIPPED" in report and "no CUDA device" in report
    assert "Result: PASS (dry run, nothing checked on a GPU)" in report
    assert (tmp_path / "gpu_junit.xml").exists()
