/*
 * simcore.c - streams, events, memory and kernels of the CPU stand-in.
 *
 * One global mutex and one condition variable guard all stream/event state.
 * That is deliberately simple: the stand-in runs tests with a handful of
 * streams, and a single lock makes cross-stream dependencies (events, the
 * legacy default stream's implicit barriers) easy to get right. Work bodies
 * (kernels, copies, collectives) run with the lock released.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "simcore.h"

enum { OP_RUN, OP_RECORD, OP_WAIT };

/* One cudaEventRecord. Events point at their latest record; waits hold the
 * record that was current when they were enqueued, so re-recording an event
 * does not release an earlier cudaStreamWaitEvent (as on a GPU). */
struct rec_node {
  int refs;
  int done;
  uint64_t t_ns;
};

struct dep {
  jitsim_stream *s;
  uint64_t seq;
};

struct op {
  struct op *next;
  int kind;
  uint64_t seq;
  int ndeps;
  struct dep *deps;
  struct rec_node *node;
  jitsim_fn run, release;
  void *arg;
};

struct jitsim_stream {
  unsigned flags;
  int priority;
  int legacy;
  int per_thread;
  uint64_t enq, done; /* items enqueued / completed so far */
  struct op *head, *tail;
  int destroyed;
  int started;
  struct jitsim_stream *next; /* g_streams, while the worker lives */
};

struct jitsim_event {
  unsigned flags;
  struct rec_node *last;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static jitsim_stream *g_streams;
static jitsim_stream g_legacy = {.legacy = 1};
static _Atomic int g_sticky;
static __thread jitsim_stream *t_ptds;
static pthread_key_t g_ptds_key;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

uint64_t jitsim_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

long jitsim_env_long(const char *name, long dflt) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || *end) return dflt;
  return x;
}

int jitsim_sticky(void) { return atomic_load(&g_sticky); }

void jitsim_set_sticky(int err) {
  pthread_mutex_lock(&g_mu);
  int zero = 0;
  atomic_compare_exchange_strong(&g_sticky, &zero, err);
  /* Wake every waiter: a dead context answers all syncs with the error. */
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
}

static void node_put_locked(struct rec_node *n) {
  if (n && --n->refs == 0) free(n);
}

static int op_ready_locked(const struct op *o) {
  for (int i = 0; i < o->ndeps; i++)
    if (o->deps[i].s->done < o->deps[i].seq) return 0;
  if (o->kind == OP_WAIT && !o->node->done) return 0;
  return 1;
}

static void *worker_main(void *p) {
  jitsim_stream *s = p;
  pthread_mutex_lock(&g_mu);
  for (;;) {
    while (!s->head && !s->destroyed) pthread_cond_wait(&g_cv, &g_mu);
    if (!s->head) break;
    struct op *o = s->head;
    while (!atomic_load(&g_sticky) && !op_ready_locked(o)) pthread_cond_wait(&g_cv, &g_mu);
    int dead = atomic_load(&g_sticky) != 0;
    if (o->kind == OP_RUN && !dead) {
      pthread_mutex_unlock(&g_mu);
      o->run(o->arg);
      pthread_mutex_lock(&g_mu);
    } else if (o->kind == OP_RECORD) {
      o->node->t_ns = jitsim_now_ns();
      o->node->done = 1;
    }
    s->head = o->next;
    if (!s->head) s->tail = NULL;
    s->done = o->seq;
    pthread_cond_broadcast(&g_cv);
    node_put_locked(o->node);
    if (o->release) {
      pthread_mutex_unlock(&g_mu);
      o->release(o->arg);
      pthread_mutex_lock(&g_mu);
    }
    free(o->deps);
    free(o);
  }
  /* Unlink so the legacy stream stops considering it. The struct itself is
   * never freed: dependencies recorded earlier may still point at it (a
   * destroyed stream costs ~100 bytes; frameworks pool their streams). */
  for (jitsim_stream **pp = &g_streams; *pp; pp = &(*pp)->next)
    if (*pp == s) {
      *pp = s->next;
      break;
    }
  pthread_mutex_unlock(&g_mu);
  return NULL;
}

static int start_worker_locked(jitsim_stream *s) {
  pthread_t th;
  pthread_attr_t at;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&th, &at, worker_main, s);
  pthread_attr_destroy(&at);
  if (rc) return cudaErrorMemoryAllocation;
  s->started = 1;
  s->next = g_streams;
  g_streams = s;
  return cudaSuccess;
}

static void ptds_destructor(void *p) { jitsim_stream_destroy(p); }

