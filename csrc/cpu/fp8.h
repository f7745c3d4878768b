// fp8 caches (torch.float8_e4m3fn, torch.float8_e5m2): the encoder reshape_and_cache
// quantises with (cache_ops.cpp) and the decoder's scalar parts the attention kernel reads with
// (attention/kernel.h, whose element loads also hold the vector decode). Compiled into every
// CPU build that includes it (namespace CPU_CAPABILITY).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>
#include <vector>

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(_M_X64))
#include <immintrin.h>
#endif

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// ---- decoding (the attention kernel) ----------------------------------------------------------

template <typename T>
constexpr bool is_fp8_v =
    std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// The kernel reads e4m3fn caches in units of 2^-8 (the value times 2^-8, exact): that is what
// reinterpreting its bits as an fp16 gives, so the vector decode is a shift and a convert. The
// factor 2^8 is folded into the scales (fp8_unit).
template <typename T>
constexpr float fp8_unit() {
  return std::is_same_v<T, c10::Float8_e4m3fn> ? 256.f : 1.f;
}

// fp8 -> fp32 (in the kernel's units) by table lookup: the scalar and partial-vector path.
template <typename T>
inline const float* fp8_table() {
  static const auto table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) {
      t[i] = static_cast<float>(T(static_cast<uint8_t>(i), T::from_bits())) / fp8_unit<T>();
    }
    return t;
  }();
  return table.data();
}

// The e4m3 NaN (magnitude 0x7f). The vector decode of the AVX2 and AVX-512 builds reads it as
// a finite number; the kernel finds it by scanning each block it reads instead (a bound on the
// decode's cost: two instructions per 64 bytes here against two per 16-32 values there), and
// sets the logits and outputs it reaches to NaN (attention/nonfinite.h).
inline bool is_e4m3_nan(uint8_t b) { return (b & 0x7F) == 0x7F; }
// Whether n bytes hold an e4m3 NaN: their largest magnitude is 0x7f exactly then (a max
// reduction the compiler vectorises).
inline bool e4m3_has_nan(const uint8_t* p, int64_t n) {
  uint8_t m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max<uint8_t>(m, p[i] & 0x7F);
  return m == 0x7F;
}

// fp8 -> bf16 bits, in the kernel's units, by 128-entry byte tables indexed by the magnitude
// (the low 7 bits): the high and the low byte of the bf16 of |value| / fp8_unit (exact: every
// fp8 value is a bf16 value, subnormals included, and bf16 subnormals are never needed). The
// sign is the byte's top bit, which is the bf16's too. For decode_fp8_by_tables (isa.h).
struct Fp8Bf16Tables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
};
template <typename T>
constexpr uint16_t fp8_bf16_bits(int i) {
  constexpr bool e4m3 = std::is_same_v<T, c10::Float8_e4m3fn>;
  constexpr int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, emax = e4m3 ? 15 : 31;
  constexpr int unit_log2 = e4m3 ? 8 : 0;  // fp8_unit
  const int e = i >> mbits, m = i & ((1 << mbits) - 1);
  if (e4m3 && i == 0x7F) return 0x7FC0;                      // NaN (e4m3fn has no Inf)
  if (!e4m3 && e == emax) return m == 0 ? 0x7F80 : 0x7FC0;  // Inf, NaN
  // |value| / unit = mant * 2^exp2 with an integer mant (the implicit bit for normals).
  const int mant = e > 0 ? (1 << mbits) + m : m;
  const int exp2 = (e > 0 ? e : 1) - bias - mbits - unit_log2;
  if (mant == 0) return 0;
  const int top = 31 - std::countl_zero(static_cast<uint32_t>(mant));  // mant = 1.f * 2^top
  const int frac = (mant - (1 << top)) << (7 - top);
  return static_cast<uint16_t>(((top + exp2 + 127) << 7) | frac);
}
template <typename T>
constexpr Fp8Bf16Tables make_fp8_bf16_tables() {
  Fp8Bf16Tables t{};
  for (int i = 0; i < 128; ++i) {
    t.hi[i] = static_cast<uint8_t>(fp8_bf16_bits<T>(i) >> 8);
    t.lo[i] = static_cast<uint8_t>(fp8_bf16_bits<T>(i) & 0xFF);
  }
  return t;
}
template <typename T>
inline constexpr Fp8Bf16Tables kFp8Bf16Tables = make_fp8_bf16_tables<T>();
// The bf16 bits of fp8 byte b, in the kernel's units, by the tables: the scalar form of the
// vector lookups (portable decode_fp8_by_tables and decode_fp8_pairs).
template <typename T>
inline uint16_t fp8_bf16_word(uint8_t b) {
  const Fp8Bf16Tables& t = kFp8Bf16Tables<T>;
  return static_cast<uint16_t>(((t.hi[b & 0x7F] | (b & 0x80)) << 8) | t.lo[b & 0x7F]);
}
// 2^-9 / 2^8 (e4m3's smallest subnormal, in units of 2^-8) and 448 / 2^8; e5m2's 2^-16, 57344.
static_assert(fp8_bf16_bits<c10::Float8_e4m3fn>(0x01) == ((127 - 17) << 7));
static_assert(fp8_bf16_bits<c10::Float8_e4m3fn>(0x7E) == (((127 + 0) << 7) | 0x60));
static_assert(fp8_bf16_bits<c10::Float8_e5m2>(0x01) == ((127 - 16) << 7));
static_assert(fp8_bf16_bits<c10::Float8_e5m2>(0x7B) == (((127 + 15) << 7) | 0x60));

