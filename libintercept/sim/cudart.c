/*
 * cudart.c - the CPU stand-in for libcudart.so.12 / libcudart.so.13.
 *
 * Compiled twice (JITSIM_CUDART_MAJOR=12 or 13); the linker version script
 * gives every symbol the version node of the matching real library, so
 * binaries linked against it carry `cudaX@libcudart.so.1x` references exactly
 * as with NVIDIA's runtime. The state (streams, events, memory) lives in
 * libjitsimcore.so, shared with the stand-in NCCL; only what the real runtime
 * keeps per runtime instance (last error, current device) lives here.
 */
#define _GNU_SOURCE
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simcore.h"

#ifndef JITSIM_CUDART_MAJOR
#error "define JITSIM_CUDART_MAJOR (12 or 13)"
#endif

#define API __attribute__((visibility("default")))

static __thread cudaError_t t_last_error;
static __thread int t_device;

static cudaError_t note(cudaError_t e) {
  if (e != cudaSuccess) t_last_error = e;
  return e;
}

static cudaError_t sticky(void) { return (cudaError_t)jitsim_sticky(); }

#define STICKY_GUARD()                   \
  do {                                   \
    cudaError_t st_ = sticky();          \
    if (st_) return note(st_);           \
  } while (0)

static int device_count(void) {
  long n = jitsim_env_long("JITSIM_DEVICES", 1);
  return n < 0 ? 0 : n > 64 ? 64 : (int)n;
}

API cudaError_t cudaGetDeviceCount(int *count) {
  if (!count) return note(cudaErrorInvalidValue);
  STICKY_GUARD();
  *count = device_count();
  if (*count == 0) return note(cudaErrorNoDevice);
  return cudaSuccess;
}

API cudaError_t cudaSetDevice(int device) {
  STICKY_GUARD();
  int n = device_count();
  if (n == 0) return note(cudaErrorNoDevice);
  if (device < 0 || device >= n) return note(cudaErrorInvalidDevice);
  /* Simplification: all devices share one set of streams and memory; the
   * current device is only remembered and reported. */
  t_device = device;
  return cudaSuccess;
}

API cudaError_t cudaGetDevice(int *device) {
  if (!device) return note(cudaErrorInvalidValue);
  STICKY_GUARD();
  if (device_count() == 0) return note(cudaErrorNoDevice);
  *device = t_device;
  return cudaSuccess;
}

API cudaError_t cudaDeviceSynchronize(void) { return note(jitsim_device_sync()); }

API cudaError_t cudaDeviceReset(void) {
  /* A real reset cannot revive a context with a sticky error either. */
  return note(jitsim_device_sync());
}

API cudaError_t cudaDeviceGetStreamPriorityRange(int *leastPriority, int *greatestPriority) {
  STICKY_GUARD();
  if (leastPriority) *leastPriority = 0;
  if (greatestPriority) *greatestPriority = -5;
  return cudaSuccess;
}

API cudaError_t cudaGetLastError(void) {
  cudaError_t st = sticky();
  if (st) return st; /* sticky: reported forever, never reset */
  cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

API cudaError_t cudaPeekAtLastError(void) {
  cudaError_t st = sticky();
  return st ? st : t_last_error;
}

API const char *cudaGetErrorName(cudaError_t error) {
  switch ((int)error) {
#define JITSIM_NAME_CASE(name, value) \
  case value:                         \
    return #name;
    JITABI_CUDA_ERRORS(JITSIM_NAME_CASE)
#undef JITSIM_NAME_CASE
  }
  return "unrecognized error code";
}

API const char *cudaGetErrorString(cudaError_t error) {
  /* The texts of the real runtime for the errors the stand-in produces. */
  switch ((int)error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    case cudaErrorUnknown: return "unknown error";
  }
  /* Other codes: the name is more useful than a text we would invent. */
  return cudaGetErrorName(error);
}

API cudaError_t cudaDriverGetVersion(int *driverVersion) {
  if (!driverVersion) return note(cudaErrorInvalidValue);
  *driverVersion = 13000;
  return cudaSuccess;
}

API cudaError_t cudaRuntimeGetVersion(int *runtimeVersion) {
  if (!runtimeVersion) return note(cudaErrorInvalidValue);
  *runtimeVersion = JITSIM_CUDART_MAJOR == 12 ? CUDART_VERSION_12 : CUDART_VERSION_13;
  return cudaSuccess;
}

/* ---- streams ---- */

API cudaError_t cudaStreamCreateWithPriority(cudaStream_t *pStream, unsigned int flags, int priority) {
  if (!pStream) return note(cudaErrorInvalidValue);
  jitsim_stream *s;
  cudaError_t e = (cudaError_t)jitsim_stream_create(&s, flags, priority);
  if (e) return note(e);
  *pStream = (cudaStream_t)s;
  return cudaSuccess;
}

API cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags) {
  return cudaStreamCreateWithPriority(pStream, flags, 0);
}

