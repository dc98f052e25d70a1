/*
 * bench - added cost of the shim per call, in ns, for cudaEventRecord,
 * cudaEventQuery and cudaStreamWaitEvent on the stand-in.
 *
 * Run under LD_PRELOAD: each repetition times one batch through the shim
 * (the normal symbols) and one batch calling the stand-in directly (the
 * library's own definitions, from dlsym on its handle, with the physical
 * handles), interleaved, so both see the same machine state; the report is
 * the median over repetitions of the per-call difference. The stand-in's
 * record/wait enqueue to a worker thread and are noisy on 2 cores, hence
 * many short paired batches. The replay log is armed and cleared every batch
 * (as per-minibatch step hooks would). Without the shim only direct timings
 * are printed.
 *
 * Workers held (the default; argv[2] "live" turns it off): while a record or
 * wait batch is timed, every stand-in stream worker sits in a host function
 * that waits on a semaphore, so the calls only append to the queues, as a
 * real runtime's record appends to a push buffer. Live, each append also
 * wakes idle workers (a futex wake, charged to the caller) and contends with
 * them for the stand-in's one lock; how often depends on how the longer path
 * through the shim phases against the workers, and that interplay, not the
 * shim's own instructions, dominates the difference (perf: two thirds of the
 * samples in the kernel's wake-up path, ~1.5 % in the shim).
 */
#include "common.h"

#include <semaphore.h>
#include <stdatomic.h>

#define BATCH 5000
#define MAXR 2000

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static double med(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp);
  return v[n / 2];
}

typedef cudaError_t (*rec_fn)(cudaEvent_t, cudaStream_t);
typedef cudaError_t (*qry_fn)(cudaEvent_t);
typedef cudaError_t (*wai_fn)(cudaStream_t, cudaEvent_t, unsigned);
typedef cudaError_t (*host_fn)(cudaStream_t, cudaHostFn_t, void *);

/* The held-workers gate: every stream's worker blocks in gate_fn until
 * gate_open posts it; gate_close returns once all of them are inside. */
#define NHELD 3
static sem_t g_release;
static atomic_int g_inside;
static int g_hold = 1;
static host_fn g_launch;
static int g_batches, g_held_through; /* timed batches; those every worker sat out */
static cudaStream_t g_held[NHELD];

static void gate_fn(void *arg) {
  (void)arg;
  atomic_fetch_add(&g_inside, 1);
  while (sem_wait(&g_release) && errno == EINTR) {
  }
  atomic_fetch_sub(&g_inside, 1);
}
static void gate_close(void) {
  if (!g_hold) return;
  for (int i = 0; i < NHELD; i++) CK(g_launch(g_held[i], gate_fn, NULL));
  while (atomic_load(&g_inside) < NHELD) usleep(50);
}
static void gate_open(void) {
  g_batches++;
  if (atomic_load(&g_inside) == NHELD) g_held_through++;
  if (!g_hold) return;
  for (int i = 0; i < NHELD; i++) sem_post(&g_release);
  /* All out before the next close, or a late one would take its post. */
  while (atomic_load(&g_inside) > 0) usleep(50);
}

/* Thread CPU time: on a loaded 2-core machine wall time mostly measures
 * preemption and the stand-in worker's wake-ups, not the call path. */
static double cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}
#define now_s cpu_s

static double t_rec(rec_fn f, cudaEvent_t e, cudaStream_t s) {
  gate_close();
  double t0 = now_s();
  for (int i = 0; i < BATCH; i++) f(e, s);
  double t = (now_s() - t0) * 1e9 / BATCH;
  gate_open();
  CK(cudaStreamSynchronize(s));
  return t;
}
static double t_qry(qry_fn f, cudaEvent_t e) {
  double t0 = now_s();
  for (int i = 0; i < BATCH; i++) f(e);
  return (now_s() - t0) * 1e9 / BATCH;
}
static double t_wai(wai_fn f, cudaStream_t s, cudaEvent_t e, cudaStream_t sync) {
  gate_close();
  double t0 = now_s();
  for (int i = 0; i < BATCH; i++) f(s, e, 0);
  double t = (now_s() - t0) * 1e9 / BATCH;
  gate_open();
  CK(cudaStreamSynchronize(sync));
  return t;
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 200;
  if (reps > MAXR) reps = MAXR;
  g_hold = !(argc > 2 && !strcmp(argv[2], "live"));
  cudaStream_t s, s2;
  cudaEvent_t e;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CK(cudaEventRecord(e, s));
  CK(cudaStreamSynchronize(s));
  void (*mb)(void) = shim_jitintercept_minibatch_begin();
  void *(*phys)(void *) = shim_jitintercept_physical();
  void *lib = dlopen("libcudart.so.13", RTLD_NOW | RTLD_NOLOAD);
  rec_fn d_rec = (rec_fn)dlsym(lib, "cudaEventRecord");
  qry_fn d_qry = (qry_fn)dlsym(lib, "cudaEventQuery");
  wai_fn d_wai = (wai_fn)dlsym(lib, "cudaStreamWaitEvent");
  cudaStream_t ps = phys ? phys(s) : s, ps2 = phys ? phys(s2) : s2;
  cudaEvent_t pe = phys ? phys(e) : e;
  /* The gates go straight to the stand-in so the shim's log never sees them. */
  g_launch = (host_fn)dlsym(lib, "cudaLaunchHostFunc");
  if (!lib || !d_rec || !d_qry || !d_wai || !g_launch) {
    fprintf(stderr, "bench: the stand-in's own symbols are not reachable\n");
    return 3;
  }
  sem_init(&g_release, 0, 0);
  g_held[0] = ps, g_held[1] = ps2, g_held[2] = cudaStreamLegacy;
  static double dr[MAXR], dq[MAXR], dw[MAXR], br[MAXR], bq[MAXR], bw[MAXR];
  for (int r = 0; r < reps; r++) {
    if (mb) mb();
    double a, b, c, d, f, g;
    if (r & 1) { /* alternate the order so neither side always runs first */
      a = t_rec(d_rec, pe, ps), b = t_rec(cudaEventRecord, e, s);
      c = t_qry(d_qry, pe), d = t_qry(cudaEventQuery, e);
      if (mb) mb();
      f = t_wai(d_wai, ps2, pe, s2), g = t_wai(cudaStreamWaitEvent, s2, e, s2);
    } else {
      b = t_rec(cudaEventRecord, e, s), a = t_rec(d_rec, pe, ps);
      d = t_qry(cudaEventQuery, e), c = t_qry(d_qry, pe);
      if (mb) mb();
      g = t_wai(cudaStreamWaitEvent, s2, e, s2), f = t_wai(d_wai, ps2, pe, s2);
    }
    br[r] = a, bq[r] = c, bw[r] = f;
    dr[r] = b - a, dq[r] = d - c, dw[r] = g - f;
  }
  printf("{\"shim\": %s, \"workers\": \"%s\", \"held_through\": [%d, %d], \"reps\": %d, \"batch\": %d, \"direct_ns\": {\"cudaEventRecord\": %.1f, "
         "\"cudaEventQuery\": %.1f, \"cudaStreamWaitEvent\": %.1f}, \"added_ns\": {\"cudaEventRecord\": %.1f, "
         "\"cudaEventQuery\": %.1f, \"cudaStreamWaitEvent\": %.1f}}\n",
         phys ? "true" : "false", g_hold ? "held" : "live", g_held_through, g_batches, reps, BATCH,
         med(br, reps), med(bq, reps), med(bw, reps), med(dr, reps),
         med(dq, reps), med(dw, reps));
  return 0;
}
