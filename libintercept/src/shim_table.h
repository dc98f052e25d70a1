/*
 * shim_table.h - the single list of interposed symbols.
 *
 * X(name, ret, params, args, lib, flags)
 *   lib:   JI_CUDART or JI_NCCL: where the real symbol is looked up.
 *   flags: JI_BLOCK - may block the calling host thread until device work
 *                     (possibly a hung collective) finishes; such calls mark
 *                     the thread "parked" so the watchdog may release its GIL.
 *          JI_COLL  - enqueues NCCL work on its stream argument.
 *          JI_HOT   - off the hang path and called per op; must stay lock-free.
 *
 * This list drives: the exported prototypes (re-declared here, so any drift
 * from abi/ is a compile error), the real-function pointer typedefs, the
 * enum of ids, real-symbol resolution (name strings) and the counters array.
 * tests/intercept/test_shim_table.py checks that `nm -D` of the .so exports
 * every entry and that the runtime counter list has the same length/order.
 */
#ifndef JI_SHIM_TABLE_H
#define JI_SHIM_TABLE_H

#define JI_CUDART 0
#define JI_NCCL 1

#define JI_BLOCK 1u
#define JI_COLL 2u
#define JI_HOT 4u

#define JI_LAUNCH_PARAMS (const void *func, dim3 gridDim, dim3 blockDim, void **args, size_t sharedMem, cudaStream_t stream)
#define JI_LAUNCH_ARGS (func, gridDim, blockDim, args, sharedMem, stream)
#define JI_KLAUNCH_PARAMS (cudaKernel_t kernel, dim3 gridDim, dim3 blockDim, void **args, size_t sharedMem, cudaStream_t stream)
#define JI_KLAUNCH_ARGS (kernel, gridDim, blockDim, args, sharedMem, stream)
#define JI_MEMCPY_PARAMS (void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
#define JI_MEMCPYA_PARAMS (void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream)

