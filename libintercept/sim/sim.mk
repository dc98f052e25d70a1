# Rules for the CPU stand-in runtime (included by libintercept/Makefile).
# Paths are relative to libintercept/.
SIM_OUT   := $(BUILD)/sim
SIMT_OUT  := $(BUILD)/sim-tests
SIM_CPPFLAGS := -Iabi -Isim

# Real headers for `make check-abi`; each check is skipped when absent.
CUDA_INCLUDE ?= /usr/local/cuda/include
NCCL_WHEEL_DIR := $(BUILD)/nccl-wheel
NCCL_INCLUDE ?= $(firstword $(patsubst %/nccl.h,%,$(wildcard \
	$(NCCL_WHEEL_DIR)/nvidia/nccl/include/nccl.h /usr/include/nccl.h \
	$(CUDA_INCLUDE)/nccl.h)))

.PHONY: check-abi check-abi-own fetch-nccl-header clean-sim

SIM_CFLAGS  = $(CFLAGS) -fvisibility=hidden $(SIM_CPPFLAGS)
SIM_LDFLAGS = -shared -Wl,-z,defs -Wl,--as-needed -pthread
SIM_CORE    = $(SIM_OUT)/libjitsimcore.so
SIM_LIBS    = $(SIM_CORE) $(SIM_OUT)/libcudart.so.12 $(SIM_OUT)/libcudart.so.13 \
              $(SIM_OUT)/libnccl.so.2 $(SIM_OUT)/libcudart.so $(SIM_OUT)/libnccl.so \
              $(SIM_OUT)/jitsim-cleanup $(SIM_OUT)/libnvidia-ml.so.1
SIM_HDRS    = abi/cuda_abi.h abi/nccl_abi.h sim/simcore.h

all: sim
.SECONDARY: $(SIM_OUT)/cudart12.map $(SIM_OUT)/cudart13.map
sim: $(SIM_LIBS)

$(SIM_OUT)/.dir:
	mkdir -p $(SIM_OUT) && touch $@

# "Driver" shared by both runtimes and NCCL (see sim/simcore.h for why).
$(SIM_CORE): sim/simcore.c $(SIM_HDRS) sim/jitsimcore.map $(SIM_OUT)/.dir
	$(CC) $(SIM_CFLAGS) $(SIM_LDFLAGS) -Wl,-soname,libjitsimcore.so \
	  -Wl,--version-script=sim/jitsimcore.map -o $@ sim/simcore.c

$(SIM_OUT)/cudart%.map: sim/cudart.map.in $(SIM_OUT)/.dir
	sed 's/@MAJOR@/$*/g' $< > $@

# Not-simulated entry points, generated: what the supported torch versions'
# CUDA builds import (sim/torch_imports/, from scripts/torch_cuda_imports.py)
# less what the hand-written sources define (their objects, read with nm).
SIM_IMPORTS := $(sort $(wildcard sim/torch_imports/torch-*.txt))
SIM_GEN     := $(SIM_OUT)/gen
$(SIM_GEN)/.dir:
	mkdir -p $(SIM_GEN) && touch $@
$(SIM_GEN)/cudart.o: sim/cudart.c $(SIM_HDRS) $(SIM_GEN)/.dir
	$(CC) $(SIM_CFLAGS) -DJITSIM_CUDART_MAJOR=13 -c -o $@ $<
$(SIM_GEN)/cudart_unsupported.o: sim/cudart_unsupported.c $(SIM_HDRS) $(SIM_GEN)/.dir
	$(CC) $(SIM_CFLAGS) -DJITSIM_CUDART_MAJOR=13 -c -o $@ $<
$(SIM_GEN)/nccl.o: sim/nccl.c $(SIM_HDRS) $(SIM_GEN)/.dir
	$(CC) $(SIM_CFLAGS) -c -o $@ $<
