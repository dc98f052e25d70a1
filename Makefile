# jitckpt: two commands on a fresh machine: `make demo` and `make test`.
# Every target installs what it needs and is safe to re-run.
#
# Python runs from a virtual environment of the project's own (.venv, made from
# the python3 on PATH) unless one is already active: Debian's system python3
# refuses `pip install` (PEP 668).
ifdef VIRTUAL_ENV
VENV := $(VIRTUAL_ENV)
else
VENV := $(CURDIR)/.venv
endif
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
BUILD := $(CURDIR)/build
PYTEST_ARGS ?=
export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))
# jitrun and the tests' subprocesses find the venv's tools first
export PATH := $(VENV)/bin:$(PATH)

.PHONY: all setup build libs test test-fast test-zoo test-asan test-compat gpu-wheels lint demo bench stress clean
all: build

# Debian's python3-venv (ensurepip) and the C toolchain when missing.
$(VENV)/bin/python:
	@python3 -c 'import ensurepip, venv' 2>/dev/null || \
	  scripts/apt_install.sh python3-venv
	python3 -m venv $(VENV)

# Python deps into the venv: the default torch of torch-default.txt (2.13.0; a
# constraint: pyproject gives users the whole tested range) as pip resolves it,
# from whatever index pip is configured with (none configured: PyPI). PyPI's
# Linux build is the CUDA 13.0 one (2.13.0+cu130, ~4 GB with its nvidia-*
# wheels; it runs on the CPU where there is no GPU); a configuration that serves
# the CPU wheel (2.13.0+cpu) gets that. Both builds are supported: the tests
# that put the CPU stand-in under a torch process preload it ahead of torch's
# own CUDA runtime. Stamped so re-runs cost nothing.
$(VENV)/.stamp-setup: pyproject.toml torch-default.txt | $(VENV)/bin/python
	@command -v cc >/dev/null && command -v make >/dev/null || \
	  scripts/apt_install.sh build-essential
	@python3 -c 'import ctypes; ctypes.CDLL("libisal.so.2")' 2>/dev/null || \
	  scripts/apt_install.sh libisal-dev
	$(PIP) install -q -c torch-default.txt -e '.[test,bench]'
	@$(PY) -c 'import torch; c = torch.version.cuda; \
	  print("setup: torch", torch.__version__, "(CUDA " + c + " build)" if c else "(CPU build)")'
	@touch $@
setup: $(VENV)/.stamp-setup

build: setup libs

# libintercept and its stand-ins (no Python needed)
libs:
	@command -v cc >/dev/null && command -v make >/dev/null || \
	  scripts/apt_install.sh build-essential
	$(MAKE) -C libintercept BUILD=$(BUILD) all test-progs

lint: setup
	$(PY) -m ruff check jitckpt launcher scripts tests
	$(PY) scripts/check_structure.py

# Three tests at a time on 2 cores: most of the suite waits on process start-up,
# timeouts and sleeps (two at a time kept the cores ~55 % busy: 30 min against
# 22 min, both alone on this 2-core machine); the 15 slowest are listed at the end.
# Paths in PYTEST_ARGS narrow the run (without any, pyproject's testpaths: tests/).
TEST_WORKERS ?= 3
test: build criu
	$(PY) -m ruff check jitckpt launcher scripts tests
	$(PY) scripts/check_structure.py
	$(PY) -m pytest -n $(TEST_WORKERS) --durations=15 $(PYTEST_ARGS)

# The compatibility subset (tests/compat_subset.txt) on another torch of the
# supported range, e.g. `make test-compat TORCH=2.14.1`: a venv of its own per
# version, build/compat/torch-X (outside .venv; made once, ~5 GB with the CUDA
# wheels, which is what pip resolves here as for users), jitckpt editable in it.
COMPAT_ROOT ?= $(BUILD)/compat
COMPAT_VENV := $(COMPAT_ROOT)/torch-$(TORCH)
$(COMPAT_ROOT)/torch-%/.stamp: pyproject.toml
	rm -rf $(@D)
	python3 -m venv $(@D)
	$(@D)/bin/python -m pip install -q 'torch==$*' -e '.[test]'
	@$(@D)/bin/python -c 'import torch; c = torch.version.cuda; \
	  print("test-compat: torch", torch.__version__, "(CUDA " + c + " build)" if c else "(CPU build)")'
	@touch $@
