# geosharp — two commands on a fresh machine: `make test` and `make demo`.
# Each creates .venv when missing and installs exactly requirements.lock (every package, transitive
# ones included, at one version; `make lock` regenerates it), then geosharp itself, editable.

SHELL  := bash
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: test demo docs lint format bench clean install lock test-latest test-oldest

$(PY):
	$(PYTHON) -m venv $(VENV)

# The lock is complete (tools/lock.sh resolved it), so nothing is resolved here: --no-deps
# everywhere, the build backend from the lock too (--no-build-isolation), then a check that the
# venv holds exactly the lock (a package left from an older lock fails it: `make clean`).
$(STAMP): $(PY) pyproject.toml requirements.lock
	$(PIP) install --quiet --disable-pip-version-check --no-deps "$$(grep '^pip==' requirements.lock)"
	$(PIP) install --quiet --no-deps -r requirements.lock
	$(PIP) install --quiet --no-deps --no-build-isolation -e .
	bash tools/lock.sh --check $(VENV)
	touch $(STAMP)

install: $(STAMP)

# The suite on $(WORKERS) pytest-xdist processes, a test file per process at a time (--dist
# loadfile: a file's module fixtures, e.g. the FSDP worlds of tests/estimators/test_fsdp.py, run
# once); conftest.py gives each worker one thread. `make test WORKERS=0` runs it in one process.
WORKERS ?= 2

test: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile

demo: $(STAMP)
	$(PY) -m geosharp.demos.invariance
	@echo
	$(VENV)/bin/geosharp study diagonal --out runs/diagonal

# The documentation site as static HTML in build/site (open build/site/index.html); --strict:
# any warning (a broken link, a docstring griffe cannot read) fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir build/site
	@echo "documentation: build/site/index.html"

lint: $(STAMP)
	$(PY) -m ruff check src tests benchmarks

format: $(STAMP)
	$(PY) -m ruff format src tests benchmarks
	$(PY) -m ruff check --fix src tests benchmarks

bench: $(STAMP)
	$(PY) benchmarks/geometry_bench.py

# requirements.lock anew from pyproject.toml's ranges and constraints.txt (pip's own resolver,
# in a scratch venv): review `git diff requirements.lock`, run `make test`, commit both.
lock:
	bash tools/lock.sh

# The newest versions pyproject.toml allows (only torch held at its CPU build), in a scratch venv,
# and the test suite on them: meet an upstream release on purpose. Not in CI.
test-latest:
	bash tools/lock.sh --latest build/latest-venv
	build/latest-venv/bin/python -m pytest -q

# The lower bounds of pyproject.toml (tools/lower_bounds.py), in a scratch venv, and the suite.
test-oldest:
	bash tools/lock.sh --oldest build/oldest-venv
	build/oldest-venv/bin/python -m pytest -q

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
