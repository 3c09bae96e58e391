#!/usr/bin/env bash
# Download, here, the wheels scripts/gpu_check.sh installs on the GPU machine when its python
# lacks a working MPI: the MPICH wheel (libmpi + mpiexec) and mpi4py, for CPython 3.12 on
# x86-64 Linux (the lent machine's python3). They land in .whl/ (git-ignored); pass `.whl` in
# the device tool's `carry` so they travel with the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null \
    || echo '/.whl/' >>"$(git rev-parse --git-common-dir)/info/exclude"
PY=${PYTHON:-python3}
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "mpich==${MPICH_VERSION:-5.0.2}" "mpi4py==${MPI4PY_VERSION:-4.1.2}"
ls -l .whl
