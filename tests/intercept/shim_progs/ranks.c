/*
 * ranks - one rank of a PyTorch-like job on the stand-in runtime.
 *   ranks MODE RANK NRANKS DIR
 * MODE train:    ITERS iterations of: fill kernel on the compute stream,
 *                event -> NCCL stream waits -> grouped async all-reduce ->
 *                event on the NCCL stream -> compute stream waits (Fig. 3);
 *                every SYNC_EVERY-th iteration also a synchronous all-reduce
 *                on the compute stream. JITTER_US: random host delay before
 *                each collective. Progress goes to DIR/progress.RANK.
 * MODE initonly: joins the communicator, then sleeps (a peer that will never
 *                enter a collective).
 * MODE redirect: rank 0 registers a C hang handler, blocks its stream behind
 *                a collective the peer never joins, and the handler copies
 *                device memory out (cudaMemcpy and cudaMemcpyAsync+sync on
 *                the blocked stream) while the trigger runs.
 */
#include "common.h"

#include <signal.h>

#define N 1024

/* PAUSE_ON_ERROR=1: a failing CUDA/NCCL call in the training loop parks the
 * rank instead of exiting, like a framework that leaves error handling to
 * its watchdog. */
#define NCK(x)                                                \
  do {                                                        \
    int nrc_ = (int)(x);                                      \
    if (nrc_ != 0 && getenv("PAUSE_ON_ERROR"))                \
      for (;;) pause();                                       \
    CK(nrc_);                                                 \
  } while (0)

static void k_fill(void **args) {
  float *buf = *(float **)args[0];
  int n = *(int *)args[1];
  float v = *(float *)args[2];
  for (int i = 0; i < n; i++) buf[i] = v * (float)(i % 7 + 1);
}
static const size_t k_fill_sizes[3] = {sizeof(float *), sizeof(int), sizeof(float)};

static void progress(const char *dir, int rank, long it) {
  char p[4096], b[64];
  snprintf(p, sizeof p, "%s/progress.%d", dir, rank);
  int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  int n = snprintf(b, sizeof b, "%ld\n", it);
  if (write(fd, b, (size_t)n) < 0) {}
  close(fd);
}

static float *g_host, *g_dev;
static cudaStream_t g_stream;

static void redirect_handler(const char *json, void *user) {
  (void)user;
  double t0 = now_s();
  float *out = calloc(N, sizeof(float));
  /* 1: plain cudaMemcpy: the legacy stream waits on the hung blocking stream. */
  int r1 = cudaMemcpy(out, g_dev, N * sizeof(float), cudaMemcpyDeviceToHost);
  int ok1 = r1 == 0 && memcmp(out, g_host, N * sizeof(float)) == 0;
  memset(out, 0, N * sizeof(float));
  /* 2: async copy on the blocked stream, then a sync of that stream. */
  int r2 = cudaMemcpyAsync(out, g_dev, N * sizeof(float), cudaMemcpyDeviceToHost, g_stream);
  int r3 = cudaStreamSynchronize(g_stream);
  int ok2 = r2 == 0 && r3 == 0 && memcmp(out, g_host, N * sizeof(float)) == 0;
  int64_t (*stat)(const char *) = shim_jitintercept_stat();
  printf("HANDLER event=%s\nREDIRECT ok1=%d ok2=%d redirected=%lld took=%.3f\n", json, ok1, ok2,
         stat ? (long long)stat("redirected_memcpy") : -1LL, now_s() - t0);
  fflush(stdout);
  _exit(ok1 && ok2 ? 0 : 5);
}

