# Two commands for a newcomer: `make demo` and `make test`. Both create .venv when missing.
# Tests come in two tiers: `make test` (the fast tier, every test not marked `full`: minutes)
# and `make test-all` (both tiers: the 8-device sharding checks, the broad property searches,
# sweeps and benches too, and programs compiled for an H100 and a TPU v5e from .venv-aot).
# `make test-full` runs the full tier alone (CI: `make test` first).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PEER_STAMP := $(VENV)/.installed-peer
# Compiling for chips that are not here (scripts/aot_check.py): its own venv, since the CUDA
# and TPU plugins make jax look for those devices at every start.
AOT_VENV := .venv-aot
AOT_STAMP := $(AOT_VENV)/.installed

.PHONY: demo test test-all test-full install aot-venv clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

# The tests also cover the benchmark's Hugging Face peer (torch CPU + transformers) and the
# OpenAI-compatible server (fastapi, uvicorn, the openai client).
$(PEER_STAMP): $(STAMP)
	$(BIN)/pip install -q -e ".[dev,peer,serve]"
	touch $(PEER_STAMP)

install: $(STAMP)

$(AOT_STAMP): pyproject.toml
	test -d $(AOT_VENV) || $(PY) -m venv $(AOT_VENV)
	$(AOT_VENV)/bin/pip install -q --upgrade pip
	$(AOT_VENV)/bin/pip install -q -e ".[aot]"
	touch $(AOT_STAMP)

aot-venv: $(AOT_STAMP)

# Trains the tiny V4.1 preset for a few CPU minutes (runs/demo-v41; a rerun resumes), shows
# its KV cache beside MHA and MLA, decodes a sample.
demo: $(STAMP)
	$(BIN)/python scripts/demo.py

PYTEST := $(BIN)/python -m pytest -q -n 2 --dist worksteal --durations=15

test: $(PEER_STAMP)
	$(PYTEST) -x -m "not full" tests

test-all: $(PEER_STAMP) $(AOT_STAMP)
	$(PYTEST) tests

test-full: $(PEER_STAMP) $(AOT_STAMP)
	$(PYTEST) -m full tests

clean:
	rm -rf $(VENV) $(AOT_VENV) runs .pytest_cache
