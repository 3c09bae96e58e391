"""Print a pip constraints file that pins every floor pyproject.toml claims.

    python scripts/floors.py [pyproject.toml] > floors.txt
    PIP_CONSTRAINT=floors.txt pip install -e '.[test]'     (what `make test-oldest` does)

pip has no lowest-version resolution, so the floors are turned into pins: each ``name>=v``
of ``[build-system] requires``, ``[project] dependencies`` and every extra becomes
``name==v`` (its environment marker kept). The floors in pyproject.toml are thus the one
source of truth, and each must be a release the index has for that Python, or pip says so.
Requirements with no ``>=`` (exact pins such as ``torch==2.13.0``, the project's own extras)
add nothing, and a floor of a name pinned exactly elsewhere is left out (torch's floor is
tested by ``make test-torch-versions``). A name whose floors disagree between two places is an error: one floor a name.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    raise SystemExit("scripts/floors.py needs Python >= 3.11 (tomllib)") from None

_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_FLOOR = re.compile(r">=\s*([0-9][A-Za-z0-9.+!]*)")


def requirements(pyproject: dict) -> list[str]:
    project = pyproject.get("project", {})
    found = list(pyproject.get("build-system", {}).get("requires", []))
    found += project.get("dependencies", [])
    for extra in project.get("optional-dependencies", {}).values():
        found += extra
    return found


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def exactly_pinned(pyproject: dict) -> set[str]:
    """Normalized names some requirement pins with ``==`` (the test set-up's torch): their
    floor cannot be installed beside the pin, and is tested by a target of its own
    (``make test-torch-versions`` for torch)."""
    found = set()
    for requirement in requirements(pyproject):
        name = _NAME.match(requirement)
        if name is not None and "==" in requirement.split(";")[0]:
            found.add(_key(name.group(1)))
    return found


def floors(pyproject: dict) -> dict[str, str]:
    """``{normalized name: "name==v[; marker]"}`` for every requirement with a ``>=``, but the
    names pinned exactly elsewhere (:func:`exactly_pinned`)."""
    pins: dict[str, str] = {}
    pinned = exactly_pinned(pyproject)
    for requirement in requirements(pyproject):
        spec, _, marker = requirement.partition(";")
        name = _NAME.match(spec)
        floor = _FLOOR.search(spec)
        if name is None or floor is None:
            continue
        key = _key(name.group(1))
        if key in pinned:
            continue
        pin = f"{name.group(1)}=={floor.group(1)}" + (f"; {marker.strip()}" if marker.strip() else "")
        if pins.setdefault(key, pin) != pin:
            raise SystemExit(f"floors.py: two floors for {key}: {pins[key]!r} and {pin!r}")
    return pins


def main(argv: list[str]) -> int:
    path = Path(argv[1] if len(argv) > 1 else Path(__file__).resolve().parent.parent / "pyproject.toml")
    pyproject = tomllib.loads(path.read_text())
    print(f"# the floors of {path.name}, pinned (scripts/floors.py)")
    for pin in floors(pyproject).values():
        print(pin)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
