"""Moved to :mod:`collectives.diagnostics.recorder`; this name stays for code that imported it here."""

import sys

from .diagnostics import recorder as _moved

sys.modules[__name__] = _moved
