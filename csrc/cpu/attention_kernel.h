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
  std::vector<float> q;      // [G][D] scaled query
  std::vector<float> qrep;   // [G][D/x][W]: q chunk c repeated across the W lanes
  std::vector<float> raw;    // [G][KP] per-lane partial dot products of one block
  std::vector<float> z;      // [G][bs] logits of one block
  std::vector<float> acc;    // [G][VP] per-(d, t) lane accumulators of sum p * v
  std::vector<float> vtmp;   // [D * bs] masked fp32 copy of a partially visible V block
  std::vector<float> m, l;   // [G] running max / normalizer
};

inline Scratch& thread_scratch() {
  static thread_local Scratch s;
  return s;
}

inline void grow(std::vector<float>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// raw[g][j] = sum_c qrep[g][c][j % W] * kblk[c][j] for the G_T heads of a tile, where
// kblk[c] is the [bs][x] chunk c of a key block (flat index j = t * x + i). Since W % x == 0,
// one repeated q vector per chunk lines up with every K vector of that chunk.
template <int G_T, typename T>
inline void qk_tile(const T* kblk, const float* qrep, float* raw, int64_t num_chunks,
                    int64_t chunk_elems, int64_t raw_stride) {
  for (int64_t j = 0; j < chunk_elems; j += W) {
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

// acc[g][j] += p[g][j % bs pattern] * v[j] over the flat [D][bs] block (j = d * bs + t), for
// the case where the lane pattern of p repeats every vector (bs % W == 0 or W % bs == 0).
template <int G_T, typename T>
inline void pv_tile_flat(const T* vblk, const float* prep, float* acc, int64_t elems,
                         int64_t period, int64_t acc_stride, int64_t prep_stride) {
  for (int64_t j = 0; j < elems; j += W) {
    const int64_t cnt = std::min<int64_t>(W, elems - j);
    const VecF v = load_f32(vblk + j, cnt);
    const int64_t pofs = j % period;
    for (int g = 0; g < G_T; ++g) {
      float* a = acc + g * acc_stride + j;
      const VecF p = VecF::loadu(prep + g * prep_stride + pofs);
      at::vec::fmadd(v, p, VecF::loadu(a)).store(a);
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
  const int64_t KP = (chunk_elems + W - 1) / W * W;  // raw row, padded to whole vectors
  const int64_t VE = D * bs;                          // elements of one V block (one kv head)
  const int64_t VP = (VE + W - 1) / W * W;
  // The flat p*v pass needs a p lane pattern that repeats every W lanes or every bs lanes.
  const bool flat_pv = (bs % W == 0) || (W % bs == 0);
  const int64_t period = std::max<int64_t>(bs, W);  // prep row length in the flat pass
  const T* q_base = static_cast<const T*>(P.query);
  T* o_base = static_cast<T*>(P.out);
  const T* kc = static_cast<const T*>(P.key_cache);
  const T* vc = static_cast<const T*>(P.value_cache);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, P.num_seqs * P.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    Scratch& S = thread_scratch();
    grow(S.q, G * D);
    grow(S.qrep, G * num_chunks * W);
    grow(S.raw, G * KP);
    grow(S.z, G * period * 2);
    grow(S.acc, G * VP);
    grow(S.vtmp, VP);
    grow(S.m, G);
    grow(S.l, G);
    float* z = S.z.data();  // [G][period]: logits, then probabilities (zero when masked)
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
      // Query, pre-scaled, in fp32; and its chunks repeated across lanes for the QK pass.
      for (int64_t g = 0; g < G; ++g) {
        const T* q = q_base + s * P.q_stride_seq + (h0 + g) * P.q_stride_head;
        float* qf = S.q.data() + g * D;
        for (int64_t d = 0; d < D; ++d) qf[d] = static_cast<float>(q[d]) * P.scale;
        for (int64_t c = 0; c < num_chunks; ++c) {
          float* r = S.qrep.data() + (g * num_chunks + c) * W;
          for (int64_t lane = 0; lane < W; ++lane) r[lane] = qf[c * x + lane % x];
        }
        S.m[g] = neg_inf;
        S.l[g] = 0.f;
      }
      std::fill(S.acc.begin(), S.acc.begin() + G * VP, 0.f);
      const int32_t* table = P.block_tables + s * P.bt_stride_seq;
      const int64_t first_blk = start / bs;
      const int64_t last_blk = (L - 1) / bs;
      for (int64_t b = first_blk; b <= last_blk; ++b) {
        const int64_t blk = table[b * P.bt_stride_col];
        const T* kblk = kc + blk * P.k_stride_block + kvh * (D * bs);
        const T* vblk = vc + blk * P.v_stride_block + kvh * (D * bs);
        if (b + 1 <= last_blk) {
          // Pull the next block's K toward the cache while this one is computed.
          const int64_t nblk = table[(b + 1) * P.bt_stride_col];
          const char* nk = reinterpret_cast<const char*>(kc + nblk * P.k_stride_block + kvh * (D * bs));
          for (int64_t off = 0; off < static_cast<int64_t>(D * bs * sizeof(T)); off += 256) {
            __builtin_prefetch(nk + off);
          }
        }
        // Visible offsets of this block: [t0, t1).
        const int64_t t0 = std::max<int64_t>(start - b * bs, 0);
        const int64_t t1 = std::min<int64_t>(L - b * bs, bs);
        // QK: raw per-lane partial sums, tiled over the GQA group.
        int64_t g = 0;
        for (; g + 8 <= G; g += 8)
          qk_tile<8>(kblk, S.qrep.data() + g * num_chunks * W, S.raw.data() + g * KP, num_chunks, chunk_elems, KP);
        for (; g + 4 <= G; g += 4)
          qk_tile<4>(kblk, S.qrep.data() + g * num_chunks * W, S.raw.data() + g * KP, num_chunks, chunk_elems, KP);
        for (; g < G; ++g)
          qk_tile<1>(kblk, S.qrep.data() + g * num_chunks * W, S.raw.data() + g * KP, num_chunks, chunk_elems, KP);
        // Logits, masking by position, online-softmax update.
        for (g = 0; g < G; ++g) {
          const float* raw = S.raw.data() + g * KP;
          float* zg = z + g * period;
          const float slope = P.alibi_slopes ? P.alibi_slopes[(h0 + g) * P.alibi_stride] : 0.f;
          float bmax = neg_inf;
          for (int64_t t = 0; t < bs; ++t) {
            if (t < t0 || t >= t1) {
              zg[t] = neg_inf;
              continue;
            }
            float v = 0.f;
            for (int64_t i = 0; i < x; ++i) v += raw[t * x + i];
            if (P.logits_soft_cap > 0.f) v = P.logits_soft_cap * std::tanh(v / P.logits_soft_cap);
            if (P.alibi_slopes) v += slope * static_cast<float>(b * bs + t - (L - 1));
            zg[t] = v;
            bmax = std::max(bmax, v);
          }
          const float m_old = S.m[g];
          const float m_new = std::max(m_old, bmax);
          if (m_new > m_old && m_old != neg_inf) {
            const float alpha = std::exp(m_old - m_new);
            S.l[g] *= alpha;
            float* a = S.acc.data() + g * VP;
            const VecF va(alpha);
            for (int64_t j = 0; j < VP; j += W) (VecF::loadu(a + j) * va).store(a + j);
          }
          S.m[g] = m_new;
          float sum = 0.f;
          for (int64_t t = 0; t < bs; ++t) {
            const float p = (t < t0 || t >= t1) ? 0.f : std::exp(zg[t] - m_new);
            zg[t] = p;
            sum += p;
          }
          S.l[g] += sum;
          // Repeat the probabilities to the lane period of the flat PV pass.
          for (int64_t t = bs; t < period; ++t) zg[t] = zg[t % bs];
        }
        // PV. A partially visible block is first copied with its hidden columns zeroed, since
        // 0 * NaN would still be NaN.
        const bool partial = (t0 > 0 || t1 < bs);
        const float* vsrc_f = nullptr;
        if (partial) {
          float* vt = S.vtmp.data();
          for (int64_t d = 0; d < D; ++d) {
            for (int64_t t = 0; t < bs; ++t) {
              vt[d * bs + t] = (t < t0 || t >= t1) ? 0.f : static_cast<float>(vblk[d * bs + t]);
            }
          }
          vsrc_f = vt;
        }
        if (flat_pv) {
          auto run = [&](auto src) {
            int64_t gg = 0;
            for (; gg + 4 <= G; gg += 4)
              pv_tile_flat<4>(src, z + gg * period, S.acc.data() + gg * VP, VE, period, VP, period);
            for (; gg < G; ++gg)
              pv_tile_flat<1>(src, z + gg * period, S.acc.data() + gg * VP, VE, period, VP, period);
          };
          if (partial) run(vsrc_f); else run(vblk);
        } else {
          // Any other block size: row by row over d, vectors over t with a tail.
          for (int64_t gg = 0; gg < G; ++gg) {
            float* a = S.acc.data() + gg * VP;
            const float* p = z + gg * period;
            for (int64_t d = 0; d < D; ++d) {
              for (int64_t t = 0; t < bs; t += W) {
                const int64_t cnt = std::min<int64_t>(W, bs - t);
                const VecF v = partial ? load_f32(vsrc_f + d * bs + t, cnt) : load_f32(vblk + d * bs + t, cnt);
                const VecF acc = VecF::loadu(a + d * bs + t, cnt);
                at::vec::fmadd(v, VecF::loadu(p + t, cnt), acc).store(a + d * bs + t, cnt);
              }
            }
          }
        }
      }
      // out[g][d] = sum_t acc[g][d * bs + t] / l[g]
      for (int64_t g = 0; g < G; ++g) {
        T* o = o_base + s * P.out_stride_seq + (h0 + g) * P.out_stride_head;
        const float* a = S.acc.data() + g * VP;
        const float inv = 1.f / S.l[g];
        for (int64_t d = 0; d < D; ++d) {
          float v = 0.f;
          for (int64_t t = 0; t < bs; ++t) v += a[d * bs + t];
          o[d] = static_cast<T>(v * inv);
        }
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
