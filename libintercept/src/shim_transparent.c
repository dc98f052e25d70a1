/*
 * shim_transparent.c - in-place recovery of transient faults (paper §4.2.1),
 * JITCKPT_ON_HANG=recover.
 *
 * On a hang past the timeout, an NCCL error (returned by a call, or the
 * communicator's async error), or a peer's announcement through the store,
 * one thread of the process becomes the coordinator (the watchdog thread, or
 * the application thread whose call failed) and:
 *   1. raises the gate: every other thread entering a hook waits in it, and a
 *      thread coming back from a blocking call (cudaStreamSynchronize, ...)
 *      waits too, then redoes the call against the new handles;
 *   2. decides locally whether the replay can be trusted (optimizer phase,
 *      log overflow/incomplete, sticky device error, split communicators,
 *      recovery count); another thread inside an open NCCL group postpones
 *      the attempt (gate down, retried at the next poll);
 *   3. closes its own open NCCL group (if the failed call was inside one),
 *      aborts every communicator, and waits for the old streams to drain
 *      (the work queued behind the aborted collective runs out and is redone
 *      by the replay);
 *   4. agrees on the epoch E with every rank through the job's TCPStore
 *      (MASTER_ADDR/MASTER_PORT, shim_store.c): ADD start/E, ADD bad/E,
 *      ADD join/E, then polls join/E until WORLD_SIZE ranks joined; any
 *      bad/E > 0 means every rank falls back;
 *   5. re-creates virtual streams/events, and each communicator from a new
 *      ncclUniqueId published by its rank 0 under id/E/<k>;
 *   6. replays the minibatch's log (shim_replay.c) and waits, bounded, for
 *      the replayed work; the failed call itself is re-issued by its caller;
 *   7. clears the watch list, writes one "shim_recovery" line, re-opens the
 *      trigger latch (shim_trigger.c) and lowers the gate.
 * Entries: ji_rcv_watchdog (the watchdog's only one), ji_rcv_run and the
 * hooks' helpers below (application threads), ji_rcv_check_peers (phase
 * marks). Nothing here calls the watchdog.
 * Whatever cannot be done writes one "shim_recovery" line with outcome
 * "fallback" and the reason, then runs the registered JIT handler (if any)
 * and _exits with JITCKPT_HANG_EXIT_CODE: the process never continues with
 * device state it cannot vouch for. Late ranks (stopped, then continued) see
 * start/E in the store (the watchdog polls it while a collective is pending,
 * optimizer_begin once per step) or time out themselves, and join the same
 * epoch.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <unistd.h>

#include "jitintercept.h"
#include "shim_recovery.h"

_Atomic int ji_rcv_active;
_Atomic unsigned ji_rcv_gen;
int ji_rcv_mode;
_Atomic int ji_open_groups;
_Atomic int ji_opt_phase;     /* 1 between optimizer_begin and optimizer_end */
_Atomic int ji_opt_in_mb;     /* optimizer_begin seen in the current minibatch */
_Atomic int ji_opt_ever;      /* the application uses the phase marks */

static _Atomic int busy;
static JI_TLS int tls_coord;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
static _Atomic int local_epoch; /* completed recoveries (written by the coordinator) */
static _Atomic uint64_t n_recovered;
static double cfg_bound = 60.0;
static int cfg_max = 100;
static char prefix[256];

static double env_num(const char *n, double d) {
  const char *v = ji_getenv(n);
  if (!v) return d;
  char *e;
  double x = strtod(v, &e);
  return e != v ? x : d;
}

__attribute__((constructor)) static void rcv_init(void) {
  const char *m = ji_getenv("JITCKPT_ON_HANG");
  ji_rcv_mode = m && !strcmp(m, "recover");
  cfg_bound = env_num("JITCKPT_RECOVER_TIMEOUT", 60.0);
  cfg_max = (int)env_num("JITCKPT_RECOVER_MAX", 100);
  const char *p = ji_getenv("JITCKPT_STORE_PREFIX");
  const char *rc = ji_getenv("TORCHELASTIC_RESTART_COUNT");
  snprintf(prefix, sizeof prefix, "%s/%s/", p ? p : "jitckpt/shim", rc ? rc : "0");
}

