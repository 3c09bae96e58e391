# The two commands of the README: `make demo` and `make test`. Both set up the
# virtual environment in .venv on first use (and again when pyproject.toml changes).
PYTHON ?= python3.11
# CI's Python (3.11) lives in .venv; any other one in .venv-X.Y, so PYTHON=... never rebuilds .venv.
PYTHON_VERSION := $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
VENV ?= $(if $(filter-out 3.11,$(PYTHON_VERSION)),.venv-$(PYTHON_VERSION),.venv)
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_RANKS ?= 4

# The Pythons `make test-pythons` runs the suite on (the ones this machine lacks are skipped, and said so)
# and `make wheels` builds wheels for (each one needed).
PYTHONS ?= 3.10 3.11 3.12 3.13
# Shell: py= the interpreter of Python $$v here (python$$v on PATH, else pyenv's newest), or empty.
FIND_PYTHON = py=""; for c in python$$v $${PYENV_ROOT:-$$HOME/.pyenv}/versions/$$v.*/bin/python$$v; do \
	  if $$c -c '' 2>/dev/null; then py=$$c; fi; \
	done

# The wheel folder every checkout of this user shares (scripts/torch_versions.py uses the same).
WHEEL_CACHE := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/collectives-wheels
ifneq ($(VENV),.venv)
# Only 3.11 has a CPU torch on the project's disk; elsewhere pip fetches torch 2.13.0 from the index
# (the CUDA build, ~4.6 GB with its nvidia wheels; it runs on CPU too). pip's HTTP cache does not
# keep it here, so these venvs download into a wheel folder every checkout of this user shares (pip
# download skips the files already there) and install from it alone.
WHEELS := $(WHEEL_CACHE)
endif
# test-oldest: every floor of pyproject.toml pinned (scripts/floors.py), for pip and for the build.
PIN_FLOORS := $(if $(FLOORS),PIP_CONSTRAINT=$(CURDIR)/$(VENV)/floors.txt)
PIP_FROM_WHEELS := $(if $(WHEELS),PIP_FIND_LINKS="$$PIP_FIND_LINKS $(WHEELS)" PIP_NO_INDEX=1)

.PHONY: demo demo-collectives test test-pythons test-oldest test-torch-suite test-many-ranks fuzz-c10d test-environments test-torch-versions \
	test-ci-slice test-python-forms wheels test-free-threaded typecheck docs lint bench bench-train bench-c10d clean rehearse-gpu-image

