/*
 * shim_vh.c - virtual handles for streams, events and communicators.
 *
 * A virtual handle is the address of a 64-byte slot in one reserved arena, so
 * "is this handle virtual?" is a range check and translation is one acquire
 * load: no hashing, no lock on the hot path. Handles not in the arena (stream
 * 0, cudaStreamLegacy/PerThread, objects created before the shim or by the
 * runtime itself) pass through untouched.
 *
 * Slots are allocated under vh_mu (creation/destruction are rare) and reused
 * LIFO; `gen` is bumped on reuse so watch-list entries can detect it.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "shim_base.h"

int ji_vh_mode;
static pthread_mutex_t vh_mu = PTHREAD_MUTEX_INITIALIZER;
static uint32_t vh_high;     /* slots handed out so far (bump pointer) */
static ji_vh *vh_free_head;  /* free list, linked through ->comm */
static pthread_once_t vh_once = PTHREAD_ONCE_INIT;

/* ---- physical handle -> shadow record (lookup: ji_pm_get) ----
 * Insert/delete under vh_mu; deleted keys become tombstones. A stale read can
 * only yield an arena slot, which is never unmapped. */
#define PM_CAP JI_PM_CAP
#define PM_PROBE JI_PM_PROBE
#define PM_TOMB ((void *)~(uintptr_t)0)
ji_pm_ent ji_pm[PM_CAP];

/* Caller holds vh_mu. Returns 0 when the probe window is full (the object is
 * then simply not tracked: no Fig. 3 watch, no rank label). */
static int pm_put_locked(void *phys, ji_vh *v) {
  size_t h = ji_pm_hash(phys);
  for (unsigned i = 0; i < PM_PROBE; i++) {
    size_t s = (h + i) & (PM_CAP - 1);
    void *k = atomic_load(&ji_pm[s].key);
    if (!k || k == PM_TOMB || k == phys) {
      atomic_store_explicit(&ji_pm[s].val, v, memory_order_relaxed);
      atomic_store_explicit(&ji_pm[s].key, phys, memory_order_release);
      return 1;
    }
  }
  return 0;
}

/* Only if the entry is still ours: the runtime may already have handed the
 * same address to a new object that another thread registered. */
static void pm_del_locked(void *phys, ji_vh *v) {
  size_t h = ji_pm_hash(phys);
  for (unsigned i = 0; i < PM_PROBE; i++) {
    size_t s = (h + i) & (PM_CAP - 1);
    void *k = atomic_load(&ji_pm[s].key);
    if (k == phys) {
      if (atomic_load(&ji_pm[s].val) == v) atomic_store(&ji_pm[s].key, PM_TOMB);
      return;
    }
    if (!k) return;
  }
}

/* JITCKPT_VIRTUAL_HANDLES: "all", "none", or a comma list of streams,
 * events, comms. Default "none": stream handles are also handed by PyTorch
 * to cuBLAS/cuDNN/Triton, which use them below the runtime API where no
 * LD_PRELOAD hook can translate them; events and communicators reach
 * unhooked APIs too (cudaIpcGetEventHandle, ncclRedOpCreatePreMulSum, ...). */
__attribute__((constructor)) static void vh_mode_init(void) {
  const char *e = ji_getenv("JITCKPT_VIRTUAL_HANDLES");
  if (!e || !strcmp(e, "none") || !strcmp(e, "0")) {
    ji_vh_mode = 0;
  } else if (!strcmp(e, "all") || !strcmp(e, "1")) {
    ji_vh_mode = JI_VM_STREAMS | JI_VM_EVENTS | JI_VM_COMMS;
  } else {
    ji_vh_mode = (strstr(e, "stream") ? JI_VM_STREAMS : 0) | (strstr(e, "event") ? JI_VM_EVENTS : 0) |
                 (strstr(e, "comm") ? JI_VM_COMMS : 0);
  }
  /* In-place recovery re-creates communicators: they are always virtual
   * then (nothing outside the hooked NCCL API needs the raw handle). */
  const char *m = ji_getenv("JITCKPT_ON_HANG");
  if (m && !strcmp(m, "recover")) ji_vh_mode |= JI_VM_COMMS;
  /* A device swap (shim_device.c) re-creates every stream and event on the
   * new device: the application must hold none of the old physical ones. */
  const char *d = ji_getenv("JITCKPT_ON_DEVICE_LOSS");
  if (m && !strcmp(m, "recover") && d && !strcmp(d, "migrate")) ji_vh_mode |= JI_VM_STREAMS | JI_VM_EVENTS;
}

/* Under LeakSanitizer the arena must be a root: communicator records are
 * malloc'ed and referenced only from slots. Weak: absent without ASan. */
extern void __lsan_register_root_region(const void *p, size_t size) __attribute__((weak));

