"""The torch-facing tests on each torch release: ``make test-torch-versions``.

    python scripts/torch_versions.py 2.11.0 2.15.0            # a table of counts at the end
    python scripts/torch_versions.py 2.15.0 -- -k ddp          # after --: passed to pytest

For each release a venv ``.venv-torch-X.Y.Z`` holds that torch (and what it brings: the
index's Linux builds are the CUDA ones, which run on CPU) and reaches everything else of
``.venv`` through a .pth file (scripts/environments.py's overlay), so torch is the one
difference. The wheels are downloaded once into ``~/.cache/collectives-wheels`` (under
``$XDG_CACHE_HOME`` where set; every checkout of the user shares it) and installed from there. The
machine's pip may cap torch (a constraints file): each venv's pip commands get a
``PIP_CONSTRAINT`` of their own that pins the release asked for. 2.13.0, the project's own
test pin, runs in ``.venv``.

The tests: tests/torch_distributed (torch.distributed over the "collectives" backend, DDP,
FSDP2, torch's own suite slice), tests/syncbn, the torch rows of tests/collective_calls, and
tests/elastic (fault tolerance reaches into torch.distributed's tables of groups);
a FutureWarning or DeprecationWarning (torch deprecating something we call) is an error.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from environments import BASE, ROOT, counts, log, overlay_venv, report, with_selection  # noqa: E402

WHEELS = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "collectives-wheels"
#: The release `make test` pins (pyproject.toml's [test] extra): its venv is .venv.
PINNED = "2.13.0"
TESTS = ["tests/torch_distributed", "tests/syncbn", "tests/collective_calls", "tests/elastic"]
#: In tests/collective_calls, the torch rows: torch worlds and torch arrays.
SELECT = "not collective_calls or torch"
#: Every FutureWarning and DeprecationWarning is an error, in the test process and in the ranks
#: (they inherit it): torch deprecating what the library or its tests call fails the run. But
#: torch's own: 2.11's torch.distributed.optim applies torch.jit.script and jit.interface, which
#: 2.11 deprecates, when torch's distributed test base imports it (the last filter wins).
WARNINGS = "error::FutureWarning,error::DeprecationWarning,ignore:`torch.jit.:DeprecationWarning"


def venv_for(version: str) -> Path:
    if version == PINNED:
        return BASE
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as pin:
        pin.write(f"torch=={version}\n")
    try:
        return overlay_venv(ROOT / f".venv-torch-{version}", [f"torch=={version}"],
                            pip_env={"PIP_CONSTRAINT": pin.name}, wheels=WHEELS, share_mpi=True)
    finally:
        os.unlink(pin.name)


def run(version: str, pytest_args: list[str]) -> tuple[int, dict[str, int], float]:
    import subprocess  # noqa: PLC0415

    venv = venv_for(version)
    command = [str(venv / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS,
               *with_selection(pytest_args, SELECT)]
    env = {**os.environ, "PYTHONWARNINGS": WARNINGS,
           "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    log(f"torch {version}: {' '.join(command)}")
    start = time.monotonic()
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    lines = []
    assert process.stdout is not None
    for line in process.stdout:
        sys.stdout.write(line)
        lines.append(line)
    code = process.wait()
    return code, counts("".join(lines)), time.monotonic() - start


def main(argv: list[str]) -> int:
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else []
    versions = argv[:argv.index("--")] if "--" in argv else argv
    if not versions or any(not re.fullmatch(r"\d+\.\d+\.\d+", v) for v in versions):
        raise SystemExit("usage: torch_versions.py X.Y.Z [X.Y.Z ...] [-- PYTEST_ARGS]")
    results = [(f"torch {version:<8}", *run(version, pytest_args)) for version in versions]
    return report("test-torch-versions: torch, pytest counts, seconds", results, width=40)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
