/*
 * simcore.h - the stand-in's "driver": streams, events, host-backed device
 * memory, the kernel registry and the sticky context error.
 *
 * Why a separate library (libjitsimcore.so): on a real machine NCCL does not
 * call the CUDA runtime the application uses; it carries its own static
 * runtime and talks to the driver (libcuda.so.1). Both libcudart.so.12 and
 * .13 also sit on that one driver, so a stream created through either is
 * usable by NCCL. The stand-in reproduces that: libcudart.so.1x and
 * libnccl.so.2 are thin front ends over this shared core, and NCCL's internal
 * stream work never passes through a cudart symbol a shim could hook.
 *
 * All functions return cudaError_t values (as int) unless said otherwise.
 */
#ifndef JITSIM_SIMCORE_H
#define JITSIM_SIMCORE_H

#include <stddef.h>
#include <stdint.h>

#include "cuda_abi.h"

#define JITSIM_API __attribute__((visibility("default")))

typedef struct jitsim_stream jitsim_stream;
typedef struct jitsim_event jitsim_event;

/* Work item body run on a stream's worker thread. `release` (may be NULL) is
 * called once afterwards, also when the body is skipped (sticky error). */
typedef void (*jitsim_fn)(void *arg);

/* Maps a user handle to a stream. 0 means the legacy default stream, or the
 * calling thread's per-thread default stream when per_thread is set (the
 * _ptsz/_ptds entry points); cudaStreamLegacy/cudaStreamPerThread are honoured
 * either way. Never fails for those; other handles are returned as is. */
JITSIM_API jitsim_stream *jitsim_stream_get(cudaStream_t s, int per_thread);
JITSIM_API int jitsim_stream_create(jitsim_stream **out, unsigned flags, int priority);
JITSIM_API int jitsim_stream_destroy(jitsim_stream *s);
JITSIM_API int jitsim_stream_flags(jitsim_stream *s, unsigned *flags, int *priority);
JITSIM_API int jitsim_stream_sync(jitsim_stream *s);
JITSIM_API int jitsim_stream_query(jitsim_stream *s);
JITSIM_API int jitsim_device_sync(void);

/* Enqueue a host closure; returns cudaSuccess or the sticky error. */
JITSIM_API int jitsim_enqueue(jitsim_stream *s, jitsim_fn run, void *arg, jitsim_fn release);
/* Enqueue and wait for that item only (cudaMemcpy semantics). */
JITSIM_API int jitsim_enqueue_sync(jitsim_stream *s, jitsim_fn run, void *arg, jitsim_fn release);

JITSIM_API int jitsim_event_create(jitsim_event **out, unsigned flags);
JITSIM_API int jitsim_event_destroy(jitsim_event *e);
JITSIM_API int jitsim_event_record(jitsim_event *e, jitsim_stream *s);
JITSIM_API int jitsim_event_query(jitsim_event *e);
JITSIM_API int jitsim_event_sync(jitsim_event *e);
JITSIM_API int jitsim_event_elapsed(float *ms, jitsim_event *a, jitsim_event *b);
JITSIM_API int jitsim_stream_wait_event(jitsim_stream *s, jitsim_event *e);

JITSIM_API int jitsim_malloc(void **p, size_t n, int host);
JITSIM_API int jitsim_free(void *p, int host);
/* Device memory at a given address of the arena (the replacement device's
 * allocations must come back where the application's pointers point). */
JITSIM_API int jitsim_malloc_at(void *p, size_t n);

/* "New device" model. detach: the device is lost (sticky error from now on),
 * its memory unmapped (a CRIU dump then carries none of it). replace: a fresh
 * device with identity `uuid` takes its place: no old allocation survives,
 * the arena is mapped again at the same base, the sticky error is cleared, and
 * streams/events created before are invalid (re-create them). */
JITSIM_API int jitsim_device_detach(void);
JITSIM_API int jitsim_device_replace(const char *uuid);
JITSIM_API const char *jitsim_device_uuid(void);

/* Sticky context error (cudaErrorIllegalAddress after an injected fault).
 * jitsim_sticky() returns 0 while the context is healthy. */
JITSIM_API int jitsim_sticky(void);
JITSIM_API void jitsim_set_sticky(int err);

/* Kernel registry (see README, "Kernel convention"). */
JITSIM_API int jitsim_kernel_register(const void *func, int nparams, const size_t *sizes);
JITSIM_API int jitsim_kernel_param(const void *func, size_t index, size_t *offset, size_t *size);
/* Copies argument values now, runs func on the stream later. */
JITSIM_API int jitsim_kernel_launch(const void *func, void **args, jitsim_stream *s);

/* Monotonic nanoseconds (CLOCK_MONOTONIC). */
JITSIM_API uint64_t jitsim_now_ns(void);
/* Integer environment variable, or dflt when unset/invalid. */
JITSIM_API long jitsim_env_long(const char *name, long dflt);

#endif /* JITSIM_SIMCORE_H */
