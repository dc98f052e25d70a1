/* realcudart - linked against NVIDIA's libcudart.so.13 (no GPU here): prints
 * each hooked call's status. Run with and without the shim: the output must
 * be identical (errors pass through unchanged). */
#include "common.h"

static void dummy_kernel(void) {}

int main(void) {
  cudaStream_t s = NULL;
  cudaEvent_t e = NULL;
  void *p = NULL;
  char h[16] = {0};
  printf("cudaStreamCreate %d\n", cudaStreamCreate(&s));
  printf("cudaStreamCreateWithFlags %d\n", cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  printf("cudaEventCreate %d\n", cudaEventCreate(&e));
  printf("cudaEventCreateWithFlags %d\n", cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  printf("cudaMalloc %d\n", cudaMalloc(&p, 16));
  printf("cudaEventRecord %d\n", cudaEventRecord(e, s));
  printf("cudaEventQuery %d\n", cudaEventQuery(e));
  printf("cudaStreamWaitEvent %d\n", cudaStreamWaitEvent(s, e, 0));
  printf("cudaStreamSynchronize %d\n", cudaStreamSynchronize(s));
  printf("cudaDeviceSynchronize %d\n", cudaDeviceSynchronize());
  printf("cudaMemcpy %d\n", cudaMemcpy(h, h + 8, 8, cudaMemcpyHostToHost));
  void *args[1] = {NULL};
  printf("cudaLaunchKernel %d\n", cudaLaunchKernel((const void *)dummy_kernel, ONE, ONE, args, 0, s));
  printf("cudaFree %d\n", cudaFree(p));
  printf("cudaEventDestroy %d\n", cudaEventDestroy(e));
  printf("cudaStreamDestroy %d\n", cudaStreamDestroy(s));
  /* stderr, so stdout stays comparable with and without the shim */
  fprintf(stderr, "COUNTERS malloc=%lld record=%lld launch=%lld\n", (long long)counter("cudaMalloc"),
          (long long)counter("cudaEventRecord"), (long long)counter("cudaLaunchKernel"));
  return 0;
}
