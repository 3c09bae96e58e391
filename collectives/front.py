"""The call path's compiled form: :mod:`collectives.callpath` (``Communicator._run``) compiled as
it stands by Cython, the module ``collectives._callpath_c`` (setup.py's ``COMPILED`` table), set as
a communicator's ``_run`` when the communicator is made.

There is one call path: the Python module is the source and the reference, and the compiled module
is built from that file (stamped with its sha256: a build from another version of the file is not
used). Compiled, the interpreter's cost of the path's own steps goes (docs/performance.md).

Optional: an install without Cython or a C compiler has no ``collectives._callpath_c``, and
``COLLECTIVES_COMPILED=0`` turns it off for communicators made after; a communicator keeps the
form it was made in.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

from . import callpath, config


def compiled_module() -> Any:
    """The compiled call path's module (``collectives._callpath_c``), or None where it was not built
    (or was built from another version of collectives/callpath.py) or ``COLLECTIVES_COMPILED=0``
    turns the compiled forms off."""
    return config.compiled_extension(f"{__package__}._callpath_c", callpath)


def install(comm: Any, owner: type) -> bool:
    """Set ``comm._run`` to the compiled call path, bound to ``comm``, where there is one and
    ``comm``'s class has not a ``_run`` of its own (which then runs, as written). Whether it did."""
    module = compiled_module()
    if module is None or type(comm)._run is not owner._run:  # type: ignore[attr-defined]
        return False
    comm.__dict__["_run"] = MethodType(module.run, comm)
    return True


def is_compiled(comm: Any) -> bool:
    """Whether ``comm``'s calls go through the compiled call path."""
    return "_run" in vars(comm)
