"""Errors raised by collectives.

Bad arguments are ordinary ``TypeError`` / ``ValueError`` raised before anything
is sent. Everything that goes wrong once ranks talk to each other is a
``CollectiveError`` (or one of its subclasses).
"""

from __future__ import annotations


class CollectiveError(RuntimeError):
    """A collective failed in the transport (or could not be set up)."""


class BackendUnavailable(CollectiveError):
    """The requested backend cannot run here (missing package, wrong launcher)."""


class CollectiveTimeout(CollectiveError, TimeoutError):
    """A blocking collective did not complete within the communicator's timeout."""


class CollectiveMismatch(CollectiveError):
    """Ranks called collectives that do not match (operation, op, root, dtype, shape)."""
