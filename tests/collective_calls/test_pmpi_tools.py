"""PMPI tools see the library's MPI calls in both forms: a tool preloaded with LD_PRELOAD (mpiP,
Score-P, Darshan, MUST) defines MPI_Start, MPI_Test, MPI_Gather... itself and forwards to
PMPI_Start, PMPI_Test, PMPI_Gather; the compiled round (backends/mpi_round.py compiled,
collectives.backends._round_c) and the compiled fast paths (backends/mpi_moves.py,
collectives.backends._moves_c) call the process's global MPI_Start, MPI_Test, MPI_Gather and
MPI_Igather, as mpi4py's calls do, so the tool counts the same calls as in the Python form (mpi4py
calls an MPI-4 library's large-count MPI_Gather_c and MPI_Igather_c: the shim counts both names).

The tool here is a counting shim, compiled by the system's C compiler and linked to the libmpi
mpi4py loads (as a PMPI tool links the MPI it measures); a 2-rank mpiexec job preloads it and
makes all_reduces and gathers on the compiled form and on the Python one (COLLECTIVES_COMPILED=0)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from collectives.testing.launch import mpi_command

#: The counting shim: MPI_Start, MPI_Test, MPI_Gather and MPI_Igather counted, then their PMPI_
#: forms called (the gathers' handles as intptr_t: an int handle of MPICH passes as one on 64-bit
#: little-endian Linux); the _c forms only where the library has them (MPI-4: mpi4py calls the
#: shim's where it finds them).
SHIM = r"""
#include <stdint.h>
typedef void *request_t;
typedef intptr_t handle_t;
int PMPI_Start(request_t *request);
int PMPI_Test(request_t *request, int *flag, void *status);
int PMPI_Gather(const void *s, int sc, handle_t st, void *r, int rc, handle_t rt, int root, handle_t comm);
int PMPI_Igather(const void *s, int sc, handle_t st, void *r, int rc, handle_t rt, int root, handle_t comm,
                 request_t *request);
static long starts, tests, gathers, igathers;
int MPI_Start(request_t *request) { ++starts; return PMPI_Start(request); }
int MPI_Test(request_t *request, int *flag, void *status) { ++tests; return PMPI_Test(request, flag, status); }
int MPI_Gather(const void *s, int sc, handle_t st, void *r, int rc, handle_t rt, int root, handle_t comm) {
    ++gathers; return PMPI_Gather(s, sc, st, r, rc, rt, root, comm); }
int MPI_Igather(const void *s, int sc, handle_t st, void *r, int rc, handle_t rt, int root, handle_t comm,
                request_t *request) { ++igathers; return PMPI_Igather(s, sc, st, r, rc, rt, root, comm, request); }
#ifdef WITH_LARGE_COUNTS
int PMPI_Gather_c(const void *s, long long sc, handle_t st, void *r, long long rc, handle_t rt, int root,
                  handle_t comm);
int PMPI_Igather_c(const void *s, long long sc, handle_t st, void *r, long long rc, handle_t rt, int root,
                   handle_t comm, request_t *request);
int MPI_Gather_c(const void *s, long long sc, handle_t st, void *r, long long rc, handle_t rt, int root,
                 handle_t comm) { ++gathers; return PMPI_Gather_c(s, sc, st, r, rc, rt, root, comm); }
int MPI_Igather_c(const void *s, long long sc, handle_t st, void *r, long long rc, handle_t rt, int root,
                  handle_t comm, request_t *request) {
    ++igathers; return PMPI_Igather_c(s, sc, st, r, rc, rt, root, comm, request); }
#endif
long shim_starts(void) { return starts; }
long shim_tests(void) { return tests; }
long shim_gathers(void) { return gathers; }
long shim_igathers(void) { return igathers; }
"""

#: The job: ``calls`` all_reduces of a small array after the first (checked in full, not carried
#: by the round), then ``calls`` gathers of 64 KiB (the fast path's MPI call: past the round's and
#: the staged requests' bytes) under the default timeout and ``calls`` without one; the shim's counts
#: over them, and whether the round and the fast paths were compiled, written in a file per rank in
#: the folder given.
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
         "compiled_round": comm._transport._compiled_round is not None,
         "persistent_round": comm._transport.round.request is not None}
shim.shim_gathers.restype = shim.shim_igathers.restype = ctypes.c_long
big = np.ones(8192)
out = np.empty((2, 8192)) if comm.rank == 0 else None
for timeout in (comm.timeout, None):
    comm.timeout = timeout
    comm.gather(big, 0, out=out)
    gathers, igathers = shim.shim_gathers(), shim.shim_igathers()
    for _ in range(calls):
        comm.gather(big, 0, out=out)
    assert np.array_equal(out, np.ones((2, 8192))) if out is not None else True
    found["timeout" if timeout else "blocking"] = [shim.shim_gathers() - gathers, shim.shim_igathers() - igathers]
found["compiled_moves"] = comm._transport._move.__module__.endswith("_moves_c")
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
    large = subprocess.run([sys.executable, "-c", "import ctypes, sys; print(hasattr(ctypes.CDLL(sys.argv[1]), "
                            "'PMPI_Gather_c'))", libmpi], capture_output=True, text=True, timeout=120, check=True)
    subprocess.run([compiler, "-shared", "-fPIC", "-O1", *(["-DWITH_LARGE_COUNTS"] if "True" in large.stdout else []),
                    "-o", str(library), str(folder / "shim.c"), libmpi,
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


def test_a_preloaded_pmpi_tool_sees_every_mpi_start_mpi_test_and_gather_in_both_forms(shim):
    compiled, python = counts(shim, "compiled"), counts(shim, "python")
    assert all(rank["compiled_round"] for rank in compiled), "backends/mpi_round.py was not compiled: reinstall"
    assert not any(rank["compiled_round"] for rank in python)
    for form in (compiled, python):
        for rank in form:
            # Every all_reduce is one round of the check (one persistent request started, where the
            # library's persistent all_gather is right: else an MPI_Iallgather), and a started
            # request is tested at least once before it completes.
            assert rank["starts"] == (CALLS if rank["persistent_round"] else 0), (compiled, python)
            assert rank["tests"] >= rank["starts"], (compiled, python)
            # Every gather is one MPI call: nonblocking under a timeout, else blocking.
            assert rank["timeout"] == [0, CALLS] and rank["blocking"] == [CALLS, 0], (compiled, python)
    assert all(rank["compiled_moves"] for rank in compiled), "backends/mpi_moves.py was not compiled: reinstall"
    assert not any(rank["compiled_moves"] for rank in python)


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
