/*
 * cuda_abi.h - jitckpt's own declaration of the subset of the CUDA runtime ABI
 * that libintercept interposes and the CPU stand-in (sim/) implements.
 *
 * Why our own header: the shim and the stand-in must build on machines without
 * the CUDA toolkit, and must not depend on which toolkit version is installed.
 * The values and prototypes below are copied from CUDA 13.0's driver_types.h /
 * cuda_runtime_api.h; `make check-abi` proves they agree with the real headers
 * whenever those are present (abi/check_cuda_abi.c).
 *
 * Stability: the shim includes this file. Only append; never renumber or
 * change a prototype without re-running `make check-abi`.
 *
 * JITABI_USE_REAL_CUDA_TYPES: defined only by the ABI check, after including
 * the real cuda_runtime_api.h, so that our prototypes are compiled against the
 * real types (any mismatch is then a "conflicting types" error).
 */
#ifndef JITCKPT_CUDA_ABI_H
#define JITCKPT_CUDA_ABI_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Every cudaError_t value of CUDA 13.0, as an X-macro so the ABI check can
 * assert each one against the real enum. */
#define JITABI_CUDA_ERRORS(X) \
  X(cudaSuccess, 0) \
  X(cudaErrorInvalidValue, 1) \
  X(cudaErrorMemoryAllocation, 2) \
  X(cudaErrorInitializationError, 3) \
  X(cudaErrorCudartUnloading, 4) \
  X(cudaErrorProfilerDisabled, 5) \
  X(cudaErrorProfilerNotInitialized, 6) \
  X(cudaErrorProfilerAlreadyStarted, 7) \
  X(cudaErrorProfilerAlreadyStopped, 8) \
  X(cudaErrorInvalidConfiguration, 9) \
  X(cudaErrorInvalidPitchValue, 12) \
  X(cudaErrorInvalidSymbol, 13) \
  X(cudaErrorInvalidHostPointer, 16) \
  X(cudaErrorInvalidDevicePointer, 17) \
  X(cudaErrorInvalidTexture, 18) \
  X(cudaErrorInvalidTextureBinding, 19) \
  X(cudaErrorInvalidChannelDescriptor, 20) \
  X(cudaErrorInvalidMemcpyDirection, 21) \
  X(cudaErrorAddressOfConstant, 22) \
  X(cudaErrorTextureFetchFailed, 23) \
  X(cudaErrorTextureNotBound, 24) \
  X(cudaErrorSynchronizationError, 25) \
  X(cudaErrorInvalidFilterSetting, 26) \
  X(cudaErrorInvalidNormSetting, 27) \
  X(cudaErrorMixedDeviceExecution, 28) \
  X(cudaErrorNotYetImplemented, 31) \
  X(cudaErrorMemoryValueTooLarge, 32) \
  X(cudaErrorStubLibrary, 34) \
  X(cudaErrorInsufficientDriver, 35) \
  X(cudaErrorCallRequiresNewerDriver, 36) \
  X(cudaErrorInvalidSurface, 37) \
  X(cudaErrorDuplicateVariableName, 43) \
  X(cudaErrorDuplicateTextureName, 44) \
  X(cudaErrorDuplicateSurfaceName, 45) \
  X(cudaErrorDevicesUnavailable, 46) \
  X(cudaErrorIncompatibleDriverContext, 49) \
  X(cudaErrorMissingConfiguration, 52) \
  X(cudaErrorPriorLaunchFailure, 53) \
  X(cudaErrorLaunchMaxDepthExceeded, 65) \
  X(cudaErrorLaunchFileScopedTex, 66) \
  X(cudaErrorLaunchFileScopedSurf, 67) \
  X(cudaErrorSyncDepthExceeded, 68) \
  X(cudaErrorLaunchPendingCountExceeded, 69) \
  X(cudaErrorInvalidDeviceFunction, 98) \
  X(cudaErrorNoDevice, 100) \
  X(cudaErrorInvalidDevice, 101) \
  X(cudaErrorDeviceNotLicensed, 102) \
  X(cudaErrorSoftwareValidityNotEstablished, 103) \
  X(cudaErrorStartupFailure, 127) \
  X(cudaErrorInvalidKernelImage, 200) \
  X(cudaErrorDeviceUninitialized, 201) \
  X(cudaErrorMapBufferObjectFailed, 205) \
  X(cudaErrorUnmapBufferObjectFailed, 206) \
  X(cudaErrorArrayIsMapped, 207) \
  X(cudaErrorAlreadyMapped, 208) \
  X(cudaErrorNoKernelImageForDevice, 209) \
  X(cudaErrorAlreadyAcquired, 210) \
  X(cudaErrorNotMapped, 211) \
  X(cudaErrorNotMappedAsArray, 212) \
  X(cudaErrorNotMappedAsPointer, 213) \
  X(cudaErrorECCUncorrectable, 214) \
  X(cudaErrorUnsupportedLimit, 215) \
  X(cudaErrorDeviceAlreadyInUse, 216) \
  X(cudaErrorPeerAccessUnsupported, 217) \
  X(cudaErrorInvalidPtx, 218) \
  X(cudaErrorInvalidGraphicsContext, 219) \
  X(cudaErrorNvlinkUncorrectable, 220) \
  X(cudaErrorJitCompilerNotFound, 221) \
  X(cudaErrorUnsupportedPtxVersion, 222) \
  X(cudaErrorJitCompilationDisabled, 223) \
  X(cudaErrorUnsupportedExecAffinity, 224) \
  X(cudaErrorUnsupportedDevSideSync, 225) \
  X(cudaErrorContained, 226) \
  X(cudaErrorInvalidSource, 300) \
  X(cudaErrorFileNotFound, 301) \
  X(cudaErrorSharedObjectSymbolNotFound, 302) \
  X(cudaErrorSharedObjectInitFailed, 303) \
  X(cudaErrorOperatingSystem, 304) \
  X(cudaErrorInvalidResourceHandle, 400) \
  X(cudaErrorIllegalState, 401) \
  X(cudaErrorLossyQuery, 402) \
  X(cudaErrorSymbolNotFound, 500) \
  X(cudaErrorNotReady, 600) \
  X(cudaErrorIllegalAddress, 700) \
  X(cudaErrorLaunchOutOfResources, 701) \
  X(cudaErrorLaunchTimeout, 702) \
  X(cudaErrorLaunchIncompatibleTexturing, 703) \
  X(cudaErrorPeerAccessAlreadyEnabled, 704) \
  X(cudaErrorPeerAccessNotEnabled, 705) \
  X(cudaErrorSetOnActiveProcess, 708) \
  X(cudaErrorContextIsDestroyed, 709) \
  X(cudaErrorAssert, 710) \
  X(cudaErrorTooManyPeers, 711) \
  X(cudaErrorHostMemoryAlreadyRegistered, 712) \
  X(cudaErrorHostMemoryNotRegistered, 713) \
  X(cudaErrorHardwareStackError, 714) \
  X(cudaErrorIllegalInstruction, 715) \
  X(cudaErrorMisalignedAddress, 716) \
  X(cudaErrorInvalidAddressSpace, 717) \
  X(cudaErrorInvalidPc, 718) \
  X(cudaErrorLaunchFailure, 719) \
  X(cudaErrorCooperativeLaunchTooLarge, 720) \
  X(cudaErrorTensorMemoryLeak, 721) \
  X(cudaErrorNotPermitted, 800) \
  X(cudaErrorNotSupported, 801) \
  X(cudaErrorSystemNotReady, 802) \
  X(cudaErrorSystemDriverMismatch, 803) \
  X(cudaErrorCompatNotSupportedOnDevice, 804) \
  X(cudaErrorMpsConnectionFailed, 805) \
  X(cudaErrorMpsRpcFailure, 806) \
  X(cudaErrorMpsServerNotReady, 807) \
  X(cudaErrorMpsMaxClientsReached, 808) \
  X(cudaErrorMpsMaxConnectionsReached, 809) \
  X(cudaErrorMpsClientTerminated, 810) \
  X(cudaErrorCdpNotSupported, 811) \
  X(cudaErrorCdpVersionMismatch, 812) \
  X(cudaErrorStreamCaptureUnsupported, 900) \
  X(cudaErrorStreamCaptureInvalidated, 901) \
  X(cudaErrorStreamCaptureMerge, 902) \
  X(cudaErrorStreamCaptureUnmatched, 903) \
  X(cudaErrorStreamCaptureUnjoined, 904) \
  X(cudaErrorStreamCaptureIsolation, 905) \
  X(cudaErrorStreamCaptureImplicit, 906) \
  X(cudaErrorCapturedEvent, 907) \
  X(cudaErrorStreamCaptureWrongThread, 908) \
  X(cudaErrorTimeout, 909) \
  X(cudaErrorGraphExecUpdateFailure, 910) \
  X(cudaErrorExternalDevice, 911) \
  X(cudaErrorInvalidClusterSize, 912) \
  X(cudaErrorFunctionNotLoaded, 913) \
  X(cudaErrorInvalidResourceType, 914) \
  X(cudaErrorInvalidResourceConfiguration, 915) \
  X(cudaErrorUnknown, 999) \
  X(cudaErrorApiFailureBase, 10000)

