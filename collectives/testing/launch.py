"""The command lines that start a job's ranks for the pools and the launcher tests.

``COLLECTIVES_TEST_LAUNCHER`` says which MPI launcher starts them (the pools of backends
mpi, torch-under-MPI and cupy, and tests that launch scripts): a command line to which
``-n N`` and the program are appended. Unset, it is ``mpiexec`` (MPICH's or Intel MPI's
Hydra, whichever the environment has). For example::

    COLLECTIVES_TEST_LAUNCHER="mpirun --oversubscribe"   # Open MPI (more ranks than cores)
    COLLECTIVES_TEST_LAUNCHER="srun --mpi=pmi2"          # Slurm, MPICH or Intel MPI
    COLLECTIVES_TEST_LAUNCHER="srun --mpi=pmix"          # Slurm, Open MPI

Its first word is looked up next to the running interpreter first (the venv's mpiexec or
mpirun), then on PATH. As root, Open MPI wants ``OMPI_ALLOW_RUN_AS_ROOT=1`` and
``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1`` in the environment (or ``--allow-run-as-root`` in the
command); the pools pass both through to the ranks, as they do every user setting (see
:func:`collectives.launcher.without_launcher_variables`).
"""

from __future__ import annotations

import os
import random
import shlex
import shutil
import socket
import sys
from pathlib import Path

from .. import config

#: What an unset COLLECTIVES_TEST_LAUNCHER means.
DEFAULT_MPI_LAUNCHER = "mpiexec"


class LauncherNotFound(RuntimeError):
    """The launcher's program is neither next to the interpreter nor on PATH."""


def executable(name: str) -> str:
    """A launcher from the running interpreter's environment (the venv) first, then PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise LauncherNotFound(f"launcher {name!r} not found next to {sys.executable} or on PATH")
    return found


def mpi_launcher() -> list[str]:
    """``COLLECTIVES_TEST_LAUNCHER`` as words, its program resolved (:func:`executable`)."""
    words = shlex.split(os.environ.get(config.TEST_LAUNCHER, "").strip() or DEFAULT_MPI_LAUNCHER)
    return [executable(words[0]), *words[1:]]


def mpi_launcher_name() -> str:
    """The launcher's program name and flags, as the user wrote them (for messages and reports)."""
    return os.environ.get(config.TEST_LAUNCHER, "").strip() or DEFAULT_MPI_LAUNCHER


def mpi_command(size: int, program: list[str]) -> list[str]:
    """``program`` on ``size`` ranks under the MPI launcher."""
    return [*mpi_launcher(), "-n", str(size), *program]


def free_port() -> int:
    """A loopback port nothing listens on now, for a launcher to listen on: drawn at random
    outside the kernel's ephemeral range (``ip_local_port_range``), from which every outgoing
    connection (an MPI launcher's, Gloo's) takes its port, so that none of them can take it before
    the launcher binds it (a port the kernel hands out for ``bind(0)`` is in that range)."""
    low, high = 32768, 60999
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(n) for n in f.read().split())
    except (OSError, ValueError):
        pass
    outside = [(10000, low - 1), (high + 1, 65535)]
    ranges = [(a, b) for a, b in outside if b - a >= 1000] or [(1024, 65535)]
    draw = random.SystemRandom()
    for _ in range(200):
        a, b = draw.choice(ranges)
        port = draw.randint(a, b)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (every one drawn was taken: the kernel's choice)
        s.bind(("127.0.0.1", 0))
        found: int = s.getsockname()[1]
        return found


def launcher_command(name: str) -> list[str]:
    """The command that runs launcher ``name``: ``mpiexec`` is the MPI launcher (see
    :func:`mpi_launcher`); ``torchrun`` is the script beside the running interpreter or on PATH,
    else torch's own module, ``python -m torch.distributed.run`` (an interpreter whose console
    scripts are elsewhere, as in a container image); any other name is :func:`executable`'s."""
    if name == "mpiexec":
        return mpi_launcher()
    try:
        return [executable(name)]
    except LauncherNotFound:
        if name != "torchrun":
            raise
        return [sys.executable, "-m", "torch.distributed.run"]


def torchrun_command(size: int, program: list[str]) -> list[str]:
    """``program`` (a script and its arguments, or ``-m module``) on ``size`` ranks under
    torchrun, its rendezvous on a free loopback port (two suites on one machine never join
    each other's)."""
    return [*launcher_command("torchrun"), "--nnodes", "1", "--nproc_per_node", str(size),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *program]