static int env_int(const char *n, int d) {
  const char *v = ji_getenv(n);
  return v ? atoi(v) : d;
}

/* ---------------- gate ---------------- */
static void gate_wait(void) {
  pthread_mutex_lock(&g_mu);
  while (atomic_load(&ji_rcv_active)) pthread_cond_wait(&g_cv, &g_mu);
  pthread_mutex_unlock(&g_mu);
}

void ji_rcv_gate(void) {
  if (tls_coord || !atomic_load(&ji_rcv_active)) return;
  ji_park_enter();
  gate_wait();
  ji_park_exit();
}

/* The hooks' slow path (ji_count): wait out a running recovery; a call that
 * met the lost device and was never logged cannot be re-issued. */
void ji_rcv_attend(void) {
  if (atomic_load(&ji_rcv_active)) ji_rcv_gate();
  if (ji_tls.reissue) ji_rcv_reissue_failed(-2);
}

static void gate_up(void) {
  atomic_fetch_add(&ji_rcv_gen, 1);
  atomic_store(&ji_rcv_active, 1);
  atomic_fetch_add(&ji_hot.rcv_attn, 1);
}
static void gate_down(void) {
  pthread_mutex_lock(&g_mu);
  atomic_store(&ji_rcv_active, 0);
  atomic_fetch_sub(&ji_hot.rcv_attn, 1);
  pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
}

/* ---------------- the event line ---------------- */
struct rec_info {
  const ji_fault *f;
  int epoch, replayed;
  double t0, t_abort, t_agree, t_reinit, t_replay;
  const char *outcome, *reason;
  char state_digest[17]; /* after a refill: the replicas' verified state digest (hex), else "" */
};

static void emit(const struct rec_info *ri) {
  struct timeval tv;
  gettimeofday(&tv, NULL);
  double end = ji_now();
  char reason[300];
  snprintf(reason, sizeof reason, "%s", ri->reason ? ri->reason : "");
  for (char *c = reason; *c; c++)
    if (*c == '"' || *c == '\\' || (unsigned char)*c < 0x20) *c = '\'';
#define SPAN(a, b) ((a) > 0 && (b) > 0 ? (b) - (a) : 0.0)
  char json[1400];
  snprintf(json, sizeof json,
           "{\"event\": \"shim_recovery\", \"t\": %.6f, \"rank\": %d, \"pid\": %d, \"fault\": \"%s\", "
           "\"source\": \"%s\", \"collective\": \"%s\", \"code\": %d, \"waited_s\": %.3f, \"timeout_s\": %.3f, "
           "\"epoch\": %d, \"minibatch\": %llu, \"detect_s\": %.6f, \"abort_s\": %.6f, \"agree_s\": %.6f, "
           "\"reinit_s\": %.6f, \"replay_s\": %.6f, \"total_s\": %.6f, \"replayed\": %d, \"outcome\": \"%s\", "
           "\"reason\": \"%s\", \"attempt\": %d, \"state_digest\": \"%s\"}",
           (double)tv.tv_sec + tv.tv_usec * 1e-6, env_int("RANK", -1), (int)getpid(), ri->f->kind, ri->f->source,
           (ri->f->coll >= 0 && ri->f->coll < JI_N_SYMS) ? ji_names[ri->f->coll] : "none", ri->f->code,
           ri->f->waited, ji_watch_timeout(), ri->epoch, (unsigned long long)jitintercept_minibatch(),
           ri->f->waited, SPAN(ri->t0, ri->t_abort), SPAN(ri->t_abort, ri->t_agree),
           SPAN(ri->t_agree, ri->t_reinit), SPAN(ri->t_reinit, ri->t_replay), end - ri->t0, ri->replayed,
           ri->outcome, reason, env_int("TORCHELASTIC_RESTART_COUNT", 0), ri->state_digest);
#undef SPAN
  ji_event_write(json);
}

