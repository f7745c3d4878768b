// The portable (DEFAULT capability) build of the CPU attention kernel, linked into _C. It is
// what runs when no faster variant library is loaded (see paged_ops/__init__.py).
#define CPU_CAPABILITY_NAME "default"
#include "cpu/attention_kernel.h"

namespace paged::cpu {
const KernelTable* default_kernel_table() { return kernel_table(); }
}  // namespace paged::cpu
