// The attention kernel over c10::BFloat16 caches, in this build (see build.h).
#include "cpu/attention/kernel.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {
template void attention_cache<c10::BFloat16>(const AttentionParams&);
template void describe_cache<c10::BFloat16>(const AttentionParams&, PlanInfo*);
}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
