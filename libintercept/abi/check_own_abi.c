/* Layout facts of our own declarations, checked even where no real CUDA or
 * NCCL header exists (they are what the stand-in and the shim compile with). */
#include <stddef.h>

#include "cuda_abi.h"
#include "nccl_abi.h"

_Static_assert(sizeof(cudaError_t) == 4, "cudaError_t size");
_Static_assert(cudaErrorNotReady == 600 && cudaErrorIllegalAddress == 700, "values");
_Static_assert(sizeof(dim3) == 12, "dim3 size");
_Static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId size");
_Static_assert(sizeof(ncclConfig_t) == 120, "ncclConfig_t size (NCCL 2.32)");
_Static_assert(ncclInProgress == 7 && ncclRemoteError == 6, "values");

int main(void) { return 0; }
