"""scripts/gpu_check.sh cannot say PASS when something failed: each way it once could is rehearsed
on CPU, with this venv's python (the project installed from this checkout), in seconds.

- a smoke test that hangs, stopped by the smoke's own limit (pytest writes no junit entry for it);
- a GPU that nvidia-smi lists (a stand-in nvidia-smi on PATH) or GPU_CHECK_REQUIRE_CUDA=1, while
  torch sees no CUDA device: no dry run, a failure;
- the check stopped from outside (SIGTERM, as a machine's command limit does): "Result: INCOMPLETE"
  and nothing of it left running;
- the smoke runs twice, the second time on the Python forms (COLLECTIVES_COMPILED=0), and the
  pre-flight says which forms loaded.
The phases run against tests/gpu/fake_gpu_phases.py (GPU_CHECK_TESTS, GPU_CHECK_AS_IF_CUDA=1).
"""

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "gpu_check.sh"
FAKE = "tests/gpu/fake_gpu_phases.py"


def _environment(out, **extra):
    token = uuid.uuid4().hex
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "FAKE_GPU_TOKEN": token, **extra}
    env.pop("GPU_CHECK_NCCL", None)
    return env, token


def _left_running(token):
    """Processes whose environment holds FAKE_GPU_TOKEN=token."""
    mark = f"FAKE_GPU_TOKEN={token}".encode()
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if mark in environ.read().split(b"\0"):
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def _run(out, **extra):
    env, token = _environment(out, **extra)
    done = subprocess.run(["bash", str(CHECK)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    report = (out / "gpu_report.md").read_text()
    return done, report, token


def _result(report):
    return re.findall(r"^Result: .*$", report, re.MULTILINE)


@pytest.mark.timeout(320)
def test_a_smoke_test_that_hangs_fails_the_check(tmp_path):
    done, report, token = _run(tmp_path, GPU_CHECK_AS_IF_CUDA="1", GPU_CHECK_TESTS=FAKE, FAKE_GPU_CASE="smoke-hang",
                               GPU_CHECK_SMOKE_SECONDS="8")
    assert done.returncode == 1, report
    (result,) = _result(report)
    assert result.startswith("Result: FAIL (smoke (1 rank of each backend): stopped at its 8 s limit"), result
    # pytest's junit entry of the test a Ctrl-C stopped has no name: an error, not a pass
    assert "- smoke (1 rank of each backend): 1 error" in report
    assert not _left_running(token)


@pytest.mark.timeout(320)
@pytest.mark.parametrize("how", ["nvidia-smi lists a GPU", "GPU_CHECK_REQUIRE_CUDA=1"])
def test_no_cuda_where_a_gpu_is_expected_fails_instead_of_a_dry_run(tmp_path, how):
    extra = {"GPU_CHECK_REQUIRE_CUDA": "1"}
    if how == "nvidia-smi lists a GPU":  # a stand-in for the driver's tool: one H100 listed
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3, 81559 MiB'\n")
        smi.chmod(0o755)
        extra = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = tmp_path / "out"
    done, report, _ = _run(out, **extra)
    assert done.returncode == 1, report
    (result,) = _result(report)
    why = "nvidia-smi lists 1 GPU(s)" if how == "nvidia-smi lists a GPU" else "GPU_CHECK_REQUIRE_CUDA=1"
    assert result.startswith(f"Result: FAIL (CUDA unavailable: {why})"), result
    assert "DRY RUN" not in report


@pytest.mark.timeout(320)
def test_the_check_stopped_from_outside_reports_incomplete_and_leaves_nothing_running(tmp_path):
    record = tmp_path / "record.txt"
    out = tmp_path / "out"
    env, token = _environment(out, GPU_CHECK_AS_IF_CUDA="1", GPU_CHECK_TESTS=FAKE, FAKE_GPU_CASE="smoke-hang",
                              FAKE_GPU_RECORD=str(record))
    check = subprocess.Popen(["bash", str(CHECK)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not record.exists():  # the smoke's test has started (it hangs, with no limit but 100 s)
            assert check.poll() is None and time.monotonic() < deadline, "the smoke did not start"
            time.sleep(0.2)
        check.send_signal(signal.SIGTERM)
        assert check.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if check.poll() is None:
            check.kill()
    report = (out / "gpu_report.md").read_text()
    (result,) = _result(report)
    assert result.startswith("Result: INCOMPLETE (stopped by SIGTERM during the smoke phase"), result
    assert not _left_running(token)


@pytest.mark.timeout(320)
def test_the_smoke_runs_again_on_the_python_forms_and_the_preflight_names_the_forms(tmp_path):
    record = tmp_path / "record.txt"
    out = tmp_path / "out"
    done, report, _ = _run(out, GPU_CHECK_AS_IF_CUDA="1", GPU_CHECK_TESTS=FAKE, FAKE_GPU_RECORD=str(record),
                           FAKE_GPU_SHOW="COLLECTIVES_COMPILED")
    assert done.returncode == 0, report
    assert _result(report)[0].startswith("Result: PASS (rehearsal, nothing checked on a GPU)")
    assert record.read_text().splitlines() == [
        "smoke COLLECTIVES_COMPILED=", "full torch-nccl-1 COLLECTIVES_COMPILED=",
        "full torch-nccl-2 COLLECTIVES_COMPILED=", "smoke COLLECTIVES_COMPILED=0"]
    assert re.search(r"^- compiled modules: collectives\._callpath_c \(call path\): (compiled|Python \(.*\)); "
                     r"collectives\.backends\._round_c \(MPI round\): ", report, re.MULTILINE), report
    assert "- smoke with COLLECTIVES_COMPILED=0 (the Python forms): 1 passed" in report
