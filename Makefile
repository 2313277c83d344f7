# Two commands do all set-up on a fresh machine:
#   make demo   the main job (dppo train with defaults)
#   make test   create .venv, build the extension, install the oracle (verl), run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch 2.14.1 (a CUDA 13.0 build) lies in the local wheel cache on this project's machines.
TORCH_SPEC ?= torch==2.14.1
PYTEST_ARGS ?=

BUILD_INPUTS := setup.py pyproject.toml $(wildcard csrc/*)
# verl's own functions, the oracle of tests/oracle: installed without their heavy dependencies.
ORACLE_REQUIREMENTS := tests/oracle/requirements.txt

.PHONY: all install build test demo bench docs clean

all: install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade "pip>=24" "setuptools>=77" wheel ninja numpy
	$(BIN)/python -m pip install "$(TORCH_SPEC)"

# The stamp rebuilds the extension whenever setup.py or anything in csrc/ changes.
$(VENV)/.installed: $(BIN)/python $(BUILD_INPUTS)
	$(BIN)/python -m pip install --no-build-isolation -e ".[test]"
	$(BIN)/python -m dppo.build_info
	touch $@

$(VENV)/.oracle: $(BIN)/python $(ORACLE_REQUIREMENTS)
	$(BIN)/python -m pip install --no-deps -r $(ORACLE_REQUIREMENTS)
	touch $@

install: $(VENV)/.installed

build: install

test: install $(VENV)/.oracle
	$(BIN)/lint-imports
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/dppo train

bench: install
	$(BIN)/python benchmarks/snapshot_bench.py
	$(BIN)/python benchmarks/cycle_bench.py

# docs/config_keys.md from the config schema (a test fails while it is stale).
docs: install
	$(BIN)/python -c "from dppo.config.load import markdown_reference; open('docs/config_keys.md', 'w').write(markdown_reference())"

clean:
	rm -rf build dist *.egg-info dppo/*.so $(VENV)

# dppo against TRL's GRPOTrainer on the demo's work (issue 18; docs/benchmarks.md, "dppo against TRL"). TRL lives in
# a venv of its own and is never a dependency of dppo; it gets the same torch and transformers as .venv.
TRL_VENV ?= .venv-trl
TRL_SPEC ?= trl==1.16.0
PEERS_ARGS ?= --out bench_out/peers.json

$(TRL_VENV)/.installed: $(VENV)/.installed
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install --upgrade "pip>=24"
	$(TRL_VENV)/bin/python -m pip install "$(TORCH_SPEC)" "$(TRL_SPEC)" \
		"transformers==$$($(BIN)/python -c 'import transformers; print(transformers.__version__)')"
	touch $@

.PHONY: bench-peers
bench-peers: install $(TRL_VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/peer_bench.py $(PEERS_ARGS)
