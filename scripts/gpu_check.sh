#!/usr/bin/env bash
# The GPU check, in one call, within 6 minutes: install this checkout into the machine's python
# (from carried wheels only: no index there), a pre-flight (45 s), a 1-rank smoke of every backend,
# every GPU test (tests/gpu/test_gpu.py, marker gpu) over torch (NCCL), cupy and mpi, the smoke
# again with COLLECTIVES_COMPILED=0 (the Python forms) while time is left, then a timing table of
# our all_reduce against the raw transports while time is left. Writes $OUT/gpu_report.md
# (versions, what was installed, the pre-flight, results, every skip and why, timings, each
# phase's time), with gpu_check.log, smoke_junit.xml, gpu_junit.xml and gpu_timing.md beside it.
#
#   OUT=/some/dir scripts/gpu_check.sh          # OUT defaults to ./gpu-check-out
#   PYTHON=python3 (default): the interpreter that has torch (and CuPy, mpi4py), e.g. the image's
#   GPU_CHECK_REQUIRE_CUDA=1: no CUDA device is a failure (default: only where nvidia-smi lists a GPU)
#   GPU_CHECK_NCCL=.nccl: the multi-rank phase: the libnccl of scripts/fetch_gpu_nccl.sh (NCCL >= 2.30,
#       joined from its parts and checked) in place of the python's for the run, then put back;
#       NCCL_MULTI_RANK_GPU_ENABLE=1 and NCCL_MAX_CTAS=8; the full run takes the 2-rank NCCL worlds
#   GPU_CHECK_SELECT: the full run's pytest -k expression (default "not smoke"; with GPU_CHECK_NCCL,
#       the 2-rank NCCL worlds)
#
# Carried wheels (.whl/, git-ignored; scripts/fetch_gpu_wheels.sh fills it where an index is
# reachable): setuptools and Cython (to build the checkout and compile its call path), MPICH
# (libmpi and mpiexec) and mpi4py, installed
# into that python only where it lacks them. docs/gpu.md lists the image's versions this expects
# and each phase's time budget. On a machine without CUDA (and no GPU that nvidia-smi lists) it is
# a dry run: set-up and pre-flight, then every GPU test reported skipped with its reason; exit 0.
# Exit status: 0 and "Result: PASS" when nothing failed; 1 and "Result: FAIL (why)" when a test
# failed, a phase failed or ran past its limit, or CUDA is missing where a GPU is listed; 128+N and
# "Result: INCOMPLETE" when signal N (a limit from outside) stopped the check.
#
# For the CPU rehearsals of these verdicts (tests/gpu/test_gpu_check_verdicts.py) only:
# GPU_CHECK_TESTS (the test file of every phase) and GPU_CHECK_AS_IF_CUDA=1 (the phases run as on a
# GPU; no timing); GPU_CHECK_SMOKE_SECONDS (the smoke's limit).
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
SETUP_LIMIT=60 PREFLIGHT_LIMIT=45 SMOKE_LIMIT=${GPU_CHECK_SMOKE_SECONDS:-100} TIMING_RESERVE=90
TESTS=${GPU_CHECK_TESTS:-tests/gpu/test_gpu.py}
status=0
failures=""
phases=""
phase="start"  # the phase under way, for the INCOMPLETE line
child=""       # the command a phase waits on, stopped with the check
marker=""      # the marker of the processes the phase under way started
nccl_lib=""    # the python's libnccl.so.2 while a carried one is in its place

: >"$REPORT"
: >"$LOG"
: >"$TIMING"
say() { echo "$*" | tee -a "$REPORT"; }
now() { echo $(( $(date +%s) - START )); }
left() { echo $(( TOTAL - $(now) )); }
phase_done() { phases="$phases| $1 | $2 s | $3 |"$'\n'; }  # name, seconds taken, limit
fail() { status=1; failures="${failures:+$failures; }$1"; say "- **FAILED**: $1"; }
# A phase's command in the background, waited on: a signal to the check runs its trap at once
# instead of after the command. (SIGINT is ignored in background jobs unless reset: timeout -s INT
# must reach pytest.)
waited() {
    ( trap - INT; exec "$@" ) &
    child=$!
    wait "$child"
    local rc=$?
    child=""
    return $rc
}
source scripts/gpu_nccl.sh
stopped() {  # the trap of a signal from outside: stop what runs, put the NCCL back, say INCOMPLETE
    trap - TERM INT HUP
    [ -n "$child" ] && kill -TERM "$child" 2>/dev/null
    [ -n "$marker" ] && reap "$marker"
    [ -n "$nccl_lib" ] && nccl_restore "$nccl_lib"
    say ""
    say "Result: INCOMPLETE (stopped by SIG$1 during the $phase phase${failures:+; failed before: $failures}), $(now) s in all"
    exit $(( 128 + $2 ))
}
trap 'stopped TERM 15' TERM
trap 'stopped INT 2' INT
trap 'stopped HUP 1' HUP
trap '[ -n "$nccl_lib" ] && nccl_restore "$nccl_lib"' EXIT