#define JITABI_CUDA_MEMCPY_KINDS(X) \
  X(cudaMemcpyHostToHost, 0) \
  X(cudaMemcpyHostToDevice, 1) \
  X(cudaMemcpyDeviceToHost, 2) \
  X(cudaMemcpyDeviceToDevice, 3) \
  X(cudaMemcpyDefault, 4)

/* Flag macros (real CUDA uses #defines; we spell them the same). */
#define JITABI_CUDA_FLAGS(X) \
  X(cudaStreamDefault, 0x00) \
  X(cudaStreamNonBlocking, 0x01) \
  X(cudaEventDefault, 0x00) \
  X(cudaEventBlockingSync, 0x01) \
  X(cudaEventDisableTiming, 0x02) \
  X(cudaEventInterprocess, 0x04) \
  X(cudaEventRecordDefault, 0x00) \
  X(cudaEventRecordExternal, 0x01) \
  X(cudaEventWaitDefault, 0x00) \
  X(cudaEventWaitExternal, 0x01)

#ifndef JITABI_USE_REAL_CUDA_TYPES

#define JITABI_ENUM_ITEM_(name, value) name = value,
enum cudaError { JITABI_CUDA_ERRORS(JITABI_ENUM_ITEM_) };
typedef enum cudaError cudaError_t;

