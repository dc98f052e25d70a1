/*
 * shim_replay.c - per-minibatch replay log (paper §4.1), allocation registry,
 * kernel parameter layouts, and the replay executor.
 *
 * Log: one mmap'ed arena of JITCKPT_REPLAY_CAP_MB (default 64) MiB. Appending
 * is a fetch_add on the tail (lock-free, global order across threads), a
 * fill, and a release-store of the record size (its commit); the hooks do it
 * inline (ji_log_reserve in shim_replay.h, ji_log_commit in shim_entry.h). A record that
 * does not fit is dropped and counted; the minibatch is then marked
 * unreplayable. jitintercept_minibatch_begin() bumps the epoch and resets the
 * tail; records carry the epoch, so leftovers of earlier minibatches beyond
 * the new tail end a scan. The log is armed by the first minibatch_begin (no
 * step hooks, no log), or from the start with JITCKPT_REPLAY_LOG=1;
 * JITCKPT_REPLAY_LOG=0 disables it.
 * Readers (dump, replay) require the application to be quiescent.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "jitintercept.h"
#include "shim_replay.h"

unsigned char *ji_log_base;
size_t ji_log_cap;
_Atomic uint64_t ji_log_tail;
_Atomic uint32_t ji_log_epoch;
static _Atomic uint64_t log_overflow;
static _Atomic int log_incomplete;
/* Log offset at the last blocking call that completed (the application has
 * consumed device-to-host copies logged before it). */
static _Atomic uint64_t log_synced;
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;

static int log_arm(void) {
  const char *e = ji_getenv("JITCKPT_REPLAY_LOG");
  if (e && !strcmp(e, "0")) return 0;
  pthread_mutex_lock(&log_mu);
  if (!ji_log_base) {
    const char *c = ji_getenv("JITCKPT_REPLAY_CAP_MB");
    double mb = c ? strtod(c, NULL) : 64;
    if (mb <= 0) mb = 64;
    size_t cap = (size_t)(mb * 1048576.0);
    cap = (cap + 4095) & ~(size_t)4095;
    void *p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p != MAP_FAILED) ji_log_base = p, ji_log_cap = cap;
  }
  pthread_mutex_unlock(&log_mu);
  return ji_log_base != NULL;
}

__attribute__((constructor)) static void log_ctor(void) {
  const char *e = ji_getenv("JITCKPT_REPLAY_LOG");
  if (e && !strcmp(e, "1") && log_arm()) {
    atomic_store(&ji_log_epoch, 1);
    atomic_store(&ji_hot.log_armed, 1);
  }
}

void ji_log_overflowed(void) {
  atomic_fetch_add_explicit(&log_overflow, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&ji_stats[JI_ST_OVERFLOW_TOTAL], 1, memory_order_relaxed);
}

void ji_log_mark_incomplete(void) { atomic_store_explicit(&log_incomplete, 1, memory_order_relaxed); }

int ji_log_new_minibatch(void) {
  if (!atomic_load(&ji_hot.log_armed)) {
    if (!log_arm()) return 0;
    atomic_store(&ji_hot.log_armed, 1);
  }
  atomic_fetch_add(&ji_log_epoch, 1);
  atomic_store(&ji_log_tail, 0);
  atomic_store(&log_overflow, 0);
  atomic_store(&log_incomplete, 0);
  atomic_store(&log_synced, 0);
  return 1;
}

uint64_t ji_log_tail_now(void) {
  uint64_t t = atomic_load(&ji_log_tail);
  return t < ji_log_cap ? t : ji_log_cap;
}
void ji_log_mark_synced(void) {
  if (atomic_load_explicit(&ji_hot.log_armed, memory_order_relaxed))
    atomic_store_explicit(&log_synced, ji_log_tail_now(), memory_order_relaxed);
}
int ji_log_replayable(const char **why) {
  if (!atomic_load(&ji_hot.log_armed)) *why = "no replay log (jitintercept_minibatch_begin never called)";
  else if (atomic_load(&log_overflow)) *why = "the replay log overflowed (JITCKPT_REPLAY_CAP_MB)";
  else if (atomic_load(&log_incomplete)) *why = "the replay log is incomplete (unknown kernel parameter sizes or host callbacks)";
  else return 1;
  return 0;
}

