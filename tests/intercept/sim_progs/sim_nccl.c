/*
 * sim_nccl MODE RANK NRANKS DIR - one rank of a multi-process NCCL check.
 * Rank 0 creates the unique id and publishes it as a file in DIR; the other
 * ranks read it. Prints "PASS MODE" (plus mode-specific lines) or FAIL.
 */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>

#include "nccl_abi.h"
#include "simtest.h"

#define NCCL_OK(call)                                                                     \
  do {                                                                                    \
    ncclResult_t r_ = (call);                                                             \
    CHECK(r_ == ncclSuccess, "%s -> %d (%s) last: %s", #call, (int)r_, ncclGetErrorString(r_), \
          ncclGetLastError(NULL));                                                        \
  } while (0)

static int g_rank, g_n;
static const char *g_dir;

static void exchange_id(const char *tag, ncclUniqueId *id) {
  char path[512], tmp[520];
  snprintf(path, sizeof path, "%s/%s.id", g_dir, tag);
  if (g_rank == 0) {
    NCCL_OK(ncclGetUniqueId(id));
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    CHECK(f && fwrite(id, sizeof *id, 1, f) == 1 && fclose(f) == 0, "write id");
    CHECK(rename(tmp, path) == 0, "rename id");
    return;
  }
  for (int i = 0; i < 3000; i++) {
    FILE *f = fopen(path, "rb");
    if (f) {
      size_t k = fread(id, sizeof *id, 1, f);
      fclose(f);
      if (k == 1) return;
    }
    sleep_ms(10);
  }
  CHECK(0, "no id at %s", path);
}

static ncclComm_t init_comm(const char *tag) {
  ncclUniqueId id;
  exchange_id(tag, &id);
  ncclComm_t c;
  NCCL_OK(ncclCommInitRank(&c, g_n, id, g_rank));
  return c;
}

/* Deterministic, rank-dependent, non-trivial float input. */
static float fin(int r, size_t i) { return (float)(((i * 2654435761u + (size_t)r * 40503u) % 1000003u)) / 997.0f - 300.0f; }

static uint64_t fnv(const void *p, size_t n) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)p)[i]) * 1099511628211ull;
  return h;
}

