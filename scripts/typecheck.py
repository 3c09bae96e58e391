"""mypy over the package as it is installed: ``collectives`` with ``collectives.backends``
and ``collectives.syncbn`` inside it.

The checkout keeps ``backends/`` and ``syncbn/`` at the top and pyproject.toml's
``[tool.setuptools] package-dir`` installs them inside ``collectives``. The editable
install does that mapping with an import hook that mypy cannot follow, so this script
builds the installed layout as a tree of links to the checkout's files under
``build/typecheck/`` (from ``packages`` and ``package-dir``, so a new module or package
needs no change here), runs ``mypy -p collectives`` on it (settings: ``[tool.mypy]`` in
pyproject.toml) and prints mypy's file names as the checkout's paths, so that an error
in ``collectives/backends/mpi.py`` reads ``backends/mpi.py``.

    python scripts/typecheck.py [mypy options]      # what `make typecheck` runs
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mypy depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
TOP = "collectives"


def source_dir(package: str, package_dir: dict[str, str]) -> Path:
    """Where setuptools takes ``package`` from: the longest mapped prefix, else the root."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        prefix = ".".join(parts[:cut])
        if prefix in package_dir:
            return ROOT / package_dir[prefix] / Path(*parts[cut:])
    return ROOT / package_dir.get("", ".") / Path(*parts)


def build_tree(tree: Path = TREE) -> None:
    """The installed layout under ``tree``: a folder per package, a link per module."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = settings.get("package-dir", {})
    shutil.rmtree(tree, ignore_errors=True)
    for package in settings["packages"]:
        source = source_dir(package, package_dir)
        target = tree / Path(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for file in sorted(source.iterdir()):
            if file.is_file() and (file.suffix in (".py", ".pyi") or file.name == "py.typed"):
                (target / file.name).symlink_to(file)


def checkout_path(match: re.Match[str]) -> str:
    path = ROOT / match.group(1)  # mypy's names are relative to ROOT, or absolute
    if path.is_symlink():
        return os.path.relpath(path.resolve(), ROOT)
    return match.group(1)


def main(argv: list[str]) -> int:
    build_tree()
    env = dict(os.environ, MYPYPATH=str(TREE))
    done = subprocess.run([sys.executable, "-m", "mypy", "-p", TOP, *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    for stream, text in ((sys.stdout, done.stdout), (sys.stderr, done.stderr)):
        stream.write(re.sub(r"^([^:\s]+\.pyi?)(?=:)", checkout_path, text, flags=re.MULTILINE))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
