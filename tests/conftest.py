"""Shared fixtures: the rank pools come from collectives.testing's pytest plugin, which is
opt-in (no entry point: it must not load in other projects' test runs); this suite opts in."""

import sys
from pathlib import Path

pytest_plugins = ["collectives.testing.plugin"]

# Every folder of tests/ on sys.path, whichever of them pytest was pointed at: a test module
# may import another area's by name (test_multihost takes test_train's training run). Test
# and helper modules therefore have names unique across the folders.
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(p) for p in sorted(_HERE.iterdir()) if p.is_dir() and not p.name.startswith((".", "_"))]
