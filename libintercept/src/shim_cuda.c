/*
 * shim_cuda.c - CUDA runtime hooks.
 *
 * Every hook: (1) passes straight through when the runtime calls back into a
 * hooked symbol while serving us (ji_tls.depth), (2) counts, (3) maps virtual
 * handles to physical ones, (4) parks the thread around calls that can block
 * on device progress, (5) appends a replay record after success.
 * The event record/query and wait paths take no lock: relaxed counters, one
 * acquire load per handle, and one fetch_add in the replay log.
 */
#define _GNU_SOURCE
#include <string.h>

#include "shim_entry.h"

/* Re-declare every hook from the table: a drift from abi/ is a compile error. */
#define JI_PROTO_(name, ret, params, args, lib, flags) JI_API ret name params;
JI_TABLE(JI_PROTO_)
#undef JI_PROTO_

#define NO_LIB cudaErrorInitializationError

/* Every CALL runs where its hook's depth test found 0 on this thread, so the
 * depth is stored (1, then 0) rather than incremented and decremented: the
 * next hook's depth test then does not wait on a read-modify-write chain
 * through memory.
 * In recover mode a sticky error (>= 700: illegal address and its family)
 * from any call means the context is gone: fall back at once, before the
 * application sees the error (one predictable compare on the hot path). */
#define CALL(expr)                                                     \
  (ji_tls.depth = 1, __extension__({                                   \
     cudaError_t r_ = (expr);                                          \
     ji_tls.depth = 0;                                                 \
     if (JI_UNLIKELY(r_ >= 700) && ji_rcv_mode) r_ = (cudaError_t)ji_rcv_cuda_error(r_); \
     r_;                                                               \
   }))

/* Handle translation that also yields the handle's record (Fig. 3
 * bookkeeping): the slot itself for a virtual handle, the shadow record for a
 * physical one (one hash probe), or NULL. */
#define XLATE_SLOT(out, slot, h)                                            \
  void *out = (void *)(h);                                                  \
  ji_vh *slot = NULL;                                                       \
  do {                                                                      \
    if (ji_is_vh(h)) {                                                      \
      slot = (ji_vh *)(h);                                                  \
      out = atomic_load_explicit(&slot->phys, memory_order_acquire);        \
      if (JI_UNLIKELY(!out)) return cudaErrorInvalidResourceHandle;         \
    } else if (atomic_load_explicit(&ji_hot.pm_used, memory_order_relaxed)) {   \
      slot = ji_pm_get(h);                                                  \
    }                                                                       \
  } while (0)

/* Handle translation that rejects destroyed virtual handles. */
#define XLATE(out, h)                                                        \
  void *out = (void *)(h);                                                   \
  do {                                                                       \
    if (ji_is_vh(h)) {                                                       \
      out = atomic_load_explicit(&((ji_vh *)(h))->phys, memory_order_acquire); \
      if (JI_UNLIKELY(!out)) return cudaErrorInvalidResourceHandle;          \
    }                                                                        \
  } while (0)

static inline int in_trigger(void) {
  return JI_UNLIKELY(ji_tls.trigger) && atomic_load_explicit(&ji_trigger_active, memory_order_relaxed) &&
         ji_redirect_enabled;
}

static void log_words(int id, unsigned n, const uint64_t *w) {
  if (!ji_log_on()) return;
  ji_rec *r = ji_log_reserve(id, n, 0);
  if (!r) return;
  memcpy(r->a, w, n * sizeof(uint64_t));
  ji_log_commit(r);
}
#define U(x) ((uint64_t)(uintptr_t)(x))

