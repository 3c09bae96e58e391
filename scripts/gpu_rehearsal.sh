#!/usr/bin/env bash
# Rehearse scripts/gpu_check.sh on CPU in the device image's conditions, so that the first run
# on a lent GPU machine cannot die at set-up or import:
#   - a fresh venv without the project, holding what the image holds that the check uses (torch,
#     cupy-cuda13x 14.2 with nvidia-nccl-cu13 2.28.9, numpy, mpi4py without an MPI library,
#     pytest, pytest-timeout, hypothesis, ml_dtypes), installed from wheels that are downloaded
#     from the index into a cache once and from that cache after;
#   - a copy of the checkout as the device tool sends it (tracked and untracked-not-ignored
#     files: no .venv), with the carried wheels of scripts/fetch_gpu_wheels.sh in its .whl/;
#   - no pip configuration of this machine, no index, and nothing of ours on PATH;
# then runs the check there (it installs MPICH and the checkout from .whl/, runs the pre-flight,
# reaches "no CUDA device" and reports every GPU test skipped) and checks its report.
#
#   scripts/gpu_rehearsal.sh        # CI: CI's python (3.11) and the suite's torch (2.13.0, CPU build)
#   make rehearse-gpu-image         # the image's: python 3.12, torch 2.11.0 (3 GB with its CUDA wheels)
#
# PYTHON (interpreter), TORCH and NUMPY (versions; NUMPY empty: the newest CuPy takes) choose the
# image; GPU_REHEARSAL_CACHE the cache (default ~/.cache/collectives-gpu-rehearsal); OUT where
# the report goes (default: a temporary folder, removed on success); GPU_REHEARSAL_TESTS test
# files to run afterwards in the image's python (the GPU tests' jobs on host tensors, say, under
# the image's torch). Exit 0 when the rehearsal passed; it prints the report and the seconds the
# check took.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3.11}
TORCH=${TORCH:-2.13.0}
NUMPY=${NUMPY:-}
CUPY=cupy-cuda13x==14.2.0
NCCL=nvidia-nccl-cu13==2.28.9
CACHE=${GPU_REHEARSAL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/collectives-gpu-rehearsal}
version=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
IMAGE_PACKAGES=("torch==$TORCH" "$CUPY" "$NCCL" "numpy${NUMPY:+==$NUMPY}" "mpi4py==4.1.2" pytest pytest-timeout
                hypothesis ml_dtypes)
WORK=$(mktemp -d /tmp/gpu-rehearsal.XXXXXX)
OUT=${OUT:-$WORK/out}
trap 'rm -rf "$WORK/image" "$WORK/checkout"' EXIT

# 1. The image's packages: downloaded once into the cache (with their dependencies), then a fresh
#    venv from the cache alone. (The machine's pip constraints cap torch; its find-links hold the
#    suite's CPU torch 2.13.0 for Python 3.11.)
wheels=$CACHE/image-py$version-torch$TORCH${NUMPY:+-numpy$NUMPY}
if [ ! -e "$wheels/.complete" ]; then
    echo "gpu-rehearsal: downloading the image's wheels into $wheels (once)"
    mkdir -p "$wheels"
    "$PYTHON" -m pip download --quiet --only-binary=:all: -d "$wheels" "${IMAGE_PACKAGES[@]}"
    touch "$wheels/.complete"
fi
# (keyed by what fetch_gpu_wheels.sh fetches: a cache of an older list is not used)
carried=$CACHE/carried-py$version-$(sha256sum scripts/fetch_gpu_wheels.sh | cut -c1-12)
if [ ! -e "$carried/.complete" ]; then
    echo "gpu-rehearsal: downloading the carried wheels into $carried (once)"
    PYTHON="$PYTHON" PYTHON_VERSION=$version WHEELS=$carried scripts/fetch_gpu_wheels.sh >/dev/null
    touch "$carried/.complete"
fi
start=$(date +%s)
"$PYTHON" -m venv "$WORK/image"
# The cache holds exactly the resolved set: installed as files, without resolving again or compiling.
PIP_CONFIG_FILE=/dev/null "$WORK/image/bin/python" -m pip install --quiet --no-index --no-deps --no-compile \
    --disable-pip-version-check "$wheels"/*.whl
image_seconds=$(( $(date +%s) - start ))

# 2. The checkout as the device tool sends it, with the carried wheels.
mkdir -p "$WORK/checkout/.whl"
git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null \
    | tar -xf - -C "$WORK/checkout"
cp "$carried"/*.whl "$WORK/checkout/.whl/"
if (cd /tmp && "$WORK/image/bin/python" -c 'import collectives' 2>/dev/null); then
    echo "gpu-rehearsal: FAIL: the fresh venv already imports collectives"
    exit 1
fi

# 3. The check, with the image's environment: its python first on PATH, no pip configuration.
start=$(date +%s)
set +e
env -i HOME="$HOME" PATH="$WORK/image/bin:/usr/local/bin:/usr/bin:/bin" PIP_CONFIG_FILE=/dev/null \
    LANG=C.UTF-8 OUT="$OUT" bash "$WORK/checkout/scripts/gpu_check.sh" >"$WORK/check.txt" 2>&1
rc=$?
set -e
check_seconds=$(( $(date +%s) - start ))
report=$OUT/gpu_report.md

# 4. What the first real run depends on, in the report.
missing=()
for expected in "# GPU check report" "- python: $version" "MPI: the carried mpich-" \
                "collectives: installed into the python: pip install --no-index --no-deps --find-links .whl -e ." \
                "- collectives: " "- torch: $TORCH" "- CuPy: 14.2.0; NCCL 2.28.9" "mpiexec: $WORK/image/bin/mpiexec" \
                "no CUDA device" "DRY RUN" "skipped" "Result: PASS (dry run"; do
    grep -qF -- "$expected" "$report" 2>/dev/null || missing+=("$expected")
done
grep -qE "^[0-9]+ skipped$" "$report" 2>/dev/null || missing+=("every GPU test skipped (a line 'N skipped' alone)")
cat "$report" 2>/dev/null || cat "$WORK/check.txt"
echo
echo "gpu-rehearsal: python $version, torch $TORCH; fresh image venv in ${image_seconds} s; gpu_check.sh exit $rc in ${check_seconds} s"
if [ "$rc" -ne 0 ] || [ "${#missing[@]}" -ne 0 ] || [ "$check_seconds" -ge 120 ]; then
    printf 'gpu-rehearsal: FAIL: missing from the report: %s\n' "${missing[@]:-none}"
    [ "$check_seconds" -ge 120 ] && echo "gpu-rehearsal: FAIL: the dry run took ${check_seconds} s (limit 120 s)"
    echo "gpu-rehearsal: kept in $WORK"
    trap - EXIT
    exit 1
fi
if [ -n "${GPU_REHEARSAL_TESTS:-}" ]; then
    start=$(date +%s)
    (cd "$WORK/checkout" && env -i HOME="$HOME" PATH="$WORK/image/bin:/usr/local/bin:/usr/bin:/bin" LANG=C.UTF-8 \
        "$WORK/image/bin/python" -m pytest -q -p no:cacheprovider $GPU_REHEARSAL_TESTS) \
        || { echo "gpu-rehearsal: FAIL: $GPU_REHEARSAL_TESTS in the image's python"; trap - EXIT; exit 1; }
    echo "gpu-rehearsal: $GPU_REHEARSAL_TESTS passed in the image's python in $(( $(date +%s) - start )) s"
fi
echo "gpu-rehearsal: PASS"
rm -rf "$WORK"  # (the report too, unless OUT put it elsewhere)
exit 0
