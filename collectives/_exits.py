"""Moved to :mod:`collectives.diagnostics._exits`; this name stays for code that imported it here."""

import sys

from .diagnostics import _exits as _moved

sys.modules[__name__] = _moved
