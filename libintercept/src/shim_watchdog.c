/*
 * shim_watchdog.c - collective watchdog and the JIT trigger (paper §3.1, §3.2).
 *
 * What is watched:
 *  - own events: after the outermost ncclGroupEnd (or an ungrouped collective)
 *    the calling thread records a watchdog-owned event on every stream that
 *    carried NCCL work inside the group;
 *  - application events recorded on an NCCL stream that another stream waits
 *    on (cudaStreamWaitEvent; Fig. 3), timed from that wait.
 * The watchdog thread polls them with cudaEventQuery every JITCKPT_POLL_MS and
 * every live communicator with ncclCommGetAsyncError. Per stream only the
 * oldest pending entry's clock runs (time spent queued behind an earlier
 * collective is not "waiting"). A hang is an entry pending longer than the
 * timeout; an error is a failed query or an NCCL async error.
 *
 * Locks: wd_mu guards the pending list, the event pool and the comm list;
 * held only for list surgery (never across a CUDA/NCCL call made by an
 * application thread, and the watchdog polls a detached list without it,
 * except for ncclCommGetAsyncError, which is non-blocking and must not race
 * ncclCommDestroy). Hook hot paths (record/query/wait of non-NCCL events)
 * never take it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "jitintercept.h"
#include "shim_internal.h"

_Atomic int ji_trigger_active;
int ji_redirect_enabled = 1;
_Atomic uint64_t ji_stats[JI_ST_N];

typedef struct wentry {
  struct wentry *next;
  void *pev;        /* physical event polled */
  int own;          /* watchdog-owned event: back to the pool when done */
  ji_vh *vev;       /* application event (own == 0) */
  uint32_t gen;
  uint64_t rec_seq;
  void *skey;       /* application stream handle: per-stream FIFO key */
  int coll;         /* JI_ID_* of the (last) collective */
  int rank;
  uint64_t seq;
  double t_enq, t_start;
} wentry;

static pthread_mutex_t wd_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wd_cv;
static wentry *wl_head;
static _Atomic int wl_pending;
static uint64_t wd_seq;
#define POOL_MAX 1024
static void *ev_pool[POOL_MAX];
static int ev_pool_n;
#define COMMS_MAX 256
static ji_vh *comms[COMMS_MAX];
static int ncomms;

static _Atomic int wd_started;
/* Device of the first communicator: the watchdog thread (and so the private
 * stream and the handler) must run on the rank's device, not device 0. */
static _Atomic int wd_device = -1;
static pthread_t wd_thread;
static _Atomic int fired;
static _Atomic(void *) priv_stream;

static _Atomic(jitintercept_handler_fn) handler_fn;
static _Atomic(void *) handler_user;

/* Configuration, read once at start. */
static double cfg_fixed_timeout; /* > 0: JITCKPT_TIMEOUT */
static double cfg_mult = 5.0, cfg_floor = 30.0;
static double cfg_poll = 0.05;
static int cfg_on_hang; /* 0 report, 1 exit, 2 abort, 3 recover (shim_transparent.c) */
static int cfg_exit_code = 75;
static double longest_s; /* longest completed collective (watchdog thread only, read atomically-ish) */
static _Atomic double timeout_now;

/* Per-thread group state: NCCL groups are per thread. */
#define GROUP_STREAMS 16
static JI_TLS int tls_group_depth;
static JI_TLS int tls_group_n;
static JI_TLS void *tls_group_streams[GROUP_STREAMS];
static JI_TLS int tls_group_coll[GROUP_STREAMS];
static JI_TLS int tls_group_rank[GROUP_STREAMS];

static double env_d(const char *n, double dflt) {
  const char *v = ji_getenv(n);
  if (!v) return dflt;
  char *e;
  double d = strtod(v, &e);
  return (e != v && d >= 0) ? d : dflt;
}

static void read_config(void) {
  cfg_fixed_timeout = env_d("JITCKPT_TIMEOUT", 0);
  cfg_mult = env_d("JITCKPT_TIMEOUT_MULT", 5.0);
  cfg_floor = env_d("JITCKPT_TIMEOUT_FLOOR", 30.0);
  cfg_poll = env_d("JITCKPT_POLL_MS", 50) / 1000.0;
  if (cfg_poll < 0.001) cfg_poll = 0.001;
  const char *m = ji_getenv("JITCKPT_ON_HANG");
  cfg_on_hang = !m ? 0 : !strcmp(m, "exit") ? 1 : !strcmp(m, "abort") ? 2 : !strcmp(m, "recover") ? 3 : 0;
  cfg_exit_code = (int)env_d("JITCKPT_HANG_EXIT_CODE", 75);
  /* 0 only for the negative control of the redirect test. */
  const char *rd = ji_getenv("JITCKPT_REDIRECT");
  ji_redirect_enabled = !(rd && !strcmp(rd, "0"));
}