static void key(char *out, size_t n, const char *what, int epoch, int k) {
  if (k >= 0) snprintf(out, n, "%s%s/%d/%d", prefix, what, epoch, k);
  else snprintf(out, n, "%s%s/%d", prefix, what, epoch);
}

__attribute__((noreturn)) static void fallback(struct rec_info *ri, const char *reason) {
  ri->outcome = "fallback";
  ri->reason = reason;
  emit(ri);
  /* Tell the other ranks at once (they may still be before their check). */
  if (ri->epoch > 0 && ji_store_available()) {
    char k[300];
    key(k, sizeof k, "bad", ri->epoch, -1);
    ji_store_add(k, 1, NULL, 2.0);
  }
  ji_trigger_fallback(); /* handler (user-level JIT save) if registered, then _exit */
}

/* ---------------- store rounds ---------------- */
/* Waits until `k` exists and reads it: 0, or -1 (the store failed, or not
 * there by the deadline). */
static int wait_get(const char *k, void *val, size_t n, double deadline) {
  for (;;) {
    int c = ji_store_check(k, 5.0);
    if (c == 1) return ji_store_get(k, val, n, 5.0) ? -1 : 0;
    if (c < 0 || ji_now() >= deadline) return -1;
    usleep(2000);
  }
}

/* Counts this rank in at `what`/epoch and waits for every rank until the
 * deadline: NULL, or why not (`at` names the round in it). */
static const char *join_all(const char *what, const char *at, int epoch, int world, double deadline) {
  static char msg[160];
  char k[300];
  key(k, sizeof k, what, epoch, -1);
  int64_t joined = 0;
  if (ji_store_add(k, 1, &joined, 5.0)) return "the store is unreachable";
  while (joined < world && ji_now() < deadline) {
    usleep(2000);
    if (ji_store_add(k, 0, &joined, 5.0)) return "the store is unreachable";
  }
  if (joined >= world) return NULL;
  snprintf(msg, sizeof msg, "epoch %d did not complete: %lld of %d ranks joined%s within %.1f s", epoch,
           (long long)joined, world, at, cfg_bound);
  return msg;
}

/* ---------------- communicators ---------------- */
struct comms {
  ji_vh *v[64];
  int n;
};
static void collect_comm(ji_vh *v, void *p) {
  struct comms *c = p;
  if (c->n < 64) c->v[c->n++] = v;
}
static void collect_comm_any(ji_vh *v, void *p) {
  if (v->kind == JI_VK_COMM && v->comm && atomic_load(&v->phys)) collect_comm(v, p);
}

static int reinit_comms(struct comms *cs, int epoch, double deadline, const char **why) {
  ji_fn_ncclGetUniqueId gid = REAL(ncclGetUniqueId);
  ji_fn_ncclCommInitRankConfig irc = REAL(ncclCommInitRankConfig);
  ji_fn_ncclCommInitRank ir = REAL(ncclCommInitRank);
  for (int k = 0; k < cs->n; k++) {
    ji_vh *v = cs->v[k];
    struct ji_comm_info *ci = v->comm;
    ncclUniqueId id;
    char kk[300];
    key(kk, sizeof kk, "id", epoch, k);
    if (ci->rank == 0) {
      ji_tls.depth++;
      int r = gid ? gid(&id) : ncclSystemError;
      ji_tls.depth--;
      if (r != ncclSuccess || ji_store_set(kk, &id, sizeof id, 5.0)) {
        *why = "could not publish the new ncclUniqueId";
        return -1;
      }
    } else if (wait_get(kk, &id, sizeof id, deadline)) {
      *why = "no new ncclUniqueId from rank 0 of a communicator within the bound";
      return -1;
    }
    ncclComm_t fresh = NULL;
    ji_tls.depth++;
    ncclResult_t r = (ci->has_config && irc) ? irc(&fresh, ci->nranks, id, ci->rank, &ci->config)
                     : ir                     ? ir(&fresh, ci->nranks, id, ci->rank)
                                              : ncclSystemError;
    /* Non-blocking configs: wait until the communicator is ready. */
    ji_fn_ncclCommGetAsyncError ge = REAL(ncclCommGetAsyncError);
    while (r == ncclInProgress && ge && ji_now() < deadline) {
      ncclResult_t ar = ncclInProgress;
      if (ge(fresh, &ar) != ncclSuccess) break;
      r = ar;
      if (r == ncclInProgress) usleep(1000);
    }
    ji_tls.depth--;
    if (r != ncclSuccess) {
      *why = "re-initializing a communicator failed";
      return -1;
    }
    ci->id = id;
    atomic_store(&v->phys, (void *)fresh);
  }
  return 0;
}

