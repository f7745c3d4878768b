// One build of the CPU attention kernel: the kernel compiled with one instruction set (ATen's
// CPU_CAPABILITY names its namespace). Its cache dtypes are instantiated in their own
// translation units (cache_<dtype>.cpp) so that a build compiles in parallel; table.cpp
// dispatches to them. The build's switches (PAGED_OPS_BUILD_NAME, PAGED_OPS_DOT_BF16, ...) come
// from the compiler's command line: paged_ops/_cpu_build.py for the library builds, setup.py
// for the default build inside _C.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include "cpu/kernels.h"

// PAGED_OPS_BUILD_NAME: the build's name, a bare word (-DPAGED_OPS_BUILD_NAME=avx2: no quotes
// to survive the shells of the build tools), turned into the table's string here.
#ifndef PAGED_OPS_BUILD_NAME
#error "PAGED_OPS_BUILD_NAME names the build (see paged_ops/_cpu_build.py)"
#endif
#define PAGED_OPS_STR2(x) #x
#define PAGED_OPS_STR(x) PAGED_OPS_STR2(x)

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// Attention over a cache of element type CT (cpu/attention/kernel.h); queries and outputs of
// any of fp32 / fp16 / bf16.
template <typename CT>
void attention_cache(const AttentionParams& P);

#define PAGED_OPS_CACHE_TYPES(X)                                              \
  X(float, F32) X(c10::Half, F16) X(c10::BFloat16, BF16) X(c10::Float8_e4m3fn, F8E4M3) \
  X(c10::Float8_e5m2, F8E5M2)

// What a call of these parameters takes (kernels.h, PlanInfo).
template <typename CT>
void describe_cache(const AttentionParams& P, PlanInfo* info);

#define PAGED_OPS_DECLARE(CT, _)                                          \
  extern template void attention_cache<CT>(const AttentionParams&);      \
  extern template void describe_cache<CT>(const AttentionParams&, PlanInfo*);
PAGED_OPS_CACHE_TYPES(PAGED_OPS_DECLARE)
#undef PAGED_OPS_DECLARE

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
