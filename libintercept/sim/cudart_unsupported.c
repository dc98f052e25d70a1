/*
 * cudart_unsupported.c - entry points of NVIDIA's libcudart.so.13 that the
 * stand-in exports but does not simulate, and that cannot be generated.
 *
 * Why they exist: a program linked against the real runtime must be able to
 * load over the stand-in. PyTorch's CUDA build is loaded with RTLD_NOW, so
 * every cudaX@libcudart.so.13 its libraries reference must resolve, or
 * `import torch` fails in a process where the stand-in is the CUDA runtime.
 * Those returning a cudaError_t are generated (sim/gen_stubs.sh, from
 * sim/torch_imports/torch-*.txt: each supported version's imports, written by
 * scripts/torch_cuda_imports.py); the ones here return something else.
 *
 * Behaviour: device code registration (__cudaRegisterFatBinary and friends,
 * run by the static constructors of every library holding kernels) is
 * accepted and ignored, so the library loads; launching such a kernel fails
 * as for any function jitsimRegisterKernel does not know.
 */
#include <stddef.h>

#include "simcore.h"

#if JITSIM_CUDART_MAJOR >= 13

#define API __attribute__((visibility("default")))

/* ---- device code registration (crt/host_runtime.h): accepted, ignored ---- */

static void *g_fatbin_handle; /* what the handle points to is never read */

API void **__cudaRegisterFatBinary(void *fatCubin) {
  (void)fatCubin;
  return &g_fatbin_handle;
}
API void __cudaRegisterFatBinaryEnd(void **fatCubinHandle) { (void)fatCubinHandle; }
API void __cudaUnregisterFatBinary(void **fatCubinHandle) { (void)fatCubinHandle; }
API char __cudaInitModule(void **fatCubinHandle) { /* managed variables: not simulated */
  (void)fatCubinHandle;
  return 0;
}
API void __cudaRegisterFunction(void **fatCubinHandle, const char *hostFun, char *deviceFun,
                                const char *deviceName, int thread_limit, void *tid, void *bid,
                                void *bDim, void *gDim, int *wSize) {
  (void)fatCubinHandle, (void)hostFun, (void)deviceFun, (void)deviceName, (void)thread_limit;
  (void)tid, (void)bid, (void)bDim, (void)gDim, (void)wSize;
}
API void __cudaRegisterVar(void **fatCubinHandle, char *hostVar, char *deviceAddress,
                           const char *deviceName, int ext, size_t size, int constant, int global) {
  (void)fatCubinHandle, (void)hostVar, (void)deviceAddress, (void)deviceName;
  (void)ext, (void)size, (void)constant, (void)global;
}

/* The `kernel<<<grid, block>>>(...)` path: a non-zero answer makes the
 * compiled launch skip the kernel, so nothing half-launches. */
API unsigned __cudaPushCallConfiguration(dim3 gridDim, dim3 blockDim, size_t sharedMem, void *stream) {
  (void)gridDim, (void)blockDim, (void)sharedMem, (void)stream;
  return 1;
}
API cudaError_t __cudaPopCallConfiguration(dim3 *gridDim, dim3 *blockDim, size_t *sharedMem, void *stream) {
  (void)gridDim, (void)blockDim, (void)sharedMem, (void)stream;
  return cudaErrorNotSupported;
}

#else
/* The .12 runtime simulates only what cudart.c has (no torch build here needs more). */
typedef int jitsim_cudart12_has_no_unsupported_entry_points;
#endif
