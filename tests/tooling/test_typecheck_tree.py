"""`make typecheck` sees the package as installed: scripts/typecheck.py's link tree puts
backends/ and syncbn/ inside collectives, as pyproject.toml's package-dir installs them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import collectives

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("typecheck", ROOT / "scripts" / "typecheck.py")
assert _spec is not None and _spec.loader is not None
typecheck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(typecheck)


def test_the_tree_holds_every_installed_module_at_its_installed_name(tmp_path: Path) -> None:
    typecheck.build_tree(tmp_path)
    linked = {path.relative_to(tmp_path).as_posix(): path.resolve()
              for path in tmp_path.rglob("*") if path.is_symlink()}
    # What the installed package holds (the editable install maps the same package-dir).
    installed = {}
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    for package in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations is not None
        folder = Path(next(iter(spec.submodule_search_locations)))
        for file in folder.iterdir():
            if file.suffix in (".py", ".pyi") or file.name == "py.typed":
                installed[f"{package.replace('.', '/')}/{file.name}"] = file.resolve()
    assert linked == installed
    assert linked["collectives/backends/mpi.py"] == ROOT / "backends" / "mpi.py"
    assert linked["collectives/syncbn/batchnorm.py"] == ROOT / "syncbn" / "batchnorm.py"
    assert linked["collectives/__init__.py"] == Path(collectives.__file__).resolve()


def test_a_package_is_taken_from_its_longest_mapped_prefix() -> None:
    mapping = {"collectives.backends": "backends"}
    assert typecheck.source_dir("collectives.backends", mapping) == ROOT / "backends"
    assert typecheck.source_dir("collectives.backends.sub", mapping) == ROOT / "backends" / "sub"
    assert typecheck.source_dir("collectives.testing", mapping) == ROOT / "collectives" / "testing"