enum cudaMemcpyKind { JITABI_CUDA_MEMCPY_KINDS(JITABI_ENUM_ITEM_) };
#undef JITABI_ENUM_ITEM_

struct dim3 { unsigned int x, y, z; };
typedef struct dim3 dim3;

/* Opaque handles: same struct tags as the real headers so that C++ mangling
 * and C type compatibility match. */
typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
typedef struct CUkern_st *cudaKernel_t;

typedef void (*cudaHostFn_t)(void *userData);
typedef void (*cudaStreamCallback_t)(cudaStream_t stream, cudaError_t status,
                                     void *userData);

#define cudaStreamDefault       0x00
#define cudaStreamNonBlocking   0x01
#define cudaStreamLegacy        ((cudaStream_t)0x1)
#define cudaStreamPerThread     ((cudaStream_t)0x2)
#define cudaEventDefault        0x00
#define cudaEventBlockingSync   0x01
#define cudaEventDisableTiming  0x02
#define cudaEventInterprocess   0x04
#define cudaEventRecordDefault  0x00
#define cudaEventRecordExternal 0x01
#define cudaEventWaitDefault    0x00
#define cudaEventWaitExternal   0x01

#define CUDART_VERSION_12 12080
#define CUDART_VERSION_13 13000

#endif /* JITABI_USE_REAL_CUDA_TYPES */

/*
 * The function list, as an X-macro: F(return type, name, (params), (arg names)).
 * The shim uses it to generate hooks and real-function pointer typedefs; the
 * stand-in uses it to check it implements everything. `_ptsz`/`_ptds` names are
 * the per-thread-default-stream entry points that code compiled with
 * --default-stream per-thread calls (both libcudart.so.12 and .13 export them).
 */