$(SIM_GEN)/cudart_stubs.c: sim/gen_stubs.sh $(SIM_IMPORTS) $(SIM_GEN)/cudart.o $(SIM_GEN)/cudart_unsupported.o
	sh sim/gen_stubs.sh cudart $@ "$(SIM_IMPORTS)" $(SIM_GEN)/cudart.o $(SIM_GEN)/cudart_unsupported.o
$(SIM_GEN)/nccl_stubs.c: sim/gen_stubs.sh $(SIM_IMPORTS) $(SIM_GEN)/nccl.o
	sh sim/gen_stubs.sh nccl $@ "$(SIM_IMPORTS)" $(SIM_GEN)/nccl.o

$(SIM_OUT)/libcudart.so.%: sim/cudart.c sim/cudart_unsupported.c $(SIM_GEN)/cudart_stubs.c $(SIM_HDRS) \
                           $(SIM_OUT)/cudart%.map $(SIM_CORE)
	$(CC) $(SIM_CFLAGS) -DJITSIM_CUDART_MAJOR=$* $(SIM_LDFLAGS) -Wl,-soname,libcudart.so.$* \
	  -Wl,--version-script=$(SIM_OUT)/cudart$*.map -o $@ sim/cudart.c sim/cudart_unsupported.c \
	  $(SIM_GEN)/cudart_stubs.c -L$(SIM_OUT) -ljitsimcore -Wl,-rpath,'$$ORIGIN' -Wl,-Bsymbolic-functions

$(SIM_OUT)/libnccl.so.2: sim/nccl.c $(SIM_GEN)/nccl_stubs.c $(SIM_HDRS) sim/nccl.map $(SIM_CORE)
	$(CC) $(SIM_CFLAGS) $(SIM_LDFLAGS) -Wl,-soname,libnccl.so.2 \
	  -Wl,--version-script=sim/nccl.map -o $@ sim/nccl.c $(SIM_GEN)/nccl_stubs.c \
	  -L$(SIM_OUT) -ljitsimcore -lrt -Wl,-rpath,'$$ORIGIN'

# Link-time names, as in a CUDA toolkit: libcudart.so -> the newest runtime.
$(SIM_OUT)/libcudart.so: $(SIM_OUT)/libcudart.so.13
	ln -sf libcudart.so.13 $@
$(SIM_OUT)/libnccl.so: $(SIM_OUT)/libnccl.so.2
	ln -sf libnccl.so.2 $@

# NVML for jitrun's health checks (launcher/devices/health.py), with injectable device faults.
$(SIM_OUT)/libnvidia-ml.so.1: sim/nvml.c $(SIM_OUT)/.dir
	$(CC) $(SIM_CFLAGS) $(SIM_LDFLAGS) -Wl,-soname,libnvidia-ml.so.1 -o $@ sim/nvml.c

$(SIM_OUT)/jitsim-cleanup: sim/jitsim-cleanup.c $(SIM_OUT)/.dir
	$(CC) $(CFLAGS) -o $@ $<

check-abi: check-abi-own
	@if [ -f $(CUDA_INCLUDE)/cuda_runtime_api.h ]; then \
	  set -e; mkdir -p $(SIM_OUT)/check; \
	  echo "check-abi: CUDA runtime vs $(CUDA_INCLUDE)"; \
	  $(CC) $(CFLAGS) -Iabi -I$(CUDA_INCLUDE) -c -o $(SIM_OUT)/check/cuda.o abi/check_cuda_abi.c; \
	  if command -v $(CXX) >/dev/null; then \
	    $(CXX) -Wall -Wextra -Werror -Iabi -I$(CUDA_INCLUDE) -fsyntax-only abi/check_cuda_abi_cxx.cc; \
	  else echo "check-abi: SKIPPED __cuda* launch prototypes (no $(CXX))"; fi; \
	else echo "check-abi: SKIPPED CUDA (no $(CUDA_INCLUDE)/cuda_runtime_api.h)"; fi
	@if [ -n "$(NCCL_INCLUDE)" ] && [ -f $(CUDA_INCLUDE)/cuda_runtime.h ]; then \
	  set -e; mkdir -p $(SIM_OUT)/check; \
	  echo "check-abi: NCCL vs $(NCCL_INCLUDE)/nccl.h"; \
	  $(CC) $(CFLAGS) -Iabi -I$(NCCL_INCLUDE) -I$(CUDA_INCLUDE) -c -o $(SIM_OUT)/check/nccl.o abi/check_nccl_abi.c; \
	else echo "check-abi: SKIPPED NCCL (no nccl.h; try 'make -C libintercept fetch-nccl-header')"; fi