/* ---------------- events ---------------- */
static cudaError_t ev_create(int id, cudaEvent_t *event, unsigned flags) {
  void *fn = ji_real(id);
  if (!fn) return NO_LIB;
  if (ji_tls.depth || !event) {
    return id == JI_ID_cudaEventCreate ? ((ji_fn_cudaEventCreate)fn)(event)
                                       : ((ji_fn_cudaEventCreateWithFlags)fn)(event, flags);
  }
  ji_count(id);
  cudaEvent_t phys = NULL;
  cudaError_t r = id == JI_ID_cudaEventCreate ? CALL(((ji_fn_cudaEventCreate)fn)(&phys))
                                              : CALL(((ji_fn_cudaEventCreateWithFlags)fn)(&phys, flags));
  if (r != cudaSuccess) return r;
  ji_vh *v = ji_vh_alloc(JI_VK_EVENT, phys);
  if (!v) { /* arena exhausted: still correct, just not re-creatable */
    *event = phys;
    return r;
  }
  v->cflags = flags;
  *event = (cudaEvent_t)ji_vh_app(v);
  uint64_t w[2] = {U(*event), flags};
  log_words(id, 2, w);
  return r;
}
JI_API cudaError_t cudaEventCreate(cudaEvent_t *event) { return ev_create(JI_ID_cudaEventCreate, event, 0); }
JI_API cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  return ev_create(JI_ID_cudaEventCreateWithFlags, event, flags);
}

JI_API cudaError_t cudaEventDestroy(cudaEvent_t event) {
  ji_fn_cudaEventDestroy fn = REAL(cudaEventDestroy);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(event);
  COUNT(cudaEventDestroy);
  XLATE(pe, event);
  ji_vh *v = ji_slot(event);
  cudaError_t r = CALL(fn(pe));
  if (r == cudaSuccess) {
    uint64_t w[1] = {U(event)};
    log_words(JI_ID_cudaEventDestroy, 1, w);
    ji_vh_free(v);
  }
  return r;
}

/* Appends a three-word record (event record, stream wait). */
static inline void log3(int id, uint64_t a0, uint64_t a1, uint64_t a2) {
  if (!ji_log_on()) return;
  ji_rec *rec = ji_log_reserve(id, 3, 0);
  if (JI_UNLIKELY(!rec)) return;
  rec->a[0] = a0;
  rec->a[1] = a1;
  rec->a[2] = a2;
  ji_log_commit(rec);
}

/* Inlined into each entry point: id and wf fold to constants, and the hook
 * costs no extra jump or argument shuffle. */
static inline __attribute__((always_inline)) cudaError_t ev_record(int id, cudaEvent_t event, cudaStream_t stream, unsigned flags, int wf) {
  void *fn = ji_real(id);
  if (JI_UNLIKELY(!fn)) return NO_LIB;
  if (ji_enter_hot())
    return wf ? ((ji_fn_cudaEventRecordWithFlags)fn)(event, stream, flags)
              : ((ji_fn_cudaEventRecord)fn)(event, stream);
  ji_count_only(id);
  XLATE_SLOT(pe, ve, event);
  XLATE(ps, stream);
  if (in_trigger()) ps = ji_private_stream();
  cudaError_t r = wf ? CALL(((ji_fn_cudaEventRecordWithFlags)fn)(pe, ps, flags))
                     : CALL(((ji_fn_cudaEventRecord)fn)(pe, ps));
  if (JI_LIKELY(r == cudaSuccess)) {
    if (ve) {
      /* Fig. 3 bookkeeping: which stream the event was last recorded on, so a
       * later cudaStreamWaitEvent can tell whether it guards an NCCL stream. */
      atomic_store_explicit(&ve->rec_stream, (void *)stream, memory_order_relaxed);
      /* Not an RMW: concurrent records of one event only need *a* change. */
      atomic_store_explicit(&ve->rec_seq, atomic_load_explicit(&ve->rec_seq, memory_order_relaxed) + 1,
                            memory_order_release);
    }
    log3(id, U(event), U(stream), flags);
  }
  return r;
}
JI_API cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  return ev_record(JI_ID_cudaEventRecord, event, stream, 0, 0);
}
JI_API cudaError_t cudaEventRecord_ptsz(cudaEvent_t event, cudaStream_t stream) {
  return ev_record(JI_ID_cudaEventRecord_ptsz, event, stream, 0, 0);
}
JI_API cudaError_t cudaEventRecordWithFlags(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
  return ev_record(JI_ID_cudaEventRecordWithFlags, event, stream, flags, 1);
}
JI_API cudaError_t cudaEventRecordWithFlags_ptsz(cudaEvent_t event, cudaStream_t stream, unsigned int flags) {
  return ev_record(JI_ID_cudaEventRecordWithFlags_ptsz, event, stream, flags, 1);
}

