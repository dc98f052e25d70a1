# jitckpt: two commands on a fresh machine: `make demo` and `make test`.
# Every target installs what it needs and is safe to re-run.
PY ?= python3
PIP ?= $(PY) -m pip
BUILD := $(CURDIR)/build
PYTEST_ARGS ?=
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: all setup build test test-fast test-asan lint demo bench clean
all: build

# Toolchain from Debian when missing; Python deps (torch pinned to the local CPU
# wheel) into the current interpreter. Stamped so re-runs cost nothing.
.stamp-setup: pyproject.toml
	@command -v cc >/dev/null && command -v make >/dev/null || \
	  { apt-get update -qq && apt-get install -y -qq build-essential; }
	$(PIP) install -q -e '.[test,bench]'
	@touch $@
setup: .stamp-setup

build: .stamp-setup
	$(MAKE) -C libintercept BUILD=$(BUILD) all test-progs

lint: .stamp-setup
	$(PY) -m ruff check jitckpt launcher scripts tests

test: build
	$(PY) -m ruff check jitckpt launcher scripts tests
	$(PY) -m pytest $(PYTEST_ARGS) tests

test-fast: build
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS) tests

# The shim's tests against the ASan/UBSan build of libjitintercept.
test-asan: build
	$(MAKE) -C libintercept BUILD=$(BUILD) asan
	JITCKPT_SHIM=$(BUILD)/asan/libjitintercept.so $(PY) -m pytest $(PYTEST_ARGS) tests/intercept

# A real training run under jitrun with an injected failure and its recovery,
# checked bit for bit against the same run without a failure.
demo: build
	$(PY) scripts/demo.py

bench: build
	$(PY) scripts/bench_overhead.py
	$(PY) scripts/bench_recovery.py

clean:
	rm -rf build .stamp-setup demo_runs