/* ---------------- lost devices (shim_device.c) ---------------- */
struct dev_pos {
  uint64_t minibatch, in_opt, digest;
};

/* Every rank reads the same keys and so decides alike (a fallback is then
 * everybody's). 0 lost ranks: nothing to do. */
static const char *dev_decide(int epoch, int world, int me, int *lost, int *nlost, int *donor, int *skip) {
  static char msg[200];
  char k[300];
  struct dev_pos pos[256];
  int is_lost[256] = {0};
  if (world > 256) return "more than 256 ranks: lost-device recovery not supported";
  *nlost = 0;
  for (int r = 0; r < world; r++) {
    key(k, sizeof k, "lost", epoch, r);
    int c = ji_store_check(k, 5.0);
    if (c < 0) return "the store is unreachable";
    if (c == 1) is_lost[r] = 1, lost[(*nlost)++] = r;
  }
  if (!*nlost) return NULL;
  for (int r = 0; r < world; r++) {
    key(k, sizeof k, "pos", epoch, r);
    if (ji_store_get(k, &pos[r], sizeof pos[r], 5.0)) return "the store is unreachable";
  }
  *donor = -1;
  for (int r = 0; r < world && *donor < 0; r++)
    if (!is_lost[r]) *donor = r;
  if (*donor < 0) return "every rank lost its device: no replica to refill from";
  const struct dev_pos *d = &pos[*donor];
  for (int r = 0; r < world; r++) {
    if (is_lost[r]) continue;
    if (pos[r].minibatch != d->minibatch || pos[r].in_opt || pos[r].digest != d->digest) {
      snprintf(msg, sizeof msg, "lost device: healthy ranks %d and %d are not at the same minibatch boundary", *donor, r);
      return msg;
    }
  }
  for (int j = 0; j < *nlost; j++) {
    const struct dev_pos *l = &pos[lost[j]];
    if (l->digest != d->digest) {
      snprintf(msg, sizeof msg, "lost device: rank %d's device allocations do not match replica %d's", lost[j], *donor);
      return msg;
    }
    int ok = l->in_opt ? l->minibatch + 1 == d->minibatch : l->minibatch == d->minibatch;
    if (!ok) {
      snprintf(msg, sizeof msg,
               "lost device: rank %d faulted %s minibatch %llu while the replicas wait in minibatch %llu: no replica "
               "holds a state it can continue from",
               lost[j], l->in_opt ? "in the optimizer step of" : "in", (unsigned long long)l->minibatch,
               (unsigned long long)d->minibatch);
      return msg;
    }
    if (lost[j] == me) *skip = (int)l->in_opt;
  }
  return NULL;
}

/* After a refill every lost rank must hold the donor's state bit for bit: the
 * donor publishes its state digest, each lost rank compares its own, and every
 * rank learns the verdict before any replays (a mismatch is everybody's
 * fallback, like a refusal). `hex` gets the verified digest. */