JI_API cudaError_t cudaEventQuery(cudaEvent_t event) {
  ji_fn_cudaEventQuery fn = REAL(cudaEventQuery);
  if (JI_UNLIKELY(!fn)) return NO_LIB;
  if (ji_enter_hot()) return fn(event);
  ji_count_only(JI_ID_cudaEventQuery);
  XLATE(pe, event);
  /* A pure query changes no device state: not logged. */
  return CALL(fn(pe));
}

JI_API cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  ji_fn_cudaEventSynchronize fn = REAL(cudaEventSynchronize);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(event);
  COUNT(cudaEventSynchronize);
  XLATE(pe, event);
  if (in_trigger()) {
    /* The handler's own work went to the private stream; waiting on an app
     * event recorded behind a hung collective would deadlock the save. */
    ji_fn_cudaStreamSynchronize ss = REAL(cudaStreamSynchronize);
    return ss ? CALL(ss(ji_private_stream())) : NO_LIB;
  }
  for (;;) {
    unsigned g = ji_rcv_begin();
    ji_park_enter();
    cudaError_t r = CALL(fn(pe));
    ji_park_exit();
    if (JI_LIKELY(!ji_rcv_mode) || !ji_rcv_after_block(g, r, 1)) {
      if (r == cudaSuccess) ji_log_mark_synced();
      return r;
    }
    ji_vh *v2 = ji_vh_of(event); /* re-created behind the virtual handle */
    if (v2) pe = atomic_load(&v2->phys);
  }
}

/* ---------------- streams ---------------- */
static cudaError_t st_create(int id, cudaStream_t *ps, unsigned flags, int prio) {
  void *fn = ji_real(id);
  if (!fn) return NO_LIB;
#define ST_CALL(p)                                                              \
  (id == JI_ID_cudaStreamCreate ? ((ji_fn_cudaStreamCreate)fn)(p)                \
   : id == JI_ID_cudaStreamCreateWithFlags                                       \
       ? ((ji_fn_cudaStreamCreateWithFlags)fn)(p, flags)                         \
       : ((ji_fn_cudaStreamCreateWithPriority)fn)(p, flags, prio))
  if (ji_tls.depth || !ps) return ST_CALL(ps);
  ji_count(id);
  cudaStream_t phys = NULL;
  cudaError_t r = CALL(ST_CALL(&phys));
#undef ST_CALL
  if (r != cudaSuccess) return r;
  ji_vh *v = ji_vh_alloc(JI_VK_STREAM, phys);
  if (!v) {
    *ps = phys;
    return r;
  }
  v->cflags = flags;
  v->prio = prio;
  *ps = (cudaStream_t)ji_vh_app(v);
  uint64_t w[3] = {U(*ps), flags, (uint64_t)(int64_t)prio};
  log_words(id, 3, w);
  return r;
}
JI_API cudaError_t cudaStreamCreate(cudaStream_t *pStream) { return st_create(JI_ID_cudaStreamCreate, pStream, 0, 0); }
JI_API cudaError_t cudaStreamCreateWithFlags(cudaStream_t *pStream, unsigned int flags) {
  return st_create(JI_ID_cudaStreamCreateWithFlags, pStream, flags, 0);
}
JI_API cudaError_t cudaStreamCreateWithPriority(cudaStream_t *pStream, unsigned int flags, int priority) {
  return st_create(JI_ID_cudaStreamCreateWithPriority, pStream, flags, priority);
}

JI_API cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  ji_fn_cudaStreamDestroy fn = REAL(cudaStreamDestroy);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(stream);
  COUNT(cudaStreamDestroy);
  XLATE(ps, stream);
  ji_vh *v = ji_slot(stream);
  cudaError_t r = CALL(fn(ps));
  if (r == cudaSuccess) {
    uint64_t w[1] = {U(stream)};
    log_words(JI_ID_cudaStreamDestroy, 1, w);
    ji_vh_free(v);
  }
  return r;
}

