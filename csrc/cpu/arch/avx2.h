// The AVX2 build's instruction-set hooks (isa.h; their contracts: portable.h): fp8 decode
// with F16C, bf16 read in pairs, lane sums by hadd trees, and fill_qrep's vector moves.
#pragma once

#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/fp8.h"
#include "cpu/arch/portable.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

static_assert(W == 8, "the AVX2 hooks are written for 8 fp32 lanes");

// bf16 pair dot products: the portable emulation (vdpbf16ps needs AVX512-BF16).
using portable::BF16Pairs;
using portable::dot_pairs;
using portable::fmadd_lanes;  // pv_group_any's straddling vectors: 16 lanes only
using portable::load_lanes;
using portable::load_pairs;
using portable::pairs_in_register;
// fp8 by byte tables: 16-lane builds only (kFp8Tables is off here).
using portable::decode_fp8_by_tables;
using portable::decode_fp8_pairs;
using portable::decode_fp8_quads;
using portable::kFp8TableOrder;
using portable::kFp8Tables;

// ---- fp8 -> fp32 --------------------------------------------------------------------------

constexpr bool kDecodeFp8 = true;

template <typename T>
C10_ALWAYS_INLINE VecF decode_fp8(const uint8_t* b) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    // e5m2 is the high byte of an fp16: widen, shift, convert with F16C.
    return VecF(_mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8)));
  } else {
    // e4m3fn s.eeee.mmm -> fp16 s.0eeee.mmm0000000 = value * 2^-8 (subnormals included):
    // sign-extend, shift into place, clear the copy of the sign in bit 14, convert. (0x7f,
    // NaN, reads as 480: the kernel scans the blocks for it instead, see is_e4m3_nan.)
    const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7),
                                    _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
    return VecF(_mm256_cvtph_ps(h));
  }
}

// One 16-byte load, widened and shifted once for both halves.
template <typename T>
C10_ALWAYS_INLINE void decode_fp8_two(const uint8_t* b, VecF& lo, VecF& hi) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  __m256i h;
  if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
  } else {  // see decode_fp8
    h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                         _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
  }
  lo = VecF(_mm256_cvtph_ps(_mm256_castsi256_si128(h)));
  hi = VecF(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}

// ---- bf16 pairs ---------------------------------------------------------------------------

// A 32-bit lane of two neighbouring bf16 values holds the upper one as an fp32 with its low
// half cleared, and the lower one shifted up by 16 bits: both exact, without the widening
// shuffle of load_f32. The values come out split, even offsets then odd ones.
template <typename T>
constexpr bool kSplitPairs = std::is_same_v<T, c10::BFloat16>;
inline VecF bf16_even(__m256i raw) { return VecF(_mm256_castsi256_ps(_mm256_slli_epi32(raw, 16))); }
inline VecF bf16_odd(__m256i raw) {
  return VecF(_mm256_castsi256_ps(
      _mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u)))));
}
inline void load_bf16_pairs(const c10::BFloat16* p, VecF& even, VecF& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = bf16_even(raw);
  odd = bf16_odd(raw);
}
// One half of load_bf16_pairs: i = 0 the even elements, i = 1 the odd ones.
inline VecF load_bf16_half(const c10::BFloat16* p, int i) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return i == 0 ? bf16_even(raw) : bf16_odd(raw);
}
// p[0, 2W) reordered the same way: [p0, p2, ..., p14, p1, p3, ..., p15].
inline void split_pairs(float* p) {
  const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + W);
  const __m256 e = _mm256_shuffle_ps(a, b, 0x88);  // [a0 a2 b0 b2 | a4 a6 b4 b6]
  const __m256 o = _mm256_shuffle_ps(a, b, 0xDD);  // [a1 a3 b1 b3 | a5 a7 b5 b7]
  _mm256_storeu_ps(p, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8)));
  _mm256_storeu_ps(p + W, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xD8)));
}

// ---- registers and lane sums --------------------------------------------------------------

// permute_lanes (portable.h): vpermps.
C10_ALWAYS_INLINE VecF permute_lanes(const VecF& v, const int32_t* idx) {
  const __m256i i = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx));
  return VecF(_mm256_permutevar8x32_ps(v, i));
}

// repeat_lanes (portable.h) by one broadcast load.
template <int H>
C10_ALWAYS_INLINE VecF repeat_lanes(const float* p) {
  if constexpr (H == 1) {
    return VecF(_mm256_set1_ps(*p));
  } else if constexpr (H == 2) {
    double d;
    std::memcpy(&d, p, sizeof(d));
    return VecF(_mm256_castpd_ps(_mm256_set1_pd(d)));
  } else if constexpr (H == 4) {
    return VecF(_mm256_broadcast_ps(reinterpret_cast<const __m128*>(p)));
  } else {
    return VecF::loadu(p);
  }
}

// An empty asm that claims to change the vector: the compiler must keep it in a register.
inline VecF in_register(VecF v) {
  __m256 r = v;
  asm("" : "+x"(r));
  return VecF(r);
}