// ---- fp8 quantisation: round(x / scale), saturated to +-max, round-to-nearest-even ----------

inline float bits_to_float(uint32_t b) { return std::bit_cast<float>(b); }
inline uint32_t float_to_bits(float f) { return std::bit_cast<uint32_t>(f); }
// Branch-free selects (all-ones / all-zeros masks), so that the loops below vectorise even
// though the compiler keeps IEEE trapping semantics.
inline uint32_t mask_if(bool c) { return 0u - static_cast<uint32_t>(c); }
inline uint32_t select(uint32_t m, uint32_t a, uint32_t b) { return (a & m) | (b & ~m); }

inline float load_float(float v) { return v; }
inline float load_float(c10::BFloat16 v) { return bits_to_float(static_cast<uint32_t>(v.x) << 16); }
// IEEE half -> float (the branch-free formulation of c10's fp16_ieee_to_fp32_value).
inline float load_float(c10::Half v) {
  const uint32_t w = static_cast<uint32_t>(v.x) << 16;
  const uint32_t sign = w & UINT32_C(0x80000000);
  const uint32_t two_w = w + w;
  const float normalized =
      bits_to_float((two_w >> 4) + (UINT32_C(0xE0) << 23)) * bits_to_float(UINT32_C(0x7800000));
  const float denormalized = bits_to_float((two_w >> 17) | (UINT32_C(126) << 23)) - 0.5f;
  const uint32_t bits = select(mask_if(two_w < (UINT32_C(1) << 27)), float_to_bits(denormalized),
                               float_to_bits(normalized));
  return bits_to_float(sign | bits);
}

struct E4M3 {  // torch.float8_e4m3fn: bias 7, 3 mantissa bits, max 448, no infinities
  static constexpr float kMax = 448.0f;
  static constexpr uint32_t kMinNormal = UINT32_C(121) << 23;    // 2^-6
  static constexpr uint32_t kDenormMagic = UINT32_C(141) << 23;  // 2^14: 2^-9 at the unit bit
  static constexpr uint32_t kBiasAdjust = static_cast<uint32_t>(7 - 127) << 23;
  static constexpr int kShift = 20;  // 23 - 3 mantissa bits
};
struct E5M2 {  // torch.float8_e5m2: bias 15, 2 mantissa bits, max 57344
  static constexpr float kMax = 57344.0f;
  static constexpr uint32_t kMinNormal = UINT32_C(113) << 23;    // 2^-14
  static constexpr uint32_t kDenormMagic = UINT32_C(134) << 23;  // 2^7: 2^-16 at the unit bit
  static constexpr uint32_t kBiasAdjust = static_cast<uint32_t>(15 - 127) << 23;
  static constexpr int kShift = 21;  // 23 - 2 mantissa bits
};

// The bits of fp8 format F nearest to f (ties to even), saturated to +-F::kMax (also for
// +-Inf); NaN stays NaN. For |f| <= kMax this is exactly c10's conversion (the same rounding
// arithmetic), so the kernel and torch's `.to(float8)` after a clamp agree bit for bit.
template <typename F>
inline uint8_t fp8_bits(float f) {
  uint32_t b = float_to_bits(f);
  const uint32_t sign = b & UINT32_C(0x80000000);
  b ^= sign;  // |f|; below 2^31, so signed compares (one instruction on x86) are exact
  constexpr int32_t kInfBits = 0x7F800000;
  constexpr uint32_t kMaxBits = std::bit_cast<uint32_t>(F::kMax);
  const uint32_t nan = mask_if(static_cast<int32_t>(b) > kInfBits);
  b = std::min(b, kMaxBits);  // saturate (+-Inf included); NaN is restored below
  // Below the smallest normal: adding the magic number leaves the subnormal mantissa, rounded
  // to nearest even by the FPU, in the low bits.
  const uint32_t sub =
      float_to_bits(bits_to_float(b) + bits_to_float(F::kDenormMagic)) - F::kDenormMagic;
  // Normal: rebias the exponent and round the mantissa to nearest even.
  const uint32_t odd = (b >> F::kShift) & 1u;
  const uint32_t nrm =
      (b + (F::kBiasAdjust + ((UINT32_C(1) << (F::kShift - 1)) - 1)) + odd) >> F::kShift;
  uint32_t r = select(mask_if(static_cast<int32_t>(b) < static_cast<int32_t>(F::kMinNormal)),
                      sub, nrm);
  // NaN: b was clamped to the max (0x7E / 0x7B), so or-ing 0x7F gives the format's NaN.
  r |= nan & UINT32_C(0x7F);
  return static_cast<uint8_t>(r | (sign >> 24));
}

