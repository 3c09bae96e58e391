"""scripts/gpu_check.sh rehearsed on CPU in the device image's conditions (scripts/gpu_rehearsal.sh):
a fresh venv without the project, holding the image's packages (CuPy 14.2 with NCCL 2.28.9, mpi4py
without an MPI library; torch: the suite's 2.13.0 CPU build here, the image's 2.11.0 under `make
rehearse-gpu-image`), the checkout copied as the device tool sends it with the carried wheels, no
index. The check must install MPICH and the checkout from the carried wheels, pass the pre-flight,
reach "no CUDA device" and report every GPU test skipped, in under 2 minutes.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: gpu_check.sh would run for real")
@pytest.mark.timeout(900)
def test_gpu_check_rehearsal_reaches_no_cuda_and_reports_every_skip(tmp_path):
    # The base interpreter of this venv: the rehearsal's venv must not see this one's packages.
    python = getattr(sys, "_base_executable", sys.executable)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_rehearsal.sh")], cwd=ROOT,
                          env={**os.environ, "OUT": str(tmp_path), "PYTHON": python},
                          capture_output=True, text=True, timeout=880)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    report = (tmp_path / "gpu_report.md").read_text()
    for line in ("- MPI: the carried mpich-", "- collectives: installed into the python: pip install --no-index",
                 "- CuPy: 14.2.0; NCCL 2.28.9", "no CUDA device", "DRY RUN",
                 "(the MPI timing's launcher: /", "Result: PASS (dry run, nothing checked on a GPU)"):
        assert line in report, line
    assert re.search(r"^\d+ skipped$", report, re.MULTILINE), report
    assert "test_smoke_one_rank[cupy-1]" in report  # the skips are listed, by reason
    seconds = int(re.search(r"gpu_check.sh exit 0 in (\d+) s", done.stdout).group(1))
    assert seconds < 120, seconds
    for name in ("gpu_check.log", "gpu_junit.xml"):
        assert (tmp_path / name).exists(), name
    print(done.stdout.splitlines()[-2])  # the rehearsal's times (-s shows them)
