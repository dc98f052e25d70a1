/*
 * nccl.c - CPU stand-in for libnccl.so.2: communicators across processes over
 * POSIX shared memory, with collectives executed in stream order.
 *
 * Transport. ncclGetUniqueId names a shared-memory segment
 * (/jitsim-<job>-<pid>-<random>-<n>). Every rank maps it at init; once all
 * ranks are attached the name is unlinked, so a finished or crashed job
 * normally leaves nothing in /dev/shm (see README for what can remain).
 *
 * Collectives run as "rounds": in round s every rank may put up to CHUNK
 * bytes into its own slot, publishes posted[rank] = s, waits until all ranks
 * posted s, reads what it needs from the slots, then publishes consumed = s.
 * A slot is rewritten only after every rank consumed the previous round.
 * Reductions always combine slot 0, 1, ..., n-1 in that order on every rank,
 * so results are bit-identical across ranks and runs.
 *
 * Round numbers and point-to-point byte offsets are assigned when an
 * operation is *issued* (in program order, identical on every rank), not
 * when it executes: a rank never matches the wrong operation even when one
 * communicator is used from several streams.
 *
 * Waiting uses a process-shared futex word in the segment that every state
 * change bumps. There is no timeout: a missing peer (SIGKILL, SIGSTOP, an
 * injected hang) blocks the stream forever, like a GPU kernel spinning on a
 * dead peer. ncclCommAbort is the only way out.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <signal.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "nccl_abi.h"
#include "simcore.h"

#define API __attribute__((visibility("default")))
/* NCCL's PMPI-style naming: pncclX is the implementation, ncclX a weak alias. */
#define NCCL_ALIAS(name) __typeof__(p##name) name __attribute__((weak, alias("p" #name), visibility("default")));

#define MAX_RANKS 64
#define CHUNK ((size_t)256 * 1024)   /* per-rank slot, bytes */
#define P2P_CAP ((size_t)128 * 1024) /* per ordered pair ring, bytes */
#define ID_MAGIC "JITSIMv1"
#define COMM_MAGIC 0x6a69636dU

struct id_blob {
  char magic[8];
  char name[NCCL_UNIQUE_ID_BYTES - 8];
};
_Static_assert(sizeof(struct id_blob) == sizeof(ncclUniqueId), "id layout");

struct shm_hdr {
  _Atomic uint32_t futex;
  _Atomic uint32_t nranks;
  _Atomic uint32_t attached;
  uint32_t pad_;
  _Atomic int32_t pids[MAX_RANKS];
  _Atomic uint64_t posted[MAX_RANKS];
  _Atomic uint64_t consumed[MAX_RANKS];
  _Atomic uint64_t split_posted[MAX_RANKS];
  _Atomic uint64_t split_consumed[MAX_RANKS];
  _Atomic int32_t split_color[MAX_RANKS];
  _Atomic int32_t split_key[MAX_RANKS];
};

struct ring {
  _Atomic uint64_t head; /* bytes written by the sender */
  char pad1[56];
  _Atomic uint64_t tail; /* bytes read by the receiver */
  char pad2[56];
};

#define HDR_BYTES (((sizeof(struct shm_hdr)) + 4095) & ~(size_t)4095)
#define RING_BYTES (sizeof(struct ring) + P2P_CAP)

enum { INIT_PENDING = 0, INIT_READY = 1, INIT_FAILED = 2 };

struct ncclComm {
  uint32_t magic;
  int rank, nranks;
  char name[sizeof(((struct id_blob *)0)->name)];
  struct shm_hdr *hdr;
  char *slots, *rings;
  size_t map_size;
  _Atomic int aborted;
  _Atomic int async_err;
  _Atomic int init_state;
  pthread_mutex_t mu; /* guards everything below */
  pthread_cond_t cv;
  int refs;     /* user handle + queued operations */
  int inflight; /* operations executing right now */
  uint64_t issue_step;
  uint64_t send_off[MAX_RANKS], recv_off[MAX_RANKS];
  uint64_t nsplits;
  int detect_dead;                 /* JITSIM_DEAD_PEER_ERROR */
  char reason[128];                /* why async_err was set, for messages */
  _Atomic uint64_t last_peer_check;
};

/* ---- errors ---- */

/* Process-wide, like NCCL's ncclLastError (it may be set on a stream's
 * worker thread and read on the caller's). */
static char g_last_error[256];
static pthread_mutex_t g_err_mu = PTHREAD_MUTEX_INITIALIZER;

static void set_last_error(const char *fmt, va_list ap) {
  pthread_mutex_lock(&g_err_mu);
  vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
  pthread_mutex_unlock(&g_err_mu);
}

static ncclResult_t fail(ncclResult_t r, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  set_last_error(fmt, ap);
  va_end(ap);
  return r;
}

/* The answer of the generated stubs (gen_stubs.sh; not exported: the map keeps only nccl*). */
ncclResult_t jitsim_nccl_unsupported(const char *name) {
  return fail(ncclInvalidUsage, "%s: not simulated by the CPU stand-in", name);
}

API const char *pncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclTimeout: return "NCCL operation timed out";
    default: return "unknown result code";
  }
}
NCCL_ALIAS(ncclGetErrorString)

API const char *pncclGetLastError(ncclComm_t comm) {
  (void)comm; /* like NCCL: one string for the process */
  return g_last_error;
}
NCCL_ALIAS(ncclGetLastError)

API ncclResult_t pncclGetVersion(int *version) {
  if (!version) return fail(ncclInvalidArgument, "ncclGetVersion: NULL version");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}
NCCL_ALIAS(ncclGetVersion)

/* ---- futex waiting on the shared segment ---- */

