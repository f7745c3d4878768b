// CPU paged attention, written once with at::vec and compiled per CPU capability (the including
// file defines CPU_CAPABILITY; see kernels.h and setup.py).
//
// Work item = (sequence, kv heads, chunk of query tokens, split of the block range): every query
// row of a kv head (its tokens x the whole GQA group of heads) is handled together, so each K/V
// block is read from memory once. Decode has one token per sequence and an item takes all kv
// heads of its blocks (contiguous in the cache); when the sequences cannot keep every thread
// busy, long sequences are split over threads and the partial softmax states merged exactly
// (flash-decoding), then the kv heads. Multi-token items take one kv head. Blocks are read
// straight from the cache through the block table (no gathered copy) with a blockwise online
// softmax (seed 004):
//   m_new = max(m, max_t z_t);  l = l * e^(m - m_new) + sum_t e^(z_t - m_new);
//   acc = acc * e^(m - m_new) + sum_t e^(z_t - m_new) v_t.
// Positions that are not visible (past seq_len in the last block, before the sliding window)
// are excluded by position, never by value, so NaN/Inf in unwritten slots cannot leak.
//
// Reading order: make_plan cuts the call into items, item_info says what an item covers, and
// ItemWorker runs an item on one thread: start (query rows), then for each group of blocks
// and each kv head group_blocks (what to read and prefetch), logits (q.k, qk_tile), softmax
// (softmax_step) and pv (pv_group), and finish (normalise, or store a split's partial state
// for merge_splits).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/fp8.h"
#include "cpu/kernels.h"
#include "cpu/work_plan.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// Switches for benchmarks/kernel_phases.py, which times the phases of the kernel by building
// it without each one (the others then run on stale but finite data): q.k, the softmax step,
// p.v; PHASE_ARITH reads only the first two blocks of every sequence, alternately, so K and V
// come from the core's caches and a call costs its arithmetic alone. The library builds leave
// them as they are here.
#ifndef PAGED_OPS_PHASE_ARITH
#define PAGED_OPS_PHASE_ARITH 0
#endif
#ifndef PAGED_OPS_PHASE_QK
#define PAGED_OPS_PHASE_QK 1
#endif
#ifndef PAGED_OPS_PHASE_SM
#define PAGED_OPS_PHASE_SM 1
#endif
#ifndef PAGED_OPS_PHASE_PV
#define PAGED_OPS_PHASE_PV 1
#endif

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

// Per-thread scratch, grown on demand and reused across calls (no allocation per block or call
// once warm). R = query rows of one kv head of a work item (tokens x GQA group), HR = rows of
// all its kv heads: the state that lives through the item (qrep, acc, m, l) has HR rows, the
// per-step buffers R.
struct Scratch {
  std::vector<float> qrep;  // [HR][D/x][q_repeat]: q chunk c (pre-scaled) repeated to q_repeat
  std::vector<float> raw;    // [R][raw_row] per-lane partial q.k sums of one block (t * x + i)
  std::vector<float> p;  // [R][kGroup * block_row] logits, then probabilities of a group
  std::vector<float> acc;    // [HR][D][W] running sum of p * v, lanes not yet summed (lane_acc)
  std::vector<float> ot;     // [HR][D] running sum of p * v (pv_group), tile-major (tile_sums)
  std::vector<float> alpha;  // [HR] the group's rescale factor of each row's sum (softmax_step)
  std::vector<float> o;      // [HR][D] the sum of p * v in rows, at the end of an item
  std::vector<float> qf;     // [D] one query row in fp32, pre-scaled (to fill qrep)
  std::vector<float> vtmp;   // [kGroup][D * bs] fp32 copies of V blocks, hidden columns zeroed
  std::vector<uint8_t> vraw;  // [kGroup][D * bs] copies of V blocks in the cache's type, ditto
  std::vector<float> m, l;   // [HR] running max / normalizer
  std::vector<int64_t> row_P, row_lo;  // [R] per row: last and first visible position
};

inline Scratch& thread_scratch() {
  static thread_local Scratch s;
  return s;
}

// Blocks per softmax step (see the block loop of attention_impl): at most kGroup, and about
// kGroupTokens tokens, so that a group's K and V and the next group's, prefetched meanwhile,
// stay well inside L2 whatever the block size.
constexpr int64_t kGroup = 4;
#ifndef PAGED_OPS_GROUP_TOKENS
#define PAGED_OPS_GROUP_TOKENS 128
#endif
constexpr int64_t kGroupTokens = PAGED_OPS_GROUP_TOKENS;

// Prefetch of the blocks read next (the next kv head of the group, or the next group), spread
// over the loops that read the current ones: the table scatters blocks, so the hardware
// prefetcher cannot find the next group, and a burst of prefetches for whole blocks stalls on
// the core's miss buffers. Into L2 (locality 1), so the current blocks keep L1. Issued
// unconditionally at the pace of the reads (a line may be asked for twice): measured faster
// than a branch per line. (Values prefetched in address order instead, part of it during the
// softmax, measured 3-10% slower.)
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 1); }

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

// One q.k step over every chunk of a key block, for TOK units of H vectors each starting at
// element `in` of the chunk; unit t pairs with the q chunk (H vectors, q repeated to H * W
// lanes) and accumulates into raw[g][out + t * W ...]. Each q vector is loaded once per chunk
// for all TOK units (kept in a register, not folded into every FMA: loads bound the loop).
//   H = 1 (x <= W, q repeated): units are K vectors, several tokens' chunks each when x < W.
//   H = 2 (q repeated to 2 W lanes): units of 2 W elements whose two halves fold into one
//     accumulator. fp8 on AVX2 (x = 2 W): a unit is one token's chunk, raw holds W lanes per
//     token. bf16 on AVX2 read in pairs (load_bf16_pairs): a unit is two tokens' chunks split
//     into even and odd elements, raw holds W / 2 lanes per token.
template <int G_T, int TOK, int H, typename T>
inline void qk_step(const T* kblk, const float* qrep, float* raw, int64_t num_chunks,
                    int64_t chunk_elems, int64_t raw_stride, PrefetchCursor& pf, int64_t in,
                    int64_t out) {
  VecF a[G_T][TOK];
  for (int g = 0; g < G_T; ++g)
    for (int t = 0; t < TOK; ++t) a[g][t] = VecF(0.f);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t off = c * chunk_elems + in;
    pf.step();
    VecF k[TOK][H];
    for (int t = 0; t < TOK; ++t) {
      if constexpr (H == 2) {
        if constexpr (kSplitPairs<T>) {
          load_bf16_pairs(kblk + off + t * 2 * W, k[t][0], k[t][1]);  // q split to match
        } else {
          load2_f32(kblk + off + t * 2 * W, k[t][0], k[t][1]);
        }
      } else {
        k[t][0] = load_f32(kblk + off + t * W);
      }
    }
    for (int g = 0; g < G_T; ++g) {
      for (int h = 0; h < H; ++h) {
        const VecF q = in_register(VecF::loadu(qrep + (g * num_chunks + c) * H * W + h * W));
        for (int t = 0; t < TOK; ++t) a[g][t] = at::vec::fmadd(k[t][h], q, a[g][t]);
      }
    }
  }
  for (int g = 0; g < G_T; ++g)
    for (int t = 0; t < TOK; ++t) a[g][t].store(raw + g * raw_stride + out + t * W);
}

