"""The build's two decisions pyproject.toml cannot state (everything else is there): a wheel
where no optional extension was built (no C compiler or Python headers) is tagged pure,
py3-none-any, not as one of this interpreter and platform (pip's cache keeps a wheel under its
tag: a pure one tagged cp3xx-linux would pass for compiled); and the wheel installs no C source."""

from __future__ import annotations

from typing import Any

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """build_ext that records which extensions it built (an optional one that fails to compile
    is left out with a warning, by setuptools)."""

    def run(self) -> None:
        self.built: list[str] = []
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


setup(cmdclass={"build_ext": BuildExt, "bdist_wheel": BdistWheel})
