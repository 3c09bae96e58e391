"""The Python half of scripts/gpu_check.sh: its pre-flight, and the summary of its test runs.

    python scripts/gpu_check.py preflight            # markdown on stdout; exit 0 ok, 2 no CUDA, 1 stop
    python scripts/gpu_check.py summary JUNIT...     # markdown: counts, failures, skips by reason
    python scripts/gpu_check.py smoke-failures JUNIT # "backend: why; ..." of the failed smoke tests
    python scripts/gpu_check.py launcher NAME        # the tests' command line for NAME (mpiexec)

The pre-flight runs in the interpreter the check uses (the device image's python), in one
process, in seconds: every import the tests need (the project as installed, torch, CuPy,
mpi4py, pytest), which form of each optional compiled module loaded, the GPUs CUDA shows, the NCCL
of torch and of CuPy (the loaded library's and the build's; collectives.info.nccl_versions, which
the GPU tests' gates read too) and every libnccl mapped
into the process, the MPI library and mpiexec, torchrun and collectives-bench (console scripts
or their ``python -m`` forms), and which GPU worlds the machine cannot run and why. The
summary needs only the standard library.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OK, STOP, NO_CUDA = 0, 1, 2


def _version(version: object) -> str:
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _nccl_text(library: str) -> str:
    """collectives.info.nccl_versions(library): the version the gates read, then both."""
    from collectives.info import nccl_versions  # noqa: PLC0415

    versions = nccl_versions(library)
    if versions["gate"] is None:
        raise RuntimeError("no NCCL version readable (no NCCL in this build?)")
    runtime = _version(versions["runtime"]) if versions["runtime"] else "unknown"
    build = _version(versions["build"]) if versions["build"] else "unknown"
    return (f"{_version(versions['gate'])} (runtime {runtime}, build {build}; "
            f"the gates read the {versions['gate_source']})")


def _compiled_forms() -> str:
    """Which form of each optional compiled module loaded: compiled, or the Python beside it."""
    from collectives.backends import cupy_plans, mpi_carried, mpi_round  # noqa: PLC0415

    from collectives import config, front  # noqa: PLC0415

    why = "off, COLLECTIVES_COMPILED=0" if not config.compiled() else "not built or stale"
    forms = {"collectives._callpath_c (call path)": front.compiled_module(),
             "collectives.backends._round_c (MPI round)": mpi_round.compiled_module(),
             "collectives.backends._carried_c (MPI carried calls)": mpi_carried.compiled_carrier(),
             "collectives.backends._cupy_fast_c (cupy planned calls)": cupy_plans.compiled_fast_module()}
    return "; ".join(f"{name}: {'compiled' if module is not None else f'Python ({why})'}"
                     for name, module in forms.items())


def preflight() -> int:
    """Print the pre-flight's findings as markdown; return OK, NO_CUDA (a dry run) or STOP."""
    start = time.monotonic()
    fatal: list[str] = []
    lines: list[str] = []

    def found(what: str, text: str) -> None:
        lines.append(f"- {what}: {text}")

    def problem(what: str, error: BaseException, stop: bool) -> None:
        text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        found(what, ("**FAILED** " if stop else "unavailable: ") + text)
        if stop:
            fatal.append(f"{what}: {text}")

    # The project, as installed: collectives.backends and collectives.syncbn exist only there.
    try:
        import collectives  # noqa: PLC0415

        for name in ("collectives.backends.torch_dist", "collectives.backends.mpi",
                     "collectives.backends.cupy_nccl", "collectives.syncbn", "collectives.testing.plugin",
                     "collectives.bench", "collectives.info"):
            importlib.import_module(name)
        where = Path(collectives.__file__).resolve().parent
        found("collectives", f"{collectives.__version__} from {where}"
              + ("" if str(where).startswith(str(ROOT)) else f" (NOT this checkout, {ROOT})"))
        if not str(where).startswith(str(ROOT)):
            fatal.append(f"collectives is imported from {where}, not from this checkout")
    except Exception as error:  # noqa: BLE001  (the finding)
        problem("collectives (installed)", error, stop=True)
    for name in ("pytest", "pytest_timeout", "numpy"):
        try:
            module = importlib.import_module(name)
            found(name, getattr(module, "__version__", "present"))
        except Exception as error:  # noqa: BLE001
            problem(name, error, stop=name != "pytest_timeout")
    def check(what: str, finding: Callable[[], str], stop: bool = False) -> None:
        try:
            found(what, finding())
        except Exception as error:  # noqa: BLE001  (the finding)
            problem(what, error, stop)

    check("compiled modules", _compiled_forms)
    cuda = False
    try:
        import torch  # noqa: PLC0415

        cuda = bool(torch.cuda.is_available())
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []
        found("torch", f"{torch.__version__} (CUDA {torch.version.cuda or 'none'}); "
                       f"GPUs: {', '.join(gpus) if gpus else 'none visible'}")
        check("torch NCCL", lambda: _nccl_text("torch"))
    except Exception as error:  # noqa: BLE001
        problem("torch", error, stop=True)
    if importlib.util.find_spec("cupy") is None:
        found("CuPy", "not installed (the cupy worlds skip)")
    else:
        def cupy_finding() -> str:
            import cupy  # noqa: PLC0415

            return f"{cupy.__version__}; NCCL {_nccl_text('cupy')}"

        check("CuPy", cupy_finding)
        if "cupy" in sys.modules:
            check("CuPy GPUs", lambda: str(int(sys.modules["cupy"].cuda.runtime.getDeviceCount())))
    try:
        with open("/proc/self/maps") as maps:
            loaded = sorted({line.split()[-1] for line in maps if "libnccl" in line})
        found("libnccl mapped (torch, then CuPy, imported)", ", ".join(loaded) if loaded else "none")
        if len(loaded) > 1:
            found("note", "two libnccl builds in one process (cupy/cupy#8354): see docs/gpu.md")
    except OSError as error:
        problem("libnccl mapped", error, stop=False)
    try:
        from collectives.info import mpi_report  # noqa: PLC0415

        report = mpi_report()
        if report["usable"]:
            found("MPI", f"{report['library']} (mpi4py {report['mpi4py']}); CUDA-aware: "
                         f"{'yes' if report['cuda_aware'] else 'no'} [{report['cuda_aware_source']}]")
        else:
            found("MPI", f"unavailable: {report['why']} (the mpi worlds skip)")
    except Exception as error:  # noqa: BLE001
        problem("MPI", error, stop=False)
    try:
        from collectives.testing.launch import launcher_command  # noqa: PLC0415

        for name in ("mpiexec", "torchrun"):
            try:
                found(name, " ".join(launcher_command(name)))
            except Exception as error:  # noqa: BLE001
                problem(name, error, stop=False)
    except Exception as error:  # noqa: BLE001
        problem("launchers", error, stop=True)
    bench = shutil.which("collectives-bench") or (Path(sys.executable).parent / "collectives-bench")
    found("collectives-bench", str(bench) if Path(bench).exists() else
          f"no console script; the tests run `{sys.executable} -m collectives.bench`")
    if cuda and not fatal:
        try:
            sys.path.insert(0, str(ROOT / "tests" / "gpu"))
            import test_gpu  # noqa: PLC0415

            reasons = test_gpu.world_skip_reasons(test_gpu.Machine.probe())
            skipped = [f"{world}: {reason}" for world, reason in reasons.items() if reason]
            found("worlds this machine cannot run", f"{len(skipped)} of {len(reasons)}")
            lines.extend(f"  - {line}" for line in skipped)
        except Exception as error:  # noqa: BLE001
            problem("GPU worlds", error, stop=False)
    print("\n".join(lines))
    print(f"- pre-flight took {time.monotonic() - start:.1f} s")
    if fatal:
        print("\nPRE-FLIGHT FAILED: " + "; ".join(fatal))
        return STOP
    if not cuda:
        print("\nno CUDA device (torch.cuda.is_available() is False)")
        return NO_CUDA
    return OK