// raw[g][j] = sum_c qrep[g][c][j % q_repeat] * kblk[c][j] for the G_T rows of a tile, where
// kblk[c] is the [bs][x] chunk c of a key block (flat index j = t * x + i) and qrep[g][c] holds
// q chunk c repeated to q_repeat = max(x, W) lanes, so the q vector at offset j % q_repeat lines
// up with the K vector at j. q_repeat == 2 W (fp8, or bf16 read in pairs, on AVX2): the two
// halves fold into
// W lanes per unit instead (qk_step, H = 2). Every chunk iteration steps the prefetch cursor
// once: qk_tile_iterations counts them and must follow any change to these loops.
template <int G_T, bool ONE_Q, typename T>
inline void qk_tile(const T* kblk, const float* qrep, float* raw, int64_t num_chunks,
                    int64_t chunk_elems, int64_t raw_stride, int64_t q_repeat, PrefetchCursor& pf) {
  // ONE_Q: q_repeat == W, so every K vector of a chunk pairs with the same q vector.
  if (!ONE_Q && q_repeat == 2 * W) {  // two units per step, each q half loaded once for both
    const int64_t units = chunk_elems / q_repeat;  // of 2 W elements: see qk_step, H = 2
    int64_t t = 0;
    for (; t + 2 <= units; t += 2)
      qk_step<G_T, 2, 2>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, t * q_repeat,
                         t * W);
    for (; t < units; ++t)
      qk_step<G_T, 1, 2>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, t * q_repeat,
                         t * W);
    return;
  }
  int64_t j = 0;
  if constexpr (ONE_Q) {
    // Three K vectors per step: 3 K loads + G_T q loads feed 3 G_T FMAs (the two-vector step
    // below needs 2 G_T q loads for 2 G_T FMAs, and runs out of load slots first).
    for (; j + 3 * W <= chunk_elems; j += 3 * W)
      qk_step<G_T, 3, 1>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, j, j);
  }
  // Two K vectors per step: 2 loads + G_T (or 2 G_T) q loads feed 2 G_T FMAs.
  for (; j + 2 * W <= chunk_elems; j += 2 * W) {
    const int64_t o0 = j % q_repeat, o1 = (j + W) % q_repeat;
    VecF a[G_T], b[G_T];
    for (int g = 0; g < G_T; ++g) a[g] = b[g] = VecF(0.f);
    for (int64_t c = 0; c < num_chunks; ++c) {
      pf.step();
      const VecF k0 = load_f32(kblk + c * chunk_elems + j);
      const VecF k1 = load_f32(kblk + c * chunk_elems + j + W);
      for (int g = 0; g < G_T; ++g) {
        const float* q = qrep + (g * num_chunks + c) * q_repeat;
        const VecF q0 = VecF::loadu(q + (ONE_Q ? 0 : o0));
        a[g] = at::vec::fmadd(k0, q0, a[g]);
        b[g] = at::vec::fmadd(k1, ONE_Q ? q0 : VecF::loadu(q + o1), b[g]);
      }
    }
    for (int g = 0; g < G_T; ++g) {
      a[g].store(raw + g * raw_stride + j);
      b[g].store(raw + g * raw_stride + j + W);
    }
  }
  for (; j < chunk_elems; j += W) {
    const int64_t cnt = std::min<int64_t>(W, chunk_elems - j);
    const int64_t o0 = j % q_repeat;
    VecF a[G_T];
    for (int g = 0; g < G_T; ++g) a[g] = VecF(0.f);
    for (int64_t c = 0; c < num_chunks; ++c) {
      pf.step();
      const VecF k = load_f32(kblk + c * chunk_elems + j, cnt);
      for (int g = 0; g < G_T; ++g) {
        a[g] = at::vec::fmadd(k, VecF::loadu(qrep + (g * num_chunks + c) * q_repeat + o0), a[g]);
      }
    }
    for (int g = 0; g < G_T; ++g) a[g].store(raw + g * raw_stride + j);
  }
}

// Chunk iterations of one qk_tile call (one PrefetchCursor::step() each), mirroring its loops.
inline int64_t qk_tile_iterations(int64_t chunk_elems, int64_t num_chunks, int64_t q_repeat) {
  int64_t steps = 0;
  if (q_repeat == 2 * W) {
    const int64_t units = chunk_elems / q_repeat;
    steps = units / 2 + units % 2;
  } else {
    const int64_t three = q_repeat == W ? chunk_elems / (3 * W) : 0;
    const int64_t two = (chunk_elems - three * 3 * W) / (2 * W);
    steps = three + two + (chunk_elems - three * 3 * W - two * 2 * W + W - 1) / W;
  }
  return steps * num_chunks;
}

// q.k by bf16 pair dot products (Layout::dot_bf16): a unit is 2 W bf16 elements of a chunk
// (2 W / x tokens' chunks), qrep[g][c] the q chunk's x bf16 values repeated to 2 W (in W float
// slots), and raw gets W lanes per unit, x / 2 pair sums per token. TOK units per step share
// each q load.
template <int G_T, int TOK>
inline void qk_dot_step(const c10::BFloat16* kblk, const float* qrep, float* raw,
                        int64_t num_chunks, int64_t chunk_elems, int64_t raw_stride,
                        PrefetchCursor& pf, int64_t unit0) {
  VecF a[G_T][TOK];
  for (int g = 0; g < G_T; ++g)
    for (int t = 0; t < TOK; ++t) a[g][t] = VecF(0.f);
  for (int64_t c = 0; c < num_chunks; ++c) {
    pf.step();
    BF16Pairs k[TOK];
    for (int t = 0; t < TOK; ++t) k[t] = load_pairs(kblk + c * chunk_elems + (unit0 + t) * 2 * W);
    for (int g = 0; g < G_T; ++g) {
      const BF16Pairs q = load_pairs(qrep + (g * num_chunks + c) * W);
      for (int t = 0; t < TOK; ++t) a[g][t] = dot_pairs(a[g][t], k[t], q);
    }
  }
  for (int g = 0; g < G_T; ++g)
    for (int t = 0; t < TOK; ++t) a[g][t].store(raw + g * raw_stride + (unit0 + t) * W);
}

// Steps of 4, 2 and 1 units: 4 G_T + 4 + 1 vectors live at once (21 of AVX-512's 32 registers
// for a tile of 4 rows). Every chunk iteration steps the prefetch cursor once, as in qk_tile;
// qk_dot_iterations counts them.
template <int G_T>
inline void qk_tile_dot(const c10::BFloat16* kblk, const float* qrep, float* raw,
                        int64_t num_chunks, int64_t chunk_elems, int64_t raw_stride,
                        PrefetchCursor& pf) {
  const int64_t units = chunk_elems / (2 * W);
  int64_t u = 0;
  for (; u + 4 <= units; u += 4)
    qk_dot_step<G_T, 4>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, u);
  for (; u + 2 <= units; u += 2)
    qk_dot_step<G_T, 2>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, u);
  for (; u < units; ++u)
    qk_dot_step<G_T, 1>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, u);
}

