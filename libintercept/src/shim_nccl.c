/*
 * shim_nccl.c - NCCL hooks (forwarding to pnccl* when present).
 *
 * Collectives mark their stream as an NCCL stream and hand it to the watchdog,
 * which records its own completion event after the outermost ncclGroupEnd
 * (nothing is launched before it; synchronous ops run NCCL on the compute
 * stream, so the stream argument is the only reliable key).
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "shim_entry.h"

#define JI_PROTO_(name, ret, params, args, lib, flags) JI_API ret name params;
JI_TABLE(JI_PROTO_)
#undef JI_PROTO_

#define NO_LIB ncclSystemError
#define NCALL(expr) (ji_tls.depth++, __extension__({ ncclResult_t r_ = (expr); ji_tls.depth--; r_; }))
#define NXLATE(out, h)                                                       \
  void *out = (void *)(h);                                                   \
  do {                                                                       \
    if (ji_is_vh(h)) {                                                       \
      out = atomic_load_explicit(&((ji_vh *)(h))->phys, memory_order_acquire); \
      if (JI_UNLIKELY(!out)) return ncclInvalidArgument;                     \
    }                                                                        \
  } while (0)
#define U(x) ((uint64_t)(uintptr_t)(x))

static inline int ok(ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; }

static void log_words(int id, unsigned n, const uint64_t *w) {
  if (!ji_log_on()) return;
  ji_rec *r = ji_log_reserve(id, n, 0);
  if (!r) return;
  if (n) memcpy(r->a, w, n * sizeof(uint64_t));
  ji_log_commit(r);
}

JI_API ncclResult_t ncclGetUniqueId(ncclUniqueId *uniqueId) {
  ji_fn_ncclGetUniqueId fn = REAL(ncclGetUniqueId);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(uniqueId);
  COUNT(ncclGetUniqueId);
  return NCALL(fn(uniqueId));
}

static ji_vh *wrap_comm(ncclComm_t phys, int nranks, const ncclUniqueId *id, int rank, const ncclConfig_t *cfg,
                        ji_vh *parent, int color, int key) {
  struct ji_comm_info *ci = calloc(1, sizeof *ci);
  if (!ci) return NULL;
  ji_vh *v = ji_vh_alloc(JI_VK_COMM, phys);
  if (!v) {
    free(ci);
    return NULL;
  }
  ci->nranks = nranks;
  ci->rank = rank;
  if (id) ci->id = *id;
  if (cfg) {
    size_t n = cfg->size < sizeof ci->config ? cfg->size : sizeof ci->config;
    memcpy(&ci->config, cfg, n);
    ci->has_config = 1;
  }
  ci->parent = parent;
  ci->color = color;
  ci->key = key;
  v->comm = ci;
  ji_comms_add(v);
  ji_wd_start();
  return v;
}

static ncclResult_t comm_init(int id, ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                              ncclConfig_t *config) {
  void *fn = ji_real(id);
  if (!fn) return NO_LIB;
#define CI_CALL(p)                                                                        \
  (id == JI_ID_ncclCommInitRank ? ((ji_fn_ncclCommInitRank)fn)(p, nranks, commId, rank) \
                                : ((ji_fn_ncclCommInitRankConfig)fn)(p, nranks, commId, rank, config))
  if (ji_tls.depth || !comm) return CI_CALL(comm);
  ji_count(id);
  ncclComm_t phys = NULL;
  ji_park_enter();
  ncclResult_t r = NCALL(CI_CALL(&phys));
  ji_park_exit();
#undef CI_CALL
  if (!ok(r)) return r;
  ji_vh *v = wrap_comm(phys, nranks, &commId, rank, id == JI_ID_ncclCommInitRankConfig ? config : NULL, NULL, 0, 0);
  *comm = v ? (ncclComm_t)ji_vh_app(v) : phys;
  uint64_t w[3] = {U(*comm), (uint64_t)nranks, (uint64_t)rank};
  log_words(id, 3, w);
  return r;
}
JI_API ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
  return comm_init(JI_ID_ncclCommInitRank, comm, nranks, commId, rank, NULL);
}
JI_API ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank,
                                           ncclConfig_t *config) {
  return comm_init(JI_ID_ncclCommInitRankConfig, comm, nranks, commId, rank, config);
}

JI_API ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config) {
  ji_fn_ncclCommSplit fn = REAL(ncclCommSplit);
  if (!fn) return NO_LIB;
  if (ji_tls.depth || !newcomm) return fn(comm, color, key, newcomm, config);
  COUNT(ncclCommSplit);
  NXLATE(pc, comm);
  ncclComm_t phys = NULL;
  ji_park_enter();
  ncclResult_t r = NCALL(fn((ncclComm_t)pc, color, key, &phys, config));
  ji_park_exit();
  if (!ok(r)) return r;
  if (!phys) { /* NCCL_SPLIT_NOCOLOR */
    *newcomm = NULL;
    return r;
  }
  int rank = -1, nranks = -1;
  /* Not interposed: resolved ad hoc, only to label events with a rank. */
  jitabi_ncclCommUserRank_fn ur = (jitabi_ncclCommUserRank_fn)ji_sym_in_lib(JI_NCCL, "pncclCommUserRank");
  jitabi_ncclCommCount_fn cc = (jitabi_ncclCommCount_fn)ji_sym_in_lib(JI_NCCL, "pncclCommCount");
  if (ur) (void)NCALL(ur(phys, &rank));
  if (cc) (void)NCALL(cc(phys, &nranks));
  ji_vh *v = wrap_comm(phys, nranks, NULL, rank, config, ji_slot(comm), color, key);
  *newcomm = v ? (ncclComm_t)ji_vh_app(v) : phys;
  uint64_t w[4] = {U(*newcomm), U(comm), (uint64_t)color, (uint64_t)key};
  log_words(JI_ID_ncclCommSplit, 4, w);
  return r;
}

