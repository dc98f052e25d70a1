/*
 * nccl_unsupported.c - entry points of NVIDIA's libnccl.so.2 that the
 * stand-in exports but does not simulate.
 *
 * Why they exist: PyTorch's CUDA build (torch 2.13.0+cu130 from PyPI) links
 * libnccl.so.2 and is loaded with RTLD_NOW, so every ncclX its libraries
 * reference must resolve, or `import torch` fails in a process where the
 * stand-in is NCCL. The list is what they reference beyond what nccl.c
 * simulates; test_sim_abi.py checks it against an installed CUDA build.
 *
 * Each returns ncclInvalidUsage without touching its arguments, and
 * ncclGetLastError names the call.
 */
#include "nccl_abi.h"

#define API __attribute__((visibility("default")))

/* nccl.c: records "<name>: not simulated ..." as the last error. */
ncclResult_t jitsim_nccl_unsupported(const char *name);

/* The arguments are never read, so no prototype beyond the return type is
 * needed: on the supported ABIs (x86-64 System V, AArch64) the caller owns
 * its argument registers and stack. As in nccl.c, pncclX is the
 * implementation and ncclX a weak alias. */
#define JITSIM_UNSUPPORTED_NCCL(X)   \
  X(ncclAlltoAll)                    \
  X(ncclCommInitAll)                 \
  X(ncclCommInitRankScalable)        \
  X(ncclCommMemStats)                \
  X(ncclCommResume)                  \
  X(ncclCommShrink)                  \
  X(ncclCommSuspend)                 \
  X(ncclCommWindowDeregister)        \
  X(ncclCommWindowRegister)          \
  X(ncclDevCommCreate)               \
  X(ncclDevCommDestroy)              \
  X(ncclGetLsaMultimemDevicePointer) \
  X(ncclGetPeerDevicePointer)        \
  X(ncclGroupSimulateEnd)            \
  X(ncclMemAlloc)                    \
  X(ncclMemFree)                     \
  X(ncclPutSignal)                   \
  X(ncclRedOpCreatePreMulSum)        \
  X(ncclRedOpDestroy)                \
  X(ncclSignal)                      \
  X(ncclWaitSignal)

#define JITSIM_DEFINE_UNSUPPORTED(name)                                       \
  API ncclResult_t p##name(void) { return jitsim_nccl_unsupported(#name); } \
  __typeof__(p##name) name __attribute__((weak, alias("p" #name), visibility("default")));
JITSIM_UNSUPPORTED_NCCL(JITSIM_DEFINE_UNSUPPORTED)