inline int64_t qk_dot_iterations(int64_t chunk_elems, int64_t num_chunks) {
  const int64_t units = chunk_elems / (2 * W);
  return (units / 4 + units % 4 / 2 + units % 2) * num_chunks;
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

// z[t] = sum_i raw[t * X + i] for t < ntok. With X a constant the compiler vectorizes it with
// permutes (checked in the AVX-512 build's code, where nothing below is written by hand).
template <int X>
inline void sum_lanes(const float* __restrict raw, int64_t ntok, float* __restrict z) {
  for (int64_t t = 0; t < ntok; ++t) {
    float v = 0.f;
    for (int i = 0; i < X; ++i) v += raw[t * X + i];
    z[t] = v;
  }
}

// z[t] = sum_i raw[t * x + i] for t < ntok: the per-token q.k dot products.
inline void sum_lane_groups(const float* raw, int64_t x, int64_t ntok, float* z) {
  int64_t t = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if (x == 16) {  // two vectors per token (fp8)
    for (; t + 8 <= ntok; t += 8) {
      VecF r[8];
      for (int k = 0; k < 8; ++k)
        r[k] = VecF::loadu(raw + (t + k) * 16) + VecF::loadu(raw + (t + k) * 16 + 8);
      reduce_rows(r).store(z + t);
    }
  } else if (x == 8) {  // one token per vector
    for (; t + 8 <= ntok; t += 8) {
      VecF r[8];
      for (int k = 0; k < 8; ++k) r[k] = VecF::loadu(raw + (t + k) * 8);
      reduce_rows(r).store(z + t);
    }
  } else if (x == 4) {  // two tokens per vector
    for (; t + 8 <= ntok; t += 8) {
      const float* b = raw + t * 4;
      const __m256 h0 = _mm256_hadd_ps(VecF::loadu(b), VecF::loadu(b + 8));
      const __m256 h1 = _mm256_hadd_ps(VecF::loadu(b + 16), VecF::loadu(b + 24));
      const __m256 s = _mm256_hadd_ps(h0, h1);  // tokens [0, 2, 4, 6 | 1, 3, 5, 7]
      const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
      _mm256_storeu_ps(z + t, _mm256_permutevar8x32_ps(s, order));
    }
  }
#endif
  // x is Layout::x_sum: x = 16 / sizeof(cache element) or half of it, so 4, 8 or 16.
  switch (x) {
    case 4: return sum_lanes<4>(raw + t * x, ntok - t, z + t);
    case 8: return sum_lanes<8>(raw + t * x, ntok - t, z + t);
    case 16: return sum_lanes<16>(raw + t * x, ntok - t, z + t);
    default: TORCH_INTERNAL_ASSERT(false, "sum_lane_groups: ", x, " lanes per token");
  }
}

// The tile of p.v sums of pv_group, RT rows x DT consecutive d, into the running sums of its
// rows: o[u * RT + r] = o[u * RT + r] * alpha[r] + (sum of the lanes of a[r][u]), or = the
// lane sum on an item's first group (init: o may hold anything). o is tile-major ([D][RT]
// for the tile's rows), so the DT * RT sums of a step are contiguous; finish turns the tiles
// back into rows (rows_from_tiles).
template <int RT, int DT>
inline void tile_sums(const VecF (&a)[RT][DT], float* o, const float* alpha, bool init) {
#if defined(CPU_CAPABILITY_AVX2)
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
    return;
  }
  if constexpr (RT == 1 && DT >= 2) {  // one hadd tree for the DT <= 3 vectors of the row
    static_assert(DT <= 3);
    const __m256 t01 = _mm256_hadd_ps(a[0][0], a[0][1]);
    const __m256 t2 = DT == 3 ? _mm256_hadd_ps(a[0][DT - 1], a[0][DT - 1]) : t01;
    const __m256 h = _mm256_hadd_ps(t01, t2);  // [s0 s1 s2 s2 | s0 s1 s2 s2] (low / high lanes)
    float sum[4];
    _mm_storeu_ps(sum, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
    for (int u = 0; u < DT; ++u) o[u] = init ? sum[u] : o[u] * alpha[0] + sum[u];
    return;
  }
#endif
  for (int u = 0; u < DT; ++u)
    for (int r = 0; r < RT; ++r) {
      const float sum = hsum(a[r][u]);
      o[u * RT + r] = init ? sum : o[u * RT + r] * alpha[r] + sum;
    }
}

// p . v of a group of blocks for a tile of RT query rows: the [D][bs] V blocks (bs == NV * W)
// are read in steps of DT rows d; each lane of an accumulator a[r][u] sums p[r][t] * v[d + u][t]
// over the offsets t = lane (mod W) of every block of the group, in registers (one V row load
// and conversion feeds the RT rows of the tile; the probabilities p[r][k * block_row + t] are
// loaded once per step and row). Where to then:
// - 8 lanes (AVX2, portable): the lanes are summed once per group into the rows' running sums
//   o (tile_sums, which also applies the softmax rescale alpha). The running sums are D floats
//   per row; per-lane accumulators kept across groups were D * W, and their loads and stores
//   from L2 cost p.v 12% (a microbenchmark with 8 kv heads). The AVX2 kernel gained 3-7%
//   (fp32, fp16, bf16; fp8 1-4% slower) at block size 16, 3-11% at 8 and 10-28% at 32.
// - 16 lanes (kLaneAcc): the accumulators are kept across groups in acc (W lanes per d,
//   rescaled by softmax_step) and summed into o only on the item's last group (last; an item
//   of one group never touches acc). tile_sums has a shuffle tree for 8 lanes only; with 16
//   it would sum each accumulator on its own, 8 per 32 FMAs at block size 16, and there is
//   no AVX-512 CPU here to measure either on, so the 16-lane builds keep what they had.
// next[k]: the blocks to prefetch. init: an item's first group (o and acc are written, not
// read). NB > 0: a full group of NB blocks, unrolled (pointers stay in registers); NB = 0: nb.
// NV = 4: any multiple of 4 vectors per V row (nv_in of them, block sizes 4 W and up), in
// steps of 4.
constexpr bool kLaneAcc = W == 16;
#ifndef PAGED_OPS_PV_DT_WIDE
#define PAGED_OPS_PV_DT_WIDE 2
#endif
template <int NV, int RT, int NB, typename VT, typename NT>
inline void pv_group(const VT* const* src_in, int64_t nb_in, int64_t nv_in, const float* p,
                     int64_t p_stride, float* o, const float* alpha, float* acc,
                     int64_t acc_stride, int64_t D, const NT* const* next_in, int64_t vrow_bytes,
                     bool init, bool last) {
  const int64_t nv = NV == 4 ? nv_in : NV;
  const int64_t BPv = nv * W;
  constexpr int NBA = NB > 0 ? NB : static_cast<int>(kGroup);
  const int64_t nb = NB > 0 ? NB : nb_in;
  const VT* src[NBA];
  const NT* next[NBA];
  for (int64_t k = 0; k < nb; ++k) {
    src[k] = src_in[k];
    next[k] = next_in[k];
  }
  // DT V rows per step share each probability load (one load feeds DT FMAs). RT * DT
  // accumulators: each takes NV * nb dependent FMAs per step, so 8 (RT = 4, DT = 2) just
  // cover the FMA latency x throughput and stall on any delay; 12 measured 5-10% faster for
  // 16-bit caches (fp32: same). The V vectors are loaded per half i (3 + 12 + 1 registers).
  constexpr int DT = NV == 2 ? 3 : NV == 1 ? 2 : PAGED_OPS_PV_DT_WIDE;
  auto step = [&](int64_t d, auto dt_c) {
    constexpr int DTc = decltype(dt_c)::value;
    VecF a[RT][DTc];
    for (int r = 0; r < RT; ++r)
      for (int u = 0; u < DTc; ++u)
        a[r][u] = !kLaneAcc || init ? VecF(0.f) : VecF::loadu(acc + r * acc_stride + (d + u) * W);
#pragma GCC unroll 4
    for (int64_t k = 0; k < nb; ++k) {
      // The same rows of the next block: each row (short rows, at most a line), or each
      // line of the rows.
      const char* pf = reinterpret_cast<const char*>(next[k]) + d * vrow_bytes;
      if (vrow_bytes <= 64) {
        for (int u = 0; u < DTc; ++u) prefetch_l2(pf + u * vrow_bytes);
      } else {
        for (int64_t b = 0; b < DTc * vrow_bytes; b += 64) prefetch_l2(pf + b);
      }
      for (int64_t i0 = 0; i0 < nv; i0 += NV) {
        for (int i = static_cast<int>(i0); i < i0 + NV; ++i) {
          VecF v[DTc];
          for (int u = 0; u < DTc; ++u) {
            const VT* row = src[k] + (d + u) * BPv;
            if constexpr (NV == 2 && kSplitPairs<VT>) {
              v[u] = load_bf16_half(row, i);  // p split to match
            } else {
              v[u] = load_f32(row + i * W);
            }
          }
          for (int r = 0; r < RT; ++r) {
            const VecF pv = in_register(VecF::loadu(p + r * p_stride + k * BPv + i * W));
            for (int u = 0; u < DTc; ++u) a[r][u] = at::vec::fmadd(v[u], pv, a[r][u]);
          }
        }
      }
    }
    if (!kLaneAcc || last) {
      tile_sums<RT, DTc>(a, o + d * RT, alpha, kLaneAcc || init);
      return;
    }
    for (int r = 0; r < RT; ++r)
      for (int u = 0; u < DTc; ++u) a[r][u].store(acc + r * acc_stride + (d + u) * W);
  };
  int64_t d = 0;
  for (; d + DT <= D; d += DT) step(d, std::integral_constant<int, DT>{});
  if constexpr (DT == 3) {  // head size 128 leaves 2 rows: one step of 2, not 2 of 1
    if (d + 2 <= D) {
      step(d, std::integral_constant<int, 2>{});
      d += 2;
    }
  }
  for (; d < D; ++d) step(d, std::integral_constant<int, 1>{});
}

// Rows [0, R) of o (row-major, D each) from the running sums ot of pv_group: tiles of 4 rows
// ([D][4]), then single rows.
inline void rows_from_tiles(const float* ot, int64_t R, int64_t D, float* o) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4, ot += 4 * D)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t i = 0; i < 4; ++i) o[(r + i) * D + d] = ot[d * 4 + i];
  std::copy(ot, ot + (R - r) * D, o + r * D);
}

