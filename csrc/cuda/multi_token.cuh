// Paged attention with several query tokens per sequence (query_start_loc): chunked prefill,
// whole prompts, speculative decoding, mixed batches. CUDA cores, fp32 accumulation: the kernel
// for fp32 queries and head size 120 (and for everything when PAGED_OPS_CUDA_MULTI_TOKEN_SIMT=1);
// fp16 / bf16 queries otherwise take the tensor-core kernel of multi_token_mma.cuh, which shares
// the work split, the tile search (mt_find_tile) and the masking rules below.
//
// Work item: one CTA per (tile of TQ consecutive query tokens of one sequence, GQA group tile of
// GH heads, key partition). Its rows are the TQ x GH (token, head) pairs, token-major; all of
// them read the same kv head, so every K/V element is loaded once per CTA for all of them.
// Tiles are found without any host knowledge of the q_lens (see plan_multi_token): the grid's
// x is num_tokens / TQ + num_seqs "virtual tiles", sequence s owns [v(s), v(s + 1)) with
// v(s) = qsl[s] / TQ + s, and a CTA finds its sequence by a (32-way, one warp) search over
// query_start_loc; tiles past a sequence's q_len exit at once.
//
// Row (token j of q_len, head g) sits at position P = L - q_len + j and sees [lo, P] with
// lo = P - sliding_window + 1 (or 0); with causal=False every row sits at P = L - 1 (it sees the
// whole sequence, window and ALiBi measured from there). The CTA walks 32-position key tiles over
// [min lo, max P] of its rows (clipped to its partition):
//   1. all threads: K tile -> kt_s[d][t] (fp32, transposed), V tile -> v_s[d][t] (fp32), zeros
//      at positions no row of the CTA may see (outside [lo_min, P_max] or its partition, or
//      in a block whose id is out of range: those are never dereferenced), so NaN/Inf in
//      unwritten slots never reach the arithmetic; kvis_s[t] says which positions were loaded.
//   2. each warp, on its 16 (8 for head_size > 128) rows, if one of them sees the tile:
//      S = Q K^T (lane: 4 rows x 4 (2) keys), soft-cap, ALiBi, per-row causal/window mask by
//      selection (z = -inf, p = 0), online softmax with the row max reduced over the
//      8 (16) lanes sharing the rows, p -> p_s, then O += P V (lane: the same 4 rows x
//      head_size / 8 (16) dims), the running max/sum of its rows staying in the same lanes.
// With several partitions, (m, l, o) per (token, head, partition) go to fp32 scratch and the
// decode reduce kernel merges them (decode_reduce_kernel, launched over tokens).
//
// Shared memory (bytes): q 4*R*D, K 4*D*32, V 4*D*32, P 4*R*32 (R = rows per CTA):
// 72 KiB at head size 128 (three CTAs per SM), 100 KiB at 256 (two).
// Bank conflicts: the q and p reads are broadcasts (the 8 lanes of a phase share their rows),
// the K reads and all stores touch 32 consecutive words per phase, and the V reads (8 lanes, 8
// different dims, same 4 keys) are spread by an XOR swizzle of the 16-byte key chunk with d.
#pragma once

#include <atomic>

#include "cuda/attention.cuh"
#include "cuda/common.cuh"
#include "cuda/launch.cuh"

