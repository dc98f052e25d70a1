/*
 * sim_cuda MODE - single-process checks of the stand-in CUDA runtime.
 * Prints "PASS MODE" and exits 0, or prints FAIL and exits 1.
 */
#include <pthread.h>

#include "simtest.h"

static void mode_order(void) {
  int *flag, *out;
  CUDA_OK(cudaMalloc((void **)&flag, sizeof(int)));
  CUDA_OK(cudaMalloc((void **)&out, sizeof(int)));
  *flag = 0;
  *out = -1;
  cudaStream_t a, b;
  CUDA_OK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  cudaEvent_t ev;
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  /* Never recorded: complete, like CUDA. */
  CUDA_OK(cudaEventQuery(ev));

  CUDA_OK(launch_sleep_store(a, 300, flag, 42));
  CUDA_OK(cudaEventRecord(ev, a));
  CHECK(cudaEventQuery(ev) == cudaErrorNotReady, "event before kernel end must be not ready");
  CHECK(cudaStreamQuery(a) == cudaErrorNotReady, "stream busy");
  /* NotReady is not an error: it must not become the last error. */
  CUDA_OK(cudaGetLastError());
  /* b waits for the event, so the copy sees 42. */
  CUDA_OK(cudaStreamWaitEvent(b, ev, 0));
  CUDA_OK(launch_copy_int(b, flag, out));
  CUDA_OK(cudaStreamSynchronize(b));
  CHECK(*out == 42, "wait-event ordering: got %d", *out);
  CUDA_OK(cudaEventQuery(ev));
  CUDA_OK(cudaStreamQuery(a));

  /* Re-recording does not release a wait enqueued for the earlier record. */
  cudaEvent_t gate;
  CUDA_OK(cudaEventCreateWithFlags(&gate, cudaEventDisableTiming));
  *flag = 0;
  *out = -1;
  CUDA_OK(launch_sleep_store(a, 300, flag, 7));
  CUDA_OK(cudaEventRecord(gate, a));
  CUDA_OK(cudaStreamWaitEvent(b, gate, 0));
  CUDA_OK(launch_copy_int(b, flag, out));
  cudaStream_t c;
  CUDA_OK(cudaStreamCreateWithFlags(&c, cudaStreamNonBlocking));
  CUDA_OK(cudaEventRecord(gate, c)); /* completes at once */
  CUDA_OK(cudaStreamSynchronize(b));
  CHECK(*out == 7, "wait must hold the earlier record: got %d", *out);

  /* Kernel arguments are copied at launch. */
  int v = 5;
  int *dst = out;
  void *args[] = {&(int){200}, &dst, &v};
  CUDA_OK(cudaLaunchKernel((const void *)k_sleep_store, ONE, ONE, args, 0, a));
  v = 99;
  dst = flag;
  CUDA_OK(cudaStreamSynchronize(a));
  CHECK(*out == 5, "args by value: got %d", *out);

  /* Timing. */
  cudaEvent_t t0, t1;
  CUDA_OK(cudaEventCreate(&t0));
  CUDA_OK(cudaEventCreate(&t1));
  float ms = -1;
  CHECK(cudaEventElapsedTime(&ms, t0, t1) == cudaErrorInvalidResourceHandle, "unrecorded elapsed");
  CUDA_OK(cudaEventRecord(t0, a));
  CUDA_OK(launch_sleep_store(a, 100, flag, 1));
  CUDA_OK(cudaEventRecordWithFlags(t1, a, cudaEventRecordDefault));
  CUDA_OK(cudaEventSynchronize(t1));
  CUDA_OK(cudaEventElapsedTime(&ms, t0, t1));
  CHECK(ms >= 90 && ms < 2000, "elapsed %f", ms);
  CHECK(cudaEventElapsedTime(&ms, ev, t1) == cudaErrorInvalidResourceHandle, "DisableTiming event");

  CUDA_OK(cudaEventDestroy(ev));
  CUDA_OK(cudaEventDestroy(gate));
  CUDA_OK(cudaEventDestroy(t0));
  CUDA_OK(cudaEventDestroy(t1));
  CUDA_OK(cudaStreamDestroy(a));
  CUDA_OK(cudaStreamDestroy(b));
  CUDA_OK(cudaStreamDestroy(c));
  CUDA_OK(cudaFree(flag));
  CUDA_OK(cudaFree(out));
}

