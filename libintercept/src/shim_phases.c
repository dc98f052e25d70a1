/*
 * shim_phases.c - the application's phase marks (paper §4.1, §4.2.2):
 * jitintercept_minibatch_begin (the replay log restarts) and
 * jitintercept_optimizer_begin/end (a fault after begin is not replayable).
 * Called like hooks, from the application's thread, while it issues no other
 * device calls (a step hook).
 *
 * In recover mode both first wait for the work on every NCCL stream through
 * the hooked synchronize, so a fault found there is recovered (or falls back)
 * like any other, before the state it would be replayed against changes.
 */
#define _GNU_SOURCE
#include "jitintercept.h"
#include "shim_entry.h"

static void sync_nccl_stream(ji_vh *v, void *p) {
  (void)p;
  if (atomic_load(&v->sflags) & JI_VH_NCCL) cudaStreamSynchronize((cudaStream_t)ji_vh_app(v));
}

static void quiesce(void) {
  for (int i = 0; i < 3; i++) {
    ji_vh_foreach_all(JI_VK_STREAM, sync_nccl_stream, NULL);
    void *nv[32];
    int n = 0;
    ji_nccl_nv_streams(nv, &n, 32);
    for (int j = 0; j < n; j++) cudaStreamSynchronize((cudaStream_t)nv[j]);
    int rank;
    int e = ji_comms_async_error(&rank);
    if (!e) break;
    ji_fault f = {.kind = "nccl_async_error", .source = "ncclCommGetAsyncError", .code = e, .coll = -1};
    ji_rcv_run(&f, 0);
  }
}

JI_API void jitintercept_minibatch_begin(void) {
  /* Collectives issued in the previous optimizer phase (a grad-norm
   * all-reduce on the compute stream, say) must be known good before the log
   * is reset: a fault in them falls back instead of being replayed wrongly. */
  if (ji_rcv_mode && atomic_load(&ji_opt_in_mb)) quiesce();
  if (!ji_log_new_minibatch()) return;
  atomic_store(&ji_opt_in_mb, 0);
  atomic_store(&ji_hot.discard, 0); /* a lost-device recovery's skip ends here */
}

JI_API void jitintercept_optimizer_begin(void) {
  atomic_store(&ji_opt_ever, 1);
  /* The minibatch's collectives must be known good before parameters
   * change: wait for them here (a fault found now is still replayable). */
  if (ji_rcv_mode) {
    quiesce();
    /* A rank that was stalled (stopped, descheduled) may have completed this
     * minibatch's collectives while its peers were already recovering (their
     * contributions were in place before they aborted): one store query per
     * step makes it join their epoch now, while the replay is still valid. */
    ji_rcv_check_peers();
  }
  atomic_store(&ji_opt_in_mb, 1);
  atomic_store(&ji_opt_phase, 1);
}

JI_API void jitintercept_optimizer_end(void) { atomic_store(&ji_opt_phase, 0); }
