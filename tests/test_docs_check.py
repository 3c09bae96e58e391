"""The API reference's completeness check (docs/_ext/public_names.py) finds what is missing.

`make docs` runs it over the real reference; here it runs on a small module made for the
test, so that a check that could never fail would show.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("sphinx")

_PATH = Path(__file__).resolve().parents[1] / "docs" / "_ext" / "public_names.py"
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
