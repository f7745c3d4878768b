// The kernel table of one build: the entry point dispatching on the cache dtype. A capability
// library (PAGED_OPS_VARIANT_LIBRARY) exports it; the default build inside _C hands it to
// ops_cpu.cpp.
#include "cpu/builds/build.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {
namespace {

void attention(const AttentionParams& P) {
  switch (P.cache_dtype) {
#define PAGED_OPS_CASE(CT, DT) \
  case DType::DT:              \
    return attention_cache<CT>(P);
    PAGED_OPS_CACHE_TYPES(PAGED_OPS_CASE)
#undef PAGED_OPS_CASE
  }
}

void describe(const AttentionParams& P, PlanInfo* info) {
  switch (P.cache_dtype) {
#define PAGED_OPS_CASE(CT, DT) \
  case DType::DT:              \
    return describe_cache<CT>(P, info);
    PAGED_OPS_CACHE_TYPES(PAGED_OPS_CASE)
#undef PAGED_OPS_CASE
  }
}

const KernelTable* kernel_table() {
  static const KernelTable t{kKernelAbiVersion, PAGED_OPS_STR(PAGED_OPS_BUILD_NAME), &attention,
                             &describe};
  return &t;
}

}  // namespace
}  // namespace CPU_CAPABILITY

#if !defined(PAGED_OPS_VARIANT_LIBRARY)
const KernelTable* default_kernel_table() { return kernel_table(); }
#endif

}  // namespace paged::cpu

#if defined(PAGED_OPS_VARIANT_LIBRARY)
extern "C" __attribute__((visibility("default"))) const paged::cpu::KernelTable*
paged_ops_cpu_kernel_table() {
  return paged::cpu::kernel_table();
}
#endif
