"""The call path's compiled form: :mod:`collectives.callpath` (``Communicator._run``) compiled as
it stands by Cython, the module ``collectives._callpath_c`` (setup.py's ``COMPILED`` table, with
the types of collectives/callpath.pxd), whose ``CallPath`` a communicator gets when it is made.

There is one call path: the Python module is the source and the reference, and the compiled module
is built from that file (stamped with its sha256: a build from another version of the file is not
used). Compiled, the interpreter's cost of the path's own steps goes (docs/performance.md).

Optional: an install without Cython or a C compiler has no ``collectives._callpath_c``, and
``COLLECTIVES_COMPILED=0`` turns it off for communicators made after; a communicator keeps the
form it was made in.
"""

from __future__ import annotations

from typing import Any

from . import callpath, config, host_views


def compiled_module() -> Any:
    """The compiled call path's module (``collectives._callpath_c``), or None where it was not built
    (or was built from another version of collectives/callpath.py) or ``COLLECTIVES_COMPILED=0``
    turns the compiled forms off."""
    return config.compiled_extension(f"{__package__}._callpath_c", callpath)


def install(comm: Any, owner: type, gate: Any, checking: bool, ring: Any) -> Any:
    """Make ``comm``'s call path (a :class:`~collectives.callpath.CallPath` over it, with its
    ``gate``, ``checking`` and ``ring``), compiled where there is a compiled form and ``comm``'s
    class has not a ``_run`` of its own, and set ``comm._run`` to its ``_run`` unless it has (that
    ``_run`` then runs, as written, and calls :meth:`owner._run`, the call path's ``run`` in the
    Python form); compiled, its public collectives (``Collectives._METHODS``) that its class has
    not replaced are its call path's (the same methods, compiled, calling the call path in C).
    Returns the call path."""
    module = compiled_module()
    own_run = type(comm)._run is not owner._run  # type: ignore[attr-defined]
    if module is None or own_run:
        path = callpath.CallPath(comm, gate, checking, ring, {})
    else:  # (the compiled per-array checks where they were built from the same source)
        views = config.compiled_extension(f"{__package__}._host_views_c", host_views)
        twins = {} if views is None else {host_views.numpy_host_view: views.numpy_host_view,
                                          host_views.tensor_host_view: views.tensor_host_view,
                                          host_views.out_fits: views.out_fits}
        path = module.CallPath(comm, gate, checking, ring, twins)
    if not own_run:
        comm.__dict__["_run"] = path._run
    if type(path) is not callpath.CallPath:  # its public methods, where the class kept them
        for name in callpath.Collectives._METHODS:
            if getattr(type(comm), name) is getattr(callpath.Collectives, name):
                comm.__dict__[name] = getattr(path, name)
    return path


def is_compiled(comm: Any) -> bool:
    """Whether ``comm``'s calls go through the compiled call path."""
    return type(comm._path) is not callpath.CallPath