# -- the test runs' junit XML -------------------------------------------------------------------------

def _cases(paths: list[str]) -> list[tuple[str, str, str]]:
    """(test id, outcome, message) of every test case in the junit files that exist."""
    cases = []
    for path in paths:
        if not os.path.exists(path):
            continue
        try:
            tree = ElementTree.parse(path)
        except ElementTree.ParseError:
            cases.append((path, "error", "junit XML unreadable (pytest killed?)"))
            continue
        for case in tree.iter("testcase"):
            if case.get("name") is None:  # what pytest writes for the test a Ctrl-C (timeout -s INT) stopped
                cases.append((path, "error", "a test was stopped before it ended (pytest interrupted: "
                                             "its junit entry has no name; see gpu_check.log)"))
                continue
            name = f"{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                element = case.find(tag)
                if element is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
                    message = (element.get("message") or element.text or "").strip()
                    break
            cases.append((name, outcome, message))
    return cases


def summary(paths: list[str]) -> int:
    """Markdown: counts, then every failure, then every skip grouped by its reason."""
    cases = _cases(paths)
    counts: dict[str, int] = defaultdict(int)
    for _, outcome, _ in cases:
        counts[outcome] += 1
    print(", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no test ran")
    failed = [(name, message) for name, outcome, message in cases if outcome in ("failed", "error")]
    if failed:
        print("\n### Failed\n")
        for name, message in failed:
            print(f"- `{name}`: {message.splitlines()[0][:400] if message else ''}")
    skipped: dict[str, list[str]] = defaultdict(list)
    for name, outcome, message in cases:
        if outcome == "skipped":
            skipped[message.removeprefix("Skipped: ")].append(name)
    if skipped:
        print("\n### Skipped: not exercised on this machine, and why\n")
        for reason, names in sorted(skipped.items(), key=lambda item: -len(item[1])):
            print(f"- {len(names)} test(s): {reason}")
            for name in names[:6]:
                print(f"  - `{name}`")
            if len(names) > 6:
                print(f"  - ... and {len(names) - 6} more")
    return 1 if failed else 0


def smoke_failures(paths: list[str]) -> int:
    """Print ``backend: why; ...`` for each backend whose smoke test failed (test_gpu's format)."""
    broken = {}
    for name, outcome, message in _cases(paths):
        if outcome in ("failed", "error") and "[" in name:
            world = name.rsplit("[", 1)[1].rstrip("]")
            backend = world.split("-", 1)[0]
            first = message.splitlines()[0][:150].replace(";", ",") if message else outcome
            broken.setdefault(backend, f"{world}: {first}")
    print("; ".join(f"{backend}: {why}" for backend, why in broken.items()))
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("preflight", "summary", "smoke-failures", "launcher"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        if argv[0] == "preflight":
            return preflight()
        if argv[0] == "launcher":  # the command line the tests use for a launcher, e.g. mpiexec
            from collectives.testing.launch import launcher_command  # noqa: PLC0415

            print(" ".join(launcher_command(argv[1])))
            return 0
        return summary(argv[1:]) if argv[0] == "summary" else smoke_failures(argv[1:])
    except Exception:  # noqa: BLE001  (a bug here must not lose the report)
        traceback.print_exc(file=sys.stdout)
        return STOP


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