static void mode_coll(void) {
  ncclComm_t comm = init_comm("coll");
  int cnt, rk;
  NCCL_OK(ncclCommCount(comm, &cnt));
  NCCL_OK(ncclCommUserRank(comm, &rk));
  CHECK(cnt == g_n && rk == g_rank, "count/rank");
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  /* AllReduce float sum across several chunks (> 256 KiB), bit-identical. */
  size_t N = 150000;
  float *x, *y;
  CUDA_OK(cudaMalloc((void **)&x, N * sizeof(float)));
  CUDA_OK(cudaMalloc((void **)&y, N * sizeof(float)));
  for (size_t i = 0; i < N; i++) x[i] = fin(g_rank, i);
  NCCL_OK(ncclAllReduce(x, y, N, ncclFloat32, ncclSum, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  for (size_t i = 0; i < N; i += 997) {
    float e = fin(0, i);
    for (int r = 1; r < g_n; r++) e += fin(r, i); /* same order as the stand-in */
    CHECK(y[i] == e, "allreduce[%zu] %g != %g", i, y[i], e);
  }
  printf("allreduce_f32_hash %016llx\n", (unsigned long long)fnv(y, N * sizeof(float)));

  /* Every op over int32/int64/float64/uint8/int8, in place. */
  int32_t i32[5];
  int64_t i64[5];
  double f64[5];
  uint8_t u8[5];
  int8_t i8[5];
  const ncclRedOp_t ops[] = {ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg};
  for (int o = 0; o < 5; o++) {
    for (int i = 0; i < 5; i++) {
      i32[i] = g_rank + 1 + i;
      i64[i] = (int64_t)(g_rank + 1) * 1000 + i;
      f64[i] = 0.5 * (g_rank + 1) + i;
      u8[i] = (uint8_t)(g_rank + 2);
      i8[i] = (int8_t)(-(g_rank + 1));
    }
    NCCL_OK(ncclGroupStart());
    NCCL_OK(ncclAllReduce(i32, i32, 5, ncclInt32, ops[o], comm, s));
    NCCL_OK(ncclAllReduce(i64, i64, 5, ncclInt64, ops[o], comm, s));
    NCCL_OK(ncclGroupStart()); /* nesting */
    NCCL_OK(ncclAllReduce(f64, f64, 5, ncclFloat64, ops[o], comm, s));
    NCCL_OK(ncclAllReduce(u8, u8, 5, ncclUint8, ops[o], comm, s));
    NCCL_OK(ncclAllReduce(i8, i8, 5, ncclInt8, ops[o], comm, s));
    NCCL_OK(ncclGroupEnd());
    /* Nothing may start before the outermost ncclGroupEnd. */
    sleep_ms(20);
    CHECK(i32[0] == g_rank + 1, "group op started before outermost GroupEnd");
    NCCL_OK(ncclGroupEnd());
    CUDA_OK(cudaStreamSynchronize(s));
    int64_t e32 = 0, e64 = 0, eu8 = 0, ei8 = 0;
    double ef = 0;
    for (int r = 0; r < g_n; r++) {
      int64_t a = r + 1, b = (int64_t)(r + 1) * 1000, c = r + 2, d = -(r + 1);
      double f = 0.5 * (r + 1);
      if (r == 0) {
        e32 = a, e64 = b, eu8 = c, ei8 = d, ef = f;
        continue;
      }
      switch (ops[o]) {
        case ncclSum: case ncclAvg: e32 += a, e64 += b, eu8 += c, ei8 += d, ef += f; break;
        case ncclProd: e32 *= a, e64 *= b, eu8 *= c, ei8 *= d, ef *= f; break;
        case ncclMax: e32 = a > e32 ? a : e32, e64 = b > e64 ? b : e64, eu8 = c > eu8 ? c : eu8,
                      ei8 = d > ei8 ? d : ei8, ef = f > ef ? f : ef; break;
        default: e32 = a < e32 ? a : e32, e64 = b < e64 ? b : e64, eu8 = c < eu8 ? c : eu8,
                 ei8 = d < ei8 ? d : ei8, ef = f < ef ? f : ef; break;
      }
    }
    if (ops[o] == ncclAvg) e32 /= g_n, e64 /= g_n, eu8 = (uint8_t)eu8 / g_n, ei8 = (int8_t)ei8 / g_n, ef /= g_n;
    CHECK(i32[0] == (int32_t)e32, "op %d int32 %d != %lld", o, i32[0], (long long)e32);
    CHECK(i64[0] == e64, "op %d int64", o);
    CHECK(f64[0] == ef, "op %d f64 %g != %g", o, f64[0], ef);
    CHECK(u8[0] == (uint8_t)eu8, "op %d u8 %d != %d", o, u8[0], (int)(uint8_t)eu8);
    CHECK(i8[0] == (int8_t)ei8, "op %d i8 %d != %d", o, i8[0], (int)(int8_t)ei8);
  }

  /* Half-precision types: small integers are exact in both. */
  _Float16 h[3] = {(_Float16)(g_rank + 1), (_Float16)2, (_Float16)(-g_rank)};
  uint16_t bf[2];
  float f1 = (float)(g_rank + 1), f2 = 0.5f * (float)g_rank;
  uint32_t u1, u2;
  memcpy(&u1, &f1, 4);
  memcpy(&u2, &f2, 4);
  bf[0] = (uint16_t)(u1 >> 16);
  bf[1] = (uint16_t)(u2 >> 16);
  NCCL_OK(ncclAllReduce(h, h, 3, ncclFloat16, ncclSum, comm, s));
  NCCL_OK(ncclAllReduce(bf, bf, 2, ncclBfloat16, ncclMax, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK((float)h[0] == (float)(g_n * (g_n + 1) / 2) && (float)h[1] == 2.0f * g_n &&
            (float)h[2] == -(float)(g_n * (g_n - 1) / 2), "f16 sum");
  u1 = (uint32_t)bf[0] << 16;
  u2 = (uint32_t)bf[1] << 16;
  memcpy(&f1, &u1, 4);
  memcpy(&f2, &u2, 4);
  CHECK(f1 == (float)g_n && f2 == 0.5f * (float)(g_n - 1), "bf16 max %g %g", f1, f2);

  /* Broadcast from the last rank (out of place) and Bcast in place. */
  size_t B = 70000;
  int32_t *bs = calloc(B, 4), *br = calloc(B, 4);
  for (size_t i = 0; i < B; i++) bs[i] = (int32_t)(i * 7 + (size_t)g_rank);
  NCCL_OK(ncclBroadcast(bs, br, B, ncclInt32, g_n - 1, comm, s));
  NCCL_OK(ncclBcast(bs, B, ncclInt32, 0, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  for (size_t i = 0; i < B; i++) {
    CHECK(br[i] == (int32_t)(i * 7 + (size_t)(g_n - 1)), "broadcast[%zu]", i);
    CHECK(bs[i] == (int32_t)(i * 7), "bcast[%zu]", i);
  }

  /* Reduce to rank 1 % n. */
  int root = 1 % g_n;
  int64_t rv[3] = {g_rank, 2 * g_rank, 3}, ro[3] = {-1, -1, -1};
  NCCL_OK(ncclReduce(rv, ro, 3, ncclInt64, ncclSum, root, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  int64_t sr = (int64_t)g_n * (g_n - 1) / 2;
  if (g_rank == root)
    CHECK(ro[0] == sr && ro[1] == 2 * sr && ro[2] == 3 * g_n, "reduce");
  else
    CHECK(ro[0] == -1, "reduce must not write on non-root");

  /* AllGather (multi-chunk) and in-place AllGather. */
  size_t G = 40000;
  float *gs = malloc(G * 4), *gr = malloc(G * 4 * (size_t)g_n);
  for (size_t i = 0; i < G; i++) gs[i] = fin(g_rank, i);
  NCCL_OK(ncclAllGather(gs, gr, G, ncclFloat32, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  for (int r = 0; r < g_n; r++)
    for (size_t i = 0; i < G; i += 101) CHECK(gr[(size_t)r * G + i] == fin(r, i), "allgather r%d[%zu]", r, i);
  memset(gr, 0, G * 4 * (size_t)g_n);
  memcpy(gr + (size_t)g_rank * G, gs, G * 4);
  NCCL_OK(ncclAllGather(gr + (size_t)g_rank * G, gr, G, ncclFloat32, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  for (int r = 0; r < g_n; r++) CHECK(gr[(size_t)r * G + 5] == fin(r, 5), "allgather in place");

  /* ReduceScatter: rank r gets the sum of block r. */
  size_t R = 1000;
  int32_t *rs = malloc(R * 4 * (size_t)g_n), *rr = malloc(R * 4);
  for (size_t i = 0; i < R * (size_t)g_n; i++) rs[i] = (int32_t)(i + (size_t)g_rank);
  NCCL_OK(ncclReduceScatter(rs, rr, R, ncclInt32, ncclSum, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  for (size_t i = 0; i < R; i++) {
    int32_t e = 0;
    for (int r = 0; r < g_n; r++) e += (int32_t)((size_t)g_rank * R + i + (size_t)r);
    CHECK(rr[i] == e, "reducescatter[%zu] %d != %d", i, rr[i], e);
  }

  /* Send/Recv ring inside a group, larger than the pair buffer. */
  size_t P = 100000;
  int32_t *ps = malloc(P * 4), *pr = malloc(P * 4);
  for (size_t i = 0; i < P; i++) ps[i] = (int32_t)(i ^ (size_t)(g_rank * 131));
  int to = (g_rank + 1) % g_n, from = (g_rank + g_n - 1) % g_n;
  NCCL_OK(ncclGroupStart());
  NCCL_OK(ncclSend(ps, P, ncclInt32, to, comm, s));
  NCCL_OK(ncclRecv(pr, P, ncclInt32, from, comm, s));
  NCCL_OK(ncclGroupEnd());
  CUDA_OK(cudaStreamSynchronize(s));
  for (size_t i = 0; i < P; i++) CHECK(pr[i] == (int32_t)(i ^ (size_t)(from * 131)), "sendrecv[%zu]", i);

  /* Collectives ordered with kernels/events on the stream. */
  int *flag;
  CUDA_OK(cudaMalloc((void **)&flag, sizeof(int)));
  *flag = 0;
  register_test_kernels();
  int32_t one = 0;
  CUDA_OK(launch_sleep_store(s, 100, flag, 1));
  CUDA_OK(launch_copy_int(s, flag, &one)); /* one = 1 only after the kernel */
  NCCL_OK(ncclAllReduce(&one, &one, 1, ncclInt32, ncclSum, comm, s));
  cudaEvent_t ev;
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_OK(cudaEventRecord(ev, s));
  CUDA_OK(cudaEventSynchronize(ev));
  CHECK(one == g_n, "allreduce after kernel saw %d", one);

  NCCL_OK(ncclCommDestroy(comm));
  CUDA_OK(cudaStreamDestroy(s));
}

struct aborter {
  ncclComm_t comm;
  int delay_ms;
};
static void *abort_thread(void *p) {
  struct aborter *a = p;
  sleep_ms(a->delay_ms);
  NCCL_OK(ncclCommAbort(a->comm));
  return NULL;
}

static _Atomic int g_memcpy_done;
static void *memcpy_thread(void *p) {
  int src = 3, dst = 0;
  (void)p;
  CUDA_OK(cudaMemcpy(&dst, &src, sizeof dst, cudaMemcpyDeviceToHost));
  g_memcpy_done = 1;
  return NULL;
}

/* Issue an allreduce, record an event; the event must stay not-ready for
 * `hold_ms`, and so must a cudaMemcpy queued behind it on the legacy default
 * stream; then another thread aborts the communicator and everything moves
 * on. */
static void expect_blocked_then_abort(ncclComm_t comm, cudaStream_t s, int hold_ms) {
  float v = 1;
  ncclResult_t r = ncclAllReduce(&v, &v, 1, ncclFloat32, ncclSum, comm, s);
  CHECK(r == ncclSuccess, "allreduce issue %d", (int)r);
  cudaEvent_t ev;
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_OK(cudaEventRecord(ev, s));
  /* What ProcessGroupNCCL does: the compute stream waits for the collective. */
  CUDA_OK(cudaStreamWaitEvent(cudaStreamLegacy, ev, 0));
  pthread_t mc;
  CHECK(pthread_create(&mc, NULL, memcpy_thread, NULL) == 0, "thread");
  /* A rescue copy: fine on a non-blocking stream, stuck on a blocking one
   * (it queues behind the legacy stream, which waits for the collective). */
  static int src = 9, dst_nb, dst_b;
  cudaStream_t nb, bl;
  CUDA_OK(cudaStreamCreateWithFlags(&nb, cudaStreamNonBlocking));
  CUDA_OK(cudaStreamCreate(&bl));
  CUDA_OK(cudaMemcpyAsync(&dst_nb, &src, sizeof src, cudaMemcpyDeviceToHost, nb));
  CUDA_OK(cudaMemcpyAsync(&dst_b, &src, sizeof src, cudaMemcpyDeviceToHost, bl));
  CUDA_OK(cudaStreamSynchronize(nb));
  CHECK(dst_nb == 9, "non-blocking rescue copy");
  double t0 = now_s();
  while (now_s() - t0 < hold_ms / 1000.0) {
    CHECK(cudaEventQuery(ev) == cudaErrorNotReady, "collective must stay blocked");
    CHECK(!g_memcpy_done, "cudaMemcpy must block behind the hung collective");
    CHECK(cudaStreamQuery(bl) == cudaErrorNotReady, "blocking stream must queue behind legacy");
    sleep_ms(50);
  }
  printf("BLOCKED %.2fs\n", now_s() - t0);
  pthread_t th;
  struct aborter a = {comm, 0};
  CHECK(pthread_create(&th, NULL, abort_thread, &a) == 0, "thread");
  t0 = now_s();
  CUDA_OK(cudaEventSynchronize(ev));
  pthread_join(th, NULL);
  pthread_join(mc, NULL);
  CHECK(g_memcpy_done, "cudaMemcpy finished after the abort");
  CUDA_OK(cudaStreamSynchronize(bl));
  CHECK(dst_b == 9, "blocking-stream copy after the abort");
  CUDA_OK(cudaStreamDestroy(nb));
  CUDA_OK(cudaStreamDestroy(bl));
  /* The stream keeps working after the abort. */
  int *flag;
  CUDA_OK(cudaMalloc((void **)&flag, sizeof(int)));
  register_test_kernels();
  CUDA_OK(launch_sleep_store(s, 1, flag, 5));
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK(*flag == 5, "stream usable after abort");
  printf("UNBLOCKED %.2fs\n", now_s() - t0);
}

/* The last rank stops itself (SIGSTOP) after one good collective. */
static void mode_stop(void) {
  ncclComm_t comm = init_comm("stop");
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float v = 1;
  NCCL_OK(ncclAllReduce(&v, &v, 1, ncclFloat32, ncclSum, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK(v == (float)g_n, "first allreduce");
  if (g_rank == g_n - 1) {
    printf("STOPPING\n");
    raise(SIGSTOP);
    /* Resumed by the test only to be killed; nothing to check. */
    pause();
  }
  expect_blocked_then_abort(comm, s, 1200);
}

/* JITSIM_DEAD_PEER_ERROR=1: the last rank stops itself and the test kills
 * it; the survivors' collective then fails with ncclRemoteError on its own. */
static void mode_deadpeer(void) {
  ncclComm_t comm = init_comm("dead");
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float v = 1;
  NCCL_OK(ncclAllReduce(&v, &v, 1, ncclFloat32, ncclSum, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  if (g_rank == g_n - 1) {
    printf("STOPPING\n");
    raise(SIGSTOP);
    pause();
  }
  NCCL_OK(ncclAllReduce(&v, &v, 1, ncclFloat32, ncclSum, comm, s));
  cudaEvent_t ev;
  CUDA_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CUDA_OK(cudaEventRecord(ev, s));
  double t0 = now_s();
  while (cudaEventQuery(ev) == cudaErrorNotReady) {
    CHECK(now_s() - t0 < 20, "collective never failed");
    sleep_ms(20);
  }
  ncclResult_t ae;
  NCCL_OK(ncclCommGetAsyncError(comm, &ae));
  CHECK(ae == ncclRemoteError, "async error %d", (int)ae);
  CHECK(ncclAllReduce(&v, &v, 1, ncclFloat32, ncclSum, comm, s) == ncclRemoteError, "comm stays failed");
  printf("REMOTE ERROR after %.2fs: %s\n", now_s() - t0, ncclGetLastError(comm));
  NCCL_OK(ncclCommAbort(comm));
}

/* JITSIM_HANG_AT / JITSIM_HANG_RANK set by the test for all ranks. */
static void mode_hang(void) {
  ncclComm_t comm = init_comm("hang");
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float v = 1;
  NCCL_OK(ncclAllReduce(&v, &v, 1, ncclFloat32, ncclSum, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK(v == (float)g_n, "first allreduce");
  expect_blocked_then_abort(comm, s, 1200);
}

/* JITSIM_NCCL_ERROR_AT=2 set by the test on one rank only. */
static void mode_ncclerr(void) {
  ncclComm_t comm = init_comm("err1");
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  float v = 1;
  NCCL_OK(ncclAllReduce(&v, &v, 1, ncclFloat32, ncclSum, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  if (getenv("JITSIM_NCCL_ERROR_AT") && getenv("JITSIM_NCCL_ERROR_ASYNC")) {
    /* Asynchronous flavour: the call succeeds, the stream does not hang, the
     * error shows up in ncclCommGetAsyncError. */
    NCCL_OK(ncclAllReduce(&v, &v, 1, ncclFloat32, ncclSum, comm, s));
    CUDA_OK(cudaStreamSynchronize(s));
    ncclResult_t ae;
    NCCL_OK(ncclCommGetAsyncError(comm, &ae));
    CHECK(ae == ncclRemoteError, "async error %d", (int)ae);
    printf("ASYNC ERROR %d\n", (int)ae);
    NCCL_OK(ncclCommAbort(comm));
  } else if (getenv("JITSIM_NCCL_ERROR_AT")) {
    ncclResult_t r = ncclAllReduce(&v, &v, 1, ncclFloat32, ncclSum, comm, s);
    CHECK(r == ncclSystemError, "injected error: call returned %d", (int)r);
    ncclResult_t ae;
    NCCL_OK(ncclCommGetAsyncError(comm, &ae));
    CHECK(ae == ncclRemoteError, "async error %d", (int)ae);
    printf("ERROR %d ASYNC %d\n", (int)r, (int)ae);
    r = ncclAllReduce(&v, &v, 1, ncclFloat32, ncclSum, comm, s);
    CHECK(r == ncclRemoteError, "comm stays in error: %d", (int)r);
    NCCL_OK(ncclCommAbort(comm));
  } else {
    /* The peer never joins op 2: we see a hang, detect it, abort. */
    expect_blocked_then_abort(comm, s, 800);
  }
  /* Re-initialize with a fresh id: collectives work again. */
  comm = init_comm("err2");
  v = (float)(g_rank + 1);
  NCCL_OK(ncclAllReduce(&v, &v, 1, ncclFloat32, ncclSum, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK(v == (float)(g_n * (g_n + 1) / 2), "after re-init %g", v);
  ncclResult_t ae;
  NCCL_OK(ncclCommGetAsyncError(comm, &ae));
  CHECK(ae == ncclSuccess, "fresh comm healthy");
  printf("REINIT OK\n");
  NCCL_OK(ncclCommDestroy(comm));
}

/* JITSIM_STICKY_ERROR_AT=1 on every rank: after the context dies, NCCL
 * calls fail with ncclUnhandledCudaError (a 1-rank job is enough). */
static void mode_sticky(void) {
  ncclComm_t comm = init_comm("sticky");
  register_test_kernels();
  int *flag;
  CUDA_OK(cudaMalloc((void **)&flag, sizeof(int)));
  CHECK(launch_sleep_store(0, 1, flag, 1) == cudaErrorIllegalAddress, "injected fault");
  float v = 1;
  ncclResult_t r = ncclAllReduce(&v, &v, 1, ncclFloat32, ncclSum, comm, 0);
  CHECK(r == ncclUnhandledCudaError, "allreduce in dead context -> %d", (int)r);
  ncclResult_t ae;
  NCCL_OK(ncclCommGetAsyncError(comm, &ae));
  CHECK(ae == ncclUnhandledCudaError, "async %d", (int)ae);
  NCCL_OK(ncclCommAbort(comm));
}

static void mode_nonblocking(void) {
  ncclUniqueId id;
  exchange_id("nb", &id);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t comm;
  ncclResult_t r = ncclCommInitRankConfig(&comm, g_n, id, g_rank, &cfg);
  CHECK(r == ncclInProgress, "non-blocking init returns ncclInProgress, got %d", (int)r);
  ncclResult_t ae = ncclInProgress;
  double t0 = now_s();
  while (ae == ncclInProgress && now_s() - t0 < 20) {
    NCCL_OK(ncclCommGetAsyncError(comm, &ae));
    sleep_ms(5);
  }
  CHECK(ae == ncclSuccess, "init finished with %d", (int)ae);
  cudaStream_t s;
  CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int64_t v = g_rank;
  NCCL_OK(ncclAllReduce(&v, &v, 1, ncclInt64, ncclMax, comm, s));
  CUDA_OK(cudaStreamSynchronize(s));
  CHECK(v == g_n - 1, "max");

  /* Split: even/odd ranks, keys reversing the order. */
  ncclComm_t sub;
  NCCL_OK(ncclCommSplit(comm, g_rank % 2, -g_rank, &sub, NULL));
  int sn, sr;
  NCCL_OK(ncclCommCount(sub, &sn));
  NCCL_OK(ncclCommUserRank(sub, &sr));
  int members = 0, higher = 0;
  for (int r = 0; r < g_n; r++)
    if (r % 2 == g_rank % 2) members++, higher += r > g_rank;
  CHECK(sn == members && sr == higher, "split size %d rank %d", sn, sr);
  int32_t w = g_rank;
  NCCL_OK(ncclAllReduce(&w, &w, 1, ncclInt32, ncclSum, sub, s));
  CUDA_OK(cudaStreamSynchronize(s));
  int32_t e = 0;
  for (int r = g_rank % 2; r < g_n; r += 2) e += r;
  CHECK(w == e, "sub allreduce %d != %d", w, e);
  /* NOCOLOR: no communicator. */
  ncclComm_t none = (ncclComm_t)0x1;
  NCCL_OK(ncclCommSplit(comm, g_rank == 0 ? NCCL_SPLIT_NOCOLOR : 0, 0, &none, NULL));
  if (g_rank == 0) CHECK(none == NULL, "NOCOLOR gives NULL");
  if (none) NCCL_OK(ncclCommDestroy(none));
  NCCL_OK(ncclCommDestroy(sub));
  NCCL_OK(ncclCommDestroy(comm));
  int ver;
  NCCL_OK(ncclGetVersion(&ver));
  CHECK(ver == NCCL_VERSION_CODE, "version");
  CHECK(ncclGroupEnd() == ncclInvalidUsage, "unbalanced GroupEnd");
}

int main(int argc, char **argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: %s coll|stop|hang|ncclerr|nonblocking RANK NRANKS DIR\n", argv[0]);
    return 2;
  }
  setvbuf(stdout, NULL, _IONBF, 0);
  g_rank = atoi(argv[2]);
  g_n = atoi(argv[3]);
  g_dir = argv[4];
  const char *m = argv[1];
  if (!strcmp(m, "coll")) mode_coll();
  else if (!strcmp(m, "stop")) mode_stop();
  else if (!strcmp(m, "hang")) mode_hang();
  else if (!strcmp(m, "deadpeer")) mode_deadpeer();
  else if (!strcmp(m, "sticky")) mode_sticky();
  else if (!strcmp(m, "ncclerr")) mode_ncclerr();
  else if (!strcmp(m, "nonblocking")) mode_nonblocking();
  else {
    fprintf(stderr, "unknown mode %s\n", m);
    return 2;
  }
  printf("PASS %s\n", m);
  return 0;
}
