"""``python -m collectives.info``: what this machine can run, and why not.

Prints, per backend, whether it is usable here and the reason when it is not; the MPI
library and its version, and whether it takes CUDA memory; the NCCL versions CuPy and
torch loaded (they can differ: cupy/cupy#8354); and the GPUs seen. Every transport is
imported here, lazily, one at a time, and a failure is reported rather than raised.
``--json`` prints the same as one JSON object; ``--require mpi,torch`` exits with status 1
when one of the named backends is unusable here (a check for job scripts, like
``horovodrun --check-build``). Installed as the ``collectives-info`` command.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from . import config, front
from .launcher import detect_launcher


def _version_text(version: tuple[int, ...] | None) -> str:
    return "unknown" if version is None else ".".join(map(str, version))


#: An NCCL version: (major, minor, patch).
NcclVersion = tuple[int, int, int]


def _as_nccl_version(value: object) -> NcclVersion | None:
    """``ncclGetVersion``'s integer, or a tuple that starts (major, minor, patch), as a version."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        from collectives.backends.cupy_plans import decode_nccl_version  # noqa: PLC0415

        return decode_nccl_version(value)
    if isinstance(value, tuple) and len(value) >= 3 and all(isinstance(part, int) for part in value[:3]):
        return (value[0], value[1], value[2])
    return None


def _read_nccl_version(read: Callable[[], object]) -> NcclVersion | None:
    """What ``read`` gives, as a version; None where it raises or gives none."""
    try:
        return _as_nccl_version(read())
    except Exception:  # noqa: BLE001  (an older torch, a CPU build, a CuPy without NCCL)
        return None


def _nccl_readers(library: str) -> dict[str, Callable[[], object]]:
    """The calls that read ``library``'s NCCL versions: the library it loaded ("runtime", which a
    libnccl put in place of the wheel's changes) and the headers it was built with ("build")."""
    if library == "torch":
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        def torch_runtime() -> object:
            # A static method binding ncclGetVersion of the libnccl torch loaded (torch's stub
            # declares a `self` it does not take); absent from CPU builds.
            process_group_nccl: Any = dist.ProcessGroupNCCL
            return process_group_nccl.get_runtime_nccl_version()

        return {"runtime": torch_runtime, "build": torch.cuda.nccl.version}  # build: the NCCL_* macros
    from collectives.backends.cupy_channel import import_cupy_nccl  # noqa: PLC0415

    def cupy_nccl() -> Any:
        return import_cupy_nccl()[1]

    return {"runtime": lambda: cupy_nccl().get_version(), "build": lambda: cupy_nccl().get_build_version()}


def nccl_versions(library: str) -> dict[str, Any]:
    """The NCCL of ``library`` ("torch" or "cupy"): ``runtime`` (the loaded libnccl's), ``build``
    (the headers'), and ``gate``: the version that decides what NCCL allows (several ranks on one
    GPU from 2.30), the runtime one where the library can tell it, else the build one; ``gate_source``
    names which. Every check that gates on NCCL's version reads ``gate`` from here. Each is None
    where unknown (no NCCL, no such library)."""
    if library not in ("torch", "cupy"):
        raise ValueError(f"library must be 'torch' or 'cupy', not {library!r}")
    try:
        readers = _nccl_readers(library)
    except Exception:  # noqa: BLE001  (the library is not installed or does not import)
        return {"runtime": None, "build": None, "gate": None, "gate_source": ""}
    runtime, build = _read_nccl_version(readers["runtime"]), _read_nccl_version(readers["build"])
    gate, source = (runtime, "runtime") if runtime else (build, "build") if build else (None, "")
    return {"runtime": runtime, "build": build, "gate": gate, "gate_source": source}