phase_env=()   # NAME=VALUE of the phase's pytest (the smoke on the Python forms: COLLECTIVES_COMPILED=0)
# A test phase: pytest under `timeout -s INT` (pytest stops, writes its junit and closes its pools;
# -k 10: killed if it does not), the processes it started marked so none outlives it.
run_pytest() {  # seconds, junit, pytest arguments...
    local seconds=$1 junit=$2
    shift 2
    marker=$RANDOM$RANDOM
    GPU_CHECK_RUN=$marker waited env "${phase_env[@]}" timeout -s INT -k 10 "$seconds" "$PY" -m pytest "$TESTS" -m gpu -v -rs \
        -p no:cacheprovider --junitxml="$junit" -o junit_family=xunit2 "$@" >>"$LOG" 2>&1
    local rc=$?
    reap "$marker"
    marker=""
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
# The GPUs the driver lists (an H100 or an H200 on the device machines; any CUDA GPU will do).
listed=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>&1)
    [ $? -eq 0 ] && listed=$(printf '%s\n' "$gpus" | grep -c .)
    say "- GPU: $(printf '%s' "$gpus" | paste -sd ';' -)"
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
phase="set-up"
# A check stopped by SIGKILL leaves a carried libnccl in the python's place: put the original back.
saved=$("$PY" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
if [ -n "$saved" ] && [ -e "$saved$NCCL_SAVED_SUFFIX" ]; then
    nccl_restore "$saved" && say "- NCCL: the python's libnccl.so.2, left aside by an earlier check, put back"
fi
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
    installed=$?
    if [ $installed -eq 0 ]; then say "- collectives: installed into the python: $how"
    elif [ $installed -eq 124 ]; then fail "set-up: the install of collectives ran past its $SETUP_LIMIT s limit"
    else say "- collectives: **install failed**: $how (see gpu_check.log)"; fi
fi
phase_done "set-up (MPI, install)" "$(now)" "$SETUP_LIMIT s (the install)"

# The multi-rank phase: a carried NCCL >= 2.30 in place of the python's, several ranks per GPU.
if [ -n "${GPU_CHECK_NCCL:-}" ]; then
    t0=$(now)
    nccl_lib=$saved
    joined=$(mktemp /tmp/gpu-check-libnccl.XXXXXX)
    if [ -z "$nccl_lib" ]; then
        say "- NCCL: the python has no nvidia/nccl/lib/libnccl.so.2 to replace"
        say ""
        say "Result: FAIL (GPU_CHECK_NCCL: no libnccl.so.2 in the python's site-packages), $(now) s in all"
        exit 1
    fi
    if ! why=$(nccl_assemble "$GPU_CHECK_NCCL" "$joined") || ! why=$(nccl_swap_in "$nccl_lib" "$joined"); then
        rm -f "$joined"
        say "- NCCL: $GPU_CHECK_NCCL cannot be put in place: $why"
        say ""
        say "Result: FAIL (GPU_CHECK_NCCL: $why), $(now) s in all"
        exit 1
    fi
    rm -f "$joined"
    export NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS=8
    say "- NCCL: $(cat "$GPU_CHECK_NCCL/VERSION" 2>/dev/null || echo '(no VERSION)') from $GPU_CHECK_NCCL (sha256 checked) in place of $nccl_lib for this run (put back at its end); NCCL_MULTI_RANK_GPU_ENABLE=1 NCCL_MAX_CTAS=8"
    phase_done "NCCL swap" $(( $(now) - t0 )) "-"
fi

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
phase="pre-flight"
waited timeout -k 5 $PREFLIGHT_LIMIT "$PY" scripts/gpu_check.py preflight >"$OUT/preflight.txt" 2>>"$LOG"
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
if [ "$cuda" = 0 ] && [ "${GPU_CHECK_AS_IF_CUDA:-0}" = 1 ]; then
    cuda=1
    say "- (rehearsal: GPU_CHECK_AS_IF_CUDA=1, the phases run as on a GPU, against $TESTS; no timing)"
fi
if [ "$cuda" = 0 ] && { [ "$listed" -gt 0 ] || [ "${GPU_CHECK_REQUIRE_CUDA:-0}" = 1 ]; }; then
    why=$([ "$listed" -gt 0 ] && echo "nvidia-smi lists $listed GPU(s)" || echo "GPU_CHECK_REQUIRE_CUDA=1")
    say ""
    say "CUDA UNAVAILABLE: $why, but torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES, a CPU"
    say "torch?): nothing would be checked on a GPU."
    say ""
    say "Result: FAIL (CUDA unavailable: $why), $(now) s in all"
    exit 1
fi
# Per-test limits (pytest-timeout, signal method: the test fails, the run goes on); a job on the
# ranks has 60 s (JOB_TIMEOUT of tests/gpu/test_gpu.py).
# The smoke's tests stop well inside its limit, so a hung one is a failure in its junit (the limit
# itself is a failure too).
per_test=() smoke_test=()
if "$PY" -c 'import pytest_timeout' 2>/dev/null; then
    per_test=(--timeout 90 -o timeout_method=signal)
    smoke_test=(--timeout $(( SMOKE_LIMIT > 20 ? SMOKE_LIMIT - 10 : SMOKE_LIMIT / 2 )) -o timeout_method=signal)
fi
smoke() {  # junit, what it is called in the report, then variables for it: fail() on any failure
    local junit=$1 what=$2 rc
    shift 2
    phase_env=("$@")
    run_pytest $SMOKE_LIMIT "$junit" -k smoke "${smoke_test[@]}"
    rc=$?
    phase_env=()
    say "- $what: $("$PY" scripts/gpu_check.py summary "$junit" 2>>"$LOG" | head -1)"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        fail "$what: stopped at its $SMOKE_LIMIT s limit (a test hung; the one stopped has no junit entry)"
    elif [ "$rc" -ne 0 ]; then
        fail "$what: pytest exit status $rc (see gpu_check.log)"
    fi
    return $rc
}

# -- 3. smoke: one rank of each backend, before the long run ---------------------------------------------
say ""
say "## GPU tests (tests/gpu/test_gpu.py)"
say ""
export GPU_CHECK_SMOKE_FAILED=""
if [ "$cuda" = 1 ]; then
    t0=$(now)
    phase="smoke"
    smoke "$OUT/smoke_junit.xml" "smoke (1 rank of each backend)"
    smoke_rc=$?
    GPU_CHECK_SMOKE_FAILED=$("$PY" scripts/gpu_check.py smoke-failures "$OUT/smoke_junit.xml" 2>>"$LOG")
    [ -n "$GPU_CHECK_SMOKE_FAILED" ] && say "- the full run skips the worlds of: $GPU_CHECK_SMOKE_FAILED"
    phase_done "smoke" $(( $(now) - t0 )) "$SMOKE_LIMIT s"
else
    say "DRY RUN: no CUDA device here. Every GPU test skips (each with its reason below), and the"
    say "timing table is skipped. Nothing about the GPU paths was checked by this run."
fi

# -- 4. the full run -------------------------------------------------------------------------------------
t0=$(now)
phase="full run"
reserve=$(( cuda == 1 ? TIMING_RESERVE : 0 ))
budget=$(( $(left) - reserve ))
[ "$budget" -lt 30 ] && budget=30
# The 2-rank NCCL worlds (ids: torch-nccl-2, cupy-2-mpi-id, cupy-2-store-id, c10d-cupy-2 (as cupy-2),
# cupy-timeout-2, cupy-2-hosts-*, elastic-torch-nccl-2): what a carried NCCL >= 2.30 unlocks on one GPU.
MULTI_RANK_WORLDS="torch-nccl-2 or cupy-2 or cupy-timeout-2 or elastic-torch-nccl-2"
default_selection=$([ -n "${GPU_CHECK_NCCL:-}" ] && echo "$MULTI_RANK_WORLDS" || echo "not smoke")
selection=(-k "${GPU_CHECK_SELECT:-$default_selection}")
[ "$cuda" = 1 ] || selection=()  # (a dry run reports the smoke tests skipped too)
[ "$cuda" = 1 ] && say "- the full run's selection: -k \"${selection[1]}\""
run_pytest "$budget" "$OUT/gpu_junit.xml" "${selection[@]}" --maxfail 5 "${per_test[@]}"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    fail "full run: pytest stopped at its $budget s limit (the test it stopped has no junit entry)"
elif [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    fail "full run: pytest exit status $rc"
fi
phase_done "full run" $(( $(now) - t0 )) "$budget s (what is left of $TOTAL s, less $reserve s for timing)"

# The smoke again on the Python forms (COLLECTIVES_COMPILED=0), while time is left.
python_smoke="$OUT/smoke_python_junit.xml"
rm -f "$python_smoke"
if [ "$cuda" = 1 ] && [ "${smoke_rc:-1}" -eq 0 ]; then
    if [ "$(left)" -gt $(( SMOKE_LIMIT + reserve )) ]; then
        t0=$(now)
        phase="smoke, Python forms"
        smoke "$python_smoke" "smoke with COLLECTIVES_COMPILED=0 (the Python forms)" COLLECTIVES_COMPILED=0
        phase_done "smoke, COLLECTIVES_COMPILED=0" $(( $(now) - t0 )) "$SMOKE_LIMIT s"
    else
        say "- smoke with COLLECTIVES_COMPILED=0: not run, $(left) s left"
    fi
fi
say ""
"$PY" scripts/gpu_check.py summary "$OUT/smoke_junit.xml" "$OUT/gpu_junit.xml" "$python_smoke" 2>>"$LOG" | tee -a "$REPORT"
[ "${PIPESTATUS[0]}" -ne 0 ] && fail "a test failed (listed above)"
say ""
say "(pytest exit status $rc; log: gpu_check.log; junit: smoke_junit.xml, gpu_junit.xml, smoke_python_junit.xml)"

# -- 5. timing, while time is left ------------------------------------------------------------------------
say ""
say "## all_reduce timing: ours vs the raw transport (float32 SUM, same buffers)"
say ""
MPIEXEC=$("$PY" scripts/gpu_check.py launcher mpiexec 2>>"$LOG")
say "(the MPI timing's launcher: ${MPIEXEC:-none found})"
if [ "$cuda" = 1 ] && [ "${GPU_CHECK_AS_IF_CUDA:-0}" = 1 ]; then
    say "skipped: a rehearsal (GPU_CHECK_AS_IF_CUDA=1), no GPU to time"
elif [ "$cuda" = 1 ]; then
    t0=$(now)
    phase="timing"
    timed() {  # one timing command, 40 s at most, and only while the check's budget lasts
        if [ "$(left)" -lt 45 ]; then
            echo "| $* | skipped: the check's budget is spent | | | | | | | | | |" >>"$TIMING"
            return
        fi
        marker=timing$START
        GPU_CHECK_RUN=$marker waited timeout -k 5 40 "$@" --out "$TIMING" >>"$LOG" 2>&1
        local rc=$?
        if [ $rc -ne 0 ]; then
            echo "| $* | failed or timed out (see gpu_check.log) | | | | | | | | | |" >>"$TIMING"
            fail "timing: \`$*\` $([ $rc -eq 124 ] && echo 'ran past its 40 s limit' || echo "exit status $rc")"
        fi
        reap "$marker"
        marker=""
    }
    "$PY" scripts/bench/gpu_timing.py --header-only >>"$TIMING"
    # A row per setting: ours and raw interleaved, the median of the rounds (gpu_timing.py).
    for setting in defaults COLLECTIVES_TIMEOUT=0 COLLECTIVES_DEBUG=0; do
        timed "$PY" scripts/bench/gpu_timing.py --backend torch --env "$setting"
        if "$PY" -c 'import cupy' >/dev/null 2>&1; then
            timed "$PY" scripts/bench/gpu_timing.py --backend cupy --env "$setting"
        fi
    done
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
trap - TERM INT HUP
[ -n "$nccl_lib" ] && nccl_restore "$nccl_lib" && say "- NCCL: the python's libnccl.so.2 put back" && say ""
if [ "$status" -eq 0 ]; then
    kind=$([ "$cuda" = 1 ] && echo 'GPU run' || echo 'dry run, nothing checked on a GPU')
    [ "${GPU_CHECK_AS_IF_CUDA:-0}" = 1 ] && kind="rehearsal, nothing checked on a GPU"
    say "Result: PASS ($kind), $(now) s in all"
else
    say "Result: FAIL ($failures), $(now) s in all"
fi
exit $status
