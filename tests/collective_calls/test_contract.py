"""The backend contract: a backend overrides only what collectives.transport.Transport
declares, every backend of the registry implements it whole, and the lists that must agree
come from the one table of calls."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

from collectives import calls, profile, registry, wire
from collectives.bench import cases
from collectives.communicator import Communicator
from collectives.transport import Transport

BACKENDS_DIR = Path(__file__).resolve().parents[2] / "backends"


def backend_class(name: str) -> type[Communicator]:
    module, _, cls = registry.BACKENDS[name].partition(":")
    found: type[Communicator] = getattr(importlib.import_module(module), cls)
    return found


@pytest.mark.parametrize("name", sorted(registry.BACKENDS))
def test_a_backend_overrides_only_the_transport_contract(name):
    cls = backend_class(name)
    assert not inspect.isabstract(cls), f"{cls.__name__} leaves abstract methods"
    framework = {attr for attr in dir(Communicator) if not attr.startswith("__")}
    for klass in cls.__mro__[:cls.__mro__.index(Communicator)]:
        overridden = {attr for attr in vars(klass) if attr in framework} - set(vars(Transport))
        assert not overridden, f"{klass.__name__} overrides the framework's {sorted(overridden)}"


def test_from_launcher_and_its_timeout_are_in_the_contract():
    assert "from_launcher" in Transport.__abstractmethods__
    assert "timeout" in inspect.signature(Transport.from_launcher).parameters
    for name in registry.BACKENDS:
        assert "timeout" in inspect.signature(backend_class(name).from_launcher).parameters


@pytest.mark.parametrize("path", sorted(BACKENDS_DIR.glob("*.py")), ids=lambda p: p.name)
def test_no_backend_swaps_its_class(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                assert not (isinstance(target, ast.Attribute) and target.attr == "__class__"), \
                    f"{path.name}:{node.lineno} assigns __class__"


def test_operation_codes_and_factors_come_from_the_rows():
    codes = {}
    for row in calls.ROWS:
        assert codes.setdefault(row.name, row.code) == row.code, f"{row.name} has two codes"
    assert sorted(codes.values()) == list(range(len(codes))), "codes are 0..n-1, no gaps"
    assert set(wire.OPERATIONS) == set(profile.OPERATIONS) == set(codes)
    assert [wire.OPERATIONS.index(name) for name in codes] == list(codes.values())
    for op in (*calls.OPERATIONS, "all_to_all_v", "send_recv"):
        for n in (2, 3, 8):
            assert profile.bus_factor(op, n) == cases.bus_factor(op, n) == calls.bus_factor(op, n)
    assert {op for op in cases.OPS if op in codes or op == "all_to_all_v"} >= {
        op for op in codes if op not in ("send", "recv", "split")}