static double cur_timeout(void) {
  if (cfg_fixed_timeout > 0) return cfg_fixed_timeout;
  double t = cfg_mult * longest_s;
  return t < cfg_floor ? cfg_floor : t;
}

cudaStream_t ji_private_stream(void) { return (cudaStream_t)atomic_load(&priv_stream); }

static void make_private_stream(void) {
  if (atomic_load(&priv_stream)) return;
  ji_fn_cudaStreamCreateWithFlags f = REAL(cudaStreamCreateWithFlags);
  cudaStream_t s = NULL;
  if (!f) return;
  ji_tls_depth++;
  cudaError_t r = f(&s, cudaStreamNonBlocking);
  ji_tls_depth--;
  if (r == cudaSuccess) atomic_store(&priv_stream, (void *)s);
}

/* ---------------- event pool ---------------- */
static void *pool_get(void) {
  void *e = NULL;
  pthread_mutex_lock(&wd_mu);
  if (ev_pool_n) e = ev_pool[--ev_pool_n];
  pthread_mutex_unlock(&wd_mu);
  if (e) return e;
  ji_fn_cudaEventCreateWithFlags f = REAL(cudaEventCreateWithFlags);
  if (!f) return NULL;
  ji_tls_depth++;
  cudaError_t r = f((cudaEvent_t *)&e, cudaEventDisableTiming);
  ji_tls_depth--;
  return r == cudaSuccess ? e : NULL;
}
/* Caller holds wd_mu. */
static void pool_put_locked(void *e) {
  if (ev_pool_n < POOL_MAX) {
    ev_pool[ev_pool_n++] = e;
    return;
  }
  ji_fn_cudaEventDestroy f = REAL(cudaEventDestroy);
  if (f) f((cudaEvent_t)e);
}

/* Append in t_enq order (own events are always newest; application events
 * carry their record time and may be older than entries already queued). */
static void add_entry(wentry *e) {
  pthread_mutex_lock(&wd_mu);
  e->seq = ++wd_seq;
  wentry **pp = &wl_head;
  while (*pp && (*pp)->t_enq <= e->t_enq) pp = &(*pp)->next;
  e->next = *pp;
  *pp = e;
  pthread_mutex_unlock(&wd_mu);
  atomic_fetch_add(&wl_pending, 1);
  atomic_fetch_add_explicit(&ji_stats[JI_ST_WATCHED], 1, memory_order_relaxed);
}

static int comm_rank(ji_vh *vc) {
  if (vc && vc->comm) return vc->comm->rank;
  const char *r = ji_getenv("RANK");
  return r ? atoi(r) : -1;
}

static void watch_stream(void *vstream, int coll, int rank) {
  if (atomic_load_explicit(&fired, memory_order_relaxed)) return;
  void *pe = pool_get();
  if (!pe) return;
  ji_fn_cudaEventRecord rec = REAL(cudaEventRecord);
  ji_tls_depth++;
  cudaError_t r = rec ? rec((cudaEvent_t)pe, (cudaStream_t)ji_phys(vstream)) : cudaErrorInitializationError;
  ji_tls_depth--;
  if (r != cudaSuccess) {
    pthread_mutex_lock(&wd_mu);
    pool_put_locked(pe);
    pthread_mutex_unlock(&wd_mu);
    return;
  }
  wentry *e = calloc(1, sizeof *e);
  if (!e) return;
  e->pev = pe;
  e->own = 1;
  e->skey = vstream;
  e->coll = coll;
  e->rank = rank;
  e->t_enq = e->t_start = ji_now();
  add_entry(e);
}

void ji_wd_collective(int id, cudaStream_t vstream, ji_vh *vcomm) {
  int rank = comm_rank(vcomm);
  if (tls_group_depth == 0) {
    watch_stream((void *)vstream, id, rank);
    return;
  }
  for (int i = 0; i < tls_group_n; i++)
    if (tls_group_streams[i] == (void *)vstream) {
      tls_group_coll[i] = id;
      return;
    }
  if (tls_group_n < GROUP_STREAMS) {
    tls_group_streams[tls_group_n] = (void *)vstream;
    tls_group_coll[tls_group_n] = id;
    tls_group_rank[tls_group_n] = rank;
    tls_group_n++;
  }
}

