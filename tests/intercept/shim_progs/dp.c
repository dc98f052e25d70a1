/*
 * dp - a data-parallel training loop on the stand-in, for in-place recovery.
 *   dp RANK NRANKS STEPS DIR      (RANK/NRANKS "-": from RANK/WORLD_SIZE, as under jitrun)
 * Per step: minibatch_begin; H2D input (pageable, async on the compute
 * stream); forward and gradient kernels; Fig. 3 all-reduce of the gradient
 * on an NCCL stream inside ncclGroupStart/End (NCCL op 2*step+1 of the
 * process); D2H of the loss and a host sync; optimizer_begin; a grad-norm
 * kernel and a synchronous all-reduce of the norm on the compute stream
 * (op 2*step+2, the optimizer phase, as clip_grad_norm does); the optimizer
 * kernel (momentum state M, parameters W); optimizer_end.
 * At the end the final W and M (device) are copied out and written to
 * DIR/final.RANK; prints "PID <pid>" at start and
 * "FINAL rank=<r> pid=<pid> dev=<fnv of W,M> host=<fnv of the losses seen>".
 * Env: DP_HOSTFN=1: a cudaLaunchHostFunc per step (host work on the stream,
 * which the replay cannot redo). DP_INIT_MS: start-up sleep before the first device call.
 * DP_FAULTS_FIRST_ATTEMPT=1: JITSIM_* faults only when
 * TORCHELASTIC_RESTART_COUNT is 0. DP_STEP_MS: host work (a sleep) at the start of each step, after
 * writing the step number to DIR/progress.RANK (default 0: neither).
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
static void k_grad(void **a) { /* g = 2 y x; loss = sum y^2 (pure: outputs only written) */
  float *g = *(float **)a[0], *loss = *(float **)a[3];
  const float *y = *(const float **)a[1], *x = *(const float **)a[2];
  int n = *(int *)a[4];
  double s = 0;
  for (int i = 0; i < n; i++) g[i] = 2.0f * y[i] * x[i], s += (double)y[i] * y[i];
  *loss = (float)s;
}
static const size_t k_grad_sizes[5] = {8, 8, 8, 8, sizeof(int)};
static void k_norm(void **a) { /* s = sum g^2 */
  float *s = *(float **)a[0];
  const float *g = *(const float **)a[1];
  int n = *(int *)a[2];
  double t = 0;
  for (int i = 0; i < n; i++) t += (double)g[i] * g[i];
  *s = (float)t;
}
static const size_t k_norm_sizes[3] = {8, 8, sizeof(int)};
static void host_noop(void *p) { (void)p; }
static float sqrtf_approx(float v) { /* no libm: a few Newton steps, deterministic */
  if (v <= 0) return 0;
  float x = v > 1 ? v / 2 : 1;
  for (int i = 0; i < 40; i++) x = 0.5f * (x + v / x);
  return x;
}
static void k_opt(void **a) { /* clipped momentum SGD: m = 0.9 m + g/(n*c); w -= lr m */
  float *w = *(float **)a[0], *m = *(float **)a[1];
  const float *g = *(const float **)a[2], *s = *(const float **)a[3];
  float lr = *(float *)a[4], nr = *(float *)a[5];
  int n = *(int *)a[6];
  float norm = sqrtf_approx(*s);
  float c = 1.0f + norm * 1e-6f; /* every bit of the reduced norm matters */
  for (int i = 0; i < n; i++) {
    m[i] = 0.9f * m[i] + g[i] / (nr * c);
    w[i] -= lr * m[i];
  }
}
static const size_t k_opt_sizes[7] = {8, 8, 8, 8, sizeof(float), sizeof(float), sizeof(int)};

