// The AVX-512 builds' instruction-set hooks (isa.h; their contracts: portable.h): fp8
// decode with F16C, and vdpbf16ps in the builds compiled with AVX512-BF16 (avx512_bf16,
// avx512_amx), lane sums of many vectors by shuffle trees over 128-bit blocks (tile_sums in
// pv.h sums each vector by ATen's hsum), and bf16 is not read in pairs.
#pragma once

#include <immintrin.h>

#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/fp8.h"
#include "cpu/arch/portable.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

static_assert(W == 16, "the AVX-512 hooks are written for 16 fp32 lanes");

using portable::fill_qrep_chunk;
using portable::kSplitPairs;
using portable::load_bf16_half;
using portable::load_bf16_pairs;
using portable::split_pairs;

// ---- tile_sums (pv.h) of tiles of 4 rows: one shuffle tree for up to 16 vectors --------

// The lane sums of v[0, 16) in one vector: lane 4 k + m holds the sum of v[4 m + k]. Halves,
// then 128-bit blocks, then pairs and single lanes are added across vectors: 30 shuffles and
// 15 adds for 16 sums, where summing each vector on its own takes 4 of each per sum.
C10_ALWAYS_INLINE __m512 sum16_transposed(const __m512 (&v)[16]) {
  __m512 a[8], b[4];
  for (int i = 0; i < 8; ++i)  // [v2i: 2 blocks | v2i+1: 2 blocks]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // block k: v[4 j + k], 4 lanes
    b[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xDD));
  const __m512 c0 = _mm512_add_ps(_mm512_unpacklo_ps(b[0], b[1]), _mm512_unpackhi_ps(b[0], b[1]));
  const __m512 c1 = _mm512_add_ps(_mm512_unpacklo_ps(b[2], b[3]), _mm512_unpackhi_ps(b[2], b[3]));
  const __m512d c0d = _mm512_castps_pd(c0), c1d = _mm512_castps_pd(c1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c0d, c1d)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(c0d, c1d)));
}

template <int RT, int DT>
constexpr bool kTileSumsByShuffles = RT == 4;
// o[u * 4 + r] = (init ? 0 : o[u * 4 + r] * alpha[r]) + the lane sum of a[r][u].
template <int RT, int DT>
C10_ALWAYS_INLINE void tile_sums_by_shuffles(const VecF (&a)[RT][DT], float* o,
                                             const float* alpha, bool init) {
  static_assert(RT == 4 && DT >= 1 && DT <= 4);
  __m512 v[16];
  for (int r = 0; r < 4; ++r)
    for (int u = 0; u < 4; ++u) v[4 * r + u] = u < DT ? __m512(a[r][u]) : _mm512_setzero_ps();
  const __m512 sum = sum16_transposed(v);
  constexpr __mmask16 m = static_cast<__mmask16>((1u << (4 * DT)) - 1);
  if (init) {
    _mm512_mask_storeu_ps(o, m, sum);
    return;
  }
  const __m512 al = _mm512_broadcast_f32x4(_mm_loadu_ps(alpha));
  _mm512_mask_storeu_ps(o, m, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, o), al, sum));
}

// ---- fp8 -> fp32: as on AVX2 (avx2.h), 16 lanes --------------------------------------

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

// ---- fp8 -> fp32 by byte tables (portable.h's contract) ------------------------------

