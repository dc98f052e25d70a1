/*
 * Compile-time proof that abi/nccl_abi.h matches a real nccl.h (NCCL 2.32.x,
 * from the nvidia-nccl-cu13 wheel). Built by `make check-abi` only when the
 * header is found; see sim/sim.mk (NCCL_INCLUDE, fetch-nccl-header).
 */
#include <stddef.h>

#include <nccl.h>

#define JITABI_USE_REAL_CUDA_TYPES
#define JITABI_USE_REAL_NCCL_TYPES
#include "nccl_abi.h"

#define JITABI_CHECK_VALUE(name, value) \
  _Static_assert((long long)(name) == (long long)(value), "value of " #name);
JITABI_NCCL_RESULTS(JITABI_CHECK_VALUE)
JITABI_NCCL_REDOPS(JITABI_CHECK_VALUE)
JITABI_NCCL_DTYPES(JITABI_CHECK_VALUE)

_Static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId size");
_Static_assert(sizeof(ncclResult_t) == 4 && sizeof(ncclRedOp_t) == 4 &&
               sizeof(ncclDataType_t) == 4, "enum sizes");
_Static_assert(NCCL_MAJOR == 2, "NCCL major");

/* Field-by-field layout of ncclConfig_t. */
_Static_assert(sizeof(struct jitabi_ncclConfig) == sizeof(ncclConfig_t), "ncclConfig_t size");
#define JITABI_CHECK_FIELD(type, name) \
  _Static_assert(offsetof(struct jitabi_ncclConfig, name) == offsetof(ncclConfig_t, name), \
                 "offset of ncclConfig_t." #name); \
  _Static_assert(sizeof(((struct jitabi_ncclConfig *)0)->name) == \
                 sizeof(((ncclConfig_t *)0)->name), "size of ncclConfig_t." #name);
JITABI_NCCL_CONFIG_FIELDS(JITABI_CHECK_FIELD)

#define JITABI_CHECK_FN(ret, name, params, args) \
  jitabi_##name##_fn jitabi_check_##name = &name; \
  jitabi_##name##_fn jitabi_check_p##name = &p##name;
JITABI_NCCL_FUNCS(JITABI_CHECK_FN)

int main(void) { return 0; }
