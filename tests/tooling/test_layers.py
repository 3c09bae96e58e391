"""The layers of the package: the interface (collectives/) never imports a backend, SyncBN uses
only the interface's public names, and the import graph (every import, TYPE_CHECKING and
function-level ones included) has no cycle beyond the ones still listed here to be undone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import collectives

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (("collectives", "collectives"), ("backends", "collectives.backends"),
            ("syncbn", "collectives.syncbn"))
# Modules of collectives/ that are tools over the backends, not the interface: the environment
# report (collectives-info) and the torch.distributed backend's rendezvous.
TOOLS = ("collectives.info", "collectives.c10d", "collectives.testing", "collectives.bench")
# Cycles still there (each a strongly connected set of modules); the list may only shrink.
KNOWN_CYCLES: list[set[str]] = []


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules ``name`` imports (of ``known``; ``from pkg import mod`` names ``mod``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{alias.name}" for alias in node.names} & known.keys()
            found |= submodules or {target}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return (found & known.keys()) - {name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected sets of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(group)

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_interface_never_imports_a_backend():
    for name, targets in graph().items():
        outside = ("collectives.backends", "collectives.syncbn", *TOOLS)
        if name.startswith("collectives.") and not name.startswith(outside):
            assert not {t for t in targets if t.startswith("collectives.backends")}, name


def test_syncbn_uses_only_the_public_names_of_the_interface():
    for path in (ROOT / "syncbn").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("collectives"):
                assert node.module == "collectives", f"{path.name}:{node.lineno} imports {node.module}"
                assert {alias.name for alias in node.names} <= set(collectives.__all__), path.name


def test_no_import_cycle_but_the_known_ones():
    found = cycles(graph())
    new = [group for group in found if not any(group <= known for known in KNOWN_CYCLES)]
    assert not new, f"import cycles: {new}"


def test_every_module_is_small_and_says_what_it_holds():
    """A module of the library is at most 600 lines (past that it wants splitting along a seam)
    and opens with a docstring that says what it holds."""
    for name, path in modules().items():
        text = path.read_text()
        assert len(text.splitlines()) <= 600, f"{name}: {len(text.splitlines())} lines"
        assert ast.get_docstring(ast.parse(text)), f"{name} has no module docstring"


def test_each_backends_channel_is_below_its_collectives():
    """The MPI, torch and cupy backends each split into a channel (the communicator, its
    buffers, completion, farewells) and the module of its collectives above it: the channel
    never imports the collectives' module, and the collectives' transport derives from it."""
    edges = graph()
    for channel, above in (("mpi_channel", "mpi"), ("torch_group", "torch_dist"),
                           ("cupy_channel", "cupy_nccl")):
        assert f"collectives.backends.{above}" not in edges[f"collectives.backends.{channel}"], channel
        assert f"collectives.backends.{channel}" in edges[f"collectives.backends.{above}"], above
    from collectives.backends import cupy_channel, cupy_nccl, mpi, mpi_channel, torch_dist, torch_group

    assert issubclass(mpi.MPITransport, mpi_channel.MPIChannel)
    assert issubclass(torch_dist.TorchTransport, torch_group.TorchGroup)
    assert issubclass(cupy_nccl.CupyNcclTransport, cupy_channel.CupyNcclChannel)


def test_the_diagnostics_old_module_names_are_the_moved_modules():
    """``collectives.recorder``, ``trace`` and ``process_hooks`` (public names) moved into
    ``collectives.diagnostics``; code that imported the old names gets the same module objects
    (so a monkeypatch or a flag set through either name is seen by both)."""
    import importlib  # noqa: PLC0415

    for name in ("recorder", "trace", "process_hooks"):
        old = importlib.import_module(f"collectives.{name}")
        assert old is importlib.import_module(f"collectives.diagnostics.{name}"), name


def test_every_package_of_the_checkout_is_installed():
    """pyproject.toml lists the packages a wheel holds: a folder with an ``__init__.py`` that is
    not listed is missing from every install but the editable one (where the tests run)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert found == listed, f"unlisted: {sorted(found - listed)}; listed, not found: {sorted(listed - found)}"


def test_the_communicator_has_no_base_but_its_public_methods():
    """The Communicator HOLDS its parts (kept handles, argument checks, the context, the same-call
    check, farewells, fault tolerance): none is a base class whose attributes it must set. Its one
    base is callpath.Collectives, the public collectives that hand their arguments to ``_run``
    (compiled with the call path): functions only, no state of its own."""
    from collectives import Communicator  # noqa: PLC0415
    from collectives.callpath import Collectives  # noqa: PLC0415

    assert Communicator.__bases__ == (Collectives,)
    assert Collectives.__bases__ == (object,)
    own = {name for name in vars(Collectives) if not name.startswith("__")}
    assert "__init__" not in vars(Collectives) and "__slots__" not in vars(Collectives)
    assert all(callable(vars(Collectives)[name]) for name in own - {"_METHODS"}), own
