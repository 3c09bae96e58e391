"""scripts/floors.py: the constraints file of `make test-oldest` pins every floor of pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="scripts/floors.py needs Python >= 3.11 (tomllib)")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import floors  # noqa: E402

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_floor_of_pyproject_becomes_a_pin():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "floors.py")], capture_output=True,
                         text=True, check=True).stdout
    pins = [line for line in out.splitlines() if not line.startswith("#")]
    specs = [r.split(";")[0].replace(" ", "") for r in floors.requirements(PYPROJECT)]
    pinned = floors.exactly_pinned(PYPROJECT)
    spelled = [spec for spec in specs if ">=" in spec]  # not a marker's python_version >= ...
    assert spelled, "pyproject.toml claims no floors?"
    for requirement in spelled:
        if floors._key(requirement.split(">=")[0]) in pinned:  # torch: make test-torch-versions
            assert not any(pin.startswith(requirement.split(">=")[0] + "==") for pin in pins)
            continue
        name, floor = requirement.split(">=")
        assert f"{name}=={floor.split(',')[0]}" in pins, (requirement, pins)
    assert len(pins) == len({pin.split("==")[0] for pin in pins})


def test_markers_are_kept_and_exact_pins_add_nothing():
    pyproject = {"project": {
        "dependencies": ["numpy>=1.23.2; python_version < '3.13'", "torch==2.13.0"],
        "optional-dependencies": {"x": ["pkg[extra]", "Some_Name >= 2.0, <3"]},
    }}
    assert list(floors.floors(pyproject).values()) == [
        "numpy==1.23.2; python_version < '3.13'", "Some_Name==2.0"]
    pyproject["project"]["optional-dependencies"]["torch"] = ["torch>=2.9"]  # pinned: left out
    assert "torch" not in floors.floors(pyproject)


def test_two_floors_for_one_name_are_an_error():
    pyproject = {"build-system": {"requires": ["setuptools>=77"]},
                 "project": {"optional-dependencies": {"test": ["setuptools>=80"]}}}
    with pytest.raises(SystemExit, match="two floors for setuptools"):
        floors.floors(pyproject)



def test_the_torch_backends_floor_is_pyprojects():
    from collectives.backends import torch_bootstrap  # noqa: PLC0415

    (floor,) = [r for r in floors.requirements(PYPROJECT) if r.replace(" ", "").startswith("torch>=")]
    assert floor.replace(" ", "") == "torch>=" + ".".join(map(str, torch_bootstrap.TORCH_FLOOR))
    assert torch_bootstrap._release("2.13.0+cpu") == (2, 13)
    assert torch_bootstrap._release("2.8.0+cu128") < torch_bootstrap.TORCH_FLOOR <= torch_bootstrap._release("2.9.1")
    assert torch_bootstrap._release("2.10.0a0+git") == (2, 10)
