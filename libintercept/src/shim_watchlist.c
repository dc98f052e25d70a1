/*
 * shim_watchlist.c - what the watchdog watches (paper §3.1), and for how long:
 *  - own events: after the outermost ncclGroupEnd (or an ungrouped collective)
 *    the calling thread records a pooled event on every stream that carried
 *    NCCL work inside the group (per-thread group state below);
 *  - application events recorded on an NCCL stream that another stream waits
 *    on (cudaStreamWaitEvent; Fig. 3), timed from that wait;
 *  - the hang timeout: max(floor, mult x the longest collective seen), the
 *    rule of jitckpt/hang/bound.py, capped by JITCKPT_TIMEOUT (the ceiling);
 *    with JITCKPT_TIMEOUT_FIXED=1, JITCKPT_TIMEOUT itself. The floor defaults
 *    to 30 s, not the Python path's 1 s: this watchdog acts on its own, with
 *    no liveness check by the agent before it.
 * Hooks add entries; the watchdog thread detaches the list, polls it and hands
 * back what is still pending; a recovery (or jitintercept_recreate_handles)
 * drops every entry, since they name objects that are being replaced.
 *
 * Lock: wl_mu guards the list; held only for list surgery, never across a
 * CUDA/NCCL call.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "jitintercept.h"
#include "shim_base.h"

static pthread_mutex_t wl_mu = PTHREAD_MUTEX_INITIALIZER;
static ji_watch *wl_head;
static uint64_t wl_gen; /* bumped by every reset: a detached list from before is stale */
static _Atomic int wl_pending;
static uint64_t wl_seq;

/* Per-thread group state: NCCL groups are per thread. */
#define GROUP_STREAMS 16
static JI_TLS int tls_group_depth;
static JI_TLS int tls_group_n;
static JI_TLS void *tls_group_streams[GROUP_STREAMS];
static JI_TLS int tls_group_coll[GROUP_STREAMS];
static JI_TLS int tls_group_rank[GROUP_STREAMS];

/* ---------------- the timeout rule ---------------- */
static _Atomic int cfg_locked; /* read once the watchdog started; re-read before that */
static double cfg_timeout; /* > 0: JITCKPT_TIMEOUT, the ceiling (the timeout itself when fixed) */
static int cfg_fixed;      /* JITCKPT_TIMEOUT_FIXED */
static double cfg_mult = 5.0, cfg_floor = 30.0;
static _Atomic double longest_s; /* longest completed collective (written by the watchdog thread) */

static void read_timeout_config(void) {
  cfg_timeout = ji_env_num("JITCKPT_TIMEOUT", 0);
  cfg_fixed = ji_env_num("JITCKPT_TIMEOUT_FIXED", 0) != 0;
  cfg_mult = ji_env_num("JITCKPT_TIMEOUT_MULT", 5.0);
  cfg_floor = ji_env_num("JITCKPT_TIMEOUT_FLOOR", 30.0);
}

void ji_watch_configure(void) {
  read_timeout_config();
  atomic_store(&cfg_locked, 1);
}

double ji_watch_timeout(void) {
  if (cfg_fixed && cfg_timeout > 0) return cfg_timeout;
  double t = cfg_mult * atomic_load_explicit(&longest_s, memory_order_relaxed);
  if (t < cfg_floor) t = cfg_floor;
  return cfg_timeout > 0 && t > cfg_timeout ? cfg_timeout : t;
}

void ji_watch_completed(double seconds) {
  if (seconds > atomic_load_explicit(&longest_s, memory_order_relaxed))
    atomic_store_explicit(&longest_s, seconds, memory_order_relaxed);
}

/* ---------------- entries ---------------- */
/* Append in t_enq order (own events are always newest; application events
 * carry their record time and may be older than entries already queued). */
static void add_entry(ji_watch *e) {
  pthread_mutex_lock(&wl_mu);
  e->seq = ++wl_seq;
  ji_watch **pp = &wl_head;
  while (*pp && (*pp)->t_enq <= e->t_enq) pp = &(*pp)->next;
  e->next = *pp;
  *pp = e;
  pthread_mutex_unlock(&wl_mu);
  atomic_fetch_add(&wl_pending, 1);
  atomic_fetch_add_explicit(&ji_stats[JI_ST_WATCHED], 1, memory_order_relaxed);
}

static void watch_stream(void *vstream, int coll, int rank) {
  if (ji_trigger_fired()) return;
  void *pe = ji_pool_get();
  if (!pe) return;
  ji_fn_cudaEventRecord rec = REAL(cudaEventRecord);
  ji_tls.depth++;
  cudaError_t r = rec ? rec((cudaEvent_t)pe, (cudaStream_t)ji_phys(vstream)) : cudaErrorInitializationError;
  ji_tls.depth--;
  if (r != cudaSuccess) {
    ji_pool_put(pe);
    return;
  }
  ji_watch *e = calloc(1, sizeof *e);
  if (!e) return;
  e->pev = pe;
  e->own = 1;
  e->skey = vstream;
  e->coll = coll;
  e->rank = rank;
  e->t_enq = e->t_start = ji_now();
  add_entry(e);
}

