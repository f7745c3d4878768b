// The attention kernel over c10::Float8_e5m2 caches, in this build (see build.h).
#include "cpu/attention/kernel.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {
template void attention_cache<c10::Float8_e5m2>(const AttentionParams&);
template void describe_cache<c10::Float8_e5m2>(const AttentionParams&, PlanInfo*);
}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
