"""Communicators in a form: the compiled one (what the install builds: the call path,
collectives/callpath.py compiled by Cython, and the MPI backend's round and carried calls,
backends/mpi_round.py and mpi_carried.py compiled the same way) or the Python one, their reference
(COLLECTIVES_COMPILED=0). A communicator takes its form when it is made, so a test makes a split
under the variable."""

from __future__ import annotations

import contextlib
import os

import numpy as np

from collectives.config import COMPILED


@contextlib.contextmanager
def made_in_form(form):
    """COLLECTIVES_COMPILED set for ``form`` while a communicator is made in the block (it takes
    its form when made), and as it was after."""
    kept = os.environ.get(COMPILED)
    os.environ[COMPILED] = "1" if form == "compiled" else "0"
    try:
        yield
    finally:
        if kept is None:
            os.environ.pop(COMPILED, None)
        else:
            os.environ[COMPILED] = kept


@contextlib.contextmanager
def split_in_form(comm, form):
    """A split of ``comm`` made where COLLECTIVES_COMPILED says ``form`` (a communicator takes its
    form when made), its first call made (checked in full, not carried); closed after, and
    COLLECTIVES_COMPILED as it was."""
    with made_in_form(form):
        sub = comm.split(0)
        try:
            sub.all_reduce(np.zeros(1))
            yield sub
        finally:
            sub.close()
