// The AVX-512 build with bf16 dot products (vdpbf16ps, see kDotBF16 in attention_kernel.h): its
// own shared object (paged_ops/_cpu_avx512_bf16), loaded only when ATen reports both AVX-512
// and AVX512-BF16. Everything but the q.k of bf16 queries on bf16 caches is the avx512 build.
#define CPU_CAPABILITY_NAME "avx512_bf16"
#define PAGED_OPS_DOT_BF16 1
#define PAGED_OPS_FP8_TABLES 1
#include "cpu/attention_kernel.h"

extern "C" __attribute__((visibility("default"))) const paged::cpu::KernelTable*
paged_ops_cpu_kernel_table() {
  return paged::cpu::kernel_table();
}