static void core_init(void) {
  pthread_key_create(&g_ptds_key, ptds_destructor);
  pthread_mutex_lock(&g_mu);
  if (start_worker_locked(&g_legacy) != cudaSuccess) {
    fprintf(stderr, "jitsim: cannot start the default stream worker\n");
    abort();
  }
  pthread_mutex_unlock(&g_mu);
}

jitsim_stream *jitsim_stream_get(cudaStream_t h, int per_thread) {
  pthread_once(&g_once, core_init);
  if (h == cudaStreamLegacy || (h == NULL && !per_thread)) return &g_legacy;
  if (h == cudaStreamPerThread || h == NULL) {
    if (!t_ptds) {
      jitsim_stream *s;
      if (jitsim_stream_create(&s, cudaStreamDefault, 0) != cudaSuccess) return &g_legacy;
      s->per_thread = 1;
      t_ptds = s;
      pthread_setspecific(g_ptds_key, s);
    }
    return t_ptds;
  }
  return (jitsim_stream *)h;
}

int jitsim_stream_create(jitsim_stream **out, unsigned flags, int priority) {
  pthread_once(&g_once, core_init);
  if (!out || (flags & ~(unsigned)cudaStreamNonBlocking)) return cudaErrorInvalidValue;
  if (atomic_load(&g_sticky)) return atomic_load(&g_sticky);
  jitsim_stream *s = calloc(1, sizeof *s);
  if (!s) return cudaErrorMemoryAllocation;
  s->flags = flags;
  /* CUDA clamps priorities into [greatest, least] = [-5, 0]. */
  s->priority = priority > 0 ? 0 : priority < -5 ? -5 : priority;
  pthread_mutex_lock(&g_mu);
  int rc = start_worker_locked(s);
  pthread_mutex_unlock(&g_mu);
  if (rc) {
    free(s);
    return rc;
  }
  *out = s;
  return cudaSuccess;
}

int jitsim_stream_destroy(jitsim_stream *s) {
  if (!s || s->legacy) return cudaErrorInvalidResourceHandle;
  pthread_mutex_lock(&g_mu);
  /* Like CUDA: returns at once; queued work still runs, then the worker ends. */
  s->destroyed = 1;
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
  return cudaSuccess;
}

int jitsim_stream_flags(jitsim_stream *s, unsigned *flags, int *priority) {
  if (flags) *flags = s->flags;
  if (priority) *priority = s->priority;
  return cudaSuccess;
}

/* Implicit synchronization of the legacy default stream: its work waits for
 * all prior work on blocking streams, and work on a blocking stream waits for
 * prior legacy work. Non-blocking streams take part in neither. */
static int legacy_deps_locked(jitsim_stream *s, struct op *o) {
  if (s->legacy) {
    int n = 0;
    for (jitsim_stream *t = g_streams; t; t = t->next)
      if (t != s && !(t->flags & cudaStreamNonBlocking) && t->enq > t->done) n++;
    if (!n) return 0;
    o->deps = calloc((size_t)n, sizeof *o->deps);
    if (!o->deps) return -1;
    for (jitsim_stream *t = g_streams; t; t = t->next)
      if (t != s && !(t->flags & cudaStreamNonBlocking) && t->enq > t->done)
        o->deps[o->ndeps++] = (struct dep){t, t->enq};
  } else if (!(s->flags & cudaStreamNonBlocking) && g_legacy.enq > g_legacy.done) {
    o->deps = calloc(1, sizeof *o->deps);
    if (!o->deps) return -1;
    o->deps[o->ndeps++] = (struct dep){&g_legacy, g_legacy.enq};
  }
  return 0;
}

/* Consumes o (and calls its release) on failure. */
static int enqueue_locked(jitsim_stream *s, struct op *o, uint64_t *seq) {
  int err = atomic_load(&g_sticky);
  if (!err && s->destroyed) err = cudaErrorInvalidResourceHandle;
  if (!err && legacy_deps_locked(s, o)) err = cudaErrorMemoryAllocation;
  if (err) {
    node_put_locked(o->node);
    free(o->deps);
    if (o->release) o->release(o->arg);
    free(o);
    return err;
  }
  o->seq = ++s->enq;
  if (seq) *seq = o->seq;
  if (s->tail)
    s->tail->next = o;
  else
    s->head = o;
  s->tail = o;
  pthread_cond_broadcast(&g_cv);
  return cudaSuccess;
}

static struct op *op_new(int kind, jitsim_fn run, void *arg, jitsim_fn release) {
  struct op *o = calloc(1, sizeof *o);
  if (!o) {
    if (release) release(arg);
    return NULL;
  }
  o->kind = kind;
  o->run = run;
  o->arg = arg;
  o->release = release;
  return o;
}

