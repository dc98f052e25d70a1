/*
 * shim_comms.c - the live communicators: polled for NCCL async errors (by the
 * watchdog, and by a blocking hook in recover mode), aborted all at once
 * (JITCKPT_ON_HANG=abort), and the device the first one was made on (the
 * watchdog thread makes it its own).
 *
 * Lock: comms_mu guards the list and is held across ncclCommGetAsyncError
 * (non-blocking) so that a poll never races ncclCommDestroy: the destroy hook
 * removes the communicator here before destroying it.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>

#include "shim_base.h"

#define COMMS_MAX 256
static pthread_mutex_t comms_mu = PTHREAD_MUTEX_INITIALIZER;
static ji_vh *comms[COMMS_MAX];
static int ncomms;
static _Atomic int first_device = -1;

void ji_comms_add(ji_vh *vc) {
  if (atomic_load(&first_device) < 0) {
    jitabi_cudaGetDevice_fn getdev = (jitabi_cudaGetDevice_fn)ji_sym_in_lib(JI_CUDART, "cudaGetDevice");
    int dev = -1;
    if (getdev && getdev(&dev) == cudaSuccess) atomic_store(&first_device, dev);
  }
  pthread_mutex_lock(&comms_mu);
  if (ncomms < COMMS_MAX) comms[ncomms++] = vc;
  pthread_mutex_unlock(&comms_mu);
}

void ji_comms_remove(ji_vh *vc) {
  pthread_mutex_lock(&comms_mu);
  for (int i = 0; i < ncomms; i++)
    if (comms[i] == vc) {
      comms[i] = comms[--ncomms];
      break;
    }
  pthread_mutex_unlock(&comms_mu);
}

int ji_comms_device(void) { return atomic_load(&first_device); }

int ji_comm_rank(const ji_vh *vc) {
  if (vc && vc->comm) return vc->comm->rank;
  const char *r = ji_getenv("RANK");
  return r ? atoi(r) : -1;
}

/* First NCCL async error of a live communicator (0: none) and its rank. */
int ji_comms_async_error(int *rank) {
  ji_fn_ncclCommGetAsyncError ge = REAL(ncclCommGetAsyncError);
  int err = 0;
  if (!ge) return 0;
  pthread_mutex_lock(&comms_mu);
  for (int i = 0; i < ncomms && !err; i++) {
    void *pc = atomic_load(&comms[i]->phys);
    ncclResult_t ar = ncclSuccess;
    if (!pc) continue;
    ji_tls.depth++;
    ncclResult_t rr = ge((ncclComm_t)pc, &ar);
    ji_tls.depth--;
    if (rr == ncclSuccess && ar != ncclSuccess && ar != ncclInProgress) err = (int)ar, *rank = ji_comm_rank(comms[i]);
  }
  pthread_mutex_unlock(&comms_mu);
  return err;
}

/* Unblocks every stream stuck in a collective (the application then sees
 * NCCL errors). The aborts run outside the lock. */
void ji_comms_abort_all(void) {
  ji_fn_ncclCommAbort ab = REAL(ncclCommAbort);
  if (!ab) return;
  pthread_mutex_lock(&comms_mu);
  int n = ncomms;
  void *phys[COMMS_MAX];
  for (int i = 0; i < n; i++) phys[i] = atomic_load(&comms[i]->phys);
  pthread_mutex_unlock(&comms_mu);
  for (int i = 0; i < n; i++)
    if (phys[i]) ab((ncclComm_t)phys[i]);
}

/* A forked child owns none of the parent's communicators. */
void ji_comms_atfork_child(void) {
  pthread_mutex_init(&comms_mu, NULL);
  ncomms = 0;
}
