"""Stand-ins for tests/gpu/test_gpu.py in the CPU rehearsals of scripts/gpu_check.sh's verdicts
(tests/gpu/test_gpu_check_verdicts.py runs the check with GPU_CHECK_TESTS pointing here and
GPU_CHECK_AS_IF_CUDA=1). FAKE_GPU_CASE says how the phases go: "smoke-hang" (the smoke's test
never returns, and no per-test limit stops it: only the phase's own limit, or a signal to the
check, does), anything else passes. Each test appends a line to the file FAKE_GPU_RECORD, where
set: its name, the variables FAKE_GPU_SHOW names, and the first bytes of the file FAKE_GPU_LIBRARY.
Not collected by the suite (no test_ prefix).
"""

import os
import threading

import pytest

pytestmark = pytest.mark.gpu
CASE = os.environ.get("FAKE_GPU_CASE", "")


def _record(name):
    if os.environ.get("FAKE_GPU_RECORD"):
        names = os.environ.get("FAKE_GPU_SHOW", "").split()
        seen = [f"{variable}={os.environ.get(variable, '')}" for variable in names]
        if os.environ.get("FAKE_GPU_LIBRARY"):  # the first bytes of a file, as the tests see it
            with open(os.environ["FAKE_GPU_LIBRARY"], "rb") as library:
                seen.append(f"library={library.read(16).decode(errors='replace')}")
        with open(os.environ["FAKE_GPU_RECORD"], "a") as record:
            record.write(" ".join([name, *seen]) + "\n")


@pytest.mark.timeout(0)  # (a hang that pytest-timeout does not catch: the phase's limit must)
def test_smoke_one_rank():
    _record("smoke")
    if CASE == "smoke-hang":
        threading.Event().wait()


@pytest.mark.parametrize("world", ["torch-nccl-1", "torch-nccl-2"])
def test_every_op(world):
    _record(f"full {world}")