JI_API uint64_t jitintercept_minibatch(void) { return atomic_load(&ji_log_epoch); }
static ji_rec *rec_next(uint64_t *off);
/* Counted by a scan: a shared counter would cost every append a locked op. */
JI_API uint64_t jitintercept_replay_records(void) {
  uint64_t off = 0, n = 0;
  while (rec_next(&off)) n++;
  return n;
}
JI_API uint64_t jitintercept_replay_bytes(void) {
  uint64_t t = atomic_load(&ji_log_tail);
  return t < ji_log_cap ? t : ji_log_cap;
}
JI_API uint64_t jitintercept_replay_overflows(void) { return atomic_load(&log_overflow); }

/* Iterates committed records of the current epoch. */
static ji_rec *rec_next(uint64_t *off) {
  uint64_t end = atomic_load(&ji_log_tail);
  if (end > ji_log_cap) end = ji_log_cap;
  if (!ji_log_base || *off + sizeof(ji_rec) > end) return NULL;
  ji_rec *r = (ji_rec *)(ji_log_base + *off);
  uint32_t sz = atomic_load_explicit((_Atomic uint32_t *)&r->size, memory_order_acquire);
  if (sz == 0 || r->epoch != atomic_load(&ji_log_epoch) || *off + sz > end) return NULL;
  *off += sz;
  return r;
}