static void vh_init(void) {
  /* NORESERVE: only touched slots cost memory. */
  void *p = mmap(NULL, (size_t)JI_VH_SLOT * JI_VH_MAX, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return;
  if (__lsan_register_root_region) __lsan_register_root_region(p, (size_t)JI_VH_SLOT * JI_VH_MAX);
  ji_hot.vh_base = (uintptr_t)p;
}

ji_vh *ji_vh_alloc(uint32_t kind, void *phys) {
  pthread_once(&vh_once, vh_init);
  if (ji_hot.vh_base == JI_VH_NONE) return NULL;
  pthread_mutex_lock(&vh_mu);
  ji_vh *v = vh_free_head;
  if (v) {
    vh_free_head = (ji_vh *)v->comm;
  } else if (vh_high < JI_VH_MAX) {
    v = (ji_vh *)(ji_hot.vh_base + (uintptr_t)vh_high++ * JI_VH_SLOT);
  }
  pthread_mutex_unlock(&vh_mu);
  if (!v) return NULL;
  uint32_t gen = atomic_load(&v->gen);
  memset(v, 0, sizeof *v);
  atomic_store(&v->gen, gen + 1);
  v->kind = (uint16_t)kind;
  int virt = (kind == JI_VK_STREAM && (ji_vh_mode & JI_VM_STREAMS)) ||
             (kind == JI_VK_EVENT && (ji_vh_mode & JI_VM_EVENTS)) ||
             (kind == JI_VK_COMM && (ji_vh_mode & JI_VM_COMMS));
  atomic_store_explicit(&v->phys, phys, memory_order_release);
  if (!virt) {
    v->shadow = 1;
    pthread_mutex_lock(&vh_mu);
    int ok = pm_put_locked(phys, v);
    pthread_mutex_unlock(&vh_mu);
    atomic_store(&ji_hot.pm_used, 1);
    if (!ok) { /* untracked: hand the slot back, the app keeps the physical handle */
      ji_vh_free(v);
      return NULL;
    }
  }
  return v;
}

void ji_vh_free(ji_vh *v) {
  if (!v) return;
  if (v->shadow) {
    pthread_mutex_lock(&vh_mu);
    pm_del_locked(atomic_load(&v->phys), v);
    pthread_mutex_unlock(&vh_mu);
  }
  /* A stale handle used after destroy then fails cleanly (NULL physical ->
   * cudaErrorInvalidResourceHandle in the hooks) instead of aliasing. */
  atomic_store_explicit(&v->phys, NULL, memory_order_release);
  atomic_fetch_add(&v->gen, 1);
  if (v->kind == JI_VK_COMM) free(v->comm);
  v->kind = 0;
  v->shadow = 0;
  pthread_mutex_lock(&vh_mu);
  v->comm = (struct ji_comm_info *)vh_free_head;
  vh_free_head = v;
  pthread_mutex_unlock(&vh_mu);
}

void ji_vh_foreach(uint32_t kind, void (*fn)(ji_vh *, void *), void *arg) {
  if (ji_hot.vh_base == JI_VH_NONE) return;
  pthread_mutex_lock(&vh_mu);
  uint32_t n = vh_high;
  pthread_mutex_unlock(&vh_mu);
  for (uint32_t i = 0; i < n; i++) {
    ji_vh *v = (ji_vh *)(ji_hot.vh_base + (uintptr_t)i * JI_VH_SLOT);
    if (v->kind == kind && !v->shadow && atomic_load(&v->phys)) fn(v, arg);
  }
}

JI_API void *jitintercept_physical(void *handle) { return ji_phys(handle); }

/* Like ji_vh_foreach, shadow records included. */
void ji_vh_foreach_all(uint32_t kind, void (*fn)(ji_vh *, void *), void *arg) {
  if (ji_hot.vh_base == JI_VH_NONE) return;
  pthread_mutex_lock(&vh_mu);
  uint32_t n = vh_high;
  pthread_mutex_unlock(&vh_mu);
  for (uint32_t i = 0; i < n; i++) {
    ji_vh *v = (ji_vh *)(ji_hot.vh_base + (uintptr_t)i * JI_VH_SLOT);
    if (v->kind == kind && atomic_load(&v->phys)) fn(v, arg);
  }
}

/* ---- NCCL streams ----
 * A stream record carries JI_VH_NCCL once a collective ran on it. NCCL
 * streams that have no record (stream 0, per-thread, created before the
 * shim): few, so a small append-only array scanned linearly. */
#define NV_MAX 32
static _Atomic(void *) nv_streams[NV_MAX];
_Atomic int ji_nv_n;

void ji_mark_nccl_stream(cudaStream_t s, int coll) {
  ji_vh *v = ji_slot(s);
  if (v) {
    if (!(atomic_load_explicit(&v->sflags, memory_order_relaxed) & JI_VH_NCCL))
      atomic_fetch_or(&v->sflags, JI_VH_NCCL);
    atomic_store_explicit(&v->last_coll, (uint32_t)coll, memory_order_relaxed);
    return;
  }
  if (ji_is_nccl_stream(s)) return;
  int i = atomic_fetch_add(&ji_nv_n, 1);
  if (i < NV_MAX) atomic_store(&nv_streams[i], (void *)s);
}

int ji_is_nv_stream(cudaStream_t s) {
  int n = atomic_load_explicit(&ji_nv_n, memory_order_relaxed);
  if (n > NV_MAX) n = NV_MAX;
  for (int i = 0; i < n; i++)
    if (atomic_load_explicit(&nv_streams[i], memory_order_relaxed) == (void *)s) return 1;
  return 0;
}

void ji_nccl_nv_streams(void **out, int *n, int max) {
  int m = atomic_load(&ji_nv_n);
  if (m > NV_MAX) m = NV_MAX;
  for (int i = 0; i < m; i++) {
    void *s = atomic_load(&nv_streams[i]);
    int dup = 0;
    for (int j = 0; j < *n; j++) dup |= out[j] == s;
    if (!dup && *n < max) out[(*n)++] = s;
  }
}