void ji_watch_collective(int id, cudaStream_t vstream, ji_vh *vcomm) {
  int rank = ji_comm_rank(vcomm);
  if (tls_group_depth == 0) {
    watch_stream((void *)vstream, id, rank);
    return;
  }
  for (int i = 0; i < tls_group_n; i++)
    if (tls_group_streams[i] == (void *)vstream) {
      tls_group_coll[i] = id;
      return;
    }
  if (tls_group_n < GROUP_STREAMS) {
    tls_group_streams[tls_group_n] = (void *)vstream;
    tls_group_coll[tls_group_n] = id;
    tls_group_rank[tls_group_n] = rank;
    tls_group_n++;
  }
}

int ji_watch_group_depth(void) { return tls_group_depth; }
void ji_watch_group_start(void) { tls_group_depth++; }

void ji_watch_group_end(int ok) {
  if (tls_group_depth > 0) tls_group_depth--;
  if (tls_group_depth) return;
  int n = tls_group_n;
  tls_group_n = 0;
  if (!ok) return;
  for (int i = 0; i < n; i++) watch_stream(tls_group_streams[i], tls_group_coll[i], tls_group_rank[i]);
}

void ji_watch_stream_wait(cudaStream_t vstream, ji_vh *vev) {
  (void)vstream;
  if (ji_trigger_fired()) return;
  uint64_t seq = atomic_load_explicit(&vev->rec_seq, memory_order_acquire);
  void *rs = atomic_load_explicit(&vev->rec_stream, memory_order_relaxed);
  /* Many streams may wait on the same record: watch it once. */
  pthread_mutex_lock(&wl_mu);
  for (ji_watch *e = wl_head; e; e = e->next)
    if (!e->own && e->vev == vev && e->rec_seq == seq) {
      pthread_mutex_unlock(&wl_mu);
      return;
    }
  pthread_mutex_unlock(&wl_mu);
  ji_watch *e = calloc(1, sizeof *e);
  if (!e) return;
  e->vev = vev;
  e->gen = atomic_load(&vev->gen);
  e->rec_seq = seq;
  e->skey = rs;
  ji_vh *vs = ji_slot(rs);
  e->coll = vs ? (int)atomic_load(&vs->last_coll) : JI_ID_ncclAllReduce;
  e->rank = ji_comm_rank(NULL);
  /* Clock from the wait, not the record: stamping every record would put a
   * clock read on the hottest path for a difference of microseconds. */
  e->t_enq = e->t_start = ji_now();
  add_entry(e);
}

/* Own events may sit on a stream that is being replaced: leak them rather
 * than destroy an event that is stuck behind a hung collective. */
static void free_list(ji_watch *e) {
  while (e) {
    ji_watch *n = e->next;
    free(e);
    e = n;
  }
}

void ji_watch_reset(void) {
  pthread_mutex_lock(&wl_mu);
  ji_watch *e = wl_head;
  wl_head = NULL;
  wl_gen++;
  atomic_store(&wl_pending, 0);
  pthread_mutex_unlock(&wl_mu);
  free_list(e);
}

ji_watch *ji_watch_detach(uint64_t *gen) {
  pthread_mutex_lock(&wl_mu);
  ji_watch *list = wl_head;
  wl_head = NULL;
  *gen = wl_gen;
  pthread_mutex_unlock(&wl_mu);
  return list;
}

void ji_watch_return(uint64_t gen, ji_watch *keep, ji_watch **keep_tail, ji_watch *done, int ndone) {
  pthread_mutex_lock(&wl_mu);
  int stale = gen != wl_gen;
  if (!stale) {
    if (keep) { /* kept entries are older than anything added meanwhile */
      *keep_tail = wl_head;
      wl_head = keep;
    }
    atomic_fetch_sub(&wl_pending, ndone);
  }
  pthread_mutex_unlock(&wl_mu);
  if (stale) free_list(keep);
  while (done) {
    ji_watch *n = done->next;
    if (done->own) ji_pool_put(done->pev);
    free(done);
    done = n;
  }
}

int ji_watch_pending(void) { return atomic_load(&wl_pending); }

void ji_watch_atfork_child(void) {
  /* The parent's pending entries are not the child's to watch. */
  pthread_mutex_init(&wl_mu, NULL);
  wl_head = NULL;
  atomic_store(&wl_pending, 0);
  atomic_store(&cfg_locked, 0);
}

JI_API int jitintercept_watch_pending(void) { return ji_watch_pending(); }
JI_API double jitintercept_timeout_s(void) {
  if (!atomic_load(&cfg_locked)) read_timeout_config();
  return ji_watch_timeout();
}