static inline __attribute__((always_inline)) cudaError_t st_wait(int id, cudaStream_t stream, cudaEvent_t event, unsigned flags) {
  ji_fn_cudaStreamWaitEvent fn = (ji_fn_cudaStreamWaitEvent)ji_real(id);
  if (JI_UNLIKELY(!fn)) return NO_LIB;
  if (ji_enter_hot()) return fn(stream, event, flags);
  ji_count_only(id);
  XLATE(ps, stream);
  XLATE_SLOT(pe, ve, event);
  cudaError_t r = CALL(fn(ps, pe, flags));
  if (JI_LIKELY(r == cudaSuccess)) {
    if (ve) {
      void *rs = atomic_load_explicit(&ve->rec_stream, memory_order_relaxed);
      /* Paper Fig. 3: an event on an NCCL stream that another stream waits on
       * guards the collective(s) before it: watch it. */
      if (rs != (void *)stream && atomic_load_explicit(&ve->rec_seq, memory_order_relaxed) &&
          ji_is_nccl_stream((cudaStream_t)rs)) {
        ji_watch_stream_wait(stream, ve);
        ji_wd_start();
      }
    }
    log3(id, U(stream), U(event), flags);
  }
  return r;
}
JI_API cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  return st_wait(JI_ID_cudaStreamWaitEvent, stream, event, flags);
}
JI_API cudaError_t cudaStreamWaitEvent_ptsz(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  return st_wait(JI_ID_cudaStreamWaitEvent_ptsz, stream, event, flags);
}

static cudaError_t st_sync(int id, cudaStream_t stream) {
  ji_fn_cudaStreamSynchronize fn = (ji_fn_cudaStreamSynchronize)ji_real(id);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(stream);
  ji_count(id);
  for (;;) {
    XLATE(ps, stream);
    if (in_trigger()) ps = ji_private_stream();
    unsigned g = ji_rcv_begin();
    ji_park_enter();
    cudaError_t r = CALL(fn(ps));
    ji_park_exit();
    if (JI_LIKELY(!ji_rcv_mode) || !ji_rcv_after_block(g, r, 1)) {
      if (r == cudaSuccess) ji_log_mark_synced();
      return r;
    }
  }
}
JI_API cudaError_t cudaStreamSynchronize(cudaStream_t stream) { return st_sync(JI_ID_cudaStreamSynchronize, stream); }
JI_API cudaError_t cudaStreamSynchronize_ptsz(cudaStream_t stream) {
  return st_sync(JI_ID_cudaStreamSynchronize_ptsz, stream);
}

JI_API cudaError_t cudaDeviceSynchronize(void) {
  ji_fn_cudaDeviceSynchronize fn = REAL(cudaDeviceSynchronize);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn();
  COUNT(cudaDeviceSynchronize);
  if (in_trigger()) {
    ji_fn_cudaStreamSynchronize ss = REAL(cudaStreamSynchronize);
    return ss ? CALL(ss(ji_private_stream())) : NO_LIB;
  }
  for (;;) {
    unsigned g = ji_rcv_begin();
    ji_park_enter();
    cudaError_t r = CALL(fn());
    ji_park_exit();
    if (JI_LIKELY(!ji_rcv_mode) || !ji_rcv_after_block(g, r, 1)) {
      if (r == cudaSuccess) ji_log_mark_synced();
      return r;
    }
  }
}

/* ---------------- memory ---------------- */
JI_API cudaError_t cudaMalloc(void **devPtr, size_t size) {
  ji_fn_cudaMalloc fn = REAL(cudaMalloc);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(devPtr, size);
  COUNT(cudaMalloc);
  ji_park_enter();
  cudaError_t r = CALL(fn(devPtr, size));
  ji_park_exit();
  if (r == cudaSuccess && devPtr) {
    ji_alloc_track(*devPtr, size, ji_callsite());
    uint64_t w[2] = {U(*devPtr), size};
    log_words(JI_ID_cudaMalloc, 2, w);
  }
  return r;
}

