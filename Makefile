# Two commands: `make run` (the embedded pipeline on CPU) and `make test`.
# Everything installs into .venv from this repository's own files.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PRESET ?= tiny-cpu
SAO_HOME ?= .sao
export PYTHONHASHSEED := 0
export TOKENIZERS_PARALLELISM := false

.PHONY: setup run test test-slow bench clean

setup: $(STAMP)

# torch first, pinned: it resolves to the CPU wheel; an unpinned torch pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/sao run --preset $(PRESET) --home $(SAO_HOME)

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(VENV) $(SAO_HOME) .pytest_cache