inline VecF reduce_rows(const VecF* r) {
  const __m256 h0 = _mm256_hadd_ps(r[0], r[1]);
  const __m256 h1 = _mm256_hadd_ps(r[2], r[3]);
  const __m256 h2 = _mm256_hadd_ps(r[4], r[5]);
  const __m256 h3 = _mm256_hadd_ps(r[6], r[7]);
  const __m256 i0 = _mm256_hadd_ps(h0, h1);  // [r0..r3 low-half sums | r0..r3 high-half sums]
  const __m256 i1 = _mm256_hadd_ps(h2, h3);
  return VecF(_mm256_add_ps(_mm256_permute2f128_ps(i0, i1, 0x20),
                            _mm256_permute2f128_ps(i0, i1, 0x31)));
}

// tile_sums (pv.h) of tiles of 4 rows, and of single rows of 2 or 3 vectors.
template <int RT, int DT>
constexpr bool kTileSumsByShuffles = RT == 4 || (RT == 1 && DT >= 2);
template <int RT, int DT>
C10_ALWAYS_INLINE void tile_sums_by_shuffles(const VecF (&a)[RT][DT], float* o,
                                             const float* alpha, bool init) {
  if constexpr (RT == 4) {
    static_assert(DT >= 1 && DT <= 3);
    if constexpr (DT >= 2) {  // 8 sums [r0..r3 of d, r0..r3 of d + 1]
      const VecF r[8] = {a[0][0], a[1][0], a[2][0], a[3][0], a[0][1], a[1][1], a[2][1], a[3][1]};
      const __m256 sum = reduce_rows(r);
      const __m128 al = _mm_loadu_ps(alpha);
      _mm256_storeu_ps(o, init ? sum
                               : _mm256_fmadd_ps(_mm256_loadu_ps(o), _mm256_set_m128(al, al), sum));
    }
    if constexpr (DT != 2) {  // 4 sums [r0..r3 of the last d]
      constexpr int u = DT - 1;
      const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0][u], a[1][u]),
                                      _mm256_hadd_ps(a[2][u], a[3][u]));
      const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      float* ou = o + u * 4;
      _mm_storeu_ps(ou, init ? sum : _mm_fmadd_ps(_mm_loadu_ps(ou), _mm_loadu_ps(alpha), sum));
    }
  } else {  // one hadd tree for the DT <= 3 vectors of the row
    static_assert(RT == 1 && DT >= 2 && DT <= 3);
    const __m256 t01 = _mm256_hadd_ps(a[0][0], a[0][1]);
    const __m256 t2 = DT == 3 ? _mm256_hadd_ps(a[0][DT - 1], a[0][DT - 1]) : t01;
    const __m256 h = _mm256_hadd_ps(t01, t2);  // [s0 s1 s2 s2 | s0 s1 s2 s2] (low / high lanes)
    float sum[4];
    _mm_storeu_ps(sum, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    for (int u = 0; u < DT; ++u) o[u] = init ? sum[u] : o[u] * alpha[0] + sum[u];
  }
}

// sum_lane_groups (qk.h) in steps of 8 tokens.
C10_ALWAYS_INLINE int64_t sum_lane_groups_by_shuffles(const float* raw, int64_t x, int64_t ntok,
                                                      float* z, float scale) {
  const VecF s(scale);
  int64_t t = 0;
  if (x == 16) {  // two vectors per token (fp8)
    for (; t + 8 <= ntok; t += 8) {
      VecF r[8];
      for (int k = 0; k < 8; ++k)
        r[k] = VecF::loadu(raw + (t + k) * 16) + VecF::loadu(raw + (t + k) * 16 + 8);
      (reduce_rows(r) * s).store(z + t);
    }
  } else if (x == 8) {  // one token per vector
    for (; t + 8 <= ntok; t += 8) {
      VecF r[8];
      for (int k = 0; k < 8; ++k) r[k] = VecF::loadu(raw + (t + k) * 8);
      (reduce_rows(r) * s).store(z + t);
    }
  } else if (x == 4) {  // two tokens per vector
    for (; t + 8 <= ntok; t += 8) {
      const float* b = raw + t * 4;
      const __m256 h0 = _mm256_hadd_ps(VecF::loadu(b), VecF::loadu(b + 8));
      const __m256 h1 = _mm256_hadd_ps(VecF::loadu(b + 16), VecF::loadu(b + 24));
      const __m256 h = _mm256_hadd_ps(h0, h1);  // tokens [0, 2, 4, 6 | 1, 3, 5, 7]
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      _mm256_storeu_ps(z + t, _mm256_mul_ps(s, _mm256_permutevar8x32_ps(h, order)));
    }
  }
  return t;
}

// ---- fill_qrep ----------------------------------------------------------------------------

// The only capability where split_k is set (kSplitPairs).
C10_ALWAYS_INLINE void fill_qrep_chunk(const float* chunk, float* rp, int64_t x, int64_t q_repeat,
                                       bool split_k) {
  if (split_k) {  // x == W: [even, even, odd, odd] elements of the chunk
    const __m256 v = _mm256_loadu_ps(chunk);
    const __m256 e = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    const __m256 o = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7));
    _mm256_storeu_ps(rp, e);
    _mm256_storeu_ps(rp + W, o);
    return;
  }
  if (x == 4 && q_repeat == 8) {  // fp32: the 4 elements in both halves
    _mm256_storeu_ps(rp, _mm256_broadcast_ps(reinterpret_cast<const __m128*>(chunk)));
    return;
  }
  portable::fill_qrep_chunk(chunk, rp, x, q_repeat, split_k);
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
