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
 * "FINAL rank=<r> pid=<pid> dev=<fnv of W,M> host=<fnv of the losses seen> ... device=<device identity>".
 * Env: DP_HOSTFN=1: a cudaLaunchHostFunc per step (host work on the stream,
 * which the replay cannot redo). DP_INIT_MS: start-up sleep before the first device call.
 * DP_FAULTS_FIRST_ATTEMPT=1: JITSIM_* faults only when
 * TORCHELASTIC_RESTART_COUNT is 0. DP_STEP_MS: host work (a sleep) at the start of each step, after
 * writing the step number to DIR/progress.RANK (default 0: neither).
 * DP_GATE=<step>:<path>: at the start of that step, wait until <path> exists (a
 * test holds the job there until everything it needs is up).
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

/* The training state of one rank. dp.so (-DDP_LIB) exports the steps for a
 * Python worker that drives them through ctypes, with jitckpt's runtime
 * marking the phases (tests/intercept/test_python_over_shim.py). */
struct dp {
  int rank, nranks, n;
  ncclComm_t comm;
  cudaStream_t cs, ns;
  cudaEvent_t e1, e2;
  float *W, *M, *X, *Y, *G, *L, *S;
  float b, lr, nr;
  uint64_t host;
};
static struct dp D;
static float hw[N], hx[N];

int dp_setup(int rank, int nranks, const char *dir) {
  D.rank = rank, D.nranks = nranks, D.n = N;
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
  CK(ncclCommInitRank(&D.comm, nranks, id, rank));
  CK(cudaStreamCreateWithFlags(&D.cs, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&D.ns, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&D.e1, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&D.e2, cudaEventDisableTiming));
  CK(cudaMalloc((void **)&D.W, N * 4));
  CK(cudaMalloc((void **)&D.M, N * 4));
  CK(cudaMalloc((void **)&D.X, N * 4));
  CK(cudaMalloc((void **)&D.Y, N * 4));
  CK(cudaMalloc((void **)&D.G, N * 4));
  CK(cudaMalloc((void **)&D.L, 4));
  CK(cudaMalloc((void **)&D.S, 4));
  for (int i = 0; i < N; i++) hw[i] = 0.001f * (float)(i % 97) + 0.5f;
  CK(cudaMemcpy(D.W, hw, sizeof hw, cudaMemcpyHostToDevice));
  CK(cudaMemset(D.M, 0, N * 4));
  CK(cudaDeviceSynchronize());
  D.b = 0.25f, D.lr = 0.01f, D.nr = (float)nranks;
  D.host = 1469598103934665603ull;
  return 0;
}

/* Forward, gradient, the grouped all-reduce on the NCCL stream, the loss to the host. */
int dp_compute(int step, int hostfn) {
  for (int i = 0; i < N; i++) hx[i] = (float)((i * 31 + step * 7 + D.rank * 3) % 101) * 0.01f;
  CK(cudaMemcpyAsync(D.X, hx, sizeof hx, cudaMemcpyHostToDevice, D.cs));
  void *fa[5] = {&D.Y, &D.W, &D.X, &D.b, &D.n};
  CK(cudaLaunchKernel((const void *)k_fwd, ONE, ONE, fa, 0, D.cs));
  void *ga[5] = {&D.G, &D.Y, &D.X, &D.L, &D.n};
  CK(cudaLaunchKernel((const void *)k_grad, ONE, ONE, ga, 0, D.cs));
  if (hostfn) CK(cudaLaunchHostFunc(D.cs, host_noop, NULL)); /* unreplayable: marks the log incomplete */
  CK(cudaEventRecord(D.e1, D.cs));
  CK(cudaStreamWaitEvent(D.ns, D.e1, 0));
  CK(ncclGroupStart());
  CK(ncclAllReduce(D.G, D.G, N, ncclFloat, ncclSum, D.comm, D.ns));
  CK(ncclGroupEnd());
  CK(cudaEventRecord(D.e2, D.ns));
  CK(cudaStreamWaitEvent(D.cs, D.e2, 0));
  float loss = -1;
  CK(cudaMemcpyAsync(&loss, D.L, 4, cudaMemcpyDeviceToHost, D.cs));
  CK(cudaStreamSynchronize(D.cs));
  D.host = fnv1a(&loss, 4, D.host);
  return 0;
}

