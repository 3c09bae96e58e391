"""Every example in examples/ runs with the command written at its top (``# run: ...``), so
that none can rot: the command itself is what is tested, on CPU, with the project's launchers.
Each example checks its own result (an assert against numpy or one process) and exits non-zero
when it is wrong."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def command(path: Path) -> str:
    match = re.match(r"# run: (.+)\n", path.read_text())
    assert match, f"{path.name} does not start with '# run: <the command that runs it>'"
    return match.group(1)


def test_every_example_the_readme_promises_is_there() -> None:
    names = {p.stem for p in EXAMPLES}
    assert names >= {"hello_all_reduce", "syncbn_training", "pipeline_send_recv", "moe_all_to_all",
                     "test_global_argmax"}
    for path in EXAMPLES:
        assert f"examples/{path.name}" in command(path)


def run(line: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # python, mpiexec, torchrun
    done = subprocess.run(["bash", "-c", line], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=220, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip(), "an example says what it did"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_example_runs_with_the_command_at_its_top(path: Path) -> None:
    run(command(path))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["hello_all_reduce", "pipeline_send_recv"])
def test_the_example_runs_on_the_torch_backend_under_torchrun(name: str) -> None:
    """"Replace mpiexec -n N python with torchrun --nproc_per_node N", as the README says."""
    from collectives.testing.launch import free_port

    port = free_port()
    line, n = re.subn(r"^mpiexec -n (\d+) python ", rf"torchrun --nproc_per_node \1 --master_port {port} ",
                      command(ROOT / "examples" / f"{name}.py"))
    assert n == 1
    run(line)
