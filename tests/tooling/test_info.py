"""``python -m collectives.info`` on this (CPU) machine: every backend reported, with reasons."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import collectives
from collectives.launcher import without_launcher_variables

ROOT = Path(__file__).resolve().parents[2]


def run_info(*args):
    env = {**without_launcher_variables(os.environ),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "collectives.info", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.fixture(scope="module")
def report():
    return json.loads(run_info("--json"))


def test_every_backend_is_reported_with_usable_and_a_reason(report):
    assert set(report["backends"]) == set(collectives.BACKENDS)
    for name, entry in report["backends"].items():
        assert isinstance(entry["usable"], bool), name
        if not entry["usable"]:
            assert entry["why"], name


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed here")
def test_cupy_unavailable_says_why_and_how_to_install():
    text = run_info()
    assert "cupy   unavailable: cupy is not installed (pip install 'pycollectives[cupy]'" in text
    assert "NCCL: cupy not loaded" in text


def test_mpi_library_version_and_cuda_awareness_are_printed(report):
    mpi = report["backends"]["mpi"]
    if not mpi["usable"]:
        pytest.skip(f"MPI unavailable here: {mpi['why']}")
    from mpi4py import MPI  # the test process's own view, independently

    assert mpi["library"].split()[0] == MPI.Get_library_version().split()[0]
    assert mpi["mpi_version"] == "{}.{}".format(*MPI.Get_version())
    assert isinstance(mpi["cuda_aware"], bool)


def test_the_compiled_check_round_is_reported(monkeypatch, report):
    """The test set-up compiles backends/mpi_round.py and mpi_carried.py: reported as compiled;
    COLLECTIVES_COMPILED=0 says off."""
    if not report["backends"]["mpi"]["usable"]:
        pytest.skip("MPI unavailable here")
    assert report["backends"]["mpi"]["compiled"] is True
    assert "check round compiled: yes" in run_info()
    monkeypatch.setenv("COLLECTIVES_COMPILED", "0")
    assert "check round compiled: no, off (COLLECTIVES_COMPILED=0)" in run_info()


def test_the_compiled_call_path_is_reported(monkeypatch, report):
    """The test set-up builds collectives._callpath_c: reported as compiled; COLLECTIVES_COMPILED=0 says off."""
    assert report["call_path_compiled"] is True
    assert "call path compiled: yes" in run_info()
    monkeypatch.setenv("COLLECTIVES_COMPILED", "0")
    assert "call path compiled: no, off (COLLECTIVES_COMPILED=0)" in run_info()


def test_every_compiled_form_is_reported(monkeypatch, report):
    """The test set-up builds every compiled form: each reported as running; COLLECTIVES_COMPILED=0
    names every one as off."""
    from collectives.info import COMPILED_FORMS  # noqa: PLC0415

    assert report["compiled_forms"] == dict.fromkeys(COMPILED_FORMS, True)
    assert f"compiled forms: {len(COMPILED_FORMS)} of {len(COMPILED_FORMS)} run\n" in run_info()
    monkeypatch.setenv("COLLECTIVES_COMPILED", "0")
    [line] = [line for line in run_info().splitlines() if line.startswith("compiled forms:")]
    assert line.startswith(f"compiled forms: 0 of {len(COMPILED_FORMS)} run; not ")
    assert [name for name in COMPILED_FORMS if name not in line] == [] and line.endswith("off (COLLECTIVES_COMPILED=0)")


def test_forced_cuda_awareness_is_reported_as_forced(monkeypatch):
    monkeypatch.setenv("COLLECTIVES_MPI_CUDA_AWARE", "1")
    text = run_info()
    assert "CUDA-aware: yes [COLLECTIVES_MPI_CUDA_AWARE=1]" in text


def test_gpus_and_torch_nccl_match_torch(report):
    import torch

    assert len(report["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if not torch.cuda.is_available():
        assert "GPUs: none seen" in run_info()


def test_importing_collectives_imports_no_transport_and_not_info():
    code = ("import sys, collectives, collectives.registry; "
            "print(sorted(m for m in ('torch', 'mpi4py', 'cupy', 'collectives.info') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", out.stderr


def run_command(*args):
    """The installed ``collectives-info`` console script (pyproject's [project.scripts])."""
    command = Path(sys.executable).with_name("collectives-info")
    assert command.is_file(), f"{command} is not installed: reinstall the package (make .venv/.installed)"
    return subprocess.run([str(command), *args], env=without_launcher_variables(os.environ), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_collectives_info_command_reports_what_the_module_does(report):
    done = run_command("--json")
    assert done.returncode == 0, done.stderr
    command_report = json.loads(done.stdout)
    assert {name: entry["usable"] for name, entry in command_report["backends"].items()} == {
        name: entry["usable"] for name, entry in report["backends"].items()}
    assert command_report["launcher"] is None
    assert "usage: collectives-info" in run_command("--help").stdout


def test_require_exits_1_naming_the_unavailable_backend(report):
    usable = [name for name, entry in report["backends"].items() if entry["usable"]]
    unusable = [name for name, entry in report["backends"].items() if not entry["usable"]]
    assert run_command("--require", ",".join(usable)).returncode == 0
    if not unusable:
        pytest.skip("every backend is usable here")
    done = run_command("--require", f"local,{unusable[0]}")
    assert done.returncode == 1
    assert f"required backend {unusable[0]!r} is unavailable: {report['backends'][unusable[0]]['why']}" in done.stderr


def test_require_rejects_an_unknown_backend_listing_the_valid_ones():
    done = run_command("--require", "nccl")
    assert done.returncode == 2
    assert "'nccl' names no backend of: local, torch, mpi, cupy" in done.stderr


@pytest.mark.parametrize("runtime, build, gate, source", [
    ((2, 30, 7), (2, 28, 9), (2, 30, 7), "runtime"),     # a newer libnccl in place of the wheel's
    (23007, 22809, (2, 30, 7), "runtime"),               # ncclGetVersion's integers (CuPy)
    (AttributeError, (2, 28, 9, ""), (2, 28, 9), "build"),  # a torch without the runtime call
    (RuntimeError, RuntimeError, None, ""),              # a CPU build: no NCCL at all
])
def test_nccl_versions_gate_on_the_runtime_version_then_the_build_one(monkeypatch, runtime, build, gate, source):
    from collectives import info

    def reader(value):
        def read():
            if isinstance(value, type) and issubclass(value, Exception):
                raise value("not here")
            return value
        return read

    monkeypatch.setattr(info, "_nccl_readers", lambda library: {"runtime": reader(runtime), "build": reader(build)})
    versions = info.nccl_versions("torch")
    assert (versions["gate"], versions["gate_source"]) == (gate, source)
    assert versions["build"] == (None if build is RuntimeError else (2, 28, 9))


def test_nccl_versions_of_this_torch_and_an_unknown_library():
    import torch

    from collectives import info

    versions = info.nccl_versions("torch")
    if not torch.cuda.is_available():  # the CPU build has no NCCL: nothing known, nothing raised
        assert versions == {"runtime": None, "build": None, "gate": None, "gate_source": ""}
    with pytest.raises(ValueError, match="library must be 'torch' or 'cupy'"):
        info.nccl_versions("gloo")


@pytest.mark.parametrize("args", [(), ("--json",)], ids=["text", "json"])
def test_a_reader_that_closes_early_ends_it_quietly(args):
    """``collectives-info | head -1``: the pipe's reader is gone before the report is written
    (here closed at once); the command ends as a tool that SIGPIPE ends, with no traceback."""
    env = {**without_launcher_variables(os.environ),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "collectives.info", *args], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # before the report is written: its write finds no reader
    stderr = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 128 + 13, stderr
    assert stderr == ""