// Online-softmax step of one row over a group's logits pr[0, n): pr becomes e^(z - m_new)
// (0 where z = -inf, and all 0 when the row sees none of the group). Returns the factor
// e^(m - m_new) by which the running max m's growth rescales the normalizer l (done here) and
// the row's sum of p * v (done here when acc is given: acc[0, acc_len); pv_group does it
// otherwise); 1 when m does not grow or nothing was seen before.
inline float softmax_step(float* pr, int64_t n, float& m, float& l, float* acc,
                          int64_t acc_len) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  VecF vmax(neg_inf);
  for (int64_t j = 0; j < n; j += W) vmax = at::vec::maximum(vmax, VecF::loadu(pr + j));
  const float bmax = hmax(vmax);
  if (bmax == neg_inf) {  // the row sees none of the group
    std::fill(pr, pr + n, 0.f);
    return 1.f;
  }
  const float m_new = std::max(m, bmax);
  float a = 1.f;
  if (m_new > m && m != neg_inf) {
    a = std::exp(m - m_new);
    l *= a;
    if (acc != nullptr) {
      const VecF alpha(a);
      for (int64_t j = 0; j < acc_len; j += W) (VecF::loadu(acc + j) * alpha).store(acc + j);
    }
  }
  m = m_new;
  VecF sum(0.f);
  const VecF vm(m_new);
  for (int64_t j = 0; j < n; j += W) {
    const VecF e = (VecF::loadu(pr + j) - vm).exp_u20();
    e.store(pr + j);
    sum = sum + e;
  }
  l += hsum(sum);
  return a;
}

// Any block size: a [D][bs] fp32 V block, one row at a time, vectors over t (zero-filled tail).
inline void pv_row_any(const float* vblk, const float* pg, float* acc, int64_t D, int64_t bs) {
  for (int64_t d = 0; d < D; ++d) {
    const float* row = vblk + d * bs;
    VecF a = VecF::loadu(acc + d * W);
    for (int64_t t = 0; t < bs; t += W) {
      const int64_t cnt = std::min<int64_t>(W, bs - t);
      a = at::vec::fmadd(VecF::loadu(row + t, cnt), VecF::loadu(pg + t), a);
    }
    a.store(acc + d * W);
  }
}

// out[d] = sum of the W lanes of acc[d].
inline void reduce_acc(const float* acc, float* out, int64_t D) {
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    VecF r[W];
    for (int64_t k = 0; k < W; ++k) r[k] = VecF::loadu(acc + (d + k) * W);
    reduce_rows(r).store(out + d);
  }
  for (; d < D; ++d) out[d] = hsum(VecF::loadu(acc + d * W));
}

// Copy a [D][bs] V block in its own type with the columns outside [t0, t1) zeroed (all-zero
// bits are +0 in every cache type), so that p.v reads it like a block of the cache: only the
// partly visible blocks of a group (the last one, the first under a sliding window) are copied.
template <typename T>
inline const T* v_block_masked(const T* vblk, T* dst, int64_t D, int64_t bs, int64_t t0,
                               int64_t t1) {
  for (int64_t d = 0; d < D; ++d, vblk += bs, dst += bs) {
    std::memset(static_cast<void*>(dst), 0, t0 * sizeof(T));
    std::memcpy(static_cast<void*>(dst + t0), vblk + t0, (t1 - t0) * sizeof(T));
    std::memset(static_cast<void*>(dst + t1), 0, (bs - t1) * sizeof(T));
  }
  return dst - D * bs;
}

// out[0, n) = src * s in the output type (vectorised conversion: same rounding as the scalar
// one, to nearest even).
template <typename QT>
inline void store_scaled(const float* src, float s, QT* out, int64_t n) {
  const VecF vs(s);
  int64_t d = 0;
  if constexpr (std::is_same_v<QT, float>) {
    for (; d + W <= n; d += W) (VecF::loadu(src + d) * vs).store(out + d);
  } else {
    for (; d + 2 * W <= n; d += 2 * W)
      at::vec::convert_from_float<QT>(VecF::loadu(src + d) * vs, VecF::loadu(src + d + W) * vs)
          .store(out + d);
  }
  for (; d < n; ++d) out[d] = static_cast<QT>(src[d] * s);
}

