# The two commands a new user needs:
#   make run   - set up everything and start the whole system on the embedded default
#   make test  - set up everything and run the whole test suite
SHELL := /bin/bash
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup system-deps model run test test-fast lint bench-hashing clean

setup:
	@scripts/bootstrap.sh

# Debian packages only the tests need (kubectl, podman, runc, mmdebstrap).
system-deps:
	@scripts/system-deps.sh

model: setup
	$(BIN)/cpd model build

run: model
	$(BIN)/cpd up

# The slowest tests are listed at the end: the suite's time is watched.
test: model system-deps
	$(BIN)/python -m pytest --durations=25 $(PYTEST_ARGS)

# Everything but the slow end-to-end tests (CI runs them all via `make test`).
test-fast: model
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

bench-hashing: setup
	$(BIN)/cpd bench hashing --json out/bench-hashing.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