namespace paged::gpu {

template <int D>
struct MultiCfg {
  static constexpr int kRowsPerWarp = D <= 128 ? 16 : 8;
  static constexpr int kRows = 4 * kRowsPerWarp;  // == multi_rows_per_cta(D)
  static constexpr int kRowGroups = kRowsPerWarp / 4;  // groups of 4 rows per warp
  static constexpr int kNK = 32 / kRowGroups;          // lanes sharing a row group: 8 or 16
  static constexpr int KT = kMultiKeyTile;             // key positions per tile
  static constexpr int kKPL = KT / kNK;                // keys per lane in S: 4 or 2
  static constexpr int kDPL = D / kNK;                 // output dims per lane
  static constexpr int kQFloats = kRows * D;
  static constexpr int kKVFloats = D * KT;
  static constexpr int kPFloats = kRows * KT;
  static constexpr size_t kSmemBytes =
      sizeof(float) * (kQFloats + 2 * kKVFloats + kPFloats) + sizeof(int) * KT;
  static constexpr int kMinBlocks = D <= 128 ? 3 : 2;
  static_assert(kRows == multi_rows_per_cta(D), "rows per CTA must match the host plan");
  static_assert(D % kNK == 0 && D % 4 == 0 && KT == 32, "unsupported head size");
  static_assert(kMultiThreads == 128, "four warps");
};

// Float index of v_s[d][t .. t+3] (t a multiple of 4): the 16-byte chunk t / 4 is XOR-swizzled
// with d, so that 8 lanes reading 8 consecutive dims at the same keys hit 8 different chunks.
__device__ __forceinline__ int v_index(int d, int t) {
  return d * kMultiKeyTile + ((((t >> 2) ^ d) & 7) << 2);
}

// First position a row at position P sees (sliding window W > 0), or 0.
__device__ __forceinline__ int64_t mt_first_visible(int64_t P, int64_t W) {
  return (W > 0 && P - W + 1 > 0) ? P - W + 1 : 0;
}

// What one CTA of a multi-token kernel works on (grid: virtual tiles x (kv head, group tile) x
// partitions; see plan_multi_token).
struct MtTile {
  int64_t s;      // sequence
  int64_t qs0;    // its first query row
  int64_t q_len;  // its query tokens
  int64_t j0;     // first token of this tile within the sequence
  int64_t pos0;   // position of that token: L - q_len + j0 (may be negative for bad input);
                  // L - 1 for causal=False
  int pos_step;   // 1, or 0 for causal=False: every token of the tile sits at pos0
  int n_tok;      // tokens of this tile (<= TQ)
  int L;          // the sequence's length, clamped to [0, max_len]
  int kvh, h0, gv;  // kv head, first query head, valid heads of the group tile
  // Positions some row of the CTA may see, clipped to its partition: [k_lo, k_hi) with
  // 0 <= k_lo <= k_hi <= L <= INT32_MAX (both 0 when empty).
  int k_lo, k_hi;
  // Position of token jj of the tile, clamped to >= -1 (a row at a negative position sees
  // nothing either way), so positions fit in ints.
  __device__ __forceinline__ int row_pos(int64_t jj) const {
    const int64_t P = pos0 + jj * pos_step;
    return static_cast<int>(P < -1 ? -1 : P);
  }
};

// Finds this CTA's sequence and tokens by a 32-way search over query_start_loc (every warp
// searches: same loads, same answer, no barrier). Offsets are clamped to [0, num_tokens] and
// seq_lens to [0, max_len] (device data is never trusted); for a valid query_start_loc
// v(s) = qsl[s] / TQ + s increases strictly and the search is exact. Returns false (for the
// whole CTA) when the virtual tile is past its sequence's q_len.
__device__ __forceinline__ bool mt_find_tile(const AttentionParams& p, int lane, MtTile& t) {
  const int64_t T = p.num_tokens;
  const int64_t n_seqs = p.num_seqs;
  const int TQ = p.mt_tokens_per_tile;
  const int GH = p.mt_heads_per_tile;
  auto qstart = [&](int64_t s) -> int64_t {
    const int64_t v = __ldg(p.query_start_loc + s * p.qsl_stride);
    return v < 0 ? 0 : (v > T ? T : v);
  };
  const int64_t vt = blockIdx.x;
  if (n_seqs <= 0 || qstart(0) / TQ > vt) return false;
  int64_t lo_s = 0, hi_s = n_seqs;  // the answer (largest s with v(s) <= vt) is in [lo_s, hi_s)
  while (hi_s - lo_s > 1) {
    const int64_t step = (hi_s - lo_s + 31) / 32;
    const int64_t probe = lo_s + static_cast<int64_t>(lane) * step;
    const bool ok = lane > 0 && probe < hi_s && qstart(probe) / TQ + probe <= vt;
    const int k = __popc(__ballot_sync(kFullMask, ok));
    lo_s += k * step;
    hi_s = min(hi_s, lo_s + step);
  }
  t.s = lo_s;
  t.qs0 = qstart(t.s);
  const int64_t qs1 = max(qstart(t.s + 1), t.qs0);
  t.q_len = qs1 - t.qs0;
  t.j0 = (vt - (t.qs0 / TQ + t.s)) * TQ;
  if (t.j0 >= t.q_len) return false;
  t.n_tok = static_cast<int>(t.q_len - t.j0 < TQ ? t.q_len - t.j0 : TQ);

  t.kvh = blockIdx.y / p.mt_group_tiles;
  const int gtile = blockIdx.y - t.kvh * p.mt_group_tiles;
  const int group = p.num_heads / p.num_kv_heads;
  t.h0 = t.kvh * group + gtile * GH;
  t.gv = min(GH, group - gtile * GH);

  int64_t L = p.seq_lens[t.s * p.sl_stride];
  L = L < 0 ? 0 : (L > p.max_len ? p.max_len : L);
  t.L = static_cast<int>(L);  // seq_lens are int32
  t.pos_step = p.causal ? 1 : 0;
  t.pos0 = p.causal ? L - t.q_len + t.j0 : L - 1;
  const int64_t part_begin = static_cast<int64_t>(blockIdx.z) * p.partition_tokens;
  int64_t key_lo = max(mt_first_visible(t.pos0, p.sliding_window), part_begin);
  // One past the last token's position: <= L.
  int64_t key_hi = min(t.pos0 + static_cast<int64_t>(t.n_tok - 1) * t.pos_step + 1,
                       part_begin + p.partition_tokens);
  if (key_lo >= key_hi) key_lo = key_hi = 0;
  t.k_lo = static_cast<int>(key_lo);
  t.k_hi = static_cast<int>(key_hi);
  return true;
}

template <typename CT, int D>
__global__ void __launch_bounds__(kMultiThreads, MultiCfg<D>::kMinBlocks)
    multi_token_attention_kernel(const __grid_constant__ AttentionParams p) {
  using C = MultiCfg<D>;
  using E = Elem<CT>;
  using Q = QueryIO<QAny>;
  constexpr bool kFp8 = E::kFp8;
  constexpr int X = E::kX;    // elements per key vector (the layout's x)
  constexpr int NC = D / X;   // key vectors per token
  constexpr int VX = E::kVX;  // elements per value load
  constexpr int KT = C::KT;
  constexpr int NK = C::kNK;
  constexpr int KPL = C::kKPL;
  constexpr int DPL = C::kDPL;
  constexpr int RW = C::kRowsPerWarp;
  constexpr int VG = KT / VX;  // value loads per dim per tile
  static_assert(D % X == 0 && KT % VX == 0 && kMultiThreads % VG == 0, "unsupported shape");

  extern __shared__ float4 smem4[];
  float* q_s = reinterpret_cast<float*>(smem4);  // [rows][D], scaled query
  float* kt_s = q_s + C::kQFloats;               // [D][KT]
  float* v_s = kt_s + C::kKVFloats;              // [D][KT], swizzled (v_index)
  float* p_s = v_s + C::kKVFloats;               // [rows][KT]
  int* kvis_s = reinterpret_cast<int*>(p_s + C::kPFloats);  // [KT]: position loaded

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int GH = p.mt_heads_per_tile;
  MtTile tl;
  if (!mt_find_tile(p, lane, tl)) return;  // surplus virtual tile (CTA-uniform)
  const int n_tok = tl.n_tok;
  const int h0 = tl.h0, gv = tl.gv, kvh = tl.kvh;
  const int64_t s = tl.s, qs0 = tl.qs0, j0 = tl.j0;
  const int64_t W = p.sliding_window;
  auto first_visible = [&](int64_t P) -> int64_t { return mt_first_visible(P, W); };
  auto row_pos = [&](int64_t jj) -> int { return tl.row_pos(jj); };

  // ---- the scaled query rows (fp32), zero for padding rows ----
  float qscale = p.scale;
  if constexpr (kFp8) qscale *= __ldg(p.k_scale);
  for (int i = tid; i < C::kRows * D; i += kMultiThreads) {
    const int r = i / D;
    const int d = i - r * D;
    const int jj = r / GH;
    const int g = r - jj * GH;
    float v = 0.f;
    if (jj < n_tok && g < gv) {
      const int64_t row = qs0 + j0 + jj;
      v = Q::load(p.query, row * p.q_stride_seq + static_cast<int64_t>(h0 + g) * p.q_stride_head + d,
                  p.dtype) *
          qscale;
    }
    q_s[i] = v;
  }

  // ---- this lane's 4 rows ----
  const int ri = lane / NK;  // row group of the warp
  const int kk = lane % NK;  // key group (S) / dim group (O)
  const int rbase = warp * RW + ri * 4;
  bool rvalid[4];
  int rP[4], rlo[4];
  float slope[4];
  const bool has_alibi = p.alibi_slopes != nullptr;
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int r = rbase + a;
    const int jj = r / GH;
    const int g = r - jj * GH;
    rvalid[a] = jj < n_tok && g < gv;
    rP[a] = row_pos(jj);
    rlo[a] = static_cast<int>(first_visible(rP[a]));
    slope[a] = (has_alibi && rvalid[a])
                   ? p.alibi_slopes[static_cast<int64_t>(h0 + g) * p.alibi_stride]
                   : 0.f;
  }
  // Positions this warp's rows may see: [first lo, last P] over its tokens.
  const int wj0 = (warp * RW) / GH;
  const int wj1 = min((warp * RW + RW - 1) / GH, n_tok - 1);
  const bool warp_active = __any_sync(kFullMask, rvalid[0] || rvalid[1] || rvalid[2] || rvalid[3]);
  const int warp_lo = static_cast<int>(first_visible(row_pos(wj0)));
  const int warp_hi = row_pos(wj1) + 1;
  const float cap = p.logits_soft_cap;
  const float inv_cap = cap > 0.f ? 1.f / cap : 0.f;

