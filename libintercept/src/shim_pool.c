/*
 * shim_pool.c - the shim's own CUDA objects and what it does with them:
 *  - a private non-blocking stream: the trigger's copies (the application's
 *    streams may sit behind a hung collective) and the lost-device refill;
 *  - a pool of timing-disabled events: the watch list's completion events and
 *    the drain's;
 *  - draining every stream the application may have work on (after an abort,
 *    after a replay).
 *
 * Lock: pool_mu guards the pool array only; never held across a CUDA call
 * other than cudaEventDestroy of an event the full pool cannot take.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <unistd.h>

#include "shim_base.h"

#define POOL_MAX 1024
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static void *ev_pool[POOL_MAX];
static int ev_pool_n;
static _Atomic(void *) priv_stream;

cudaStream_t ji_private_stream(void) { return (cudaStream_t)atomic_load(&priv_stream); }

void ji_private_stream_make(void) {
  if (atomic_load(&priv_stream)) return;
  ji_fn_cudaStreamCreateWithFlags f = REAL(cudaStreamCreateWithFlags);
  cudaStream_t s = NULL;
  if (!f) return;
  ji_tls.depth++;
  cudaError_t r = f(&s, cudaStreamNonBlocking);
  ji_tls.depth--;
  if (r == cudaSuccess) atomic_store(&priv_stream, (void *)s);
}

void *ji_pool_get(void) {
  void *e = NULL;
  pthread_mutex_lock(&pool_mu);
  if (ev_pool_n) e = ev_pool[--ev_pool_n];
  pthread_mutex_unlock(&pool_mu);
  if (e) return e;
  ji_fn_cudaEventCreateWithFlags f = REAL(cudaEventCreateWithFlags);
  if (!f) return NULL;
  ji_tls.depth++;
  cudaError_t r = f((cudaEvent_t *)&e, cudaEventDisableTiming);
  ji_tls.depth--;
  return r == cudaSuccess ? e : NULL;
}

void ji_pool_put(void *e) {
  pthread_mutex_lock(&pool_mu);
  if (ev_pool_n < POOL_MAX) {
    ev_pool[ev_pool_n++] = e;
    e = NULL;
  }
  pthread_mutex_unlock(&pool_mu);
  ji_fn_cudaEventDestroy f = REAL(cudaEventDestroy);
  if (e && f) {
    ji_tls.depth++;
    f((cudaEvent_t)e);
    ji_tls.depth--;
  }
}

/* The device was replaced: pooled events and the private stream belonged to
 * the old one (using them now fails). Forget them (nothing to destroy: their
 * context is gone) and make the private stream again on the new device. */
void ji_pool_device_replaced(void) {
  pthread_mutex_lock(&pool_mu);
  ev_pool_n = 0;
  pthread_mutex_unlock(&pool_mu);
  atomic_store(&priv_stream, NULL);
  ji_private_stream_make();
}

/* A forked child: another thread may have held the lock at the fork. */
void ji_pool_atfork_child(void) { pthread_mutex_init(&pool_mu, NULL); }

/* Every physical stream the application may have work on: all stream
 * records (virtual and shadow), NCCL streams that are not records, legacy. */
#define DRAIN_MAX 256
struct streams {
  void *s[DRAIN_MAX];
  int n;
};
static void add_stream(struct streams *ss, void *s) {
  for (int i = 0; i < ss->n; i++)
    if (ss->s[i] == s) return;
  if (ss->n < DRAIN_MAX) ss->s[ss->n++] = s;
}
static void collect_stream(ji_vh *v, void *p) { add_stream(p, atomic_load(&v->phys)); }

int ji_drain_streams(double deadline) {
  struct streams ss = {.n = 0};
  add_stream(&ss, NULL); /* legacy default stream */
  ji_vh_foreach_all(JI_VK_STREAM, collect_stream, &ss);
  ji_nccl_nv_streams(ss.s, &ss.n, DRAIN_MAX);
  ji_fn_cudaEventRecord rec = REAL(cudaEventRecord);
  ji_fn_cudaEventQuery q = REAL(cudaEventQuery);
  if (!rec || !q) return -1;
  void *ev[DRAIN_MAX];
  int ne = 0, rc = 0;
  ji_tls.depth++;
  for (int i = 0; i < ss.n; i++) {
    void *e = ji_pool_get();
    if (!e) continue;
    int r = rec((cudaEvent_t)e, (cudaStream_t)ss.s[i]);
    if (r != cudaSuccess) {
      if (ji_sticky_cuda(r)) rc = r;
      ji_pool_put(e);
      continue;
    }
    ev[ne++] = e;
  }
  while (!rc) {
    int pending = 0;
    for (int i = 0; i < ne; i++) {
      if (!ev[i]) continue;
      int r = q((cudaEvent_t)ev[i]);
      if (r == cudaSuccess) ji_pool_put(ev[i]), ev[i] = NULL;
      else if (r == cudaErrorNotReady) pending++;
      else { rc = r; break; }
    }
    if (!pending || rc) break;
    if (ji_now() > deadline) { rc = -1; break; }
    usleep(500);
  }
  ji_tls.depth--;
  return rc; /* events still pending are leaked: they sit behind work that may never finish */
}
