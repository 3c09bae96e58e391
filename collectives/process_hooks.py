"""Moved to :mod:`collectives.diagnostics.process_hooks`; this name stays for code that imported it here."""

import sys

from .diagnostics import process_hooks as _moved

sys.modules[__name__] = _moved
