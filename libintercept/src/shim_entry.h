/*
 * shim_entry.h - the entry layer (shim_cuda.c, shim_nccl.c, shim_phases.c,
 * shim_v12.c: the application's calls), and the hooks' hot-path inline
 * functions: counting, the depth test and recovery gate, the replay log's
 * commit. Included by the entry modules only. Layers and their headers:
 * shim_base.h.
 */
#ifndef JI_SHIM_ENTRY_H
#define JI_SHIM_ENTRY_H

#include "shim_watchdog.h"

/* Hidden by default, as in shim_base.h (why: there). */
#pragma GCC visibility push(hidden)

static inline void ji_count_only(int id) {
  ji_cblock *b = ji_tls.cnt;
  if (JI_UNLIKELY(!b)) b = ji_cblock_new();
  if (JI_UNLIKELY(!b)) return;
  atomic_store_explicit(&b->c[id], atomic_load_explicit(&b->c[id], memory_order_relaxed) + 1,
                        memory_order_relaxed);
}
static inline void ji_count(int id) {
  if (JI_UNLIKELY(atomic_load_explicit(&ji_hot.rcv_attn, memory_order_relaxed))) ji_rcv_attend();
  ji_count_only(id);
}
#define COUNT(name) ji_count(JI_ID_##name)
/* The JI_HOT hooks' first test: the depth test and the gate in one branch
 * (the two words OR'ed), then ji_count_only. 1: a shim frame is below this
 * call on this thread, pass it straight through. */
static inline int ji_enter_hot(void) {
  int d = ji_tls.depth;
  if (JI_LIKELY(!(d | atomic_load_explicit(&ji_hot.rcv_attn, memory_order_relaxed)))) return 0;
  if (d) return 1;
  ji_rcv_attend();
  return 0;
}
/* Publishes a record; after a lost-device recovery the call that met the lost
 * device is executed from it now, on the new device. */
static inline void ji_log_commit(ji_rec *r) {
  ji_log_publish(r);
  if (JI_UNLIKELY(ji_tls.reissue)) ji_rcv_reissue(r);
}
static inline unsigned ji_rcv_begin(void) {
  ji_tls.in_block = 1;
  return atomic_load_explicit(&ji_rcv_gen, memory_order_relaxed);
}

#pragma GCC visibility pop

#endif
