/*
 * replay - the paper's replay-log validation (§4.1) on the stand-in.
 *   replay RANK NRANKS DIR
 * One minibatch (H2D input, forward/backward kernels, Fig. 3 all-reduce of
 * the gradient, a D2H of the loss) is logged; the buffers are checksummed;
 * activations, gradients and the host input are scribbled over; the log is
 * replayed; the buffers must match the first checksum bit for bit.
 * Prints: SUMS before=<x> scribbled=<y> after=<z> rc=<replay rc> records=<n>
 */
#include "common.h"

#define N 4096

static void k_fwd(void **a) { /* y = w * x + b */
  float *y = *(float **)a[0];
  const float *w = *(const float **)a[1], *x = *(const float **)a[2];
  float b = *(float *)a[3];
  int n = *(int *)a[4];
  for (int i = 0; i < n; i++) y[i] = w[i] * x[i] + b;
}
static const size_t k_fwd_sizes[5] = {8, 8, 8, sizeof(float), sizeof(int)};
static void k_bwd(void **a) { /* g = 2 * y * x; loss = sum(y^2) */
  float *g = *(float **)a[0], *loss = *(float **)a[3];
  const float *y = *(const float **)a[1], *x = *(const float **)a[2];
  int n = *(int *)a[4];
  double s = 0;
  for (int i = 0; i < n; i++) g[i] = 2.0f * y[i] * x[i], s += (double)y[i] * y[i];
  *loss = (float)s;
}
static const size_t k_bwd_sizes[5] = {8, 8, 8, 8, sizeof(int)};

static float *W, *X, *Y, *G, *L;

static uint64_t sums(void) {
  void (*susp)(int) = shim_jitintercept_log_suspend();
  if (susp) susp(1);
  static float h[N];
  uint64_t s = 1469598103934665603ull;
  float *bufs[5] = {W, X, Y, G, L};
  size_t lens[5] = {N, N, N, N, 1};
  for (int i = 0; i < 5; i++) {
    CK(cudaMemcpy(h, bufs[i], lens[i] * sizeof(float), cudaMemcpyDeviceToHost));
    s = fnv1a(h, lens[i] * sizeof(float), s);
  }
  if (susp) susp(0);
  return s;
}

int main(int argc, char **argv) {
  if (argc < 4) return 2;
  int rank = atoi(argv[1]), nranks = atoi(argv[2]);
  char idpath[4096];
  snprintf(idpath, sizeof idpath, "%s/nccl.id", argv[3]);
  if (!shim_jitintercept_replay() || !shim_jitintercept_minibatch_begin()) {
    fprintf(stderr, "shim not preloaded\n");
    return 6;
  }
  CK(jitsimRegisterKernel((const void *)k_fwd, 5, k_fwd_sizes));
  CK(jitsimRegisterKernel((const void *)k_bwd, 5, k_bwd_sizes));
  ncclUniqueId id;
  exchange_id(&id, rank, idpath);
  ncclComm_t comm;
  CK(ncclCommInitRank(&comm, nranks, id, rank));
  cudaStream_t cs, ns;
  cudaEvent_t e1, e2;
  CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&ns, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&e1, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&e2, cudaEventDisableTiming));
  CK(cudaMalloc((void **)&W, N * 4));
  CK(cudaMalloc((void **)&X, N * 4));
  CK(cudaMalloc((void **)&Y, N * 4));
  CK(cudaMalloc((void **)&G, N * 4));
  CK(cudaMalloc((void **)&L, 4));
  static float hw[N], hx[N];
  for (int i = 0; i < N; i++) hw[i] = 0.001f * (float)(i % 97) + 0.5f;
  CK(cudaMemcpy(W, hw, sizeof hw, cudaMemcpyHostToDevice));

  int n = N;
  float b = 0.25f;
  float loss = 0;
  for (int step = 0; step < 2; step++) {
    shim_jitintercept_minibatch_begin()();
    for (int i = 0; i < N; i++) hx[i] = (float)((i * 31 + step * 7 + rank * 3) % 101) * 0.01f;
    /* pageable H2D, async on the compute stream, plus a Default-kind copy */
    CK(cudaMemcpyAsync(X, hx, sizeof hx, cudaMemcpyHostToDevice, cs));
    CK(cudaMemcpy(X + N / 2, hx + N / 2, sizeof hx / 2, cudaMemcpyDefault));
    void *fa[5] = {&Y, &W, &X, &b, &n};
    CK(cudaLaunchKernel((const void *)k_fwd, ONE, ONE, fa, 0, cs));
    cudaKernel_t kb;
    CK(__cudaGetKernel(&kb, (const void *)k_bwd));
    void *ba[5] = {&G, &Y, &X, &L, &n};
    CK(__cudaLaunchKernel(kb, ONE, ONE, ba, 0, cs));
    CK(cudaEventRecord(e1, cs));
    CK(cudaStreamWaitEvent(ns, e1, 0));
    CK(ncclGroupStart());
    CK(ncclAllReduce(G, G, N, ncclFloat, ncclSum, comm, ns));
    CK(ncclGroupEnd());
    CK(cudaEventRecord(e2, ns));
    CK(cudaStreamWaitEvent(cs, e2, 0));
    CK(cudaMemcpyAsync(&loss, L, 4, cudaMemcpyDeviceToHost, cs));
    CK(cudaStreamSynchronize(cs));
  }
  uint64_t before = sums();
  if (getenv("DUMP")) CK(shim_jitintercept_dump_replay_log()(getenv("DUMP")));

  /* Reset to "start of minibatch": parameters W are untouched by fwd/bwd;
   * everything else, and the host input, is garbage now. */
  void (*susp)(int) = shim_jitintercept_log_suspend();
  susp(1);
  static float junk[N];
  for (int i = 0; i < N; i++) junk[i] = -7.0f - (float)i;
  CK(cudaMemcpy(X, junk, sizeof junk, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(Y, junk, sizeof junk, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(G, junk, sizeof junk, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(L, junk, 4, cudaMemcpyHostToDevice));
  memcpy(hx, junk, sizeof hx);
  susp(0);
  uint64_t scribbled = sums();

  int rc = shim_jitintercept_replay()();
  uint64_t after = sums();
  printf("SUMS before=%016llx scribbled=%016llx after=%016llx rc=%d records=%llu overflows=%llu\n",
         (unsigned long long)before, (unsigned long long)scribbled, (unsigned long long)after, rc,
         (unsigned long long)shim_jitintercept_replay_records()(),
         (unsigned long long)shim_jitintercept_replay_overflows()());
  CK(ncclCommDestroy(comm));
  return 0;
}