static const char *dev_verify(int epoch, int world, int me, int donor, const int *lost, int nlost, double deadline,
                              char hex[17]) {
  static char msg[200];
  char k[300];
  int is_lost = 0;
  for (int j = 0; j < nlost; j++) is_lost |= lost[j] == me;
  uint64_t mine = 0, theirs = 0;
  int bad = 0;
  const char *why;
  if ((me == donor || is_lost) && (why = ji_dev_state_digest(&mine))) return why;
  key(k, sizeof k, "sdig", epoch, -1);
  if (me == donor && ji_store_set(k, &mine, sizeof mine, 5.0)) return "the store is unreachable";
  if (is_lost) {
    if (wait_get(k, &theirs, sizeof theirs, deadline)) return "refill check: no state digest from the replica";
    bad = mine != theirs;
  }
  key(k, sizeof k, "vbad", epoch, -1);
  if (ji_store_add(k, bad, NULL, 5.0)) return "the store is unreachable";
  if ((why = join_all("vjoin", " the refill check", epoch, world, deadline))) return why;
  int64_t nbad = 0;
  key(k, sizeof k, "vbad", epoch, -1);
  if (ji_store_add(k, 0, &nbad, 5.0)) return "the store is unreachable";
  if (bad) {
    snprintf(msg, sizeof msg, "refill check: this rank's state differs from replica %d's after the refill "
             "(digest %016llx, replica %016llx)", donor, (unsigned long long)mine, (unsigned long long)theirs);
    return msg;
  }
  if (nbad) return "refill check: a refilled rank's state differs from its replica's";
  if (me == donor || is_lost) snprintf(hex, 17, "%016llx", (unsigned long long)mine);
  return NULL;
}

/* ---------------- the recovery ---------------- */
/* Another thread holds `busy`: wait until its gate is up, then until it
 * is down (a fallback never comes back: the process exits). */
static void wait_done(void) {
  while (atomic_load(&busy) && !atomic_load(&ji_rcv_active)) usleep(100);
  gate_wait();
}