int jitsim_enqueue(jitsim_stream *s, jitsim_fn run, void *arg, jitsim_fn release) {
  struct op *o = op_new(OP_RUN, run, arg, release);
  if (!o) return cudaErrorMemoryAllocation;
  pthread_mutex_lock(&g_mu);
  int rc = enqueue_locked(s, o, NULL);
  pthread_mutex_unlock(&g_mu);
  return rc;
}

int jitsim_enqueue_sync(jitsim_stream *s, jitsim_fn run, void *arg, jitsim_fn release) {
  struct op *o = op_new(OP_RUN, run, arg, release);
  if (!o) return cudaErrorMemoryAllocation;
  uint64_t seq;
  pthread_mutex_lock(&g_mu);
  int rc = enqueue_locked(s, o, &seq);
  while (!rc && !atomic_load(&g_sticky) && s->done < seq) pthread_cond_wait(&g_cv, &g_mu);
  if (!rc) rc = atomic_load(&g_sticky);
  pthread_mutex_unlock(&g_mu);
  return rc;
}

int jitsim_stream_sync(jitsim_stream *s) {
  pthread_mutex_lock(&g_mu);
  uint64_t target = s->enq;
  while (!atomic_load(&g_sticky) && s->done < target) pthread_cond_wait(&g_cv, &g_mu);
  int rc = atomic_load(&g_sticky);
  pthread_mutex_unlock(&g_mu);
  return rc;
}

int jitsim_stream_query(jitsim_stream *s) {
  int rc = atomic_load(&g_sticky);
  if (rc) return rc;
  pthread_mutex_lock(&g_mu);
  rc = s->done >= s->enq ? cudaSuccess : cudaErrorNotReady;
  pthread_mutex_unlock(&g_mu);
  return rc;
}

int jitsim_device_sync(void) {
  pthread_once(&g_once, core_init);
  pthread_mutex_lock(&g_mu);
  size_t n = 0;
  for (jitsim_stream *t = g_streams; t; t = t->next) n++;
  struct dep *snap = calloc(n ? n : 1, sizeof *snap);
  if (!snap) {
    pthread_mutex_unlock(&g_mu);
    return cudaErrorMemoryAllocation;
  }
  n = 0;
  for (jitsim_stream *t = g_streams; t; t = t->next) snap[n++] = (struct dep){t, t->enq};
  for (size_t i = 0; i < n && !atomic_load(&g_sticky);)
    if (snap[i].s->done >= snap[i].seq)
      i++;
    else
      pthread_cond_wait(&g_cv, &g_mu);
  int rc = atomic_load(&g_sticky);
  pthread_mutex_unlock(&g_mu);
  free(snap);
  return rc;
}

int jitsim_event_create(jitsim_event **out, unsigned flags) {
  if (!out ||
      (flags & ~(unsigned)(cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess)))
    return cudaErrorInvalidValue;
  /* Interprocess events must disable timing (CUDA's rule). */
  if ((flags & cudaEventInterprocess) && !(flags & cudaEventDisableTiming))
    return cudaErrorInvalidValue;
  int rc = atomic_load(&g_sticky);
  if (rc) return rc;
  jitsim_event *e = calloc(1, sizeof *e);
  if (!e) return cudaErrorMemoryAllocation;
  e->flags = flags;
  *out = e;
  return cudaSuccess;
}

int jitsim_event_destroy(jitsim_event *e) {
  if (!e) return cudaErrorInvalidResourceHandle;
  /* A pending record keeps its node alive; the event can go now. */
  pthread_mutex_lock(&g_mu);
  node_put_locked(e->last);
  pthread_mutex_unlock(&g_mu);
  free(e);
  return cudaSuccess;
}

int jitsim_event_record(jitsim_event *e, jitsim_stream *s) {
  if (!e) return cudaErrorInvalidResourceHandle;
  struct rec_node *n = calloc(1, sizeof *n);
  struct op *o = op_new(OP_RECORD, NULL, NULL, NULL);
  if (!n || !o) {
    free(n);
    free(o);
    return cudaErrorMemoryAllocation;
  }
  n->refs = 1; /* the op's reference */
  o->node = n;
  pthread_mutex_lock(&g_mu);
  int rc = enqueue_locked(s, o, NULL);
  if (!rc) {
    n->refs++; /* the event's reference */
    node_put_locked(e->last);
    e->last = n;
  }
  pthread_mutex_unlock(&g_mu);
  return rc;
}

