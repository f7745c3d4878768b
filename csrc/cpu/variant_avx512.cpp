// The AVX512 build of the CPU attention kernel: its own shared object (paged_ops/_cpu_avx512),
// compiled with AVX512 flags (setup.py), loaded only when ATen reports the CPU supports AVX512.
#define CPU_CAPABILITY_NAME "avx512"
#include "cpu/attention_kernel.h"

extern "C" __attribute__((visibility("default"))) const paged::cpu::KernelTable*
paged_ops_cpu_kernel_table() {
  return paged::cpu::kernel_table();
}
