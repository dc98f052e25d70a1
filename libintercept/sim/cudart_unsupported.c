/*
 * cudart_unsupported.c - entry points of NVIDIA's libcudart.so.13 that the
 * stand-in exports but does not simulate.
 *
 * Why they exist: a program linked against the real runtime must be able to
 * load over the stand-in. PyTorch's CUDA build (torch 2.13.0+cu130, the build
 * pip gets from PyPI) is loaded with RTLD_NOW, so every cudaX@libcudart.so.13
 * its libraries reference must resolve, or `import torch` fails in a process
 * where the stand-in is the CUDA runtime. The list below is what those
 * libraries reference beyond what cudart.c simulates (`nm -D --undefined-only
 * torch/lib/lib*.so` of the build); test_sim_abi.py checks it against an installed CUDA build.
 *
 * Behaviour: device code registration (__cudaRegisterFatBinary and friends,
 * run by the static constructors of every library holding kernels) is
 * accepted and ignored, so the library loads; launching such a kernel fails
 * as for any function jitsimRegisterKernel does not know. Every other entry
 * point returns cudaErrorNotSupported without touching its arguments and
 * without recording the error as the last error: the shim probes some of them
 * (cudaPointerGetAttributes) internally, and a probe must not leave an error
 * behind for the application's next cudaGetLastError.
 */
#include <stddef.h>

#include "simcore.h"

#if JITSIM_CUDART_MAJOR >= 13

#define API __attribute__((visibility("default")))

/* The arguments are never read, so no prototype beyond the return type is
 * needed: on the supported ABIs (x86-64 System V, AArch64) the caller owns
 * its argument registers and stack. */
#define JITSIM_UNSUPPORTED_CUDA(X)                             \
  X(cudaDeviceCanAccessPeer)                                   \
  X(cudaDeviceEnablePeerAccess)                                \
  X(cudaDeviceGetAttribute)                                    \
  X(cudaDeviceGetDefaultMemPool)                               \
  X(cudaDeviceGetPCIBusId)                                     \
  X(cudaFreeAsync)                                             \
  X(cudaFuncGetAttributes)                                     \
  X(cudaFuncSetAttribute)                                      \
  X(cudaGetDeviceProperties)                                   \
  X(cudaGetDriverEntryPointByVersion)                          \
  X(cudaGetSymbolAddress)                                      \
  X(cudaGraphAddNode)                                          \
  X(cudaGraphConditionalHandleCreate)                          \
  X(cudaGraphDebugDotPrint)                                    \
  X(cudaGraphDestroy)                                          \
  X(cudaGraphExecDestroy)                                      \
  X(cudaGraphGetNodes)                                         \
  X(cudaGraphInstantiateWithFlags)                             \
  X(cudaGraphLaunch)                                           \
  X(cudaGraphNodeGetDependencies)                              \
  X(cudaHostAlloc)                                             \
  X(cudaHostRegister)                                          \
  X(cudaHostUnregister)                                        \
  X(cudaIpcCloseMemHandle)                                     \
  X(cudaIpcGetEventHandle)                                     \
  X(cudaIpcGetMemHandle)                                       \
  X(cudaIpcOpenEventHandle)                                    \
  X(cudaIpcOpenMemHandle)                                      \
  X(cudaKernelSetAttributeForDevice)                           \
  X(cudaLaunchCooperativeKernel)                               \
  X(cudaLaunchKernelExC)                                       \
  X(cudaLibraryGetKernel)                                      \
  X(cudaLibraryLoadData)                                       \
  X(cudaLibraryUnload)                                         \
  X(cudaMallocAsync)                                           \
  X(cudaMemGetInfo)                                            \
  X(cudaMemPoolGetAttribute)                                   \
  X(cudaMemPoolSetAccess)                                      \
  X(cudaMemPoolSetAttribute)                                   \
  X(cudaMemPoolTrimTo)                                         \
  X(cudaMemcpy2DAsync)                                         \
  X(cudaMemcpyPeerAsync)                                       \
  X(cudaMemcpyToSymbol)                                        \
  X(cudaOccupancyMaxActiveBlocksPerMultiprocessor)             \
  X(cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags)    \
  X(cudaPointerGetAttributes)                                  \
  X(cudaProfilerStart)                                         \
  X(cudaProfilerStop)                                          \
  X(cudaStreamBeginCapture)                                    \
  X(cudaStreamBeginCaptureToGraph)                             \
  X(cudaStreamEndCapture)                                      \
  X(cudaStreamGetCaptureInfo)                                  \
  X(cudaStreamIsCapturing)                                     \
  X(cudaStreamUpdateCaptureDependencies)                       \
  X(cudaThreadExchangeStreamCaptureMode)

#define JITSIM_DEFINE_UNSUPPORTED(name) \
  API cudaError_t name(void) { return cudaErrorNotSupported; }
JITSIM_UNSUPPORTED_CUDA(JITSIM_DEFINE_UNSUPPORTED)
#undef JITSIM_DEFINE_UNSUPPORTED

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
