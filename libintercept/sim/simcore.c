/*
 * simcore.c - streams, events, memory and kernels of the CPU stand-in.
 *
 * One global mutex and one condition variable guard all stream/event state.
 * That is deliberately simple: the stand-in runs tests with a handful of
 * streams, and a single lock makes cross-stream dependencies (events, the
 * legacy default stream's implicit barriers) easy to get right. Work bodies
 * (kernels, copies, collectives) run with the lock released (g_running counts
 * them, so a device detach can wait until none touches device memory).
 * Allocation tables (and the device arena) are under g_alloc_mu; the only
 * nesting is g_mu -> g_alloc_mu, in jitsim_device_replace.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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
  unsigned gen;               /* the device generation it was created on */
  struct jitsim_stream *next; /* g_streams, while the worker lives */
};

struct jitsim_event {
  unsigned flags;
  unsigned gen;
  struct rec_node *last;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static jitsim_stream *g_streams;
static jitsim_stream g_legacy = {.legacy = 1};
static _Atomic int g_sticky;
/* "New device" model: a device replacement bumps the generation; streams and
 * events of an older one are handles of a context that no longer exists
 * (cudaErrorInvalidResourceHandle). The legacy and per-thread default
 * streams belong to whichever context is current. */
static unsigned g_gen;
static int g_running; /* work bodies executing right now (they touch device memory) */
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
      g_running++;
      pthread_mutex_unlock(&g_mu);
      o->run(o->arg);
      pthread_mutex_lock(&g_mu);
      g_running--;
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
  s->gen = g_gen;
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

static int stale_stream_locked(const jitsim_stream *s) {
  return !s->legacy && !s->per_thread && s->gen != g_gen;
}

/* Consumes o (and calls its release) on failure. */
static int enqueue_locked(jitsim_stream *s, struct op *o, uint64_t *seq) {
  int err = atomic_load(&g_sticky);
  if (!err && (s->destroyed || stale_stream_locked(s))) err = cudaErrorInvalidResourceHandle;
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
  if (stale_stream_locked(s)) {
    pthread_mutex_unlock(&g_mu);
    return cudaErrorInvalidResourceHandle;
  }
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
  rc = stale_stream_locked(s) ? cudaErrorInvalidResourceHandle : s->done >= s->enq ? cudaSuccess : cudaErrorNotReady;
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
  pthread_mutex_lock(&g_mu);
  e->gen = g_gen;
  pthread_mutex_unlock(&g_mu);
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
  if (e->gen != g_gen) {
    pthread_mutex_unlock(&g_mu);
    free(n);
    free(o);
    return cudaErrorInvalidResourceHandle;
  }
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
  rc = e->gen != g_gen ? cudaErrorInvalidResourceHandle : (!e->last || e->last->done) ? cudaSuccess : cudaErrorNotReady;
  pthread_mutex_unlock(&g_mu);
  return rc;
}

int jitsim_event_sync(jitsim_event *e) {
  if (!e) return cudaErrorInvalidResourceHandle;
  pthread_mutex_lock(&g_mu);
  if (e->gen != g_gen) {
    pthread_mutex_unlock(&g_mu);
    return cudaErrorInvalidResourceHandle;
  }
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
  if (!rc && e->gen != g_gen) rc = cudaErrorInvalidResourceHandle;
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
  size_t n;
  int host;
  struct alloc *next;
};
static struct alloc *g_allocs[ALLOC_BUCKETS];
static pthread_mutex_t g_alloc_mu = PTHREAD_MUTEX_INITIALIZER;

static size_t ptr_bucket(const void *p) { return ((uintptr_t)p >> 8) * 2654435761u % ALLOC_BUCKETS; }

/* Device memory lives in one arena per process, a fixed range of address
 * space, handed out first-fit at 256-byte granularity (cudaMalloc's
 * alignment). Why an arena: a replacement device (jitsim_device_replace)
 * maps a fresh arena at the same base, so "allocations come back at the
 * device addresses the application holds" is something the shim can ask for
 * (jitsim_malloc_at), as it would with the driver's VMM calls on a GPU. New
 * allocations are filled with 0xDB: device memory holds nothing meaningful
 * until written, and a buffer the recovery forgot to refill shows up. */
#define ARENA_HINT ((uintptr_t)0x5a0000000000ull)
#define GRAN 256
static char *g_arena;
static size_t g_arena_size;
static int g_detached;           /* device lost: no arena mapped */
static char g_uuid[64] = "";
struct blk {
  size_t off, n;
};
static struct blk *g_blks; /* live device blocks, sorted by offset; under g_alloc_mu */
static size_t g_nblk, g_capblk;

static int arena_map_locked(void) {
  if (!g_arena_size) {
    long mb = jitsim_env_long("JITSIM_DEVICE_MEM_MB", 4096);
    g_arena_size = (size_t)(mb > 0 ? mb : 4096) << 20;
  }
  void *want = g_arena ? (void *)g_arena : (void *)ARENA_HINT;
  void *m = mmap(want, g_arena_size, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED_NOREPLACE, -1, 0);
  if (m == MAP_FAILED && !g_arena) /* the hint is taken in this process: anywhere */
    m = mmap(NULL, g_arena_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return cudaErrorMemoryAllocation;
  if (g_arena && m != g_arena) { /* a kernel without MAP_FIXED_NOREPLACE treats it as a hint */
    munmap(m, g_arena_size);
    return cudaErrorMemoryAllocation;
  }
  g_arena = m;
  if (!g_uuid[0]) {
    const char *u = getenv("JITSIM_DEVICE_UUID");
    snprintf(g_uuid, sizeof g_uuid, "%s", u && *u ? u : "GPU-sim-0");
  }
  return cudaSuccess;
}

static int blk_insert_locked(size_t at, size_t off, size_t n) {
  if (g_nblk == g_capblk) {
    size_t nc = g_capblk ? 2 * g_capblk : 64;
    struct blk *nb = realloc(g_blks, nc * sizeof *nb);
    if (!nb) return -1;
    g_blks = nb, g_capblk = nc;
  }
  memmove(&g_blks[at + 1], &g_blks[at], (g_nblk - at) * sizeof *g_blks);
  g_blks[at] = (struct blk){off, n};
  g_nblk++;
  return 0;
}

/* First fit; returns the offset or (size_t)-1. */
static size_t arena_alloc_locked(size_t n) {
  if (!g_arena && arena_map_locked() != cudaSuccess) return (size_t)-1;
  n = (n + GRAN - 1) / GRAN * GRAN;
  size_t prev_end = 0;
  for (size_t i = 0; i <= g_nblk; i++) {
    size_t next = i < g_nblk ? g_blks[i].off : g_arena_size;
    if (next - prev_end >= n) return blk_insert_locked(i, prev_end, n) ? (size_t)-1 : prev_end;
    if (i < g_nblk) prev_end = g_blks[i].off + g_blks[i].n;
  }
  return (size_t)-1;
}

static int arena_free_locked(size_t off) {
  size_t lo = 0, hi = g_nblk;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (g_blks[mid].off < off) lo = mid + 1;
    else hi = mid;
  }
  if (lo == g_nblk || g_blks[lo].off != off) return -1;
  memmove(&g_blks[lo], &g_blks[lo + 1], (g_nblk - lo - 1) * sizeof *g_blks);
  g_nblk--;
  return 0;
}

static void track_locked(struct alloc *a) {
  size_t b = ptr_bucket(a->p);
  a->next = g_allocs[b];
  g_allocs[b] = a;
}

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
  if (!a) return cudaErrorMemoryAllocation;
  pthread_mutex_lock(&g_alloc_mu);
  if (host) {
    if (posix_memalign(&m, GRAN, n)) m = NULL;
  } else if (!g_detached) {
    size_t off = arena_alloc_locked(n);
    if (off != (size_t)-1) m = g_arena + off;
  }
  if (!m) {
    pthread_mutex_unlock(&g_alloc_mu);
    free(a);
    return cudaErrorMemoryAllocation;
  }
  a->p = m, a->n = n, a->host = host;
  track_locked(a);
  pthread_mutex_unlock(&g_alloc_mu);
  if (!host) memset(m, 0xDB, n);
  *p = m;
  return cudaSuccess;
}