void ji_wd_group_start(void) { tls_group_depth++; }

void ji_wd_group_end(int ok) {
  if (tls_group_depth > 0) tls_group_depth--;
  if (tls_group_depth) return;
  int n = tls_group_n;
  tls_group_n = 0;
  if (!ok) return;
  for (int i = 0; i < n; i++) watch_stream(tls_group_streams[i], tls_group_coll[i], tls_group_rank[i]);
}

void ji_wd_stream_wait(cudaStream_t vstream, ji_vh *vev) {
  (void)vstream;
  if (atomic_load_explicit(&fired, memory_order_relaxed)) return;
  uint64_t seq = atomic_load_explicit(&vev->rec_seq, memory_order_acquire);
  void *rs = atomic_load_explicit(&vev->rec_stream, memory_order_relaxed);
  /* Many streams may wait on the same record: watch it once. */
  pthread_mutex_lock(&wd_mu);
  for (wentry *e = wl_head; e; e = e->next)
    if (!e->own && e->vev == vev && e->rec_seq == seq) {
      pthread_mutex_unlock(&wd_mu);
      return;
    }
  pthread_mutex_unlock(&wd_mu);
  wentry *e = calloc(1, sizeof *e);
  if (!e) return;
  e->vev = vev;
  e->gen = atomic_load(&vev->gen);
  e->rec_seq = seq;
  e->skey = rs;
  ji_vh *vs = ji_slot(rs);
  e->coll = vs ? (int)atomic_load(&vs->last_coll) : JI_ID_ncclAllReduce;
  e->rank = comm_rank(NULL);
  /* Clock from the wait, not the record: stamping every record would put a
   * clock read on the hottest path for a difference of microseconds. */
  e->t_enq = e->t_start = ji_now();
  add_entry(e);
  ji_wd_start();
}

void ji_wd_comm_add(ji_vh *vc) {
  if (atomic_load(&wd_device) < 0) {
    jitabi_cudaGetDevice_fn getdev = (jitabi_cudaGetDevice_fn)ji_sym_in_lib(JI_CUDART, "cudaGetDevice");
    int dev = -1;
    if (getdev && getdev(&dev) == cudaSuccess) atomic_store(&wd_device, dev);
  }
  pthread_mutex_lock(&wd_mu);
  if (ncomms < COMMS_MAX) comms[ncomms++] = vc;
  pthread_mutex_unlock(&wd_mu);
}

void ji_wd_comm_remove(ji_vh *vc) {
  pthread_mutex_lock(&wd_mu);
  for (int i = 0; i < ncomms; i++)
    if (comms[i] == vc) {
      comms[i] = comms[--ncomms];
      break;
    }
  pthread_mutex_unlock(&wd_mu);
}

static void free_entry_locked(wentry *e) {
  if (e->own) pool_put_locked(e->pev);
  free(e);
}

void ji_wd_reset(void) {
  pthread_mutex_lock(&wd_mu);
  wentry *e = wl_head;
  wl_head = NULL;
  while (e) {
    wentry *n = e->next;
    /* Own events may sit on a stream that is being replaced: leak them
     * rather than destroy an event that is stuck behind a hung collective. */
    free(e);
    e = n;
  }
  atomic_store(&wl_pending, 0);
  pthread_mutex_unlock(&wd_mu);
}

/* ---------------- trigger ---------------- */
static const char *coll_name(int id) {
  return (id >= 0 && id < JI_N_SYMS) ? ji_names[id] : "unknown";
}

static void write_event_line(const char *json) {
  const char *path = ji_getenv("JITCKPT_SHIM_EVENTS");
  if (!path) path = ji_getenv("JITCKPT_EVENT_LOG");
  int fd = path ? open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644) : 2;
  if (fd < 0) fd = 2;
  size_t n = strlen(json);
  /* One write() per line: O_APPEND keeps lines from several ranks intact. */
  char *buf = malloc(n + 1);
  if (buf) {
    memcpy(buf, json, n);
    buf[n] = '\n';
    ssize_t w = write(fd, buf, n + 1);
    (void)w;
    free(buf);
  }
  if (fd != 2) close(fd);
}