static void mode_legacy(void) {
  /* Blocking stream work is waited for by the legacy default stream
   * (cudaMemcpy); a non-blocking stream's is not. */
  int *flag, host = -1;
  CUDA_OK(cudaMalloc((void **)&flag, sizeof(int)));
  *flag = 0;
  cudaStream_t blocking, nonblocking;
  CUDA_OK(cudaStreamCreate(&blocking));
  CUDA_OK(cudaStreamCreateWithFlags(&nonblocking, cudaStreamNonBlocking));
  unsigned fl = 9;
  CUDA_OK(cudaStreamGetFlags(nonblocking, &fl));
  CHECK(fl == cudaStreamNonBlocking, "flags %u", fl);

  CUDA_OK(launch_sleep_store(blocking, 300, flag, 11));
  CUDA_OK(cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost));
  CHECK(host == 11, "legacy stream must wait for blocking stream: %d", host);

  *flag = 0;
  CUDA_OK(launch_sleep_store(nonblocking, 500, flag, 12));
  double t = now_s();
  CUDA_OK(cudaMemcpy(&host, flag, sizeof(int), cudaMemcpyDeviceToHost));
  CHECK(host == 0, "legacy must not wait for non-blocking stream (%.2fs)", now_s() - t);
  CUDA_OK(cudaDeviceSynchronize());
  CHECK(*flag == 12, "device sync");

  /* Work on a blocking stream waits for earlier legacy-stream work. */
  int *out;
  CUDA_OK(cudaMalloc((void **)&out, sizeof(int)));
  *flag = 0;
  *out = -1;
  CUDA_OK(launch_sleep_store(0, 300, flag, 13));
  CUDA_OK(launch_copy_int(blocking, flag, out));
  CUDA_OK(cudaStreamSynchronize(blocking));
  CHECK(*out == 13, "blocking stream after legacy work: %d", *out);

  /* Memset/memcpyAsync ordering on a stream. */
  CUDA_OK(cudaMemsetAsync(out, 0, sizeof(int), nonblocking));
  CUDA_OK(cudaMemcpyAsync(&host, out, sizeof(int), cudaMemcpyDeviceToHost, nonblocking));
  CUDA_OK(cudaStreamSynchronize(nonblocking));
  CHECK(host == 0, "memset+memcpyAsync: %d", host);
  CHECK(cudaFree((void *)0x1234) == cudaErrorInvalidValue, "bad free");
  CHECK(cudaGetLastError() == cudaErrorInvalidValue, "last error");
  CUDA_OK(cudaGetLastError());
  CUDA_OK(cudaFree(flag));
  CUDA_OK(cudaFree(out));
}

static int *g_pt_flag;
static void *ptsz_thread(void *p) {
  (void)p;
  /* The per-thread default stream: kernel then copy through the _ptsz ABI. */
  int host = -1;
  void *args[] = {&(int){200}, &g_pt_flag, &(int){21}};
  CUDA_OK(cudaLaunchKernel_ptsz((const void *)k_sleep_store, ONE, ONE, args, 0, 0));
  CUDA_OK(cudaMemcpy_ptds(&host, g_pt_flag, sizeof(int), cudaMemcpyDeviceToHost));
  CHECK(host == 21, "ptds ordering %d", host);
  CUDA_OK(cudaStreamSynchronize_ptsz(0));
  return NULL;
}

static void mode_ptsz(void) {
  CUDA_OK(cudaMalloc((void **)&g_pt_flag, sizeof(int)));
  *g_pt_flag = 0;
  pthread_t th;
  CHECK(pthread_create(&th, NULL, ptsz_thread, NULL) == 0, "thread");
  pthread_join(th, NULL);
#ifdef SIM_CUDART12
  /* libcudart.so.12 has no __cudaLaunchKernel: use the public cudaGetKernel. */
  cudaKernel_t k;
  CUDA_OK(cudaGetKernel(&k, (const void *)k_sleep_store));
  int *dst = g_pt_flag;
  void *args[] = {&(int){1}, &dst, &(int){31}};
  CUDA_OK(cudaLaunchKernel((const void *)k, ONE, ONE, args, 0, cudaStreamPerThread));
  CUDA_OK(cudaStreamSynchronize(cudaStreamPerThread));
  CHECK(*g_pt_flag == 31, "cudaLaunchKernel");
  CHECK(cudaGetKernel(&k, (const void *)mode_ptsz) == cudaErrorInvalidDeviceFunction, "unregistered");
#else
  /* __cudaLaunchKernel path of CUDA 13 nvcc output. */
  cudaKernel_t k;
  CUDA_OK(__cudaGetKernel(&k, (const void *)k_sleep_store));
  int *dst = g_pt_flag;
  void *args[] = {&(int){1}, &dst, &(int){31}};
  CUDA_OK(__cudaLaunchKernel(k, ONE, ONE, args, 0, cudaStreamPerThread));
  CUDA_OK(cudaStreamSynchronize(cudaStreamPerThread));
  CHECK(*g_pt_flag == 31, "__cudaLaunchKernel");
  CHECK(__cudaGetKernel(&k, (const void *)mode_ptsz) == cudaErrorInvalidDeviceFunction, "unregistered");
#endif
  CHECK(cudaGetLastError() == cudaErrorInvalidDeviceFunction, "last error");
}

