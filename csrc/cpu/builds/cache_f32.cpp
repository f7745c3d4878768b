// The attention kernel over float caches, in this build (see build.h).
#include "cpu/attention/kernel.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {
template void attention_cache<float>(const AttentionParams&);
template void describe_cache<float>(const AttentionParams&, PlanInfo*);
}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
