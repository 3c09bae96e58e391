"""The multi-rank NCCL phase of scripts/gpu_check.sh, on CPU: scripts/gpu_nccl.sh cuts a library
into parts under 60 MiB with its sha256 (what scripts/fetch_gpu_nccl.sh does with NCCL 2.30's
libnccl.so.2), joins and checks them, and swaps the result in place of a python's
site-packages/nvidia/nccl/lib/libnccl.so.2 and back; gpu_check.sh with GPU_CHECK_NCCL does that
around a run (rehearsed with tests/gpu/fake_gpu_phases.py against a stand-in site-packages), and
puts the original back when it fails, when it is stopped from outside, and after a SIGKILL.
"""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAKE = "tests/gpu/fake_gpu_phases.py"


def nccl(function, *args):
    """One function of scripts/gpu_nccl.sh: (exit status, what it printed)."""
    done = subprocess.run(["bash", "-c", 'source scripts/gpu_nccl.sh && "$@"', "gpu_nccl", function, *map(str, args)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout + done.stderr


@pytest.fixture
def library(tmp_path):
    """A 2.5 MiB stand-in for libnccl.so.2 (random bytes)."""
    path = tmp_path / "built" / "libnccl.so.2"
    path.parent.mkdir()
    path.write_bytes(os.urandom(5 * 512 * 1024))
    return path


def test_split_makes_parts_under_the_limit_that_join_to_the_checked_library(tmp_path, library):
    parts = tmp_path / "parts"
    assert nccl("nccl_split", library, parts, 1)[0] == 0
    pieces = sorted(parts.glob("part-*"))
    assert [piece.name for piece in pieces] == ["part-00", "part-01", "part-02"]
    assert all(piece.stat().st_size <= 1024 * 1024 for piece in pieces)
    want = hashlib.sha256(library.read_bytes()).hexdigest()
    assert (parts / "libnccl.so.2.sha256").read_text().split() == [want, "libnccl.so.2"]
    joined = tmp_path / "joined"
    assert nccl("nccl_assemble", parts, joined) == (0, "")
    assert joined.read_bytes() == library.read_bytes()
    status, said = nccl("nccl_split", library, tmp_path / "big", 60)
    assert status == 2 and "under 60 MiB" in said


def test_a_damaged_or_missing_part_is_refused(tmp_path, library):
    parts = tmp_path / "parts"
    nccl("nccl_split", library, parts, 1)
    (parts / "part-02").unlink()
    status, said = nccl("nccl_assemble", parts, tmp_path / "joined")
    assert status == 1 and "sha256 of the joined parts" in said and not (tmp_path / "joined").exists()
    status, said = nccl("nccl_assemble", tmp_path / "nothing", tmp_path / "joined")
    assert status == 1 and "no parts" in said


def site_packages(tmp_path, content=b"NCCL 2.28.9 wheel"):
    """A stand-in site-packages holding nvidia/nccl/lib/libnccl.so.2 (a namespace package, as the wheel's)."""
    lib = tmp_path / "site" / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(content)
    return lib


def test_swap_in_and_restore_keep_the_original_even_across_a_second_swap(tmp_path, library):
    lib = site_packages(tmp_path)
    assert nccl("nccl_swap_in", lib, library)[0] == 0
    assert lib.read_bytes() == library.read_bytes()
    saved = Path(f"{lib}.gpu-check-saved")
    assert saved.read_bytes() == b"NCCL 2.28.9 wheel"
    assert nccl("nccl_swap_in", lib, library)[0] == 0  # a check killed before it put the original back
    assert saved.read_bytes() == b"NCCL 2.28.9 wheel"
    assert nccl("nccl_restore", lib) == (0, "")
    assert lib.read_bytes() == b"NCCL 2.28.9 wheel" and not saved.exists()
    assert nccl("nccl_restore", lib) == (0, "")  # nothing to put back
    assert lib.read_bytes() == b"NCCL 2.28.9 wheel"


def check(tmp_path, parts, lib, **extra):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "GPU_CHECK_AS_IF_CUDA": "1",
           "GPU_CHECK_TESTS": FAKE, "GPU_CHECK_NCCL": str(parts), "FAKE_GPU_RECORD": str(tmp_path / "record.txt"),
           "FAKE_GPU_SHOW": "NCCL_MULTI_RANK_GPU_ENABLE NCCL_MAX_CTAS", "FAKE_GPU_LIBRARY": str(lib),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])),
           **extra}
    return subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def result(tmp_path):
    report = (tmp_path / "out" / "gpu_report.md").read_text()
    return report, [line for line in report.splitlines() if line.startswith("Result: ")]


