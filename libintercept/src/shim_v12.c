/*
 * shim_v12.c - libcudart.so.12 entry points of the CUDA hooks.
 *
 * libtorch references `cudaX@libcudart.so.13` (or .12). glibc binds a
 * versioned reference to a definition in an object that has version
 * definitions only if the version names match, so every CUDA hook is exported
 * as cudaX@@libcudart.so.13 (the default, via shim.map) and, from here, as
 * cudaX@libcudart.so.12. Unversioned references (dlsym, binaries linked
 * against an unversioned runtime) resolve to the default.
 * The .12 names are one-jump trampolines in their own translation unit: GNU as
 * binds `.symver` to a same-named symbol of the same object, so an alias next
 * to the hook would replace the hook's default version.
 */
#include "shim_entry.h"

#define JI_V12_JI_NCCL(name, ret, params, args)
#define JI_V12_JI_CUDART(name, ret, params, args)                 \
  ret name params;                                                 \
  __attribute__((used, visibility("default"))) ret ji12_##name params { return name args; } \
  __asm__(".symver ji12_" #name ", " #name "@libcudart.so.12");
#define JI_V12_(name, ret, params, args, lib, flags) JI_V12_##lib(name, ret, params, args)
JI_TABLE(JI_V12_)