// Convert (16-bit / fp8 caches) or copy a [D][bs] V block to fp32, zeroing columns outside
// [t0, t1): their probability is 0 for every row, but 0 * NaN would still be NaN.
template <typename T>
inline void v_block_to_f32(const T* vblk, float* dst, int64_t D, int64_t bs, int64_t t0,
                           int64_t t1) {
  const int64_t n = D * bs;
  int64_t j = 0;
  for (; j + W <= n; j += W) load_f32(vblk + j).store(dst + j);
  for (; j < n; ++j) dst[j] = to_f32(vblk[j]);
  if (t0 > 0 || t1 < bs) {
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t t = 0; t < t0; ++t) dst[d * bs + t] = 0.f;
      for (int64_t t = t1; t < bs; ++t) dst[d * bs + t] = 0.f;
    }
  }
}

// Per-call constants: the scratch geometry and how the cache type CT is read.
template <typename CT>
struct Layout {
  int64_t G, D, bs, x, num_chunks, chunk_elems;
  int64_t raw_row;  // raw row, padded to whole vectors
  int64_t block_row;  // probability row of one block, padded to whole vectors
  int64_t group_row;  // probabilities of a group of blocks
  int64_t group;  // blocks per group (kGroupTokens, at most kGroup)
  // Row stride of the p.v accumulators: D * W lanes plus one cache line, so the rows of a tile
  // (touched together) do not fall in the same L1 sets when D * W * 4 is a multiple of 4 KiB.
  int64_t acc_row;
  // bf16 keys with an even block size are read in pairs (load_bf16_pairs): units of two
  // tokens' chunks, split into even and odd elements, each half paired with the q chunk's
  // even / odd elements.
  bool split_k;
  // q.k by bf16 pair dot products (qk_tile_dot): a bf16 cache read with bf16 queries where the
  // CPU has them (kDotBF16) and the block's chunk is whole units of 2 W elements. qrep then
  // holds the unscaled bf16 q (qk_scale multiplies the logits instead: q stays exact).
  bool dot_bf16;
  int64_t q_repeat;     // q chunk repetition length (x, W: powers of 2)
  int64_t x_sum;  // raw lanes per token
  int64_t NV;            // V row vectors in the fast PV path
  bool fast_pv;
  bool lane_acc;  // the p.v sums live in acc between groups (pv_row_any, or kLaneAcc)
  int64_t qk_iters;      // chunk iterations of one qk_tile call
  bool plain_logits;  // no soft cap, no ALiBi
  // (q . s_k k) scale = s_k scale (q . k); fp8_unit: see fp8_unit().
  float qk_scale, v_scale;

  explicit Layout(const AttentionParams& P)
      : G(P.num_heads / P.num_kv_heads), D(P.head_size), bs(P.block_size), x(P.x) {
    num_chunks = D / x;
    chunk_elems = bs * x;
    raw_row = round_up(chunk_elems, W);
    block_row = round_up(bs, W);
    group_row = kGroup * block_row;
    group = std::clamp<int64_t>(kGroupTokens / bs, 1, kGroup);
    acc_row = D * W + 16;
    dot_bf16 = kDotBF16 && std::is_same_v<CT, c10::BFloat16> && P.dtype == DType::BF16 &&
               chunk_elems % (2 * W) == 0;
    split_k = kSplitPairs<CT> && x == W && bs % 2 == 0;
    q_repeat = dot_bf16 ? W : split_k ? 2 * W : std::max<int64_t>(x, W);
    x_sum = dot_bf16 || q_repeat == 2 * W ? x / 2 : x;
    NV = bs / W;
    fast_pv = bs % W == 0 && (NV == 1 || NV == 2 || NV % 4 == 0);
    lane_acc = !fast_pv || kLaneAcc;
    plain_logits = P.logits_soft_cap <= 0.f && P.alibi_slopes == nullptr;
    qk_iters = dot_bf16 ? qk_dot_iterations(chunk_elems, num_chunks)
                        : qk_tile_iterations(chunk_elems, num_chunks, q_repeat);
    qk_scale = P.scale * P.k_scale * fp8_unit<CT>();
    v_scale = P.v_scale * fp8_unit<CT>();
  }
};

// The blocks a group step reads (K and V of one kv head, up to kGroup blocks) and the ones to
// prefetch meanwhile (next).
template <typename CT>
struct GroupBlocks {
  const CT* k[kGroup];
  const CT* v[kGroup];
  const CT* k_next[kGroup];
  const CT* v_next[kGroup];
  int64_t t0[kGroup], t1[kGroup];  // offsets of block k visible to some row of the item
};

// The work of one thread on its items: the per-item state lives in the thread's Scratch.
// Rows of each kv head are token-major, head-minor (R per kv head; the state of kv head
// it.kvh + hl is rows [hl * R, (hl + 1) * R) of qrep, acc, m and l).
template <typename QT, typename CT>
struct ItemWorker {
  const AttentionParams& P;
  const Layout<CT>& layout;
  const Plan& plan;
  Scratch& scratch;
  const CT* const kc;
  const CT* const vc;
  ItemInfo it{};
  int64_t R = 0;  // query rows of one kv head of the item

  ItemWorker(const AttentionParams& P_, const Layout<CT>& layout_, const Plan& plan_,
             Scratch& scratch_)
      : P(P_), layout(layout_), plan(plan_), scratch(scratch_),
        kc(static_cast<const CT*>(P_.key_cache)),
        vc(static_cast<const CT*>(P_.value_cache)) {
    const int64_t R_max = plan.tokens_per_chunk * layout.G;     // rows of one kv head
    const int64_t HR_max = R_max * plan.heads_per_item;    // rows of an item
    grow(scratch.qrep, HR_max * layout.num_chunks * layout.q_repeat);
    grow(scratch.raw, R_max * layout.raw_row);
    grow(scratch.p, R_max * layout.group_row);
    if (layout.lane_acc) grow(scratch.acc, HR_max * layout.acc_row);
    grow(scratch.ot, HR_max * layout.D);
    grow(scratch.alpha, HR_max);
    grow(scratch.o, HR_max * layout.D);
    grow(scratch.qf, layout.D);
    grow(scratch.vtmp, kGroup * layout.D * layout.bs);
    grow(scratch.vraw, kGroup * layout.D * layout.bs * static_cast<int64_t>(sizeof(CT)));
    grow(scratch.m, HR_max);
    grow(scratch.l, HR_max);
    scratch.row_P.resize(R_max);
    scratch.row_lo.resize(R_max);
  }

  // K and V of blocks [b, b + n) of sequence s, kv head kvh, through the block table.
  void blocks(int64_t s, int64_t kvh, int64_t b, int64_t n, const CT** k_out,
              const CT** v_out) const {
    const int32_t* table = P.block_tables + s * P.bt_stride_seq;
    const int64_t head = kvh * (layout.D * layout.bs);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t col = PAGED_OPS_PHASE_ARITH ? (b + k) % 2 : b + k;
      const int64_t blk = table[col * P.bt_stride_col];
      k_out[k] = kc + blk * P.k_stride_block + head;
      v_out[k] = vc + blk * P.v_stride_block + head;
    }
  }

  // One query row's q.k operand: chunk c of qf (x elements) repeated to q_repeat lanes, element
  // lane mod x in each lane; split_k: lanes [0, W) hold the even elements, [W, 2W) the odd
  // ones, each twice (the two tokens of a unit). With vector moves: it runs for every row of
  // every item, which short items feel.
  void fill_qrep(const float* qf, float* rp) const {
    const int64_t x = layout.x, q_repeat = layout.q_repeat;
    if (q_repeat == x) {  // chunk by chunk, the row itself
      std::memcpy(rp, qf, layout.D * sizeof(float));
      return;
    }
    for (int64_t c = 0; c < layout.num_chunks; ++c, rp += q_repeat) {
      const float* chunk = qf + c * x;
#if defined(CPU_CAPABILITY_AVX2)  // the only capability where split_k is set
      if (layout.split_k) {  // x == W: [even, even, odd, odd] elements of the chunk
        const __m256 v = _mm256_loadu_ps(chunk);
        const __m256 e = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
        const __m256 o = _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7));
        _mm256_storeu_ps(rp, e);
        _mm256_storeu_ps(rp + W, o);
        continue;
      }
      if (x == 4 && q_repeat == 8) {  // fp32: the 4 elements in both halves
        _mm256_storeu_ps(rp, _mm256_broadcast_ps(reinterpret_cast<const __m128*>(chunk)));
        continue;
      }