JI_API cudaError_t cudaFree(void *devPtr) {
  ji_fn_cudaFree fn = REAL(cudaFree);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(devPtr);
  COUNT(cudaFree);
  ji_park_enter();
  cudaError_t r = CALL(fn(devPtr));
  ji_park_exit();
  if (r == cudaSuccess && devPtr) {
    ji_alloc_untrack(devPtr);
    uint64_t w[1] = {U(devPtr)};
    log_words(JI_ID_cudaFree, 1, w);
  }
  return r;
}

static int src_is_host(const void *src, enum cudaMemcpyKind kind) {
  return kind == cudaMemcpyHostToDevice || (kind == cudaMemcpyDefault && !ji_is_device_ptr(src));
}
static int dst_is_device(const void *dst, enum cudaMemcpyKind kind) {
  return kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice ||
         (kind == cudaMemcpyDefault && ji_is_device_ptr(dst));
}

static void log_memcpy(int id, void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                       cudaStream_t stream) {
  if (!ji_log_on()) return;
  /* H2D sources are captured by value: the host buffer will have been reused
   * by the time a replay runs. Copies into host memory carry no payload. */
  size_t blob = (dst_is_device(dst, kind) && src_is_host(src, kind)) ? count : 0;
  ji_rec *r = ji_log_reserve(id, 5, blob);
  if (!r) return;
  r->a[0] = U(dst);
  r->a[1] = U(src);
  r->a[2] = count;
  r->a[3] = (uint64_t)kind;
  r->a[4] = U(stream);
  if (blob) memcpy(ji_rec_blob(r), src, blob);
  ji_log_commit(r);
}

/* During the trigger every copy goes to the private non-blocking stream and
 * completes before returning: the application's streams may be stuck behind
 * a hung collective (paper §3.2, last paragraph). */
static cudaError_t memcpy_redirect(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
  ji_fn_cudaMemcpyAsync ma = REAL(cudaMemcpyAsync);
  ji_fn_cudaStreamSynchronize ss = REAL(cudaStreamSynchronize);
  cudaStream_t priv = ji_private_stream();
  if (!ma || !ss || !priv || !ji_redirect_enabled) return cudaErrorNotReady;
  atomic_fetch_add_explicit(&ji_stats[JI_ST_REDIRECTS], 1, memory_order_relaxed);
  cudaError_t r = CALL(ma(dst, src, count, kind, priv));
  if (r == cudaSuccess) r = CALL(ss(priv));
  return r;
}

static cudaError_t mc_sync(int id, void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
  ji_fn_cudaMemcpy fn = (ji_fn_cudaMemcpy)ji_real(id);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(dst, src, count, kind);
  ji_count(id);
  if (JI_DISCARDED()) return cudaSuccess;
  if (JI_UNLIKELY(atomic_load_explicit(&ji_trigger_active, memory_order_relaxed))) {
    cudaError_t r = memcpy_redirect(dst, src, count, kind);
    if (r != cudaErrorNotReady) return r;
  }
  for (;;) {
    unsigned g = ji_rcv_begin();
    ji_park_enter();
    cudaError_t r = CALL(fn(dst, src, count, kind));
    ji_park_exit();
    /* Redone after a recovery: the copy may have read pre-replay state. */
    if (JI_UNLIKELY(ji_rcv_mode) && ji_rcv_after_block(g, r, 0)) continue;
    if (r == cudaSuccess) {
      log_memcpy(id, dst, src, count, kind, NULL);
      ji_log_mark_synced();
    }
    return r;
  }
}
JI_API cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
  return mc_sync(JI_ID_cudaMemcpy, dst, src, count, kind);
}
JI_API cudaError_t cudaMemcpy_ptds(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind) {
  return mc_sync(JI_ID_cudaMemcpy_ptds, dst, src, count, kind);
}

