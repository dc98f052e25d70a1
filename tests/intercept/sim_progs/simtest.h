/* Helpers shared by the stand-in's test programs. */
#ifndef SIMTEST_H
#define SIMTEST_H
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_abi.h"

#define CHECK(cond, ...)                                              \
  do {                                                                \
    if (!(cond)) {                                                    \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                   \
      fprintf(stderr, "\n");                                          \
      exit(1);                                                        \
    }                                                                 \
  } while (0)

#define CUDA_OK(call)                                                            \
  do {                                                                           \
    cudaError_t e_ = (call);                                                     \
    CHECK(e_ == cudaSuccess, "%s -> %d (%s)", #call, (int)e_, cudaGetErrorName(e_)); \
  } while (0)

static inline double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static inline void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) && errno == EINTR) {
  }
}

static const dim3 ONE = {1, 1, 1};

/* Kernels follow the stand-in convention: void k(void **args). */

/* args: int ms, int *dst, int value -- sleeps, then stores value. */
static void k_sleep_store(void **a) {
  sleep_ms(*(int *)a[0]);
  __atomic_store_n(*(int **)a[1], *(int *)a[2], __ATOMIC_SEQ_CST);
}

/* args: const int *src, int *dst -- copies one int. */
static void k_copy_int(void **a) {
  __atomic_store_n(*(int **)a[1], __atomic_load_n(*(int **)a[0], __ATOMIC_SEQ_CST), __ATOMIC_SEQ_CST);
}

static inline void register_test_kernels(void) {
  size_t s3[] = {sizeof(int), sizeof(int *), sizeof(int)};
  size_t s2[] = {sizeof(int *), sizeof(int *)};
  CHECK(jitsimRegisterKernel((const void *)k_sleep_store, 3, s3) == 0, "register");
  CHECK(jitsimRegisterKernel((const void *)k_copy_int, 2, s2) == 0, "register");
}

static inline cudaError_t launch_sleep_store(cudaStream_t s, int ms, int *dst, int value) {
  void *args[] = {&ms, &dst, &value};
  return cudaLaunchKernel((const void *)k_sleep_store, ONE, ONE, args, 0, s);
}

static inline cudaError_t launch_copy_int(cudaStream_t s, const int *src, int *dst) {
  void *args[] = {&src, &dst};
  return cudaLaunchKernel((const void *)k_copy_int, ONE, ONE, args, 0, s);
}

#endif
