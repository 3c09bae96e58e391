# The two commands of the README: `make demo` and `make test`. Both set up the
# virtual environment in .venv on first use (and again when pyproject.toml changes).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_RANKS ?= 4

.PHONY: demo demo-collectives test typecheck docs lint bench clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (Python >= 3.10); set PYTHON=..."; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# The distribution was called `collectives` before: drop it, or pytest loads its old plugin entry point too.
	$(PY) -m pip uninstall --quiet --yes collectives 2>/dev/null || true
	rm -rf collectives.egg-info
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	COLLECTIVES_BACKEND=mpi $(VENV)/bin/mpiexec -n $(DEMO_RANKS) $(PY) scripts/train.py --epochs 5 --check

demo-collectives: $(STAMP)
	COLLECTIVES_BACKEND=mpi $(VENV)/bin/mpiexec -n $(DEMO_RANKS) $(PY) scripts/demo.py

test: $(STAMP)
	$(VENV)/bin/ruff check collectives backends syncbn tests scripts docs
	$(MAKE) typecheck docs
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m pytest $(PYTEST_ARGS)

# mypy, strict, over the installed layout (collectives.backends, collectives.syncbn): see scripts/typecheck.py.
typecheck: $(STAMP)
	$(PY) scripts/typecheck.py

# The API reference from the docstrings (docs/api.rst) into build/docs/html; warnings and
# broken references are errors, and so is a public name missing from it (docs/_ext/public_names.py).
docs: $(STAMP)
	$(VENV)/bin/sphinx-build -q -E -W --keep-going -n -b html -d build/docs/doctrees docs build/docs/html

bench: $(STAMP)
	$(VENV)/bin/mpiexec -n 2 $(PY) scripts/bench.py --json docs/bench/mpi-multiple.json
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(VENV)/bin/torchrun --nproc_per_node 2 scripts/bench.py --json docs/bench/torch-gloo.json
	$(PY) scripts/bench.py --plot-only docs/bench/mpi-multiple.json docs/bench/torch-gloo.json --plot docs/bench.png

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .mypy_cache build