int ji_rcv_run(const ji_fault *f, int failed_in_group) {
  if (!ji_rcv_mode) return -1;
  int exp = 0;
  if (!atomic_compare_exchange_strong(&busy, &exp, 1)) {
    /* Another thread of this process is recovering: wait for its outcome. */
    if (!tls_coord) wait_done();
    return 0;
  }
  struct rec_info ri = {.f = f, .t0 = ji_now(), .outcome = "recovered"};
  tls_coord = 1;
  gate_up();
  /* Threads that passed the gate just before it went up finish their
   * (non-blocking) enqueue and log it before the log tail is read. */
  usleep(2000);

  const char *why = NULL;
  int my_depth = failed_in_group ? ji_watch_group_depth() : 0;
  if (atomic_load(&ji_open_groups) > (my_depth > 0)) {
    /* Another thread is between ncclGroupStart and ncclGroupEnd: its group
     * state lives in that thread. Let it finish (it is about to park in a
     * synchronize, or to fail and coordinate itself); try again later. */
    tls_coord = 0;
    atomic_store(&busy, 0);
    gate_down();
    usleep(5000);
    return -2;
  }
  struct comms cs = {.n = 0};
  ji_vh_foreach(JI_VK_COMM, collect_comm, &cs);
  if (!cs.n) ji_vh_foreach_all(JI_VK_COMM, collect_comm_any, &cs);
  int sticky = ji_sticky_cuda(f->code) && !strcmp(f->kind, "cuda_error");
  int lost = ji_dev_mode && (sticky || atomic_load(&ji_dev_lost));
  int in_opt = atomic_load(&ji_opt_phase) || atomic_load(&ji_opt_in_mb);
  if (lost) atomic_store(&ji_dev_lost, 1);
  if (!ji_store_available()) why = "no store: MASTER_ADDR/MASTER_PORT not set";
  else if (lost) {
    /* In the optimizer phase the replicas' post-update state is taken instead
     * of a replay (decided with them after the join). */
    if ((why = ji_dev_precheck())) { /* why set */ }
    else if (!atomic_load(&ji_opt_ever) && !ji_getenv("JITCKPT_RECOVER_NO_PHASES"))
      why = "no optimizer phase marks (jitintercept_optimizer_begin/end): cannot tell whether parameters were updated";
    else if (!in_opt && !ji_log_replayable(&why)) { /* why set */ }
  } else if (sticky) why = "sticky CUDA error: the device context is unusable";
  else if (atomic_load(&ji_opt_phase)) why = "fault in the optimizer phase (parameters may be partly updated)";
  else if (atomic_load(&ji_opt_in_mb)) why = "fault after the optimizer step of this minibatch began";
  else if (!atomic_load(&ji_opt_ever) && !ji_getenv("JITCKPT_RECOVER_NO_PHASES"))
    why = "no optimizer phase marks (jitintercept_optimizer_begin/end): cannot tell whether parameters were updated";
  else if (!ji_log_replayable(&why)) { /* why set */ }
  else if (local_epoch >= cfg_max) why = "JITCKPT_RECOVER_MAX recoveries reached";
  else if (!cs.n) why = "no communicator to re-create";
  for (int k = 0; !why && k < cs.n; k++)
    if (cs.v[k]->comm->parent || cs.v[k]->shadow) why = "a communicator is split or not virtual";
  uint64_t end = ji_log_tail_now();
  double deadline = ri.t0 + cfg_bound;
  int epoch = local_epoch + 1;
  ri.epoch = epoch;

  /* Close our own open group so its items leave this thread's group state
   * (they run on the old communicators and are aborted below). */
  ji_fn_ncclGroupEnd ge = REAL(ncclGroupEnd);
  ji_tls.depth++;
  for (int i = 0; i < my_depth && ge; i++) (void)ge();
  ji_tls.depth--;

  /* Abort: unblocks every stream stuck in a collective. */
  ji_fn_ncclCommAbort ab = REAL(ncclCommAbort);
  for (int k = 0; k < cs.n; k++) {
    void *old = atomic_exchange(&cs.v[k]->phys, NULL);
    ji_tls.depth++;
    if (old && ab) ab((ncclComm_t)old);
    ji_tls.depth--;
  }
  ji_watch_reset();
  if (!why && !lost) {
    int d = ji_drain_streams(deadline);
    if (d > 0) why = "sticky CUDA error while draining the streams";
    else if (d < 0) why = "the streams did not drain after the abort";
  }
  ri.t_abort = ji_now();

  /* Agree on the epoch with every rank. */
  if (!ji_store_available()) fallback(&ri, why);
  char k[300];
  int world = env_int("WORLD_SIZE", cs.n ? cs.v[0]->comm->nranks : 1);
  /* The communicator spanning every rank carries a refill. */
  int wc = -1;
  for (int i = 0; i < cs.n && wc < 0; i++)
    if (cs.v[i]->comm->nranks == world) wc = i;
  int me = wc >= 0 ? cs.v[wc]->comm->rank : env_int("RANK", -1);
  key(k, sizeof k, "start", epoch, -1);
  int st = ji_store_add(k, 1, NULL, 5.0);
  key(k, sizeof k, "bad", epoch, -1);
  st |= ji_store_add(k, why ? 1 : 0, NULL, 5.0);
  if (ji_dev_mode && !why) {
    /* Where this rank stands, for the lost-device decision after the join. */
    struct dev_pos pos = {jitintercept_minibatch(), (uint64_t)in_opt, ji_dev_digest()};
    key(k, sizeof k, "pos", epoch, me);
    st |= ji_store_set(k, &pos, sizeof pos, 5.0);
    if (lost) {
      key(k, sizeof k, "lost", epoch, me);
      st |= ji_store_set(k, "1", 1, 5.0);
    }
  }
  if (st) fallback(&ri, "the store is unreachable");
  if (why) { /* joined too: the others see bad/E as soon as everybody is in */
    key(k, sizeof k, "join", epoch, -1);
    ji_store_add(k, 1, NULL, 5.0);
    fallback(&ri, why);
  }
  if (lost) {
    const char *w = ji_dev_park_and_replace(me, epoch, cfg_bound);
    if (w) { /* joined with "bad": the others learn it now, not at the bound */
      key(k, sizeof k, "join", epoch, -1);
      ji_store_add(k, 1, NULL, 5.0);
      fallback(&ri, w);
    }
    atomic_store(&ji_dev_lost, 0);
    deadline = ji_now() + cfg_bound; /* the process may have moved: a new clock */
  }
  if ((why = join_all("join", "", epoch, world, deadline))) fallback(&ri, why);
  int64_t bad = 0;
  key(k, sizeof k, "bad", epoch, -1);
  if (ji_store_add(k, 0, &bad, 5.0)) fallback(&ri, "the store is unreachable");
  if (bad > 0) fallback(&ri, "another rank cannot recover in place");
  ri.t_agree = ji_now();

  /* Re-create. */
  int rc = jitintercept_recreate_handles(0);
  if (rc < 0) fallback(&ri, "re-creating streams/events failed");
  if (reinit_comms(&cs, epoch, deadline, &why)) fallback(&ri, why);
  int skip = 0;
  if (ji_dev_mode) {
    int lost_ranks[256], nlost = 0, donor = -1;
    if ((why = dev_decide(epoch, world, me, lost_ranks, &nlost, &donor, &skip))) fallback(&ri, why);
    if (nlost && wc < 0) fallback(&ri, "refill: no communicator spans every rank");
    if (nlost && (why = ji_dev_refill(atomic_load(&cs.v[wc]->phys), me, donor, lost_ranks, nlost, deadline)))
      fallback(&ri, why);
    if (nlost && (why = dev_verify(epoch, world, me, donor, lost_ranks, nlost, deadline, ri.state_digest)))
      fallback(&ri, why);
  }
  ri.t_reinit = ji_now();

  /* Replay the minibatch up to the fault; wait (bounded) for it. Or, for a
   * device lost in the optimizer step, take the replicas' post-update state
   * and drop this step's remaining device calls. */
  int nrec = 0;
  if (skip) atomic_store(&ji_hot.discard, 1);
  rc = skip ? 0 : ji_replay_run(end, &nrec, deadline);
  ri.replayed = nrec;
  if (rc == -3) fallback(&ri, "second fault: the replay did not complete within the bound");
  if (rc) {
    static char msg[120];
    snprintf(msg, sizeof msg, "replay failed with status %d", rc);
    fallback(&ri, msg);
  }
  /* The replay may have left this thread inside the open group again (that
   * is where the failed call was): the caller re-issues the failed call. */
  ri.t_replay = ji_now();
  local_epoch = epoch;
  key(k, sizeof k, "done", epoch, -1);
  ji_store_add(k, 1, NULL, 2.0);
  ji_watch_reset();
  atomic_fetch_add(&n_recovered, 1);
  emit(&ri);
  /* Open the trigger latch before any application thread passes the gate:
   * a collective it issues while the latch is closed would go unwatched. */
  ji_trigger_release();
  tls_coord = 0;
  atomic_store(&busy, 0);
  gate_down();
  return 0;
}