static void abort_all_comms(void) {
  ji_fn_ncclCommAbort ab = REAL(ncclCommAbort);
  if (!ab) return;
  pthread_mutex_lock(&wd_mu);
  int n = ncomms;
  void *phys[COMMS_MAX];
  for (int i = 0; i < n; i++) phys[i] = atomic_load(&comms[i]->phys);
  pthread_mutex_unlock(&wd_mu);
  for (int i = 0; i < n; i++)
    if (phys[i]) ab((ncclComm_t)phys[i]);
}

static void fire(const char *kind, const wentry *e, double waited, int code, const char *what) {
  int expected = 0;
  if (!atomic_compare_exchange_strong(&fired, &expected, 1)) return;
  atomic_fetch_add(&ji_stats[JI_ST_TRIGGERS], 1);
  if (cfg_on_hang == 3) {
    /* In-place recovery; the entry is copied: the recovery resets the list. */
    ji_fault f = {.kind = !strcmp(kind, "hang") ? "hang"
                          : !strcmp(what, "ncclCommGetAsyncError") ? "nccl_async_error"
                                                                   : "cuda_error",
                  .source = what, .code = code, .coll = e ? e->coll : -1, .waited = waited};
    /* Returns when recovered (or joined a recovery); -2: not now (another
     * thread is inside an NCCL group), the next poll detects it again. */
    if (ji_rcv_run(&f, 0) == -2) atomic_store(&fired, 0);
    return;
  }
  struct timeval tv;
  gettimeofday(&tv, NULL);
  char json[1024];
  snprintf(json, sizeof json,
           "{\"event\": \"%s\", \"t\": %.6f, \"rank\": %d, \"pid\": %d, \"waited_s\": %.3f, "
           "\"collective\": \"%s\", \"timeout_s\": %.3f, \"code\": %d, \"source\": \"%s\", "
           "\"pending\": %d, \"seq\": %llu, \"on_hang\": \"%s\"}",
           kind, (double)tv.tv_sec + tv.tv_usec * 1e-6, e ? e->rank : comm_rank(NULL), (int)getpid(), waited,
           e ? coll_name(e->coll) : "none", cur_timeout(), code, what, atomic_load(&wl_pending),
           (unsigned long long)(e ? e->seq : 0),
           cfg_on_hang == 1 ? "exit" : cfg_on_hang == 2 ? "abort" : cfg_on_hang == 3 ? "recover" : "report");
  jitintercept_handler_fn h = atomic_load(&handler_fn);
  if (!h || ji_getenv("JITCKPT_EVENT_LOG")) write_event_line(json);
  if (h) {
    make_private_stream();
    atomic_store(&ji_trigger_active, 1);
    /* The handler usually needs the GIL; its holder may be parked in a
     * blocking call that will never return. */
    ji_gil_release_parked(0.5);
    ji_tls_trigger = 1;
    /* The handler's copies are not part of the minibatch being logged. */
    ji_tls_log_off = 1;
    h(json, atomic_load(&handler_user));
    ji_tls_log_off = 0;
    ji_tls_trigger = 0;
    atomic_store(&ji_trigger_active, 0);
  }
  if (cfg_on_hang == 1) _exit(cfg_exit_code);
  if (cfg_on_hang == 2) abort_all_comms();
}