#define JITABI_CUDA_FUNCS_COMMON(F) \
  F(cudaError_t, cudaGetDeviceCount, (int *count), (count)) \
  F(cudaError_t, cudaSetDevice, (int device), (device)) \
  F(cudaError_t, cudaGetDevice, (int *device), (device)) \
  F(cudaError_t, cudaDeviceSynchronize, (void), ()) \
  F(cudaError_t, cudaDeviceReset, (void), ()) \
  F(cudaError_t, cudaDeviceGetStreamPriorityRange, (int *leastPriority, int *greatestPriority), (leastPriority, greatestPriority)) \
  F(cudaError_t, cudaGetLastError, (void), ()) \
  F(cudaError_t, cudaPeekAtLastError, (void), ()) \
  F(const char *, cudaGetErrorString, (cudaError_t error), (error)) \
  F(const char *, cudaGetErrorName, (cudaError_t error), (error)) \
  F(cudaError_t, cudaDriverGetVersion, (int *driverVersion), (driverVersion)) \
  F(cudaError_t, cudaRuntimeGetVersion, (int *runtimeVersion), (runtimeVersion)) \
  F(cudaError_t, cudaStreamCreate, (cudaStream_t *pStream), (pStream)) \
  F(cudaError_t, cudaStreamCreateWithFlags, (cudaStream_t *pStream, unsigned int flags), (pStream, flags)) \
  F(cudaError_t, cudaStreamCreateWithPriority, (cudaStream_t *pStream, unsigned int flags, int priority), (pStream, flags, priority)) \
  F(cudaError_t, cudaStreamDestroy, (cudaStream_t stream), (stream)) \
  F(cudaError_t, cudaStreamSynchronize, (cudaStream_t stream), (stream)) \
  F(cudaError_t, cudaStreamQuery, (cudaStream_t stream), (stream)) \
  F(cudaError_t, cudaStreamWaitEvent, (cudaStream_t stream, cudaEvent_t event, unsigned int flags), (stream, event, flags)) \
  F(cudaError_t, cudaStreamGetFlags, (cudaStream_t hStream, unsigned int *flags), (hStream, flags)) \
  F(cudaError_t, cudaStreamGetPriority, (cudaStream_t hStream, int *priority), (hStream, priority)) \
  F(cudaError_t, cudaStreamAddCallback, (cudaStream_t stream, cudaStreamCallback_t callback, void *userData, unsigned int flags), (stream, callback, userData, flags)) \
  F(cudaError_t, cudaLaunchHostFunc, (cudaStream_t stream, cudaHostFn_t fn, void *userData), (stream, fn, userData)) \
  F(cudaError_t, cudaEventCreate, (cudaEvent_t *event), (event)) \
  F(cudaError_t, cudaEventCreateWithFlags, (cudaEvent_t *event, unsigned int flags), (event, flags)) \
  F(cudaError_t, cudaEventDestroy, (cudaEvent_t event), (event)) \
  F(cudaError_t, cudaEventRecord, (cudaEvent_t event, cudaStream_t stream), (event, stream)) \
  F(cudaError_t, cudaEventRecordWithFlags, (cudaEvent_t event, cudaStream_t stream, unsigned int flags), (event, stream, flags)) \
  F(cudaError_t, cudaEventQuery, (cudaEvent_t event), (event)) \
  F(cudaError_t, cudaEventSynchronize, (cudaEvent_t event), (event)) \
  F(cudaError_t, cudaEventElapsedTime, (float *ms, cudaEvent_t start, cudaEvent_t end), (ms, start, end)) \
  F(cudaError_t, cudaMalloc, (void **devPtr, size_t size), (devPtr, size)) \
  F(cudaError_t, cudaFree, (void *devPtr), (devPtr)) \
  F(cudaError_t, cudaMallocHost, (void **ptr, size_t size), (ptr, size)) \
  F(cudaError_t, cudaFreeHost, (void *ptr), (ptr)) \
  F(cudaError_t, cudaMemset, (void *devPtr, int value, size_t count), (devPtr, value, count)) \
  F(cudaError_t, cudaMemsetAsync, (void *devPtr, int value, size_t count, cudaStream_t stream), (devPtr, value, count, stream)) \
  F(cudaError_t, cudaMemcpy, (void *dst, const void *src, size_t count, enum cudaMemcpyKind kind), (dst, src, count, kind)) \
  F(cudaError_t, cudaMemcpyAsync, (void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream), (dst, src, count, kind, stream)) \
  F(cudaError_t, cudaLaunchKernel, (const void *func, dim3 gridDim, dim3 blockDim, void **args, size_t sharedMem, cudaStream_t stream), (func, gridDim, blockDim, args, sharedMem, stream)) \
  F(cudaError_t, cudaGetKernel, (cudaKernel_t *kernelPtr, const void *entryFuncAddr), (kernelPtr, entryFuncAddr))