static ncclResult_t comm_end(int id, ncclComm_t comm) {
  ji_fn_ncclCommDestroy fn = (ji_fn_ncclCommDestroy)ji_real(id);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(comm);
  ji_count(id);
  NXLATE(pc, comm);
  ji_vh *v = ji_slot(comm);
  /* Out of the watchdog's poll set before the object goes away. */
  if (v) ji_comms_remove(v);
  if (id == JI_ID_ncclCommDestroy) ji_park_enter();
  ncclResult_t r = NCALL(fn((ncclComm_t)pc));
  if (id == JI_ID_ncclCommDestroy) ji_park_exit();
  uint64_t w[1] = {U(comm)};
  log_words(id, 1, w);
  if (v) ji_vh_free(v);
  return r;
}
JI_API ncclResult_t ncclCommDestroy(ncclComm_t comm) { return comm_end(JI_ID_ncclCommDestroy, comm); }
JI_API ncclResult_t ncclCommAbort(ncclComm_t comm) { return comm_end(JI_ID_ncclCommAbort, comm); }

JI_API ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
  ji_fn_ncclCommGetAsyncError fn = REAL(ncclCommGetAsyncError);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(comm, asyncError);
  COUNT(ncclCommGetAsyncError);
  NXLATE(pc, comm);
  return NCALL(fn((ncclComm_t)pc, asyncError));
}

/* Common tail of every collective: log, mark the stream, tell the watchdog. */
static void coll_done(int id, ncclComm_t comm, cudaStream_t stream, const uint64_t *w, unsigned n) {
  ji_mark_nccl_stream(stream, id);
  ji_watch_collective(id, stream, ji_slot(comm));
  log_words(id, n, w);
}

/* One collective hook. `args` is the call's argument list with the
 * communicator and stream written as c_ and s_: the application's handles
 * when the runtime calls back into us, else the physical ones. The call is
 * parked (it may block behind a hung peer); in recover mode an NCCL error
 * recovers (or joins a recovery) and the call is made again against the
 * re-created communicator and stream. `...`: the record's words, in the
 * order the replay reads them (send, recv, count, type, op/root/peer, comm,
 * stream[, root]). */
#define COLLECTIVE(name, args, ...)                                                          \
  ji_fn_##name fn = REAL(name);                                                              \
  if (!fn) return NO_LIB;                                                                    \
  ncclComm_t c_ = comm;                                                                      \
  cudaStream_t s_ = stream;                                                                  \
  if (ji_tls.depth) return fn args;                                                          \
  COUNT(name);                                                                               \
  if (JI_DISCARDED()) return ncclSuccess;                                                    \
  ncclResult_t r_;                                                                           \
  do {                                                                                       \
    NXLATE(pc_, comm);                                                                       \
    NXLATE(ps_, stream);                                                                     \
    c_ = (ncclComm_t)pc_, s_ = (cudaStream_t)ps_;                                            \
    ji_park_enter();                                                                         \
    r_ = NCALL(fn args);                                                                     \
    ji_park_exit();                                                                          \
  } while (JI_UNLIKELY(!ok(r_)) && ji_rcv_mode && ji_rcv_nccl_error(JI_ID_##name, r_));      \
  if (ok(r_)) {                                                                              \
    uint64_t w_[] = {__VA_ARGS__};                                                           \
    coll_done(JI_ID_##name, comm, stream, w_, sizeof w_ / sizeof w_[0]);                     \
  }                                                                                          \
  return r_

JI_API ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  COLLECTIVE(ncclAllReduce, (sendbuff, recvbuff, count, datatype, op, c_, s_), U(sendbuff), U(recvbuff), count,
             (uint64_t)datatype, (uint64_t)op, U(comm), U(stream));
}

JI_API ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  int root, ncclComm_t comm, cudaStream_t stream) {
  COLLECTIVE(ncclBroadcast, (sendbuff, recvbuff, count, datatype, root, c_, s_), U(sendbuff), U(recvbuff), count,
             (uint64_t)datatype, (uint64_t)(int64_t)root, U(comm), U(stream));
}

JI_API ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                               ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  COLLECTIVE(ncclReduce, (sendbuff, recvbuff, count, datatype, op, root, c_, s_), U(sendbuff), U(recvbuff), count,
             (uint64_t)datatype, (uint64_t)op, U(comm), U(stream), (uint64_t)(int64_t)root);
}