test-compat: libs
	@python3 -c 'import re, sys; v = "$(TORCH)"; lo, hi = re.search(r"\"torch>=([\d.]+),<([\d.]+)\"", \
	  open("pyproject.toml").read()).groups(); t = lambda s: tuple(map(int, s.split("."))); \
	  ok = re.fullmatch(r"\d+\.\d+\.\d+", v) and t(lo) <= t(v) < t(hi); \
	  ok or sys.exit(f"make test-compat: TORCH={v!r} is not a version X.Y.Z of pyproject'"'"'s range " \
	  f"torch>={lo},<{hi}; e.g. make test-compat TORCH=2.14.1")'
	$(MAKE) $(COMPAT_VENV)/.stamp
	PATH=$(COMPAT_VENV)/bin:$$PATH $(COMPAT_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --durations=10 \
	  $$(grep -v '^#' tests/compat_subset.txt) $(PYTEST_ARGS)

# The wheels jitckpt needs beyond the lent GPU machines' image (Python 3.12, torch 2.11.0+cu130 in
# /opt/torch/.venv, no registry), for scripts/gpu_check.sh: its runtime dependencies at the versions
# .venv tested (cffi and its pycparser, nvidia-ml-py, setproctitle, psutil; whether the image has
# each cannot be known from here, so all travel) in .gpu-wheels/, git-ignored: name it in the
# device tool's `carry`.
GPU_WHEELS := cffi pycparser nvidia-ml-py setproctitle psutil
GPU_PYTHON ?= 3.12
gpu-wheels: setup
	rm -rf .gpu-wheels.tmp && mkdir .gpu-wheels.tmp
	$(PIP) download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .gpu-wheels.tmp \
	  $$($(PIP) list --format=freeze | grep -iE '^($(subst $() ,|,$(GPU_WHEELS)))==')
	rm -rf .gpu-wheels && mv .gpu-wheels.tmp .gpu-wheels
	@ls .gpu-wheels

test-fast: build
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The whole model-zoo recovery matrix (tests/test_model_zoo.py: 216 cells; make test runs a cover of 12 and 5 quick cells)
test-zoo: build
	JITCKPT_ZOO_FULL=1 $(PY) -m pytest -n $(TEST_WORKERS) tests/test_model_zoo.py $(PYTEST_ARGS)

# The shim's tests against the ASan/UBSan build of libjitintercept (the lost-device
# test too: the shim's state crosses a CRIU dump and restore there).
test-asan: build criu
	$(MAKE) -C libintercept BUILD=$(BUILD) asan
	JITCKPT_SHIM=$(BUILD)/asan/libjitintercept.so $(PY) -m pytest $(PYTEST_ARGS) tests/intercept tests/test_device_loss.py

# A real training run under jitrun with an injected failure and its recovery,
# checked bit for bit against the same run without a failure.
demo: build
	$(PY) scripts/demo.py

bench: build
	$(PY) scripts/bench_overhead.py
	$(PY) scripts/bench_recovery.py

# 300 warm restarts with faults in every phase and at exit (the short form runs in make test)
stress: build
	$(PY) scripts/stress_warm.py --jobs 10 --restarts 31

clean:
	rm -rf build demo_runs

# CRIU for process migration (issue 13): the distribution's when it works on this
# kernel, else 4.1.1 built once per machine into ~/.cache/jitckpt (survives `make
# clean`), linked at build/criu/criu. < 0.1 s when done. Best effort under `make
# test` (the CRIU tests then skip with the reason); `make criu` fails loudly.
.PHONY: criu
criu:
	scripts/build_criu.sh $(if $(filter criu,$(MAKECMDGOALS)),,--best-effort)
