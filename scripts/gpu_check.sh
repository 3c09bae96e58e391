#!/usr/bin/env bash
# The GPU check, in one call, within 6 minutes: install this checkout into the machine's python
# (from carried wheels only: no index there), a pre-flight (45 s), a 1-rank smoke of every backend,
# every GPU test (tests/gpu/test_gpu.py, marker gpu) over torch (NCCL), cupy and mpi, then a
# timing table of our all_reduce against the raw transports while time is left. Writes
# $OUT/gpu_report.md (versions, what was installed, the pre-flight, results, every skip and why,
# timings, each phase's time), with gpu_check.log, smoke_junit.xml, gpu_junit.xml and
# gpu_timing.md beside it.
#
#   OUT=/some/dir scripts/gpu_check.sh          # OUT defaults to ./gpu-check-out
#   PYTHON=python3 (default): the interpreter that has torch (and CuPy, mpi4py), e.g. the image's
#
# Carried wheels (.whl/, git-ignored; scripts/fetch_gpu_wheels.sh fills it where an index is
# reachable): setuptools (to build the checkout), MPICH (libmpi and mpiexec) and mpi4py, installed
# into that python only where it lacks them. docs/gpu.md lists the image's versions this expects
# and each phase's time budget. On a machine without CUDA it is a dry run: set-up and pre-flight,
# then every GPU test reported skipped with its reason; exit 0. Exit status: 0 when every test that
# could run passed, 1 otherwise (a failed pre-flight stops the run: 1).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
REPORT=$OUT/gpu_report.md
LOG=$OUT/gpu_check.log
TIMING=$OUT/gpu_timing.md
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
# pip may install into the python even if its distribution marks it externally managed (the
# machine is the check's to change); older pips ignore the variable.
export PIP_BREAK_SYSTEM_PACKAGES=1
START=$(date +%s)
# Time budget (seconds from the start): the whole check, and the limits of each phase.
TOTAL=${GPU_CHECK_SECONDS:-360}
SETUP_LIMIT=60 PREFLIGHT_LIMIT=45 SMOKE_LIMIT=75 TIMING_RESERVE=45
status=0
phases=""

: >"$REPORT"
: >"$LOG"
: >"$TIMING"
say() { echo "$*" | tee -a "$REPORT"; }
now() { echo $(( $(date +%s) - START )); }
left() { echo $(( TOTAL - $(now) )); }
phase_done() { phases="$phases| $1 | $2 s | $3 |"$'\n'; }  # name, seconds taken, limit

# A test phase: pytest under `timeout -s INT` (pytest stops, writes its junit and closes its pools;
# -k 10: killed if it does not), the processes it started marked so none outlives it.
run_pytest() {  # seconds, junit, pytest arguments...
    local seconds=$1 junit=$2 marker
    shift 2
    marker=$RANDOM$RANDOM
    GPU_CHECK_RUN=$marker timeout -s INT -k 10 "$seconds" "$PY" -m pytest tests/gpu/test_gpu.py -m gpu -v -rs \
        -p no:cacheprovider --junitxml="$junit" -o junit_family=xunit2 "$@" >>"$LOG" 2>&1
    local rc=$?
    reap "$marker"
    return $rc
}
reap() {  # kill what a phase left running: every process carrying its marker
    local pids
    pids=$("$PY" - "$1" <<'EOF' 2>>"$LOG"
import os, sys
marker = f"GPU_CHECK_RUN={sys.argv[1]}".encode()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            if marker in environ.read().split(b"\0"):
                print(pid)
    except OSError:
        pass
EOF
)
    if [ -n "$pids" ]; then
        kill -KILL $pids 2>/dev/null
        say "- killed processes left by a test phase: $(echo $pids)"
    fi
}

say "# GPU check report"
say ""
say "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
say "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if command -v nvidia-smi >/dev/null 2>&1; then
    say "- GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1 | paste -sd ';' -)"
    say "- driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1 | head -1)"
else
    say "- GPU: none (no nvidia-smi)"
fi
if ! "$PY" -c '' 2>/dev/null; then
    say "- python: $PY not found"
    say ""
    say "Result: FAIL (no python), $(now) s in all"
    exit 1
fi
# Its full path: a bare name would reach another python on the ranks mpiexec starts.
PY=$("$PY" -c 'import sys; print(sys.executable)')
say "- python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"