  float m_run[4], l_run[4], acc[4][DPL];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    m_run[a] = -INFINITY;
    l_run[a] = 0.f;  // per-lane partial sum over its keys
#pragma unroll
    for (int m = 0; m < DPL; ++m) acc[a][m] = 0.f;
  }

  const CT* kc = static_cast<const CT*>(p.key_cache);
  const CT* vc = static_cast<const CT*>(p.value_cache);
  const int32_t* bt = p.block_tables + s * p.bt_stride_seq;
  const int bs = p.block_size;
  const int lg_bs = __ffs(bs) - 1;  // block sizes are powers of two (checked on the host)
  const int64_t head_off = static_cast<int64_t>(kvh) * D * bs;
  // Physical block holding position pos, or -1 (pos < key_hi <= L, so the table column exists).
  auto block_of = [&](int pos) -> int {
    const int32_t id = bt[(pos >> lg_bs) * p.bt_stride_col];
    return (id >= 0 && id < p.num_blocks) ? id : -1;
  };

  const int k_lo = tl.k_lo, k_hi = tl.k_hi;
  for (int t0 = (k_lo / KT) * KT; t0 < k_hi; t0 += KT) {
    __syncthreads();  // the previous tile's kt_s / v_s / p_s / kvis_s are no longer read
    // ---- K: lane = key position t0 + lane; warp w loads key vectors w, w + 4, ... ----
    {
      const int pos = t0 + lane;
      int blk = -1;
      if (pos >= k_lo && pos < k_hi) blk = block_of(pos);
      if (warp == 0) kvis_s[lane] = blk >= 0;
      const CT* kp = kc + static_cast<int64_t>(max(blk, 0)) * p.k_stride_block + head_off +
                     (pos & (bs - 1)) * X;  // dereferenced only when blk >= 0
      for (int c = warp; c < NC; c += 4) {
        float kf[X];
        if (blk >= 0) {
          E::unpack(ld_nc16(kp + static_cast<int64_t>(c) * bs * X), kf);
        } else {
#pragma unroll
          for (int e = 0; e < X; ++e) kf[e] = 0.f;
        }
#pragma unroll
        for (int e = 0; e < X; ++e) kt_s[(c * X + e) * KT + lane] = kf[e];
      }
    }
    // ---- V: thread -> (dim d, VX consecutive positions of one block) ----
    {
      const int tc = tid % VG;
      const int pos = t0 + tc * VX;
      int blk = -1;
      if (pos < k_hi && pos + VX > k_lo) blk = block_of(pos);
      const bool full = pos >= k_lo && pos + VX <= k_hi;
      const CT* vp = vc + static_cast<int64_t>(max(blk, 0)) * p.v_stride_block + head_off +
                     (pos & (bs - 1));  // dereferenced only when blk >= 0
      for (int d = tid / VG; d < D; d += kMultiThreads / VG) {
        float vf[VX];
        if (blk >= 0) {
          if constexpr (kFp8) {
            E::unpack8(ld_nc8(vp + static_cast<int64_t>(d) * bs), vf);
          } else {
            E::unpack(ld_nc16(vp + static_cast<int64_t>(d) * bs), vf);
          }
          if (!full) {
#pragma unroll
            for (int e = 0; e < VX; ++e) {
              const int pe = pos + e;
              vf[e] = (pe >= k_lo && pe < k_hi) ? vf[e] : 0.f;  // select, never multiply
            }
          }
        } else {
#pragma unroll
          for (int e = 0; e < VX; ++e) vf[e] = 0.f;
        }
#pragma unroll
        for (int e4 = 0; e4 < VX; e4 += 4) {
          *reinterpret_cast<float4*>(&v_s[v_index(d, tc * VX + e4)]) =
              make_float4(vf[e4], vf[e4 + 1], vf[e4 + 2], vf[e4 + 3]);
        }
      }
    }
    __syncthreads();

    // Warp-uniform: this warp has rows and some of them may see a position of the tile.
    if (!warp_active || t0 >= warp_hi || t0 + KT <= warp_lo) continue;

    // ---- S = (scale q) . k: rows rbase .. rbase + 3, keys kk * KPL .. + KPL ----
    float sc[4][KPL];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
#pragma unroll
      for (int b = 0; b < KPL; ++b) sc[a][b] = 0.f;
    }
