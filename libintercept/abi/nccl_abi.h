/*
 * nccl_abi.h - jitckpt's own declaration of the NCCL API subset that
 * libintercept interposes and the CPU stand-in (sim/) implements.
 *
 * Copied from nccl.h of NCCL 2.32.3 (nvidia-nccl-cu13 wheel). `make check-abi`
 * compiles abi/check_nccl_abi.c against the wheel's nccl.h when it is found
 * (NCCL_INCLUDE=...), asserting enum values, the ncclConfig_t layout and every
 * prototype. Only append; keep this stable, the shim includes it.
 *
 * Every ncclX is also exported as pncclX (PMPI-style; in real NCCL ncclX is a
 * weak alias of pncclX), so a hook on ncclX can forward to pncclX.
 */
#ifndef JITCKPT_NCCL_ABI_H
#define JITCKPT_NCCL_ABI_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda_abi.h"

#ifdef __cplusplus
extern "C" {
#endif

#define JITABI_NCCL_RESULTS(X) \
  X(ncclSuccess, 0) \
  X(ncclUnhandledCudaError, 1) \
  X(ncclSystemError, 2) \
  X(ncclInternalError, 3) \
  X(ncclInvalidArgument, 4) \
  X(ncclInvalidUsage, 5) \
  X(ncclRemoteError, 6) \
  X(ncclInProgress, 7) \
  X(ncclTimeout, 8) \
  X(ncclNumResults, 9)

#define JITABI_NCCL_REDOPS(X) \
  X(ncclSum, 0) \
  X(ncclProd, 1) \
  X(ncclMax, 2) \
  X(ncclMin, 3) \
  X(ncclAvg, 4) \
  X(ncclNumOps, 5)

#define JITABI_NCCL_DTYPES(X) \
  X(ncclInt8, 0) X(ncclChar, 0) \
  X(ncclUint8, 1) \
  X(ncclInt32, 2) X(ncclInt, 2) \
  X(ncclUint32, 3) \
  X(ncclInt64, 4) \
  X(ncclUint64, 5) \
  X(ncclFloat16, 6) X(ncclHalf, 6) \
  X(ncclFloat32, 7) X(ncclFloat, 7) \
  X(ncclFloat64, 8) X(ncclDouble, 8) \
  X(ncclBfloat16, 9) \
  X(ncclFloat8e4m3, 10) \
  X(ncclFloat8e5m2, 11) \
  X(ncclNumTypes, 12)

/* ncclConfig_t of NCCL 2.32 (struct ncclConfig_v23100), field by field, so the
 * check can compare every offset. Callers fill it with NCCL_CONFIG_INITIALIZER;
 * `size` and `version` let a library accept configs from older headers. */
#define JITABI_NCCL_CONFIG_FIELDS(X) \
  X(size_t, size) \
  X(unsigned int, magic) \
  X(unsigned int, version) \
  X(int, blocking) \
  X(int, cgaClusterSize) \
  X(int, minCTAs) \
  X(int, maxCTAs) \
  X(const char *, netName) \
  X(int, splitShare) \
  X(int, trafficClass) \
  X(const char *, commName) \
  X(int, collnetEnable) \
  X(int, CTAPolicy) \
  X(int, shrinkShare) \
  X(int, nvlsCTAs) \
  X(int, nChannelsPerNetPeer) \
  X(int, nvlinkCentricSched) \
  X(int, graphUsageMode) \
  X(int, numRmaCtx) \
  X(int, maxP2pPeers) \
  X(int, graphStreamOrdering) \
  X(int, launchOrderImplicit) \
  X(int, numRmaSig) \
  X(int, rmaEagerInit) \
  X(int, hostCftMode) \
  X(int, nvlsHostMode)

#define JITABI_NCCL_FIELD_(type, name) type name;
/* Always defined under our own tag so the ABI check can compare layouts. */
struct jitabi_ncclConfig { JITABI_NCCL_CONFIG_FIELDS(JITABI_NCCL_FIELD_) };
#undef JITABI_NCCL_FIELD_

#ifndef JITABI_USE_REAL_NCCL_TYPES

#define NCCL_MAJOR 2
#define NCCL_MINOR 32
#define NCCL_PATCH 3
#define NCCL_SUFFIX ""
#define NCCL_VERSION_CODE 23203
#define NCCL_VERSION(X, Y, Z) \
  (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))

typedef struct ncclComm *ncclComm_t;
#define NCCL_COMM_NULL NULL

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct { char internal[NCCL_UNIQUE_ID_BYTES]; } ncclUniqueId;