#endif
      for (int64_t r = 0; r < q_repeat; r += x)  // x < q_repeat: the chunk repeated
        for (int64_t i = 0; i < x; ++i) rp[r + i] = chunk[i];
    }
  }

  // Starts item `info`: visible ranges of its rows, query rows (pre-scaled, chunks repeated
  // across lanes for q.k), running max and normalizer.
  void start(const ItemInfo& info) {
    it = info;
    const int64_t G = layout.G, D = layout.D, q_repeat = layout.q_repeat;
    const int64_t num_chunks = layout.num_chunks;
    R = (it.j1 - it.j0) * G;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t Ppos = it.L - it.q_len + it.j0 + r / G;
      scratch.row_P[r] = Ppos;
      scratch.row_lo[r] = first_visible(P, Ppos);
    }
    const bool multi = P.query_start_loc != nullptr;
    const QT* q_base = static_cast<const QT*>(P.query);
    for (int64_t hr = 0; hr < it.nh * R; ++hr) {
      const int64_t r = hr % R, j = it.j0 + r / G, h = (it.kvh + hr / R) * G + r % G;
      const QT* q = q_base + (it.row0 + (multi ? j : 0)) * P.q_stride_seq + h * P.q_stride_head;
      scratch.m[hr] = -std::numeric_limits<float>::infinity();
      scratch.l[hr] = 0.f;
      if constexpr (std::is_same_v<QT, c10::BFloat16>) {
        if (layout.dot_bf16) {  // each chunk's x bf16 values as they are, repeated to 2 W
          QT* rp = reinterpret_cast<QT*>(scratch.qrep.data() + hr * num_chunks * q_repeat);
          for (int64_t c = 0; c < num_chunks; ++c)
            for (int64_t i = 0; i < 2 * W; i += layout.x, rp += layout.x)
              std::memcpy(rp, q + c * layout.x, layout.x * sizeof(QT));
          continue;
        }
      }
      float* qf = scratch.qf.data();
      for (int64_t d = 0; d < D; d += W) {
        const int64_t n = std::min<int64_t>(W, D - d);
        (load_f32(q + d, n) * VecF(layout.qk_scale)).store(qf + d, n);
      }
      fill_qrep(qf, scratch.qrep.data() + hr * num_chunks * q_repeat);
    }
    // pv_group starts its sums itself on the first group (init); pv_row_any adds, and an
    // item without blocks (empty split, seq_len 0) still turns its sums into rows.
    if (!layout.fast_pv)
      std::fill(scratch.acc.begin(), scratch.acc.begin() + it.nh * R * layout.acc_row, 0.f);
    else if (!PAGED_OPS_PHASE_PV || it.b_first > it.b_last)  // (sums start at 0 without p.v)
      std::fill(scratch.ot.begin(), scratch.ot.begin() + it.nh * R * D, 0.f);
  }

  // Visible offsets of the group's blocks [b0, b0 + nb) for the item's rows together.
  void visibility(int64_t b0, int64_t nb, GroupBlocks<CT>& g) const {
    for (int64_t k = 0; k < nb; ++k) {
      const int64_t b = b0 + k;
      g.t0[k] = std::clamp<int64_t>(it.lo_min - b * layout.bs, 0, layout.bs);
      g.t1[k] = std::clamp<int64_t>(it.P_max + 1 - b * layout.bs, 0, layout.bs);
    }
  }

  // The blocks of kv head hl of the group and what to prefetch while they are read: the same
  // blocks' next kv head (the bytes that follow), after the last one the next group's first,
  // after the last group the first group of the thread's next item (next_item < end).
  void group_blocks(int64_t hl, int64_t b0, int64_t nb, int64_t next_item, int64_t end,
                    GroupBlocks<CT>& g) const {
    const int64_t kvh = it.kvh + hl;
    blocks(it.s, kvh, b0, nb, g.k, g.v);
    int64_t nb_next = 0;
    if (hl + 1 < it.nh) {
      nb_next = nb;
      blocks(it.s, kvh + 1, b0, nb, g.k_next, g.v_next);
    } else if (b0 + nb <= it.b_last) {
      nb_next = std::min<int64_t>(layout.group, it.b_last - b0 - nb + 1);
      blocks(it.s, it.kvh, b0 + nb, nb_next, g.k_next, g.v_next);
    } else if (next_item < end) {
      const ItemInfo nx = item_info(P, plan, next_item);
      nb_next = std::clamp<int64_t>(nx.b_last - nx.b_first + 1, 0, layout.group);
      blocks(nx.s, nx.kvh, nx.b_first, nb_next, g.k_next, g.v_next);
    }
    for (int64_t k = nb_next; k < kGroup; ++k) {  // nothing left: this group again, harmless
      g.k_next[k] = g.k[std::min<int64_t>(k, nb - 1)];
      g.v_next[k] = g.v[std::min<int64_t>(k, nb - 1)];
    }
  }

  // Logits of every row of kv head hl for each block of the group: p[r][k * block_row + t]; hidden
  // offsets and the padding up to block_row are -inf by position, never computed from cache data.
  void logits(int64_t hl, int64_t b0, int64_t nb, const GroupBlocks<CT>& g) {
    const int64_t num_chunks = layout.num_chunks, q_repeat = layout.q_repeat;
    const int64_t raw_row = layout.raw_row, block_row = layout.block_row, bs = layout.bs;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const float* const qrep_h = scratch.qrep.data() + hl * R * num_chunks * q_repeat;
    const int64_t h0 = (it.kvh + hl) * layout.G;
    for (int64_t k = 0; k < nb; ++k) {
      const int64_t b = b0 + k;
      int64_t r = 0;
      // The next block's key lines, spread over every tile of rows (R / 4 + R % 4 tiles).
      PrefetchCursor pf(g.k_next[k], layout.D * bs * static_cast<int64_t>(sizeof(CT)),
                        (R / 4 + R % 4) * layout.qk_iters);
      auto qk = [&](auto tile, auto one_q) {
        constexpr int G_T = decltype(tile)::value;
        for (; r + G_T <= R; r += G_T) {
          const float* qr = qrep_h + r * num_chunks * q_repeat;
          float* raw = scratch.raw.data() + r * raw_row;
          if constexpr (std::is_same_v<CT, c10::BFloat16>) {
            if (layout.dot_bf16) {
              qk_tile_dot<G_T>(g.k[k], qr, raw, num_chunks, layout.chunk_elems, raw_row, pf);
              continue;
            }
          }
          qk_tile<G_T, decltype(one_q)::value>(g.k[k], qr, raw, num_chunks, layout.chunk_elems,
                                               raw_row, q_repeat, pf);
        }
      };
      if (!PAGED_OPS_PHASE_QK) {
      } else if (q_repeat == W) {
        qk(std::integral_constant<int, 4>{}, std::true_type{});
        qk(std::integral_constant<int, 1>{}, std::true_type{});
      } else {
        qk(std::integral_constant<int, 4>{}, std::false_type{});
        qk(std::integral_constant<int, 1>{}, std::false_type{});
      }
      for (r = 0; r < R; ++r) {
        float* pr = scratch.p.data() + r * layout.group_row + k * block_row;
        const int64_t t0 = std::clamp<int64_t>(scratch.row_lo[r] - b * bs, 0, bs);
        const int64_t t1 = std::clamp<int64_t>(scratch.row_P[r] + 1 - b * bs, 0, bs);
        if (t0 >= t1) {  // nothing of this block is visible to this row
          std::fill(pr, pr + block_row, neg_inf);
          continue;
        }
        sum_lane_groups(scratch.raw.data() + r * raw_row, layout.x_sum, bs, pr);
        if (layout.dot_bf16)
          for (int64_t t = 0; t < bs; ++t) pr[t] *= layout.qk_scale;
        for (int64_t t = bs; t < block_row; ++t) pr[t] = neg_inf;
        if (!layout.plain_logits || t0 > 0 || t1 < bs) {
          const float slope =
              P.alibi_slopes ? P.alibi_slopes[(h0 + r % layout.G) * P.alibi_stride] : 0.f;
          for (int64_t t = 0; t < bs; ++t) {
            if (t < t0 || t >= t1) {
              pr[t] = neg_inf;
              continue;
            }
            float v = pr[t];
            if (P.logits_soft_cap > 0.f) v = P.logits_soft_cap * std::tanh(v / P.logits_soft_cap);
            if (P.alibi_slopes) v += slope * static_cast<float>(b * bs + t - scratch.row_P[r]);
            pr[t] = v;
          }
        }
      }
    }
  }

  // Softmax step of each row of kv head hl over the group: p = e^(z - m_new) (0 where
  // hidden). Nothing is read from memory here, so the first rows of the next V blocks are
  // prefetched meanwhile, 8 per row (measured 2-7% faster than leaving memory idle).
  void softmax(int64_t hl, int64_t nb, const GroupBlocks<CT>& g) {
    // Rows of up to a line each, else lines.
    const int64_t vrow_bytes = layout.bs * static_cast<int64_t>(sizeof(CT));
    const int64_t vpf_stride = std::min<int64_t>(vrow_bytes, 64);
    const int64_t vpf_end = std::min<int64_t>(R * 8, kGroup * layout.D * vrow_bytes / vpf_stride);
    const int64_t n = nb * layout.block_row;
    // Accumulators in acc are rescaled here; pv_group's running sums o by pv_group (alpha).
    float* const acc_h = layout.lane_acc ? scratch.acc.data() + hl * R * layout.acc_row : nullptr;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t i = r * 8; i < std::min(r * 8 + 8, vpf_end); ++i)
        prefetch_l2(reinterpret_cast<const char*>(g.v_next[i % kGroup]) + i / kGroup * vpf_stride);
      if (!PAGED_OPS_PHASE_SM) continue;
      scratch.alpha[hl * R + r] =
          softmax_step(scratch.p.data() + r * layout.group_row, n, scratch.m[hl * R + r],
                       scratch.l[hl * R + r], acc_h ? acc_h + r * layout.acc_row : nullptr,
                       layout.D * W);
    }
  }

  // p . v for all rows of kv head hl. V columns no row sees may hold NaN (0 * NaN = NaN), so
  // a partly visible block is read through a copy with those columns zeroed. Blocks are read
  // in place (the partly visible ones from a copy in their own type) when one tile of rows
  // covers them or the cache is fp32; else the group is converted to fp32 once, for all
  // tiles. (Converting a whole group for its one partial block made calls of odd lengths
  // 13-25% slower.)
  void pv(int64_t hl, int64_t nb, bool first, bool last, const GroupBlocks<CT>& g) {
    const int64_t D = layout.D, bs = layout.bs;
    const int64_t group_row = layout.group_row, acc_row = layout.acc_row;
    float* const acc_h = layout.lane_acc ? scratch.acc.data() + hl * R * acc_row : nullptr;
    const int64_t vrow_bytes = bs * static_cast<int64_t>(sizeof(CT));
    auto vcopy = [&]() {
      for (int64_t k = 0; k < nb; ++k)
        v_block_to_f32(g.v[k], scratch.vtmp.data() + k * D * bs, D, bs, g.t0[k], g.t1[k]);
    };
    if (!layout.fast_pv) {
      vcopy();
      for (int64_t k = 0; k < nb; ++k)
        for (int64_t r = 0; r < R; ++r)
          pv_row_any(scratch.vtmp.data() + k * D * bs,
                     scratch.p.data() + r * group_row + k * layout.block_row, acc_h + r * acc_row,
                     D, bs);
      return;
    }
    auto run = [&](auto nv, auto src) {
      constexpr int NVc = decltype(nv)::value;
      const float* pp = scratch.p.data();
      float* const ot = scratch.ot.data() + hl * R * D;  // tiles of 4 rows, then single rows
      const float* const al = scratch.alpha.data() + hl * R;
      int64_t r2 = 0;
      auto acc = [&](int64_t r) { return acc_h ? acc_h + r * acc_row : nullptr; };
      if (nb == kGroup) {
        for (; r2 + 4 <= R; r2 += 4)
          pv_group<NVc, 4, kGroup>(src, nb, layout.NV, pp + r2 * group_row, group_row,
                                   ot + r2 * D, al + r2, acc(r2), acc_row, D, g.v_next,
                                   vrow_bytes, first, last);
      }
      for (; r2 + 4 <= R; r2 += 4)
        pv_group<NVc, 4, 0>(src, nb, layout.NV, pp + r2 * group_row, group_row, ot + r2 * D,
                            al + r2, acc(r2), acc_row, D, g.v_next, vrow_bytes, first, last);
      for (; r2 < R; ++r2)
        pv_group<NVc, 1, 0>(src, nb, layout.NV, pp + r2 * group_row, group_row, ot + r2 * D,
                            al + r2, acc(r2), acc_row, D, g.v_next, vrow_bytes, first, last);
    };
    auto dispatch = [&](auto src) {
      if (layout.NV == 1) run(std::integral_constant<int, 1>{}, src);
      else if (layout.NV == 2) run(std::integral_constant<int, 2>{}, src);
      else run(std::integral_constant<int, 4>{}, src);
    };
    if (std::is_same_v<CT, float> || R <= 4) {
      if (kSplitPairs<CT> && layout.NV == 2) {  // pv_group reads bf16 rows split (even, odd)
        for (int64_t r = 0; r < R; ++r)
          for (int64_t k = 0; k < nb; ++k)
            split_pairs(scratch.p.data() + r * group_row + k * layout.block_row);
      }
      const CT* src[kGroup];
      CT* const masked = reinterpret_cast<CT*>(scratch.vraw.data());
      for (int64_t k = 0; k < nb; ++k) {
        src[k] = g.t0[k] == 0 && g.t1[k] == bs
                     ? g.v[k]
                     : v_block_masked(g.v[k], masked + k * D * bs, D, bs, g.t0[k], g.t1[k]);
      }
      dispatch(static_cast<const CT* const*>(src));
    } else {
      vcopy();
      const float* vf[kGroup];
      for (int64_t k = 0; k < nb; ++k) vf[k] = scratch.vtmp.data() + k * D * bs;
      dispatch(static_cast<const float* const*>(vf));
    }
  }

  // Ends the item: the sums of p * v in rows (from pv_group's tiles, or pv_row_any's
  // accumulators with their lanes summed), then each row normalised into the output, or
  // (split) its unnormalised state stored for merge_splits.
  void finish(float* part_ml, float* part_o) {
    const int64_t G = layout.G, D = layout.D;
    const bool multi = P.query_start_loc != nullptr;
    QT* o_base = static_cast<QT*>(P.out);
    for (int64_t hl = 0; hl < it.nh; ++hl) {
      const int64_t kvh = it.kvh + hl;
      float* const o_h = scratch.o.data() + hl * R * D;
      if (layout.fast_pv) {
        rows_from_tiles(scratch.ot.data() + hl * R * D, R, D, o_h);
      } else {
        for (int64_t r = 0; r < R; ++r)
          reduce_acc(scratch.acc.data() + (hl * R + r) * layout.acc_row, o_h + r * D, D);
      }
      const float* m_h = scratch.m.data() + hl * R;
      const float* l_h = scratch.l.data() + hl * R;
      if (plan.splits > 1) {
        const int64_t part = (it.s * P.num_kv_heads + kvh) * plan.splits + it.split;
        for (int64_t g = 0; g < G; ++g) {
          part_ml[(part * G + g) * 2] = m_h[g];
          part_ml[(part * G + g) * 2 + 1] = l_h[g];
          std::copy(o_h + g * D, o_h + g * D + D, part_o + (part * G + g) * D);
        }
        continue;
      }
      for (int64_t r = 0; r < R; ++r) {
        const int64_t j = it.j0 + r / G, g = r % G;
        QT* o = o_base + (it.row0 + (multi ? j : 0)) * P.out_stride_seq +
                (kvh * G + g) * P.out_stride_head;
        // A row that sees nothing (seq_len 0) has l = 0: its output is 0.
        store_scaled(o_h + r * D, l_h[r] > 0.f ? layout.v_scale / l_h[r] : 0.f, o, D);
      }
    }
  }
};