static cudaError_t mc_async(int id, void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream) {
  ji_fn_cudaMemcpyAsync fn = (ji_fn_cudaMemcpyAsync)ji_real(id);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(dst, src, count, kind, stream);
  ji_count(id);
  if (JI_DISCARDED()) return cudaSuccess;
  XLATE(ps, stream);
  if (JI_UNLIKELY(atomic_load_explicit(&ji_trigger_active, memory_order_relaxed))) {
    cudaError_t r = memcpy_redirect(dst, src, count, kind);
    if (r != cudaErrorNotReady) return r;
  }
  /* Pageable-memory async copies can block the host. */
  ji_park_enter();
  cudaError_t r = CALL(fn(dst, src, count, kind, ps));
  ji_park_exit();
  if (r == cudaSuccess) log_memcpy(id, dst, src, count, kind, stream);
  return r;
}
JI_API cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                                   cudaStream_t stream) {
  return mc_async(JI_ID_cudaMemcpyAsync, dst, src, count, kind, stream);
}
JI_API cudaError_t cudaMemcpyAsync_ptsz(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                                        cudaStream_t stream) {
  return mc_async(JI_ID_cudaMemcpyAsync_ptsz, dst, src, count, kind, stream);
}

/* ---------------- kernels ---------------- */
#define JI_MAXP 64
static void log_launch(int id, const void *fn_or_kernel, int is_kernel, dim3 g, dim3 b, void **args,
                       size_t shm, cudaStream_t stream) {
  if (!ji_log_on()) return;
  size_t offs[JI_MAXP], sizes[JI_MAXP];
  int np = ji_kernel_params(fn_or_kernel, is_kernel, offs, sizes, JI_MAXP);
  size_t blob = 0;
  if (np > 0 && !args) np = -1;
  if (np < 0) {
    ji_log_mark_incomplete();
  } else {
    blob = (size_t)np * 8;
    for (int i = 0; i < np; i++) blob += (sizes[i] + 7) & ~(size_t)7;
  }
  ji_rec *r = ji_log_reserve(id, 8, blob);
  if (!r) return;
  r->a[0] = U(fn_or_kernel);
  r->a[1] = (uint64_t)g.x | ((uint64_t)g.y << 32);
  r->a[2] = g.z;
  r->a[3] = (uint64_t)b.x | ((uint64_t)b.y << 32);
  r->a[4] = b.z;
  r->a[5] = shm;
  r->a[6] = U(stream);
  r->a[7] = (uint64_t)(int64_t)np;
  /* Blob: np sizes, then each argument's bytes by value, 8-aligned. */
  unsigned char *p = ji_rec_blob(r);
  for (int i = 0; i < np; i++) ((uint64_t *)p)[i] = sizes[i];
  p += (size_t)np * 8;
  for (int i = 0; i < np; i++) {
    memcpy(p, args[i], sizes[i]);
    p += (sizes[i] + 7) & ~(size_t)7;
  }
  ji_log_commit(r);
}

static inline cudaError_t launch(int id, const void *f, int is_kernel, dim3 g, dim3 b, void **args, size_t shm,
                                 cudaStream_t stream) {
  void *fn = ji_real(id);
  if (JI_UNLIKELY(!fn)) return NO_LIB;
#define LCALL(s)                                                              \
  (is_kernel ? ((ji_fn___cudaLaunchKernel)fn)((cudaKernel_t)f, g, b, args, shm, s) \
             : ((ji_fn_cudaLaunchKernel)fn)(f, g, b, args, shm, s))
  if (ji_enter_hot()) return LCALL(stream);
  ji_count_only(id);
  if (JI_DISCARDED()) return cudaSuccess;
  XLATE(ps, stream);
  if (in_trigger()) ps = ji_private_stream();
  cudaError_t r = CALL(LCALL(ps));
#undef LCALL
  if (JI_LIKELY(r == cudaSuccess)) log_launch(id, f, is_kernel, g, b, args, shm, stream);
  else if (ji_rcv_mode) (void)ji_rcv_after_block(ji_rcv_begin(), r, 0); /* sticky: falls back */
  return r;
}
JI_API cudaError_t cudaLaunchKernel(const void *func, dim3 gridDim, dim3 blockDim, void **args, size_t sharedMem,
                                    cudaStream_t stream) {
  return launch(JI_ID_cudaLaunchKernel, func, 0, gridDim, blockDim, args, sharedMem, stream);
}
JI_API cudaError_t cudaLaunchKernel_ptsz(const void *func, dim3 gridDim, dim3 blockDim, void **args,
                                         size_t sharedMem, cudaStream_t stream) {
  return launch(JI_ID_cudaLaunchKernel_ptsz, func, 0, gridDim, blockDim, args, sharedMem, stream);
}
JI_API cudaError_t __cudaLaunchKernel(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void **args,
                                      size_t sharedMem, cudaStream_t stream) {
  return launch(JI_ID___cudaLaunchKernel, (const void *)kernel, 1, gridDim, blockDim, args, sharedMem, stream);
}
JI_API cudaError_t __cudaLaunchKernel_ptsz(cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void **args,
                                           size_t sharedMem, cudaStream_t stream) {
  return launch(JI_ID___cudaLaunchKernel_ptsz, (const void *)kernel, 1, gridDim, blockDim, args, sharedMem,
                stream);
}

