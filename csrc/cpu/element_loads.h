// The attention kernel's vector basics (at::vec, per CPU capability): cache elements of any
// type loaded as fp32 lanes (fp8 decoded, bf16 in pairs), bf16 pair dot products,
// prefetches, and horizontal sums.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/fp8.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

using VecF = at::vec::Vectorized<float>;
constexpr int64_t W = VecF::size();  // fp32 lanes: 8 (DEFAULT, AVX2) or 16 (AVX-512)

// Load `count` (<= W) elements of T as fp32 lanes; missing lanes are zero.
template <typename T>
inline VecF load_f32(const T* p, int64_t count = W) {
  if constexpr (std::is_same_v<T, float>) {
    return count == W ? VecF::loadu(p) : VecF::loadu(p, count);
  } else if constexpr (is_fp8_v<T>) {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(p);
#if defined(CPU_CAPABILITY_AVX2)
    if (count == W) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
      if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
        // e5m2 is the high byte of an fp16: widen, shift, convert with F16C.
        return VecF(_mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8)));
      } else {
        // e4m3fn s.eeee.mmm -> fp16 s.0eeee.mmm0000000 = value * 2^-8 (subnormals included):
        // sign-extend, shift into place, clear the copy of the sign in bit 14, convert. (0x7f,
        // NaN, reads as 480: only unwritten slots hold it, and those are masked by position.)
        const __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7),
                                        _mm_set1_epi16(static_cast<int16_t>(0xBFFF)));
        return VecF(_mm256_cvtph_ps(h));
      }
    }
#elif defined(CPU_CAPABILITY_AVX512)
    if (count == W) {  // as on AVX2, 16 lanes
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
        return VecF(_mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8)));
      } else {
        const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                           _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
        return VecF(_mm512_cvtph_ps(h));
      }
    }
#endif
    // The table only here: its first-use guard (a call) inside the vector path above made the
    // compiler spill every vector register around it.
    const float* lut = fp8_table<T>();
    float tmp[W] = {};
    for (int64_t i = 0; i < count; ++i) tmp[i] = lut[b[i]];
    return VecF::loadu(tmp);
  } else {
    if (count == W) {
      VecF out;
      at::vec::load_to_float<T>(p, out);
      return out;
    }
    T tmp[W];
    std::memset(tmp, 0, sizeof(tmp));
    std::memcpy(tmp, p, count * sizeof(T));
    VecF out;
    at::vec::load_to_float<T>(tmp, out);
    return out;
  }
}

// Load 2 * W elements of T as two fp32 vectors. fp8 on AVX2: one 16-byte load, widened and
// shifted once for both halves.
template <typename T>
inline void load2_f32(const T* p, VecF& lo, VecF& hi) {
#if defined(CPU_CAPABILITY_AVX2)
  if constexpr (is_fp8_v<T>) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m256i h;
    if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
      h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8);
    } else {  // see load_f32
      h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                           _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)));
    }
    lo = VecF(_mm256_cvtph_ps(_mm256_castsi256_si128(h)));
    hi = VecF(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    return;
  }
#elif defined(CPU_CAPABILITY_AVX512)
  if constexpr (is_fp8_v<T>) {  // as on AVX2: one 32-byte load for both halves
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    __m512i h;
    if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
      h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(bytes), 8);
    } else {
      h = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(bytes), 7),
                           _mm512_set1_epi16(static_cast<int16_t>(0xBFFF)));
    }
    lo = VecF(_mm512_cvtph_ps(_mm512_castsi512_si256(h)));
    hi = VecF(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)));
    return;
  }
#endif
  lo = load_f32(p);
  hi = load_f32(p + W);
}

// bf16 pairs: a 32-bit lane of two neighbouring bf16 values holds the upper one as an fp32
// with its low half cleared, and the lower one shifted up by 16 bits: both exact, without the
// widening shuffle of load_f32. The values come out split, even offsets then odd ones.
#if defined(CPU_CAPABILITY_AVX2)
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
#else
template <typename T>
constexpr bool kSplitPairs = false;
inline void load_bf16_pairs(const c10::BFloat16*, VecF&, VecF&) {}
inline VecF load_bf16_half(const c10::BFloat16*, int) { return VecF(0.f); }
inline void split_pairs(float*) {}
#endif

