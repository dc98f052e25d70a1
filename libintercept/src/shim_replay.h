/*
 * shim_replay.h - the replay layer: replay log, allocations, kernel layouts,
 * executor (shim_replay.c). Layers and their headers: shim_base.h.
 */
#ifndef JI_SHIM_REPLAY_H
#define JI_SHIM_REPLAY_H

#include "shim_base.h"

/* Hidden by default, as in shim_base.h (why: there). */
#pragma GCC visibility push(hidden)

/* ---- replay log, allocations, kernel layouts, executor (shim_replay.c) ---- */
typedef struct ji_rec {
  uint32_t size;  /* bytes of this record, 8-aligned; 0 = not committed */
  uint32_t epoch; /* minibatch number; stale records from earlier epochs end a scan */
  uint16_t id;    /* JI_ID_* */
  uint16_t nargs;
  uint32_t blob_len;
  uint64_t a[];   /* nargs raw argument words, then the blob */
} ji_rec;
static inline int ji_log_on(void) {
  return atomic_load_explicit(&ji_hot.log_armed, memory_order_relaxed) && !ji_tls.log_off;
}
extern unsigned char *ji_log_base;
extern size_t ji_log_cap;
extern _Atomic uint64_t ji_log_tail;
extern _Atomic uint32_t ji_log_epoch;
JI_HIDDEN void ji_log_overflowed(void);
static inline size_t ji_rec_size(unsigned nargs, size_t blob_len) {
  return (sizeof(ji_rec) + (size_t)nargs * 8 + blob_len + 7) & ~(size_t)7;
}
/* A record of nargs words and blob_len bytes, to be filled and published;
 * NULL when it does not fit (counted: the minibatch is then unreplayable).
 * Lock-free: one fetch_add on the tail orders records across threads. */
static inline ji_rec *ji_log_reserve(int id, unsigned nargs, size_t blob_len) {
  size_t sz = ji_rec_size(nargs, blob_len);
  uint64_t off = atomic_fetch_add_explicit(&ji_log_tail, sz, memory_order_relaxed);
  if (JI_UNLIKELY(off + sz > ji_log_cap || blob_len > UINT32_MAX)) {
    ji_log_overflowed();
    return NULL;
  }
  ji_rec *r = (ji_rec *)(ji_log_base + off);
  atomic_store_explicit((_Atomic uint32_t *)&r->size, 0, memory_order_relaxed);
  r->epoch = atomic_load_explicit(&ji_log_epoch, memory_order_relaxed);
  r->id = (uint16_t)id;
  r->nargs = (uint16_t)nargs;
  r->blob_len = (uint32_t)blob_len;
  return r;
}
static inline unsigned char *ji_rec_blob(ji_rec *r) { return (unsigned char *)&r->a[r->nargs]; }
/* Publishes a filled record (hooks use ji_log_commit, below). */
static inline void ji_log_publish(ji_rec *r) {
  atomic_store_explicit((_Atomic uint32_t *)&r->size, (uint32_t)ji_rec_size(r->nargs, r->blob_len),
                        memory_order_release);
}
JI_HIDDEN void ji_log_mark_incomplete(void);
JI_HIDDEN void ji_log_mark_synced(void);
/* A new minibatch: the log restarts (armed on first use). 0: no log. */
JI_HIDDEN int ji_log_new_minibatch(void);
JI_HIDDEN uint64_t ji_log_tail_now(void);
JI_HIDDEN int ji_log_replayable(const char **why);
JI_HIDDEN int ji_is_device_ptr(const void *p);
JI_HIDDEN void ji_alloc_track(void *p, size_t n, uint64_t site);
/* A live device allocation's name across ranks (site, seq, n) and its address here. */
typedef struct { uint64_t site; uint32_t seq; size_t n; void *p; } ji_alloc_key;
/* Every live allocation, sorted by name; *out is malloc'ed (caller frees). */
JI_HIDDEN size_t ji_alloc_keys(ji_alloc_key **out);
JI_HIDDEN void ji_alloc_untrack(void *p);
/* Kernel parameter layout: number of params (or -1) and their sizes/offsets. */
JI_HIDDEN int ji_kernel_params(const void *func, int is_kernel_handle, size_t *offs, size_t *sizes, int max);
JI_HIDDEN void ji_kernel_map(cudaKernel_t k, const void *func);
/* Replays the records before offset `end`, then waits for every stream until
 * the deadline (-3 when it passes: a second fault). */
JI_HIDDEN int ji_replay_run(uint64_t end, int *nrec, double deadline);
/* Executes one record as its call would have been (no wait). 0 or a status. */
JI_HIDDEN int ji_replay_record(ji_rec *r);

#pragma GCC visibility pop

#endif