int jitsim_event_query(jitsim_event *e) {
  if (!e) return cudaErrorInvalidResourceHandle;
  int rc = atomic_load(&g_sticky);
  if (rc) return rc;
  pthread_mutex_lock(&g_mu);
  /* Never recorded counts as complete, as in CUDA. */
  rc = (!e->last || e->last->done) ? cudaSuccess : cudaErrorNotReady;
  pthread_mutex_unlock(&g_mu);
  return rc;
}

int jitsim_event_sync(jitsim_event *e) {
  if (!e) return cudaErrorInvalidResourceHandle;
  pthread_mutex_lock(&g_mu);
  struct rec_node *n = e->last;
  if (n) n->refs++;
  while (n && !n->done && !atomic_load(&g_sticky)) pthread_cond_wait(&g_cv, &g_mu);
  node_put_locked(n);
  int rc = atomic_load(&g_sticky);
  pthread_mutex_unlock(&g_mu);
  return rc;
}

int jitsim_event_elapsed(float *ms, jitsim_event *a, jitsim_event *b) {
  if (!ms) return cudaErrorInvalidValue;
  if (!a || !b) return cudaErrorInvalidResourceHandle;
  int rc = atomic_load(&g_sticky);
  if (rc) return rc;
  if ((a->flags | b->flags) & cudaEventDisableTiming) return cudaErrorInvalidResourceHandle;
  pthread_mutex_lock(&g_mu);
  if (!a->last || !b->last)
    rc = cudaErrorInvalidResourceHandle;
  else if (!a->last->done || !b->last->done)
    rc = cudaErrorNotReady;
  else
    *ms = (float)(((double)b->last->t_ns - (double)a->last->t_ns) / 1e6);
  pthread_mutex_unlock(&g_mu);
  return rc;
}

int jitsim_stream_wait_event(jitsim_stream *s, jitsim_event *e) {
  if (!e) return cudaErrorInvalidResourceHandle;
  pthread_mutex_lock(&g_mu);
  int rc = atomic_load(&g_sticky);
  if (!rc && e->last) {
    struct op *o = calloc(1, sizeof *o);
    if (!o) {
      rc = cudaErrorMemoryAllocation;
    } else {
      o->kind = OP_WAIT;
      o->node = e->last;
      o->node->refs++;
      rc = enqueue_locked(s, o, NULL);
    }
  }
  pthread_mutex_unlock(&g_mu);
  return rc;
}

/* ---- memory: host allocations tracked so bad frees fail like on a GPU ---- */

#define ALLOC_BUCKETS 4096
struct alloc {
  void *p;
  int host;
  struct alloc *next;
};
static struct alloc *g_allocs[ALLOC_BUCKETS];
static pthread_mutex_t g_alloc_mu = PTHREAD_MUTEX_INITIALIZER;

static size_t ptr_bucket(const void *p) { return ((uintptr_t)p >> 8) * 2654435761u % ALLOC_BUCKETS; }

int jitsim_malloc(void **p, size_t n, int host) {
  if (!p) return cudaErrorInvalidValue;
  int rc = atomic_load(&g_sticky);
  if (rc) return rc;
  if (n == 0) {
    *p = NULL;
    return cudaSuccess;
  }
  void *m = NULL;
  struct alloc *a = malloc(sizeof *a);
  /* 256-byte alignment, the guarantee cudaMalloc gives. */
  if (!a || posix_memalign(&m, 256, n)) {
    free(a);
    return cudaErrorMemoryAllocation;
  }
  a->p = m;
  a->host = host;
  pthread_mutex_lock(&g_alloc_mu);
  size_t b = ptr_bucket(m);
  a->next = g_allocs[b];
  g_allocs[b] = a;
  pthread_mutex_unlock(&g_alloc_mu);
  *p = m;
  return cudaSuccess;
}

int jitsim_free(void *p, int host) {
  int rc = atomic_load(&g_sticky);
  if (rc) return rc;
  if (!p) return cudaSuccess;
  struct alloc *found = NULL;
  pthread_mutex_lock(&g_alloc_mu);
  for (struct alloc **pp = &g_allocs[ptr_bucket(p)]; *pp; pp = &(*pp)->next)
    if ((*pp)->p == p && (*pp)->host == host) {
      found = *pp;
      *pp = found->next;
      break;
    }
  pthread_mutex_unlock(&g_alloc_mu);
  if (!found) return cudaErrorInvalidValue;
  free(found);
  free(p);
  return cudaSuccess;
}

/* ---- kernels ---- */

struct kinfo {
  const void *func;
  int nparams;
  size_t total;
  size_t *sizes, *offsets;
  struct kinfo *next;
};
#define KERN_BUCKETS 1024
static struct kinfo *g_kerns[KERN_BUCKETS];
static pthread_rwlock_t g_kern_mu = PTHREAD_RWLOCK_INITIALIZER;