int jitsim_malloc_at(void *p, size_t n) {
  int rc = atomic_load(&g_sticky);
  if (rc) return rc;
  if (!p || !n || (uintptr_t)p % GRAN) return cudaErrorInvalidValue;
  struct alloc *a = malloc(sizeof *a);
  if (!a) return cudaErrorMemoryAllocation;
  pthread_mutex_lock(&g_alloc_mu);
  rc = cudaErrorMemoryAllocation;
  if (!g_detached && (g_arena || arena_map_locked() == cudaSuccess) && (char *)p >= g_arena &&
      (size_t)((char *)p - g_arena) + n <= g_arena_size) {
    size_t off = (size_t)((char *)p - g_arena), rn = (n + GRAN - 1) / GRAN * GRAN, i = 0;
    while (i < g_nblk && g_blks[i].off + g_blks[i].n <= off) i++;
    if ((i == g_nblk || g_blks[i].off >= off + rn) && !blk_insert_locked(i, off, rn)) rc = cudaSuccess;
  }
  if (rc) {
    pthread_mutex_unlock(&g_alloc_mu);
    free(a);
    return rc;
  }
  a->p = p, a->n = n, a->host = 0;
  track_locked(a);
  pthread_mutex_unlock(&g_alloc_mu);
  memset(p, 0xDB, n);
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
  if (found && !host) arena_free_locked((size_t)((char *)p - g_arena));
  pthread_mutex_unlock(&g_alloc_mu);
  if (!found) return cudaErrorInvalidValue;
  free(found);
  if (host) free(p);
  return cudaSuccess;
}

