"""An install without the compiled forms (no C compiler at install) says so: a warning once per
process when the first MPI communicator is made, and collectives-info, each with how to get them;
``COLLECTIVES_COMPILED=0`` (the Python form chosen) warns nothing.

Not built is made here as it is for a user: the import of the compiled modules fails (a
``sitecustomize`` on PYTHONPATH refuses them), in a real 2-rank mpiexec job."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from collectives.backends.mpi_round import compiled_module

from collectives.front import compiled_module as front_module
from collectives.info import COMPILED_FORMS
from collectives.testing.launch import mpi_command

#: Imported at start-up from PYTHONPATH: the compiled modules' imports fail, as where not built.
REFUSE = '''
import sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name in REFUSED:
            raise ImportError(f"{name} refused (the test's stand-in for a build without a C compiler)")
        return None

sys.meta_path.insert(0, Refuse())
'''

#: Two MPI communicators (the world and a split) and a call on each.
JOB = ("import numpy as np, collectives\n"
       "comm = collectives.init('mpi')\n"
       "sub = comm.split(0)\n"
       "comm.all_reduce(np.ones(3)); sub.all_reduce(np.ones(3))\n"
       "sub.close(); comm.close()\n")

WARNING = "NotCompiledWarning: collectives: the compiled forms of"


def environment(tmp_path, built, compiled, refused=tuple(COMPILED_FORMS)):
    """The environment of a process where the compiled modules are there or not (``built``: else
    the ``refused`` ones are not), and COLLECTIVES_COMPILED (None: unset)."""
    env = {key: value for key, value in os.environ.items() if key != "COLLECTIVES_COMPILED"}
    if not built:
        (tmp_path / "sitecustomize.py").write_text(f"REFUSED = {set(refused)!r}\n{REFUSE}")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    if compiled is not None:
        env["COLLECTIVES_COMPILED"] = compiled
    return env


def job_stderr(tmp_path, built, compiled, refused=tuple(COMPILED_FORMS)):
    """The stderr of a 2-rank job making two MPI communicators."""
    done = subprocess.run(mpi_command(2, [sys.executable, "-c", JOB]),
                          env=environment(tmp_path, built, compiled, refused),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_a_job_without_the_compiled_forms_warns_once_per_rank_saying_how_to_get_them(tmp_path):
    stderr = job_stderr(tmp_path, built=False, compiled=None)
    assert stderr.count(WARNING) == 2, stderr  # (one per rank, though each made two communicators)
    assert [name for name in COMPILED_FORMS if name not in stderr] == []
    assert "pip install --no-cache-dir --force-reinstall" in stderr and "COLLECTIVES_COMPILED=0" in stderr


def test_one_compiled_form_missing_is_named_alone(tmp_path):
    if compiled_module() is None or front_module() is None:
        pytest.skip("the compiled forms were not built here")
    stderr = job_stderr(tmp_path, built=False, compiled=None, refused=["collectives.backends._uneven_c"])
    lines = [line for line in stderr.splitlines() if WARNING in line]
    assert len(lines) == 2, stderr  # (one per rank)
    assert all([name for name in COMPILED_FORMS if name in line] == ["collectives.backends._uneven_c"]
               for line in lines), lines


@pytest.mark.parametrize(("built", "compiled"), [(False, "0"), (True, None)], ids=["python-form-chosen", "built"])
def test_no_warning_where_the_python_form_is_chosen_or_the_compiled_forms_run(tmp_path, built, compiled):
    if built and (compiled_module() is None or front_module() is None):
        pytest.skip("the compiled forms were not built here")
    assert WARNING not in job_stderr(tmp_path, built, compiled)


def test_collectives_info_says_the_compiled_forms_are_missing_and_how_to_get_them(tmp_path):
    done = subprocess.run([sys.executable, "-m", "collectives.info"], env=environment(tmp_path, False, None),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "compiled: no" in line or "compiled forms: 0 of" in line]
    assert len(lines) == 3, done.stdout  # (the call path, the MPI backend's check round, every form)
    assert all("pip install --no-cache-dir --force-reinstall" in line for line in lines), lines
