/* Test library with a DT_NEEDED on libcudart.so.13, dlopen'ed RTLD_LOCAL by
 * sim_dlopen: the way PyTorch's extension modules pull in the runtime. */
#include "simtest.h"

__attribute__((visibility("default"))) int simdl_run(void) {
  register_test_kernels();
  int *flag;
  if (cudaMalloc((void **)&flag, sizeof(int))) return -1;
  *flag = 0;
  cudaStream_t s;
  if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)) return -2;
  cudaEvent_t ev;
  if (cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)) return -3;
  if (launch_sleep_store(s, 100, flag, 77)) return -4;
  if (cudaEventRecordWithFlags(ev, s, 0)) return -5;
  if (cudaEventQuery(ev) != cudaErrorNotReady) return -6;
  if (cudaEventSynchronize(ev)) return -7;
  int v = *flag;
  cudaEventDestroy(ev);
  cudaStreamDestroy(s);
  cudaFree(flag);
  return v;
}