API cudaError_t cudaStreamCreate(cudaStream_t *pStream) {
  return cudaStreamCreateWithPriority(pStream, cudaStreamDefault, 0);
}

API cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  STICKY_GUARD();
  if (stream == NULL || stream == cudaStreamLegacy || stream == cudaStreamPerThread)
    return note(cudaErrorInvalidResourceHandle);
  return note(jitsim_stream_destroy((jitsim_stream *)stream));
}

static cudaError_t stream_sync(cudaStream_t stream, int pt) {
  return note(jitsim_stream_sync(jitsim_stream_get(stream, pt)));
}
API cudaError_t cudaStreamSynchronize(cudaStream_t stream) { return stream_sync(stream, 0); }
API cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream) { return stream_sync(stream, 1); }

static cudaError_t stream_query(cudaStream_t stream, int pt) {
  cudaError_t e = jitsim_stream_query(jitsim_stream_get(stream, pt));
  /* cudaErrorNotReady is an answer, not an error: it does not stick. */
  return e == cudaErrorNotReady ? e : note(e);
}
API cudaError_t cudaStreamQuery(cudaStream_t stream) { return stream_query(stream, 0); }
API cudaError_t cudaStreamQuery_ptsz(cudaStream_t stream) { return stream_query(stream, 1); }

static cudaError_t stream_wait_event(cudaStream_t stream, cudaEvent_t event, unsigned int flags, int pt) {
  STICKY_GUARD();
  if (flags & ~(unsigned)cudaEventWaitExternal) return note(cudaErrorInvalidValue);
  return note(jitsim_stream_wait_event(jitsim_stream_get(stream, pt), (jitsim_event *)event));
}
API cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  return stream_wait_event(stream, event, flags, 0);
}
API cudaError_t cudaStreamWaitEvent_ptsz(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  return stream_wait_event(stream, event, flags, 1);
}

static cudaError_t stream_get_flags(cudaStream_t s, unsigned int *flags, int *prio, int pt) {
  STICKY_GUARD();
  if ((flags == NULL && prio == NULL)) return note(cudaErrorInvalidValue);
  return note(jitsim_stream_flags(jitsim_stream_get(s, pt), flags, prio));
}
API cudaError_t cudaStreamGetFlags(cudaStream_t hStream, unsigned int *flags) {
  return stream_get_flags(hStream, flags, NULL, 0);
}
API cudaError_t cudaStreamGetFlags_ptsz(cudaStream_t hStream, unsigned int *flags) {
  return stream_get_flags(hStream, flags, NULL, 1);
}
API cudaError_t cudaStreamGetPriority(cudaStream_t hStream, int *priority) {
  return stream_get_flags(hStream, NULL, priority, 0);
}
API cudaError_t cudaStreamGetPriority_ptsz(cudaStream_t hStream, int *priority) {
  return stream_get_flags(hStream, NULL, priority, 1);
}

struct hostfn {
  cudaHostFn_t fn;
  cudaStreamCallback_t cb;
  cudaStream_t stream;
  void *user;
};

static void hostfn_run(void *p) {
  struct hostfn *h = p;
  if (h->fn)
    h->fn(h->user);
  else
    h->cb(h->stream, cudaSuccess, h->user);
}

static cudaError_t enqueue_hostfn(cudaStream_t stream, cudaHostFn_t fn, cudaStreamCallback_t cb,
                                  void *user, int pt) {
  STICKY_GUARD();
  if (!fn && !cb) return note(cudaErrorInvalidValue);
  struct hostfn *h = malloc(sizeof *h);
  if (!h) return note(cudaErrorMemoryAllocation);
  *h = (struct hostfn){fn, cb, stream, user};
  return note(jitsim_enqueue(jitsim_stream_get(stream, pt), hostfn_run, h, free));
}
API cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData) {
  return enqueue_hostfn(stream, fn, NULL, userData, 0);
}
API cudaError_t cudaLaunchHostFunc_ptsz(cudaStream_t stream, cudaHostFn_t fn, void *userData) {
  return enqueue_hostfn(stream, fn, NULL, userData, 1);
}
API cudaError_t cudaStreamAddCallback(cudaStream_t stream, cudaStreamCallback_t callback,
                                      void *userData, unsigned int flags) {
  if (flags) return note(cudaErrorInvalidValue);
  return enqueue_hostfn(stream, NULL, callback, userData, 0);
}
API cudaError_t cudaStreamAddCallback_ptsz(cudaStream_t stream, cudaStreamCallback_t callback,
                                           void *userData, unsigned int flags) {
  if (flags) return note(cudaErrorInvalidValue);
  return enqueue_hostfn(stream, NULL, callback, userData, 1);
}