/* After a blocking call: 1 = the call must be redone (a recovery happened
 * meanwhile, or this call's result revealed a fault that was recovered). */
int ji_rcv_after_block(unsigned gen, int cuda_rc, int check_nccl) {
  ji_tls.in_block = 0;
  if (tls_coord) return 0;
  if (atomic_load(&ji_rcv_gen) != gen || atomic_load(&ji_rcv_active)) {
    ji_park_enter();
    gate_wait();
    ji_park_exit();
    return 1;
  }
  if (ji_sticky_cuda(cuda_rc)) {
    ji_fault f = {.kind = "cuda_error", .source = "call", .code = cuda_rc, .coll = -1};
    ji_rcv_run(&f, 0);
    return 0;
  }
  if (cuda_rc == cudaSuccess && check_nccl) {
    int rank = -1;
    int e = ji_comms_async_error(&rank);
    if (e) {
      ji_fault f = {.kind = "nccl_async_error", .source = "ncclCommGetAsyncError", .code = e, .coll = -1};
      ji_rcv_run(&f, 0);
      return 1;
    }
  }
  return 0;
}

/* A CUDA call returned an error >= 700 (any hook, through CALL); what the hook
 * returns instead. Without a device swap a sticky error falls back (never
 * returns). With one, after the recovery (run here, or by another thread
 * meanwhile) the failed call is dropped (the step's remaining calls are, see
 * ji_hot.discard) or re-issued: a blocking hook redoes it itself, any other is
 * executed from its log record when the hook logs it (ji_tls.reissue). */
