/*
 * jitintercept.h - control API of the LD_PRELOAD shim (build/libjitintercept.so).
 *
 * Programs and jitckpt/intercept.py (cffi, ABI mode) reach these functions via
 * dlsym in the preloaded shim. The header is self-contained and uses only C
 * scalar types so that it can be pasted into cffi's cdef.
 * Thread-safety of each call is stated next to it; see README.md for the
 * watchdog, GIL and locking design.
 */
#ifndef JITINTERCEPT_H
#define JITINTERCEPT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Hang/error handler. Called on the watchdog thread with one JSON object
 * ({"event": "hang"|"error", "t", "rank", "waited_s", "collective", ...}).
 * Before the call the watchdog asks every thread parked in a blocking CUDA/
 * NCCL call to release the GIL (SIGUSR1 by default), so a handler that takes
 * the GIL (a cffi callback) can run even when the GIL holder is stuck.
 * While it runs, cudaMemcpy/cudaMemcpyAsync (any thread) and synchronize /
 * record / launch calls made by the handler thread go to a private
 * non-blocking stream. After it returns, JITCKPT_ON_HANG is applied.
 * Set before the first collective or at any time (atomic pointer swap). */
typedef void (*jitintercept_handler_fn)(const char *event_json, void *user);
void jitintercept_set_handler(jitintercept_handler_fn fn, void *user);

/* 1 when the shim is in the process (lets callers probe with dlsym). */
int jitintercept_loaded(void);

/* Per-symbol call counters (one per interposed symbol). -1: unknown name. */
int64_t jitintercept_counter(const char *name);
int jitintercept_counter_count(void);
const char *jitintercept_counter_name(int index);
/* JSON object {name: count}; path NULL or "" means stderr. 0 or -errno. */
int jitintercept_dump_counters(const char *path);

/* Replay log (paper §4.1). minibatch_begin clears it; call it from the step
 * hook while no other thread is issuing device calls. */
void jitintercept_minibatch_begin(void);
/* Optimizer phase marks (paper §4.2.2): call optimizer_begin just before the
 * parameter/optimizer-state update and optimizer_end right after it, from the
 * same thread as minibatch_begin. A fault noticed between minibatch_begin and
 * optimizer_begin is recovered in place (JITCKPT_ON_HANG=recover); one
 * noticed later in the minibatch is not replayed (it falls back). In recover
 * mode optimizer_begin first waits for the minibatch's collectives to finish
 * (a fault found there is still replayable). Without the marks in-place
 * recovery refuses (JITCKPT_RECOVER_NO_PHASES=1 overrides). */
void jitintercept_optimizer_begin(void);
void jitintercept_optimizer_end(void);
/* 1 when JITCKPT_ON_HANG=recover; number of in-place recoveries so far. */
int jitintercept_recover_mode(void);
uint64_t jitintercept_recoveries(void);
/* Current minibatch number (number of minibatch_begin calls). */
uint64_t jitintercept_minibatch(void);
/* Records, bytes in use, records dropped because the cap was reached. */
uint64_t jitintercept_replay_records(void);
uint64_t jitintercept_replay_bytes(void);
uint64_t jitintercept_replay_overflows(void);
/* One JSON line per record (plus a header line). 0 or -errno. */
int jitintercept_dump_replay_log(const char *path);
/* Re-executes the current minibatch's log on the calling thread against the
 * current physical handles. 0 on success; -1 if the log is incomplete
 * (overflow, or a launch whose parameter sizes were unknown); otherwise the
 * first non-zero CUDA/NCCL status. */
int jitintercept_replay(void);
/* Thread-local: 1 = calls from this thread are not logged (inspection/checks). */
void jitintercept_log_suspend(int on);

/* Virtual handles (paper §4.2). The application only sees virtual stream,
 * event and communicator handles. */
/* Physical handle behind a virtual one (the handle itself if not virtual). */
void *jitintercept_physical(void *handle);
/* Re-creates the physical stream and event behind every live virtual handle
 * with the original flags/priority; destroy_old = 0 leaks the old ones (use
 * after a hang: destroying a stream blocked on a collective may block).
 * Returns the number re-created or a negative CUDA status. Not thread-safe
 * against concurrent use of the handles: call while the application is
 * quiescent (recovery). Clears the watchdog's watch list. */
int jitintercept_recreate_handles(int destroy_old);
/* Re-creates the communicator behind virtual handle `comm` with a new
 * 128-byte ncclUniqueId (every rank passes the same one, obtained by the
 * caller's own rendezvous). The old physical communicator is aborted. Returns
 * an ncclResult_t. Collective across the ranks of `comm`. */
int jitintercept_comm_recreate(void *comm, const void *unique_id);

/* Watchdog state: 1 while the handler runs (memcpy redirect is active). */
int jitintercept_trigger_active(void);
/* Number of collectives currently watched, and the effective timeout (s). */
int jitintercept_watch_pending(void);
double jitintercept_timeout_s(void);
/* Internal statistics by name: "redirected_memcpy", "triggers",
 * "gil_signals", "gil_released", "watched", "completed",
 * "replay_overflows_total". -1: unknown name. */
int64_t jitintercept_stat(const char *name);
/* Allows another trigger after one fired (report mode / after recovery). */
void jitintercept_rearm(void);

#ifdef __cplusplus
}
#endif

#endif /* JITINTERCEPT_H */