check-abi-own:
	@mkdir -p $(SIM_OUT)/check
	$(CC) $(CFLAGS) -Iabi -o $(SIM_OUT)/check/own abi/check_own_abi.c

# Fetches nccl.h from the nvidia-nccl-cu13 wheel into $(BUILD) (network, ~300 MB
# download; nothing is installed).
fetch-nccl-header:
	mkdir -p $(NCCL_WHEEL_DIR)
	pip download --no-deps -d $(NCCL_WHEEL_DIR) nvidia-nccl-cu13
	cd $(NCCL_WHEEL_DIR) && unzip -o -q nvidia_nccl_cu13-*.whl 'nvidia/nccl/include/nccl.h'

clean: clean-sim
clean-sim:
	rm -rf $(SIM_OUT) $(SIMT_OUT)

# ---- test programs (tests/intercept/test_sim*.py run them) ----
SIMT_SRC   := ../tests/intercept/sim_progs
SIMT_PROGS := $(SIMT_OUT)/sim_cuda $(SIMT_OUT)/sim_cuda12 $(SIMT_OUT)/sim_nccl $(SIMT_OUT)/sim_dlopen $(SIMT_OUT)/libsimdl.so
SIMT_DEPS  := $(SIMT_SRC)/simtest.h $(SIM_HDRS)
SIMT_LINK  := -L$(SIM_OUT) -Wl,-rpath,$(SIM_OUT)

test-progs: sim $(SIMT_PROGS)

$(SIMT_OUT)/.dir:
	mkdir -p $(SIMT_OUT) && touch $@

$(SIMT_OUT)/sim_cuda: $(SIMT_SRC)/sim_cuda.c $(SIMT_DEPS) $(SIM_OUT)/libcudart.so $(SIMT_OUT)/.dir
	$(CC) $(CFLAGS) -Iabi -o $@ $< $(SIMT_LINK) -lcudart

# The same checks against the CUDA 12 runtime (`cudaX@libcudart.so.12`).
$(SIMT_OUT)/sim_cuda12: $(SIMT_SRC)/sim_cuda.c $(SIMT_DEPS) $(SIM_OUT)/libcudart.so.12 $(SIMT_OUT)/.dir
	$(CC) $(CFLAGS) -DSIM_CUDART12 -Iabi -o $@ $< $(SIMT_LINK) -l:libcudart.so.12

$(SIMT_OUT)/sim_nccl: $(SIMT_SRC)/sim_nccl.c $(SIMT_DEPS) $(SIM_OUT)/libcudart.so $(SIM_OUT)/libnccl.so $(SIMT_OUT)/.dir
	$(CC) $(CFLAGS) -Iabi -o $@ $< $(SIMT_LINK) -lnccl -lcudart

# A library that needs libcudart.so.13, for the RTLD_LOCAL dlopen case: the
# program below links neither cudart nor NCCL itself.
$(SIMT_OUT)/libsimdl.so: $(SIMT_SRC)/simdl_lib.c $(SIMT_DEPS) $(SIM_OUT)/libcudart.so $(SIMT_OUT)/.dir
	$(CC) $(CFLAGS) -Iabi -shared -o $@ $< $(SIMT_LINK) -lcudart

$(SIMT_OUT)/sim_dlopen: $(SIMT_SRC)/sim_dlopen.c $(SIMT_OUT)/.dir
	$(CC) $(CFLAGS) -o $@ $< -ldl