JI_API ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                                  ncclComm_t comm, cudaStream_t stream) {
  COLLECTIVE(ncclAllGather, (sendbuff, recvbuff, sendcount, datatype, c_, s_), U(sendbuff), U(recvbuff), sendcount,
             (uint64_t)datatype, 0, U(comm), U(stream));
}

JI_API ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream) {
  COLLECTIVE(ncclReduceScatter, (sendbuff, recvbuff, recvcount, datatype, op, c_, s_), U(sendbuff), U(recvbuff),
             recvcount, (uint64_t)datatype, (uint64_t)op, U(comm), U(stream));
}

JI_API ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream) {
  COLLECTIVE(ncclSend, (sendbuff, count, datatype, peer, c_, s_), U(sendbuff), 0, count, (uint64_t)datatype,
             (uint64_t)(int64_t)peer, U(comm), U(stream));
}

JI_API ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream) {
  COLLECTIVE(ncclRecv, (recvbuff, count, datatype, peer, c_, s_), 0, U(recvbuff), count, (uint64_t)datatype,
             (uint64_t)(int64_t)peer, U(comm), U(stream));
}

JI_API ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                              cudaStream_t stream) {
  COLLECTIVE(ncclBcast, (buff, count, datatype, root, c_, s_), U(buff), U(buff), count, (uint64_t)datatype,
             (uint64_t)(int64_t)root, U(comm), U(stream));
}

/* Calls that only take a communicator: translate and forward. */
JI_API ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  ji_fn_ncclCommFinalize fn = REAL(ncclCommFinalize);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn(comm);
  COUNT(ncclCommFinalize);
  NXLATE(pc, comm);
  ji_park_enter();
  ncclResult_t r = NCALL(fn((ncclComm_t)pc));
  ji_park_exit();
  return r;
}
#define COMM_FWD(name, params, ...)                 \
  JI_API ncclResult_t name params {                 \
    ji_fn_##name fn = REAL(name);                   \
    if (!fn) return NO_LIB;                         \
    if (ji_tls.depth) return fn(comm, __VA_ARGS__); \
    COUNT(name);                                    \
    NXLATE(pc, comm);                               \
    return NCALL(fn((ncclComm_t)pc, __VA_ARGS__));  \
  }
COMM_FWD(ncclCommCount, (const ncclComm_t comm, int *count), count)
COMM_FWD(ncclCommCuDevice, (const ncclComm_t comm, int *device), device)
COMM_FWD(ncclCommUserRank, (const ncclComm_t comm, int *rank), rank)
COMM_FWD(ncclCommRegister, (const ncclComm_t comm, void *buff, size_t size, void **handle), buff, size, handle)
COMM_FWD(ncclCommDeregister, (const ncclComm_t comm, void *handle), handle)

JI_API const char *ncclGetLastError(ncclComm_t comm) {
  ji_fn_ncclGetLastError fn = REAL(ncclGetLastError);
  if (!fn) return "libnccl is not loaded";
  if (ji_tls.depth) return fn(comm);
  COUNT(ncclGetLastError);
  ji_vh *v = ji_vh_of(comm);
  void *pc = v ? atomic_load(&v->phys) : (void *)comm;
  ji_tls.depth++;
  const char *r = fn((ncclComm_t)pc);
  ji_tls.depth--;
  return r;
}

JI_API ncclResult_t ncclGroupStart(void) {
  ji_fn_ncclGroupStart fn = REAL(ncclGroupStart);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn();
  COUNT(ncclGroupStart);
  ncclResult_t r = NCALL(fn());
  if (ok(r)) {
    if (ji_watch_group_depth() == 0) atomic_fetch_add(&ji_open_groups, 1);
    ji_watch_group_start();
    log_words(JI_ID_ncclGroupStart, 0, NULL);
  }
  return r;
}

JI_API ncclResult_t ncclGroupEnd(void) {
  ji_fn_ncclGroupEnd fn = REAL(ncclGroupEnd);
  if (!fn) return NO_LIB;
  if (ji_tls.depth) return fn();
  COUNT(ncclGroupEnd);
  ncclResult_t r;
  for (;;) {
    ji_park_enter();
    r = NCALL(fn());
    ji_park_exit();
    /* An error of a group's collective can surface here: recover, which
     * replays the group (this thread's depth is restored by the replay), and
     * end it again. */
    if (JI_LIKELY(ok(r)) || !ji_rcv_mode || !ji_rcv_nccl_error(JI_ID_ncclGroupEnd, r)) break;
  }
  if (ji_watch_group_depth() == 1) atomic_fetch_sub(&ji_open_groups, 1);
  ji_watch_group_end(ok(r));
  if (ok(r)) log_words(JI_ID_ncclGroupEnd, 0, NULL);
  return r;
}