static void mode_params(void) {
  size_t off = 99, sz = 99;
  CUDA_OK(jitsimFuncGetParamInfo((const void *)k_sleep_store, 0, &off, &sz));
  CHECK(off == 0 && sz == sizeof(int), "p0 %zu %zu", off, sz);
  CUDA_OK(jitsimFuncGetParamInfo((const void *)k_sleep_store, 1, &off, &sz));
  CHECK(off == 8 && sz == sizeof(int *), "p1 %zu %zu", off, sz);
  CUDA_OK(jitsimFuncGetParamInfo((const void *)k_sleep_store, 2, &off, &sz));
  CHECK(off == 16 && sz == sizeof(int), "p2 %zu %zu", off, sz);
  CHECK(jitsimFuncGetParamInfo((const void *)k_sleep_store, 3, &off, &sz) == cudaErrorInvalidValue,
        "past last param");
  CHECK(jitsimFuncGetParamInfo((const void *)mode_params, 0, &off, &sz) == cudaErrorInvalidDeviceFunction,
        "unregistered");
  CHECK(cudaLaunchKernel((const void *)mode_params, ONE, ONE, NULL, 0, 0) == cudaErrorInvalidDeviceFunction,
        "launch unregistered");
  int v;
  #ifdef SIM_CUDART12
  CHECK(cudaRuntimeGetVersion(&v) == cudaSuccess && v == 12080, "runtime version %d", v);
#else
  CHECK(cudaRuntimeGetVersion(&v) == cudaSuccess && v == 13000, "runtime version %d", v);
#endif
  CHECK(strcmp(cudaGetErrorName(cudaErrorNotReady), "cudaErrorNotReady") == 0, "name");
  CHECK(strcmp(cudaGetErrorString(cudaErrorIllegalAddress), "an illegal memory access was encountered") == 0,
        "string");
}

static void mode_devices(void) {
  int n = -1;
  cudaError_t e = cudaGetDeviceCount(&n);
  printf("devices %d err %d\n", n, (int)e);
  if (e == cudaSuccess) {
    CUDA_OK(cudaSetDevice(n - 1));
    int d = -1;
    CUDA_OK(cudaGetDevice(&d));
    CHECK(d == n - 1, "device");
    CHECK(cudaSetDevice(n) == cudaErrorInvalidDevice, "bad device");
  }
}

/* Run with JITSIM_STICKY_ERROR_AT=3 (and optionally JITSIM_STICKY_ASYNC=1). */
static void mode_sticky(void) {
  int async = getenv("JITSIM_STICKY_ASYNC") != NULL;
  int *flag;
  CUDA_OK(cudaMalloc((void **)&flag, sizeof(int)));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CUDA_OK(launch_sleep_store(s, 1, flag, 1));
  CUDA_OK(launch_sleep_store(s, 1, flag, 2));
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK(*flag == 2, "first two kernels ran");
  cudaError_t e = launch_sleep_store(s, 1, flag, 3);
  if (async) {
    CHECK(e == cudaSuccess, "async: launch itself succeeds, got %d", (int)e);
    CHECK(cudaStreamSynchronize(s) == cudaErrorIllegalAddress, "async: sync reports the fault");
  } else {
    CHECK(e == cudaErrorIllegalAddress, "launch 3 -> %d", (int)e);
  }
  CHECK(*flag == 2, "faulting kernel must not run");
  void *p;
  CHECK(cudaMalloc(&p, 16) == cudaErrorIllegalAddress, "sticky malloc");
  CHECK(cudaStreamQuery(s) == cudaErrorIllegalAddress, "sticky query");
  cudaEvent_t ev;
  CHECK(cudaEventCreate(&ev) == cudaErrorIllegalAddress, "sticky event create");
  CHECK(cudaGetLastError() == cudaErrorIllegalAddress, "last error");
  CHECK(cudaGetLastError() == cudaErrorIllegalAddress, "sticky: not reset");
  CHECK(cudaDeviceSynchronize() == cudaErrorIllegalAddress, "device sync");
  CHECK(cudaMemcpy(&p, flag, 4, cudaMemcpyDeviceToHost) == cudaErrorIllegalAddress, "memcpy");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s order|legacy|ptsz|params|devices|sticky\n", argv[0]);
    return 2;
  }
  setvbuf(stdout, NULL, _IONBF, 0);
  register_test_kernels();
  const char *m = argv[1];
  if (!strcmp(m, "order")) mode_order();
  else if (!strcmp(m, "legacy")) mode_legacy();
  else if (!strcmp(m, "ptsz")) mode_ptsz();
  else if (!strcmp(m, "params")) mode_params();
  else if (!strcmp(m, "devices")) mode_devices();
  else if (!strcmp(m, "sticky")) mode_sticky();
  else {
    fprintf(stderr, "unknown mode %s\n", m);
    return 2;
  }
  printf("PASS %s\n", m);
  return 0;
}