# The sources of setup.py's COMPILED (Cython), each with the .pxd beside it, are compiled by the
# install: a change to them installs again.
COMPILED_SOURCES := $(shell sed -n 's/^.*": "\([^"]*\.py\)"[,}].*$$/\1/p' setup.py)
$(STAMP): pyproject.toml setup.py $(COMPILED_SOURCES) $(wildcard $(COMPILED_SOURCES:.py=.pxd))
	@test -n "$(PYTHON_VERSION)" || { echo "need $(PYTHON) (Python >= 3.10); set PYTHON=..."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# The distribution was called `collectives` before: drop it, or pytest loads its old plugin entry point too.
	$(PY) -m pip uninstall --quiet --yes collectives 2>/dev/null || true
	rm -rf collectives.egg-info
	$(if $(FLOORS),$(PY) scripts/floors.py > $(VENV)/floors.txt)
	$(if $(WHEELS),$(PIN_FLOORS) $(PY) -m pip download --quiet --dest $(WHEELS) '.[test]')
	$(PIN_FLOORS) $(PIP_FROM_WHEELS) $(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	COLLECTIVES_BACKEND=mpi $(VENV)/bin/mpiexec -n $(DEMO_RANKS) $(PY) scripts/train.py --epochs 5 --check

demo-collectives: $(STAMP)
	COLLECTIVES_BACKEND=mpi $(VENV)/bin/mpiexec -n $(DEMO_RANKS) $(PY) scripts/demo.py

test: $(STAMP)
	$(VENV)/bin/ruff check collectives backends syncbn tests scripts docs examples
	$(MAKE) typecheck docs
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest $(PYTEST_ARGS)

# mypy, strict, over the installed layout (collectives.backends, collectives.syncbn): see scripts/typecheck.py.
typecheck: $(STAMP)
	$(PY) scripts/typecheck.py

# The API reference from the docstrings (docs/api.rst) into build/docs/html; warnings and
# broken references are errors, and so is a public name missing from it (docs/_ext/public_names.py).
docs: $(STAMP)
	$(VENV)/bin/sphinx-build -q -E -W --keep-going -n -b html -d build/docs/doctrees docs build/docs/html

# Every collective, ours against the raw transport in the same run, nccl-tests style (collectives-bench).
bench: $(STAMP)
	$(VENV)/bin/mpiexec -n 2 $(VENV)/bin/collectives-bench all -b 8 -e 16M -f 4 --raw --check --json docs/bench/mpi.json
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/torchrun --nproc_per_node 2 -m collectives.bench all \
	  -b 8 -e 4M -f 4 --raw --check --json docs/bench/torch-gloo.json
	$(VENV)/bin/collectives-bench --plot-only docs/bench/mpi.json docs/bench/torch-gloo.json --plot docs/bench.png

# End-to-end training step: our DataParallel (+SyncBatchNorm) against torch DDP over Gloo (docs/performance.md).
bench-train: $(STAMP)
	for n in 2 4; do \
	  COLLECTIVES_BACKEND=mpi $(VENV)/bin/mpiexec -n $$n $(PY) scripts/bench/train.py --collective-times \
	    --json docs/bench/train-mpi-$$n.json && \
	  PATH=$(CURDIR)/$(VENV)/bin:$$PATH COLLECTIVES_BACKEND=torch $(VENV)/bin/torchrun --nproc_per_node $$n \
	    scripts/bench/train.py --collective-times --json docs/bench/train-torch-$$n.json || exit 1; \
	done
	$(PY) scripts/bench/train.py --plot-only docs/bench/train-mpi-2.json docs/bench/train-torch-2.json \
	  docs/bench/train-mpi-4.json docs/bench/train-torch-4.json --plot docs/bench/train.png

# torch's own distributed tests (torch.testing._internal.distributed.distributed_test) against the
# backend "collectives" and against Gloo, in the same harness under mpiexec: counts side by side
# (docs/torch_distributed.md), then side by side. SUITE_ARGS=-k PATTERN for a part of it.
SUITE_RANKS ?= 3
test-torch-suite: $(STAMP)
	for b in collectives gloo; do \
	  PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) scripts/torch_suite.py --backend $$b -n $(SUITE_RANKS) \
	    --json docs/bench/torch-suite-$$b-$(SUITE_RANKS).json $(SUITE_ARGS) || exit 1; \
	done
	$(PY) scripts/torch_suite.py --compare docs/bench/torch-suite-collectives-$(SUITE_RANKS).json \
	  docs/bench/torch-suite-gloo-$(SUITE_RANKS).json

# tests/collective_calls/test_many_ranks.py (5 and 8 ranks in `make test`) at MANY_RANKS ranks: the
# collective grid, the check's mismatches, SyncBN and DDP over "collectives" on mpi and torch. On
# 2 cores 16 and 32 ranks load the machine for minutes (docs/testing.md says how long).
MANY_RANKS ?= 16 32
test-many-ranks: $(STAMP)
	COLLECTIVES_MANY_RANKS="$(MANY_RANKS)" PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest \
	  tests/collective_calls/test_many_ranks.py $(PYTEST_ARGS)

# The differential fuzz of the torch backend "collectives" against Gloo (scripts/fuzz_c10d.py): FUZZ_TRIALS
# random calls, valid and not, at 3 and at 4 ranks; FUZZ_ARGS=--debug adds the mismatches only
# COLLECTIVES_DEBUG=1 catches. The suite runs a slice of it (tests/torch_distributed/test_gloo_fuzz.py).
FUZZ_TRIALS ?= 1000
fuzz-c10d: $(STAMP)
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) scripts/fuzz_c10d.py --trials $(FUZZ_TRIALS) --ranks 3 4 \
	  --json docs/bench/fuzz-c10d.json $(FUZZ_ARGS)

# torch DDP over "collectives" (mpi) against DDP over Gloo and our DataParallel, steps interleaved
# in one job (scripts/bench/c10d.py; docs/torch_distributed.md).
bench-c10d: $(STAMP)
	for n in 2 4; do \
	  $(VENV)/bin/mpiexec -n $$n $(PY) scripts/bench/c10d.py --json docs/bench/c10d-ddp-$$n.json || exit 1; \
	done

# `make test` once per Python in PYTHONS, each in its own venv (3.11: .venv); a summary at the end.
test-pythons:
	@summary=""; failed=0; \
	for v in $(PYTHONS); do \
	  $(FIND_PYTHON); \
	  if [ -z "$$py" ]; then summary="$$summary\n  $$v: skipped (no python$$v here)"; continue; fi; \
	  start=$$(date +%s); \
	  if $(MAKE) --no-print-directory test PYTHON=$$py; then r=passed; else r=FAILED; failed=1; fi; \
	  summary="$$summary\n  $$v ($$py): $$r in $$(( $$(date +%s) - start )) s"; \
	done; \
	printf "test-pythons:$$summary\n"; exit $$failed

# The sdist and a manylinux wheel per Python in PYTHONS (x86_64 here) into dist/, built without a
# container engine: Zig's C compiler targeting glibc 2.28, auditwheel's repair, each wheel then
# installed into a fresh venv and asked whether it runs compiled (scripts/wheels.py; its tools in
# build/wheel-tools, from the index). About 2 minutes on 2 cores.
wheels:
	@pythons=""; for v in $(PYTHONS); do \
	  $(FIND_PYTHON); \
	  if [ -z "$$py" ]; then echo "wheels: no python$$v here (set PYTHONS=... to leave it out)"; exit 1; fi; \
	  pythons="$$pythons $$py"; \
	done; \
	$(PYTHON) scripts/wheels.py --out dist $$pythons