static void futex_wait(_Atomic uint32_t *addr, uint32_t val) {
  /* The timeout only bounds how long a wake-up can be missed; it is not an
   * operation timeout (callers loop forever). */
  struct timespec ts = {0, 200 * 1000 * 1000};
  syscall(SYS_futex, addr, FUTEX_WAIT, val, &ts, NULL, 0);
}

static void bump(struct ncclComm *c) {
  atomic_fetch_add(&c->hdr->futex, 1);
  syscall(SYS_futex, &c->hdr->futex, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Opt-in (JITSIM_DEAD_PEER_ERROR=1): a peer whose process no longer exists
 * fails the communicator with ncclRemoteError, the way NCCL's socket
 * transport reports a closed connection. Off by default: over NVLink/shared
 * memory a dead peer just hangs its partners. A stopped peer is never
 * "dead". Checked at most every 200 ms. */
static int peer_gone(struct ncclComm *c) {
  if (!c->detect_dead) return 0;
  if (atomic_load(&c->async_err) == ncclRemoteError) return 1;
  uint64_t now = jitsim_now_ns(), last = atomic_load(&c->last_peer_check);
  if (now - last < 200000000ull || !atomic_compare_exchange_strong(&c->last_peer_check, &last, now))
    return 0;
  for (int r = 0; r < c->nranks; r++) {
    int32_t pid = atomic_load(&c->hdr->pids[r]);
    if (r == c->rank || pid <= 0) continue;
    if (kill((pid_t)pid, 0) && errno == ESRCH) {
      int ok = ncclSuccess;
      /* reason is written before async_err is published, read after. */
      if (atomic_load(&c->async_err) == ncclSuccess)
        snprintf(c->reason, sizeof c->reason, "rank %d (pid %d) is gone", r, (int)pid);
      atomic_compare_exchange_strong(&c->async_err, &ok, ncclRemoteError);
      fail(ncclRemoteError, "rank %d (pid %d) is gone", r, (int)pid);
      return 1;
    }
  }
  return 0;
}

/* Evaluates to 0 once cond holds, -1 if the communicator was aborted (or,
 * with JITSIM_DEAD_PEER_ERROR, a peer process vanished). */
#define WAIT_UNTIL(c, cond)                                  \
  ({                                                         \
    int r_ = 0;                                              \
    for (;;) {                                               \
      uint32_t f_ = atomic_load(&(c)->hdr->futex);           \
      if (cond) break;                                       \
      if (atomic_load(&(c)->aborted) || peer_gone(c)) {      \
        r_ = -1;                                             \
        break;                                               \
      }                                                      \
      futex_wait(&(c)->hdr->futex, f_);                      \
    }                                                        \
    r_;                                                      \
  })

static int all_ge(_Atomic uint64_t *a, int n, uint64_t v) {
  for (int i = 0; i < n; i++)
    if (atomic_load(&a[i]) < v) return 0;
  return 1;
}

/* ---- communicator lifetime ---- */

static size_t shm_bytes(int nranks) {
  return HDR_BYTES + (size_t)nranks * CHUNK + (size_t)nranks * (size_t)nranks * RING_BYTES;
}

static struct ring *ring_of(struct ncclComm *c, int src, int dst) {
  return (struct ring *)(c->rings + ((size_t)src * (size_t)c->nranks + (size_t)dst) * RING_BYTES);
}

static int comm_valid(const struct ncclComm *c) { return c && c->magic == COMM_MAGIC; }

static void comm_put(struct ncclComm *c) {
  pthread_mutex_lock(&c->mu);
  int last = --c->refs == 0;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  if (!last) return;
  if (atomic_load(&c->init_state) != INIT_READY) shm_unlink(c->name);
  if (c->hdr) munmap(c->hdr, c->map_size);
  c->magic = 0;
  pthread_cond_destroy(&c->cv);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

static struct ncclComm *comm_new(const char *name, int nranks, int rank) {
  struct ncclComm *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->magic = COMM_MAGIC;
  c->rank = rank;
  c->nranks = nranks;
  snprintf(c->name, sizeof c->name, "%s", name);
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  c->refs = 1;
  c->detect_dead = jitsim_env_long("JITSIM_DEAD_PEER_ERROR", 0) > 0;
  atomic_store(&c->async_err, ncclInProgress);
  return c;
}

static ncclResult_t comm_attach(struct ncclComm *c) {
  size_t sz = shm_bytes(c->nranks);
  int fd = shm_open(c->name, O_CREAT | O_RDWR, 0600);
  if (fd < 0) return fail(ncclSystemError, "shm_open(%s): %s", c->name, strerror(errno));
  struct stat st;
  /* Every rank sizes the segment; ftruncate to the same size is idempotent
   * and pages stay sparse until touched. */
  if (fstat(fd, &st) || ((size_t)st.st_size < sz && ftruncate(fd, (off_t)sz))) {
    int e = errno;
    close(fd);
    return fail(ncclSystemError, "sizing %s: %s", c->name, strerror(e));
  }
  void *m = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return fail(ncclSystemError, "mmap(%s): %s", c->name, strerror(errno));
  pthread_mutex_lock(&c->mu); /* ncclCommAbort may look at hdr from another thread */
  c->hdr = m;
  pthread_mutex_unlock(&c->mu);
  c->map_size = sz;
  c->slots = (char *)m + HDR_BYTES;
  c->rings = c->slots + (size_t)c->nranks * CHUNK;
  uint32_t zero = 0;
  if (!atomic_compare_exchange_strong(&c->hdr->nranks, &zero, (uint32_t)c->nranks) &&
      zero != (uint32_t)c->nranks)
    return fail(ncclInvalidArgument, "rank %d: nranks %d but peers use %u", c->rank, c->nranks, zero);
  int32_t none = 0;
  if (!atomic_compare_exchange_strong(&c->hdr->pids[c->rank], &none, (int32_t)getpid()))
    return fail(ncclInvalidUsage, "rank %d already joined by pid %d", c->rank, none);
  atomic_fetch_add(&c->hdr->attached, 1);
  bump(c);
  if (WAIT_UNTIL(c, atomic_load(&c->hdr->attached) >= (uint32_t)c->nranks))
    return fail(ncclSystemError, "communicator aborted during init");
  /* Everybody has it mapped: the name is no longer needed. */
  shm_unlink(c->name);
  return ncclSuccess;
}

static void comm_init_done(struct ncclComm *c, ncclResult_t r) {
  pthread_mutex_lock(&c->mu);
  atomic_store(&c->init_state, r == ncclSuccess ? INIT_READY : INIT_FAILED);
  atomic_store(&c->async_err, r);
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

static void *init_thread(void *p) {
  struct ncclComm *c = p;
  comm_init_done(c, comm_attach(c));
  comm_put(c);
  return NULL;
}

static int parse_id(const ncclUniqueId *id, char *name, size_t n) {
  const struct id_blob *b = (const void *)id;
  if (memcmp(b->magic, ID_MAGIC, 8) || b->name[0] != '/' || !memchr(b->name, 0, sizeof b->name))
    return -1;
  snprintf(name, n, "%s", b->name);
  return 0;
}

static ncclResult_t init_named(ncclComm_t *out, int nranks, const char *name, int rank, int blocking) {
  if (!out) return fail(ncclInvalidArgument, "comm is NULL");
  if (nranks < 1 || nranks > MAX_RANKS)
    return fail(ncclInvalidArgument, "nranks %d outside [1, %d]", nranks, MAX_RANKS);
  if (rank < 0 || rank >= nranks) return fail(ncclInvalidArgument, "rank %d outside [0, %d)", rank, nranks);
  struct ncclComm *c = comm_new(name, nranks, rank);
  if (!c) return fail(ncclSystemError, "out of memory");
  if (!blocking) {
    /* Like NCCL with config.blocking = 0: return at once, report progress
     * through ncclCommGetAsyncError. */
    c->refs++;
    pthread_t th;
    if (pthread_create(&th, NULL, init_thread, c)) {
      c->refs--;
      comm_put(c);
      return fail(ncclSystemError, "cannot start init thread");
    }
    pthread_detach(th);
    *out = c;
    return ncclInProgress;
  }
  ncclResult_t r = comm_attach(c);
  comm_init_done(c, r);
  if (r != ncclSuccess) {
    comm_put(c);
    return r;
  }
  *out = c;
  return ncclSuccess;
}

static void sanitize(char *dst, size_t n, const char *src) {
  size_t j = 0;
  for (; src && *src && j + 1 < n; src++)
    if ((*src >= 'a' && *src <= 'z') || (*src >= 'A' && *src <= 'Z') || (*src >= '0' && *src <= '9') ||
        *src == '_')
      dst[j++] = *src;
  dst[j] = 0;
}

API ncclResult_t pncclGetUniqueId(ncclUniqueId *uniqueId) {
  static _Atomic unsigned counter;
  if (!uniqueId) return fail(ncclInvalidArgument, "uniqueId is NULL");
  char job[32];
  sanitize(job, sizeof job, getenv("JITSIM_JOB"));
  uint32_t rnd = 0;
  if (getrandom(&rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) rnd = (uint32_t)jitsim_now_ns();
  struct id_blob b;
  memset(&b, 0, sizeof b);
  memcpy(b.magic, ID_MAGIC, 8);
  /* pid first after the job tag: jitsim-cleanup --stale reads it back. */
  snprintf(b.name, sizeof b.name, "/jitsim-%s-%d-%08x-%u", job[0] ? job : "j", (int)getpid(), rnd,
           atomic_fetch_add(&counter, 1));
  memcpy(uniqueId, &b, sizeof b);
  return ncclSuccess;
}
NCCL_ALIAS(ncclGetUniqueId)

API ncclResult_t pncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                         ncclConfig_t *config) {
  char name[sizeof(((struct id_blob *)0)->name)];
  if (parse_id(&commId, name, sizeof name)) return fail(ncclInvalidArgument, "not a jitsim unique id");
  int blocking = 1;
  /* Read only fields the caller's (possibly older) struct has. */
  if (config && config->size >= offsetof(ncclConfig_t, blocking) + sizeof(int) &&
      config->blocking != NCCL_CONFIG_UNDEF_INT)
    blocking = config->blocking != 0;
  return init_named(comm, nranks, name, rank, blocking);
}
NCCL_ALIAS(ncclCommInitRankConfig)

API ncclResult_t pncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  return pncclCommInitRankConfig(comm, nranks, commId, rank, NULL);
}
NCCL_ALIAS(ncclCommInitRank)

/* Operations still queued or running keep the communicator alive; this waits
 * for them, like NCCL's finalize (so it hangs on a hung collective: that is
 * what ncclCommAbort is for). */
static void comm_drain(struct ncclComm *c) {
  pthread_mutex_lock(&c->mu);
  while (c->refs > 1) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
}

API ncclResult_t pncclCommFinalize(ncclComm_t comm) {
  if (!comm_valid(comm)) return fail(ncclInvalidArgument, "invalid communicator");
  comm_drain(comm);
  return ncclSuccess;
}
NCCL_ALIAS(ncclCommFinalize)

API ncclResult_t pncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  if (!comm_valid(comm)) return fail(ncclInvalidArgument, "invalid communicator");
  comm_drain(comm);
  comm_put(comm);
  return ncclSuccess;
}
NCCL_ALIAS(ncclCommDestroy)

API ncclResult_t pncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  if (!comm_valid(comm)) return fail(ncclInvalidArgument, "invalid communicator");
  atomic_store(&comm->aborted, 1);
  pthread_mutex_lock(&comm->mu);
  if (comm->hdr) bump(comm); /* wake its waiters (peers just re-check) */
  pthread_cond_broadcast(&comm->cv);
  /* Return only once no operation of this communicator is still executing:
   * afterwards the streams it blocked make progress again. */
  while (comm->inflight > 0) pthread_cond_wait(&comm->cv, &comm->mu);
  pthread_mutex_unlock(&comm->mu);
  comm_put(comm);
  return ncclSuccess;
}
NCCL_ALIAS(ncclCommAbort)

API ncclResult_t pncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  if (!comm_valid(comm) || !asyncError) return fail(ncclInvalidArgument, "invalid argument");
  *asyncError = (ncclResult_t)atomic_load(&comm->async_err);
  return ncclSuccess;
}
NCCL_ALIAS(ncclCommGetAsyncError)

