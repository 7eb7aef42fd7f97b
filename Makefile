# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
# The venv is rebuilt only when pyproject.toml changes (a stamp keyed on its hash).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-16)
# tinker-cookbook, the test client of tests/cookbook, only for `make test`. It goes in with --no-deps (its
# tml-renderers>=0.4.1 is not on the package index, and its requirements must not move torch); the
# `cookbook` extra of pyproject.toml holds what its modules import. Its stamp is keyed on pyproject.toml
# and this pin, so a change to either reinstalls it.
COOKBOOK := tinker-cookbook==0.6.1
COOKBOOK_STAMP := $(VENV)/.cookbook-$(shell (sha1sum pyproject.toml; echo '$(COOKBOOK)') | sha1sum | cut -c1-16)
SERVE_ARGS ?=

.PHONY: install serve test lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

$(COOKBOOK_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev,cookbook]'
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps '$(COOKBOOK)'
	@rm -f $(VENV)/.cookbook-*
	@touch $@

serve: $(STAMP)
	$(VENV)/bin/loraplex serve $(SERVE_ARGS)

test: $(COOKBOOK_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests bench examples
	$(VENV)/bin/ruff format src tests bench examples

clean:
	rm -rf $(VENV) .pytest_cache