int main(int argc, char **argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: ranks MODE RANK NRANKS DIR\n");
    return 2;
  }
  const char *mode = argv[1];
  int rank = atoi(argv[2]), nranks = atoi(argv[3]);
  const char *dir = argv[4];
  char idpath[4096];
  snprintf(idpath, sizeof idpath, "%s/nccl.id", dir);
  srand((unsigned)(rank * 7919 + getpid()));
  CK(jitsimRegisterKernel((const void *)k_fill, 3, k_fill_sizes));

  ncclUniqueId id;
  exchange_id(&id, rank, idpath);
  ncclComm_t comm;
  CK(ncclCommInitRank(&comm, nranks, id, rank));

  if (!strcmp(mode, "initonly")) {
    progress(dir, rank, 0);
    for (;;) pause();
  }

  if (!strcmp(mode, "redirect")) {
    void (*set)(void (*)(const char *, void *), void *) = shim_jitintercept_set_handler();
    if (!set) return 6;
    set(redirect_handler, NULL);
    g_host = malloc(N * sizeof(float));
    for (int i = 0; i < N; i++) g_host[i] = (float)i * 0.5f + 3.0f;
    CK(cudaStreamCreate(&g_stream)); /* blocking: the legacy stream waits for it */
    float *coll;
    CK(cudaMalloc((void **)&g_dev, N * sizeof(float)));
    CK(cudaMalloc((void **)&coll, N * sizeof(float)));
    CK(cudaMemcpy(g_dev, g_host, N * sizeof(float), cudaMemcpyHostToDevice));
    CK(ncclAllReduce(coll, coll, N, ncclFloat, ncclSum, comm, g_stream));
    progress(dir, rank, 1);
    cudaStreamSynchronize(g_stream); /* never returns: the peer never joins */
    fprintf(stderr, "rank %d: sync returned\n", rank);
    return 7;
  }

  long iters = getenv("ITERS") ? atol(getenv("ITERS")) : 100;
  long jitter = getenv("JITTER_US") ? atol(getenv("JITTER_US")) : 0;
  long sync_every = getenv("SYNC_EVERY") ? atol(getenv("SYNC_EVERY")) : 4;
  cudaStream_t cs, ns;
  CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&ns, cudaStreamNonBlocking));
  cudaEvent_t ev_c, ev_n;
  CK(cudaEventCreateWithFlags(&ev_c, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&ev_n, cudaEventDisableTiming));
  float *buf, *host = malloc(N * sizeof(float));
  CK(cudaMalloc((void **)&buf, N * sizeof(float)));
  int n = N;
  double t0 = now_s();
  for (long it = 1; it <= iters; it++) {
    float v = (float)(it % 13 + rank);
    void *args[3] = {&buf, &n, &v};
    NCK(cudaLaunchKernel((const void *)k_fill, ONE, ONE, args, 0, cs));
    if (jitter) usleep((useconds_t)(rand() % (jitter + 1)));
    NCK(cudaEventRecordWithFlags(ev_c, cs, 0));
    NCK(cudaStreamWaitEvent(ns, ev_c, 0));
    NCK(ncclGroupStart());
    NCK(ncclAllReduce(buf, buf, N, ncclFloat, ncclSum, comm, ns));
    NCK(ncclGroupEnd());
    NCK(cudaEventRecord(ev_n, ns));
    NCK(cudaStreamWaitEvent(cs, ev_n, 0));
    if (sync_every && it % sync_every == 0) {
      NCK(ncclAllReduce(buf, buf, N, ncclFloat, ncclSum, comm, cs));
    }
    if (it % 2 == 0 || it == iters) NCK(cudaStreamSynchronize(cs));
    if (it % 50 == 0 || it == iters) {
      NCK(cudaMemcpyAsync(host, buf, N * sizeof(float), cudaMemcpyDeviceToHost, cs));
      NCK(cudaStreamSynchronize(cs));
      /* As PyTorch does: an aborted collective completes on the stream with
       * the communicator's async error set and its buffer undefined, so the
       * error is checked before the values. */
      ncclResult_t aerr_ = ncclSuccess;
      NCK(ncclCommGetAsyncError(comm, &aerr_));
      NCK(aerr_);
      /* sum over ranks of (it%13 + r), times nranks again if the sync all-reduce ran */
      float s = 0;
      for (int r = 0; r < nranks; r++) s += (float)(it % 13 + r);
      if (sync_every && it % sync_every == 0) s *= (float)nranks;
      for (int i = 0; i < N; i++)
        if (host[i] != s * (float)(i % 7 + 1)) {
          fprintf(stderr, "rank %d it %ld: bad value %f != %f\n", rank, it, host[i], s * (float)(i % 7 + 1));
          return 8;
        }
      progress(dir, rank, it);
    }
  }
  int64_t (*stat)(const char *) = shim_jitintercept_stat();
  printf("DONE rank=%d iters=%ld secs=%.3f record=%lld wait=%lld allreduce=%lld watched=%lld completed=%lld "
         "triggers=%lld\n",
         rank, iters, now_s() - t0, (long long)counter("cudaEventRecord"), (long long)counter("cudaStreamWaitEvent"),
         (long long)counter("ncclAllReduce"), stat ? (long long)stat("watched") : -1LL,
         stat ? (long long)stat("completed") : -1LL, stat ? (long long)stat("triggers") : -1LL);
  CK(ncclCommDestroy(comm));
  CK(cudaEventDestroy(ev_c));
  CK(cudaEventDestroy(ev_n));
  CK(cudaStreamDestroy(cs));
  CK(cudaStreamDestroy(ns));
  CK(cudaFree(buf));
  free(host);
  return 0;
}