API ncclResult_t pncclCommCount(const ncclComm_t comm, int *count) {
  if (!comm_valid(comm) || !count) return fail(ncclInvalidArgument, "invalid argument");
  *count = comm->nranks;
  return ncclSuccess;
}
NCCL_ALIAS(ncclCommCount)

API ncclResult_t pncclCommCuDevice(const ncclComm_t comm, int *device) {
  if (!comm_valid(comm) || !device) return fail(ncclInvalidArgument, "invalid argument");
  *device = 0; /* the stand-in does not track which runtime device was current */
  return ncclSuccess;
}
NCCL_ALIAS(ncclCommCuDevice)

API ncclResult_t pncclCommUserRank(const ncclComm_t comm, int *rank) {
  if (!comm_valid(comm) || !rank) return fail(ncclInvalidArgument, "invalid argument");
  *rank = comm->rank;
  return ncclSuccess;
}
NCCL_ALIAS(ncclCommUserRank)

/* Buffer registration is an optimization in NCCL; here all memory is
 * reachable, so a handle is handed out and nothing else happens. */
API ncclResult_t pncclCommRegister(const ncclComm_t comm, void *buff, size_t size, void **handle) {
  (void)size;
  if (!comm_valid(comm) || !handle) return fail(ncclInvalidArgument, "invalid argument");
  *handle = buff ? buff : (void *)comm;
  return ncclSuccess;
}
NCCL_ALIAS(ncclCommRegister)