/* ---- events ---- */

API cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  if (!event) return note(cudaErrorInvalidValue);
  jitsim_event *e;
  cudaError_t r = (cudaError_t)jitsim_event_create(&e, flags);
  if (r) return note(r);
  *event = (cudaEvent_t)e;
  return cudaSuccess;
}
API cudaError_t cudaEventCreate(cudaEvent_t *event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}
API cudaError_t cudaEventDestroy(cudaEvent_t event) {
  STICKY_GUARD();
  return note(jitsim_event_destroy((jitsim_event *)event));
}

static cudaError_t event_record(cudaEvent_t event, cudaStream_t stream, unsigned int flags, int pt) {
  STICKY_GUARD();
  if (flags & ~(unsigned)cudaEventRecordExternal) return note(cudaErrorInvalidValue);
  return note(jitsim_event_record((jitsim_event *)event, jitsim_stream_get(stream, pt)));
}
API cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  return event_record(event, stream, 0, 0);
}
API cudaError_t cudaEventRecord_ptsz(cudaEvent_t event, cudaStream_t stream) {
  return event_record(event, stream, 0, 1);
}
API cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
  return event_record(event, stream, flags, 0);
}
API cudaError_t cudaEventRecordWithFlags_ptsz(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
  return event_record(event, stream, flags, 1);
}

API cudaError_t cudaEventQuery(cudaEvent_t event) {
  cudaError_t e = jitsim_event_query((jitsim_event *)event);
  return e == cudaErrorNotReady ? e : note(e);
}
API cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  return note(jitsim_event_sync((jitsim_event *)event));
}
API cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
  cudaError_t e = jitsim_event_elapsed(ms, (jitsim_event *)start, (jitsim_event *)end);
  return e == cudaErrorNotReady ? e : note(e);
}

/* ---- memory ---- */

API cudaError_t cudaMalloc(void **devPtr, size_t size) { return note(jitsim_malloc(devPtr, size, 0)); }
API cudaError_t cudaFree(void *devPtr) { return note(jitsim_free(devPtr, 0)); }
API cudaError_t cudaMallocHost(void **ptr, size_t size) { return note(jitsim_malloc(ptr, size, 1)); }
API cudaError_t cudaFreeHost(void *ptr) { return note(jitsim_free(ptr, 1)); }

struct xfer {
  void *dst;
  const void *src;
  size_t n;
  int value;
};

static void copy_run(void *p) {
  struct xfer *x = p;
  memmove(x->dst, x->src, x->n);
}
static void set_run(void *p) {
  struct xfer *x = p;
  memset(x->dst, x->value, x->n);
}

static cudaError_t enqueue_xfer(jitsim_fn run, void *dst, const void *src, size_t n, int value,
                                cudaStream_t stream, int pt, int wait) {
  STICKY_GUARD();
  if (n == 0) return cudaSuccess;
  if (!dst || (run == copy_run && !src)) return note(cudaErrorInvalidValue);
  struct xfer *x = malloc(sizeof *x);
  if (!x) return note(cudaErrorMemoryAllocation);
  *x = (struct xfer){dst, src, n, value};
  jitsim_stream *s = jitsim_stream_get(stream, pt);
  return note(wait ? jitsim_enqueue_sync(s, run, x, free) : jitsim_enqueue(s, run, x, free));
}

static cudaError_t memcpy_sync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, int pt) {
  if ((unsigned)kind > cudaMemcpyDefault) return note(cudaErrorInvalidMemcpyDirection);
  /* Ordered on the (legacy or per-thread) default stream, so it waits for
   * everything that stream waits for. Like CUDA, device-to-device copies do
   * not block the host; all other directions return once the copy is done. */
  return enqueue_xfer(copy_run, dst, src, count, 0, NULL, pt, kind != cudaMemcpyDeviceToDevice);
}
API cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
  return memcpy_sync(dst, src, count, kind, 0);
}
API cudaError_t cudaMemcpy_ptds(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
  return memcpy_sync(dst, src, count, kind, 1);
}

static cudaError_t memcpy_async(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                                cudaStream_t stream, int pt) {
  if ((unsigned)kind > cudaMemcpyDefault) return note(cudaErrorInvalidMemcpyDirection);
  return enqueue_xfer(copy_run, dst, src, count, 0, stream, pt, 0);
}
API cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                                cudaStream_t stream) {
  return memcpy_async(dst, src, count, kind, stream, 0);
}
API cudaError_t cudaMemcpyAsync_ptsz(void *dst, const void *src, size_t count,
                                     enum cudaMemcpyKind kind, cudaStream_t stream) {
  return memcpy_async(dst, src, count, kind, stream, 1);
}

