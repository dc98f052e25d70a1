/*
 * shim_watchdog.c - the collective watchdog thread (paper §3.1) and what it
 * does when something is wrong.
 *
 * Every JITCKPT_POLL_MS the thread detaches the watch list (shim_watchlist.c),
 * queries each entry's event (cudaEventQuery), and hands back what is still
 * pending. Per stream only the oldest pending entry's clock runs (time spent
 * queued behind an earlier collective is not "waiting"). Then it asks every
 * live communicator for its NCCL async error (shim_comms.c). A hang is an
 * entry pending longer than the timeout; an error is a failed query or an
 * NCCL async error.
 *
 * On a hang or error the trigger latch (shim_trigger.c) is claimed once and,
 * by JITCKPT_ON_HANG: recover -> the in-place recovery, the watchdog's one
 * entry into it (ji_rcv_watchdog; the recovery never calls back up here);
 * otherwise the event line and the handler, then exit / abort / nothing.
 * While a collective is pending in recover mode, each poll also lets the
 * recovery check whether a peer started an epoch.
 *
 * Locks: none of its own; the watch list and the communicator list take
 * theirs only for list surgery (and the async-error poll). Hook hot paths
 * never reach this file.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "jitintercept.h"
#include "shim_watchdog.h"

static pthread_mutex_t wd_mu = PTHREAD_MUTEX_INITIALIZER; /* the poll timer's condvar only */
static pthread_cond_t wd_cv;
static _Atomic int wd_started;
static pthread_t wd_thread;

/* Configuration, read once at start. */
static double cfg_poll = 0.05;
static int cfg_on_hang; /* 0 report, 1 exit, 2 abort, 3 recover */

static void read_config(void) {
  ji_watch_configure();
  ji_trigger_configure();
  cfg_poll = ji_env_num("JITCKPT_POLL_MS", 50) / 1000.0;
  if (cfg_poll < 0.001) cfg_poll = 0.001;
  const char *m = ji_getenv("JITCKPT_ON_HANG");
  cfg_on_hang = !m ? 0 : !strcmp(m, "exit") ? 1 : !strcmp(m, "abort") ? 2 : !strcmp(m, "recover") ? 3 : 0;
}

static const char *coll_name(int id) {
  return (id >= 0 && id < JI_N_SYMS) ? ji_names[id] : "unknown";
}

static void fire(const char *kind, const ji_watch *e, double waited, int code, const char *what) {
  if (!ji_trigger_claim()) return;
  atomic_fetch_add(&ji_stats[JI_ST_TRIGGERS], 1);
  if (cfg_on_hang == 3) {
    /* In-place recovery; the entry is copied: the recovery resets the list. */
    ji_fault f = {.kind = !strcmp(kind, "hang") ? "hang"
                          : !strcmp(what, "ncclCommGetAsyncError") ? "nccl_async_error"
                                                                   : "cuda_error",
                  .source = what, .code = code, .coll = e ? e->coll : -1, .waited = waited};
    /* Returns when recovered (the recovery opened the latch again before
     * lowering its gate), joined another thread's recovery, or postponed
     * (another thread is inside an NCCL group: the next poll detects it
     * again); a fallback never returns. */
    ji_rcv_watchdog(&f);
    ji_trigger_release();
    return;
  }
  struct timeval tv;
  gettimeofday(&tv, NULL);
  char json[1024];
  snprintf(json, sizeof json,
           "{\"event\": \"%s\", \"t\": %.6f, \"rank\": %d, \"pid\": %d, \"waited_s\": %.3f, "
           "\"collective\": \"%s\", \"timeout_s\": %.3f, \"code\": %d, \"source\": \"%s\", "
           "\"pending\": %d, \"seq\": %llu, \"on_hang\": \"%s\"}",
           kind, (double)tv.tv_sec + tv.tv_usec * 1e-6, e ? e->rank : ji_comm_rank(NULL), (int)getpid(), waited,
           e ? coll_name(e->coll) : "none", ji_watch_timeout(), code, what, ji_watch_pending(),
           (unsigned long long)(e ? e->seq : 0),
           cfg_on_hang == 1 ? "exit" : cfg_on_hang == 2 ? "abort" : cfg_on_hang == 3 ? "recover" : "report");
  ji_trigger_fire(json);
  if (cfg_on_hang == 1) ji_trigger_exit();
  if (cfg_on_hang == 2) ji_comms_abort_all();
}

#define SEEN_MAX 64
static void poll_once(void) {
  ji_fn_cudaEventQuery q = REAL(cudaEventQuery);
  if (!q) return;
  uint64_t gen;
  ji_watch *list = ji_watch_detach(&gen);

  double now = ji_now(), tmo = ji_watch_timeout();
  void *seen[SEEN_MAX];
  int nseen = 0, ndone = 0;
  const ji_watch *hang = NULL, *err = NULL;
  double hang_wait = 0;
  int err_code = 0;
  ji_watch *keep = NULL, **kt = &keep, *done = NULL;
  for (ji_watch *e = list, *next; e; e = next) {
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
      ji_watch_completed(now - e->t_start);
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
  /* The hang/error entry is copied out before the list goes back: once it is
   * back, a hook's reset may free it. */
  ji_watch found = err ? *err : hang ? *hang : (ji_watch){.coll = -1};
  ji_watch_return(gen, keep, kt, done, ndone);

  /* NCCL async errors (a peer's transport failure, ncclRemoteError, ...). */
  int nrank = -1;
  int nerr = ji_comms_async_error(&nrank);
  if (err) {
    fire("error", &found, now - found.t_start, err_code, "cudaEventQuery");
  } else if (nerr) {
    ji_watch fake = {.coll = -1, .rank = nrank};
    fire("error", &fake, 0, nerr, "ncclCommGetAsyncError");
  } else if (hang) {
    fire("hang", &found, hang_wait, 0, "timeout");
  } else if (cfg_on_hang == 3 && ji_watch_pending() > 0) {
    /* A collective is in flight: has another rank started a recovery? */
    ji_rcv_watchdog(NULL);
  }
}

static void *wd_main(void *arg) {
  (void)arg;
  /* Signals for the application (and our GIL signal) must not land here. */
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, NULL);
  int dev = ji_comms_device();
  jitabi_cudaSetDevice_fn setdev = (jitabi_cudaSetDevice_fn)ji_sym_in_lib(JI_CUDART, "cudaSetDevice");
  if (dev >= 0 && setdev) setdev(dev);
  ji_private_stream_make();
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
    if (ji_trigger_fired() || atomic_load(&ji_rcv_active)) continue;
    poll_once();
  }
  return NULL;
}

static void atfork_child(void) {
  /* The watchdog thread does not exist in a forked child, and the parent's
   * pending entries and communicators are not the child's to watch. */
  pthread_mutex_init(&wd_mu, NULL);
  ji_watch_atfork_child();
  ji_comms_atfork_child();
  ji_pool_atfork_child();
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
  if (ji_getenv("JITCKPT_WATCHDOG") && !strcmp(ji_getenv("JITCKPT_WATCHDOG"), "0")) return;
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&wd_thread, &a, wd_main, NULL) != 0) atomic_store(&wd_started, 0);
  pthread_attr_destroy(&a);
}
