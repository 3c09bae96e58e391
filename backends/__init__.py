"""One module per transport, each a :class:`collectives.Communicator` implementation.

Backends are imported by name through :mod:`collectives.registry`; each imports
its transport (torch, mpi4py, cupy) only when it is created.
"""

# Installed as collectives.backends (pyproject.toml's package-dir): imported under this folder's own
# name (a checkout on sys.path) it would be a second copy of every module, so refuse that.
if __name__ != "collectives.backends":
    raise ImportError(f"{__name__!r} is installed as 'collectives.backends': import collectives.backends instead")

