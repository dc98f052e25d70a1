/*
 * blocker.so - loaded by the GIL test through ctypes.PyDLL, which keeps the
 * GIL held across calls. blk_enqueue_hung() enqueues an all-reduce the peer
 * never joins; the test then calls cudaStreamSynchronize on that stream
 * through ctypes.PyDLL(None) (the shim's symbol): the main thread holds the
 * GIL inside a blocking call that never returns.
 */
#include "common.h"

#define N 4096
static ncclComm_t comm;
static cudaStream_t stream;
static float *dev, *coll;
static unsigned char pattern[N];

int blk_setup(int rank, int nranks, const char *idpath) {
  ncclUniqueId id;
  exchange_id(&id, rank, idpath);
  if (ncclCommInitRank(&comm, nranks, id, rank)) return 1;
  if (cudaStreamCreate(&stream)) return 2; /* blocking: the legacy stream waits for it */
  if (cudaMalloc((void **)&dev, N) || cudaMalloc((void **)&coll, N * sizeof(float))) return 3;
  for (int i = 0; i < N; i++) pattern[i] = (unsigned char)(i * 13 + 7);
  if (cudaMemcpy(dev, pattern, N, cudaMemcpyHostToDevice)) return 4;
  return 0;
}

void *blk_dev(void) { return dev; }
void *blk_stream(void) { return stream; }
const void *blk_pattern(void) { return pattern; }
int blk_nbytes(void) { return N; }

int blk_enqueue_hung(void) { return ncclAllReduce(coll, coll, N, ncclFloat, ncclSum, comm, stream); }