// vpermi2b (AVX512-VBMI) looks up 64 bytes in a 128-entry table: one lookup each for the high
// and the low byte of the bf16 of 64 fp8 values, the sign or-ed into the high byte, two
// interleaves into bf16 words, and a shift or a mask per vector puts each word in the top half
// of an fp32 lane: 9 instructions per 64 values (about 13 uops if vpermi2b takes 3), against
// 4-5 per 16 for the fp16 route above, and NaN stays NaN.
// q.k of fp32 and fp16 queries takes it (QkPath::Fp8Tables); their p.v, whose decode feeds as
// many FMAs, gains nothing from it over decode_fp8_two (docs/cpu_kernel.md, alternatives).
// bf16 queries read fp8 as bf16 pairs (decode_fp8_pairs and decode_fp8_quads, below).
using portable::kFp8Tables;
using portable::kFp8TableOrder;
#if defined(__AVX512VBMI__)
// The high (sign included) and the low bytes of the bf16 of the 64 fp8 bytes of x.
template <typename T>
C10_ALWAYS_INLINE void fp8_bf16_bytes(__m512i x, __m512i& hi, __m512i& lo) {
  const Fp8Bf16Tables& t = kFp8Bf16Tables<T>;
  const __m512i hi7 = _mm512_permutex2var_epi8(_mm512_load_si512(t.hi), x,
                                               _mm512_load_si512(t.hi + 64));
  // hi7 | (x & 0x80)
  hi = _mm512_ternarylogic_epi32(hi7, x, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  lo = _mm512_permutex2var_epi8(_mm512_load_si512(t.lo), x, _mm512_load_si512(t.lo + 64));
}

template <typename T>
C10_ALWAYS_INLINE void decode_fp8_by_tables(const uint8_t* b, VecF (&out)[4]) {
  __m512i hi, lo;
  fp8_bf16_bytes<T>(_mm512_loadu_si512(b), hi, lo);
  const __m512i w0 = _mm512_unpacklo_epi8(lo, hi), w1 = _mm512_unpackhi_epi8(lo, hi);
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  out[0] = VecF(_mm512_castsi512_ps(_mm512_slli_epi32(w0, 16)));
  out[1] = VecF(_mm512_castsi512_ps(_mm512_and_si512(w0, top)));
  out[2] = VecF(_mm512_castsi512_ps(_mm512_slli_epi32(w1, 16)));
  out[3] = VecF(_mm512_castsi512_ps(_mm512_and_si512(w1, top)));
}
#else
using portable::decode_fp8_by_tables;
#endif

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
inline BF16Pairs pairs_in_register(BF16Pairs v) {  // see in_register
  asm("" : "+v"(v));
  return v;
}
#else
using portable::BF16Pairs;
using portable::dot_pairs;
using portable::load_pairs;
using portable::pairs_in_register;
#endif

// decode_fp8_pairs (portable.h's contract): fp8_bf16_bytes on bytes first put in
// the order (one vpermb) whose interleaves leave the values in order: byte 16 L + j takes byte
// 8 L + j, byte 16 L + 8 + j byte 32 + 8 L + j (L < 4, j < 8). 7 instructions per 64 values.
#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
template <typename T>
C10_ALWAYS_INLINE void decode_fp8_pairs(const uint8_t* b, BF16Pairs& lo, BF16Pairs& hi) {
  alignas(64) static constexpr uint8_t kOrder[64] = {
      0,  1,  2,  3,  4,  5,  6,  7,  32, 33, 34, 35, 36, 37, 38, 39,
      8,  9,  10, 11, 12, 13, 14, 15, 40, 41, 42, 43, 44, 45, 46, 47,
      16, 17, 18, 19, 20, 21, 22, 23, 48, 49, 50, 51, 52, 53, 54, 55,
      24, 25, 26, 27, 28, 29, 30, 31, 56, 57, 58, 59, 60, 61, 62, 63};
  __m512i h, l;
  fp8_bf16_bytes<T>(_mm512_permutexvar_epi8(_mm512_load_si512(kOrder), _mm512_loadu_si512(b)),
                    h, l);
  lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi8(l, h));
  hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi8(l, h));
}
// decode_fp8_quads (portable.h's contract): fp8_bf16_bytes and the two interleaves, without
// decode_fp8_pairs' vpermb. 6 instructions per 64 values.
template <typename T>
C10_ALWAYS_INLINE void decode_fp8_quads(const uint8_t* b, BF16Pairs& lo, BF16Pairs& hi) {
  __m512i h, l;
  fp8_bf16_bytes<T>(_mm512_loadu_si512(b), h, l);
  lo = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi8(l, h));
  hi = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi8(l, h));
}
#else
using portable::decode_fp8_pairs;
using portable::decode_fp8_quads;
#endif

// ---- lane sums ----------------------------------------------------------------------------

