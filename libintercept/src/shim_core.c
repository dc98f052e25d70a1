/* shim_core.c - real-symbol resolution, counters, environment, public API glue. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "jitintercept.h"
#include "shim_base.h"

ji_hot_t ji_hot = {.vh_base = JI_VH_NONE};
_Atomic(void *) ji_real_fns[JI_N_SYMS];
JI_TLS ji_thread ji_tls;
static _Atomic(ji_cblock *) cblocks;

ji_cblock *ji_cblock_new(void) {
  /* Whole cache lines of its own: a heap neighbour written by another thread
   * (the runtime's queue entries) would otherwise share a line with the
   * counters every hook on this thread increments. */
  size_t n = (sizeof(ji_cblock) + 63) & ~(size_t)63;
  ji_cblock *b = aligned_alloc(64, n);
  if (!b) return NULL;
  memset(b, 0, n);
  ji_cblock *head = atomic_load(&cblocks);
  do b->next = head;
  while (!atomic_compare_exchange_weak(&cblocks, &head, b));
  ji_tls.cnt = b;
  return b;
}

static uint64_t counter_sum(int id) {
  uint64_t s = 0;
  for (ji_cblock *b = atomic_load(&cblocks); b; b = b->next) s += atomic_load_explicit(&b->c[id], memory_order_relaxed);
  return s;
}

const char *const ji_names[JI_N_SYMS] = {
#define JI_NAME_(name, ret, params, args, lib, flags) #name,
    JI_TABLE(JI_NAME_)
#undef JI_NAME_
};
static const int ji_libs[JI_N_SYMS] = {
#define JI_LIB_(name, ret, params, args, lib, flags) lib,
    JI_TABLE(JI_LIB_)
#undef JI_LIB_
};
const unsigned ji_flags[JI_N_SYMS] = {
#define JI_FL_(name, ret, params, args, lib, flags) flags,
    JI_TABLE(JI_FL_)
#undef JI_FL_
};
_Static_assert(sizeof(((ji_cblock *)0)->c) / sizeof(uint64_t) == sizeof(ji_names) / sizeof(ji_names[0]),
               "one counter per table entry");

_Atomic uint64_t ji_stats[JI_ST_N];

double ji_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

const char *ji_getenv(const char *name) {
  const char *v = getenv(name);
  return (v && *v) ? v : NULL;
}

double ji_env_num(const char *name, double dflt) {
  const char *v = ji_getenv(name);
  if (!v) return dflt;
  char *e;
  double d = strtod(v, &e);
  return (e != v && d >= 0) ? d : dflt;
}

/* ---- locating a library that is not in the global scope ----
 * dlsym(RTLD_NEXT) only searches the global scope. When libtorch_cuda (and its
 * libcudart dependency) was dlopen'ed RTLD_LOCAL, the runtime is loaded but
 * invisible to RTLD_NEXT; walk the link map to find it and take a reference
 * with RTLD_NOLOAD (never loads anything new). */
struct find_arg {
  const char *prefix;
  char path[4096];
};
static int find_cb(struct dl_phdr_info *info, size_t size, void *data) {
  (void)size;
  struct find_arg *fa = data;
  const char *name = info->dlpi_name;
  if (!name || !*name) return 0;
  const char *base = strrchr(name, '/');
  base = base ? base + 1 : name;
  if (strncmp(base, fa->prefix, strlen(fa->prefix)) != 0) return 0;
  snprintf(fa->path, sizeof fa->path, "%s", name);
  return 1;
}
static _Atomic(void *) lib_handles[2];
static void *find_loaded(int lib) {
  void *h = atomic_load(&lib_handles[lib]);
  if (h) return h;
  struct find_arg fa = {.prefix = lib == JI_NCCL ? "libnccl.so" : "libcudart.so", .path = ""};
  if (!dl_iterate_phdr(find_cb, &fa)) return NULL;
  h = dlopen(fa.path, RTLD_LAZY | RTLD_NOLOAD);
  if (!h) return NULL;
  void *expected = NULL;
  if (!atomic_compare_exchange_strong(&lib_handles[lib], &expected, h)) {
    dlclose(h);
    h = expected;
  }
  return h;
}

void *ji_sym_in_lib(int lib, const char *name) {
  void *p = dlsym(RTLD_NEXT, name);
  if (p) return p;
  void *h = find_loaded(lib);
  return h ? dlsym(h, name) : NULL;
}

void *ji_resolve(int id) {
  const char *name = ji_names[id];
  void *p = NULL;
  if (ji_libs[id] == JI_NCCL) {
    /* Forward to the PMPI-style pnccl* entry points so that a second tool
     * interposing nccl* (or NCCL's own weak alias) cannot loop back into us. */
    char pname[64];
    snprintf(pname, sizeof pname, "p%s", name);
    p = ji_sym_in_lib(JI_NCCL, pname);
  }
  if (!p) p = ji_sym_in_lib(ji_libs[id], name);
  if (p) atomic_store_explicit(&ji_real_fns[id], p, memory_order_relaxed);
  return p;
}

/* ---- public counter API ---- */
JI_API int jitintercept_counter_count(void) { return JI_N_SYMS; }

JI_API const char *jitintercept_counter_name(int i) {
  return (i >= 0 && i < JI_N_SYMS) ? ji_names[i] : NULL;
}

JI_API int64_t jitintercept_counter(const char *name) {
  if (!name) return -1;
  for (int i = 0; i < JI_N_SYMS; i++)
    if (strcmp(ji_names[i], name) == 0)
      return (int64_t)counter_sum(i);
  return -1;
}

JI_API int jitintercept_dump_counters(const char *path) {
  FILE *f = (path && *path) ? fopen(path, "w") : stderr;
  if (!f) return -errno;
  fputc('{', f);
  for (int i = 0; i < JI_N_SYMS; i++)
    fprintf(f, "%s\"%s\": %" PRIu64, i ? ", " : "", ji_names[i],
            counter_sum(i));
  fputs("}\n", f);
  if (f != stderr) return fclose(f) == 0 ? 0 : -errno;
  fflush(f);
  return 0;
}

JI_API int jitintercept_loaded(void) { return 1; }

JI_API int64_t jitintercept_stat(const char *name) {
  static const char *const names[JI_ST_N] = {"redirected_memcpy", "triggers", "gil_signals", "gil_released",
                                             "watched", "completed", "replay_overflows_total"};
  for (int i = 0; name && i < JI_ST_N; i++)
    if (!strcmp(names[i], name)) return (int64_t)atomic_load(&ji_stats[i]);
  return -1;
}

JI_API void jitintercept_log_suspend(int on) { ji_tls.log_off = on; }

/* JITCKPT_COUNTERS_DUMP: counters written at exit, so a program that knows
 * nothing about the shim (the real-libcudart test) can still be inspected. */
__attribute__((destructor)) static void ji_fini(void) {
  const char *p = ji_getenv("JITCKPT_COUNTERS_DUMP");
  if (p) jitintercept_dump_counters(p);
}
