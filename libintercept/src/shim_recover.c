/*
 * shim_recover.c - re-creating physical objects behind virtual handles
 * (paper §4.2: "return virtual handles to the application ... and map these
 * virtual handles to new physical handles after re-creating the GPU objects").
 */
#define _GNU_SOURCE
#include <string.h>

#include "jitintercept.h"
#include "shim_recovery.h"

struct rc_arg {
  int destroy_old;
  int n;
  int err;
};

static void recreate_stream(ji_vh *v, void *p) {
  struct rc_arg *a = p;
  ji_fn_cudaStreamCreateWithPriority cr = REAL(cudaStreamCreateWithPriority);
  ji_fn_cudaStreamDestroy de = REAL(cudaStreamDestroy);
  cudaStream_t s = NULL;
  if (!cr) { a->err = cudaErrorInitializationError; return; }
  cudaError_t r = cr(&s, v->cflags, v->prio);
  if (r != cudaSuccess) { a->err = r; return; }
  void *old = atomic_exchange(&v->phys, (void *)s);
  if (a->destroy_old && old && de) de((cudaStream_t)old);
  a->n++;
}

static void recreate_event(ji_vh *v, void *p) {
  struct rc_arg *a = p;
  ji_fn_cudaEventCreateWithFlags cr = REAL(cudaEventCreateWithFlags);
  ji_fn_cudaEventDestroy de = REAL(cudaEventDestroy);
  cudaEvent_t e = NULL;
  if (!cr) { a->err = cudaErrorInitializationError; return; }
  cudaError_t r = cr(&e, v->cflags);
  if (r != cudaSuccess) { a->err = r; return; }
  void *old = atomic_exchange(&v->phys, (void *)e);
  /* A fresh event has no pending record: the Fig. 3 bookkeeping restarts. */
  atomic_store(&v->rec_stream, NULL);
  atomic_fetch_add(&v->rec_seq, 1);
  if (a->destroy_old && old && de) de((cudaEvent_t)old);
  a->n++;
}

JI_API int jitintercept_recreate_handles(int destroy_old) {
  struct rc_arg a = {destroy_old, 0, 0};
  ji_watch_reset();
  ji_tls.depth++;
  ji_vh_foreach(JI_VK_STREAM, recreate_stream, &a);
  ji_vh_foreach(JI_VK_EVENT, recreate_event, &a);
  ji_tls.depth--;
  return a.err ? -a.err : a.n;
}

JI_API int jitintercept_comm_recreate(void *comm, const void *unique_id) {
  ji_vh *v = ji_vh_of(comm);
  if (!v || v->kind != JI_VK_COMM || !v->comm || !unique_id) return ncclInvalidArgument;
  struct ji_comm_info *ci = v->comm;
  if (ci->parent) return ncclInvalidUsage; /* split children: re-split from the re-created parent */
  ji_fn_ncclCommAbort ab = REAL(ncclCommAbort);
  ji_fn_ncclCommInitRankConfig irc = REAL(ncclCommInitRankConfig);
  ji_fn_ncclCommInitRank ir = REAL(ncclCommInitRank);
  ncclUniqueId id;
  memcpy(&id, unique_id, sizeof id);
  ncclComm_t fresh = NULL;
  ji_comms_remove(v);
  ji_tls.depth++;
  /* Abort first: the old communicator may be stuck in a collective and its
   * streams blocked; abort is the call that unblocks them. */
  void *old = atomic_load(&v->phys);
  if (old && ab) ab((ncclComm_t)old);
  ncclResult_t r;
  if (ci->has_config && irc) r = irc(&fresh, ci->nranks, id, ci->rank, &ci->config);
  else if (ir) r = ir(&fresh, ci->nranks, id, ci->rank);
  else r = ncclSystemError;
  ji_tls.depth--;
  if (r != ncclSuccess && r != ncclInProgress) {
    atomic_store(&v->phys, NULL);
    return r;
  }
  ci->id = id;
  atomic_store(&v->phys, (void *)fresh);
  ji_comms_add(v);
  return r;
}
