#!/usr/bin/env bash
# Download, here, the NCCL that lets several ranks share one GPU (2.30 and later, with
# NCCL_MULTI_RANK_GPU_ENABLE=1) for scripts/gpu_check.sh's multi-rank phase (GPU_CHECK_NCCL=.nccl):
# nvidia-nccl-cu13 from the package index, its lib/libnccl.so.2 cut into parts under 60 MiB (the
# device tool takes at most 64 MiB per command, so the parts travel one per command) in .nccl/
# (git-ignored), with the sha256 of the whole library.
#
#   scripts/fetch_gpu_nccl.sh                   # .nccl/part-00 ... part-NN, libnccl.so.2.sha256, VERSION
#   NCCL_VERSION='2.30.*' NCCL_DIR=.nccl PART_MIB=50 PYTHON=python3   (the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SPEC=nvidia-nccl-cu13==${NCCL_VERSION:-2.30.*}
DEST=${NCCL_DIR:-.nccl}
PART_MIB=${PART_MIB:-50}
source scripts/gpu_nccl.sh
[ "$PART_MIB" -lt 60 ] || { echo "fetch_gpu_nccl: PART_MIB=$PART_MIB: each part must stay under 60 MiB" >&2; exit 2; }
work=$(mktemp -d /tmp/fetch-gpu-nccl.XXXXXX)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_18_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work" "$SPEC"
wheel=$(ls "$work"/nvidia_nccl_cu13-*.whl | head -1)
"$PY" - "$wheel" "$work/libnccl.so.2" <<'PYEOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    names = [n for n in wheel.namelist() if n.endswith("/lib/libnccl.so.2")]
    if len(names) != 1:
        sys.exit(f"fetch_gpu_nccl: expected one lib/libnccl.so.2 in {sys.argv[1]}, found {names}")
    with wheel.open(names[0]) as source, open(sys.argv[2], "wb") as target:
        shutil.copyfileobj(source, target)
PYEOF
nccl_split "$work/libnccl.so.2" "$DEST" "$PART_MIB"
basename "$wheel" | cut -d- -f2 >"$DEST/VERSION"
echo "fetch_gpu_nccl: NCCL $(cat "$DEST/VERSION") ($(basename "$wheel")) into $DEST:"
ls -l "$DEST"