#pragma unroll 2
    for (int d0 = 0; d0 < D; d0 += 4) {
      float4 qv[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) qv[a] = *reinterpret_cast<const float4*>(&q_s[(rbase + a) * D + d0]);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float kv[KPL];
        if constexpr (KPL == 4) {
          const float4 k4 = *reinterpret_cast<const float4*>(&kt_s[(d0 + e) * KT + kk * 4]);
          kv[0] = k4.x;
          kv[1] = k4.y;
          kv[2] = k4.z;
          kv[3] = k4.w;
        } else {
          const float2 k2 = *reinterpret_cast<const float2*>(&kt_s[(d0 + e) * KT + kk * 2]);
          kv[0] = k2.x;
          kv[1] = k2.y;
        }
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          const float qe = e == 0 ? qv[a].x : (e == 1 ? qv[a].y : (e == 2 ? qv[a].z : qv[a].w));
#pragma unroll
          for (int b = 0; b < KPL; ++b) sc[a][b] = fmaf(qe, kv[b], sc[a][b]);
        }
      }
    }

    // ---- logits, masks, online softmax (the row max over the NK lanes of the row group) ----
    bool kv_ok[KPL];
#pragma unroll
    for (int b = 0; b < KPL; ++b) kv_ok[b] = kvis_s[kk * KPL + b] != 0;
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      float z[KPL];
      bool vis[KPL];
      float mx = -INFINITY;
