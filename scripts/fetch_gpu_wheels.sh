#!/usr/bin/env bash
# Download, here, the wheels scripts/gpu_check.sh installs on the GPU machine, which reaches no
# index: setuptools and Cython (the build backend that installs this checkout, and the compiler of
# its call path), and the MPICH wheel (libmpi
# + mpiexec) with mpi4py for a python that lacks a working MPI. For CPython 3.12 on x86-64 Linux
# (the device image's python3) unless PYTHON_VERSION says another. They land in .whl/
# (git-ignored), or in WHEELS; pass `.whl` in the device tool's `carry` so they travel with the
# checkout (about 15 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${WHEELS:-.whl}
PY=${PYTHON:-python3}
VERSION=${PYTHON_VERSION:-3.12}
mkdir -p "$DEST"
# setuptools >= 77 (pyproject's license fields); < 82 (what torch 2.11 asks of the environment).
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$DEST" "setuptools==${SETUPTOOLS_VERSION:-80.9.0}"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$DEST" \
    "mpich==${MPICH_VERSION:-5.0.2}" "mpi4py==${MPI4PY_VERSION:-4.1.2}" "cython==${CYTHON_VERSION:-3.3.1}"
ls -l "$DEST"