API ncclResult_t pncclCommDeregister(const ncclComm_t comm, void *handle) {
  if (!comm_valid(comm) || !handle) return fail(ncclInvalidArgument, "invalid argument");
  return ncclSuccess;
}
NCCL_ALIAS(ncclCommDeregister)

static int wait_ready(struct ncclComm *c) {
  pthread_mutex_lock(&c->mu);
  while (atomic_load(&c->init_state) == INIT_PENDING && !atomic_load(&c->aborted))
    pthread_cond_wait(&c->cv, &c->mu);
  int ok = atomic_load(&c->init_state) == INIT_READY && !atomic_load(&c->aborted);
  pthread_mutex_unlock(&c->mu);
  return ok;
}

API ncclResult_t pncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm,
                                ncclConfig_t *config) {
  (void)config; /* always completes before returning (allowed for blocking=0 too) */
  if (!comm_valid(comm) || !newcomm) return fail(ncclInvalidArgument, "invalid argument");
  if (color < NCCL_SPLIT_NOCOLOR) return fail(ncclInvalidArgument, "invalid color %d", color);
  if (!wait_ready(comm)) return fail(ncclInvalidUsage, "parent communicator not usable");
  int err = atomic_load(&comm->async_err);
  if (err != ncclSuccess) return fail((ncclResult_t)err, "parent communicator has an error");
  struct ncclComm *c = comm;
  struct shm_hdr *h = c->hdr;
  pthread_mutex_lock(&c->mu);
  uint64_t round = ++c->nsplits;
  pthread_mutex_unlock(&c->mu);
  int n = c->nranks, me = c->rank;
  if (WAIT_UNTIL(c, all_ge(h->split_consumed, n, round - 1)))
    return fail(ncclSystemError, "aborted during split");
  atomic_store(&h->split_color[me], color);
  atomic_store(&h->split_key[me], key);
  atomic_store(&h->split_posted[me], round);
  bump(c);
  if (WAIT_UNTIL(c, all_ge(h->split_posted, n, round)))
    return fail(ncclSystemError, "aborted during split");
  int newrank = 0, newn = 0;
  for (int r = 0; r < n; r++) {
    if (atomic_load(&h->split_color[r]) != color) continue;
    newn++;
    int k = atomic_load(&h->split_key[r]);
    if (k < key || (k == key && r < me)) newrank++;
  }
  atomic_store(&h->split_consumed[me], round);
  bump(c);
  if (color == NCCL_SPLIT_NOCOLOR) {
    *newcomm = NULL;
    return ncclSuccess;
  }
  char name[sizeof c->name];
  int len = snprintf(name, sizeof name, "%s-s%llu-%d", c->name, (unsigned long long)round, color);
  if (len < 0 || (size_t)len >= sizeof name) {
    /* Deeply nested splits: fold the parent name into a hash. */
    unsigned long long hsh = 1469598103934665603ull;
    for (const char *p = c->name; *p; p++) hsh = (hsh ^ (unsigned char)*p) * 1099511628211ull;
    snprintf(name, sizeof name, "/jitsim-x-%d-%016llx-s%llu-%d", (int)getpid(), hsh,
             (unsigned long long)round, color);
  }
  return init_named(newcomm, newn, name, newrank, 1);
}
NCCL_ALIAS(ncclCommSplit)

/* ---- reductions ---- */