@pytest.mark.timeout(300)
def test_the_check_runs_the_two_rank_worlds_on_the_carried_nccl_and_puts_the_wheels_back(tmp_path):
    library = tmp_path / "libnccl.so.2"
    library.write_bytes(b"NCCL 2.30.7 carried" + os.urandom(4096))
    parts = tmp_path / "parts"
    nccl("nccl_split", library, parts, 1)
    (parts / "VERSION").write_text("2.30.7\n")
    lib = site_packages(tmp_path, b"junk a SIGKILL left")
    Path(f"{lib}.gpu-check-saved").write_bytes(b"NCCL 2.28.9 wheel")  # what a killed check left aside

    assert check(tmp_path, parts, lib).wait(timeout=240) == 0
    report, (line,) = result(tmp_path)
    assert line.startswith("Result: PASS (rehearsal"), report
    assert "- NCCL: the python's libnccl.so.2, left aside by an earlier check, put back" in report
    assert f"- NCCL: 2.30.7 from {parts} (sha256 checked) in place of {lib}" in report
    worlds = "torch-nccl-2 or cupy-2 or cupy-timeout-2 or elastic-torch-nccl-2"
    assert f'- the full run\'s selection: -k "{worlds}"' in report
    seen = "NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS=8 library=NCCL 2.30.7 carr"
    assert (tmp_path / "record.txt").read_text().splitlines() == [
        f"smoke {seen}", f"full torch-nccl-2 {seen}", f"smoke {seen}"]
    assert lib.read_bytes() == b"NCCL 2.28.9 wheel" and not Path(f"{lib}.gpu-check-saved").exists()

    (parts / "part-00").write_bytes(b"damaged")  # a part damaged on the way: nothing swapped, a failure
    assert check(tmp_path, parts, lib).wait(timeout=240) == 1
    report, (line,) = result(tmp_path)
    assert line.startswith("Result: FAIL (GPU_CHECK_NCCL: sha256 of the joined parts"), report
    assert lib.read_bytes() == b"NCCL 2.28.9 wheel"


@pytest.mark.timeout(300)
def test_the_check_stopped_from_outside_puts_the_wheels_nccl_back(tmp_path):
    library = tmp_path / "libnccl.so.2"
    library.write_bytes(b"NCCL 2.30.7 carried")
    parts = tmp_path / "parts"
    nccl("nccl_split", library, parts, 1)
    lib = site_packages(tmp_path)
    running = check(tmp_path, parts, lib, FAKE_GPU_CASE="smoke-hang")
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "record.txt").exists():  # the smoke's test hangs on the carried NCCL
            assert running.poll() is None and time.monotonic() < deadline, "the smoke did not start"
            time.sleep(0.2)
        assert lib.read_bytes() == b"NCCL 2.30.7 carried"
        running.send_signal(signal.SIGTERM)
        assert running.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if running.poll() is None:
            running.kill()
    report, (line,) = result(tmp_path)
    assert line.startswith("Result: INCOMPLETE (stopped by SIGTERM during the smoke phase"), report
    assert lib.read_bytes() == b"NCCL 2.28.9 wheel" and not Path(f"{lib}.gpu-check-saved").exists()