def torch_report() -> dict[str, Any]:
    """torch, its CUDA and NCCL, and whether torch.distributed is there."""
    if importlib.util.find_spec("torch") is None:
        return {"usable": False, "why": "torch is not installed (pip install 'pycollectives[torch]')"}
    try:
        import torch  # noqa: PLC0415
    except Exception as error:  # noqa: BLE001  (a broken install is a reason, not a crash)
        return {"usable": False, "why": f"import torch failed: {error}"}
    report: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                              "cuda_available": bool(torch.cuda.is_available())}
    import torch.distributed as dist  # noqa: PLC0415

    if not dist.is_available():
        return {**report, "usable": False, "why": "this torch build has no torch.distributed"}
    report["gloo"] = bool(dist.is_gloo_available())
    report["nccl_available"] = bool(dist.is_nccl_available())
    report["nccl"] = None
    if dist.is_nccl_available():
        versions = nccl_versions("torch")
        report["nccl"], report["nccl_build"] = versions["gate"], versions["build"]
    transports = ["gloo (CPU tensors)"] if report["gloo"] else []
    if report["nccl_available"] and report["cuda_available"]:
        transports.append("nccl (CUDA tensors)")
    elif report["nccl_available"]:
        report["cuda_why"] = "NCCL is built in, but no CUDA device is visible"
    else:
        report["cuda_why"] = "this torch build has no NCCL (CPU build): CUDA tensors cannot be reduced"
    report["usable"] = bool(transports)
    report["transports"] = transports
    if not transports:
        report["why"] = "neither Gloo nor NCCL is built into this torch"
    return report


def mpi_report() -> dict[str, Any]:
    """mpi4py, the MPI library it loaded, and whether that library is CUDA-aware."""
    if importlib.util.find_spec("mpi4py") is None:
        return {"usable": False, "why": "mpi4py is not installed (pip install 'pycollectives[mpi,mpich]'; "
                                        "only [mpi] with a cluster MPI)"}
    try:
        from mpi4py import MPI  # noqa: PLC0415
    except Exception as error:  # noqa: BLE001
        return {"usable": False, "why": f"mpi4py cannot load an MPI library: {error} "
                                        "(pip install mpich, or set MPI4PY_LIBMPI)"}
    from collectives.backends.mpi_buffers import mpi_cuda_aware  # noqa: PLC0415
    from collectives.backends.mpi_carried import compiled_carrier  # noqa: PLC0415
    from collectives.backends.mpi_library import library_version  # noqa: PLC0415
    from collectives.backends.mpi_round import compiled_module  # noqa: PLC0415

    library = library_version(MPI)
    compiled = compiled_module() is not None and compiled_carrier() is not None
    forced = os.environ.get(config.MPI_CUDA_AWARE, "").strip()
    try:
        aware = mpi_cuda_aware(MPI)
    except ValueError as error:
        aware, forced = False, f"invalid: {error}"
    return {"usable": True, "library": library, "mpi_version": ".".join(map(str, MPI.Get_version())),
            "mpi4py": importlib.import_module("mpi4py").__version__,
            "cuda_aware": aware, "cuda_aware_source": f"{config.MPI_CUDA_AWARE}={forced}" if forced
            else "MPIX_Query_cuda_support of the loaded libmpi",
            "compiled": compiled, "compiled_why": "" if compiled else _not_compiled()}


#: Why a compiled form that ``COLLECTIVES_COMPILED`` leaves on does not run, and what to do:
#: said by ``collectives-info`` and by the warning of :func:`warn_if_not_compiled`.
NOT_BUILT = ("not built (no C compiler or Python headers at install) or built from other sources: the Python "
             "form runs, a small call 2-3 times slower; install a C compiler and the Python headers "
             "(Debian: gcc python3-dev) and reinstall without pip's cache (pip install --no-cache-dir "
             f"--force-reinstall pycollectives), or set {config.COMPILED}=0 to choose the Python form")


def _not_compiled() -> str:
    """Why a compiled form does not run (``COLLECTIVES_COMPILED=0``, or it was not built)."""
    return f"off ({config.COMPILED}=0)" if not config.compiled() else NOT_BUILT


class NotCompiledWarning(RuntimeWarning):
    """The compiled forms were not built: the Python form runs (see :func:`warn_if_not_compiled`)."""


_warned = False


#: The compiled forms an install builds (setup.py's COMPILED, the same modules): the compiled module
#: -> the Python module it is compiled from (its twin, which runs where it is not there).
COMPILED_FORMS = {"collectives._callpath_c": "collectives.callpath",
                  "collectives._host_views_c": "collectives.host_views",
                  "collectives._wire_c": "collectives.wire",
                  "collectives._reliability_c": "collectives.reliability",
                  "collectives.backends._p2p_c": "collectives.backends.mpi_p2p",
                  "collectives.backends._moves_c": "collectives.backends.mpi_moves",
                  "collectives.backends._round_c": "collectives.backends.mpi_round",
                  "collectives.backends._carried_c": "collectives.backends.mpi_carried",
                  "collectives.backends._uneven_c": "collectives.backends.mpi_uneven",
                  "collectives.backends._cupy_fast_c": "collectives.backends.cupy_fast"}