/* ---------------- the thread ---------------- */
#define SEEN_MAX 64
static void poll_once(void) {
  ji_fn_cudaEventQuery q = REAL(cudaEventQuery);
  if (!q) return;
  pthread_mutex_lock(&wd_mu);
  wentry *list = wl_head;
  wl_head = NULL;
  pthread_mutex_unlock(&wd_mu);

  double now = ji_now(), tmo = cur_timeout();
  void *seen[SEEN_MAX];
  int nseen = 0, ndone = 0;
  const wentry *hang = NULL, *err = NULL;
  double hang_wait = 0;
  int err_code = 0;
  wentry *keep = NULL, **kt = &keep, *done = NULL;
  for (wentry *e = list, *next; e; e = next) {
    next = e->next;
    e->next = NULL;
    if (!e->own && (atomic_load(&e->vev->gen) != e->gen ||
                    atomic_load_explicit(&e->vev->rec_seq, memory_order_acquire) != e->rec_seq)) {
      /* Re-recorded (cached events) or destroyed: a later wait re-adds it, and
       * own events cover the collectives in between. */
      e->next = done, done = e, ndone++;
      continue;
    }
    void *pe = e->own ? e->pev : atomic_load(&e->vev->phys);
    cudaError_t r = pe ? q((cudaEvent_t)pe) : cudaSuccess;
    if (r == cudaSuccess) {
      double d = now - e->t_start;
      if (d > longest_s) longest_s = d;
      atomic_fetch_add_explicit(&ji_stats[JI_ST_COMPLETED], 1, memory_order_relaxed);
      e->next = done, done = e, ndone++;
      continue;
    }
    int is_head = 1;
    for (int i = 0; i < nseen; i++)
      if (seen[i] == e->skey) is_head = 0;
    if (is_head && nseen < SEEN_MAX) seen[nseen++] = e->skey;
    if (r != cudaErrorNotReady) {
      if (!err) err = e, err_code = (int)r;
    } else if (!is_head) {
      e->t_start = now; /* queued behind an earlier pending entry: clock not running */
    } else if (now - e->t_start > tmo && now - e->t_start > hang_wait) {
      hang = e, hang_wait = now - e->t_start;
    }
    *kt = e, kt = &e->next;
  }
  pthread_mutex_lock(&wd_mu);
  *kt = wl_head; /* kept entries are older than anything added meanwhile */
  wl_head = keep;
  while (done) {
    wentry *n = done->next;
    free_entry_locked(done);
    done = n;
  }
  pthread_mutex_unlock(&wd_mu);
  atomic_fetch_sub(&wl_pending, ndone);
  atomic_store(&timeout_now, cur_timeout());

  /* NCCL async errors (a peer's transport failure, ncclRemoteError, ...). */
  ji_fn_ncclCommGetAsyncError ge = REAL(ncclCommGetAsyncError);
  int nerr = 0, nrank = -1;
  if (ge) {
    pthread_mutex_lock(&wd_mu);
    for (int i = 0; i < ncomms && !nerr; i++) {
      void *pc = atomic_load(&comms[i]->phys);
      ncclResult_t ar = ncclSuccess;
      if (!pc) continue;
      ji_tls_depth++;
      ncclResult_t rr = ge((ncclComm_t)pc, &ar);
      ji_tls_depth--;
      if (rr == ncclSuccess && ar != ncclSuccess && ar != ncclInProgress) nerr = (int)ar, nrank = comm_rank(comms[i]);
    }
    pthread_mutex_unlock(&wd_mu);
  }
  /* Entries stay owned by the list while fire() reads them: only this thread
   * frees entries, and it is busy here. */
  if (err) {
    fire("error", err, now - err->t_start, err_code, "cudaEventQuery");
  } else if (nerr) {
    wentry fake = {.coll = -1, .rank = nrank};
    fire("error", &fake, 0, nerr, "ncclCommGetAsyncError");
  } else if (hang) {
    fire("hang", hang, hang_wait, 0, "timeout");
  } else if (cfg_on_hang == 3 && atomic_load(&wl_pending) > 0) {
    /* A collective is in flight: has another rank started a recovery? */
    ji_rcv_poll_store();
  }
}

static void *wd_main(void *arg) {
  (void)arg;
  /* Signals for the application (and our GIL signal) must not land here. */
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, NULL);
  int dev = atomic_load(&wd_device);
  jitabi_cudaSetDevice_fn setdev = (jitabi_cudaSetDevice_fn)ji_sym_in_lib(JI_CUDART, "cudaSetDevice");
  if (dev >= 0 && setdev) setdev(dev);
  make_private_stream();
  for (;;) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    long ns = (long)(cfg_poll * 1e9);
    ts.tv_sec += ns / 1000000000L;
    ts.tv_nsec += ns % 1000000000L;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&wd_mu);
    pthread_cond_timedwait(&wd_cv, &wd_mu, &ts);
    pthread_mutex_unlock(&wd_mu);
    if (atomic_load(&fired) || atomic_load(&ji_rcv_active)) continue;
    poll_once();
  }
  return NULL;
}

static void atfork_child(void) {
  /* The watchdog thread does not exist in a forked child, and the parent's
   * pending entries and communicators are not the child's to watch. */
  pthread_mutex_init(&wd_mu, NULL);
  wl_head = NULL;
  atomic_store(&wl_pending, 0);
  ncomms = 0;
  atomic_store(&wd_started, 0);
  ji_store_atfork_child();
}

