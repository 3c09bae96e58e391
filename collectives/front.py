"""The call path's compiled form: :meth:`Communicator._run <collectives.communicator.Communicator._run>`
in C (collectives/_front_call.c; the object and module in _front.c), set as a communicator's ``_run``
when the communicator is made.

The Python ``_run`` is the reference. The compiled one runs the same steps in the same order,
calling the same parts (the plan's check and fast path, the carried path, the check, the flight
recorder, the hooks, the transport's method, the error mapping); it hands every call it does not
take to the Python one before any step has run (keyword arguments, a call's own ``timeout=``, a
closed or unusable communicator, another thread, a kind of ``x`` with no plan yet). It saves the
interpreter's cost of the path's own steps, 0.1-0.5 us a call (docs/performance.md).

Optional: an install without a C compiler has no ``collectives._front``, and
``COLLECTIVES_COMPILED=0`` turns it off for communicators made after; a communicator keeps the
form it was made in.
"""

from __future__ import annotations

from typing import Any

from . import config

#: The interface the module's ``VERSION`` (``FRONT_VERSION`` of collectives/_front.h) must have:
#: a build left from an older checkout is not used.
FRONT_VERSION = 3


def compiled_module() -> Any:
    """The compiled front's module (``collectives._front``), or None where it was not built (or is stale) or
    ``COLLECTIVES_COMPILED=0`` turns the compiled forms off."""
    return config.compiled_extension(f"{__package__}._front", FRONT_VERSION)


def install(comm: Any, python_run: Any, **parts: Any) -> bool:
    """Set ``comm._run`` to its compiled form (``python_run``, ``Communicator._run``, is what it
    hands over to; ``parts``: the constants it needs, see ``Front``), where there is one and
    ``comm``'s class has not a ``_run`` of its own (which then runs, as written). Whether it did."""
    module = compiled_module()
    if module is None or type(comm)._run is not python_run:
        return False
    comm.__dict__["_run"] = module.Front(comm, python_run, **parts)
    return True


def is_compiled(comm: Any) -> bool:
    """Whether ``comm``'s calls go through the compiled call path."""
    return "_run" in vars(comm)
