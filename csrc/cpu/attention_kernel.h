// CPU paged decode attention, written once with at::vec and compiled per CPU capability
// (the including file defines CPU_CAPABILITY; see kernels.h and setup.py).
//
// Work item = (sequence, kv head): the whole GQA group of query heads is handled together, so
// every K/V block is read from memory exactly once. Blocks are read straight from the cache
// through the block table (no gathered copy) with a blockwise online softmax (seed 004):
//   m_new = max(m, max_t z_t);  l = l * e^(m - m_new) + sum_t e^(z_t - m_new);
//   acc = acc * e^(m - m_new) + sum_t e^(z_t - m_new) v_t.
// Positions that are not visible (past seq_len in the last block, before the sliding window)
// are excluded by position, never by value, so NaN/Inf in unwritten slots cannot leak.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/kernels.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

using VecF = at::vec::Vectorized<float>;
constexpr int64_t W = VecF::size();  // fp32 lanes: 8 (DEFAULT, AVX2) or 16 (AVX-512)

// Load `count` (<= W) elements of T as fp32 lanes; missing lanes are zero.
template <typename T>
inline VecF load_f32(const T* p, int64_t count = W) {
  if constexpr (std::is_same_v<T, float>) {
    return count == W ? VecF::loadu(p) : VecF::loadu(p, count);
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

// Per-thread scratch, grown on demand and reused across calls (no allocation per block or call
// once warm).
struct Scratch {
  std::vector<float> qrep;   // [G][D/x][W]: q chunk c (pre-scaled) repeated across the W lanes
  std::vector<float> raw;    // [G][KP] per-lane partial q.k sums of one block (t * x + i)
  std::vector<float> p;      // [G][BP] logits, then probabilities of one block (0 when hidden)
  std::vector<float> o;      // [G][DP] running sum of p * v
  std::vector<float> vtmp;   // [D * bs] fp32 copy of a partially visible V block, hidden cols 0
  std::vector<float> m, l;   // [G] running max / normalizer
};

inline Scratch& thread_scratch() {
  static thread_local Scratch s;
  return s;
}

inline void grow(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// raw[g][j] = sum_c qrep[g][c][j % W] * kblk[c][j] for the G_T heads of a tile, where
// kblk[c] is the [bs][x] chunk c of a key block (flat index j = t * x + i). Since W % x == 0,
// one repeated q vector per chunk lines up with every K vector of that chunk.
template <int G_T, typename T>
inline void qk_tile(const T* kblk, const float* qrep, float* raw, int64_t num_chunks,
                    int64_t chunk_elems, int64_t raw_stride) {
  int64_t j = 0;
  // Two K vectors per step: 2 loads + G_T q loads feed 2 * G_T FMAs.
  for (; j + 2 * W <= chunk_elems; j += 2 * W) {
    VecF a[G_T], b[G_T];
    for (int g = 0; g < G_T; ++g) a[g] = b[g] = VecF(0.f);
    for (int64_t c = 0; c < num_chunks; ++c) {
      const VecF k0 = load_f32(kblk + c * chunk_elems + j);
      const VecF k1 = load_f32(kblk + c * chunk_elems + j + W);
      for (int g = 0; g < G_T; ++g) {
        const VecF q = VecF::loadu(qrep + (g * num_chunks + c) * W);
        a[g] = at::vec::fmadd(k0, q, a[g]);
        b[g] = at::vec::fmadd(k1, q, b[g]);
      }
    }
    for (int g = 0; g < G_T; ++g) {
      a[g].store(raw + g * raw_stride + j);
      b[g].store(raw + g * raw_stride + j + W);
    }
  }
  for (; j < chunk_elems; j += W) {
    const int64_t cnt = std::min<int64_t>(W, chunk_elems - j);
    VecF a[G_T];
    for (int g = 0; g < G_T; ++g) a[g] = VecF(0.f);
    for (int64_t c = 0; c < num_chunks; ++c) {
      const VecF k = load_f32(kblk + c * chunk_elems + j, cnt);
      for (int g = 0; g < G_T; ++g) {
        a[g] = at::vec::fmadd(k, VecF::loadu(qrep + (g * num_chunks + c) * W), a[g]);
      }
    }
    for (int g = 0; g < G_T; ++g) a[g].store(raw + g * raw_stride + j);
  }
}

inline float hsum(const VecF& v) {
  float tmp[W];
  v.store(tmp);
  float s = 0.f;
  for (int64_t k = 0; k < W; ++k) s += tmp[k];
  return s;
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

// z[t] = sum_i raw[t * x + i] for t < ntok: the per-token q.k dot products.
inline void sum_lane_groups(const float* raw, int64_t x, int64_t ntok, float* z) {
  int64_t t = 0;
#if defined(CPU_CAPABILITY_AVX2)
  if (x == 8) {  // one token per vector
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
  for (; t < ntok; ++t) {
    float v = 0.f;
    for (int64_t i = 0; i < x; ++i) v += raw[t * x + i];
    z[t] = v;
  }
}

// o[g][d] += sum_t p[g][t] * v[d][t] for one head over a [D][bs] fp32 V block, when
// bs == NV * W: the NV probability vectors stay in registers and W rows are reduced at once
// (reduce_rows), so no transposed copy of V is needed.
template <int NV>
inline void pv_head_fast(const float* vblk, const float* pg, float* og, int64_t D) {
  VecF p[NV];
  for (int v = 0; v < NV; ++v) p[v] = VecF::loadu(pg + v * W);
  int64_t d0 = 0;
  for (; d0 + W <= D; d0 += W) {
    VecF r[W];
    for (int64_t k = 0; k < W; ++k) {
      const float* row = vblk + (d0 + k) * (NV * W);
      VecF a = VecF::loadu(row) * p[0];
      for (int v = 1; v < NV; ++v) a = at::vec::fmadd(VecF::loadu(row + v * W), p[v], a);
      r[k] = a;
    }
    (VecF::loadu(og + d0) + reduce_rows(r)).store(og + d0);
  }
  for (; d0 < D; ++d0) {  // D not a multiple of W: the leftover rows one by one
    const float* row = vblk + d0 * (NV * W);
    VecF a = VecF::loadu(row) * p[0];
    for (int v = 1; v < NV; ++v) a = at::vec::fmadd(VecF::loadu(row + v * W), p[v], a);
    og[d0] += hsum(a);
  }
}

// Any block size: rows of bs elements, vectors over t with a zero-filled tail.
inline void pv_head_any(const float* vblk, const float* pg, float* og, int64_t D, int64_t bs) {
  for (int64_t d = 0; d < D; ++d) {
    const float* row = vblk + d * bs;
    VecF a(0.f);
    for (int64_t t = 0; t < bs; t += W) {
      const int64_t cnt = std::min<int64_t>(W, bs - t);
      a = at::vec::fmadd(VecF::loadu(row + t, cnt), VecF::loadu(pg + t), a);
    }
    og[d] += hsum(a);
  }
}

// Convert (16-bit caches) or copy a [D][bs] V block to fp32, zeroing hidden columns [0, t0)
// and [t1, bs): their probability is 0, but 0 * NaN would still be NaN.
template <typename T>
inline void v_block_to_f32(const T* vblk, float* dst, int64_t D, int64_t bs, int64_t t0,
                           int64_t t1) {
  const int64_t n = D * bs;
  int64_t j = 0;
  for (; j + W <= n; j += W) load_f32(vblk + j).store(dst + j);
  for (; j < n; ++j) dst[j] = static_cast<float>(vblk[j]);
  if (t0 > 0 || t1 < bs) {
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t t = 0; t < t0; ++t) dst[d * bs + t] = 0.f;
      for (int64_t t = t1; t < bs; ++t) dst[d * bs + t] = 0.f;
    }
  }
}

template <typename T>
void attention_impl(const AttentionParams& P) {
  const int64_t G = P.num_heads / P.num_kv_heads;
  const int64_t D = P.head_size;
  const int64_t bs = P.block_size;
  const int64_t x = P.x;
  const int64_t num_chunks = D / x;
  const int64_t chunk_elems = bs * x;
  const int64_t KP = round_up(chunk_elems, W);  // raw row, padded to whole vectors
  const int64_t BP = round_up(bs, W);           // probability row, padded to whole vectors
  const int64_t DP = round_up(D, W);
  const int64_t NV = bs / W;                    // V row vectors in the fast PV path
  const bool fast_pv = bs % W == 0 && (NV == 1 || NV == 2 || NV == 4);
  const bool plain_logits = P.logits_soft_cap <= 0.f && P.alibi_slopes == nullptr;
  const T* q_base = static_cast<const T*>(P.query);
  T* o_base = static_cast<T*>(P.out);
  const T* kc = static_cast<const T*>(P.key_cache);
  const T* vc = static_cast<const T*>(P.value_cache);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, P.num_seqs * P.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch& S = thread_scratch();
    grow(S.qrep, G * num_chunks * W);
    grow(S.raw, G * KP);
    grow(S.p, G * BP);
    grow(S.o, G * DP);
    grow(S.vtmp, D * bs);
    grow(S.m, G);
    grow(S.l, G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / P.num_kv_heads;
      const int64_t kvh = item % P.num_kv_heads;
      const int64_t h0 = kvh * G;
      const int64_t L = P.seq_lens[s * P.sl_stride];
      if (L <= 0) {
        for (int64_t g = 0; g < G; ++g) {
          T* o = o_base + s * P.out_stride_seq + (h0 + g) * P.out_stride_head;
          std::fill(o, o + D, T(0.f));
        }
        continue;
      }
      const int64_t start = P.sliding_window > 0 ? std::max<int64_t>(0, L - P.sliding_window) : 0;
      // Query chunks, pre-scaled, repeated across lanes for the QK pass.
      for (int64_t g = 0; g < G; ++g) {
        const T* q = q_base + s * P.q_stride_seq + (h0 + g) * P.q_stride_head;
        for (int64_t c = 0; c < num_chunks; ++c) {
          float* r = S.qrep.data() + (g * num_chunks + c) * W;
          for (int64_t lane = 0; lane < W; ++lane) {
            r[lane] = static_cast<float>(q[c * x + lane % x]) * P.scale;
          }
        }
        S.m[g] = neg_inf;
        S.l[g] = 0.f;
      }
      std::fill(S.o.begin(), S.o.begin() + G * DP, 0.f);
      const int32_t* table = P.block_tables + s * P.bt_stride_seq;
      const int64_t first_blk = start / bs;
      const int64_t last_blk = (L - 1) / bs;
      for (int64_t b = first_blk; b <= last_blk; ++b) {
        const int64_t blk = table[b * P.bt_stride_col];
        const T* kblk = kc + blk * P.k_stride_block + kvh * (D * bs);
        const T* vblk = vc + blk * P.v_stride_block + kvh * (D * bs);
        // Visible offsets of this block: [t0, t1).
        const int64_t t0 = std::max<int64_t>(start - b * bs, 0);
        const int64_t t1 = std::min<int64_t>(L - b * bs, bs);
        const bool partial = t0 > 0 || t1 < bs;
        if (b < last_blk) {
          // Blocks are scattered, so the hardware prefetcher cannot guess the next one: ask for
          // it now, and its memory latency overlaps this block's compute.
          const int64_t nb = table[(b + 1) * P.bt_stride_col];
          const char* nk = reinterpret_cast<const char*>(kc + nb * P.k_stride_block + kvh * (D * bs));
          const char* nv = reinterpret_cast<const char*>(vc + nb * P.v_stride_block + kvh * (D * bs));
          for (int64_t off = 0; off < static_cast<int64_t>(D * bs * sizeof(T)); off += 64) {
            __builtin_prefetch(nk + off);
            __builtin_prefetch(nv + off);
          }
        }
        // QK over the whole GQA group, in register tiles of heads.
        int64_t g = 0;
        for (; g + 4 <= G; g += 4)
          qk_tile<4>(kblk, S.qrep.data() + g * num_chunks * W, S.raw.data() + g * KP, num_chunks, chunk_elems, KP);
        for (; g < G; ++g)
          qk_tile<1>(kblk, S.qrep.data() + g * num_chunks * W, S.raw.data() + g * KP, num_chunks, chunk_elems, KP);
        // V as fp32 (once for the whole group), hidden columns zeroed. fp32 full blocks are
        // read in place.
        const float* vf;
        if (std::is_same_v<T, float> && !partial) {
          vf = reinterpret_cast<const float*>(vblk);
        } else {
          v_block_to_f32(vblk, S.vtmp.data(), D, bs, t0, t1);
          vf = S.vtmp.data();
        }
        for (g = 0; g < G; ++g) {
          // Logits; hidden offsets and the padding up to BP are -inf by position, never
          // computed from cache data.
          float* pg = S.p.data() + g * BP;
          sum_lane_groups(S.raw.data() + g * KP, x, bs, pg);
          for (int64_t t = bs; t < BP; ++t) pg[t] = neg_inf;
          VecF vmax(neg_inf);
          if (plain_logits && !partial) {
            for (int64_t j = 0; j < BP; j += W) vmax = at::vec::maximum(vmax, VecF::loadu(pg + j));
          } else {
            const float slope = P.alibi_slopes ? P.alibi_slopes[(h0 + g) * P.alibi_stride] : 0.f;
            for (int64_t t = 0; t < bs; ++t) {
              if (t < t0 || t >= t1) {
                pg[t] = neg_inf;
                continue;
              }
              float v = pg[t];
              if (P.logits_soft_cap > 0.f) v = P.logits_soft_cap * std::tanh(v / P.logits_soft_cap);
              if (P.alibi_slopes) v += slope * static_cast<float>(b * bs + t - (L - 1));
              pg[t] = v;
            }
            for (int64_t j = 0; j < BP; j += W) vmax = at::vec::maximum(vmax, VecF::loadu(pg + j));
          }
          float bmax = neg_inf;
          {
            float tmp[W];
            vmax.store(tmp);
            for (int64_t k = 0; k < W; ++k) bmax = std::max(bmax, tmp[k]);
          }
          const float m_old = S.m[g];
          const float m_new = std::max(m_old, bmax);
          if (m_new > m_old && m_old != neg_inf) {
            const float a = std::exp(m_old - m_new);
            const VecF alpha(a);
            S.l[g] *= a;
            float* og = S.o.data() + g * DP;
            for (int64_t j = 0; j < DP; j += W) (VecF::loadu(og + j) * alpha).store(og + j);
          }
          S.m[g] = m_new;
          // p = exp(z - m); exp(-inf) = 0 for hidden offsets and padding.
          VecF sum(0.f);
          const VecF vm(m_new);
          for (int64_t j = 0; j < BP; j += W) {
            const VecF e = (VecF::loadu(pg + j) - vm).exp_u20();
            e.store(pg + j);
            sum = sum + e;
          }
          S.l[g] += hsum(sum);
          // PV for this head.
          float* og = S.o.data() + g * DP;
          if (fast_pv) {
            if (NV == 1) pv_head_fast<1>(vf, pg, og, D);
            else if (NV == 2) pv_head_fast<2>(vf, pg, og, D);
            else pv_head_fast<4>(vf, pg, og, D);
          } else {
            pv_head_any(vf, pg, og, D, bs);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* o = o_base + s * P.out_stride_seq + (h0 + g) * P.out_stride_head;
        const float* og = S.o.data() + g * DP;
        const float inv = 1.f / S.l[g];
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(og[d] * inv);
      }
    }
  });
}

inline void attention(const AttentionParams& P) {
  switch (P.dtype) {
    case DType::F32: return attention_impl<float>(P);
    case DType::F16: return attention_impl<c10::Half>(P);
    case DType::BF16: return attention_impl<c10::BFloat16>(P);
  }
}

inline const KernelTable* kernel_table() {
  static const KernelTable t{kKernelAbiVersion, CPU_CAPABILITY_NAME, &attention};
  return &t;
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
