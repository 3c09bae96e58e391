"""PMPI tools see the library's MPI calls in both forms: a tool preloaded with LD_PRELOAD (mpiP,
Score-P, Darshan, MUST) defines MPI_Start, MPI_Test... itself and forwards to PMPI_Start,
PMPI_Test; the compiled round (backends/mpi_round.py compiled, collectives.backends._round_c) calls
the process's global MPI_Start and MPI_Test, as mpi4py's calls do, so the tool counts the same calls
as in the Python form.

The tool here is a counting shim, compiled by the system's C compiler and linked to the libmpi
mpi4py loads (as a PMPI tool links the MPI it measures); a 2-rank mpiexec job preloads it and
makes all_reduces on the compiled form and on the Python one (COLLECTIVES_COMPILED=0)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from collectives.testing.launch import mpi_command

#: The counting shim: MPI_Start and MPI_Test counted, then PMPI_Start and PMPI_Test.
SHIM = r"""
typedef void *request_t;
int PMPI_Start(request_t *request);
int PMPI_Test(request_t *request, int *flag, void *status);
static long starts, tests;
int MPI_Start(request_t *request) { ++starts; return PMPI_Start(request); }
int MPI_Test(request_t *request, int *flag, void *status) { ++tests; return PMPI_Test(request, flag, status); }
long shim_starts(void) { return starts; }
long shim_tests(void) { return tests; }
"""

#: The job: ``calls`` all_reduces of a small array after the first (checked in full, not carried
#: by the round); the shim's counts over them, and whether the round was compiled, written in a
#: file per rank in the folder given.
JOB = r"""
import ctypes, json, os, sys
import numpy as np
import collectives

shim = ctypes.CDLL(os.environ["SHIM_LIBRARY"])
shim.shim_starts.restype = shim.shim_tests.restype = ctypes.c_long
calls = int(sys.argv[1])
comm = collectives.init("mpi")
x = np.ones(4)
comm.all_reduce(x)
starts, tests = shim.shim_starts(), shim.shim_tests()
for _ in range(calls):
    comm.all_reduce(x)
found = {"starts": shim.shim_starts() - starts, "tests": shim.shim_tests() - tests,
         "compiled_round": comm._transport._compiled_round is not None}
with open(os.path.join(sys.argv[2], f"{comm.rank}.json"), "w") as f:
    json.dump(found, f)
comm.close()
"""

CALLS = 200


def libmpi_of_mpi4py() -> str:
    """The path of the libmpi mpi4py loads (from this process's map, once mpi4py.MPI is imported)."""
    found = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; print(open('/proc/self/maps').read())"],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    paths = {line.split()[-1] for line in found.splitlines() if "/libmpi" in line}
    paths = sorted(p for p in paths if os.path.basename(p).startswith(("libmpi.so", "libmpi_")))
    if not paths:
        pytest.skip("mpi4py's libmpi is not found in the process's map")
    return next((p for p in paths if os.path.basename(p).startswith("libmpi.so")), paths[0])


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    """The counting shim, built: its path."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (cc, gcc or $CC) to build the PMPI shim")
    if not sys.platform.startswith("linux"):
        pytest.skip("LD_PRELOAD and /proc/self/maps: Linux")
    libmpi = libmpi_of_mpi4py()
    folder = tmp_path_factory.mktemp("pmpi")
    (folder / "shim.c").write_text(SHIM)
    library = folder / "libshim.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(folder / "shim.c"), libmpi,
                    f"-Wl,-rpath,{os.path.dirname(libmpi)}"], check=True, timeout=120)
    (folder / "job.py").write_text(JOB)
    return library


def counts(shim, form):
    """The shim's counts on each of the 2 ranks of a job in ``form`` (compiled, python)."""
    folder = shim.parent / form
    folder.mkdir(exist_ok=True)
    env = dict(os.environ, LD_PRELOAD=str(shim), SHIM_LIBRARY=str(shim), COLLECTIVES_COMPILED=
               "1" if form == "compiled" else "0", COLLECTIVES_BACKEND="mpi")
    done = subprocess.run(mpi_command(2, [sys.executable, str(shim.parent / "job.py"), str(CALLS), str(folder)]),
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((folder / f"{rank}.json").read_text()) for rank in range(2)]


def test_a_preloaded_pmpi_tool_sees_every_mpi_start_and_mpi_test_in_both_forms(shim):
    compiled, python = counts(shim, "compiled"), counts(shim, "python")
    assert all(rank["compiled_round"] for rank in compiled), "backends/mpi_round.py was not compiled: reinstall"
    assert not any(rank["compiled_round"] for rank in python)
    for form in (compiled, python):
        for rank in form:
            # Every all_reduce is one round of the check (one persistent request started), and a
            # started request is tested at least once before it completes.
            assert rank["starts"] == CALLS, (compiled, python)
            assert rank["tests"] >= rank["starts"], (compiled, python)


def test_an_mpi_module_without_a_file_leaves_the_round_to_mpi4pys_calls():
    """binds_mpi on an MPI module with no ``__file__`` (and no MPI in the process): not bound, no error."""
    program = ("import types; from collectives.backends import mpi_round; "
               "module = mpi_round.compiled_module(); "
               "print('unbuilt' if module is None else module.binds_mpi(types.ModuleType('MPI')))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, COLLECTIVES_COMPILED="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    if done.stdout.strip() == "unbuilt":
        pytest.skip("backends/mpi_round.py was not compiled")
    assert done.stdout.strip() == "False"