#pragma unroll
      for (int b = 0; b < KPL; ++b) {
        const int pos = t0 + kk * KPL + b;
        vis[b] = rvalid[a] && kv_ok[b] && pos >= rlo[a] && pos <= rP[a];
        float zz = sc[a][b];
        if (cap > 0.f) zz = cap * tanhf(zz * inv_cap);
        if (has_alibi) zz += slope[a] * static_cast<float>(pos - rP[a]);
        z[b] = vis[b] ? zz : -INFINITY;
        mx = fmaxf(mx, z[b]);
      }
#pragma unroll
      for (int o = 1; o < NK; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, o));
      const float m_new = fmaxf(m_run[a], mx);
      // Nothing visible so far: keep the state (avoids e^(-inf - -inf)).
      const float alpha = (m_new == -INFINITY) ? 1.f : __expf(m_run[a] - m_new);
      float pr[KPL];
      float psum = 0.f;
#pragma unroll
      for (int b = 0; b < KPL; ++b) {
        pr[b] = vis[b] ? __expf(z[b] - m_new) : 0.f;
        psum += pr[b];
      }
      l_run[a] = l_run[a] * alpha + psum;
      m_run[a] = m_new;
#pragma unroll
      for (int m = 0; m < DPL; ++m) acc[a][m] *= alpha;
      float* pp = &p_s[(rbase + a) * KT + kk * KPL];
      if constexpr (KPL == 4) {
        *reinterpret_cast<float4*>(pp) = make_float4(pr[0], pr[1], pr[2], pr[3]);
      } else {
        *reinterpret_cast<float2*>(pp) = make_float2(pr[0], pr[1]);
      }
    }
    __syncwarp();

    // ---- O += P V: rows rbase .. + 3, dims kk + NK * m ----
