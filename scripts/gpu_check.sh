#!/usr/bin/env bash
# The GPU check, in one call: every GPU test (tests/gpu/test_gpu.py, marker gpu) over torch (NCCL),
# cupy and mpi, then a timing table of our all_reduce against the raw transports. Writes a
# markdown report to $OUT/gpu_report.md (date, GPU, driver, versions, results, timings),
# plus the pytest log and junit XML beside it. Meant to finish in under 8 minutes.
#
#   OUT=/some/dir scripts/gpu_check.sh          # OUT defaults to ./gpu-check-out
#   PYTHON=python3 (default) selects the interpreter that has torch (and CuPy, mpi4py).
#
# MPI: if that interpreter's mpi4py cannot load an MPI library, or there is no mpiexec, the
# MPICH wheel carried in .whl/ (scripts/fetch_gpu_wheels.sh puts it there) is installed
# under /tmp and used. On a machine without CUDA it is a dry run: it says what it skipped and
# exits 0. Exit status: 0 when every test that could run passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/gpu-check-out}
mkdir -p "$OUT"
REPORT=$OUT/gpu_report.md
LOG=$OUT/gpu_pytest.log
TIMING=$OUT/gpu_timing.md
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
START=$(date +%s)
status=0

say() { echo "$*" | tee -a "$REPORT"; }
elapsed() { echo $(( $(date +%s) - START ))s; }

: >"$REPORT"
: >"$TIMING"
say "# GPU check report"
say ""
say "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
say "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if command -v nvidia-smi >/dev/null 2>&1; then
    say "- GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | paste -sd ';' -)"
    say "- driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
else
    say "- GPU: none (no nvidia-smi)"
fi
say "- python: $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"

