# Set-up on a fresh machine is part of every target: venv, pinned dependencies, data.
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | cksum | cut -d' ' -f1)
COMPILED := $(VENV)/.compiled

.PHONY: run check test test-unit test-integration test-system test-matrix test-images lint setup data tools docs lock clean

run: setup
	$(BIN)/raysim run configs/quickstart.yaml

# The tests $(1), with lint, format and types (`make lint`) checked meanwhile: their output after the tests';
# either failing fails the target.
define beside_lint
@$(MAKE) --no-print-directory lint > $(VENV)/lint.log 2>&1 & lint=$$!; \
$(1); tests=$$?; \
wait $$lint; linted=$$?; cat $(VENV)/lint.log; \
if [ $$linted -ne 0 ]; then echo "make $@: lint, format or types failed (above)"; fi; \
exit $$(( tests || linted ))
endef

# What a contributor runs before a commit: the unit tier (tests/unit: no Ray, no process) beside lint.
check: setup
	$(call beside_lint,$(BIN)/pytest -q -n 2 tests/unit)

# pytest-xdist workers for the tiers that start processes: one more than the 2 cores, so that while a test waits (a
# server or a Ray starting, a signal's grace, Ray's own timeouts) the third keeps both cores busy (docs/development.md,
# Scheduling). The unit tier (`make check`) waits for nothing: two workers.
WORKERS := 3

# Everything (what CI runs: .ci/run): the three tiers beside lint, this checkout's code byte-compiled first (OWN_CODE).
test: setup $(COMPILED)
	$(BIN)/python -m compileall -q -j 0 $(OWN_CODE) > /dev/null
	$(call beside_lint,$(BIN)/pytest -q -rs --durations=25 -n $(WORKERS) --dist loadgroup --no-loadscope-reorder)

# One tier alone (tests/<tier>: docs/development.md says what belongs where).
test-unit test-integration test-system: test-%: setup
	$(BIN)/pytest -q -rs -n $(WORKERS) --dist loadgroup --no-loadscope-reorder tests/$*

# The configuration matrix alone (tests/integration/test_matrix*.py, also part of `make test`).
test-matrix: setup
	$(BIN)/pytest -q -rs -n $(WORKERS) --dist loadgroup --no-loadscope-reorder -m matrix

# The docker images built and run (tests/system/check_images.py; not in `make test`, whose collection takes test_*.py
# only: it needs a Docker engine and root and builds for minutes): the Debian base from Debian's packages, the raysim,
# MLflow and PostgreSQL images on it, then the quickstart in a container against compose's MLflow on PostgreSQL.
# DOCKER=/path/to/docker picks a docker CLI that builds with BuildKit.
test-images: setup
	$(BIN)/pytest -p no:xdist -q -s -rs tests/system/check_images.py

lint: setup
	$(BIN)/ruff check raysim tests jobs benchmarks
	$(BIN)/ruff format --check raysim tests jobs benchmarks
	$(BIN)/mypy raysim jobs

setup: $(STAMP) data tools

# The pinned set is installed by uv (pinned here, itself from PyPI): 15 s against pip's 60 on the 2-core machine, two
# thirds of pip's spent resolving 175,000 index links. uv does not read pip's configuration, so pip's find-links (the
# local CPU torch wheel: ../shared/platform.md) are handed to it; without them it would take PyPI's CUDA torch.
UV       := uv==0.13.10
FIND_LINKS = $(shell python3 -m pip config get global.find-links 2>/dev/null)
$(STAMP):
	python3 -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check '$(UV)'
	$(BIN)/uv pip install -q --python $(BIN)/python $(addprefix --find-links ,$(FIND_LINKS)) \
	  -c constraints.txt -e '.[dev,postgres]'
	$(BIN)/python -m raysim.torchvision_compat
	rm -f $(VENV)/.installed-* $(COMPILED) && touch $@

# For `make test`, the packages are byte-compiled once, on both cores: left to the first import, every process that
# imports a module before its .pyc exists compiles it for itself, and at the start of `make test` a dozen do at once
# (pytest workers, Ray daemons and workers, a cluster's nodes): an import of torch, Ray and MLflow took 14 CPU s
# without .pyc files against 6 with them. `make check`'s two pytest workers compile what they import (less than the
# whole environment). Left out (NOT_IMPORTED), as no process of `make test` imported them (the .pyc files it read, by
# their access times): the packages' own test folders (118 of the 432 MB of .pyc) and four whole packages (52 MB);
# 40 CPU s of compiling instead of 50. A module left out is compiled by the first process that imports it.
NOT_IMPORTED := /tests/|/site-packages/(sktime|networkx|databricks|mypy)/
# This checkout's own code is not in the environment (an editable install): `make test` byte-compiles what changed of
# it before its tests. Where no process writes its own .pyc (PYTHONDONTWRITEBYTECODE, as on these machines), every
# Ray worker compiled the modules it preloads (0.45 CPU s of its 1.8 s import) and every `raysim` process what it
# imports, each for itself.
OWN_CODE := raysim jobs tests benchmarks
$(COMPILED): $(STAMP)
	$(BIN)/python -m compileall -q -j 0 -x '$(NOT_IMPORTED)' \
	  $$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') > /dev/null 2>&1 || true
	touch $@

data: $(STAMP)
	$(BIN)/python -m raysim.data.fetch

# The documentation site (MkDocs Material) into site/; the configuration reference is generated from the models.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# Headless Chromium for the UI screenshots test, pdflatex with booktabs for the LaTeX table test and PostgreSQL for
# the MLflow-on-PostgreSQL test, which starts its own server in a temporary folder (Debian's packages without
# recommends: about 140 MB for TeX, 170 MB for PostgreSQL with its JIT's LLVM; as root with apt-get, like
# Fashion-MNIST). APT waits up to 10 minutes for another apt process's lock (unattended upgrades on a fresh cloud
# machine) instead of failing.
APT := apt-get -o DPkg::Lock::Timeout=600
tools:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && $(APT) update -qq >/dev/null 2>&1 && $(APT) install -y -qq chromium >/dev/null 2>&1; } \
	  || echo "note: tests/test_ui.py needs headless Chromium (Debian: apt-get install chromium)"
	@command -v pdflatex >/dev/null 2>&1 || { [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && $(APT) update -qq >/dev/null 2>&1 && $(APT) install -y -qq --no-install-recommends texlive-latex-base \
	  texlive-latex-recommended >/dev/null 2>&1; } \
	  || echo "note: tests/test_table.py needs pdflatex and booktabs (Debian: texlive-latex-recommended)"
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { [ "$$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && $(APT) update -qq >/dev/null 2>&1 && $(APT) install -y -qq --no-install-recommends postgresql >/dev/null 2>&1; } \
	  || echo "note: tests/system/test_postgres.py needs PostgreSQL (Debian: apt-get install postgresql)"

# Re-resolve the full pinned dependency set after editing pyproject.toml.
lock:
	python3 -m venv /tmp/raysim-lock && /tmp/raysim-lock/bin/pip install -q 'torch==2.13.0' -e '.[dev,postgres]' \
	  && /tmp/raysim-lock/bin/pip freeze --exclude-editable | sed 's/+cpu//' > constraints.txt

clean:
	rm -rf $(VENV) mlflow.db mlruns mlartifacts
