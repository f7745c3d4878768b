// The AVX-512 builds' instruction-set hooks (isa.h; their contracts: isa_portable.h): fp8
// decode with F16C, and vdpbf16ps in the builds compiled with AVX512-BF16 (avx512_bf16,
// avx512_amx). Lane sums are ATen's (with 16 lanes, see tile_sums in pv.h) and bf16 is not
// read in pairs.
#pragma once

#include <immintrin.h>

#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <type_traits>

#include "cpu/fp8.h"
#include "cpu/isa_portable.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

static_assert(W == 16, "the AVX-512 hooks are written for 16 fp32 lanes");

using portable::fill_qrep_chunk;
using portable::kSplitPairs;
using portable::kTileSumsByShuffles;
using portable::load_bf16_half;
using portable::load_bf16_pairs;
using portable::reduce_rows;
using portable::split_pairs;
using portable::sum_lane_groups_by_shuffles;
using portable::tile_sums_by_shuffles;

// ---- fp8 -> fp32: as on AVX2 (isa_avx2.h), 16 lanes --------------------------------------

constexpr bool kDecodeFp8 = true;

template <typename T>
C10_ALWAYS_INLINE VecF decode_fp8(const uint8_t* b) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    return VecF(_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8)));
  } else {
    const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                       _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
    return VecF(_mm512_cvtph_ps(h));
  }
}

// One 32-byte load for both halves.
template <typename T>
C10_ALWAYS_INLINE void decode_fp8_two(const uint8_t* b, VecF& lo, VecF& hi) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  __m512i h;
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(bytes), 8);
  } else {
    h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 7),
                         _mm512_set1_epi16(static_cast<int16_t>(0xBFFF)));
  }
  lo = VecF(_mm512_cvtph_ps(_mm512_castsi512_si256(h)));
  hi = VecF(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
}

// ---- bf16 pair dot products ---------------------------------------------------------------

// vdpbf16ps exists only with AVX512-BF16: the avx512 build, compiled without it, runs the
// portable emulation (not called there: kDotBF16 is off).
#if defined(__AVX512BF16__)
using BF16Pairs = __m512bh;
inline BF16Pairs load_pairs(const void* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}
inline VecF dot_pairs(const VecF& acc, const BF16Pairs& a, const BF16Pairs& b) {
  return VecF(_mm512_dpbf16_ps(acc, a, b));
}
#else
using portable::BF16Pairs;
using portable::dot_pairs;
using portable::load_pairs;
#endif

// ---- registers ----------------------------------------------------------------------------

// An empty asm that claims to change the vector: the compiler must keep it in a register.
inline VecF in_register(VecF v) {
  __m512 r = v;
  asm("" : "+v"(r));
  return VecF(r);
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