# -- MPI: the interpreter's own, else the carried MPICH wheel -----------------------------------
mpi_ok() { $PY -c 'from mpi4py import MPI; MPI.Get_library_version()' >/dev/null 2>&1 && command -v mpiexec >/dev/null 2>&1; }
if ! mpi_ok; then
    wheel=$(ls "$ROOT"/.whl/mpich-*.whl 2>/dev/null | head -1)
    if [ -n "$wheel" ]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix /tmp/mpich "$wheel" \
            >>"$LOG" 2>&1
        chmod +x /tmp/mpich/bin/* 2>/dev/null
        export PATH=/tmp/mpich/bin:$PATH
        export LD_LIBRARY_PATH=/tmp/mpich/lib:/tmp/mpich/lib/mpich${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        export MPI4PY_LIBMPI=/tmp/mpich/lib/libmpi.so.12
        if ! $PY -c 'import mpi4py' >/dev/null 2>&1; then
            m4p=$(ls "$ROOT"/.whl/mpi4py-*.whl 2>/dev/null | head -1)
            [ -n "$m4p" ] && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
                --target /tmp/site "$m4p" >>"$LOG" 2>&1 && export PYTHONPATH=$PYTHONPATH:/tmp/site
        fi
        say "- MPI: the carried $(basename "$wheel") (installed under /tmp/mpich)"
    else
        say "- MPI: none usable, and no MPICH wheel in .whl/ (run scripts/fetch_gpu_wheels.sh): MPI worlds skip"
    fi
fi
say ""
say "## What this machine offers (python -m collectives.info)"
say ""
say '```'
$PY -m collectives.info 2>&1 | tee -a "$REPORT"
say '```'

say ""
say "## libnccl of torch and CuPy, in both import orders (cupy/cupy#8354)"
say ""
say '```'
for order in "torch cupy" "cupy torch"; do
    $PY - $order <<'EOF' 2>&1 | tee -a "$REPORT"
import sys
versions = {}
for name in sys.argv[1:]:
    try:
        if name == "torch":
            import torch
            versions["torch"] = torch.cuda.nccl.version() if torch.cuda.is_available() else "no CUDA"
        else:
            import cupy.cuda.nccl as nccl
            versions["cupy"] = nccl.get_version()
    except Exception as error:  # a missing or broken library is the finding
        versions[name] = f"{type(error).__name__}: {error}"
with open("/proc/self/maps") as maps:
    loaded = sorted({line.split()[-1] for line in maps if "libnccl" in line})
print(f"import {' then '.join(sys.argv[1:])}: {versions}; libnccl loaded: {loaded or 'none'}")
EOF
done
say '```'

cuda=$($PY -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
say ""
say "## GPU tests (tests/gpu/test_gpu.py)"
say ""
if [ "$cuda" != 1 ]; then
    say "DRY RUN: no CUDA device here (torch.cuda.is_available() is False). Every GPU test skips,"
    say "and the timing table is skipped. Nothing about the GPU paths was checked by this run."
fi
# 400 s for the tests (the most a run with every world the machine allows was estimated to need);
# setup takes about 40 s before, and the timing table after only starts while under 380 s.
timeout 400 $PY -m pytest tests/gpu/test_gpu.py -m gpu -v -rs -p no:cacheprovider \
    --junitxml="$OUT/gpu_junit.xml" -o junit_family=xunit2 >>"$LOG" 2>&1
rc=$?
[ "$rc" -eq 124 ] && say "pytest was stopped at its 400 s limit"
if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=1; fi
say ""
say '```'
grep -E '^(tests/gpu/test_gpu.py::.*(PASSED|FAILED|SKIPPED|ERROR|XFAIL)|SKIPPED|FAILED|ERROR|=+ .*(passed|failed|skipped|error).* =+$)' \
    "$LOG" | sed -E 's/ +\[ *[0-9]+%\]$//' | tee -a "$REPORT"
say '```'
say "(pytest exit status $rc after $(elapsed); full log: gpu_pytest.log, junit: gpu_junit.xml)"

# -- timing ----------------------------------------------------------------------------------------
say ""
say "## all_reduce timing: ours vs the raw transport (float32 SUM, same buffers)"
say ""
if [ "$cuda" = 1 ]; then
    multi() {  # 1 when the given NCCL (torch or cupy) allows several ranks on one GPU
        $PY - "$1" <<'EOF' 2>/dev/null || echo 0
import sys
if sys.argv[1] == "torch":
    import torch
    v = tuple(torch.cuda.nccl.version())
else:
    from collectives.backends.cupy_nccl import nccl_runtime_version
    v = nccl_runtime_version()
print(int(v >= (2, 30, 0)))
EOF
    }
    timed() {  # run one timing command, note a failure in the report; keep the whole under 8 min
        if [ $(( $(date +%s) - START )) -gt 380 ]; then  # a timing run may take 90 s: end by 470 s
            echo "| $* | skipped: the check's 8-minute budget is nearly spent | | | | | | |" >>"$TIMING"
            return
        fi
        if ! timeout 90 "$@" --out "$TIMING" >>"$LOG" 2>&1; then
            echo "| $* | failed or timed out (see gpu_pytest.log) | | | | | | |" >>"$TIMING"
        fi
    }
    echo "| backend | ranks | array | bytes | ours (µs/call) | raw (µs/call) | ours / raw | ours (GB/s) |" >>"$TIMING"
    echo "|---|---|---|---|---|---|---|---|" >>"$TIMING"
    timed $PY scripts/bench/gpu_timing.py --backend torch
    if [ "$(multi torch)" = 1 ]; then
        NCCL_MULTI_RANK_GPU_ENABLE=1 timed $PY -m torch.distributed.run --nproc_per_node 2 \
            scripts/bench/gpu_timing.py --backend torch
    fi
    if $PY -c 'import cupy' >/dev/null 2>&1; then
        timed $PY scripts/bench/gpu_timing.py --backend cupy
        COLLECTIVES_TIMEOUT=0 timed $PY scripts/bench/gpu_timing.py --backend cupy  # the deadline's cost
        if [ "$(multi cupy)" = 1 ]; then
            NCCL_MULTI_RANK_GPU_ENABLE=1 timed mpiexec -n 2 $PY scripts/bench/gpu_timing.py --backend cupy
        fi
    fi
    if mpi_ok; then
        for n in 2 4; do
            COLLECTIVES_MPI_CUDA_AWARE=0 timed mpiexec -n $n $PY scripts/bench/gpu_timing.py --backend mpi
        done
        if $PY -c 'from mpi4py import MPI; from collectives.backends.mpi import mpi_cuda_aware; import sys; sys.exit(0 if mpi_cuda_aware(MPI) else 1)' 2>/dev/null; then
            for n in 2 4; do
                COLLECTIVES_MPI_CUDA_AWARE=1 timed mpiexec -n $n $PY scripts/bench/gpu_timing.py --backend mpi
            done
        else
            echo "| mpi (CUDA-aware) | - | - | - | skipped: the MPI library is not CUDA-aware | | | |" >>"$TIMING"
        fi
    fi
    tee -a "$REPORT" <"$TIMING"
else
    say "skipped: no CUDA device"
fi

say ""
if [ "$status" -eq 0 ]; then
    say "Result: PASS ($( [ "$cuda" = 1 ] && echo 'GPU run' || echo 'dry run, nothing checked on a GPU' )), $(elapsed) in all"
else
    say "Result: FAIL, $(elapsed) in all"
fi
exit $status