// Exact merge of the splits of each (sequence, kv head, row): m = max m_i,
// l = sum l_i e^(m_i - m), o = sum o_i e^(m_i - m) / l. Empty splits (l_i = 0, m_i = -inf)
// contribute nothing.
template <typename QT>
void merge_splits(const AttentionParams& P, const Plan& plan, float v_scale,
                  const std::vector<float>& part_ml, const std::vector<float>& part_o) {
  const int64_t G = P.num_heads / P.num_kv_heads;
  const int64_t D = P.head_size;
  QT* o_base = static_cast<QT*>(P.out);
  at::parallel_for(0, P.num_seqs * P.num_kv_heads * G, 64, [&](int64_t begin, int64_t end) {
    std::vector<float>& acc = thread_scratch().qf;  // free: the items are done
    grow(acc, D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t g = w % G;
      const int64_t pair = w / G;  // s * num_kv_heads + kvh
      const int64_t s = pair / P.num_kv_heads, kvh = pair % P.num_kv_heads;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t sp = 0; sp < plan.splits; ++sp) {
        const int64_t it = pair * plan.splits + sp;
        if (part_ml[(it * G + g) * 2 + 1] > 0.f) m = std::max(m, part_ml[(it * G + g) * 2]);
      }
      float l = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t sp = 0; sp < plan.splits; ++sp) {
        const int64_t it = pair * plan.splits + sp;
        const float li = part_ml[(it * G + g) * 2 + 1];
        if (li <= 0.f) continue;
        const float w_i = std::exp(part_ml[(it * G + g) * 2] - m);
        l += li * w_i;
        const float* oi = part_o.data() + (it * G + g) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += oi[d] * w_i;
      }
      QT* o = o_base + s * P.out_stride_seq + (kvh * G + g) * P.out_stride_head;
      store_scaled(acc.data(), l > 0.f ? v_scale / l : 0.f, o, D);
    }
  });
}

