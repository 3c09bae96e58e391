"""One module per transport, each a :class:`collectives.Communicator` implementation.

Backends are imported by name through :mod:`collectives.registry`; each imports
its transport (torch, mpi4py, cupy) only when it is created.
"""