JI_API cudaError_t __cudaGetKernel(cudaKernel_t *kernel, const void *func) {
  ji_fn___cudaGetKernel fn = REAL(__cudaGetKernel);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(kernel, func);
  COUNT(__cudaGetKernel);
  cudaError_t r = CALL(fn(kernel, func));
  /* Lets the stand-in's param-info lookup (keyed by host function) serve
   * launches that only carry the kernel handle. */
  if (r == cudaSuccess && kernel) ji_kernel_map(*kernel, func);
  return r;
}

/* ---------------- other calls that take stream/event handles ----------------
 * Hooked so that virtual handles never reach the runtime untranslated. */
static cudaError_t st_query(int id, cudaStream_t stream) {
  ji_fn_cudaStreamQuery fn = (ji_fn_cudaStreamQuery)ji_real(id);
  if (JI_UNLIKELY(!fn)) return NO_LIB;
  if (ji_enter_hot()) return fn(stream);
  ji_count_only(id);
  XLATE(ps, stream);
  return CALL(fn(ps));
}
JI_API cudaError_t cudaStreamQuery(cudaStream_t stream) { return st_query(JI_ID_cudaStreamQuery, stream); }
JI_API cudaError_t cudaStreamQuery_ptsz(cudaStream_t stream) { return st_query(JI_ID_cudaStreamQuery_ptsz, stream); }

static cudaError_t st_flags(int id, cudaStream_t stream, unsigned int *flags) {
  ji_fn_cudaStreamGetFlags fn = (ji_fn_cudaStreamGetFlags)ji_real(id);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(stream, flags);
  ji_count(id);
  XLATE(ps, stream);
  return CALL(fn(ps, flags));
}
JI_API cudaError_t cudaStreamGetFlags(cudaStream_t hStream, unsigned int *flags) {
  return st_flags(JI_ID_cudaStreamGetFlags, hStream, flags);
}
JI_API cudaError_t cudaStreamGetFlags_ptsz(cudaStream_t hStream, unsigned int *flags) {
  return st_flags(JI_ID_cudaStreamGetFlags_ptsz, hStream, flags);
}

static cudaError_t st_prio(int id, cudaStream_t stream, int *priority) {
  ji_fn_cudaStreamGetPriority fn = (ji_fn_cudaStreamGetPriority)ji_real(id);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(stream, priority);
  ji_count(id);
  XLATE(ps, stream);
  return CALL(fn(ps, priority));
}
JI_API cudaError_t cudaStreamGetPriority(cudaStream_t hStream, int *priority) {
  return st_prio(JI_ID_cudaStreamGetPriority, hStream, priority);
}
JI_API cudaError_t cudaStreamGetPriority_ptsz(cudaStream_t hStream, int *priority) {
  return st_prio(JI_ID_cudaStreamGetPriority_ptsz, hStream, priority);
}

/* Host callbacks are logged but make the minibatch unreplayable: re-running
 * arbitrary host code (whose userData may be gone) is not a device replay. */
static void log_host_work(int id, cudaStream_t stream, const void *fn, const void *user) {
  if (!ji_log_on()) return;
  ji_log_mark_incomplete();
  uint64_t w[3] = {U(stream), U(fn), U(user)};
  log_words(id, 3, w);
}