// bf16 dot products (the avx512_bf16 build, PAGED_OPS_DOT_BF16): vdpbf16ps takes 2 W bf16
// values of each operand and adds to fp32 lane j the products of their pair j, odd element
// first: a[2j + 1] b[2j + 1] + a[2j] b[2j], each product exact in fp32, rounded to nearest (and
// denormals flushed). Twice the multiply-adds of an fp32 FMA and no conversion, for q.k of a
// bf16 cache with bf16 queries: the q values are then bf16 already, so the products are the
// ones the fp32 path forms. The portable emulation below does the same lane by lane (denormals
// kept), so the lanes16_dot test build runs this path on any CPU.
#if defined(PAGED_OPS_DOT_BF16)
constexpr bool kDotBF16 = true;
#else
constexpr bool kDotBF16 = false;
#endif
#if defined(__AVX512BF16__)
static_assert(W == 16, "vdpbf16ps needs the 16-lane (AVX-512) vectors");
using BF16Pairs = __m512bh;
inline BF16Pairs load_pairs(const void* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}
inline VecF dot_pairs(const VecF& acc, const BF16Pairs& a, const BF16Pairs& b) {
  return VecF(_mm512_dpbf16_ps(acc, a, b));
}
#else
struct BF16Pairs {
  uint16_t v[2 * W];
};
inline BF16Pairs load_pairs(const void* p) {
  BF16Pairs r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline VecF dot_pairs(const VecF& acc, const BF16Pairs& a, const BF16Pairs& b) {
  auto f = [](uint16_t bits) { return c10::bit_cast<float>(static_cast<uint32_t>(bits) << 16); };
  float out[W];
  acc.store(out);
  for (int64_t j = 0; j < W; ++j) {
    out[j] += f(a.v[2 * j + 1]) * f(b.v[2 * j + 1]);
    out[j] += f(a.v[2 * j]) * f(b.v[2 * j]);
  }
  return VecF::loadu(out);
}
#endif

template <typename T>
inline float to_f32(T v) {
  if constexpr (is_fp8_v<T>) {
    return fp8_table<T>()[reinterpret_cast<const uint8_t&>(v)];
  } else {
    return static_cast<float>(v);
  }
}

// Prefetch of the blocks read next (the next kv head of the group, or the next group), spread
// over the loops that read the current ones: the table scatters blocks, so the hardware
// prefetcher cannot find the next group, and a burst of prefetches for whole blocks stalls on
// the core's miss buffers. Into L2 (locality 1), so the current blocks keep L1. Issued
// unconditionally at the pace of the reads (a line may be asked for twice): measured faster
// than a branch per line. (Values prefetched in address order instead, part of it during the
// softmax, measured 3-10% slower.)
// PAGED_OPS_PREFETCH_LOCALITY: the locality hint, a compile-time switch for benchmarks (-1:
// no software prefetch). Against L2 (1), on the Xeon of benchmarks/RESULTS.md, bf16 and fp32
// at block sizes 16 and 128: L1 (3) 0.88-0.93x, non-temporal (0) 0.38-0.44x, none 0.72-0.90x.
#ifndef PAGED_OPS_PREFETCH_LOCALITY
#define PAGED_OPS_PREFETCH_LOCALITY 1
#endif
inline void prefetch_l2(const void* p) {
#if PAGED_OPS_PREFETCH_LOCALITY >= 0
  __builtin_prefetch(p, 0, PAGED_OPS_PREFETCH_LOCALITY);
#endif
}

// Prefetch of a key block in address order, spread evenly over the q.k loop that runs
// meanwhile: one step() per chunk iteration, `calls` in all, each prefetching per_call lines
// (more than one only when the block has more lines than the loop has iterations), the line
// index advancing by a fixed-point fraction. q.k reads a key block in strided passes, and
// prefetches issued in that order were measured 6-7% slower (same access, microbenchmark)
// than in address order. Spreading matters: two lines per iteration from the block's start
// (all of a 16-bit block prefetched in the first 40% of its q.k, then the last line asked
// for again and again) made 16-bit caches 8-17% slower; every line must be asked for (every
// other line: 20% slower).
struct PrefetchCursor {
  const char* base;
  int64_t pos = 0;  // line index, 16 fractional bits
  int64_t inc, last;
  int per_call;
  PrefetchCursor(const void* begin, int64_t bytes, int64_t calls)
      : base(static_cast<const char*>(begin)) {
    const int64_t lines = std::max<int64_t>(1, bytes / 64);
    calls = std::max<int64_t>(1, calls);
    per_call = static_cast<int>((lines + calls - 1) / calls);
    inc = (lines << 16) / (calls * per_call);
    last = (lines - 1) << 16;
  }
  void step() {
    for (int i = 0; i < per_call; ++i) {
      prefetch_l2(base + ((pos >> 16) << 6));
      pos = std::min(pos + inc, last);
    }
  }
};

// Keeps a vector in a register: stops the compiler from folding its load into every FMA that
// uses it (one load per use would then bound the loop).
inline VecF in_register(VecF v) {
#if defined(CPU_CAPABILITY_AVX2)
  __m256 r = v;
  asm("" : "+x"(r));
  return VecF(r);
#elif defined(CPU_CAPABILITY_AVX512)
  __m512 r = v;
  asm("" : "+v"(r));
  return VecF(r);
#else
  return v;
#endif
}

// Horizontal sum / max of the lanes (ATen's shuffle trees on AVX2 and AVX-512).
inline float hsum(const VecF& v) {
  return at::vec::vec_reduce_all<float>([](const VecF& a, const VecF& b) { return a + b; }, v);
}
inline float hmax(const VecF& v) {
  return at::vec::vec_reduce_all<float>(
      [](const VecF& a, const VecF& b) { return at::vec::maximum(a, b); }, v);
}

// Lane k of the result = horizontal sum of r[k], for k < W.
inline VecF reduce_rows(const VecF* r) {
#if defined(CPU_CAPABILITY_AVX2)
  const __m256 h0 = _mm256_hadd_ps(r[0], r[1]);
  const __m256 h1 = _mm256_hadd_ps(r[2], r[3]);
  const __m256 h2 = _mm256_hadd_ps(r[4], r[5]);
  const __m256 h3 = _mm256_hadd_ps(r[6], r[7]);
  const __m256 i0 = _mm256_hadd_ps(h0, h1);  // [r0..r3 low-half sums | r0..r3 high-half sums]
  const __m256 i1 = _mm256_hadd_ps(h2, h3);
  return VecF(_mm256_add_ps(_mm256_permute2f128_ps(i0, i1, 0x20),
                            _mm256_permute2f128_ps(i0, i1, 0x31)));
#else
  float out[W];
  for (int64_t k = 0; k < W; ++k) out[k] = hsum(r[k]);
  return VecF::loadu(out);
#endif
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
