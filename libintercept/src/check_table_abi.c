/*
 * Compile-only check: every CUDA entry of the shim's table, re-declared
 * against NVIDIA's own cuda_runtime_api.h (when present). A prototype that
 * drifted from the real one is a "conflicting types" error. The _ptsz/_ptds
 * and __cuda* names are declared by the real headers only for nvcc/C++, so
 * for them this is a plain declaration; abi/check_cuda_abi*.c cover them.
 */
#include <cuda_runtime_api.h>

#define JITABI_USE_REAL_CUDA_TYPES
#include "cuda_abi.h"
#include "nccl_abi.h"
#include "shim_table.h"

#define JI_CHECK_NCCL(name, ret, params)
#define JI_CHECK_CUDART(name, ret, params) ret name params;
#define JI_CHECK_(name, ret, params, args, lib, flags) JI_CHECK_##lib(name, ret, params)
#define JI_CHECK_JI_CUDART JI_CHECK_CUDART
#define JI_CHECK_JI_NCCL JI_CHECK_NCCL
JI_TABLE(JI_CHECK_)