static size_t dtype_size(ncclDataType_t t) {
  switch (t) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

static float bf16_to_f(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint16_t f_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1); /* round to nearest even */
  return (uint16_t)(u >> 16);
}

#define RED_LOOP(T, EXPR)                         \
  do {                                            \
    T *a_ = acc;                                  \
    const T *b_ = src;                            \
    for (size_t i = 0; i < n; i++) {              \
      T x = a_[i], y = b_[i];                     \
      a_[i] = (T)(EXPR);                          \
    }                                             \
  } while (0)

#define RED_TYPE(T)                                         \
  switch (op) {                                             \
    case ncclSum: case ncclAvg: RED_LOOP(T, x + y); break;  \
    case ncclProd: RED_LOOP(T, x * y); break;               \
    case ncclMax: RED_LOOP(T, x > y ? x : y); break;        \
    case ncclMin: RED_LOOP(T, x < y ? x : y); break;        \
    default: break;                                         \
  }

/* acc[i] = acc[i] (op) src[i] */
static void reduce_into(void *acc, const void *src, size_t n, ncclDataType_t t, ncclRedOp_t op) {
  switch (t) {
    case ncclInt8: RED_TYPE(int8_t); break;
    case ncclUint8: RED_TYPE(uint8_t); break;
    case ncclInt32: RED_TYPE(int32_t); break;
    case ncclUint32: RED_TYPE(uint32_t); break;
    case ncclInt64: RED_TYPE(int64_t); break;
    case ncclUint64: RED_TYPE(uint64_t); break;
    case ncclFloat32: RED_TYPE(float); break;
    case ncclFloat64: RED_TYPE(double); break;
#ifdef __FLT16_MAX__
    case ncclFloat16: RED_TYPE(_Float16); break;
#endif
    case ncclBfloat16: {
      uint16_t *a = acc;
      const uint16_t *b = src;
      for (size_t i = 0; i < n; i++) {
        float x = bf16_to_f(a[i]), y = bf16_to_f(b[i]), r;
        switch (op) {
          case ncclProd: r = x * y; break;
          case ncclMax: r = x > y ? x : y; break;
          case ncclMin: r = x < y ? x : y; break;
          default: r = x + y; break;
        }
        a[i] = f_to_bf16(r);
      }
      break;
    }
    default: break;
  }
}

#define AVG_LOOP(T)                                  \
  do {                                               \
    T *a_ = acc;                                     \
    for (size_t i = 0; i < n; i++) a_[i] = (T)(a_[i] / (T)nranks); \
  } while (0)

static void finish_avg(void *acc, size_t n, ncclDataType_t t, int nranks) {
  switch (t) {
    case ncclInt8: AVG_LOOP(int8_t); break;
    case ncclUint8: AVG_LOOP(uint8_t); break;
    case ncclInt32: AVG_LOOP(int32_t); break;
    case ncclUint32: AVG_LOOP(uint32_t); break;
    case ncclInt64: AVG_LOOP(int64_t); break;
    case ncclUint64: AVG_LOOP(uint64_t); break;
    case ncclFloat32: AVG_LOOP(float); break;
    case ncclFloat64: AVG_LOOP(double); break;
#ifdef __FLT16_MAX__
    case ncclFloat16: AVG_LOOP(_Float16); break;
#endif
    case ncclBfloat16: {
      uint16_t *a = acc;
      for (size_t i = 0; i < n; i++) a[i] = f_to_bf16(bf16_to_f(a[i]) / (float)nranks);
      break;
    }
    default: break;
  }
}

static int reducible(ncclDataType_t t, ncclRedOp_t op) {
  if ((int)op < 0 || op >= ncclNumOps) return 0;
  switch (t) {
    case ncclInt8: case ncclUint8: case ncclInt32: case ncclUint32: case ncclInt64:
    case ncclUint64: case ncclFloat32: case ncclFloat64: case ncclBfloat16:
      return 1;
#ifdef __FLT16_MAX__
    case ncclFloat16: return 1;
#endif
    default: return 0;
  }
}

/* ---- operations ---- */

enum { K_ALLREDUCE, K_BCAST, K_REDUCE, K_ALLGATHER, K_REDSCATTER, K_SEND, K_RECV };

struct item {
  int kind;
  struct ncclComm *comm;
  jitsim_stream *stream;
  const char *sbuf;
  char *rbuf;
  size_t count; /* elements; per rank for allgather/reducescatter */
  ncclDataType_t dtype;
  ncclRedOp_t op;
  int root; /* root or peer */
  uint64_t step0; /* first round number (collectives) */
  uint64_t rounds;
  uint64_t off;  /* p2p stream offset in bytes */
  size_t done;   /* p2p bytes moved so far */
  int hang;      /* fault injection: never contribute */
  int fail;      /* fault injection: fail asynchronously when run */
  int devfault;  /* fault injection: the device dies while running it (sticky error) */
  int flip;      /* fault injection: one bit of the received data arrives flipped */
};

static uint64_t nchunks(size_t bytes) { return (bytes + CHUNK - 1) / CHUNK; }

static uint64_t rounds_of(const struct item *it) {
  size_t es = dtype_size(it->dtype);
  switch (it->kind) {
    case K_REDSCATTER: return (uint64_t)it->comm->nranks * nchunks(it->count * es);
    case K_SEND: case K_RECV: return 0;
    default: return nchunks(it->count * es);
  }
}

/* One round: post (optional) own contribution, wait for all, read, release. */
static int round_begin(struct ncclComm *c, uint64_t s) {
  return WAIT_UNTIL(c, all_ge(c->hdr->consumed, c->nranks, s - 1));
}
static int round_exchange(struct ncclComm *c, uint64_t s) {
  atomic_store(&c->hdr->posted[c->rank], s);
  bump(c);
  return WAIT_UNTIL(c, all_ge(c->hdr->posted, c->nranks, s));
}
static void round_end(struct ncclComm *c, uint64_t s) {
  atomic_store(&c->hdr->consumed[c->rank], s);
  bump(c);
}

