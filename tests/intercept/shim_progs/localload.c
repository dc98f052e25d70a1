/* localload LIB - dlopen(LIB, RTLD_LOCAL) and run local_run(); prints the
 * result and the shim's counters for the calls made inside the library. */
#include "common.h"

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "%s\n", dlerror());
    return 3;
  }
  int (*run)(void) = (int (*)(void))dlsym(h, "local_run");
  int rc = run ? run() : 99;
  printf("LOCAL rc=%d record=%lld query=%lld malloc=%lld stream=%lld\n", rc,
         (long long)counter("cudaEventRecord"), (long long)counter("cudaEventQuery"),
         (long long)counter("cudaMalloc"), (long long)counter("cudaStreamCreateWithFlags"));
  return rc;
}
