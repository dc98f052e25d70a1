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

#include "shim_internal.h"

#define JI_PROTO_(name, ret, params, args, lib, flags) JI_API ret name params;
JI_TABLE(JI_PROTO_)
#undef JI_PROTO_

#define NO_LIB ncclSystemError
#define NCALL(expr) (ji_tls_depth++, __extension__({ ncclResult_t r_ = (expr); ji_tls_depth--; r_; }))
#define NXLATE(out, h)                                                       \
  void *out = (void *)(h);                                                   \
  do {                                                                       \
    ji_vh *v_ = ji_vh_of(h);                                                 \
    if (v_) {                                                                \
      out = atomic_load_explicit(&v_->phys, memory_order_acquire);           \
      if (JI_UNLIKELY(!out)) return ncclInvalidArgument;                     \
    }                                                                        \
  } while (0)
#define U(x) ((uint64_t)(uintptr_t)(x))

static inline int ok(ncclResult_t r) { return r == ncclSuccess || r == ncclInProgress; }

/* NCCL streams that are not virtual handles (stream 0, per-thread, created
 * before the shim): few, so a small append-only array scanned linearly. */
#define NV_MAX 32
static _Atomic(void *) nv_streams[NV_MAX];
static _Atomic int nv_n;

void ji_mark_nccl_stream(cudaStream_t s, int coll) {
  ji_vh *v = ji_slot(s);
  if (v) {
    if (!(atomic_load_explicit(&v->sflags, memory_order_relaxed) & JI_VH_NCCL))
      atomic_fetch_or(&v->sflags, JI_VH_NCCL);
    atomic_store_explicit(&v->last_coll, (uint32_t)coll, memory_order_relaxed);
    return;
  }
  if (ji_is_nccl_stream(s)) return;
  int i = atomic_fetch_add(&nv_n, 1);
  if (i < NV_MAX) atomic_store(&nv_streams[i], (void *)s);
}

int ji_is_nccl_stream(cudaStream_t s) {
  ji_vh *v = ji_slot(s);
  if (v) return (atomic_load_explicit(&v->sflags, memory_order_relaxed) & JI_VH_NCCL) != 0;
  int n = atomic_load_explicit(&nv_n, memory_order_relaxed);
  if (n > NV_MAX) n = NV_MAX;
  for (int i = 0; i < n; i++)
    if (atomic_load_explicit(&nv_streams[i], memory_order_relaxed) == (void *)s) return 1;
  return 0;
}

void ji_nccl_nv_streams(void **out, int *n, int max) {
  int m = atomic_load(&nv_n);
  if (m > NV_MAX) m = NV_MAX;
  for (int i = 0; i < m; i++) {
    void *s = atomic_load(&nv_streams[i]);
    int dup = 0;
    for (int j = 0; j < *n; j++) dup |= out[j] == s;
    if (!dup && *n < max) out[(*n)++] = s;
  }
}

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
  if (ji_tls_depth) return fn(uniqueId);
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
  ji_wd_comm_add(v);
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
  if (ji_tls_depth || !comm) return CI_CALL(comm);
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
  if (ji_tls_depth || !newcomm) return fn(comm, color, key, newcomm, config);
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
  if (ji_tls_depth) return fn(comm);
  ji_count(id);
  NXLATE(pc, comm);
  ji_vh *v = ji_slot(comm);
  /* Out of the watchdog's poll set before the object goes away. */
  if (v) ji_wd_comm_remove(v);
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
  if (ji_tls_depth) return fn(comm, asyncError);
  COUNT(ncclCommGetAsyncError);
  NXLATE(pc, comm);
  return NCALL(fn((ncclComm_t)pc, asyncError));
}

/* Common tail of every collective: log, mark the stream, tell the watchdog. */
static void coll_done(int id, ncclComm_t comm, cudaStream_t stream, const uint64_t *w, unsigned n) {
  ji_mark_nccl_stream(stream, id);
  ji_wd_collective(id, stream, ji_slot(comm));
  log_words(id, n, w);
}

#define COLL_PRE(name, ...)                       \
  ji_fn_##name fn = REAL(name);                   \
  if (!fn) return NO_LIB;                         \
  if (ji_tls_depth) return fn(__VA_ARGS__);       \
  COUNT(name);                                    \
  if (JI_DISCARDED()) return ncclSuccess;         \
  NXLATE(pc, comm);                               \
  NXLATE(ps, stream)

JI_API ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  COLL_PRE(ncclAllReduce, sendbuff, recvbuff, count, datatype, op, comm, stream);
  ncclResult_t r;