void ji_wd_start(void) {
  if (atomic_load_explicit(&wd_started, memory_order_acquire)) return;
  int expected = 0;
  if (!atomic_compare_exchange_strong(&wd_started, &expected, 1)) return;
  static int once;
  if (!once) {
    once = 1;
    pthread_atfork(NULL, NULL, atfork_child);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_cond_init(&wd_cv, &ca);
  }
  read_config();
  atomic_store(&timeout_now, cur_timeout());
  if (ji_getenv("JITCKPT_WATCHDOG") && !strcmp(ji_getenv("JITCKPT_WATCHDOG"), "0")) return;
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&wd_thread, &a, wd_main, NULL) != 0) atomic_store(&wd_started, 0);
  pthread_attr_destroy(&a);
}

/* ---------------- public API ---------------- */
JI_API void jitintercept_set_handler(jitintercept_handler_fn fn, void *user) {
  atomic_store(&handler_user, user);
  atomic_store(&handler_fn, fn);
}
JI_API int jitintercept_trigger_active(void) { return atomic_load(&ji_trigger_active); }
JI_API int jitintercept_watch_pending(void) { return atomic_load(&wl_pending); }
JI_API double jitintercept_timeout_s(void) {
  if (!atomic_load(&wd_started)) read_config();
  return atomic_load(&wd_started) ? atomic_load(&timeout_now) : cur_timeout();
}
JI_API void jitintercept_rearm(void) { atomic_store(&fired, 0); }

JI_API int64_t jitintercept_stat(const char *name) {
  static const char *const names[JI_ST_N] = {"redirected_memcpy", "triggers", "gil_signals", "gil_released",
                                             "watched", "completed", "replay_overflows_total"};
  for (int i = 0; name && i < JI_ST_N; i++)
    if (!strcmp(names[i], name)) return (int64_t)atomic_load(&ji_stats[i]);
  return -1;
}

/* ---------------- services for in-place recovery (shim_transparent.c) ---------------- */
int ji_wd_group_depth(void) { return tls_group_depth; }

/* First NCCL async error of a live communicator (0: none). */
int ji_wd_comm_async_error(int *rank) {
  ji_fn_ncclCommGetAsyncError ge = REAL(ncclCommGetAsyncError);
  int err = 0;
  if (!ge) return 0;
  pthread_mutex_lock(&wd_mu);
  for (int i = 0; i < ncomms && !err; i++) {
    void *pc = atomic_load(&comms[i]->phys);
    ncclResult_t ar = ncclSuccess;
    if (!pc) continue;
    ji_tls_depth++;
    ncclResult_t rr = ge((ncclComm_t)pc, &ar);
    ji_tls_depth--;
    if (rr == ncclSuccess && ar != ncclSuccess && ar != ncclInProgress) err = (int)ar, *rank = comm_rank(comms[i]);
  }
  pthread_mutex_unlock(&wd_mu);
  return err;
}

void ji_wd_write_event(const char *json) { write_event_line(json); }
void *ji_wd_pool_get(void) { return pool_get(); }

/* The device was replaced: pooled events and the private stream belonged to
 * the old one (using them now fails). Forget them (nothing to destroy: their
 * context is gone) and make the private stream again on the new device. */
void ji_wd_device_replaced(void) {
  pthread_mutex_lock(&wd_mu);
  ev_pool_n = 0;
  pthread_mutex_unlock(&wd_mu);
  atomic_store(&priv_stream, NULL);
  make_private_stream();
}
void ji_wd_pool_put(void *e) {
  pthread_mutex_lock(&wd_mu);
  pool_put_locked(e);
  pthread_mutex_unlock(&wd_mu);
}
double ji_wd_timeout(void) { return cur_timeout(); }
void ji_wd_rearm_after_recovery(void) { atomic_store(&fired, 0); }

/* In-place recovery is impossible: the existing path (the registered JIT
 * handler, i.e. the user-level save, then exit for the launcher to restart). */
void ji_wd_fallback(void) {
  jitintercept_handler_fn h = atomic_load(&handler_fn);
  if (h) {
    char json[256];
    snprintf(json, sizeof json,
             "{\"event\": \"error\", \"source\": \"recovery_fallback\", \"rank\": %d, \"pid\": %d, "
             "\"on_hang\": \"recover\"}",
             comm_rank(NULL), (int)getpid());
    make_private_stream();
    atomic_store(&ji_trigger_active, 1);
    ji_gil_release_parked(0.5);
    ji_tls_trigger = 1;
    ji_tls_log_off = 1;
    h(json, atomic_load(&handler_user));
  }
  _exit(cfg_exit_code);
}