static int run_collective(struct item *it) {
  struct ncclComm *c = it->comm;
  int n = c->nranks, me = c->rank;
  size_t es = dtype_size(it->dtype);
  size_t per = CHUNK / es; /* elements per round */
  uint64_t s = it->step0;
  int targets = it->kind == K_REDSCATTER ? n : 1;
  size_t nch = (size_t)nchunks(it->count * es);
  for (int t = 0; t < targets; t++) {
    for (size_t ch = 0; ch < nch; ch++, s++) {
      size_t e0 = ch * per;
      size_t ne = it->count - e0 < per ? it->count - e0 : per;
      size_t off = e0 * es, nb = ne * es;
      char *mine = c->slots + (size_t)me * CHUNK;
      if (round_begin(c, s)) return -1;
      switch (it->kind) {
        case K_ALLREDUCE: case K_REDUCE: case K_ALLGATHER: memcpy(mine, it->sbuf + off, nb); break;
        case K_BCAST: if (me == it->root) memcpy(mine, it->sbuf + off, nb); break;
        case K_REDSCATTER: memcpy(mine, it->sbuf + ((size_t)t * it->count) * es + off, nb); break;
      }
      if (round_exchange(c, s)) return -1;
      switch (it->kind) {
        case K_ALLREDUCE: case K_REDUCE: case K_REDSCATTER: {
          int dest = it->kind == K_REDUCE ? it->root : it->kind == K_REDSCATTER ? t : me;
          if (dest != me) break;
          char *out = it->rbuf + off;
          memcpy(out, c->slots, nb);
          for (int r = 1; r < n; r++) reduce_into(out, c->slots + (size_t)r * CHUNK, ne, it->dtype, it->op);
          if (it->op == ncclAvg) finish_avg(out, ne, it->dtype, n);
          break;
        }
        case K_BCAST: memcpy(it->rbuf + off, c->slots + (size_t)it->root * CHUNK, nb); break;
        case K_ALLGATHER:
          for (int r = 0; r < n; r++)
            memcpy(it->rbuf + (size_t)r * it->count * es + off, c->slots + (size_t)r * CHUNK, nb);
          break;
      }
      round_end(c, s);
    }
  }
  return 0;
}

/* Moves what it can without blocking; returns bytes moved. */
static size_t p2p_progress(struct item *it) {
  struct ncclComm *c = it->comm;
  size_t total = it->count * dtype_size(it->dtype);
  if (it->done >= total) return 0;
  int send = it->kind == K_SEND;
  struct ring *r = send ? ring_of(c, c->rank, it->root) : ring_of(c, it->root, c->rank);
  char *data = (char *)(r + 1);
  uint64_t head = atomic_load(&r->head), tail = atomic_load(&r->tail);
  uint64_t pos = it->off + it->done;
  size_t k;
  if (send) {
    if (head != pos) return 0; /* an earlier send to this peer is not finished */
    uint64_t space = P2P_CAP - (head - tail);
    k = total - it->done < space ? total - it->done : (size_t)space;
  } else {
    if (tail != pos) return 0;
    uint64_t avail = head - tail;
    k = total - it->done < avail ? total - it->done : (size_t)avail;
  }
  size_t at = (size_t)(pos % P2P_CAP), first = k < P2P_CAP - at ? k : P2P_CAP - at;
  if (send) {
    memcpy(data + at, it->sbuf + it->done, first);
    memcpy(data, it->sbuf + it->done + first, k - first);
    atomic_store(&r->head, head + k);
  } else {
    memcpy(it->rbuf + it->done, data + at, first);
    memcpy(it->rbuf + it->done + first, data, k - first);
    atomic_store(&r->tail, tail + k);
    if (it->flip && k) { /* a transfer corrupted on the way, as a bad link or NIC would */
      it->rbuf[it->done] ^= 0x10;
      it->flip = 0;
    }
  }
  it->done += k;
  if (k) bump(c);
  return k;
}

static int item_dead(struct item *it) {
  return atomic_load(&it->comm->aborted) || atomic_load(&it->comm->async_err) != ncclSuccess;
}

static void mark_failed(struct ncclComm *c) {
  int ok = ncclSuccess;
  atomic_compare_exchange_strong(&c->async_err, &ok, ncclSystemError);
}

struct batch {
  int n;
  struct item *items;
};