template <typename QT, typename CT>
void attention_impl(const AttentionParams& P) {
  const Layout<CT> layout(P);
  const Plan plan = make_plan(P);
  // Split-K partial states, per (sequence, kv head, split): [G] of (m, l), [G][D] of
  // unnormalised output. finish writes every one (an empty split: m = -inf, l = 0, o = 0).
  std::vector<float>& part_ml = call_scratch().part_ml;
  std::vector<float>& part_o = call_scratch().part_o;
  if (plan.splits > 1) {
    const int64_t parts = P.num_seqs * P.num_kv_heads * plan.splits;
    grow(part_ml, parts * layout.G * 2);
    grow(part_o, parts * layout.G * layout.D);
  }
  at::parallel_for(0, plan.num_items, plan.grain, [&](int64_t begin, int64_t end) {
    ItemWorker<QT, CT> w(P, layout, plan, thread_scratch());
    GroupBlocks<CT> g;
    for (int64_t item = begin; item < end; ++item) {
      w.start(item_info(P, plan, item));
      // Blocks go in groups of up to kGroup: one softmax step per row and one pass of the
      // p.v accumulators per group, kv head after kv head.
      for (int64_t b0 = w.it.b_first; b0 <= w.it.b_last; b0 += layout.group) {
        const int64_t nb = std::min<int64_t>(layout.group, w.it.b_last - b0 + 1);
        w.visibility(b0, nb, g);
        for (int64_t hl = 0; hl < w.it.nh; ++hl) {
          w.group_blocks(hl, b0, nb, item + 1, end, g);
          w.logits(hl, b0, nb, g);
          w.softmax(hl, nb, g);
          if (PAGED_OPS_PHASE_PV) w.pv(hl, nb, b0 == w.it.b_first, b0 + nb > w.it.b_last, g);
        }
      }
      w.finish(part_ml.data(), part_o.data());
    }
  });
  if (plan.splits > 1) merge_splits<QT>(P, plan, layout.v_scale, part_ml, part_o);
}

template <typename QT>
inline void attention_q(const AttentionParams& P) {
  switch (P.cache_dtype) {
    case DType::F32: return attention_impl<QT, float>(P);
    case DType::F16: return attention_impl<QT, c10::Half>(P);
    case DType::BF16: return attention_impl<QT, c10::BFloat16>(P);
    case DType::F8E4M3: return attention_impl<QT, c10::Float8_e4m3fn>(P);
    case DType::F8E5M2: return attention_impl<QT, c10::Float8_e5m2>(P);
  }
}

inline void attention(const AttentionParams& P) {
  switch (P.dtype) {
    case DType::F32: return attention_q<float>(P);
    case DType::F16: return attention_q<c10::Half>(P);
    case DType::BF16: return attention_q<c10::BFloat16>(P);
    default: return;  // unreachable: queries are checked to be fp32 / fp16 / bf16
  }
}

inline const KernelTable* kernel_table() {
  static const KernelTable t{kKernelAbiVersion, CPU_CAPABILITY_NAME, &attention};
  return &t;
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
