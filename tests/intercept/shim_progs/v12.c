/* v12 - linked against the stand-in libcudart.so.12: its references are
 * `cudaX@libcudart.so.12`; under the shim they must bind to the shim. */
#include "common.h"

int main(void) {
  cudaStream_t s;
  cudaEvent_t e;
  CK(cudaStreamCreate(&s));
  CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  for (int i = 0; i < 10; i++) CK(cudaEventRecord(e, s));
  CK(cudaStreamSynchronize(s));
  CK(cudaEventQuery(e));
  printf("V12 record=%lld query=%lld create=%lld\n", (long long)counter("cudaEventRecord"),
         (long long)counter("cudaEventQuery"), (long long)counter("cudaStreamCreate"));
  return 0;
}