#pragma unroll 2
    for (int t = 0; t < KT; t += 4) {
      float4 pv[4];
#pragma unroll
      for (int a = 0; a < 4; ++a) pv[a] = *reinterpret_cast<const float4*>(&p_s[(rbase + a) * KT + t]);
#pragma unroll
      for (int m = 0; m < DPL; ++m) {
        const float4 v4 = *reinterpret_cast<const float4*>(&v_s[v_index(kk + NK * m, t)]);
#pragma unroll
        for (int a = 0; a < 4; ++a) {
          float o = acc[a][m];
          o = fmaf(pv[a].x, v4.x, o);
          o = fmaf(pv[a].y, v4.y, o);
          o = fmaf(pv[a].z, v4.z, o);
          o = fmaf(pv[a].w, v4.w, o);
          acc[a][m] = o;
        }
      }
    }
    // p_s is rewritten only after the next tile's first barrier.
  }

  // ---- results: the row sums over the NK lanes, then out (or the split-K partials) ----
#pragma unroll
  for (int a = 0; a < 4; ++a) {
#pragma unroll
    for (int o = 1; o < NK; o <<= 1) l_run[a] += __shfl_xor_sync(kFullMask, l_run[a], o);
  }
  const bool split = p.num_partitions > 1;
  float vscale = 1.f;
  if constexpr (kFp8) vscale = __ldg(p.v_scale);
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    if (!rvalid[a]) continue;
    const int r = rbase + a;
    const int jj = r / GH;
    const int64_t h = h0 + (r - jj * GH);
    const int64_t row = qs0 + j0 + jj;
    const float l = l_run[a];
    if (split) {
      const int64_t prow = (row * p.num_heads + h) * p.num_partitions + blockIdx.z;
      float* po = p.tmp_out + prow * D;
#pragma unroll
      for (int m = 0; m < DPL; ++m) po[kk + NK * m] = acc[a][m] * vscale;
      if (kk == 0) {
        p.tmp_max[prow] = m_run[a];
        p.tmp_sum[prow] = l;
      }
    } else {
      const float inv = l > 0.f ? vscale / l : 0.f;  // a row that saw nothing gives 0
      const int64_t o0 = row * p.out_stride_seq + h * p.out_stride_head;
#pragma unroll
      for (int m = 0; m < DPL; ++m) Q::store(p.out, o0 + kk + NK * m, acc[a][m] * inv, p.dtype);
      if (p.lse != nullptr && kk == 0) p.lse[row * p.num_heads + h] = row_lse(m_run[a], l);
    }
  }
}

template <typename CT, int D>
cudaError_t launch_multi(const AttentionParams& p, cudaStream_t stream) {
  using C = MultiCfg<D>;
  auto* kernel = &multi_token_attention_kernel<CT, D>;
  if constexpr (C::kSmemBytes > 48 * 1024) {
    // Opt in to more than 48 KiB of dynamic shared memory, once per device.
    static std::atomic<uint64_t> done{0};
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    const uint64_t bit = dev < 64 ? (uint64_t{1} << dev) : 0;
    if (bit == 0 || (done.load(std::memory_order_relaxed) & bit) == 0) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(C::kSmemBytes));
      if (err != cudaSuccess) return err;
      done.fetch_or(bit, std::memory_order_relaxed);
    }
  }
  const dim3 grid(static_cast<unsigned>(p.mt_virtual_tiles),
                  static_cast<unsigned>(p.num_kv_heads * p.mt_group_tiles),
                  static_cast<unsigned>(p.num_partitions));
  kernel<<<grid, kMultiThreads, C::kSmemBytes, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_partitions <= 1) return err;
  return launch_split_reduce<QAny>(p, p.num_tokens, stream);
}

// Head sizes: the list of cuda_sizes.h (the block size is a run-time parameter here). fp8: the
// multiples of x = 16.
template <typename CT>
cudaError_t launch_multi_any(const AttentionParams& p, cudaStream_t stream) {
  return dispatch_int(p.head_size, CudaHeadSizes{}, cudaErrorInvalidValue, [&](auto d) {
    constexpr int D = decltype(d)::value;
    if constexpr (Elem<CT>::kFp8 && D % 16 != 0) {
      return cudaErrorInvalidValue;
    } else {
      return launch_multi<CT, D>(p, stream);
    }
  });
}

}  // namespace paged::gpu