def compiled_forms() -> dict[str, bool]:
    """Whether each of :data:`COMPILED_FORMS` runs here: built from the installed sources, and
    ``COLLECTIVES_COMPILED`` leaving it on (``collectives.config.compiled_extension``). Imports
    no transport (the twins take theirs as arguments)."""
    return {name: config.compiled_extension(name, importlib.import_module(twin)) is not None
            for name, twin in COMPILED_FORMS.items()}


def warn_if_not_compiled() -> None:
    """A :class:`NotCompiledWarning`, once per process, naming every compiled form (of
    :data:`COMPILED_FORMS`: the call path, the check, the MPI backend's round, small, uneven,
    even-shaped and point-to-point calls, the cupy backend's planned calls) that is missing though
    ``COLLECTIVES_COMPILED`` leaves them on. Called when an MPI transport is made;
    ``COLLECTIVES_COMPILED=0`` silences it."""
    global _warned
    if _warned or not config.compiled():
        return
    _warned = True
    missing = [name for name, runs in compiled_forms().items() if not runs]
    if missing:
        warnings.warn(f"collectives: the compiled forms of {', '.join(missing)} are {NOT_BUILT}",
                      NotCompiledWarning, stacklevel=2)


def cupy_report() -> dict[str, Any]:
    """CuPy, its CUDA runtime, the NCCL it loaded, and the devices it sees."""
    if importlib.util.find_spec("cupy") is None:
        return {"usable": False, "why": "cupy is not installed (pip install 'pycollectives[cupy]', "
                                        "i.e. cupy-cuda13x; cupy-cuda12x for CUDA 12)"}
    try:
        from collectives.backends.cupy_channel import import_cupy_nccl  # noqa: PLC0415
        from collectives.backends.cupy_plans import decode_nccl_version  # noqa: PLC0415

        cupy, nccl = import_cupy_nccl()
    except Exception as error:  # noqa: BLE001  (BackendUnavailable, or a broken CUDA install)
        return {"usable": False, "why": str(error)}
    report: dict[str, Any] = {"version": cupy.__version__}
    try:
        report["nccl"] = decode_nccl_version(int(nccl.get_version()))
    except Exception as error:  # noqa: BLE001
        return {**report, "usable": False, "why": f"CuPy cannot load libnccl: {error}"}
    report["nccl_build"] = nccl_versions("cupy")["build"]
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as error:  # noqa: BLE001
        return {**report, "usable": False, "why": f"CuPy sees no CUDA device: {error}"}
    report["devices"] = count
    if count == 0:
        return {**report, "usable": False, "why": "CuPy sees no CUDA device"}
    return {**report, "usable": True}


