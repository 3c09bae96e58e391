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
def test_a_backend_is_a_transport_held_by_a_thin_communicator(name):
    """The public class holds its backend's Transport: it adds a constructor and read-only
    views of the transport, and overrides nothing else of the Communicator; the transport
    implements the whole protocol and is no Communicator (composition, not inheritance)."""
    cls = backend_class(name)
    transport = cls.transport_class
    assert transport is not None and issubclass(transport, Transport)
    assert not issubclass(transport, Communicator)
    assert not inspect.isabstract(transport), f"{transport.__name__} leaves abstract methods"
    allowed = {"__init__", "__doc__", "__module__", "__annotations__", "transport_class"}
    overridden = {attr for attr in vars(cls) if attr in vars(Communicator)} - allowed
    assert not overridden, f"{cls.__name__} overrides the framework's {sorted(overridden)}"
    for attr, value in vars(cls).items():
        if not attr.startswith("_") and attr != "transport_class":
            assert isinstance(value, property) and value.fset is None, f"{cls.__name__}.{attr}"


def test_from_launcher_and_its_timeout_are_in_the_contract():
    assert "from_launcher" in Transport.__abstractmethods__
    assert "timeout" in inspect.signature(Transport.from_launcher).parameters
    for name in registry.BACKENDS:
        transport = backend_class(name).transport_class
        assert transport is not None
        assert "timeout" in inspect.signature(transport.from_launcher).parameters


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