// Shuffle trees over 128-bit blocks. sum4: block k, lane j of the result = the sum of block k
// of v[j] (two levels: pairs of lanes, then pairs of pairs).
C10_ALWAYS_INLINE __m512 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
}
// Blocks [a0 + a1, a2 + a3, b0 + b1, b2 + b3].
C10_ALWAYS_INLINE __m512 sum_block_pairs(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
// Lane k = the sum of r[k]'s lanes, for 16 vectors.
inline VecF reduce_rows(const VecF* r) {
  const __m512 w0 = sum_block_pairs(sum4(r[0], r[1], r[2], r[3]), sum4(r[4], r[5], r[6], r[7]));
  const __m512 w1 =
      sum_block_pairs(sum4(r[8], r[9], r[10], r[11]), sum4(r[12], r[13], r[14], r[15]));
  return VecF(sum_block_pairs(w0, w1));
}

// sum_lane_groups (qk.h) in steps of 16 tokens, then one of 8 (block size 8).
C10_ALWAYS_INLINE int64_t sum_lane_groups_by_shuffles(const float* raw, int64_t x, int64_t ntok,
                                                      float* z, float scale) {
  const __m512 s = _mm512_set1_ps(scale);
  auto ld = [&](int64_t i) { return _mm512_loadu_ps(raw + i * W); };
  // Vectors [i, i + 8): blocks [v0-3 low half, v0-3 high half, v4-7 low, v4-7 high] (sum4 of
  // each quad, then sum_block_pairs).
  auto tree8 = [&](int64_t i) {
    return sum_block_pairs(sum4(ld(i), ld(i + 1), ld(i + 2), ld(i + 3)),
                           sum4(ld(i + 4), ld(i + 5), ld(i + 6), ld(i + 7)));
  };
  int64_t t = 0;
  if (x == 16) {  // a token per vector
    for (; t + 16 <= ntok; t += 16, raw += 16 * W)
      _mm512_storeu_ps(z + t, _mm512_mul_ps(s, sum_block_pairs(tree8(0), tree8(8))));
    if (t + 8 <= ntok) {
      const __m512 w = tree8(0);
      _mm256_storeu_ps(z + t, _mm512_castps512_ps256(_mm512_mul_ps(s, sum_block_pairs(w, w))));
      t += 8;
    }
  } else if (x == 8) {  // two tokens per vector: blocks of w are tokens [0 2 4 6 | 1 3 5 7 | ...]
    const __m512i order = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    for (; t + 16 <= ntok; t += 16, raw += 8 * W)
      _mm512_storeu_ps(z + t, _mm512_mul_ps(s, _mm512_permutexvar_ps(order, tree8(0))));
    if (t + 8 <= ntok) {  // block size 8: blocks of w are tokens [0 2 4 6 | 1 3 5 7 | again]
      const __m512 u = sum4(ld(0), ld(1), ld(2), ld(3));
      const __m512 w = _mm512_permutexvar_ps(order, sum_block_pairs(u, u));
      _mm256_storeu_ps(z + t, _mm512_castps512_ps256(_mm512_mul_ps(s, w)));
      t += 8;
    }
  } else if (x == 4) {  // four tokens per vector: lane 4 j + k of u is token 4 k + j
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    for (; t + 16 <= ntok; t += 16, raw += 4 * W) {
      const __m512 u = sum4(ld(0), ld(1), ld(2), ld(3));
      _mm512_storeu_ps(z + t, _mm512_mul_ps(s, _mm512_permutexvar_ps(order, u)));
    }
    if (t + 8 <= ntok) {  // block size 8: two vectors, lanes 2 and 3 of each block unused
      const __m512 zero = _mm512_setzero_ps();
      const __m512 u = sum4(ld(0), ld(1), zero, zero);
      const __m512 w = _mm512_mul_ps(s, _mm512_permutexvar_ps(order, u));
      _mm256_storeu_ps(z + t, _mm512_castps512_ps256(w));
      t += 8;
    }
  }
  return t;
}

// ---- registers ----------------------------------------------------------------------------

// permute_lanes (portable.h): vpermps.
C10_ALWAYS_INLINE VecF permute_lanes(const VecF& v, const int32_t* idx) {
  return VecF(_mm512_permutexvar_ps(_mm512_loadu_si512(idx), v));
}

// repeat_lanes (portable.h) by one broadcast load.
template <int H>
C10_ALWAYS_INLINE VecF repeat_lanes(const float* p) {
  if constexpr (H == 1) {
    return VecF(_mm512_set1_ps(*p));
  } else if constexpr (H == 2) {
    double d;
    std::memcpy(&d, p, sizeof(d));
    return VecF(_mm512_castpd_ps(_mm512_set1_pd(d)));
  } else if constexpr (H == 4) {
    return VecF(_mm512_broadcast_f32x4(_mm_loadu_ps(p)));
  } else if constexpr (H == 8) {
    const __m256d half = _mm256_loadu_pd(reinterpret_cast<const double*>(p));
    return VecF(_mm512_castpd_ps(_mm512_broadcast_f64x4(half)));
  } else {
    return VecF::loadu(p);
  }
}

inline VecF fmadd_lanes(const VecF& v, const VecF& p, const VecF& a, uint32_t mask) {
  return VecF(_mm512_mask3_fmadd_ps(v, p, a, static_cast<__mmask16>(mask)));
}
inline VecF load_lanes(const float* p, uint32_t mask) {
  return VecF(_mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), p));
}

// An empty asm that claims to change the vector: the compiler must keep it in a register.
inline VecF in_register(VecF v) {
  __m512 r = v;
  asm("" : "+v"(r));
  return VecF(r);
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