def gpus_seen(torch_info: dict[str, Any]) -> list[str]:
    """Names of the CUDA devices, through torch if it has CUDA, else through CuPy."""
    if torch_info.get("cuda_available"):
        import torch  # noqa: PLC0415

        return [f"{i}: {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())]
    if "cupy" in sys.modules:
        cupy = sys.modules["cupy"]
        try:
            count = cupy.cuda.runtime.getDeviceCount()
            return [f"{i}: {cupy.cuda.runtime.getDeviceProperties(i)['name'].decode()}"
                    for i in range(count)]
        except Exception:  # noqa: BLE001
            return []
    return []


def collect() -> dict[str, Any]:
    """Everything ``main`` prints, as a dict."""
    launch = detect_launcher()
    torch_info = torch_report()
    mpi_info = mpi_report()
    cupy_info = cupy_report()
    backends = {
        "local": {"usable": True, "note": "world size 1, no transport"},
        "torch": torch_info,
        "mpi": mpi_info,
        "cupy": cupy_info,
    }
    compiled = front.compiled_module() is not None
    forms = compiled_forms()
    return {"launcher": launch.launcher, "rank": launch.rank, "size": launch.size,
            "backend_env": os.environ.get(config.BACKEND, ""),
            "call_path_compiled": compiled, "call_path_why": "" if compiled else _not_compiled(),
            "compiled_forms": forms, "compiled_forms_why": "" if all(forms.values()) else _not_compiled(),
            "backends": backends, "gpus": gpus_seen(torch_info),
            "nccl": {"cupy": cupy_info.get("nccl"), "torch": torch_info.get("nccl"),
                     "torch_build": torch_info.get("nccl_build")}}


def _forms_line(forms: dict[str, bool], why: str) -> str:
    """How many of the compiled forms run, and which do not and why."""
    missing = [name for name, runs in forms.items() if not runs]
    line = f"compiled forms: {len(forms) - len(missing)} of {len(forms)} run"
    return line if not missing else f"{line}; not {', '.join(missing)}: {why}"


def render(info: dict[str, Any]) -> str:
    """The human-readable report."""
    lines = [f"launcher: {info['launcher'] or 'none'} (rank {info['rank']} of {info['size']}); "
             f"{config.BACKEND}={info['backend_env'] or '(unset: auto)'}",
             f"call path compiled: {'yes' if info['call_path_compiled'] else 'no, ' + info['call_path_why']}",
             _forms_line(info["compiled_forms"], info["compiled_forms_why"])]
    for name, entry in info["backends"].items():
        state = "usable" if entry.get("usable") else "unavailable"
        detail = entry.get("note") or entry.get("why") or ""
        if name == "torch" and entry.get("usable"):
            detail = (f"torch {entry['version']} (CUDA {entry['cuda'] or 'none'}); "
                      f"{', '.join(entry['transports'])}")
            if entry.get("cuda_why"):
                detail += f"; {entry['cuda_why']}"
        if name == "mpi" and entry.get("usable"):
            aware = "yes" if entry["cuda_aware"] else "no (CUDA arrays staged through pinned host memory)"
            detail = (f"{entry['library']} (MPI {entry['mpi_version']}, mpi4py {entry['mpi4py']}); "
                      f"CUDA-aware: {aware} [{entry['cuda_aware_source']}]; "
                      f"check round compiled: {'yes' if entry['compiled'] else 'no, ' + entry['compiled_why']}")
        if name == "cupy" and entry.get("usable"):
            detail = f"CuPy {entry['version']}, {entry['devices']} CUDA device(s)"
        lines.append(f"  {name:6s} {state}: {detail}")
    nccl = info["nccl"]
    cupy_nccl = _version_text(nccl["cupy"]) if nccl["cupy"] else "not loaded (cupy unavailable)"
    torch_nccl = _version_text(nccl["torch"]) if nccl["torch"] else "none (torch has no NCCL here)"
    if nccl["torch"] and nccl.get("torch_build") and tuple(nccl["torch_build"]) != tuple(nccl["torch"]):
        torch_nccl += f" (built with {_version_text(nccl['torch_build'])})"
    lines.append(f"NCCL: cupy {cupy_nccl}; torch {torch_nccl}")
    if nccl["cupy"] and nccl["torch"] and tuple(nccl["cupy"]) != tuple(nccl["torch"]):
        lines.append("  note: CuPy and torch loaded different libnccl builds (see README: wheel set)")
    lines.append(f"GPUs: {', '.join(info['gpus']) if info['gpus'] else 'none seen'}")
    return "\n".join(lines)


def _backend_names(text: str) -> list[str]:
    from .registry import BACKENDS  # noqa: PLC0415

    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no backend of: {', '.join(BACKENDS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    """The ``collectives-info`` command (also ``python -m collectives.info``); returns the exit status."""
    command = os.path.basename(sys.argv[0]) if argv is None else ""
    parser = argparse.ArgumentParser(
        prog=command if command.startswith("collectives-info") else "python -m collectives.info",
        description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--require", type=_backend_names, default=[], metavar="NAME[,NAME]",
                        help="exit with status 1 unless every named backend is usable here")
    args = parser.parse_args(argv)
    info = collect()
    try:
        print(json.dumps(info, indent=2, default=str) if args.json else render(info), flush=True)
    except BrokenPipeError:
        # The reader closed early (``collectives-info | head -1``): end quietly, as a Unix tool
        # that SIGPIPE ends, with the status a shell gives one; stdout goes to /dev/null so
        # that the interpreter's flush at exit finds no pipe to fail on.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # 13: SIGPIPE
    missing = [name for name in args.require if not info["backends"][name]["usable"]]
    for name in missing:
        print(f"required backend {name!r} is unavailable: {info['backends'][name]['why']}", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
