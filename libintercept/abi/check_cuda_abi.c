/*
 * Compile-time proof that abi/cuda_abi.h matches the real CUDA runtime
 * headers. Built by `make check-abi` only when cuda_runtime_api.h exists.
 * The real header declares the _ptsz/_ptds entry points only when compiled by
 * nvcc with --default-stream per-thread (g++/gcc reject that mode), so each of
 * our _ptsz/_ptds prototypes is checked against the real plain prototype it
 * mirrors instead.
 */
#include <stddef.h>

#include <cuda_runtime_api.h>

#define JITABI_USE_REAL_CUDA_TYPES
#include "cuda_abi.h"

#define JITABI_CHECK_VALUE(name, value) \
  _Static_assert((long long)(name) == (long long)(value), "value of " #name);
JITABI_CUDA_ERRORS(JITABI_CHECK_VALUE)
JITABI_CUDA_MEMCPY_KINDS(JITABI_CHECK_VALUE)
JITABI_CUDA_FLAGS(JITABI_CHECK_VALUE)

_Static_assert(sizeof(cudaError_t) == 4, "cudaError_t size");
_Static_assert(sizeof(dim3) == 12 && offsetof(dim3, y) == 4 && offsetof(dim3, z) == 8,
               "dim3 layout");
_Static_assert(cudaStreamLegacy == (cudaStream_t)0x1, "cudaStreamLegacy");
_Static_assert(cudaStreamPerThread == (cudaStream_t)0x2, "cudaStreamPerThread");

/* Redeclaring a function with an incompatible type is already a hard error
 * above (cuda_abi.h declares every prototype); taking the address into our
 * pointer typedef also catches calling-convention/qualifier drift. The
 * __cuda* launch entry points are declared by the real headers only for C++
 * (crt/device_functions.h), so they are checked by check_cuda_abi_cxx.cc. */
#define JITABI_CHECK_FN(ret, name, params, args) \
  jitabi_##name##_fn jitabi_check_##name = &name;
JITABI_CUDA_FUNCS_COMMON(JITABI_CHECK_FN)

#define JITABI_CHECK_PT(base, suffix) \
  jitabi_##base##suffix##_fn jitabi_check_##base##suffix = &base;
JITABI_CHECK_PT(cudaStreamSynchronize, _ptsz)
JITABI_CHECK_PT(cudaStreamQuery, _ptsz)
JITABI_CHECK_PT(cudaStreamWaitEvent, _ptsz)
JITABI_CHECK_PT(cudaStreamGetFlags, _ptsz)
JITABI_CHECK_PT(cudaStreamGetPriority, _ptsz)
JITABI_CHECK_PT(cudaStreamAddCallback, _ptsz)
JITABI_CHECK_PT(cudaLaunchHostFunc, _ptsz)
JITABI_CHECK_PT(cudaEventRecord, _ptsz)
JITABI_CHECK_PT(cudaEventRecordWithFlags, _ptsz)
JITABI_CHECK_PT(cudaMemset, _ptds)
JITABI_CHECK_PT(cudaMemsetAsync, _ptsz)
JITABI_CHECK_PT(cudaMemcpy, _ptds)
JITABI_CHECK_PT(cudaMemcpyAsync, _ptsz)
JITABI_CHECK_PT(cudaLaunchKernel, _ptsz)
/* Every entry of the _ptsz list must be covered above. */
#define JITABI_COUNT_(ret, name, params, args) +1
_Static_assert(0 JITABI_CUDA_FUNCS_PTSZ(JITABI_COUNT_) == 14, "update the _ptsz checks");

int main(void) { return 0; }
