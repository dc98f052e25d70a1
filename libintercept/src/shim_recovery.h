/*
 * shim_recovery.h - the recovery layer: lost device (shim_device.c), objects
 * re-created behind virtual handles (shim_recover.c), in-place recovery
 * (shim_transparent.c). Layers and their headers: shim_base.h.
 */
#ifndef JI_SHIM_RECOVERY_H
#define JI_SHIM_RECOVERY_H

#include "shim_replay.h"

/* Hidden by default, as in shim_base.h (why: there). */
#pragma GCC visibility push(hidden)

/* ---- lost device (shim_device.c) ----
 * ji_dev_mode: set once by a constructor. ji_dev_lost: this process's device
 * is gone (set by the recovery's coordinator, cleared once the new device is
 * attached). ji_hot.discard: set by the coordinator for a fault in the optimizer
 * step, cleared by minibatch_begin; read by hooks on any thread. */
extern int ji_dev_mode;
extern _Atomic int ji_dev_lost;
JI_HIDDEN uint64_t ji_callsite(void);
/* After a device lost in the optimizer step: the step's remaining device work
 * is dropped (the replica's post-update state was taken instead). */
#define JI_DISCARDED() JI_UNLIKELY(atomic_load_explicit(&ji_hot.discard, memory_order_relaxed))
JI_HIDDEN const char *ji_dev_precheck(void);
JI_HIDDEN uint64_t ji_dev_digest(void);
/* Every live allocation's name and bytes hashed (read back from the device): NULL, or why not. */
JI_HIDDEN const char *ji_dev_state_digest(uint64_t *out);
JI_HIDDEN const char *ji_dev_park_and_replace(int rank, int epoch, double bound_s);
JI_HIDDEN const char *ji_dev_refill(void *comm, int me, int donor, const int *lost, int nlost, double deadline);

/* ---- re-creating objects behind virtual handles (shim_recover.c) ----
 * jitintercept_recreate_handles, jitintercept_comm_recreate (public API). */

/* ---- in-place recovery (shim_transparent.c) ---- */
typedef struct ji_fault {
  const char *kind;   /* hang | nccl_error | nccl_async_error | cuda_error | peer */
  const char *source; /* timeout | call | ncclCommGetAsyncError | cudaEventQuery | store */
  int code;
  int coll;           /* JI_ID_* of the collective, or -1 */
  double waited;      /* detection: seconds the collective waited (hangs) */
} ji_fault;
extern int ji_rcv_mode; /* JITCKPT_ON_HANG=recover */
/* Gate: every hook passes it after its depth check (ji_count, ji_enter_hot); one relaxed
 * load of ji_hot.rcv_attn, nonzero while a recovery runs (ji_rcv_active) or some
 * thread has a call to re-issue (ji_tls.reissue): one check for both. */
extern _Atomic int ji_rcv_active;
JI_HIDDEN void ji_rcv_attend(void);
extern _Atomic unsigned ji_rcv_gen;
extern _Atomic int ji_open_groups;
/* Optimizer phase marks (set by shim_phases.c, read by the recovery). */
extern _Atomic int ji_opt_phase, ji_opt_in_mb, ji_opt_ever;
JI_HIDDEN void ji_rcv_gate(void);
/* The watchdog's one entry: a fault it found, or NULL while a collective is
 * pending (has a peer started an epoch?). Returns when recovered, joined or
 * postponed; a fallback does not return. */
JI_HIDDEN void ji_rcv_watchdog(const ji_fault *f);
/* A fault found on an application thread. -2: postponed (another thread is
 * inside an NCCL group). */
JI_HIDDEN int ji_rcv_run(const ji_fault *f, int failed_in_group);
JI_HIDDEN int ji_rcv_after_block(unsigned gen, int cuda_rc, int check_nccl);
JI_HIDDEN int ji_rcv_nccl_error(int id, int rc);
JI_HIDDEN int ji_rcv_cuda_error(int rc);
/* One store query: joins a peer's epoch if one started (phase marks). */
JI_HIDDEN void ji_rcv_check_peers(void);
JI_HIDDEN void ji_rcv_reissue(ji_rec *r);
JI_HIDDEN __attribute__((noreturn)) void ji_rcv_reissue_failed(int status);

#pragma GCC visibility pop

#endif