int ji_rcv_cuda_error(int rc) {
  if (tls_coord || !ji_sticky_cuda(rc)) return rc;
  ji_fault f = {.kind = "cuda_error", .source = "call", .code = rc, .coll = -1};
  if (!ji_dev_mode) {
    ji_rcv_run(&f, 0);
    return rc;
  }
  /* Another thread may have swapped the device since this call failed: then
   * the private stream (re-made on the new device) answers without error. */
  ji_fn_cudaStreamQuery q = REAL(cudaStreamQuery);
  cudaStream_t ps = ji_private_stream();
  int swapped = 0;
  if (q && ps && !atomic_load(&ji_dev_lost)) {
    ji_tls.depth++;
    swapped = !ji_sticky_cuda(q(ps));
    ji_tls.depth--;
  }
  while (!swapped && ji_rcv_run(&f, 0) == -2) { /* another thread is inside an NCCL group: retried */
  }
  if (atomic_load(&ji_hot.discard)) return cudaSuccess;
  if (!ji_tls.in_block && !ji_tls.reissue) {
    ji_tls.reissue = 1;
    atomic_fetch_add(&ji_hot.rcv_attn, 1);
  }
  return cudaSuccess;
}

void ji_rcv_reissue(ji_rec *r) {
  ji_tls.reissue = 0;
  atomic_fetch_sub(&ji_hot.rcv_attn, 1);
  int st = ji_replay_record(r);
  if (st) ji_rcv_reissue_failed(st);
}

void ji_rcv_reissue_failed(int status) {
  ji_fault f = {.kind = "cuda_error", .source = "reissue", .code = status, .coll = -1};
  struct rec_info ri = {.f = &f, .t0 = ji_now(), .epoch = local_epoch};
  static char msg[160];
  if (status == -2) snprintf(msg, sizeof msg, "the call that met the lost device was not logged, so it cannot be re-issued");
  else snprintf(msg, sizeof msg, "re-issuing the call that met the lost device failed (status %d)", status);
  fallback(&ri, msg);
}

/* A collective/group call returned an NCCL error on this thread. 1 = retry it. */
int ji_rcv_nccl_error(int id, int rc) {
  if (!ji_rcv_mode || tls_coord) return 0;
  if (rc == ncclInvalidArgument || rc == ncclInvalidUsage) {
    /* A recovery elsewhere may have invalidated the handle under us. */
    if (atomic_load(&ji_rcv_active)) {
      ji_rcv_gate();
      return 1;
    }
    return 0;
  }
  ji_fault f = {.kind = rc == ncclUnhandledCudaError ? "cuda_error" : "nccl_error", .source = "call", .code = rc,
                .coll = id};
  if (rc == ncclUnhandledCudaError) f.code = 700;
  ji_rcv_run(&f, ji_watch_group_depth() > 0);
  return 1;
}

/* Has another rank started the next epoch? Asked by the watchdog while a
 * collective is pending (at most every 20 ms), and once per step by
 * optimizer_begin (force). */
static void check_store(int force) {
  static _Atomic double last;
  double now = ji_now();
  if ((!force && now - atomic_load(&last) < 0.02) || !ji_store_available()) return;
  atomic_store(&last, now);
  char k[300];
  key(k, sizeof k, "start", local_epoch + 1, -1);
  if (ji_store_check(k, 2.0) == 1) {
    if (atomic_load(&ji_open_groups) > 0) return; /* retried next poll */
    /* A peer lost its device in the optimizer step this rank is finishing:
     * join from the next minibatch's collective, with the update done (the
     * state the lost rank takes over). A collective of this step that really
     * hangs still times out here and falls back. */
    if (!force && ji_dev_mode && atomic_load(&ji_opt_in_mb)) return;
    ji_fault f = {.kind = "peer", .source = "store", .code = 0, .coll = -1};
    ji_rcv_run(&f, 0);
  }
}
void ji_rcv_check_peers(void) { check_store(1); }

void ji_rcv_watchdog(const ji_fault *f) {
  if (f) ji_rcv_run(f, 0);
  else check_store(0);
}

JI_API int jitintercept_recover_mode(void) { return ji_rcv_mode; }
JI_API uint64_t jitintercept_recoveries(void) { return atomic_load(&n_recovered); }
