// The instruction-set layer of the attention kernel: the vector type VecF (W fp32 lanes), and
// the hooks the generic headers (attention/element_loads.h, qk.h, pv.h, kernel.h) call where an
// instruction set has faster code: fp8 decode, bf16 read in pairs, bf16 pair dot products,
// in_register, lane sums, fill_qrep's vector moves. Contracts and portable versions:
// portable.h; AVX2: avx2.h; AVX-512: avx512.h. (The AMX tiles: amx_tiles.h.)
#pragma once

#include "cpu/arch/portable.h"

// The one selection point: ATen's capability macro of the build (setup.py,
// paged_ops/_cpu_build.py). The DEFAULT build and the emulated 16-lane test builds are portable.
#if defined(CPU_CAPABILITY_AVX2)
#include "cpu/arch/avx2.h"
#elif defined(CPU_CAPABILITY_AVX512)
#include "cpu/arch/avx512.h"
#else
namespace paged::cpu {
inline namespace CPU_CAPABILITY {
using namespace portable;
}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
#endif
