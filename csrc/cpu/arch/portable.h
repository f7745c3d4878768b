// The attention kernel's vector type (ATen's Vectorized<float>, per CPU capability), its
// horizontal sums, and the portable versions of the instruction-set hooks (isa.h picks the
// build's): each hook's contract is stated here. The portable (DEFAULT) build and the emulated
// 16-lane test builds run these; an instruction-set header takes those it has no version of.
// The hooks that hold part of a generic function's body are C10_ALWAYS_INLINE: inlined early,
// like code written in place, so that the code around them compiles as it would with the code
// in place (with plain inline, register allocation around them differs).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/macros/Macros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/fp8.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

using VecF = at::vec::Vectorized<float>;
constexpr int64_t W = VecF::size();  // fp32 lanes: 8 (DEFAULT, AVX2) or 16 (AVX-512)

// Horizontal sum / max of the lanes (ATen's shuffle trees on AVX2 and AVX-512).
inline float hsum(const VecF& v) {
  return at::vec::vec_reduce_all<float>([](const VecF& a, const VecF& b) { return a + b; }, v);
}
inline float hmax(const VecF& v) {
  return at::vec::vec_reduce_all<float>(
      [](const VecF& a, const VecF& b) { return at::vec::maximum(a, b); }, v);
}

namespace portable {

// fp8 -> fp32 in the kernel's units (fp8_unit) by vector instructions, where kDecodeFp8:
// decode_fp8 the W bytes at b as W lanes, decode_fp8_two the 2 W bytes at b as two vectors
// (one load for both). Portable: none, load_f32 reads fp8 through the table (the stubs are
// never called).
constexpr bool kDecodeFp8 = false;
template <typename T>
C10_ALWAYS_INLINE VecF decode_fp8(const uint8_t*) {
  return VecF(0.f);
}
template <typename T>
C10_ALWAYS_INLINE void decode_fp8_two(const uint8_t*, VecF&, VecF&) {}

// fp8 -> fp32 of 4 W bytes (16-lane builds: 64 bytes, four groups of 16) through the byte
// tables of fp8.h, where kFp8Tables, in the kernel's units (NaN and Inf included): out[h] lane
// 4 L + j is byte 16 L + kFp8TableOrder[h] + 2 j (even elements of each group's first half,
// odd ones, then the same of its second half), the order two byte interleaves and a shift or a
// mask per vector leave (avx512.h); q.k lays out its query to match. Portable: the same
// lanes from the same tables, one by one, so that the emulated test builds run this path.
#if defined(PAGED_OPS_FP8_TABLES)
constexpr bool kFp8Tables = true;
#else
constexpr bool kFp8Tables = false;
#endif
constexpr int kFp8TableOrder[4] = {0, 1, 8, 9};
template <typename T>
C10_ALWAYS_INLINE void decode_fp8_by_tables(const uint8_t* b, VecF (&out)[4]) {
  static_assert(sizeof(T) == 1 && W == 16, "decode_fp8_by_tables is written for 16 lanes");
  for (int h = 0; h < 4; ++h) {
    float v[W];
    for (int L = 0; L < 4; ++L)
      for (int j = 0; j < 4; ++j) {
        const uint8_t x = b[16 * L + kFp8TableOrder[h] + 2 * j];
        v[4 * L + j] = c10::bit_cast<float>(static_cast<uint32_t>(fp8_bf16_word<T>(x)) << 16);
      }
    out[h] = VecF::loadu(v);
  }
}

// bf16 read in pairs, where kSplitPairs<T>: load_bf16_pairs loads 2 W bf16 values as two
// vectors, the even offsets then the odd ones; load_bf16_half one of the two (i = 0 the even
// elements, i = 1 the odd ones); split_pairs reorders p[0, 2W) of fp32 the same way. Portable:
// not read in pairs (the stubs are never called).
template <typename T>
constexpr bool kSplitPairs = false;
inline void load_bf16_pairs(const c10::BFloat16*, VecF&, VecF&) {}
inline VecF load_bf16_half(const c10::BFloat16*, int) { return VecF(0.f); }
inline void split_pairs(float*) {}

// bf16 pair dot products (kDotBF16): vdpbf16ps takes 2 W bf16 values of each operand and adds
// to fp32 lane j the products of their pair j, odd element first: a[2j + 1] b[2j + 1] +
// a[2j] b[2j], each product exact in fp32, rounded to nearest (and denormals flushed). The
// portable emulation below does the same lane by lane (denormals kept), so the lanes16_dot test
// build runs this path on any CPU.
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
// The operand kept in a register (in_register for bf16 pairs); portable: as it is.
inline BF16Pairs pairs_in_register(const BF16Pairs& v) { return v; }

// fp8 -> bf16 pairs through the byte tables of fp8.h (kFp8Tables; the dot paths on fp8 caches
// with bf16 queries): the 4 W bytes at b as two operands of dot_pairs in element order, lo the
// first 2 W values, hi the next 2 W, in the kernel's units (exact, NaN and Inf kept).
// Portable: value by value.
template <typename T>
C10_ALWAYS_INLINE void decode_fp8_pairs(const uint8_t* b, BF16Pairs& lo, BF16Pairs& hi) {
  static_assert(sizeof(T) == 1 && W == 16, "decode_fp8_pairs is written for 16 lanes");
  uint16_t v[4 * W];
  for (int64_t i = 0; i < 4 * W; ++i) v[i] = fp8_bf16_word<T>(b[i]);
  lo = load_pairs(v);
  hi = load_pairs(v + 2 * W);
}

// fp8 -> bf16 pairs as decode_fp8_pairs, in the order its interleaves leave without a
// reordering of the bytes: each 128-bit block L of lo holds values 16 L .. 16 L + 7 of the 4 W
// bytes at b, of hi values 16 L + 8 .. 16 L + 15. With the fp8 key layout (x = 16) that is
// token L's first and last 8 elements: q.k pairs them with q operands in the same order
// (qk_dot_quads), where the order of the sum's terms is free.
template <typename T>
C10_ALWAYS_INLINE void decode_fp8_quads(const uint8_t* b, BF16Pairs& lo, BF16Pairs& hi) {
  static_assert(sizeof(T) == 1 && W == 16, "decode_fp8_quads is written for 16 lanes");
  uint16_t l[2 * W], h[2 * W];
  for (int64_t L = 0; L < 4; ++L)
    for (int64_t j = 0; j < 8; ++j) {
      l[8 * L + j] = fp8_bf16_word<T>(b[16 * L + j]);
      h[8 * L + j] = fp8_bf16_word<T>(b[16 * L + 8 + j]);
    }
  lo = load_pairs(l);
  hi = load_pairs(h);
}

// a + v * p in the lanes set in mask (bit i: lane i), a as it is in the others, whatever v and
// p hold there (NaN included): pv_group_any's vectors that straddle two V rows. And the
// lanes of mask loaded from p, zero elsewhere (the others' addresses are not read).
// Portable: lane by lane.
inline VecF fmadd_lanes(const VecF& v, const VecF& p, const VecF& a, uint32_t mask) {
  alignas(64) float vv[W], pp[W], aa[W];
  v.store(vv);
  p.store(pp);
  a.store(aa);
  for (int64_t i = 0; i < W; ++i)
    if (mask >> i & 1) aa[i] = std::fma(vv[i], pp[i], aa[i]);
  return VecF::loadu(aa);
}
inline VecF load_lanes(const float* p, uint32_t mask) {
  alignas(64) float out[W] = {};
  for (int64_t i = 0; i < W; ++i)
    if (mask >> i & 1) out[i] = p[i];
  return VecF::loadu(out);
}

// Keeps a vector in a register: stops the compiler from folding its load into every FMA that
// uses it (one load per use would then bound the loop). Portable: the vector itself.
inline VecF in_register(VecF v) { return v; }

// Lane i of the result: lane idx[i] of v (idx: W indices < W). For pv_tiny's patterns.
// Portable: through memory.
C10_ALWAYS_INLINE VecF permute_lanes(const VecF& v, const int32_t* idx) {
  alignas(64) float a[W], t[W];
  v.store(a);
  for (int64_t i = 0; i < W; ++i) t[i] = a[idx[i]];
  return VecF::loadu(t);
}

// The H floats at p repeated across the lanes (lane i: p[i % H]; H divides W): the
// probabilities of a block of H tokens against a vector of W / H V rows (pv_tiny). Portable:
// through memory.
template <int H>
C10_ALWAYS_INLINE VecF repeat_lanes(const float* p) {
  if constexpr (H == 1) {
    return VecF(*p);
  } else {
    alignas(64) float t[W];
    for (int64_t i = 0; i < W; ++i) t[i] = p[i % H];
    return VecF::loadu(t);
  }
}

// Lane k of the result = horizontal sum of r[k], for k < W.
inline VecF reduce_rows(const VecF* r) {
  float out[W];
  for (int64_t k = 0; k < W; ++k) out[k] = hsum(r[k]);
  return VecF::loadu(out);
}

// tile_sums (pv.h) of a tile of RT rows x DT vectors by one shuffle tree, where
// kTileSumsByShuffles<RT, DT>; tile_sums sums each vector on its own otherwise. Portable: none.
template <int RT, int DT>
constexpr bool kTileSumsByShuffles = false;
template <int RT, int DT>
C10_ALWAYS_INLINE void tile_sums_by_shuffles(const VecF (&)[RT][DT], float*, const float*,
                                             bool) {}

// sum_lane_groups (qk.h) of the first tokens by shuffles: z[t] = sum_i raw[t * x + i]; returns
// how many tokens it summed, sum_lane_groups does the rest. Portable: none.
C10_ALWAYS_INLINE int64_t sum_lane_groups_by_shuffles(const float*, int64_t, int64_t, float*,
                                                      float) {
  return 0;
}

// One chunk of fill_qrep (attention/qk_paths.h): the x elements at chunk repeated into
// rp[0, q_repeat), x < q_repeat; with split_k (set only where kSplitPairs) the even elements,
// then the odd ones, each twice. Portable: element by element (split_k is never set).
C10_ALWAYS_INLINE void fill_qrep_chunk(const float* chunk, float* rp, int64_t x,
                                       int64_t q_repeat, bool) {
  for (int64_t r = 0; r < q_repeat; r += x)
    for (int64_t i = 0; i < x; ++i) rp[r + i] = chunk[i];
}

}  // namespace portable
}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