retry:
  ji_park_enter();
  r = NCALL(fn(sendbuff, recvbuff, count, datatype, op, (ncclComm_t)pc, (cudaStream_t)ps));
  ji_park_exit();
  if (JI_UNLIKELY(!ok(r)) && ji_rcv_mode && ji_rcv_nccl_error(JI_ID_ncclAllReduce, r)) {
    NXLATE(pc2, comm);
    NXLATE(ps2, stream);
    pc = pc2, ps = ps2;
    goto retry;
  }
  if (ok(r)) {
    uint64_t w[7] = {U(sendbuff), U(recvbuff), count, (uint64_t)datatype, (uint64_t)op, U(comm), U(stream)};
    coll_done(JI_ID_ncclAllReduce, comm, stream, w, 7);
  }
  return r;
}

JI_API ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                                  int root, ncclComm_t comm, cudaStream_t stream) {
  COLL_PRE(ncclBroadcast, sendbuff, recvbuff, count, datatype, root, comm, stream);
  ncclResult_t r;
retry:
  ji_park_enter();
  r = NCALL(fn(sendbuff, recvbuff, count, datatype, root, (ncclComm_t)pc, (cudaStream_t)ps));
  ji_park_exit();
  if (JI_UNLIKELY(!ok(r)) && ji_rcv_mode && ji_rcv_nccl_error(JI_ID_ncclBroadcast, r)) {
    NXLATE(pc2, comm);
    NXLATE(ps2, stream);
    pc = pc2, ps = ps2;
    goto retry;
  }
  if (ok(r)) {
    uint64_t w[7] = {U(sendbuff), U(recvbuff), count, (uint64_t)datatype, (uint64_t)(int64_t)root, U(comm),
                     U(stream)};
    coll_done(JI_ID_ncclBroadcast, comm, stream, w, 7);
  }
  return r;
}

JI_API ncclResult_t ncclReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype,
                               ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
  COLL_PRE(ncclReduce, sendbuff, recvbuff, count, datatype, op, root, comm, stream);
  ncclResult_t r;
retry:
  ji_park_enter();
  r = NCALL(fn(sendbuff, recvbuff, count, datatype, op, root, (ncclComm_t)pc, (cudaStream_t)ps));
  ji_park_exit();
  if (JI_UNLIKELY(!ok(r)) && ji_rcv_mode && ji_rcv_nccl_error(JI_ID_ncclReduce, r)) {
    NXLATE(pc2, comm);
    NXLATE(ps2, stream);
    pc = pc2, ps = ps2;
    goto retry;
  }
  if (ok(r)) {
    uint64_t w[8] = {U(sendbuff), U(recvbuff), count, (uint64_t)datatype, (uint64_t)op, U(comm), U(stream),
                     (uint64_t)(int64_t)root};
    coll_done(JI_ID_ncclReduce, comm, stream, w, 8);
  }
  return r;
}

JI_API ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype,
                                  ncclComm_t comm, cudaStream_t stream) {
  COLL_PRE(ncclAllGather, sendbuff, recvbuff, sendcount, datatype, comm, stream);
  ncclResult_t r;
retry:
  ji_park_enter();
  r = NCALL(fn(sendbuff, recvbuff, sendcount, datatype, (ncclComm_t)pc, (cudaStream_t)ps));
  ji_park_exit();
  if (JI_UNLIKELY(!ok(r)) && ji_rcv_mode && ji_rcv_nccl_error(JI_ID_ncclAllGather, r)) {
    NXLATE(pc2, comm);
    NXLATE(ps2, stream);
    pc = pc2, ps = ps2;
    goto retry;
  }
  if (ok(r)) {
    uint64_t w[7] = {U(sendbuff), U(recvbuff), sendcount, (uint64_t)datatype, 0, U(comm), U(stream)};
    coll_done(JI_ID_ncclAllGather, comm, stream, w, 7);
  }
  return r;
}

JI_API ncclResult_t ncclReduceScatter(const void *sendbuff, void *recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream) {
  COLL_PRE(ncclReduceScatter, sendbuff, recvbuff, recvcount, datatype, op, comm, stream);
  ncclResult_t r;
retry:
  ji_park_enter();
  r = NCALL(fn(sendbuff, recvbuff, recvcount, datatype, op, (ncclComm_t)pc, (cudaStream_t)ps));
  ji_park_exit();
  if (JI_UNLIKELY(!ok(r)) && ji_rcv_mode && ji_rcv_nccl_error(JI_ID_ncclReduceScatter, r)) {
    NXLATE(pc2, comm);
    NXLATE(ps2, stream);
    pc = pc2, ps = ps2;
    goto retry;
  }
  if (ok(r)) {
    uint64_t w[7] = {U(sendbuff), U(recvbuff), recvcount, (uint64_t)datatype, (uint64_t)op, U(comm), U(stream)};
    coll_done(JI_ID_ncclReduceScatter, comm, stream, w, 7);
  }
  return r;
}