# -- 1. set-up: MPI and this checkout, into the python, from carried wheels only --------------------------
say ""
say "## Set-up"
say ""
pip_carried() { "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check "$@" >>"$LOG" 2>&1; }
mpi_ok() { "$PY" -c 'from mpi4py import MPI; MPI.Get_library_version()' >/dev/null 2>&1 \
    && { [ -x "$(dirname "$("$PY" -c 'import sys; print(sys.executable)')")/mpiexec" ] || command -v mpiexec >/dev/null 2>&1; }; }
if mpi_ok; then
    say "- MPI: the python's own"
else
    wheel=$(ls "$ROOT"/.whl/mpich-*.whl 2>/dev/null | head -1)
    if [ -z "$wheel" ]; then
        say "- MPI: none usable, and no MPICH wheel in .whl/ (scripts/fetch_gpu_wheels.sh): the mpi worlds skip"
    elif pip_carried "$wheel"; then
        note="the carried $(basename "$wheel")"
        if ! mpi_ok; then
            m4p=$(ls "$ROOT"/.whl/mpi4py-*.whl 2>/dev/null | head -1)
            if [ -n "$m4p" ] && pip_carried --force-reinstall "$m4p"; then note="$note and $(basename "$m4p")"; fi
        fi
        mpi_ok && say "- MPI: $note, installed into the python" \
            || say "- MPI: $note installed, but mpi4py still loads no MPI (see gpu_check.log): the mpi worlds skip"
    else
        say "- MPI: installing $(basename "$wheel") failed (see gpu_check.log): the mpi worlds skip"
    fi
fi
# The project: collectives.backends and collectives.syncbn exist only once installed (package-dir).
if "$PY" - "$ROOT" <<'EOF' >/dev/null 2>&1
import sys, pathlib, collectives.backends, collectives.syncbn
sys.exit(0 if str(pathlib.Path(collectives.__file__).resolve()).startswith(sys.argv[1]) else 1)
EOF
then
    say "- collectives: already installed from this checkout"
else
    setuptools=$(ls "$ROOT"/.whl/setuptools-*.whl 2>/dev/null | head -1)
    if [ -n "$setuptools" ]; then  # built in isolation, with the carried setuptools
        how="pip install --no-index --no-deps --find-links .whl -e . (build backend: the carried $(basename "$setuptools"))"
        timeout -k 5 $SETUP_LIMIT "$PY" -m pip install --no-index --no-deps --find-links "$ROOT/.whl" \
            --disable-pip-version-check -e "$ROOT" >>"$LOG" 2>&1
    else
        how="pip install --no-index --no-deps --no-build-isolation -e . (build backend: the python's setuptools)"
        timeout -k 5 $SETUP_LIMIT "$PY" -m pip install --no-index --no-deps --no-build-isolation \
            --disable-pip-version-check -e "$ROOT" >>"$LOG" 2>&1
    fi
    if [ $? -eq 0 ]; then say "- collectives: installed into the python: $how"
    else say "- collectives: **install failed**: $how (see gpu_check.log)"; fi
fi
phase_done "set-up (MPI, install)" "$(now)" "$SETUP_LIMIT s (the install)"

# Open MPI refuses to start ranks as root unless told twice (the device machine runs as root).
if [ "$(id -u)" -eq 0 ]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    say "- running as root: OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (Open MPI's mpiexec)"
fi

# -- 2. pre-flight: stops the run with a clear report when the tests could not run ------------------------
say ""
say "## Pre-flight"
say ""
t0=$(now)
timeout -k 5 $PREFLIGHT_LIMIT "$PY" scripts/gpu_check.py preflight >"$OUT/preflight.txt" 2>>"$LOG"
preflight=$?
tee -a "$REPORT" <"$OUT/preflight.txt"
rm -f "$OUT/preflight.txt"
[ "$preflight" -eq 124 ] && say "PRE-FLIGHT FAILED: it took over $PREFLIGHT_LIMIT s"
phase_done "pre-flight" $(( $(now) - t0 )) "$PREFLIGHT_LIMIT s"
if [ "$preflight" -ne 0 ] && [ "$preflight" -ne 2 ]; then
    say ""
    say "Result: FAIL (pre-flight: nothing was run), $(now) s in all"
    exit 1
fi
cuda=$([ "$preflight" -eq 0 ] && echo 1 || echo 0)
# Per-test limits (pytest-timeout, signal method: the test fails, the run goes on); a job on the
# ranks has 60 s (JOB_TIMEOUT of tests/gpu/test_gpu.py).
per_test=()
"$PY" -c 'import pytest_timeout' 2>/dev/null && per_test=(--timeout 90 -o timeout_method=signal)

# -- 3. smoke: one rank of each backend, before the long run ---------------------------------------------
say ""
say "## GPU tests (tests/gpu/test_gpu.py)"
say ""
export GPU_CHECK_SMOKE_FAILED=""
if [ "$cuda" = 1 ]; then
    t0=$(now)
    run_pytest $SMOKE_LIMIT "$OUT/smoke_junit.xml" -k smoke "${per_test[@]}"
    rc=$?
    [ "$rc" -eq 124 ] && say "- the smoke was stopped at its $SMOKE_LIMIT s limit"
    GPU_CHECK_SMOKE_FAILED=$("$PY" scripts/gpu_check.py smoke-failures "$OUT/smoke_junit.xml" 2>>"$LOG")
    say "- smoke (1 rank of each backend): $("$PY" scripts/gpu_check.py summary "$OUT/smoke_junit.xml" 2>>"$LOG" | head -1)"
    [ -n "$GPU_CHECK_SMOKE_FAILED" ] && say "- the full run skips the worlds of: $GPU_CHECK_SMOKE_FAILED"
    phase_done "smoke" $(( $(now) - t0 )) "$SMOKE_LIMIT s"
else
    say "DRY RUN: no CUDA device here. Every GPU test skips (each with its reason below), and the"
    say "timing table is skipped. Nothing about the GPU paths was checked by this run."
fi

# -- 4. the full run -------------------------------------------------------------------------------------
t0=$(now)
reserve=$(( cuda == 1 ? TIMING_RESERVE : 0 ))
budget=$(( $(left) - reserve ))
[ "$budget" -lt 30 ] && budget=30
selection=(-k "not smoke")  # (a dry run reports the smoke tests skipped too)
[ "$cuda" = 1 ] || selection=()
run_pytest "$budget" "$OUT/gpu_junit.xml" "${selection[@]}" --maxfail 5 "${per_test[@]}"
rc=$?
[ "$rc" -eq 124 ] && say "- pytest was stopped at its $budget s limit"
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=1; fi
phase_done "full run" $(( $(now) - t0 )) "$budget s (what is left of $TOTAL s, less $reserve s for timing)"
say ""
"$PY" scripts/gpu_check.py summary "$OUT/smoke_junit.xml" "$OUT/gpu_junit.xml" 2>>"$LOG" | tee -a "$REPORT"
[ "${PIPESTATUS[0]}" -ne 0 ] && status=1
say ""
say "(pytest exit status $rc; log: gpu_check.log; junit: smoke_junit.xml, gpu_junit.xml)"

# -- 5. timing, while time is left ------------------------------------------------------------------------
say ""
say "## all_reduce timing: ours vs the raw transport (float32 SUM, same buffers)"
say ""
MPIEXEC=$("$PY" scripts/gpu_check.py launcher mpiexec 2>>"$LOG")
say "(the MPI timing's launcher: ${MPIEXEC:-none found})"
if [ "$cuda" = 1 ]; then
    t0=$(now)
    timed() {  # one timing command, 40 s at most, and only while the check's budget lasts
        if [ "$(left)" -lt 45 ]; then
            echo "| $* | skipped: the check's budget is spent | | | | | | |" >>"$TIMING"
            return
        fi
        GPU_CHECK_RUN=timing$START timeout -k 5 40 "$@" --out "$TIMING" >>"$LOG" 2>&1 \
            || echo "| $* | failed or timed out (see gpu_check.log) | | | | | | |" >>"$TIMING"
        reap "timing$START"
    }
    echo "| backend | ranks | array | bytes | ours (µs/call) | raw (µs/call) | ours / raw | ours (GB/s) |" >>"$TIMING"
    echo "|---|---|---|---|---|---|---|---|" >>"$TIMING"
    timed "$PY" scripts/bench/gpu_timing.py --backend torch
    if "$PY" -c 'import cupy' >/dev/null 2>&1; then
        timed "$PY" scripts/bench/gpu_timing.py --backend cupy
    fi
    if mpi_ok; then
        COLLECTIVES_MPI_CUDA_AWARE=0 timed $MPIEXEC -n 2 "$PY" scripts/bench/gpu_timing.py --backend mpi
    fi
    tee -a "$REPORT" <"$TIMING"
    phase_done "timing" $(( $(now) - t0 )) "what is left, 40 s a run"
else
    say "skipped: no CUDA device"
fi

say ""
say "## Time per phase"
say ""
say "| phase | took | limit |"
say "|---|---|---|"
printf "%s" "$phases" | tee -a "$REPORT"
say ""
if [ "$status" -eq 0 ]; then
    say "Result: PASS ($( [ "$cuda" = 1 ] && echo 'GPU run' || echo 'dry run, nothing checked on a GPU' )), $(now) s in all"
else
    say "Result: FAIL, $(now) s in all"
fi
exit $status