static cudaError_t st_callback(int id, cudaStream_t stream, cudaStreamCallback_t cb, void *user, unsigned flags) {
  ji_fn_cudaStreamAddCallback fn = (ji_fn_cudaStreamAddCallback)ji_real(id);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(stream, cb, user, flags);
  ji_count(id);
  XLATE(ps, stream);
  if (in_trigger()) ps = ji_private_stream();
  cudaError_t r = CALL(fn(ps, cb, user, flags));
  if (r == cudaSuccess) log_host_work(id, stream, (const void *)cb, user);
  return r;
}
JI_API cudaError_t cudaStreamAddCallback(cudaStream_t stream, cudaStreamCallback_t callback, void *userData,
                                         unsigned int flags) {
  return st_callback(JI_ID_cudaStreamAddCallback, stream, callback, userData, flags);
}
JI_API cudaError_t cudaStreamAddCallback_ptsz(cudaStream_t stream, cudaStreamCallback_t callback, void *userData,
                                              unsigned int flags) {
  return st_callback(JI_ID_cudaStreamAddCallback_ptsz, stream, callback, userData, flags);
}

static cudaError_t host_func(int id, cudaStream_t stream, cudaHostFn_t hf, void *user) {
  ji_fn_cudaLaunchHostFunc fn = (ji_fn_cudaLaunchHostFunc)ji_real(id);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(stream, hf, user);
  ji_count(id);
  XLATE(ps, stream);
  if (in_trigger()) ps = ji_private_stream();
  cudaError_t r = CALL(fn(ps, hf, user));
  if (r == cudaSuccess) log_host_work(id, stream, (const void *)hf, user);
  return r;
}
JI_API cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void *userData) {
  return host_func(JI_ID_cudaLaunchHostFunc, stream, fn, userData);
}
JI_API cudaError_t cudaLaunchHostFunc_ptsz(cudaStream_t stream, cudaHostFn_t fn, void *userData) {
  return host_func(JI_ID_cudaLaunchHostFunc_ptsz, stream, fn, userData);
}

JI_API cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
  ji_fn_cudaEventElapsedTime fn = REAL(cudaEventElapsedTime);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(ms, start, end);
  COUNT(cudaEventElapsedTime);
  XLATE(pa, start);
  XLATE(pb, end);
  return CALL(fn(ms, pa, pb));
}

static cudaError_t ms_sync(int id, void *p, int value, size_t count) {
  ji_fn_cudaMemset fn = (ji_fn_cudaMemset)ji_real(id);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(p, value, count);
  ji_count(id);
  if (JI_DISCARDED()) return cudaSuccess;
  ji_park_enter();
  cudaError_t r = CALL(fn(p, value, count));
  ji_park_exit();
  if (r == cudaSuccess) {
    uint64_t w[4] = {U(p), (uint64_t)(int64_t)value, count, 0};
    log_words(id, 4, w);
  }
  return r;
}
JI_API cudaError_t cudaMemset(void *devPtr, int value, size_t count) { return ms_sync(JI_ID_cudaMemset, devPtr, value, count); }
JI_API cudaError_t cudaMemset_ptds(void *devPtr, int value, size_t count) {
  return ms_sync(JI_ID_cudaMemset_ptds, devPtr, value, count);
}

static cudaError_t ms_async(int id, void *p, int value, size_t count, cudaStream_t stream) {
  ji_fn_cudaMemsetAsync fn = (ji_fn_cudaMemsetAsync)ji_real(id);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(p, value, count, stream);
  ji_count(id);
  if (JI_DISCARDED()) return cudaSuccess;
  XLATE(ps, stream);
  if (in_trigger()) ps = ji_private_stream();
  cudaError_t r = CALL(fn(p, value, count, ps));
  if (r == cudaSuccess) {
    uint64_t w[4] = {U(p), (uint64_t)(int64_t)value, count, U(stream)};
    log_words(id, 4, w);
  }
  return r;
}
JI_API cudaError_t cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream) {
  return ms_async(JI_ID_cudaMemsetAsync, devPtr, value, count, stream);
}
JI_API cudaError_t cudaMemsetAsync_ptsz(void *devPtr, int value, size_t count, cudaStream_t stream) {
  return ms_async(JI_ID_cudaMemsetAsync_ptsz, devPtr, value, count, stream);
}