#define JI_TABLE(X) \
  X(cudaEventCreate, cudaError_t, (cudaEvent_t *event), (event), JI_CUDART, 0) \
  X(cudaEventCreateWithFlags, cudaError_t, (cudaEvent_t *event, unsigned int flags), (event, flags), JI_CUDART, 0) \
  X(cudaEventDestroy, cudaError_t, (cudaEvent_t event), (event), JI_CUDART, 0) \
  X(cudaEventRecord, cudaError_t, (cudaEvent_t event, cudaStream_t stream), (event, stream), JI_CUDART, JI_HOT) \
  X(cudaEventRecord_ptsz, cudaError_t, (cudaEvent_t event, cudaStream_t stream), (event, stream), JI_CUDART, JI_HOT) \
  X(cudaEventRecordWithFlags, cudaError_t, (cudaEvent_t event, cudaStream_t stream, unsigned int flags), (event, stream, flags), JI_CUDART, JI_HOT) \
  X(cudaEventRecordWithFlags_ptsz, cudaError_t, (cudaEvent_t event, cudaStream_t stream, unsigned int flags), (event, stream, flags), JI_CUDART, JI_HOT) \
  X(cudaEventQuery, cudaError_t, (cudaEvent_t event), (event), JI_CUDART, JI_HOT) \
  X(cudaEventSynchronize, cudaError_t, (cudaEvent_t event), (event), JI_CUDART, JI_BLOCK) \
  X(cudaStreamCreate, cudaError_t, (cudaStream_t *pStream), (pStream), JI_CUDART, 0) \
  X(cudaStreamCreateWithFlags, cudaError_t, (cudaStream_t *pStream, unsigned int flags), (pStream, flags), JI_CUDART, 0) \
  X(cudaStreamCreateWithPriority, cudaError_t, (cudaStream_t *pStream, unsigned int flags, int priority), (pStream, flags, priority), JI_CUDART, 0) \
  X(cudaStreamDestroy, cudaError_t, (cudaStream_t stream), (stream), JI_CUDART, 0) \
  X(cudaStreamWaitEvent, cudaError_t, (cudaStream_t stream, cudaEvent_t event, unsigned int flags), (stream, event, flags), JI_CUDART, JI_HOT) \
  X(cudaStreamWaitEvent_ptsz, cudaError_t, (cudaStream_t stream, cudaEvent_t event, unsigned int flags), (stream, event, flags), JI_CUDART, JI_HOT) \
  X(cudaStreamSynchronize, cudaError_t, (cudaStream_t stream), (stream), JI_CUDART, JI_BLOCK) \
  X(cudaStreamSynchronize_ptsz, cudaError_t, (cudaStream_t stream), (stream), JI_CUDART, JI_BLOCK) \
  X(cudaDeviceSynchronize, cudaError_t, (void), (), JI_CUDART, JI_BLOCK) \
  X(cudaMalloc, cudaError_t, (void **devPtr, size_t size), (devPtr, size), JI_CUDART, JI_BLOCK) \
  X(cudaFree, cudaError_t, (void *devPtr), (devPtr), JI_CUDART, JI_BLOCK) \
  X(cudaMemcpy, cudaError_t, JI_MEMCPY_PARAMS, (dst, src, count, kind), JI_CUDART, JI_BLOCK) \
  X(cudaMemcpy_ptds, cudaError_t, JI_MEMCPY_PARAMS, (dst, src, count, kind), JI_CUDART, JI_BLOCK) \
  X(cudaMemcpyAsync, cudaError_t, JI_MEMCPYA_PARAMS, (dst, src, count, kind, stream), JI_CUDART, JI_BLOCK) \
  X(cudaMemcpyAsync_ptsz, cudaError_t, JI_MEMCPYA_PARAMS, (dst, src, count, kind, stream), JI_CUDART, JI_BLOCK) \
  X(cudaLaunchKernel, cudaError_t, JI_LAUNCH_PARAMS, JI_LAUNCH_ARGS, JI_CUDART, JI_HOT) \
  X(cudaLaunchKernel_ptsz, cudaError_t, JI_LAUNCH_PARAMS, JI_LAUNCH_ARGS, JI_CUDART, JI_HOT) \
  X(__cudaGetKernel, cudaError_t, (cudaKernel_t *kernel, const void *func), (kernel, func), JI_CUDART, 0) \
  X(__cudaLaunchKernel, cudaError_t, JI_KLAUNCH_PARAMS, JI_KLAUNCH_ARGS, JI_CUDART, JI_HOT) \
  X(__cudaLaunchKernel_ptsz, cudaError_t, JI_KLAUNCH_PARAMS, JI_KLAUNCH_ARGS, JI_CUDART, JI_HOT) \
  X(cudaStreamQuery, cudaError_t, (cudaStream_t stream), (stream), JI_CUDART, JI_HOT) \
  X(cudaStreamQuery_ptsz, cudaError_t, (cudaStream_t stream), (stream), JI_CUDART, JI_HOT) \
  X(cudaStreamGetFlags, cudaError_t, (cudaStream_t hStream, unsigned int *flags), (hStream, flags), JI_CUDART, 0) \
  X(cudaStreamGetFlags_ptsz, cudaError_t, (cudaStream_t hStream, unsigned int *flags), (hStream, flags), JI_CUDART, 0) \
  X(cudaStreamGetPriority, cudaError_t, (cudaStream_t hStream, int *priority), (hStream, priority), JI_CUDART, 0) \
  X(cudaStreamGetPriority_ptsz, cudaError_t, (cudaStream_t hStream, int *priority), (hStream, priority), JI_CUDART, 0) \
  X(cudaStreamAddCallback, cudaError_t, (cudaStream_t stream, cudaStreamCallback_t callback, void *userData, unsigned int flags), (stream, callback, userData, flags), JI_CUDART, 0) \
  X(cudaStreamAddCallback_ptsz, cudaError_t, (cudaStream_t stream, cudaStreamCallback_t callback, void *userData, unsigned int flags), (stream, callback, userData, flags), JI_CUDART, 0) \
  X(cudaLaunchHostFunc, cudaError_t, (cudaStream_t stream, cudaHostFn_t fn, void *userData), (stream, fn, userData), JI_CUDART, 0) \
  X(cudaLaunchHostFunc_ptsz, cudaError_t, (cudaStream_t stream, cudaHostFn_t fn, void *userData), (stream, fn, userData), JI_CUDART, 0) \
  X(cudaEventElapsedTime, cudaError_t, (float *ms, cudaEvent_t start, cudaEvent_t end), (ms, start, end), JI_CUDART, 0) \
  X(cudaMemset, cudaError_t, (void *devPtr, int value, size_t count), (devPtr, value, count), JI_CUDART, JI_BLOCK) \
  X(cudaMemset_ptds, cudaError_t, (void *devPtr, int value, size_t count), (devPtr, value, count), JI_CUDART, JI_BLOCK) \
  X(cudaMemsetAsync, cudaError_t, (void *devPtr, int value, size_t count, cudaStream_t stream), (devPtr, value, count, stream), JI_CUDART, 0) \
  X(cudaMemsetAsync_ptsz, cudaError_t, (void *devPtr, int value, size_t count, cudaStream_t stream), (devPtr, value, count, stream), JI_CUDART, 0) \
  X(ncclGetUniqueId, ncclResult_t, (ncclUniqueId *uniqueId), (uniqueId), JI_NCCL, 0) \
  X(ncclCommInitRank, ncclResult_t, (ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank), (comm, nranks, commId, rank), JI_NCCL, JI_BLOCK) \
  X(ncclCommInitRankConfig, ncclResult_t, (ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t *config), (comm, nranks, commId, rank, config), JI_NCCL, JI_BLOCK) \
  X(ncclCommSplit, ncclResult_t, (ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config), (comm, color, key, newcomm, config), JI_NCCL, JI_BLOCK) \
  X(ncclCommDestroy, ncclResult_t, (ncclComm_t comm), (comm), JI_NCCL, JI_BLOCK) \
  X(ncclCommAbort, ncclResult_t, (ncclComm_t comm), (comm), JI_NCCL, 0) \
  X(ncclCommGetAsyncError, ncclResult_t, (ncclComm_t comm, ncclResult_t *asyncError), (comm, asyncError), JI_NCCL, 0) \
  X(ncclAllReduce, ncclResult_t, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, count, datatype, op, comm, stream), JI_NCCL, JI_COLL | JI_BLOCK) \
  X(ncclBroadcast, ncclResult_t, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, count, datatype, root, comm, stream), JI_NCCL, JI_COLL | JI_BLOCK) \
  X(ncclReduce, ncclResult_t, (const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, count, datatype, op, root, comm, stream), JI_NCCL, JI_COLL | JI_BLOCK) \
  X(ncclAllGather, ncclResult_t, (const void *sendbuff, void *recvbuff, size_t sendcount, ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, sendcount, datatype, comm, stream), JI_NCCL, JI_COLL | JI_BLOCK) \
  X(ncclReduceScatter, ncclResult_t, (const void *sendbuff, void *recvbuff, size_t recvcount, ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream), (sendbuff, recvbuff, recvcount, datatype, op, comm, stream), JI_NCCL, JI_COLL | JI_BLOCK) \
  X(ncclSend, ncclResult_t, (const void *sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream), (sendbuff, count, datatype, peer, comm, stream), JI_NCCL, JI_COLL | JI_BLOCK) \
  X(ncclRecv, ncclResult_t, (void *recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream), (recvbuff, count, datatype, peer, comm, stream), JI_NCCL, JI_COLL | JI_BLOCK) \
  X(ncclBcast, ncclResult_t, (void *buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream), (buff, count, datatype, root, comm, stream), JI_NCCL, JI_COLL | JI_BLOCK) \
  X(ncclCommFinalize, ncclResult_t, (ncclComm_t comm), (comm), JI_NCCL, JI_BLOCK) \
  X(ncclCommCount, ncclResult_t, (const ncclComm_t comm, int *count), (comm, count), JI_NCCL, 0) \
  X(ncclCommCuDevice, ncclResult_t, (const ncclComm_t comm, int *device), (comm, device), JI_NCCL, 0) \
  X(ncclCommUserRank, ncclResult_t, (const ncclComm_t comm, int *rank), (comm, rank), JI_NCCL, 0) \
  X(ncclCommRegister, ncclResult_t, (const ncclComm_t comm, void *buff, size_t size, void **handle), (comm, buff, size, handle), JI_NCCL, 0) \
  X(ncclCommDeregister, ncclResult_t, (const ncclComm_t comm, void *handle), (comm, handle), JI_NCCL, 0) \
  X(ncclGetLastError, const char *, (ncclComm_t comm), (comm), JI_NCCL, 0) \
  X(ncclGroupStart, ncclResult_t, (void), (), JI_NCCL, 0) \
  X(ncclGroupEnd, ncclResult_t, (void), (), JI_NCCL, JI_BLOCK)

enum ji_id {
#define JI_ENUM_(name, ret, params, args, lib, flags) JI_ID_##name,
  JI_TABLE(JI_ENUM_)
#undef JI_ENUM_
  JI_N_SYMS
};

#endif /* JI_SHIM_TABLE_H */