/* Per-thread-default-stream variants (same signatures as the plain ones). */
#define JITABI_CUDA_FUNCS_PTSZ(F) \
  F(cudaError_t, cudaStreamSynchronize_ptsz, (cudaStream_t stream), (stream)) \
  F(cudaError_t, cudaStreamQuery_ptsz, (cudaStream_t stream), (stream)) \
  F(cudaError_t, cudaStreamWaitEvent_ptsz, (cudaStream_t stream, cudaEvent_t event, unsigned int flags), (stream, event, flags)) \
  F(cudaError_t, cudaStreamGetFlags_ptsz, (cudaStream_t hStream, unsigned int *flags), (hStream, flags)) \
  F(cudaError_t, cudaStreamGetPriority_ptsz, (cudaStream_t hStream, int *priority), (hStream, priority)) \
  F(cudaError_t, cudaStreamAddCallback_ptsz, (cudaStream_t stream, cudaStreamCallback_t callback, void *userData, unsigned int flags), (stream, callback, userData, flags)) \
  F(cudaError_t, cudaLaunchHostFunc_ptsz, (cudaStream_t stream, cudaHostFn_t fn, void *userData), (stream, fn, userData)) \
  F(cudaError_t, cudaEventRecord_ptsz, (cudaEvent_t event, cudaStream_t stream), (event, stream)) \
  F(cudaError_t, cudaEventRecordWithFlags_ptsz, (cudaEvent_t event, cudaStream_t stream, unsigned int flags), (event, stream, flags)) \
  F(cudaError_t, cudaMemset_ptds, (void *devPtr, int value, size_t count), (devPtr, value, count)) \
  F(cudaError_t, cudaMemsetAsync_ptsz, (void *devPtr, int value, size_t count, cudaStream_t stream), (devPtr, value, count, stream)) \
  F(cudaError_t, cudaMemcpy_ptds, (void *dst, const void *src, size_t count, enum cudaMemcpyKind kind), (dst, src, count, kind)) \
  F(cudaError_t, cudaMemcpyAsync_ptsz, (void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream), (dst, src, count, kind, stream)) \
  F(cudaError_t, cudaLaunchKernel_ptsz, (const void *func, dim3 gridDim, dim3 blockDim, void **args, size_t sharedMem, cudaStream_t stream), (func, gridDim, blockDim, args, sharedMem, stream))

/* Launch path of code compiled by CUDA 13's nvcc (host_runtime.h): exported
 * by libcudart.so.13 only, not by libcudart.so.12. */
#define JITABI_CUDA_FUNCS_13(F) \
  F(cudaError_t, __cudaGetKernel, (cudaKernel_t *kernel, const void *func), (kernel, func)) \
  F(cudaError_t, __cudaLaunchKernel, (cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void **args, size_t sharedMem, cudaStream_t stream), (kernel, gridDim, blockDim, args, sharedMem, stream)) \
  F(cudaError_t, __cudaLaunchKernel_ptsz, (cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void **args, size_t sharedMem, cudaStream_t stream), (kernel, gridDim, blockDim, args, sharedMem, stream))

#define JITABI_CUDA_FUNCS(F) \
  JITABI_CUDA_FUNCS_COMMON(F) JITABI_CUDA_FUNCS_PTSZ(F) JITABI_CUDA_FUNCS_13(F)

/* Prototypes plus a pointer typedef per function: jitabi_<name>_fn. */
#define JITABI_DECLARE_(ret, name, params, args) \
  ret name params; \
  typedef ret (*jitabi_##name##_fn) params;
JITABI_CUDA_FUNCS_COMMON(JITABI_DECLARE_)
JITABI_CUDA_FUNCS_PTSZ(JITABI_DECLARE_)
JITABI_CUDA_FUNCS_13(JITABI_DECLARE_)
#undef JITABI_DECLARE_

/*
 * Stand-in-only extensions, exported by the sim libcudart (see
 * sim/README.md, "Kernel convention"). Not part of the real CUDA ABI: the shim
 * must look them up with dlsym and tolerate their absence on a real GPU.
 */
typedef void (*jitsimKernelFn)(void **args);
int jitsimRegisterKernel(const void *func, int nparams, const size_t *param_sizes);
typedef int (*jitabi_jitsimRegisterKernel_fn)(const void *func, int nparams, const size_t *param_sizes);
cudaError_t jitsimFuncGetParamInfo(const void *func, size_t index, size_t *offset, size_t *size);
typedef cudaError_t (*jitabi_jitsimFuncGetParamInfo_fn)(const void *func, size_t index, size_t *offset, size_t *size);
/* Device loss and replacement (sim/README.md, "New device"). On a GPU the
 * same steps are the driver's: a context on a new device, and cuMemAddressReserve
 * at the old addresses + cuMemCreate/cuMemMap for the allocations. */
cudaError_t jitsimDeviceDetach(void);
typedef cudaError_t (*jitabi_jitsimDeviceDetach_fn)(void);
cudaError_t jitsimDeviceReplace(const char *uuid);
typedef cudaError_t (*jitabi_jitsimDeviceReplace_fn)(const char *uuid);
cudaError_t jitsimMallocAt(void *devPtr, size_t size);
typedef cudaError_t (*jitabi_jitsimMallocAt_fn)(void *devPtr, size_t size);
const char *jitsimDeviceUuid(void);
typedef const char *(*jitabi_jitsimDeviceUuid_fn)(void);

#ifdef __cplusplus
}
#endif

#endif /* JITCKPT_CUDA_ABI_H */