/* The optimizer phase: grad norm, its synchronous all-reduce, the update. */
int dp_optimizer(void) {
  void *na[3] = {&D.S, &D.G, &D.n};
  CK(cudaLaunchKernel((const void *)k_norm, ONE, ONE, na, 0, D.cs));
  CK(ncclAllReduce(D.S, D.S, 1, ncclFloat, ncclSum, D.comm, D.cs));
  void *oa[7] = {&D.W, &D.M, &D.G, &D.S, &D.lr, &D.nr, &D.n};
  CK(cudaLaunchKernel((const void *)k_opt, ONE, ONE, oa, 0, D.cs));
  return 0;
}

/* Writes W and M to DIR/final.RANK and prints the FINAL line. */
int dp_finish(const char *dir) {
  CK(cudaStreamSynchronize(D.cs));
  static float out[2 * N];
  CK(cudaMemcpy(out, D.W, N * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(out + N, D.M, N * 4, cudaMemcpyDeviceToHost));
  char path[4200];
  snprintf(path, sizeof path, "%s/final.%d", dir, D.rank);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(out, sizeof out, 1, f) != 1 || fclose(f)) return 5;
  int64_t (*stat)(const char *) = shim_jitintercept_stat();
  uint64_t (*nrec)(void) = (uint64_t(*)(void))dlsym(RTLD_DEFAULT, "jitintercept_recoveries");
  const char *(*uuid)(void) = (const char *(*)(void))dlsym(RTLD_DEFAULT, "jitsimDeviceUuid");
  printf("FINAL rank=%d pid=%d dev=%016llx host=%016llx recoveries=%llu triggers=%lld device=%s\n", D.rank,
         (int)getpid(), (unsigned long long)fnv1a(out, sizeof out, 1469598103934665603ull), (unsigned long long)D.host,
         (unsigned long long)(nrec ? nrec() : 0), (long long)(stat ? stat("triggers") : -1), uuid ? uuid() : "?");
  fflush(stdout);
  CK(ncclCommDestroy(D.comm));
  return 0;
}

#ifndef DP_LIB
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
    unsetenv("JITSIM_STICKY_COLL_AT");
  }
  printf("PID %d\n", (int)getpid());
  fflush(stdout);
  void (*mb_begin)(void) = shim_jitintercept_minibatch_begin();
  void (*opt_begin)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "jitintercept_optimizer_begin");
  void (*opt_end)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "jitintercept_optimizer_end");

  /* DP_INIT_MS: start-up work before the first device call (imports, data
   * preparation, model construction): what a restart pays again. */
  if (getenv("DP_INIT_MS")) usleep((useconds_t)atoi(getenv("DP_INIT_MS")) * 1000);
  dp_setup(rank, nranks, dir);
  for (int step = 0; step < steps; step++) {
    if (mb_begin) mb_begin();
    const char *gate = getenv("DP_GATE");
    if (gate && atoi(gate) == step && strchr(gate, ':'))
      while (access(strchr(gate, ':') + 1, F_OK)) usleep(10000);
    if (step_ms) { /* host-side work at the start of the step (data loading) */
      char pp[4200];
      snprintf(pp, sizeof pp, "%s/progress.%d", dir, rank);
      FILE *pf = fopen(pp, "w");
      if (pf) fprintf(pf, "%d\n", step), fclose(pf);
      usleep((useconds_t)step_ms * 1000);
    }
    dp_compute(step, hostfn);
    if (opt_begin) opt_begin();
    dp_optimizer();
    if (opt_end) opt_end();
  }
  return dp_finish(dir);
}
#endif
