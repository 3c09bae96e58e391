"""The wheel a machine without a C compiler builds (setup.py): tagged pure, py3-none-any, so
pip's cache cannot hold it under this interpreter's compiled tag; and no wheel installs the
extensions' C sources. Built from a copy of the checkout's sources (no build/ left from the
test set-up's compiled build), with CC=false: every extension fails to compile, as without gcc."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: What the build reads: the packages' folders and the project's files.
SOURCES = ["collectives", "backends", "syncbn", "pyproject.toml", "setup.py", "README.md", "LICENSE"]


def test_a_wheel_built_without_a_c_compiler_is_pure_and_installs_no_c_source(tmp_path):
    source = tmp_path / "source"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, source / name)
    env_cc = {"CC": "false", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "wheels"), "--quiet"], env=env_cc, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [wheel] = (tmp_path / "wheels").glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.endswith((".c", ".h", ".so"))] == []
    assert "collectives/backends/mpi_carried.py" in names  # (in purelib, the wheel's root)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "Root-Is-Purelib: true" in metadata
