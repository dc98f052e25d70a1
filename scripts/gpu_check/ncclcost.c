/*
 * ncclcost - added cost of the shim per ncclAllReduce, in ns (scripts/gpu_check.sh).
 *
 *   LD_PRELOAD=libjitintercept.so ncclcost [REPS]
 *
 * One rank, a communicator of its own (ncclCommInitRank, nranks 1), one float
 * summed in place on one stream. Each repetition times a batch of calls
 * through the normal symbol (the shim's, when preloaded) and a batch through
 * NCCL's own definition (dlsym on the loaded libnccl.so.2, with the physical
 * handles), in alternating order, with the stream drained between batches
 * (outside the timed part), so both enqueue onto the same idle stream. The
 * report is the median over repetitions of the per-call difference, in wall
 * time (an enqueue that waits for the device waits in wall time, not CPU).
 * Linked against whichever libnccl.so.2 and libcudart.so.13 the build names:
 * torch's own on a GPU machine, the CPU stand-in elsewhere.
 */
#include "common.h"

#define BATCH 200
#define MAXR 1000

typedef ncclResult_t (*ar_fn)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, cudaStream_t);

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static double med(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp);
  return v[n / 2];
}

static double timed(ar_fn f, float *buf, ncclComm_t comm, cudaStream_t s) {
  double t0 = now_s();
  for (int i = 0; i < BATCH; i++) CK(f(buf, buf, 1, ncclFloat32, ncclSum, comm, s));
  double t = (now_s() - t0) * 1e9 / BATCH;
  CK(cudaStreamSynchronize(s));
  return t;
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 100;
  if (reps < 1 || reps > MAXR) reps = MAXR;
  ncclUniqueId id;
  ncclComm_t comm;
  cudaStream_t s;
  float *buf;
  CK(cudaSetDevice(0));
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cudaMalloc((void **)&buf, sizeof *buf));
  CK(cudaMemset(buf, 0, sizeof *buf));
  CK(ncclGetUniqueId(&id));
  CK(ncclCommInitRank(&comm, 1, id, 0));
  void *(*phys)(void *) = shim_jitintercept_physical();
  void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
  ar_fn direct = lib ? (ar_fn)dlsym(lib, "ncclAllReduce") : NULL;
  if (!direct) {
    fprintf(stderr, "ncclcost: libnccl.so.2's own ncclAllReduce is not reachable\n");
    return 3;
  }
  ncclComm_t pcomm = phys ? phys(comm) : comm;
  cudaStream_t ps = phys ? phys(s) : s;
  timed(direct, buf, pcomm, ps), timed(ncclAllReduce, buf, comm, s); /* warm both paths */
  static double base[MAXR], added[MAXR];
  for (int r = 0; r < reps; r++) {
    double a, b;
    if (r & 1) {
      a = timed(direct, buf, pcomm, ps), b = timed(ncclAllReduce, buf, comm, s);
    } else {
      b = timed(ncclAllReduce, buf, comm, s), a = timed(direct, buf, pcomm, ps);
    }
    base[r] = a, added[r] = b - a;
  }
  float host = -1;
  CK(cudaMemcpy(&host, buf, sizeof host, cudaMemcpyDeviceToHost));
  CK(ncclCommDestroy(comm));
  printf("{\"shim\": %s, \"reps\": %d, \"batch\": %d, \"direct_ns\": {\"ncclAllReduce\": %.1f}, "
         "\"added_ns\": {\"ncclAllReduce\": %.1f}, \"result\": %g}\n",
         phys ? "true" : "false", reps, BATCH, med(base, reps), med(added, reps), host);
  return 0;
}
