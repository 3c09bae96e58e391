"""collectives.testing's pytest plugin is opt-in: it must not change another project's test
run in the same environment (no Hypothesis profile of ours, no ``world`` fixture), and it
works when a project asks for it (``pytest_plugins`` in conftest.py, or ``-p``).

Each case is a real pytest run in a subprocess, in a temporary project of its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent("""
    from hypothesis import settings

    def test_probe(request):
        current = settings()
        print("PROFILE", settings.get_current_profile_name(), current.max_examples,
              current.derandomize, current.deadline)
        print("WORLD", "world" in request.fixturenames or
              request._fixturemanager.getfixturedefs("world", request.node) is not None)
""")


def _run(tmp_path: Path, conftest: str | None, *options: str) -> dict[str, str]:
    (tmp_path / "test_probe.py").write_text(PROBE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # its own rootdir, not ours
    if conftest is not None:
        (tmp_path / "conftest.py").write_text(conftest)
    # CI is dropped too: Hypothesis itself loads a built-in "ci" profile when CI is set.
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("COLLECTIVES_", "PYTEST_", "HYPOTHESIS")) and name != "CI"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                             *options, "test_probe.py"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    text = result.stdout + result.stderr
    assert result.returncode == 0, text
    return {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines()
            if line.startswith(("PROFILE ", "WORLD "))}


@pytest.mark.timeout(150)
def test_another_projects_run_is_not_affected(tmp_path):
    seen = _run(tmp_path, "def pytest_configure(config):\n    pass\n")
    assert seen["PROFILE"] == "default 100 False 0:00:00.200000", seen  # Hypothesis's defaults
    assert seen["WORLD"] == "False", seen


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["conftest", "-p"])
def test_a_project_that_opts_in_gets_the_profile_and_the_fixture(tmp_path, how):
    if how == "conftest":
        seen = _run(tmp_path, 'pytest_plugins = ["collectives.testing.plugin"]\n')
    else:
        seen = _run(tmp_path, None, "-p", "collectives.testing.plugin")
    assert seen["PROFILE"] == "ci 50 True None", seen
    assert seen["WORLD"] == "True", seen


def test_the_package_registers_no_pytest_entry_point():
    from importlib.metadata import entry_points

    ours = [ep for ep in entry_points(group="pytest11") if ep.value.startswith("collectives")]
    assert not ours, f"{ours}: the plugin must be opt-in (see collectives/testing/plugin.py)"
    assert "pytest11" not in (ROOT / "pyproject.toml").read_text()
