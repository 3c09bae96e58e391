"""The wheels setup.py builds: where no extension compiles (no C compiler), a pure one,
py3-none-any, so pip's cache cannot hold it under this interpreter's compiled tag; where they
compile, one tagged for this interpreter and platform that, installed into a fresh venv, runs the
compiled forms (collectives-info says so). No wheel installs the extensions' C sources.

Built from a copy of the checkout's sources (no build/ left from the test set-up's compiled
build). Without a C compiler is CC=false: every extension fails to compile, as without gcc.
`make wheels` (scripts/wheels.py) builds the manylinux wheels the index takes, and checks each
the same way in a fresh venv of its own Python."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: What the build reads: the packages' folders and the project's files.
SOURCES = ["collectives", "backends", "syncbn", "pyproject.toml", "setup.py", "README.md", "LICENSE"]


def build_wheel(tmp_path: Path, env: dict[str, str]) -> Path:
    """The wheel pip builds from a copy of the sources, in ``env``."""
    source = tmp_path / "source"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                           "-w", str(tmp_path / "wheels"), "--quiet"], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [wheel] = (tmp_path / "wheels").glob("*.whl")
    return wheel


def test_a_wheel_built_without_a_c_compiler_is_pure_and_installs_no_c_source(tmp_path):
    wheel = build_wheel(tmp_path, {"CC": "false", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"})
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.endswith((".c", ".h", ".so"))] == []
    assert "collectives/backends/mpi_carried.py" in names  # (in purelib, the wheel's root)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()
    assert "Root-Is-Purelib: true" in metadata


def fresh_venv(path: Path) -> Path:
    """A venv at ``path`` without the project, which reaches the test venv's other packages (numpy,
    mpi4py; a .pth line adds its site-packages without running its .pth files, so not its editable
    project) and its MPI libraries (in lib/, where mpi4py looks)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(path)}))
    (site / "zz_test_venv.pth").write_text(sysconfig.get_path("purelib") + "\n")
    for entry in Path(sys.prefix, "lib").iterdir():
        if not entry.name.startswith("python"):
            (path / "lib" / entry.name).symlink_to(entry)
    return path


def test_a_wheel_built_with_a_c_compiler_installs_into_a_fresh_venv_and_runs_compiled(tmp_path):
    wheel = build_wheel(tmp_path, dict(os.environ))
    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    assert wheel.name.endswith(f"-{tag}-{tag}-{sysconfig.get_platform().replace('-', '_')}.whl"), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in names if n.endswith((".c", ".h"))] == []
    assert [n for n in names if n.endswith(".so")], names
    venv = fresh_venv(tmp_path / "venv")
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
                    "--no-index", str(wheel)], check=True, timeout=300)
    where = subprocess.run([python, "-c", "import collectives; print(collectives.__file__)"], cwd=tmp_path,
                           check=True, capture_output=True, text=True, timeout=120).stdout
    assert Path(where.strip()).is_relative_to(venv), where  # (the wheel's, not the checkout's)
    done = subprocess.run([venv / "bin" / "collectives-info", "--json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads(done.stdout)
    assert info["call_path_compiled"], info["call_path_why"]
    mpi = info["backends"]["mpi"]
    assert mpi["usable"], mpi  # (the test venv's mpi4py and MPICH)
    assert mpi["compiled"], mpi["compiled_why"]