static void batch_run(void *p) {
  struct batch *b = p;
  for (int i = 0; i < b->n; i++) {
    struct ncclComm *c = b->items[i].comm;
    pthread_mutex_lock(&c->mu);
    c->inflight++;
    pthread_mutex_unlock(&c->mu);
  }
  for (int i = 0; i < b->n; i++) {
    struct item *it = &b->items[i];
    if (it->kind == K_SEND || it->kind == K_RECV) continue;
    if (!wait_ready(it->comm) || item_dead(it)) continue;
    if (it->devfault) {
      /* Injected device loss inside NCCL's kernel: no contribution (the
       * peers hang), and the context is dead for every later call. */
      jitsim_set_sticky(cudaErrorIllegalAddress);
      continue;
    }
    if (it->fail) {
      /* Injected asynchronous failure (like a peer's connection dropping):
       * the operation ends without contributing, the stream moves on. */
      int ok = ncclSuccess;
      atomic_compare_exchange_strong(&it->comm->async_err, &ok, ncclRemoteError);
      continue;
    }
    if (it->hang) {
      /* Injected hang: this rank never contributes; only an abort ends it. */
      WAIT_UNTIL(it->comm, 0);
      mark_failed(it->comm);
      continue;
    }
    if (run_collective(it)) mark_failed(it->comm);
  }
  /* Point-to-point operations of a group progress together, so a group with
   * both a send to and a receive from the same peer cannot deadlock. */
  for (;;) {
    int pending = 0;
    size_t moved = 0;
    struct ncclComm *wc = NULL;
    uint32_t f = 0;
    for (int i = 0; i < b->n; i++) {
      struct item *it = &b->items[i];
      if (it->kind != K_SEND && it->kind != K_RECV) continue;
      if (!wait_ready(it->comm) || item_dead(it)) continue;
      if (it->fail) {
        int ok = ncclSuccess;
        atomic_compare_exchange_strong(&it->comm->async_err, &ok, ncclRemoteError);
        continue;
      }
      if (it->done >= it->count * dtype_size(it->dtype)) continue;
      if (!wc) {
        wc = it->comm;
        f = atomic_load(&wc->hdr->futex);
      }
      if (!it->hang) moved += p2p_progress(it);
      if (it->done < it->count * dtype_size(it->dtype)) pending++;
    }
    if (!pending) break;
    if (!moved) {
      /* Sleep on the first pending item's communicator; other communicators
       * in the group are re-polled at least every 200 ms. */
      if (atomic_load(&wc->aborted) || peer_gone(wc)) {
        mark_failed(wc);
        continue;
      }
      futex_wait(&wc->hdr->futex, f);
    }
  }
  for (int i = 0; i < b->n; i++) {
    struct ncclComm *c = b->items[i].comm;
    if (atomic_load(&c->aborted)) mark_failed(c);
    pthread_mutex_lock(&c->mu);
    c->inflight--;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
  }
}

static void batch_release(void *p) {
  struct batch *b = p;
  for (int i = 0; i < b->n; i++) comm_put(b->items[i].comm);
  free(b->items);
  free(b);
}

/* ---- groups and issue ---- */

static __thread int t_depth;
static __thread struct item *t_items;
static __thread int t_nitems, t_capitems;
static __thread ncclResult_t t_group_err;
static _Atomic long g_opcount;
static _Atomic long g_recvcount;

static ncclResult_t launch_items(struct item *items, int n) {
  ncclResult_t ret = ncclSuccess;
  /* One stream work item per distinct stream, keeping issue order. */
  char *taken = calloc((size_t)n + 1, 1);
  if (!taken) return fail(ncclSystemError, "out of memory");
  for (int i = 0; i < n; i++) {
    if (taken[i]) continue;
    struct batch *b = calloc(1, sizeof *b);
    int cnt = 0;
    for (int j = i; j < n; j++) cnt += !taken[j] && items[j].stream == items[i].stream;
    if (!b || !(b->items = calloc((size_t)cnt, sizeof *b->items))) {
      free(b);
      ret = fail(ncclSystemError, "out of memory");
      for (int j = i; j < n; j++)
        if (!taken[j] && items[j].stream == items[i].stream) taken[j] = 1, comm_put(items[j].comm);
      continue;
    }
    jitsim_stream *s = items[i].stream;
    for (int j = i; j < n; j++)
      if (!taken[j] && items[j].stream == s) {
        taken[j] = 1;
        b->items[b->n++] = items[j];
      }
    int e = jitsim_enqueue(s, batch_run, b, batch_release);
    if (e) ret = fail(ncclUnhandledCudaError, "enqueue on stream failed: cuda error %d", e);
  }
  free(taken);
  return ret;
}

static ncclResult_t issue(struct item it) {
  struct ncclComm *c = it.comm;
  if (!comm_valid(c)) return fail(ncclInvalidArgument, "invalid communicator");
  if (atomic_load(&c->aborted)) return fail(ncclInvalidUsage, "communicator was aborted");
  int cerr = jitsim_sticky();
  if (cerr) {
    /* NCCL's kernel launch fails in a dead CUDA context. */
    int ok = ncclSuccess;
    atomic_compare_exchange_strong(&c->async_err, &ok, ncclUnhandledCudaError);
    return fail(ncclUnhandledCudaError, "Cuda failure %d (sticky context error)", cerr);
  }
  int err = atomic_load(&c->async_err);
  if (err != ncclSuccess && err != ncclInProgress)
    return fail((ncclResult_t)err, "communicator has an asynchronous error: %s",
                c->reason[0] ? c->reason : pncclGetErrorString((ncclResult_t)err));
  size_t es = dtype_size(it.dtype);
  if (!es) return fail(ncclInvalidArgument, "invalid datatype %d", (int)it.dtype);
  int red = it.kind == K_ALLREDUCE || it.kind == K_REDUCE || it.kind == K_REDSCATTER;
  if (red && !reducible(it.dtype, it.op))
    return fail(ncclInvalidArgument, "reduction %d on datatype %d not supported", (int)it.op, (int)it.dtype);
  if ((it.kind == K_BCAST || it.kind == K_REDUCE || it.kind == K_SEND || it.kind == K_RECV) &&
      (it.root < 0 || it.root >= c->nranks))
    return fail(ncclInvalidArgument, "root/peer %d outside [0, %d)", it.root, c->nranks);
  if (it.count && ((it.kind != K_RECV && !it.sbuf && !(it.kind == K_BCAST && c->rank != it.root)) ||
                   (it.kind != K_SEND && !it.rbuf && !(it.kind == K_REDUCE && c->rank != it.root))))
    return fail(ncclInvalidArgument, "NULL buffer");

  /* Fault injection, counted per process over every operation issued. */
  long nth = atomic_fetch_add(&g_opcount, 1) + 1;
  long err_at = jitsim_env_long("JITSIM_NCCL_ERROR_AT", 0);
  if (err_at > 0 && nth == err_at && jitsim_env_long("JITSIM_NCCL_ERROR_ASYNC", 0)) {
    it.fail = 1; /* enqueued; fails on the stream, see batch_run */
  } else if (err_at > 0 && nth == err_at) {
    int ok = ncclSuccess;
    atomic_compare_exchange_strong(&c->async_err, &ok, ncclRemoteError);
    return fail(ncclSystemError, "injected NCCL error at operation %ld (JITSIM_NCCL_ERROR_AT)", nth);
  }
  long dev_at = jitsim_env_long("JITSIM_STICKY_COLL_AT", 0);
  it.devfault = dev_at > 0 && nth == dev_at;
  if (it.kind == K_RECV) {
    long flip_at = jitsim_env_long("JITSIM_FLIP_RECV_AT", 0);
    it.flip = flip_at > 0 && atomic_fetch_add(&g_recvcount, 1) + 1 == flip_at && it.count;
  }
  long hang_at = jitsim_env_long("JITSIM_HANG_AT", 0);
  long hang_rank = jitsim_env_long("JITSIM_HANG_RANK", -1);
  it.hang = hang_at > 0 && nth == hang_at && (hang_rank < 0 || hang_rank == c->rank);

  pthread_mutex_lock(&c->mu);
  it.rounds = rounds_of(&it);
  it.step0 = c->issue_step + 1;
  c->issue_step += it.rounds;
  if (it.kind == K_SEND) {
    it.off = c->send_off[it.root];
    c->send_off[it.root] += it.count * es;
  } else if (it.kind == K_RECV) {
    it.off = c->recv_off[it.root];
    c->recv_off[it.root] += it.count * es;
  }
  c->refs++;
  pthread_mutex_unlock(&c->mu);

  if (t_depth > 0) {
    if (t_nitems == t_capitems) {
      int cap = t_capitems ? 2 * t_capitems : 16;
      struct item *ni = realloc(t_items, (size_t)cap * sizeof *ni);
      if (!ni) {
        comm_put(c);
        return fail(ncclSystemError, "out of memory");
      }
      t_items = ni;
      t_capitems = cap;
    }
    t_items[t_nitems++] = it;
    return ncclSuccess;
  }
  return launch_items(&it, 1);
}

