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

#include "shim_internal.h"

uintptr_t ji_vh_base;
static pthread_mutex_t vh_mu = PTHREAD_MUTEX_INITIALIZER;
static uint32_t vh_high;     /* slots handed out so far (bump pointer) */
static ji_vh *vh_free_head;  /* free list, linked through ->comm */
static pthread_once_t vh_once = PTHREAD_ONCE_INIT;

static void vh_init(void) {
  /* NORESERVE: only touched slots cost memory. */
  void *p = mmap(NULL, (size_t)JI_VH_SLOT * JI_VH_MAX, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p != MAP_FAILED) ji_vh_base = (uintptr_t)p;
}

ji_vh *ji_vh_alloc(uint32_t kind, void *phys) {
  pthread_once(&vh_once, vh_init);
  if (!ji_vh_base) return NULL;
  pthread_mutex_lock(&vh_mu);
  ji_vh *v = vh_free_head;
  if (v) {
    vh_free_head = (ji_vh *)v->comm;
  } else if (vh_high < JI_VH_MAX) {
    v = (ji_vh *)(ji_vh_base + (uintptr_t)vh_high++ * JI_VH_SLOT);
  }
  pthread_mutex_unlock(&vh_mu);
  if (!v) return NULL;
  uint32_t gen = atomic_load(&v->gen);
  memset(v, 0, sizeof *v);
  atomic_store(&v->gen, gen + 1);
  v->kind = kind;
  atomic_store_explicit(&v->phys, phys, memory_order_release);
  return v;
}

void ji_vh_free(ji_vh *v) {
  if (!v) return;
  /* A stale handle used after destroy then fails cleanly (NULL physical ->
   * cudaErrorInvalidResourceHandle in the hooks) instead of aliasing. */
  atomic_store_explicit(&v->phys, NULL, memory_order_release);
  atomic_fetch_add(&v->gen, 1);
  if (v->kind == JI_VK_COMM) free(v->comm);
  v->kind = 0;
  pthread_mutex_lock(&vh_mu);
  v->comm = (struct ji_comm_info *)vh_free_head;
  vh_free_head = v;
  pthread_mutex_unlock(&vh_mu);
}

void ji_vh_foreach(uint32_t kind, void (*fn)(ji_vh *, void *), void *arg) {
  if (!ji_vh_base) return;
  pthread_mutex_lock(&vh_mu);
  uint32_t n = vh_high;
  pthread_mutex_unlock(&vh_mu);
  for (uint32_t i = 0; i < n; i++) {
    ji_vh *v = (ji_vh *)(ji_vh_base + (uintptr_t)i * JI_VH_SLOT);
    if (v->kind == kind && atomic_load(&v->phys)) fn(v, arg);
  }
}

JI_API void *jitintercept_physical(void *handle) { return ji_phys(handle); }
