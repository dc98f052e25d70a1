/* liblocal.so - dlopen'ed RTLD_LOCAL by localload: its libcudart dependency is
 * then outside the global scope, where dlsym(RTLD_NEXT) cannot see it. */
#include "common.h"

int local_run(void) {
  cudaStream_t s;
  cudaEvent_t e;
  int *d, h[64], back[64];
  for (int i = 0; i < 64; i++) h[i] = i * i;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) return 1;
  if (cudaEventCreate(&e)) return 2;
  if (cudaMalloc((void **)&d, sizeof h)) return 3;
  if (cudaMemcpyAsync(d, h, sizeof h, cudaMemcpyHostToDevice, s)) return 4;
  if (cudaEventRecord(e, s)) return 5;
  if (cudaEventSynchronize(e)) return 6;
  if (cudaEventQuery(e)) return 7;
  if (cudaMemcpy(back, d, sizeof h, cudaMemcpyDeviceToHost)) return 8;
  if (memcmp(h, back, sizeof h)) return 9;
  if (cudaFree(d) || cudaEventDestroy(e) || cudaStreamDestroy(s)) return 10;
  return 0;
}
