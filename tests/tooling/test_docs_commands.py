"""Every command of a ```console block in README.md and docs/*.md (the lines starting with
``$ ``) runs and exits 0, from the repository's root with the project's venv first on PATH, so
that the commands the guide shows cannot rot. Commands that cannot run on a CPU machine (GPUs,
several hosts, Slurm) are written in ```sh blocks, which are not run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def console_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of every ``$ `` line inside a ```console block."""
    found = []
    for block in re.finditer(r"^```console\n(.*?)^```", text, re.S | re.M):
        first = text.count("\n", 0, block.start(1)) + 1
        for offset, line in enumerate(block.group(1).splitlines()):
            if line.startswith("$ "):
                found.append((first + offset, line[2:]))
    return found


COMMANDS = [(page, number, command) for page in PAGES for number, command in console_commands(page.read_text())]


def test_the_reader_finds_the_commands_of_a_console_block() -> None:
    text = "intro\n```console\n$ echo one\noutput\n$ echo two\n```\n```sh\nnot run\n```\n"
    assert console_commands(text) == [(3, "echo one"), (5, "echo two")]


def test_the_guide_has_commands_to_run() -> None:
    assert len(COMMANDS) >= 5


@pytest.mark.timeout(200)
@pytest.mark.parametrize("page, number, command", COMMANDS,
                         ids=[f"{p.name}:{n}" for p, n, _ in COMMANDS])
def test_the_command_runs(page: Path, number: int, command: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLECTIVES_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, f"{page.name}:{number}: {command}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
