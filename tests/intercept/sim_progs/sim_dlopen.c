/* sim_dlopen LIB - dlopen LIB with RTLD_LOCAL (it needs libcudart.so.13) and
 * run it. Checks the runtime's symbols stay out of the global scope, which is
 * why a shim cannot rely on dlsym(RTLD_NEXT/RTLD_DEFAULT) to find them. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char **argv) {
  if (argc < 2) return 2;
  void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    fprintf(stderr, "FAIL dlopen: %s\n", dlerror());
    return 1;
  }
  int (*run)(void) = (int (*)(void))dlsym(h, "simdl_run");
  if (!run) {
    fprintf(stderr, "FAIL no simdl_run\n");
    return 1;
  }
  int v = run();
  void *global = dlsym(RTLD_DEFAULT, "cudaLaunchKernel");
  void *rt = dlopen("libcudart.so.13", RTLD_NOW | RTLD_NOLOAD);
  printf("result %d global_cudaLaunchKernel %s loaded_cudart13 %s\n", v, global ? "yes" : "no",
         rt ? "yes" : "no");
  if (v != 77) {
    fprintf(stderr, "FAIL result %d\n", v);
    return 1;
  }
  printf("PASS dlopen\n");
  return 0;
}
