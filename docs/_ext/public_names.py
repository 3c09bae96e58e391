"""Sphinx extension: every public name is in the reference, and references find it.

- ``public_modules`` (conf.py): for each module, every name of its ``__all__`` (else
  every name not starting with "_" that it defines) must be documented, and so must
  every public member that a class among them defines itself. A name counts as
  documented under its own module or, for an object other than a plain number or
  string, under any documented name of the same object (``collectives.ops.ReduceOp``
  is documented as ``collectives.ReduceOp``). A missing one is a warning, so
  ``sphinx-build -W`` fails, with the names.
- A reference to an object by the name of its defining module
  (``collectives.testing.reference.as_array``) resolves to the name it is documented
  under (``collectives.testing.as_array``). Sphinx does this itself for classes only
  (their canonical names; annotations, such as ``collectives.communicator.Work``, rely on it).
"""

from __future__ import annotations
import __future__

import importlib
import inspect
import types
from collections.abc import Iterable, Iterator
from typing import Any

from sphinx.application import Sphinx
from sphinx.util import logging

logger = logging.getLogger(__name__)

_PLAIN = (str, bytes, int, float, bool, type(None))


def lookup(name: str) -> Any:
    """The object a dotted name refers to (a module, then attributes), or None."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                value = getattr(value, part)
        except AttributeError:
            return None
        return value
    return None


def public_names(module: types.ModuleType) -> list[str]:
    """``__all__``, else the names the module defines that do not start with "_"."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    names = []
    for name, value in vars(module).items():
        if name.startswith("_") or isinstance(value, (types.ModuleType, __future__._Feature)):
            continue
        if getattr(value, "__module__", module.__name__) != module.__name__:
            continue  # imported from elsewhere
        names.append(name)
    return names


def class_members(cls: type) -> Iterator[str]:
    """The public members a class defines itself (not those it inherits)."""
    for name in vars(cls):
        if not name.startswith("_"):
            yield name


def missing_names(modules: Iterable[str], documented: Iterable[str],
                  aliases: Iterable[str] = ()) -> list[str]:
    """The public names of ``modules`` (and of their classes) that nothing documents.

    ``aliases``: those of ``documented`` that only point to another entry (Sphinx's
    canonical names): a class's members are looked for under its own entry.
    """
    documented = set(documented)
    primary = documented - set(aliases)
    documented_ids = set()
    for name in documented:
        value = lookup(name)
        if value is not None and not isinstance(value, _PLAIN):
            documented_ids.add(id(value))

    def is_documented(name: str, value: Any) -> bool:
        return name in documented or (not isinstance(value, _PLAIN) and id(value) in documented_ids)

    missing = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name in public_names(module):
            value = getattr(module, name)
            full = f"{module_name}.{name}"
            if not is_documented(full, value):
                missing.append(full)
                continue
            # The members of the project's own classes (not of a third party's it re-exports).
            if inspect.isclass(value) and value.__module__.partition(".")[0] == module_name.partition(".")[0]:
                where = next((d for d in (full, f"{value.__module__}.{value.__qualname__}")
                              if d in primary), None)
                if where is None:  # documented under another name: check its members there
                    where = next(d for d in sorted(primary) if lookup(d) is value)
                missing.extend(f"{where}.{member}" for member in class_members(value)
                               if f"{where}.{member}" not in documented)
    return missing


def _check(app: Sphinx, env: Any) -> None:
    objects = env.get_domain("py").objects
    aliases = [name for name, entry in objects.items() if entry.aliased]
    missing = missing_names(app.config.public_modules, objects, aliases)
    if missing:
        logger.warning("public names missing from the API reference (docs/api.rst): %s",
                       ", ".join(missing))


def _aliases(env: Any) -> dict[str, str]:
    """Defining name -> documented name, for objects documented where they are not defined."""
    aliases = {}
    for name in env.get_domain("py").objects:
        value = lookup(name)
        qualname = getattr(value, "__qualname__", None)
        module = getattr(value, "__module__", None)
        if isinstance(qualname, str) and isinstance(module, str) and f"{module}.{qualname}" != name:
            aliases.setdefault(f"{module}.{qualname}", name)
    return aliases


def _resolve_alias(app: Sphinx, env: Any, node: Any, contnode: Any) -> Any:
    if node.get("refdomain") != "py":
        return None
    if not hasattr(app, "_public_names_aliases"):  # once per build, when every object is read
        app._public_names_aliases = _aliases(env)
    target, module, cls = node["reftarget"], node.get("py:module"), node.get("py:class")
    candidates = [target, f"{module}.{target}", f"{module}.{cls}.{target}"]
    documented = next((app._public_names_aliases[name] for name in candidates
                       if name in app._public_names_aliases), None)
    if documented is None:
        return None
    return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, node["reftype"],
                                             documented, node, contnode)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value("public_modules", [], "env")
    app.connect("env-check-consistency", _check)
    app.connect("missing-reference", _resolve_alias)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
