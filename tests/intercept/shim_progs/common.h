/* Helpers shared by the shim test programs (stand-in runtime, no GPU). */
#ifndef SHIM_PROGS_COMMON_H
#define SHIM_PROGS_COMMON_H
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"
#include "nccl_abi.h"

#define CK(x)                                                                  \
  do {                                                                         \
    int rc_ = (int)(x);                                                        \
    if (rc_ != 0) {                                                            \
      fprintf(stderr, "%s:%d: %s -> %d\n", __FILE__, __LINE__, #x, rc_);        \
      exit(3);                                                                 \
    }                                                                          \
  } while (0)

static inline double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Rank 0 publishes the unique id atomically (write + rename); others poll. */
static inline void exchange_id(ncclUniqueId *id, int rank, const char *path) {
  if (rank == 0) {
    CK(ncclGetUniqueId(id));
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(id, sizeof *id, 1, f) != 1 || fclose(f)) exit(4);
    if (rename(tmp, path)) exit(4);
    return;
  }
  for (int i = 0; i < 20000; i++) {
    FILE *f = fopen(path, "rb");
    if (f) {
      size_t n = fread(id, sizeof *id, 1, f);
      fclose(f);
      if (n == 1) return;
    }
    usleep(1000);
  }
  fprintf(stderr, "rank %d: no unique id at %s\n", rank, path);
  exit(4);
}

/* The shim's control API, if preloaded (these programs never link it). */
#define SHIM_FN(ret, name, params) \
  static inline ret (*shim_##name(void)) params { return (ret(*) params)dlsym(RTLD_DEFAULT, #name); }
SHIM_FN(int64_t, jitintercept_counter, (const char *))
SHIM_FN(void, jitintercept_minibatch_begin, (void))
SHIM_FN(int, jitintercept_replay, (void))
SHIM_FN(void, jitintercept_log_suspend, (int))
SHIM_FN(int, jitintercept_dump_replay_log, (const char *))
SHIM_FN(uint64_t, jitintercept_replay_records, (void))
SHIM_FN(uint64_t, jitintercept_replay_overflows, (void))
SHIM_FN(void *, jitintercept_physical, (void *))
SHIM_FN(int, jitintercept_recreate_handles, (int))
SHIM_FN(int, jitintercept_comm_recreate, (void *, const void *))
SHIM_FN(void, jitintercept_set_handler, (void (*)(const char *, void *), void *))
SHIM_FN(int64_t, jitintercept_stat, (const char *))

static inline int64_t counter(const char *name) {
  int64_t (*f)(const char *) = shim_jitintercept_counter();
  return f ? f(name) : -1;
}

static inline uint64_t fnv1a(const void *p, size_t n, uint64_t h) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

static const dim3 ONE = {1, 1, 1};
#endif
