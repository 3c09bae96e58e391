"""Sphinx configuration of the user guide and the API reference: ``make docs`` (sphinx-build -W
--keep-going -n).

The guide is the Markdown pages beside this file (myst-parser); the reference is read from the
installed package's docstrings (autodoc). Nothing is fetched (no intersphinx), so the build
needs only the docs extra. Two local extensions in _ext/:
``public_names`` fails the build when a public name is missing from the reference, and
resolves references to a name at its defining module (``collectives.communicator.Work``,
as annotations spell it) to where the reference documents it (``collectives.Work``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import collectives

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "collectives"
author = "the collectives authors"
copyright = "the collectives authors"  # noqa: A001  (Sphinx's name)
release = version = collectives.__version__

extensions = ["sphinx.ext.autodoc", "myst_parser", "public_names"]
root_doc = "index"
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
# docs/bench/ holds the measurements (JSON) and their dated log: data, not pages of the guide.
exclude_patterns = ["_build", "bench"]
# Headings get anchors (``reliability.md#exits-and-signals``), as GitHub makes them.
myst_heading_anchors = 3
# The pages are also read on GitHub, where a "###" under the title is fine.
suppress_warnings = ["myst.header"]
html_theme = "alabaster"
html_static_path: list[str] = []

nitpicky = True
# Third-party and standard-library types in signatures: without intersphinx (no network at
# build time) there is nothing to link them to. Only names outside this package belong here.
nitpick_ignore_regex = [
    (r"py:.*", r"(typing|collections\.abc|collections|enum|datetime|subprocess|multiprocessing)\..*"),
    (r"py:.*", r"(numpy|np|torch|hypothesis|pytest)(\..*)?"),
]

autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "undoc-members": True}
autodoc_typehints = "signature"
# A method without a docstring shows none, not torch's (SyncBatchNormFunction.forward ...).
autodoc_inherit_docstrings = False
# The module names readers import, not where the code lives.
add_module_names = True
python_use_unqualified_type_names = True

# The modules whose public names (``__all__``, else every name not starting with "_" that
# the module defines) must all be in the reference, each with its classes' public members.
public_modules = [
    "collectives",
    "collectives.c10d",
    "collectives.config",
    "collectives.errors",
    "collectives.ops",
    "collectives.syncbn",
    "collectives.testing",
    "collectives.testing.strategies",
]
