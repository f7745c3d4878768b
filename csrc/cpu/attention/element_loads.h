// The attention kernel's element loads and prefetches: cache elements of any type loaded as
// fp32 lanes (fp8 decoded). The vector type, horizontal sums and the instruction-set-specific
// parts (fp8 decode, bf16 read in pairs, bf16 pair dot products, in_register, lane sums): isa.h.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/fp8.h"
#include "cpu/arch/isa.h"
#include "cpu/attention/tuning.h"

// Before the loops that start and store a step's array of accumulators (VecF a[G][T]): fully
// unrolled, the array lives in registers; as a loop, GCC zeroes it on the stack and copies it
// out through the stack, ~135 cycles per call (bf16 q.k on Zen 4, arithmetic alone, 1.04x).
#define PAGED_UNROLL _Pragma("GCC unroll 32")

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// Load `count` (<= W) elements of T as fp32 lanes; missing lanes are zero.
template <typename T>
inline VecF load_f32(const T* p, int64_t count = W) {
  if constexpr (std::is_same_v<T, float>) {
    return count == W ? VecF::loadu(p) : VecF::loadu(p, count);
  } else if constexpr (is_fp8_v<T>) {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(p);
    if constexpr (kDecodeFp8) {
      if (count == W) return decode_fp8<T>(b);
    }
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

// Load 2 * W elements of T as two fp32 vectors. fp8 where the build decodes it by vectors
// (AVX2, AVX-512): one load, widened and shifted once for both halves.
template <typename T>
inline void load2_f32(const T* p, VecF& lo, VecF& hi) {
  if constexpr (is_fp8_v<T> && kDecodeFp8) {
    decode_fp8_two<T>(reinterpret_cast<const uint8_t*>(p), lo, hi);
    return;
  }
  lo = load_f32(p);
  hi = load_f32(p + W);
}

// bf16 dot products (the avx512_bf16 build, PAGED_OPS_DOT_BF16): dot_pairs (isa.h, vdpbf16ps)
// adds to each fp32 lane the two products of a pair of bf16 values. Twice the multiply-adds of
// an fp32 FMA and no conversion, for q.k of a bf16 cache with bf16 queries: the q values are
// then bf16 already, so the products are the ones the fp32 path forms.
#if defined(PAGED_OPS_DOT_BF16)
constexpr bool kDotBF16 = true;
#else
constexpr bool kDotBF16 = false;
#endif

// The caches the dot paths read (with bf16 queries): bf16, and fp8 where its byte tables give
// bf16 pairs exactly (decode_fp8_pairs, 16 lanes), which reads 4 W values at once.
template <typename T>
constexpr bool kDotCache =
    kDotBF16 && (std::is_same_v<T, c10::BFloat16> || (is_fp8_v<T> && kFp8Tables && W == 16));
template <typename T>
constexpr int64_t kDotLoad = is_fp8_v<T> ? 4 * W : 2 * W;  // elements one dot load reads

// Two consecutive dot_pairs operands (4 W elements) of a block of a kDotCache cache.
template <typename T>
C10_ALWAYS_INLINE void load_pairs2(const T* p, BF16Pairs& lo, BF16Pairs& hi) {
  if constexpr (is_fp8_v<T>) {
    decode_fp8_pairs<T>(reinterpret_cast<const uint8_t*>(p), lo, hi);
  } else {
    lo = load_pairs(p);
    hi = load_pairs(p + 2 * W);
  }
}

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
// unconditionally at the pace of the reads (a line may be asked for twice): cheaper than a
// branch per line. (Values are prefetched by rows with the reads that follow them, not in
// address order.)
// The locality hint: kPrefetchLocality (tuning.h).
inline void prefetch_l2(const void* p) {
  if constexpr (kPrefetchLocality >= 0) __builtin_prefetch(p, 0, kPrefetchLocality);
}

// Prefetch of a key block in address order, spread evenly over the q.k loop that runs
// meanwhile: one step() per chunk iteration, `calls` in all, each prefetching per_call lines
// (more than one only when the block has more lines than the loop has iterations), the line
// index advancing by a fixed-point fraction. q.k reads a key block in strided passes;
// prefetches issued in that order are slower than in address order. Spreading matters: two
// lines per iteration from the block's start (all of a 16-bit block asked for early in its
// q.k, then the last line again and again) stalls on the miss buffers; and every line must be
// asked for.
// A cursor may also walk a list of line addresses (lines): the real blocks behind a staged
// block (staging.h) are scattered runs, not one range.
struct PrefetchCursor {
  const char* base = nullptr;
  const char* const* list = nullptr;  // line addresses, or nullptr: lines of base on
  int64_t pos = 0;  // line index, 16 fractional bits
  int64_t inc = 0, last = 0;
  int per_call = 0;  // 0: nothing to prefetch (step() does nothing)
  PrefetchCursor() = default;
  PrefetchCursor(const void* begin, int64_t bytes, int64_t calls)
      : base(static_cast<const char*>(begin)) {
    pace(std::max<int64_t>(1, bytes / 64), calls);
  }
  PrefetchCursor(const char* const* lines, int64_t n, int64_t calls) : list(lines) {
    if (n > 0) pace(n, calls);
  }
  void pace(int64_t lines, int64_t calls) {
    calls = std::max<int64_t>(1, calls);
    per_call = static_cast<int>((lines + calls - 1) / calls);
    inc = (lines << 16) / (calls * per_call);
    last = (lines - 1) << 16;
  }
  void step() {
    if (list != nullptr) [[unlikely]] {
      for (int i = 0; i < per_call; ++i) {
        prefetch_l2(list[pos >> 16]);
        pos = std::min(pos + inc, last);
      }
      return;
    }
    for (int i = 0; i < per_call; ++i) {
      prefetch_l2(base + ((pos >> 16) << 6));
      pos = std::min(pos + inc, last);
    }
  }
};

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
