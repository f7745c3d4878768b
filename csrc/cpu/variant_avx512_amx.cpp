// The AVX-512 build with AMX tiles (amx_attention.h) for bf16 caches read with bf16 queries:
// its own shared object (paged_ops/_cpu_avx512_amx), loaded only where ATen reports AMX-BF16
// and AVX512-BF16. Everything else is the avx512_bf16 build; without the OS's grant of the
// tiles (amx::usable) it runs as that build.
#define CPU_CAPABILITY_NAME "avx512_amx"
#define PAGED_OPS_DOT_BF16 1
#define PAGED_OPS_FP8_TABLES 1
#define PAGED_OPS_AMX 1
#include "cpu/attention_kernel.h"

extern "C" __attribute__((visibility("default"))) const paged::cpu::KernelTable*
paged_ops_cpu_kernel_table() {
  return paged::cpu::kernel_table();
}