static uint64_t fnv1a(const unsigned char *p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

JI_API int jitintercept_dump_replay_log(const char *path) {
  FILE *f = (path && *path) ? fopen(path, "w") : stderr;
  if (!f) return -errno;
  fprintf(f,
          "{\"minibatch\": %u, \"records\": %" PRIu64 ", \"bytes\": %" PRIu64 ", \"overflows\": %" PRIu64
          ", \"incomplete\": %s, \"cap\": %zu}\n",
          atomic_load(&ji_log_epoch), jitintercept_replay_records(), jitintercept_replay_bytes(),
          atomic_load(&log_overflow), atomic_load(&log_incomplete) ? "true" : "false", ji_log_cap);
  uint64_t off = 0;
  ji_rec *r;
  for (unsigned long i = 0; (r = rec_next(&off)); i++) {
    fprintf(f, "{\"i\": %lu, \"op\": \"%s\", \"args\": [", i, r->id < JI_N_SYMS ? ji_names[r->id] : "?");
    for (unsigned k = 0; k < r->nargs; k++) fprintf(f, "%s\"0x%" PRIx64 "\"", k ? ", " : "", r->a[k]);
    fprintf(f, "], \"blob_len\": %u", r->blob_len);
    if (r->blob_len) {
      const unsigned char *b = ji_rec_blob(r);
      fprintf(f, ", \"blob_fnv1a\": \"%016" PRIx64 "\"", fnv1a(b, r->blob_len));
      if (r->blob_len <= 256) {
        fputs(", \"blob_hex\": \"", f);
        for (uint32_t k = 0; k < r->blob_len; k++) fprintf(f, "%02x", b[k]);
        fputc('"', f);
      }
    }
    fputs("}\n", f);
  }
  if (f != stderr) return fclose(f) == 0 ? 0 : -errno;
  fflush(f);
  return 0;
}

/* ---------------- device allocation registry ----------------
 * Classifies cudaMemcpyDefault pointers (is the source host memory whose
 * bytes must be captured?) and names every live allocation the same way on
 * every data-parallel rank (paper §4.3): a hash of the allocating call stack,
 * a sequence number among allocations from that stack and of that size, and
 * the size. A rank whose device was replaced re-allocates each at its old
 * address and fills it from the replica's allocation with the same name
 * (shim_device.c). Sorted array under a mutex: malloc / free and
 * Default-kind copies are not on the hot path. */
struct alloc { uintptr_t p; size_t n; uint64_t site; uint32_t seq; };
static struct alloc *allocs;
static size_t nallocs, capallocs;
static pthread_mutex_t alloc_mu = PTHREAD_MUTEX_INITIALIZER;
#define SITE_SLOTS 4096
static struct { uint64_t site; size_t n; uint32_t count; } site_seq[SITE_SLOTS];

static size_t alloc_lb(uintptr_t p) { /* first index with allocs[i].p > p */
  size_t lo = 0, hi = nallocs;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (allocs[mid].p <= p) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/* Caller holds alloc_mu. The count never goes down: a freed and re-made
 * buffer gets a new name on every rank alike. */
static uint32_t next_seq_locked(uint64_t site, size_t n) {
  size_t h = (size_t)((site ^ (n * 0x9E3779B97F4A7C15ull)) % SITE_SLOTS);
  for (size_t i = 0; i < SITE_SLOTS; i++, h = (h + 1) % SITE_SLOTS) {
    if (site_seq[h].count && (site_seq[h].site != site || site_seq[h].n != n)) continue;
    site_seq[h].site = site, site_seq[h].n = n;
    return site_seq[h].count++;
  }
  return UINT32_MAX; /* table full: such buffers cannot be matched (never refilled) */
}

void ji_alloc_track(void *ptr, size_t n, uint64_t site) {
  pthread_mutex_lock(&alloc_mu);
  if (nallocs == capallocs) {
    size_t nc = capallocs ? capallocs * 2 : 256;
    struct alloc *na = realloc(allocs, nc * sizeof *na);
    if (!na) {
      pthread_mutex_unlock(&alloc_mu);
      return;
    }
    allocs = na, capallocs = nc;
  }
  size_t i = alloc_lb((uintptr_t)ptr);
  memmove(&allocs[i + 1], &allocs[i], (nallocs - i) * sizeof *allocs);
  allocs[i] = (struct alloc){(uintptr_t)ptr, n, site, next_seq_locked(site, n)};
  nallocs++;
  pthread_mutex_unlock(&alloc_mu);
}

void ji_alloc_untrack(void *ptr) {
  pthread_mutex_lock(&alloc_mu);
  size_t i = alloc_lb((uintptr_t)ptr);
  if (i > 0 && allocs[i - 1].p == (uintptr_t)ptr) {
    memmove(&allocs[i - 1], &allocs[i], (nallocs - i) * sizeof *allocs);
    nallocs--;
  }
  pthread_mutex_unlock(&alloc_mu);
}

static int key_cmp(const void *a, const void *b) {
  const ji_alloc_key *x = a, *y = b;
  if (x->site != y->site) return x->site < y->site ? -1 : 1;
  if (x->seq != y->seq) return x->seq < y->seq ? -1 : 1;
  return x->n < y->n ? -1 : x->n > y->n;
}

size_t ji_alloc_keys(ji_alloc_key **out) {
  pthread_mutex_lock(&alloc_mu);
  ji_alloc_key *k = malloc((nallocs ? nallocs : 1) * sizeof *k);
  size_t n = k ? nallocs : 0;
  for (size_t i = 0; i < n; i++) k[i] = (ji_alloc_key){allocs[i].site, allocs[i].seq, allocs[i].n, (void *)allocs[i].p};
  pthread_mutex_unlock(&alloc_mu);
  if (k) qsort(k, n, sizeof *k, key_cmp);
  *out = k;
  return n;
}

/* Memory the registry does not know (allocated before the shim, by
 * cudaMallocAsync, or through the driver's cuMemMap as PyTorch's expandable
 * segments do) is classified by the runtime when it can tell: reading device
 * memory from the host to capture it would fault on a real GPU. */
struct ji_ptr_attr { int type; int device; void *dev; void *host; long reserved[8]; };
typedef cudaError_t (*ptr_attr_fn)(struct ji_ptr_attr *, const void *);

int ji_is_device_ptr(const void *ptr) {
  pthread_mutex_lock(&alloc_mu);
  size_t i = alloc_lb((uintptr_t)ptr);
  int in = i > 0 && (uintptr_t)ptr < allocs[i - 1].p + allocs[i - 1].n;
  pthread_mutex_unlock(&alloc_mu);
  if (in) return 1;
  static _Atomic(ptr_attr_fn) attr;
  static _Atomic int resolved;
  if (!atomic_load(&resolved)) {
    atomic_store(&attr, (ptr_attr_fn)ji_sym_in_lib(JI_CUDART, "cudaPointerGetAttributes"));
    atomic_store(&resolved, 1);
  }
  ptr_attr_fn f = atomic_load(&attr);
  if (!f) return 0;
  struct ji_ptr_attr a;
  memset(&a, 0, sizeof a);
  ji_tls.depth++;
  cudaError_t r = f(&a, ptr);
  ji_tls.depth--;
  return r == cudaSuccess && a.type == 2; /* cudaMemoryTypeDevice; managed memory is host-readable */
}

/* ---------------- kernel parameter layouts ----------------
 * Insert-only open-addressing cache keyed by function (or kernel handle);
 * lookups are lock-free (acquire load of the key, published last). */
#define KP_SLOTS 4096
#define KP_MAXP 64
struct kp {
  _Atomic(const void *) key;
  int np;
  uint32_t off[KP_MAXP], size[KP_MAXP];
};
static struct kp kp_tab[KP_SLOTS];
static pthread_mutex_t kp_mu = PTHREAD_MUTEX_INITIALIZER;
#define KMAP_SLOTS 4096
static _Atomic(const void *) kmap_k[KMAP_SLOTS], kmap_f[KMAP_SLOTS];

static size_t hptr(const void *p) { return (size_t)(((uintptr_t)p >> 4) * 0x9E3779B97F4A7C15ull >> 40); }

void ji_kernel_map(cudaKernel_t k, const void *func) {
  size_t h = hptr(k);
  for (size_t i = 0; i < KMAP_SLOTS; i++) {
    size_t s = (h + i) % KMAP_SLOTS;
    const void *cur = atomic_load(&kmap_k[s]);
    if (cur == (const void *)k) return;
    if (!cur) {
      atomic_store(&kmap_f[s], func);
      const void *exp = NULL;
      if (atomic_compare_exchange_strong(&kmap_k[s], &exp, (const void *)k)) return;
    }
  }
}
static const void *kernel_func(const void *k) {
  size_t h = hptr(k);
  for (size_t i = 0; i < KMAP_SLOTS; i++) {
    size_t s = (h + i) % KMAP_SLOTS;
    const void *cur = atomic_load(&kmap_k[s]);
    if (!cur) return NULL;
    if (cur == k) return atomic_load(&kmap_f[s]);
  }
  return NULL;
}

typedef cudaError_t (*param_info_fn)(const void *, size_t, size_t *, size_t *);
typedef int (*cu_param_info_fn)(void *, size_t, size_t *, size_t *);
typedef cudaError_t (*get_func_fn)(void **, const void *);

/* Stand-in: jitsimFuncGetParamInfo(host fn). Real CUDA: cuFuncGetParamInfo on
 * cudaGetFuncBySymbol's handle, or cuKernelGetParamInfo for cudaKernel_t (both
 * resolved at run time; untested here for lack of a GPU). */
static int query_params(const void *f, int is_kernel, struct kp *out) {
  static param_info_fn sim;
  static cu_param_info_fn cu_func, cu_kernel;
  static get_func_fn get_func;
  static int resolved;
  if (!resolved) {
    sim = (param_info_fn)ji_sym_in_lib(JI_CUDART, "jitsimFuncGetParamInfo");
    get_func = (get_func_fn)ji_sym_in_lib(JI_CUDART, "cudaGetFuncBySymbol");
    cu_func = (cu_param_info_fn)dlsym(RTLD_DEFAULT, "cuFuncGetParamInfo");
    cu_kernel = (cu_param_info_fn)dlsym(RTLD_DEFAULT, "cuKernelGetParamInfo");
    resolved = 1;
  }
  int np = 0;
  size_t o, s;
  if (sim) {
    const void *hf = is_kernel ? kernel_func(f) : f;
    if (!hf) hf = f; /* the stand-in's kernel handle may be the function itself */
    while (np < KP_MAXP && sim(hf, (size_t)np, &o, &s) == cudaSuccess) out->off[np] = (uint32_t)o, out->size[np++] = (uint32_t)s;
    if (np > 0 || sim(hf, 0, &o, &s) == cudaErrorInvalidValue) return np;
  }
  if (is_kernel && cu_kernel) {
    while (np < KP_MAXP && cu_kernel((void *)f, (size_t)np, &o, &s) == 0) out->off[np] = (uint32_t)o, out->size[np++] = (uint32_t)s;
    return np ? np : -1;
  }
  void *cf = NULL;
  if (!is_kernel && get_func && cu_func && get_func(&cf, f) == cudaSuccess) {
    while (np < KP_MAXP && cu_func(cf, (size_t)np, &o, &s) == 0) out->off[np] = (uint32_t)o, out->size[np++] = (uint32_t)s;
    return np ? np : -1;
  }
  return -1;
}

int ji_kernel_params(const void *f, int is_kernel, size_t *offs, size_t *sizes, int max) {
  size_t h = hptr(f);
  struct kp *e = NULL;
  for (size_t i = 0; i < KP_SLOTS; i++) {
    struct kp *s = &kp_tab[(h + i) % KP_SLOTS];
    const void *k = atomic_load_explicit(&s->key, memory_order_acquire);
    if (k == f) { e = s; break; }
    if (!k) break;
  }
  if (!e) {
    pthread_mutex_lock(&kp_mu);
    for (size_t i = 0; i < KP_SLOTS; i++) {
      struct kp *s = &kp_tab[(h + i) % KP_SLOTS];
      const void *k = atomic_load(&s->key);
      if (k == f) { e = s; break; }
      if (!k) {
        ji_tls.depth++;
        s->np = query_params(f, is_kernel, s);
        ji_tls.depth--;
        /* Unknown layouts are not cached: registration may come later. */
        if (s->np >= 0) {
          atomic_store_explicit(&s->key, f, memory_order_release);
          e = s;
        } else {
          pthread_mutex_unlock(&kp_mu);
          return -1;
        }
        break;
      }
    }
    pthread_mutex_unlock(&kp_mu);
    if (!e) return -1;
  }
  if (e->np > max) return -1;
  for (int i = 0; i < e->np; i++) offs[i] = e->off[i], sizes[i] = e->size[i];
  return e->np;
}

/* ---------------- replay executor ---------------- */
#define P(x) ((void *)(uintptr_t)(x))
#define CHK(expr)                       \
  do {                                  \
    int rc_ = (int)(expr);              \
    if (rc_ != 0 && !status) status = rc_; \
  } while (0)
#define NEED(name)                       \
  ji_fn_##name f_##name = REAL(name);    \
  if (!f_##name) { status = -2; break; }

static void *xl(uint64_t h) { return ji_phys(P(h)); }

JI_API int jitintercept_replay(void) { return ji_replay_run(UINT64_MAX, NULL, 0); }

/* Replays the records before offset `end`. deadline 0: ends with
 * cudaDeviceSynchronize (the public API); otherwise waits for every stream
 * until the deadline (-3 when it passes: a second fault). D2H copies logged
 * after the last completed blocking call go to their real destination (the
 * application has not seen those bytes yet); earlier ones to scratch. */
/* reissue: one record whose call failed with the lost device, executed now
 * as the call itself would have been (no wait; to-host copies land where the
 * application will read them). */
static int replay_range(uint64_t off, uint64_t end, int *nrec, double deadline, int reissue) {
  if (!atomic_load(&ji_hot.log_armed) || atomic_load(&log_overflow) || atomic_load(&log_incomplete)) return -1;
  uint64_t synced = reissue ? 0 : deadline > 0 ? atomic_load(&log_synced) : UINT64_MAX;
  int status = 0, count = 0;
  void **scratch = NULL;
  size_t nscratch = 0;
  ji_rec *r;
  /* Runtime callbacks into hooked symbols during replay must not be logged. */
  ji_tls.depth++;
  while (!status && off < end && (r = rec_next(&off))) {
    uint64_t *a = r->a;
    uint64_t roff = off - r->size;
    count++;
    switch (r->id) {
      case JI_ID_cudaEventRecord:
      case JI_ID_cudaEventRecord_ptsz:
      case JI_ID_cudaEventRecordWithFlags:
      case JI_ID_cudaEventRecordWithFlags_ptsz: {
        NEED(cudaEventRecordWithFlags);
        if (ji_vh_of(P(a[0])) && !xl(a[0])) { status = cudaErrorInvalidResourceHandle; break; }
        CHK(f_cudaEventRecordWithFlags(xl(a[0]), xl(a[1]), (unsigned)a[2]));
        break;
      }
      case JI_ID_cudaStreamWaitEvent:
      case JI_ID_cudaStreamWaitEvent_ptsz: {
        NEED(cudaStreamWaitEvent);
        CHK(f_cudaStreamWaitEvent(xl(a[0]), xl(a[1]), (unsigned)a[2]));
        break;
      }
      case JI_ID_cudaMemcpy:
      case JI_ID_cudaMemcpy_ptds:
      case JI_ID_cudaMemcpyAsync:
      case JI_ID_cudaMemcpyAsync_ptsz: {
        NEED(cudaMemcpyAsync);
        void *dst = P(a[0]);
        const void *src = r->blob_len ? (const void *)ji_rec_blob(r) : P(a[1]);
        enum cudaMemcpyKind kind = (enum cudaMemcpyKind)a[3];
        int to_host = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyHostToHost ||
                      (kind == cudaMemcpyDefault && !ji_is_device_ptr(dst));
        if (to_host && roff < synced) {
          /* The application consumed those bytes already and may have freed
           * the buffer: replay into scratch. */
          void **ns = realloc(scratch, (nscratch + 1) * sizeof *ns);
          void *buf = malloc(a[2] ? a[2] : 1);
          if (!ns || !buf) { free(buf); if (ns) scratch = ns; status = cudaErrorMemoryAllocation; break; }
          scratch = ns;
          scratch[nscratch++] = buf;
          dst = buf;
        }
        if (r->id == JI_ID_cudaMemcpy || r->id == JI_ID_cudaMemcpy_ptds) {
          NEED(cudaMemcpy);
          CHK(f_cudaMemcpy(dst, src, a[2], kind));
        } else {
          CHK(f_cudaMemcpyAsync(dst, src, a[2], kind, xl(a[4])));
        }
        break;
      }
      case JI_ID_cudaLaunchKernel:
      case JI_ID_cudaLaunchKernel_ptsz:
      case JI_ID___cudaLaunchKernel:
      case JI_ID___cudaLaunchKernel_ptsz: {
        int np = (int)(int64_t)a[7];
        if (np < 0 || np > KP_MAXP) { status = -1; break; }
        void *argv[KP_MAXP];
        unsigned char *b = ji_rec_blob(r);
        const uint64_t *sz = (const uint64_t *)b;
        unsigned char *p = b + (size_t)np * 8;
        for (int i = 0; i < np; i++) {
          argv[i] = p;
          p += (sz[i] + 7) & ~(uint64_t)7;
        }
        dim3 g = {(unsigned)a[1], (unsigned)(a[1] >> 32), (unsigned)a[2]};
        dim3 bl = {(unsigned)a[3], (unsigned)(a[3] >> 32), (unsigned)a[4]};
        if (r->id == JI_ID___cudaLaunchKernel || r->id == JI_ID___cudaLaunchKernel_ptsz) {
          NEED(__cudaLaunchKernel);
          CHK(f___cudaLaunchKernel((cudaKernel_t)P(a[0]), g, bl, argv, a[5], xl(a[6])));
        } else {
          NEED(cudaLaunchKernel);
          CHK(f_cudaLaunchKernel(P(a[0]), g, bl, argv, a[5], xl(a[6])));
        }
        break;
      }
      case JI_ID_ncclAllReduce: {
        NEED(ncclAllReduce);
        CHK(f_ncclAllReduce(P(a[0]), P(a[1]), a[2], (ncclDataType_t)a[3], (ncclRedOp_t)a[4], xl(a[5]), xl(a[6])));
        break;
      }
      case JI_ID_ncclBroadcast: {
        NEED(ncclBroadcast);
        CHK(f_ncclBroadcast(P(a[0]), P(a[1]), a[2], (ncclDataType_t)a[3], (int)(int64_t)a[4], xl(a[5]), xl(a[6])));
        break;
      }
      case JI_ID_ncclReduce: {
        NEED(ncclReduce);
        CHK(f_ncclReduce(P(a[0]), P(a[1]), a[2], (ncclDataType_t)a[3], (ncclRedOp_t)a[4], (int)(int64_t)a[7],
                         xl(a[5]), xl(a[6])));
        break;
      }
      case JI_ID_ncclAllGather: {
        NEED(ncclAllGather);
        CHK(f_ncclAllGather(P(a[0]), P(a[1]), a[2], (ncclDataType_t)a[3], xl(a[5]), xl(a[6])));
        break;
      }
      case JI_ID_ncclReduceScatter: {
        NEED(ncclReduceScatter);
        CHK(f_ncclReduceScatter(P(a[0]), P(a[1]), a[2], (ncclDataType_t)a[3], (ncclRedOp_t)a[4], xl(a[5]),
                                xl(a[6])));
        break;
      }
      case JI_ID_ncclSend: {
        NEED(ncclSend);
        CHK(f_ncclSend(P(a[0]), a[2], (ncclDataType_t)a[3], (int)(int64_t)a[4], xl(a[5]), xl(a[6])));
        break;
      }
      case JI_ID_ncclRecv: {
        NEED(ncclRecv);
        CHK(f_ncclRecv(P(a[1]), a[2], (ncclDataType_t)a[3], (int)(int64_t)a[4], xl(a[5]), xl(a[6])));
        break;
      }
      case JI_ID_cudaMemset:
      case JI_ID_cudaMemset_ptds: {
        NEED(cudaMemset);
        CHK(f_cudaMemset(P(a[0]), (int)(int64_t)a[1], a[2]));
        break;
      }
      case JI_ID_cudaMemsetAsync:
      case JI_ID_cudaMemsetAsync_ptsz: {
        NEED(cudaMemsetAsync);
        CHK(f_cudaMemsetAsync(P(a[0]), (int)(int64_t)a[1], a[2], xl(a[3])));
        break;
      }
      case JI_ID_ncclBcast: {
        NEED(ncclBcast);
        CHK(f_ncclBcast(P(a[1]), a[2], (ncclDataType_t)a[3], (int)(int64_t)a[4], xl(a[5]), xl(a[6])));
        break;
      }
      case JI_ID_ncclGroupStart: {
        NEED(ncclGroupStart);
        CHK(f_ncclGroupStart());
        break;
      }
      case JI_ID_ncclGroupEnd: {
        NEED(ncclGroupEnd);
        CHK(f_ncclGroupEnd());
        break;
      }
      default:
        /* Creation/destruction of streams, events, communicators and memory
         * is not re-executed: replay runs against the objects and addresses
         * that exist now (virtual handles keep the former valid; device
         * addresses must be stable, as with a caching allocator). */
        break;
    }
  }
  if (reissue) {
    /* asynchronous, like the original call */
  } else if (deadline > 0) {
    ji_tls.depth--;
    int d = ji_drain_streams(deadline);
    ji_tls.depth++;
    if (d && !status) status = d < 0 ? -3 : d;
  } else {
    ji_fn_cudaDeviceSynchronize ds = REAL(cudaDeviceSynchronize);
    if (ds) CHK(ds());
  }
  ji_tls.depth--;
  if (nrec) *nrec = count;
  for (size_t i = 0; i < nscratch; i++) free(scratch[i]);
  free(scratch);
  return status;
}

int ji_replay_run(uint64_t end, int *nrec, double deadline) { return replay_range(0, end, nrec, deadline, 0); }

int ji_replay_record(ji_rec *r) {
  uint64_t off = (uint64_t)((unsigned char *)r - ji_log_base);
  int n = 0;
  int st = replay_range(off, off + r->size, &n, 0, 1);
  return st ? st : n != 1 ? -1 : 0;
}