static struct kinfo *kern_find_locked(const void *func) {
  for (struct kinfo *k = g_kerns[ptr_bucket(func) % KERN_BUCKETS]; k; k = k->next)
    if (k->func == func) return k;
  return NULL;
}

int jitsim_kernel_register(const void *func, int nparams, const size_t *sizes) {
  if (!func || nparams < 0 || nparams > 1024 || (nparams && !sizes)) return -1;
  struct kinfo *k = calloc(1, sizeof *k);
  if (!k) return -1;
  k->func = func;
  k->nparams = nparams;
  k->sizes = calloc((size_t)nparams + 1, sizeof(size_t));
  k->offsets = calloc((size_t)nparams + 1, sizeof(size_t));
  if (!k->sizes || !k->offsets) goto fail;
  size_t off = 0;
  for (int i = 0; i < nparams; i++) {
    if (sizes[i] == 0 || sizes[i] > 4096) goto fail; /* CUDA caps params at 4 KiB (32 KiB on 12.1+) */
    /* Natural alignment of a scalar of that size, capped at 8: what nvcc
     * gives ints/pointers/doubles; larger structs are assumed 8-aligned. */
    size_t al = 8;
    while (al > 1 && (sizes[i] % al)) al >>= 1;
    off = (off + al - 1) & ~(al - 1);
    k->sizes[i] = sizes[i];
    k->offsets[i] = off;
    off += sizes[i];
  }
  k->total = off;
  pthread_rwlock_wrlock(&g_kern_mu);
  struct kinfo *old = kern_find_locked(func);
  if (old) {
    /* Re-registration replaces the description in place (the old arrays
     * stay valid for launches reading them concurrently: leaked on purpose). */
    old->nparams = k->nparams;
    old->total = k->total;
    old->sizes = k->sizes;
    old->offsets = k->offsets;
    free(k);
  } else {
    size_t b = ptr_bucket(func) % KERN_BUCKETS;
    k->next = g_kerns[b];
    g_kerns[b] = k;
  }
  pthread_rwlock_unlock(&g_kern_mu);
  return 0;
fail:
  free(k->sizes);
  free(k->offsets);
  free(k);
  return -1;
}

int jitsim_kernel_param(const void *func, size_t index, size_t *offset, size_t *size) {
  int rc = cudaErrorInvalidDeviceFunction;
  pthread_rwlock_rdlock(&g_kern_mu);
  struct kinfo *k = kern_find_locked(func);
  if (k) {
    if (index >= (size_t)k->nparams) {
      rc = cudaErrorInvalidValue;
    } else {
      if (offset) *offset = k->offsets[index];
      if (size) *size = k->sizes[index];
      rc = cudaSuccess;
    }
  }
  pthread_rwlock_unlock(&g_kern_mu);
  return rc;
}

struct kcall {
  jitsimKernelFn fn;
  void **ptrs;
};

static void kcall_run(void *p) {
  struct kcall *c = p;
  c->fn(c->ptrs);
}

int jitsim_kernel_launch(const void *func, void **args, jitsim_stream *s) {
  int rc = atomic_load(&g_sticky);
  if (rc) return rc;
  pthread_rwlock_rdlock(&g_kern_mu);
  struct kinfo *k = kern_find_locked(func);
  if (!k) {
    pthread_rwlock_unlock(&g_kern_mu);
    return cudaErrorInvalidDeviceFunction;
  }
  int np = k->nparams;
  size_t hdr = sizeof(struct kcall) + (size_t)np * sizeof(void *);
  hdr = (hdr + 15) & ~(size_t)15;
  struct kcall *c = malloc(hdr + k->total + 1);
  if (!c) {
    pthread_rwlock_unlock(&g_kern_mu);
    return cudaErrorMemoryAllocation;
  }
  c->fn = (jitsimKernelFn)(uintptr_t)func;
  c->ptrs = (void **)(c + 1);
  char *buf = (char *)c + hdr;
  if (np && !args) {
    pthread_rwlock_unlock(&g_kern_mu);
    free(c);
    return cudaErrorInvalidValue;
  }
  /* Values are copied now: the caller may reuse its argument storage as soon
   * as the launch returns, exactly as with a real kernel launch. */
  for (int i = 0; i < np; i++) {
    memcpy(buf + k->offsets[i], args[i], k->sizes[i]);
    c->ptrs[i] = buf + k->offsets[i];
  }
  pthread_rwlock_unlock(&g_kern_mu);
  return jitsim_enqueue(s, kcall_run, c, free);
}
