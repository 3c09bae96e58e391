"""Moved to :mod:`collectives.diagnostics.trace`; this name stays for code that imported it here
(and for ``python -m collectives.trace``)."""

import sys

from .diagnostics import trace as _moved

if __name__ == "__main__":
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