/* cudaMemset on device memory is asynchronous w.r.t. the host in CUDA. */
API cudaError_t cudaMemset(void *devPtr, int value, size_t count) {
  return enqueue_xfer(set_run, devPtr, NULL, count, value, NULL, 0, 0);
}
API cudaError_t cudaMemset_ptds(void *devPtr, int value, size_t count) {
  return enqueue_xfer(set_run, devPtr, NULL, count, value, NULL, 1, 0);
}
API cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream) {
  return enqueue_xfer(set_run, devPtr, NULL, count, value, stream, 0, 0);
}
API cudaError_t cudaMemsetAsync_ptsz(void *devPtr, int value, size_t count, cudaStream_t stream) {
  return enqueue_xfer(set_run, devPtr, NULL, count, value, stream, 1, 0);
}

/* ---- kernels ---- */

static _Atomic long g_launches;

static void fault_run(void *p) {
  (void)p;
  jitsim_set_sticky(cudaErrorIllegalAddress);
}

static cudaError_t launch(const void *func, dim3 grid, dim3 block, void **args, size_t shmem,
                          cudaStream_t stream, int pt) {
  (void)shmem;
  STICKY_GUARD();
  if (!func) return note(cudaErrorInvalidDeviceFunction);
  if (!grid.x || !grid.y || !grid.z || !block.x || !block.y || !block.z)
    return note(cudaErrorInvalidConfiguration);
  jitsim_stream *s = jitsim_stream_get(stream, pt);
  long n = atomic_fetch_add(&g_launches, 1) + 1;
  long at = jitsim_env_long("JITSIM_STICKY_ERROR_AT", 0);
  /* Once: the fault belongs to this device; a replacement (jitsimDeviceReplace)
   * does not inherit it. */
  static _Atomic int fired;
  if (at > 0 && n >= at && !atomic_exchange(&fired, 1)) {
    if (jitsim_env_long("JITSIM_STICKY_ASYNC", 0)) {
      /* Realistic timing: the launch succeeds, the fault surfaces when the
       * kernel runs, and later calls (syncs, queries) report it. */
      return note(jitsim_enqueue(s, fault_run, NULL, NULL));
    }
    jitsim_set_sticky(cudaErrorIllegalAddress);
    return note(cudaErrorIllegalAddress);
  }
  return note(jitsim_kernel_launch(func, args, s));
}

API cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                 size_t sharedMem, cudaStream_t stream) {
  return launch(func, gridDim, blockDim, args, sharedMem, stream, 0);
}
API cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                      size_t sharedMem, cudaStream_t stream) {
  return launch(func, gridDim, blockDim, args, sharedMem, stream, 1);
}

/* On the stand-in a cudaKernel_t is the kernel's host function pointer, so the
 * shim can pass either to jitsimFuncGetParamInfo. */
API cudaError_t cudaGetKernel(cudaKernel_t *kernelPtr, const void *entryFuncAddr) {
  if (!kernelPtr || !entryFuncAddr) return note(cudaErrorInvalidValue);
  STICKY_GUARD();
  size_t off, sz;
  if (jitsim_kernel_param(entryFuncAddr, 0, &off, &sz) == cudaErrorInvalidDeviceFunction)
    return note(cudaErrorInvalidDeviceFunction);
  *kernelPtr = (cudaKernel_t)(uintptr_t)entryFuncAddr;
  return cudaSuccess;
}

#if JITSIM_CUDART_MAJOR >= 13
API cudaError_t __cudaGetKernel(cudaKernel_t *kernel, const void *func) {
  return cudaGetKernel(kernel, func);
}
API cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void **args,
                                   size_t sharedMem, cudaStream_t stream) {
  return launch((const void *)kernel, gridDim, blockDim, args, sharedMem, stream, 0);
}
API cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void **args,
                                        size_t sharedMem, cudaStream_t stream) {
  return launch((const void *)kernel, gridDim, blockDim, args, sharedMem, stream, 1);
}
#endif

/* ---- stand-in extensions ---- */

API int jitsimRegisterKernel(const void *func, int nparams, const size_t *param_sizes) {
  return jitsim_kernel_register(func, nparams, param_sizes);
}

API cudaError_t jitsimFuncGetParamInfo(const void *func, size_t index, size_t *offset, size_t *size) {
  return (cudaError_t)jitsim_kernel_param(func, index, offset, size);
}

/* The "new device" model (simcore.h): what a GPU swap looks like to a process
 * whose CPU state moved to another machine. */
API cudaError_t jitsimDeviceDetach(void) { return (cudaError_t)jitsim_device_detach(); }
API cudaError_t jitsimDeviceReplace(const char *uuid) { return (cudaError_t)jitsim_device_replace(uuid); }
API cudaError_t jitsimMallocAt(void *devPtr, size_t size) { return (cudaError_t)jitsim_malloc_at(devPtr, size); }
API const char *jitsimDeviceUuid(void) { return jitsim_device_uuid(); }