/* ---- device loss and replacement ---- */

static void drop_device_memory_locked(void) {
  for (size_t b = 0; b < ALLOC_BUCKETS; b++)
    for (struct alloc **pp = &g_allocs[b]; *pp;) {
      if ((*pp)->host) {
        pp = &(*pp)->next;
        continue;
      }
      struct alloc *dead = *pp;
      *pp = dead->next;
      free(dead);
    }
  g_nblk = 0;
  if (g_arena) munmap(g_arena, g_arena_size);
}

int jitsim_device_detach(void) {
  pthread_once(&g_once, core_init);
  pthread_mutex_lock(&g_mu);
  /* The device is gone: from now on every call reports it, no queued body runs. */
  int zero = 0;
  atomic_compare_exchange_strong(&g_sticky, &zero, cudaErrorIllegalAddress);
  pthread_cond_broadcast(&g_cv);
  while (g_running > 0) pthread_cond_wait(&g_cv, &g_mu);
  pthread_mutex_unlock(&g_mu);
  pthread_mutex_lock(&g_alloc_mu);
  if (!g_detached) drop_device_memory_locked();
  g_detached = 1;
  pthread_mutex_unlock(&g_alloc_mu);
  return cudaSuccess;
}

int jitsim_device_replace(const char *uuid) {
  if (!uuid || !*uuid || strlen(uuid) >= sizeof g_uuid) return cudaErrorInvalidValue;
  int rc = jitsim_device_detach(); /* idempotent */
  if (rc) return rc;
  pthread_mutex_lock(&g_mu);
  /* Work queued on the lost device is skipped by the workers: let it drain. */
  for (;;) {
    int busy = g_legacy.head != NULL;
    for (jitsim_stream *t = g_streams; t && !busy; t = t->next) busy = t->head != NULL;
    if (!busy) break;
    pthread_cond_wait(&g_cv, &g_mu);
  }
  pthread_mutex_lock(&g_alloc_mu);
  rc = g_arena ? arena_map_locked() : cudaSuccess;
  if (!rc) {
    g_detached = 0;
    snprintf(g_uuid, sizeof g_uuid, "%s", uuid);
    g_gen++;
    atomic_store(&g_sticky, 0);
  }
  pthread_mutex_unlock(&g_alloc_mu);
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
  return rc;
}

const char *jitsim_device_uuid(void) {
  pthread_mutex_lock(&g_alloc_mu);
  if (!g_uuid[0]) {
    const char *u = getenv("JITSIM_DEVICE_UUID");
    snprintf(g_uuid, sizeof g_uuid, "%s", u && *u ? u : "GPU-sim-0");
  }
  pthread_mutex_unlock(&g_alloc_mu);
  return g_uuid;
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
