/*
 * vhandles - the application keeps its stream/event/communicator handles
 * while the shim re-creates the physical objects behind them.
 *   vhandles RANK NRANKS DIR
 * Prints "PHYS <stage> stream=<p> event=<p> comm=<p>" and "OK <stage>" after
 * each all-reduce round checks out, and "VH OK" at the end.
 */
#include "common.h"

#define N 256

static void round_trip(const char *stage, ncclComm_t comm, cudaStream_t cs, cudaStream_t ns, cudaEvent_t ev,
                       float *buf, int rank, int nranks, int salt) {
  static float h[N];
  for (int i = 0; i < N; i++) h[i] = (float)(rank + salt + i);
  CK(cudaMemcpyAsync(buf, h, sizeof h, cudaMemcpyHostToDevice, cs));
  CK(cudaEventRecord(ev, cs));
  CK(cudaStreamWaitEvent(ns, ev, 0));
  CK(ncclAllReduce(buf, buf, N, ncclFloat, ncclSum, comm, ns));
  CK(cudaEventRecord(ev, ns));
  CK(cudaStreamWaitEvent(cs, ev, 0));
  CK(cudaMemcpyAsync(h, buf, sizeof h, cudaMemcpyDeviceToHost, cs));
  CK(cudaStreamSynchronize(cs));
  for (int i = 0; i < N; i++) {
    float want = 0;
    for (int r = 0; r < nranks; r++) want += (float)(r + salt + i);
    if (h[i] != want) {
      fprintf(stderr, "%s: bad %f != %f\n", stage, h[i], want);
      exit(9);
    }
  }
  void *(*phys)(void *) = shim_jitintercept_physical();
  printf("PHYS %s stream=%p event=%p comm=%p\nOK %s\n", stage, phys(cs), phys(ev), phys(comm), stage);
  fflush(stdout);
}

int main(int argc, char **argv) {
  if (argc < 4) return 2;
  int rank = atoi(argv[1]), nranks = atoi(argv[2]);
  char idpath[4096], idpath2[4096];
  snprintf(idpath, sizeof idpath, "%s/nccl.id", argv[3]);
  snprintf(idpath2, sizeof idpath2, "%s/nccl2.id", argv[3]);
  if (!shim_jitintercept_physical()) return 6;
  ncclUniqueId id;
  exchange_id(&id, rank, idpath);
  ncclComm_t comm;
  CK(ncclCommInitRank(&comm, nranks, id, rank));
  cudaStream_t cs, ns;
  cudaEvent_t ev;
  CK(cudaStreamCreateWithPriority(&cs, cudaStreamNonBlocking, -1));
  CK(cudaStreamCreate(&ns));
  CK(cudaEventCreate(&ev));
  float *buf;
  CK(cudaMalloc((void **)&buf, N * sizeof(float)));
  void *(*phys)(void *) = shim_jitintercept_physical();
  if (phys(cs) == (void *)cs || phys(ev) == (void *)ev || phys(comm) == (void *)comm) {
    fprintf(stderr, "handles are not virtual (JITCKPT_VIRTUAL_HANDLES=all?)\n");
    return 10;
  }
  round_trip("initial", comm, cs, ns, ev, buf, rank, nranks, 1);

  void *old_s = phys(cs), *old_e = phys(ev), *old_c = phys(comm);
  int n = shim_jitintercept_recreate_handles()(1);
  if (n < 3 || phys(cs) == old_s || phys(ev) == old_e) {
    fprintf(stderr, "recreate_handles: n=%d\n", n);
    return 11;
  }
  unsigned flags = 99;
  int prio = 99;
  CK(cudaStreamGetFlags((cudaStream_t)phys(cs), &flags));
  CK(cudaStreamGetPriority((cudaStream_t)phys(cs), &prio));
  if (flags != cudaStreamNonBlocking || prio != -1) {
    fprintf(stderr, "stream re-created with flags=%u prio=%d\n", flags, prio);
    return 12;
  }
  round_trip("streams", comm, cs, ns, ev, buf, rank, nranks, 2);

  ncclUniqueId id2;
  exchange_id(&id2, rank, idpath2);
  CK(shim_jitintercept_comm_recreate()(comm, &id2));
  /* The old communicator was aborted (its address may be reused by the new
   * one), so a correct all-reduce through the same handle proves the swap. */
  (void)old_c;
  round_trip("comm", comm, cs, ns, ev, buf, rank, nranks, 3);
  CK(cudaEventDestroy(ev));
  if (cudaEventRecord(ev, cs) != cudaErrorInvalidResourceHandle) return 14; /* stale handle fails cleanly */
  CK(cudaStreamDestroy(cs));
  CK(ncclCommDestroy(comm));
  printf("VH OK\n");
  return 0;
}
