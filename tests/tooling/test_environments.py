"""The environments' test bed (scripts/environments.py, scripts/slurm_node.py): its pytest count
reader, its -k composition, and a one-node Slurm that leaves nothing running when stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import environments  # noqa: E402
import slurm_node  # noqa: E402


def test_counts_reads_pytests_closing_line():
    output = "....F\n=== short test summary ===\nFAILED x\n3 passed, 1 failed, 2 skipped, 7 deselected in 4.20s\n"
    assert environments.counts(output) == {"passed": 3, "failed": 1, "skipped": 2, "deselected": 7}
    assert environments.counts("1 error in 0.1s") == {"error": 1}
    assert environments.counts("nothing") == {}


def test_a_k_given_is_anded_with_the_environments_selection():
    assert environments.with_selection(["-x"], "not torch-1") == ["-x", "-k", "not torch-1"]
    assert environments.with_selection(["-k", "ddp", "-x"], "not torch-1") == ["-x", "-k", "(not torch-1) and (ddp)"]


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(os.geteuid() != 0 or bool(slurm_node.missing_tools()),
                    reason="needs root and Slurm (scripts/environments.py setup installs it)")
@pytest.mark.timeout(180)
def test_a_slurm_node_runs_a_step_and_leaves_nothing_running(tmp_path):
    node = slurm_node.SlurmNode(tmp_path / "slurm")
    node.start()
    try:
        env = {**os.environ, **node.env}
        done = subprocess.run(["srun", "-n", "2", "hostname"], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and len(done.stdout.split()) == 2, done.stdout + done.stderr
        # A step still running when the node stops: its tasks go with it.
        step = subprocess.Popen(["srun", "-n", "1", "sleep", "300"], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not node.leftovers() and time.monotonic() < deadline:
            time.sleep(0.1)
        steps = node.leftovers()
        assert steps, "the step never started"
        daemons = [process.pid for _, process in node._daemons]
    finally:
        node.stop()
    step.wait(timeout=60)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in [*daemons, *steps]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in [*daemons, *steps] if _alive(pid)]