# The library on a free-threaded CPython, FT_PYTHON=/path/to/python3.13t (docs/contributing.md says how
# to build one here): a 2-rank job, in the main thread and from 4 threads at once, as installed, with
# PYTHON_GIL=0 and on the Python forms (scripts/free_threaded.py). About 2 minutes.
test-free-threaded:
	@test -n "$(FT_PYTHON)" || { echo "set FT_PYTHON=/path/to/python3.13t (docs/contributing.md: Free-threaded Python)"; exit 1; }
	$(PYTHON) scripts/free_threaded.py $(FT_PYTHON)

# `make test` with the oldest release of every floor pyproject.toml claims (scripts/floors.py pins
# them), on CI's Python, in .venv-oldest.
test-oldest:
	$(MAKE) --no-print-directory test VENV=.venv-oldest FLOORS=1

# scripts/gpu_check.sh rehearsed on CPU in the device image's conditions with its python (3.12) and
# torch (2.11.0: the CUDA build, ~3 GB with its nvidia wheels, downloaded into ~/.cache once); CI
# rehearses with its own python and the suite's torch (tests/gpu/test_gpu_check_script.py). Then the
# GPU tests' jobs and CPU twins run on host tensors under that torch.
rehearse-gpu-image:
	py=$$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.12.*/bin/python3.12 2>/dev/null | tail -1); \
	PYTHON=$${py:-python3.12} TORCH=2.11.0 NUMPY=2.5.2 \
	GPU_REHEARSAL_TESTS="tests/gpu/test_gpu_harness.py tests/gpu/test_gpu_paths.py" scripts/gpu_rehearsal.sh

# The launcher contract, the collective grid and the c10d tests under each MPI library x launcher:
# Open MPI's mpirun, Intel MPI's mpiexec, srun --mpi=pmi2 (MPICH, Intel MPI), srun --mpi=pmix
# (Open MPI), sbatch calling srun, and MPICH's mpiexec (scripts/environments.py: as root it
# installs slurm-wlm, munge and libpmix-dev, and starts and stops a one-node Slurm). A table of
# counts per environment at the end. ENVIRONMENTS=name,name for some; ENV_ARGS=... to pytest.
ENVIRONMENTS ?=
test-environments: $(STAMP)
	$(PY) scripts/environments.py test $(if $(ENVIRONMENTS),--only $(ENVIRONMENTS)) -- $(ENV_ARGS)

# tests/torch_distributed, tests/syncbn and the torch rows of tests/collective_calls on each torch
# release in TORCH_VERSIONS (the floor of pyproject.toml and the newest at least), each in a venv
# .venv-torch-X.Y.Z over .venv, its wheels downloaded once into $(WHEEL_CACHE) (scripts/torch_versions.py).
TORCH_VERSIONS ?= 2.9.1 2.11.0 2.13.0 2.14.1 $(TORCH_NEWEST)
test-torch-versions: $(STAMP)
	$(PY) scripts/torch_versions.py $(TORCH_VERSIONS) -- $(TORCH_ARGS)

# CI's slice of the two above, after `make test` (.ci/run): Open MPI's mpirun and srun --mpi=pmi2
# (the launcher contract, small-integer sums, small calls carried in the check's round and its two blocks, the call path's two forms, DDP over "collectives", ULFM jobs that lose ranks
# to SIGKILL, an exit, an exception and a hang and at each point of the loop, DDP on ULFM across a shrink, and the refusal of
# fault tolerance without ULFM), and the newest torch's
# c10d and elastic tests. As root on a fresh Debian machine it installs what it needs (apt, the wheels).
TORCH_NEWEST := 2.15.0
CI_ENVIRONMENT_TESTS := contract or small_integer or even_collectives or preloaded_pmpi or carried or round_blocks or both_forms_of_the_call_path or closed_split or (ddp_equals and plain) or ulfm_survivors_of_a or ulfm_a_rank_lost or ulfm_torch_ddp or refuses_without_ulfm or plain_init_process_group
# The collective grid and the reliability tests on the Python forms (COLLECTIVES_COMPILED=0), which
# an install without a C compiler runs; `make test` runs the compiled forms. About 6.5 min on 2 cores.
test-python-forms: $(STAMP)
	COLLECTIVES_COMPILED=0 PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest tests/collective_calls tests/reliability $(PYTEST_ARGS)

test-ci-slice: $(STAMP)
	$(PY) scripts/environments.py test --only openmpi-mpirun,mpich-srun-pmi2 -- -k "$(CI_ENVIRONMENT_TESTS)"
	$(PY) scripts/torch_versions.py $(TORCH_NEWEST) -- -k "test_c10d or elastic"

clean:
	rm -rf .venv .venv-* .pytest_cache .hypothesis .mypy_cache build dist backends/*.so collectives/*.so
