"""The build's decisions pyproject.toml cannot state (everything else is there).

The compiled forms (:data:`COMPILED`): a module of the library's own Python compiled as it stands
by Cython. Each source (and the ``.pxd`` beside it, where there is one) is copied under build/ with
the compiled module's name, the sha256 of the source appended as ``__source_sha256__`` (what
``collectives.config.compiled_extension`` compares with the installed source: a module built from
another version of the file is not used), cythonized there and built as an optional extension. The
generated C is a build product, never in the checkout or the wheel. Without Cython or a C compiler
the build makes the Python form only.

A wheel where no extension was built is tagged pure, py3-none-any, not as one of this interpreter
and platform (pip's cache keeps a wheel under its tag: a pure one tagged cp3xx-linux would pass for
compiled); and the wheel installs no C source."""

from __future__ import annotations

import hashlib
import os
import shutil
from typing import Any

from setuptools import Extension, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

#: The compiled forms: the compiled module's import name -> its source, a module of the library
#: that runs as Python (its twin, importable beside it).
COMPILED = {"collectives._callpath_c": "collectives/callpath.py",
            "collectives._host_views_c": "collectives/host_views.py",
            "collectives._wire_c": "collectives/wire.py",
            "collectives._reliability_c": "collectives/reliability.py",
            "collectives.backends._p2p_c": "backends/mpi_p2p.py",
            "collectives.backends._moves_c": "backends/mpi_moves.py",
            "collectives.backends._round_c": "backends/mpi_round.py",
            "collectives.backends._carried_c": "backends/mpi_carried.py",
            "collectives.backends._uneven_c": "backends/mpi_uneven.py",
            "collectives.backends._cupy_fast_c": "backends/cupy_fast.py"}

#: The compiled modules that are safe without the GIL (Cython's freethreading_compatible); the
#: others ask for the GIL on a free-threaded interpreter.
FREE_THREADED: set[str] = set()

#: Where the copies and the generated C go (git-ignored).
GENERATED = os.path.join("build", "cython")


def source_sha256(path: str) -> str:
    """The sha256 of the file at ``path`` (what the compiled module is stamped with)."""
    with open(path, "rb") as file:
        return hashlib.sha256(file.read()).hexdigest()


def generated_source(name: str, source: str) -> str:
    """Copy ``source`` (and its .pxd) under :data:`GENERATED` as the module ``name``, stamped with
    the source's sha256; the copy's path."""
    stem = os.path.join(GENERATED, *name.split("."))
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(source, encoding="utf-8") as file:
        text = file.read()
    with open(stem + ".py", "w", encoding="utf-8") as file:
        file.write(f"{text}\n__source_sha256__ = {source_sha256(source)!r}\n")
    pxd = os.path.splitext(source)[0] + ".pxd"
    if os.path.exists(pxd):
        shutil.copyfile(pxd, stem + ".pxd")
    return stem + ".py"


class BuildExt(build_ext):
    """build_ext that cythonizes the :data:`COMPILED` forms first (none where Cython is missing)
    and records which extensions it built (an optional one that fails to compile is left out with
    a warning, by setuptools)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:  # (the C of every compiled form at once, one compiler a core: `-j` sets it)
            self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        self.built: list[str] = []
        compiled = [ext for ext in self.extensions if ext.name in COMPILED]
        if compiled:
            try:
                from Cython.Build import cythonize  # noqa: PLC0415  (a build requirement, optional)
            except ImportError:
                print("warning: Cython is not installed: the compiled forms are not built (the Python runs)")
                self.extensions = [ext for ext in self.extensions if ext.name not in COMPILED]
            else:
                # every copy first: a .pxd cimports another module's by its compiled name
                copies = {ext.name: generated_source(ext.name, COMPILED[ext.name]) for ext in compiled}
                for ext in compiled:
                    ext.sources = [copies[ext.name]]
                    # annotation_typing off: the sources' annotations are for mypy; Cython would
                    # enforce `x: int` with errors of its own (the argument checks are the library's)
                    directives = {"language_level": 3, "binding": True, "annotation_typing": False,
                                  "freethreading_compatible": ext.name in FREE_THREADED}
                    # (include_path: where Cython finds the .pxd of the copy, by the module's full name)
                    [generated] = cythonize([ext], compiler_directives=directives, include_path=[GENERATED],
                                            quiet=True, force=self.force)
                    ext.sources = generated.sources  # (the C: setuptools compiles it as any other)
        super().run()

    def build_extension(self, ext: Any) -> None:
        super().build_extension(ext)  # (raises where it fails to compile)
        self.built.append(ext.name)


class BdistWheel(bdist_wheel):
    """bdist_wheel whose wheel is pure where the build built no extension."""

    def run_command(self, command: str) -> None:
        super().run_command(command)
        if command == "build" and not getattr(self.get_finalized_command("build_ext"), "built", [None]):
            # (both read after the build: the tag, and where install puts the modules, purelib)
            self.root_is_pure = True
            self.distribution.ext_modules = []


setup(cmdclass={"build_ext": BuildExt, "bdist_wheel": BdistWheel},
      ext_modules=[Extension(name, [source], optional=True) for name, source in COMPILED.items()])
