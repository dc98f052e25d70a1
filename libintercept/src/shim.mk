# Rules for the LD_PRELOAD shim (included by libintercept/Makefile).
# Paths are relative to libintercept/.
#   make shim             -> $(BUILD)/libjitintercept.so      (also part of `all`)
#   make asan             -> $(BUILD)/asan/libjitintercept.so (ASan + UBSan)
#   make shim-test-progs  -> $(BUILD)/shim-tests/*            (needs the stand-in: `sim`)
SHIM_SRCS := $(wildcard src/shim_*.c)
SHIM_HDRS := $(wildcard src/*.h) include/jitintercept.h abi/cuda_abi.h abi/nccl_abi.h src/shim.map
SHIM_CPPFLAGS := -Iabi -Iinclude -Isrc
SHIM_CFLAGS := -std=gnu11 -fvisibility=hidden -ftls-model=initial-exec
SHIM_LDFLAGS := -shared -Wl,--version-script=src/shim.map -Wl,-z,defs -Wl,-z,now -ldl -lpthread
SHIM_TESTS := $(BUILD)/shim-tests
, := ,
SHIM_ASAN_FLAGS := -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined

.PHONY: shim asan shim-test-progs clean-shim
all: shim
shim: $(BUILD)/libjitintercept.so
asan: $(BUILD)/asan/libjitintercept.so

$(BUILD)/libjitintercept.so: $(SHIM_SRCS) $(SHIM_HDRS) src/check_table_abi.c
	@mkdir -p $(dir $@)
	@if [ -f $(CUDA_INCLUDE)/cuda_runtime_api.h ]; then \
	  echo "shim: table prototypes vs $(CUDA_INCLUDE)/cuda_runtime_api.h"; \
	  $(CC) $(CFLAGS) $(SHIM_CPPFLAGS) -I$(CUDA_INCLUDE) -fsyntax-only src/check_table_abi.c; \
	else echo "shim: no $(CUDA_INCLUDE)/cuda_runtime_api.h, table prototypes checked against abi/ only"; fi
	$(CC) $(CFLAGS) $(SHIM_CFLAGS) $(SHIM_CPPFLAGS) -o $@ $(SHIM_SRCS) $(SHIM_LDFLAGS)

$(BUILD)/asan/libjitintercept.so: $(SHIM_SRCS) $(SHIM_HDRS)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(SHIM_ASAN_FLAGS) $(SHIM_CFLAGS) $(SHIM_CPPFLAGS) -o $@ $(SHIM_SRCS) \
	  $(SHIM_LDFLAGS)

# Test programs. Each links against the stand-in runtime (real SONAMEs, so the
# references are versioned `cudaX@libcudart.so.13`) and never against the shim;
# pytest runs them with LD_PRELOAD. realcudart links the toolkit's runtime.
SHIM_PROG_SRCS := $(wildcard ../tests/intercept/shim_progs/*.c)
SHIM_SIM := $(BUILD)/sim
SHIM_PROG_CFLAGS := $(CFLAGS) -std=gnu11 -O1 -g -Wno-unused-parameter -Wno-format-truncation $(SHIM_CPPFLAGS)
SHIM_PROG_SIM_LIBS = -L$(SHIM_SIM) -Wl,-rpath,$(SHIM_SIM) -l:libcudart.so.13 -l:libnccl.so.2 -ldl -lpthread
CUDA_LIB64 ?= /usr/local/cuda/lib64

SHIM_PROGS := $(SHIM_TESTS)/ranks $(SHIM_TESTS)/replay $(SHIM_TESTS)/dp $(SHIM_TESTS)/vhandles $(SHIM_TESTS)/bench \
	$(SHIM_TESTS)/blocker.so $(SHIM_TESTS)/dp.so $(SHIM_TESTS)/localload $(SHIM_TESTS)/liblocal.so $(SHIM_TESTS)/v12 \
	$(SHIM_TESTS)/v13 $(SHIM_TESTS)/variants/unversioned/libjitintercept.so \
	$(SHIM_TESTS)/variants/v13only/libjitintercept.so
shim-test-progs: sim $(SHIM_PROGS) $(if $(wildcard $(CUDA_LIB64)/libcudart.so.13),$(SHIM_TESTS)/realcudart)

$(SHIM_TESTS)/%: ../tests/intercept/shim_progs/%.c ../tests/intercept/shim_progs/common.h
	@mkdir -p $(dir $@)
	$(CC) $(SHIM_PROG_CFLAGS) -o $@ $< $(SHIM_PROG_SIM_LIBS)

# Loaded with ctypes by the GIL test (its calls go through the shim).
$(SHIM_TESTS)/blocker.so: ../tests/intercept/shim_progs/blocker.c ../tests/intercept/shim_progs/common.h
	@mkdir -p $(dir $@)
	$(CC) $(SHIM_PROG_CFLAGS) -shared -fPIC -o $@ $< $(SHIM_PROG_SIM_LIBS)

# dp's steps for a Python worker (ctypes) whose phases jitckpt's runtime marks.
$(SHIM_TESTS)/dp.so: ../tests/intercept/shim_progs/dp.c ../tests/intercept/shim_progs/common.h
	@mkdir -p $(dir $@)
	$(CC) $(SHIM_PROG_CFLAGS) -DDP_LIB -shared -fPIC -o $@ $< $(SHIM_PROG_SIM_LIBS)

# dlopen(RTLD_LOCAL)'ed by localload: its libcudart is invisible to RTLD_NEXT.
$(SHIM_TESTS)/liblocal.so: ../tests/intercept/shim_progs/liblocal.c ../tests/intercept/shim_progs/common.h
	@mkdir -p $(dir $@)
	$(CC) $(SHIM_PROG_CFLAGS) -shared -fPIC -o $@ $< $(SHIM_PROG_SIM_LIBS)
$(SHIM_TESTS)/localload: ../tests/intercept/shim_progs/localload.c
	@mkdir -p $(dir $@)
	$(CC) $(SHIM_PROG_CFLAGS) -o $@ $< -ldl

# Linked against libcudart.so.12 of the stand-in: `cudaX@libcudart.so.12` references.
$(SHIM_TESTS)/v12: ../tests/intercept/shim_progs/v12.c ../tests/intercept/shim_progs/common.h
	@mkdir -p $(dir $@)
	$(CC) $(SHIM_PROG_CFLAGS) -o $@ $< -L$(SHIM_SIM) -Wl,-rpath,$(SHIM_SIM) -l:libcudart.so.12 -ldl -lpthread

# Same source linked against libcudart.so.13: `cudaX@libcudart.so.13` references.
$(SHIM_TESTS)/v13: ../tests/intercept/shim_progs/v12.c ../tests/intercept/shim_progs/common.h
	@mkdir -p $(dir $@)
	$(CC) $(SHIM_PROG_CFLAGS) -o $@ $< -L$(SHIM_SIM) -Wl,-rpath,$(SHIM_SIM) -l:libcudart.so.13 -ldl -lpthread

# Symbol-versioning variants of the shim, for test_shim_binding.py only:
# unversioned exports (no version definitions) and a .13-only node.
SHIM_NOV12_SRCS := $(filter-out src/shim_v12.c,$(SHIM_SRCS))
$(SHIM_TESTS)/variants/%/libjitintercept.so: $(SHIM_SRCS) $(SHIM_HDRS)
	@mkdir -p $(dir $@)
	printf '%s' '$(if $(filter unversioned,$*),,libcudart.so.13 ){ global: cuda*; __cuda*; nccl*; jitintercept_*; local: *; };' > $(dir $@)map
	$(CC) $(CFLAGS) $(SHIM_CFLAGS) $(SHIM_CPPFLAGS) -o $@ $(SHIM_NOV12_SRCS) \
	  $(filter-out -Wl$(,)--version-script=src/shim.map,$(SHIM_LDFLAGS)) -Wl,--version-script=$(dir $@)map

$(SHIM_TESTS)/realcudart: ../tests/intercept/shim_progs/realcudart.c
	@mkdir -p $(dir $@)
	$(CC) $(SHIM_PROG_CFLAGS) -o $@ $< -L$(CUDA_LIB64) -Wl,-rpath,$(CUDA_LIB64) -l:libcudart.so.13 -ldl -lpthread

clean: clean-shim
clean-shim:
	rm -rf $(BUILD)/libjitintercept.so $(BUILD)/asan $(SHIM_TESTS)