JI_API ncclResult_t ncclSend(const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream) {
  COLL_PRE(ncclSend, sendbuff, count, datatype, peer, comm, stream);
  ncclResult_t r;
retry:
  ji_park_enter();
  r = NCALL(fn(sendbuff, count, datatype, peer, (ncclComm_t)pc, (cudaStream_t)ps));
  ji_park_exit();
  if (JI_UNLIKELY(!ok(r)) && ji_rcv_mode && ji_rcv_nccl_error(JI_ID_ncclSend, r)) {
    NXLATE(pc2, comm);
    NXLATE(ps2, stream);
    pc = pc2, ps = ps2;
    goto retry;
  }
  if (ok(r)) {
    uint64_t w[7] = {U(sendbuff), 0, count, (uint64_t)datatype, (uint64_t)(int64_t)peer, U(comm), U(stream)};
    coll_done(JI_ID_ncclSend, comm, stream, w, 7);
  }
  return r;
}

JI_API ncclResult_t ncclRecv(void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                             cudaStream_t stream) {
  COLL_PRE(ncclRecv, recvbuff, count, datatype, peer, comm, stream);
  ncclResult_t r;
retry:
  ji_park_enter();
  r = NCALL(fn(recvbuff, count, datatype, peer, (ncclComm_t)pc, (cudaStream_t)ps));
  ji_park_exit();
  if (JI_UNLIKELY(!ok(r)) && ji_rcv_mode && ji_rcv_nccl_error(JI_ID_ncclRecv, r)) {
    NXLATE(pc2, comm);
    NXLATE(ps2, stream);
    pc = pc2, ps = ps2;
    goto retry;
  }
  if (ok(r)) {
    uint64_t w[7] = {0, U(recvbuff), count, (uint64_t)datatype, (uint64_t)(int64_t)peer, U(comm), U(stream)};
    coll_done(JI_ID_ncclRecv, comm, stream, w, 7);
  }
  return r;
}

JI_API ncclResult_t ncclBcast(void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm,
                              cudaStream_t stream) {
  COLL_PRE(ncclBcast, buff, count, datatype, root, comm, stream);
  ncclResult_t r;
retry:
  ji_park_enter();
  r = NCALL(fn(buff, count, datatype, root, (ncclComm_t)pc, (cudaStream_t)ps));
  ji_park_exit();
  if (JI_UNLIKELY(!ok(r)) && ji_rcv_mode && ji_rcv_nccl_error(JI_ID_ncclBcast, r)) {
    NXLATE(pc2, comm);
    NXLATE(ps2, stream);
    pc = pc2, ps = ps2;
    goto retry;
  }
  if (ok(r)) {
    uint64_t w[7] = {U(buff), U(buff), count, (uint64_t)datatype, (uint64_t)(int64_t)root, U(comm), U(stream)};
    coll_done(JI_ID_ncclBcast, comm, stream, w, 7);
  }
  return r;
}

/* Calls that only take a communicator: translate and forward. */
JI_API ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  ji_fn_ncclCommFinalize fn = REAL(ncclCommFinalize);
  if (!fn) return NO_LIB;
  if (ji_tls_depth) return fn(comm);
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
    if (ji_tls_depth) return fn(comm, __VA_ARGS__); \
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
  if (ji_tls_depth) return fn(comm);
  COUNT(ncclGetLastError);
  ji_vh *v = ji_vh_of(comm);
  void *pc = v ? atomic_load(&v->phys) : (void *)comm;
  ji_tls_depth++;
  const char *r = fn((ncclComm_t)pc);
  ji_tls_depth--;
  return r;
}

JI_API ncclResult_t ncclGroupStart(void) {
  ji_fn_ncclGroupStart fn = REAL(ncclGroupStart);
  if (!fn) return NO_LIB;
  if (ji_tls_depth) return fn();
  COUNT(ncclGroupStart);
  ncclResult_t r = NCALL(fn());
  if (ok(r)) {
    if (ji_wd_group_depth() == 0) atomic_fetch_add(&ji_open_groups, 1);
    ji_wd_group_start();
    log_words(JI_ID_ncclGroupStart, 0, NULL);
  }
  return r;
}

JI_API ncclResult_t ncclGroupEnd(void) {
  ji_fn_ncclGroupEnd fn = REAL(ncclGroupEnd);
  if (!fn) return NO_LIB;
  if (ji_tls_depth) return fn();
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
  if (ji_wd_group_depth() == 1) atomic_fetch_sub(&ji_open_groups, 1);
  ji_wd_group_end(ok(r));
  if (ok(r)) log_words(JI_ID_ncclGroupEnd, 0, NULL);
  return r;
}