API ncclResult_t pncclGroupStart(void) {
  if (t_depth++ == 0) t_group_err = ncclSuccess;
  return ncclSuccess;
}
NCCL_ALIAS(ncclGroupStart)

API ncclResult_t pncclGroupEnd(void) {
  if (t_depth <= 0) return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  if (--t_depth > 0) return ncclSuccess;
  /* Nothing of a group starts before the outermost ncclGroupEnd. */
  ncclResult_t r = t_nitems ? launch_items(t_items, t_nitems) : ncclSuccess;
  t_nitems = 0;
  if (t_group_err != ncclSuccess) r = t_group_err;
  t_group_err = ncclSuccess;
  return r;
}
NCCL_ALIAS(ncclGroupEnd)

static ncclResult_t issue_noted(struct item it) {
  ncclResult_t r = issue(it);
  if (r != ncclSuccess && t_depth > 0 && t_group_err == ncclSuccess) t_group_err = r;
  return r;
}

#define STREAM(s) jitsim_stream_get((s), 0)

API ncclResult_t pncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return issue_noted((struct item){.kind = K_ALLREDUCE, .comm = comm, .stream = STREAM(stream),
                                   .sbuf = sendbuff, .rbuf = recvbuff, .count = count,
                                   .dtype = datatype, .op = op});
}
NCCL_ALIAS(ncclAllReduce)

API ncclResult_t pncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                int root, ncclComm_t comm, cudaStream_t stream) {
  return issue_noted((struct item){.kind = K_BCAST, .comm = comm, .stream = STREAM(stream),
                                   .sbuf = sendbuff, .rbuf = recvbuff, .count = count,
                                   .dtype = datatype, .root = root});
}
NCCL_ALIAS(ncclBroadcast)

API ncclResult_t pncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                            cudaStream_t stream) {
  return pncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}
NCCL_ALIAS(ncclBcast)

API ncclResult_t pncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                             ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  return issue_noted((struct item){.kind = K_REDUCE, .comm = comm, .stream = STREAM(stream),
                                   .sbuf = sendbuff, .rbuf = recvbuff, .count = count,
                                   .dtype = datatype, .op = op, .root = root});
}
NCCL_ALIAS(ncclReduce)

API ncclResult_t pncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount,
                                ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return issue_noted((struct item){.kind = K_ALLGATHER, .comm = comm, .stream = STREAM(stream),
                                   .sbuf = sendbuff, .rbuf = recvbuff, .count = sendcount,
                                   .dtype = datatype});
}
NCCL_ALIAS(ncclAllGather)

API ncclResult_t pncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                    ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                    cudaStream_t stream) {
  return issue_noted((struct item){.kind = K_REDSCATTER, .comm = comm, .stream = STREAM(stream),
                                   .sbuf = sendbuff, .rbuf = recvbuff, .count = recvcount,
                                   .dtype = datatype, .op = op});
}
NCCL_ALIAS(ncclReduceScatter)

API ncclResult_t pncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer,
                           ncclComm_t comm, cudaStream_t stream) {
  return issue_noted((struct item){.kind = K_SEND, .comm = comm, .stream = STREAM(stream),
                                   .sbuf = sendbuff, .count = count, .dtype = datatype, .root = peer});
}
NCCL_ALIAS(ncclSend)

API ncclResult_t pncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                           cudaStream_t stream) {
  return issue_noted((struct item){.kind = K_RECV, .comm = comm, .stream = STREAM(stream),
                                   .rbuf = recvbuff, .count = count, .dtype = datatype, .root = peer});
}
NCCL_ALIAS(ncclRecv)
