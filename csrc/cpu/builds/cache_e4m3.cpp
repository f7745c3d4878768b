// The attention kernel over c10::Float8_e4m3fn caches, in this build (see build.h).
#include "cpu/attention/kernel.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {
template void attention_cache<c10::Float8_e4m3fn>(const AttentionParams&);
template void describe_cache<c10::Float8_e4m3fn>(const AttentionParams&, PlanInfo*);
}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