// Quantise `rows` rows of `n` elements (row stride `ss` elements) into dst (rows of n bytes).
using QuantizeFn = void (*)(const void*, int64_t, int64_t, int64_t, uint8_t*, float);

// Portable build: the branch-free fp8_bits lets the compiler vectorise the loop (SSE2).
template <typename F, typename In>
void quantize_default(const void* src_, int64_t ss, int64_t rows, int64_t n, uint8_t* dst,
                      float scale) {
  const In* src = static_cast<const In*>(src_);
  for (int64_t j = 0; j < rows; ++j) {
    const In* __restrict x = src + j * ss;
    uint8_t* __restrict o = dst + j * n;
    for (int64_t i = 0; i < n; ++i) o[i] = fp8_bits<F>(load_float(x[i]) / scale);
  }
}

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(_M_X64))
#define PAGED_OPS_AVX2_QUANTIZE 1
// The same arithmetic as fp8_bits, 8 lanes at a time with AVX2 (+F16C for fp16 input), compiled
// for those instructions by function attribute and chosen at run time when the CPU has them.
#define PAGED_OPS_AVX2 __attribute__((target("avx2,f16c")))

template <typename F>
PAGED_OPS_AVX2 inline __m256i fp8_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN));
  __m256i b = _mm256_xor_si256(bits, sign);
  const __m256i nan = _mm256_cmpgt_epi32(b, _mm256_set1_epi32(0x7F800000));
  b = _mm256_min_epu32(b, _mm256_set1_epi32(std::bit_cast<int32_t>(F::kMax)));
  const __m256i magic = _mm256_set1_epi32(static_cast<int32_t>(F::kDenormMagic));
  const __m256i sub = _mm256_sub_epi32(
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(b), _mm256_castsi256_ps(magic))),
      magic);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, F::kShift), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_set1_epi32(
      static_cast<int32_t>(F::kBiasAdjust + ((UINT32_C(1) << (F::kShift - 1)) - 1)));
  const __m256i nrm = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, bias), odd),
                                        F::kShift);
  const __m256i small =
      _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(F::kMinNormal)), b);
  __m256i r = _mm256_blendv_epi8(nrm, sub, small);
  r = _mm256_or_si256(r, _mm256_and_si256(nan, _mm256_set1_epi32(0x7F)));
  return _mm256_or_si256(r, _mm256_srli_epi32(sign, 24));
}

PAGED_OPS_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
PAGED_OPS_AVX2 inline __m256 load8(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
PAGED_OPS_AVX2 inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));  // exact
}

template <typename F, typename In>
PAGED_OPS_AVX2 void quantize_avx2(const void* src_, int64_t ss, int64_t rows, int64_t n,
                                  uint8_t* dst, float scale) {
  const In* src = static_cast<const In*>(src_);
  const __m256 s = _mm256_set1_ps(scale);
  // packus interleaves the 128-bit lanes; this puts the 32 bytes back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t j = 0; j < rows; ++j) {
    const In* x = src + j * ss;
    uint8_t* o = dst + j * n;
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      __m256i r[4];
      for (int u = 0; u < 4; ++u) r[u] = fp8_bits8<F>(_mm256_div_ps(load8(x + i + 8 * u), s));
      const __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(r[0], r[1]),
                                            _mm256_packus_epi32(r[2], r[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i),
                          _mm256_permutevar8x32_epi32(p, order));
    }
    for (; i < n; ++i) o[i] = fp8_bits<F>(load_float(x[i]) / scale);
  }
}
#endif

template <typename F, typename In>
QuantizeFn pick_quantize() {
#ifdef PAGED_OPS_AVX2_QUANTIZE
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  if (avx2) return &quantize_avx2<F, In>;
#endif
  return &quantize_default<F, In>;
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