int main(int argc, char **argv) {
  if (argc < 5) return 2;
  /* "-" for RANK/NRANKS: take them from the launcher's RANK/WORLD_SIZE. */
  int rank = strcmp(argv[1], "-") ? atoi(argv[1]) : atoi(getenv("RANK") ? getenv("RANK") : "0");
  int nranks = strcmp(argv[2], "-") ? atoi(argv[2]) : atoi(getenv("WORLD_SIZE") ? getenv("WORLD_SIZE") : "1");
  int steps = atoi(argv[3]);
  const char *dir = argv[4];
  int step_ms = getenv("DP_STEP_MS") ? atoi(getenv("DP_STEP_MS")) : 0;
  int hostfn = getenv("DP_HOSTFN") != NULL;
  /* DP_FAULTS_FIRST_ATTEMPT=1: the JITSIM_* faults apply to the launcher's
   * first attempt only (a restarted job must not hit them again). The
   * stand-in reads them lazily, so clearing them here is enough. */
  const char *att = getenv("TORCHELASTIC_RESTART_COUNT");
  if (getenv("DP_FAULTS_FIRST_ATTEMPT") && att && atoi(att) > 0) {
    unsetenv("JITSIM_HANG_AT");
    unsetenv("JITSIM_NCCL_ERROR_AT");
    unsetenv("JITSIM_STICKY_ERROR_AT");
  }
  printf("PID %d\n", (int)getpid());
  fflush(stdout);
  void (*mb_begin)(void) = shim_jitintercept_minibatch_begin();
  void (*opt_begin)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "jitintercept_optimizer_begin");
  void (*opt_end)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "jitintercept_optimizer_end");

  /* DP_INIT_MS: start-up work before the first device call (imports, data
   * preparation, model construction): what a restart pays again. */
  if (getenv("DP_INIT_MS")) usleep((useconds_t)atoi(getenv("DP_INIT_MS")) * 1000);
  CK(jitsimRegisterKernel((const void *)k_fwd, 5, k_fwd_sizes));
  CK(jitsimRegisterKernel((const void *)k_grad, 5, k_grad_sizes));
  CK(jitsimRegisterKernel((const void *)k_norm, 3, k_norm_sizes));
  CK(jitsimRegisterKernel((const void *)k_opt, 7, k_opt_sizes));
  char idpath[4096];
  /* One id file per launcher attempt: a restarted job must not read the last one. */
  const char *attempt = getenv("TORCHELASTIC_RESTART_COUNT");
  snprintf(idpath, sizeof idpath, "%s/nccl.id.%s", dir, attempt ? attempt : "0");
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
  float *W, *M, *X, *Y, *G, *L, *S;
  CK(cudaMalloc((void **)&W, N * 4));
  CK(cudaMalloc((void **)&M, N * 4));
  CK(cudaMalloc((void **)&X, N * 4));
  CK(cudaMalloc((void **)&Y, N * 4));
  CK(cudaMalloc((void **)&G, N * 4));
  CK(cudaMalloc((void **)&L, 4));
  CK(cudaMalloc((void **)&S, 4));
  static float hw[N], hx[N];
  for (int i = 0; i < N; i++) hw[i] = 0.001f * (float)(i % 97) + 0.5f;
  CK(cudaMemcpy(W, hw, sizeof hw, cudaMemcpyHostToDevice));
  CK(cudaMemset(M, 0, N * 4));
  CK(cudaDeviceSynchronize());

  int n = N;
  float b = 0.25f, lr = 0.01f, nr = (float)nranks;
  uint64_t host = 1469598103934665603ull;
  for (int step = 0; step < steps; step++) {
    if (mb_begin) mb_begin();
    if (step_ms) { /* host-side work at the start of the step (data loading) */
      char pp[4200];
      snprintf(pp, sizeof pp, "%s/progress.%d", dir, rank);
      FILE *pf = fopen(pp, "w");
      if (pf) fprintf(pf, "%d\n", step), fclose(pf);
      usleep((useconds_t)step_ms * 1000);
    }
    for (int i = 0; i < N; i++) hx[i] = (float)((i * 31 + step * 7 + rank * 3) % 101) * 0.01f;
    CK(cudaMemcpyAsync(X, hx, sizeof hx, cudaMemcpyHostToDevice, cs));
    void *fa[5] = {&Y, &W, &X, &b, &n};
    CK(cudaLaunchKernel((const void *)k_fwd, ONE, ONE, fa, 0, cs));
    void *ga[5] = {&G, &Y, &X, &L, &n};
    CK(cudaLaunchKernel((const void *)k_grad, ONE, ONE, ga, 0, cs));
    if (hostfn) CK(cudaLaunchHostFunc(cs, host_noop, NULL)); /* unreplayable: marks the log incomplete */
    CK(cudaEventRecord(e1, cs));
    CK(cudaStreamWaitEvent(ns, e1, 0));
    CK(ncclGroupStart());
    CK(ncclAllReduce(G, G, N, ncclFloat, ncclSum, comm, ns));
    CK(ncclGroupEnd());
    CK(cudaEventRecord(e2, ns));
    CK(cudaStreamWaitEvent(cs, e2, 0));
    float loss = -1;
    CK(cudaMemcpyAsync(&loss, L, 4, cudaMemcpyDeviceToHost, cs));
    CK(cudaStreamSynchronize(cs));
    host = fnv1a(&loss, 4, host);

    if (opt_begin) opt_begin();
    void *na[3] = {&S, &G, &n};
    CK(cudaLaunchKernel((const void *)k_norm, ONE, ONE, na, 0, cs));
    CK(ncclAllReduce(S, S, 1, ncclFloat, ncclSum, comm, cs));
    void *oa[7] = {&W, &M, &G, &S, &lr, &nr, &n};
    CK(cudaLaunchKernel((const void *)k_opt, ONE, ONE, oa, 0, cs));
    if (opt_end) opt_end();
  }
  CK(cudaStreamSynchronize(cs));
  static float out[2 * N];
  CK(cudaMemcpy(out, W, N * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(out + N, M, N * 4, cudaMemcpyDeviceToHost));
  char path[4200];
  snprintf(path, sizeof path, "%s/final.%d", dir, rank);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(out, sizeof out, 1, f) != 1 || fclose(f)) return 5;
  int64_t (*stat)(const char *) = shim_jitintercept_stat();
  uint64_t (*nrec)(void) = (uint64_t(*)(void))dlsym(RTLD_DEFAULT, "jitintercept_recoveries");
  printf("FINAL rank=%d pid=%d dev=%016llx host=%016llx recoveries=%llu triggers=%lld\n", rank, (int)getpid(),
         (unsigned long long)fnv1a(out, sizeof out, 1469598103934665603ull), (unsigned long long)host,
         (unsigned long long)(nrec ? nrec() : 0), (long long)(stat ? stat("triggers") : -1));
  fflush(stdout);
  CK(ncclCommDestroy(comm));
  return 0;
}
