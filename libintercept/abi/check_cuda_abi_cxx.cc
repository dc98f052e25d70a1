// The real headers declare __cudaGetKernel / __cudaLaunchKernel(_ptsz) only
// for C++ (crt/device_functions.h, pulled in by cuda_runtime.h), so their
// prototypes in abi/cuda_abi.h are checked from a C++ translation unit.
#include <cuda_runtime.h>

#define JITABI_USE_REAL_CUDA_TYPES
#include "cuda_abi.h"

#define JITABI_CHECK_FN(ret, name, params, args) \
  static jitabi_##name##_fn jitabi_check_##name = &name;
JITABI_CUDA_FUNCS_13(JITABI_CHECK_FN)

int main() {
  return (jitabi_check___cudaGetKernel && jitabi_check___cudaLaunchKernel &&
          jitabi_check___cudaLaunchKernel_ptsz) ? 0 : 1;
}
