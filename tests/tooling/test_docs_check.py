"""The API reference's completeness check (docs/_ext/public_names.py) finds what is missing;
the user guide (README.md, docs/*.md) holds no dates, loads, run history, issue numbers or notes
to teammates, and names every environment variable the code reads.

`make docs` runs it over the real reference; here it runs on a small module made for the
test, so that a check that could never fail would show.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("sphinx")

_PATH = Path(__file__).resolve().parents[2] / "docs" / "_ext" / "public_names.py"
_spec = importlib.util.spec_from_file_location("public_names", _PATH)
assert _spec is not None and _spec.loader is not None
public_names = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(public_names)


class Thing:
    """A public class with a public method, a property, and a private method."""

    def run(self) -> None:
        pass

    @property
    def size(self) -> int:
        return 1

    def _hidden(self) -> None:
        pass


def helper() -> None:
    pass


@pytest.fixture
def fake_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fakepkg`` re-exports ``Thing`` and ``helper`` (its ``__all__``) from ``fakepkg.impl``,
    which has no ``__all__`` and a constant of its own."""
    impl = types.ModuleType("fakepkg.impl")
    impl.Thing = Thing  # type: ignore[attr-defined]
    impl.helper = helper  # type: ignore[attr-defined]
    impl.LIMIT = 3  # type: ignore[attr-defined]
    impl._private = 4  # type: ignore[attr-defined]
    impl.sys = sys  # type: ignore[attr-defined]  # an imported module is not a public name
    Thing.__module__ = helper.__module__ = "fakepkg.impl"
    Thing.__qualname__ = "Thing"
    pkg = types.ModuleType("fakepkg")
    pkg.__all__ = ["Thing", "helper"]  # type: ignore[attr-defined]
    pkg.Thing, pkg.helper = Thing, helper  # type: ignore[attr-defined]
    pkg.impl = impl  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fakepkg", pkg)
    monkeypatch.setitem(sys.modules, "fakepkg.impl", impl)


COMPLETE = ["fakepkg.Thing", "fakepkg.Thing.run", "fakepkg.Thing.size", "fakepkg.helper"]


def test_a_complete_reference_misses_nothing(fake_modules: None) -> None:
    assert public_names.missing_names(["fakepkg"], COMPLETE) == []


def test_a_missing_function_is_named(fake_modules: None) -> None:
    documented = [name for name in COMPLETE if name != "fakepkg.helper"]
    assert public_names.missing_names(["fakepkg"], documented) == ["fakepkg.helper"]


def test_a_missing_method_or_property_is_named(fake_modules: None) -> None:
    documented = [name for name in COMPLETE if name not in ("fakepkg.Thing.run", "fakepkg.Thing.size")]
    assert public_names.missing_names(["fakepkg"], documented) == ["fakepkg.Thing.run", "fakepkg.Thing.size"]


def test_a_module_without_all_needs_what_it_defines(fake_modules: None) -> None:
    # Thing and helper are documented under fakepkg (the same objects); LIMIT is not.
    assert public_names.missing_names(["fakepkg.impl"], COMPLETE) == ["fakepkg.impl.LIMIT"]
    assert public_names.missing_names(["fakepkg.impl"], [*COMPLETE, "fakepkg.impl.LIMIT"]) == []


def test_members_are_looked_for_under_the_documented_entry_not_an_alias(fake_modules: None) -> None:
    # Sphinx adds the defining name of a class as an alias of the documented entry.
    documented = [*COMPLETE, "fakepkg.impl.Thing", "fakepkg.impl.LIMIT"]
    assert public_names.missing_names(["fakepkg.impl"], documented, aliases=["fakepkg.impl.Thing"]) == []
    assert public_names.missing_names(["fakepkg"], [n for n in documented if n != "fakepkg.Thing.run"],
                                      aliases=["fakepkg.impl.Thing"]) == ["fakepkg.Thing.run"]


# -- the user guide: README.md and docs/*.md (dated measurements belong in docs/bench/) ----------

ROOT = Path(__file__).resolve().parents[2]
GUIDE = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: What a user guide does not say: when something was measured or changed, how loaded the machine
#: was, what was true before, which issue asked for it, what one teammate should do next, or a
#: Makefile's variable in a command a user would paste.
NOT_FOR_USERS = {
    "a date": r"\b(19|20)\d\d-[01]\d-[0-3]\d\b",
    "a clock time": r"\b[0-2]?\d:[0-5]\d(:[0-5]\d)? ?UTC\b",
    "a machine load": r"\bload average\b|\bload (of |about |~)?\d",
    "run history": r"\bfixed since\b|\(before\)|\bbefore the [a-z`]+ merge\b|\bno session so far\b",
    "an issue number": r"\bissues? #?\d+\b",
    "a note to a teammate": r"\bteammate\b|\(for the [a-z ]+ owner\)|\bthe [a-z]+ owner's\b",
    "a Makefile variable": r"\$\((VENV|PY|PYTHON|STAMP|CURDIR)\)",
}


def findings(text: str) -> list[str]:
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in NOT_FOR_USERS.items():
            match = re.search(pattern, line, re.IGNORECASE)
            if match:
                found.append(f"{number}: {what}: {match.group(0)!r}")
    return found


def test_the_guide_says_nothing_that_is_not_for_users() -> None:
    problems = {path.name: findings(path.read_text()) for path in GUIDE}
    assert {name: found for name, found in problems.items() if found} == {}


@pytest.mark.parametrize("line", [
    "measured 2026-12-03 on a quiet machine", "at 16:46 UTC", "load average 5-8.6", "(load 14-15)",
    "5 failed, fixed since", "| mpi, 4 ranks (before) |", "asked by issue 12", "(issue #14)",
    "Suggestion (for the reliability owner)", "COLLECTIVES_BACKEND=mpi $(VENV)/bin/mpiexec -n 4 $(PY) train.py"])
def test_each_rule_catches_what_it_is_for(line: str) -> None:
    assert findings(line)


@pytest.mark.parametrize("line", [
    "`CollectiveTimeout`: all_reduce (call #2) did not complete", "cupy/cupy#8354",
    "busbw = algbw x 2(n-1)/n", "the default is 1800 s", "MPI_THREAD_MULTIPLE (see the table)",
    "export LD_PRELOAD=$(python -c 'import nvidia.nccl')"])
def test_the_rules_leave_what_users_need(line: str) -> None:
    assert findings(line) == []


def test_every_environment_variable_the_code_reads_is_in_the_readme() -> None:
    code = "\n".join(p.read_text() for folder in ("collectives", "backends", "syncbn")
                     for p in sorted((ROOT / folder).rglob("*.py")))
    names = set(re.findall(r"\bCOLLECTIVES_[A-Z0-9_]+\b", code))
    assert len(names) >= 10  # the search itself finds them
    readme = (ROOT / "README.md").read_text()
    assert sorted(name for name in names if f"`{name}`" not in readme) == []