#define JITABI_ENUM_ITEM_(name, value) name = value,
typedef enum { JITABI_NCCL_RESULTS(JITABI_ENUM_ITEM_) } ncclResult_t;
typedef enum { ncclNumOps_dummy = 5 } ncclRedOp_dummy_t;
typedef enum {
  JITABI_NCCL_REDOPS(JITABI_ENUM_ITEM_)
  ncclMaxRedOp = 0x7fffffff >> (32 - 8 * sizeof(ncclRedOp_dummy_t))
} ncclRedOp_t;
typedef enum { JITABI_NCCL_DTYPES(JITABI_ENUM_ITEM_) } ncclDataType_t;
#undef JITABI_ENUM_ITEM_

typedef struct jitabi_ncclConfig ncclConfig_t;

#define NCCL_CONFIG_UNDEF_INT INT_MIN
#define NCCL_CONFIG_UNDEF_PTR NULL
#define NCCL_SPLIT_NOCOLOR -1
#define NCCL_API_MAGIC 0xcafebeef

#define NCCL_CONFIG_INITIALIZER {                                     \
  sizeof(ncclConfig_t), NCCL_API_MAGIC, NCCL_VERSION_CODE,            \
  NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, \
  NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_PTR, NCCL_CONFIG_UNDEF_INT, \
  NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_PTR, NCCL_CONFIG_UNDEF_INT, \
  NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, \
  NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, \
  NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, \
  NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT, \
  NCCL_CONFIG_UNDEF_INT, NCCL_CONFIG_UNDEF_INT }

#endif /* JITABI_USE_REAL_NCCL_TYPES */

/* F(return type, name, (params), (arg names)); each name also exists as p##name. */
#define JITABI_NCCL_FUNCS(F) \
  F(ncclResult_t, ncclGetVersion, (int *version), (version)) \
  F(ncclResult_t, ncclGetUniqueId, (ncclUniqueId *uniqueId), (uniqueId)) \
  F(ncclResult_t, ncclCommInitRank, (ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank), (comm, nranks, commId, rank)) \
  F(ncclResult_t, ncclCommInitRankConfig, (ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t *config), (comm, nranks, commId, rank, config)) \
  F(ncclResult_t, ncclCommSplit, (ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config), (comm, color, key, newcomm, config)) \
  F(ncclResult_t, ncclCommFinalize, (ncclComm_t comm), (comm)) \
  F(ncclResult_t, ncclCommDestroy, (ncclComm_t comm), (comm)) \
  F(ncclResult_t, ncclCommAbort, (ncclComm_t comm), (comm)) \
  F(ncclResult_t, ncclCommGetAsyncError, (ncclComm_t comm, ncclResult_t *asyncError), (comm, asyncError)) \
  F(ncclResult_t, ncclCommCount, (const ncclComm_t comm, int *count), (comm, count)) \
  F(ncclResult_t, ncclCommCuDevice, (const ncclComm_t comm, int *device), (comm, device)) \
  F(ncclResult_t, ncclCommUserRank, (const ncclComm_t comm, int *rank), (comm, rank)) \
  F(ncclResult_t, ncclCommRegister, (const ncclComm_t comm, void *buff, size_t size, void **handle), (comm, buff, size, handle)) \
  F(ncclResult_t, ncclCommDeregister, (const ncclComm_t comm, void *handle), (comm, handle)) \
  F(const char *, ncclGetErrorString, (ncclResult_t result), (result)) \
  F(const char *, ncclGetLastError, (ncclComm_t comm), (comm)) \
  F(ncclResult_t, ncclGroupStart, (void), ()) \
  F(ncclResult_t, ncclGroupEnd, (void), ()) \
  F(ncclResult_t, ncclAllReduce, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, count, datatype, op, comm, stream)) \
  F(ncclResult_t, ncclBroadcast, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, count, datatype, root, comm, stream)) \
  F(ncclResult_t, ncclBcast, (void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream), (buff, count, datatype, root, comm, stream)) \
  F(ncclResult_t, ncclReduce, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, count, datatype, op, root, comm, stream)) \
  F(ncclResult_t, ncclAllGather, (const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, sendcount, datatype, comm, stream)) \
  F(ncclResult_t, ncclReduceScatter, (const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, recvcount, datatype, op, comm, stream)) \
  F(ncclResult_t, ncclSend, (const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream), (sendbuff, count, datatype, peer, comm, stream)) \
  F(ncclResult_t, ncclRecv, (void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream), (recvbuff, count, datatype, peer, comm, stream))

/* Prototypes for ncclX and pncclX plus pointer typedefs jitabi_ncclX_fn. */
#define JITABI_DECLARE_(ret, name, params, args) \
  ret name params; \
  ret p##name params; \
  typedef ret (*jitabi_##name##_fn) params;
JITABI_NCCL_FUNCS(JITABI_DECLARE_)
#undef JITABI_DECLARE_

#ifdef __cplusplus
}
#endif

#endif /* JITCKPT_NCCL_ABI_H */
