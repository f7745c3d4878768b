// Paged decode attention (one query token per sequence) on the 5D key / 4D value layouts.
//
// Work item: one CTA per (sequence, kv head, group tile, partition). The CTA's GT query heads
// all read the same kv head, so every K/V element is loaded from memory once and used for the
// whole tile of the GQA group (GT query heads; larger groups are split into several tiles).
// Within the CTA, warp w walks 32-token tiles w, w+4, ... of its partition with its own online
// softmax (docs/concepts.md):
//   m' = max(m, max_t z_t);  l' = l e^(m-m') + sum_t e^(z_t-m');  o' = o e^(m-m') + sum_t e^(z_t-m') v_t
// and the four warps are merged through shared memory at the end. With several partitions
// (split-K, for long contexts and small batches) each CTA stores (m, l, o) unnormalised in fp32
// and a second kernel merges them:
//   M = max_i m_i;  l = sum_i l_i e^(m_i-M);  out = (sum_i o_i e^(m_i-M)) / l
// where partitions that saw nothing (m_i = -inf, l_i = 0) are skipped by a branch (their o_i is
// never read, and e^(-inf - -inf) is never evaluated). attention_with_lse (p.lse set): each row
// also gets M + log l (row_lse), from the CTA or, split, from the reduce kernel.
//
// q.k: lane l owns token l of the tile (block l / BS, offset l % BS) and reads its key row as
// D/x 16-byte vectors [c][offset][x] — the lanes of one block read bs*16 contiguous bytes per
// instruction. The scaled query of the tile's heads sits in shared memory as fp32 and is read by
// broadcast. No cross-lane reduction is needed for the dot products.
// p.v: lane l owns value vector (l % VPR) of rows d = l / VPR + k * (32 / VPR) (VPR = 16-byte
// vectors per value row of a block), so one warp instruction reads 512 contiguous bytes of the
// value block; the probabilities come from a per-warp shared buffer.
//
// fp8 caches (CT = __nv_fp8_e4m3 / __nv_fp8_e5m2, x = 16): the query's dtype is then a run-time
// choice (QT = QAny, read from p.dtype: it only matters when the query is loaded and the output
// stored). k_scale is folded into the query scale and v_scale into the output (or into the
// split-K partial outputs), both read from device memory by the kernel. Values are read 8 per
// lane (8-byte loads), so that block size 8 works and the registers match a 16-bit cache.
//
// Masking is by position and always by selection, never by multiplying with a zero weight:
// positions >= L (unwritten slots of the last block), before the sliding window, and blocks
// whose id is out of [0, num_blocks) get z = -inf, p = 0 and V lanes replaced by 0, so NaN/Inf
// in unwritten slots cannot leak. Such blocks are not even loaded. seq_lens are clamped to
// [0, max_len] (max_len = min(block_tables.size(1) * bs, max_seq_len)), so block-table entries
// beyond the table are never read.
#pragma once

#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/launch.cuh"

namespace paged::gpu {

// Query / output element access: QT is the element type, or QAny for a run-time dtype.
struct QAny {};

template <typename QT>
struct QueryIO {
  __device__ __forceinline__ static float load(const void* base, int64_t i, DType) {
    return Elem<QT>::to_float(static_cast<const QT*>(base)[i]);
  }
  __device__ __forceinline__ static void store(void* base, int64_t i, float v, DType) {
    static_cast<QT*>(base)[i] = Elem<QT>::from_float(v);
  }
};

template <>
struct QueryIO<QAny> {
  __device__ __forceinline__ static float load(const void* base, int64_t i, DType dt) {
    switch (dt) {
      case DType::F16: return QueryIO<__half>::load(base, i, dt);
      case DType::BF16: return QueryIO<__nv_bfloat16>::load(base, i, dt);
      default: return QueryIO<float>::load(base, i, dt);
    }
  }
  __device__ __forceinline__ static void store(void* base, int64_t i, float v, DType dt) {
    switch (dt) {
      case DType::F16: QueryIO<__half>::store(base, i, v, dt); break;
      case DType::BF16: QueryIO<__nv_bfloat16>::store(base, i, v, dt); break;
      default: QueryIO<float>::store(base, i, v, dt); break;
    }
  }
};

// Log-sum-exp of a row from its online-softmax state: the max m of its logits and the sum l of
// e^(z - m) over them. The logits are natural-log ones (the kernels exponentiate with __expf, and
// an fp8 k_scale is folded into the query scale, so z is already the real logit). A row that saw
// nothing (l = 0, m = -inf) gets -inf.
__device__ __forceinline__ float row_lse(float m, float l) {
  return l > 0.f ? m + logf(l) : -INFINITY;
}

template <typename QT, typename CT, int D, int BS, int GT>
__global__ void __launch_bounds__(kAttnThreads)
    decode_attention_kernel(const __grid_constant__ AttentionParams p) {
  using E = Elem<CT>;
  using Q = QueryIO<QT>;
  constexpr bool kFp8 = E::kFp8;
  constexpr int X = E::kX;             // elements per 16-byte vector (the layout's x)
  constexpr int VX = E::kVX;           // elements per value load (x; 8 for fp8)
  constexpr int NC = D / X;            // key vectors per token
  constexpr int TB = kTileTokens / BS; // blocks per 32-token tile
  constexpr int VPR = BS / VX;         // value vectors per row of one block
  constexpr int R = 32 / VPR;          // value rows covered by one warp instruction
  constexpr int NDL = (D + R - 1) / R; // value rows per lane
  static_assert(D % X == 0 && BS % VX == 0 && kTileTokens % BS == 0, "unsupported shape");
  static_assert(GT * D <= 1024 && GT * NDL <= 64, "group tile too large for registers/smem");

  __shared__ __align__(16) float q_s[GT][D];                         // scaled query, fp32
  __shared__ __align__(16) float p_s[kAttnWarps][GT][kTileTokens];   // probabilities of a tile
  __shared__ __align__(16) float acc_s[kAttnWarps][GT][D];           // per-warp outputs (merge)
  __shared__ float m_s[kAttnWarps][GT];
  __shared__ float l_s[kAttnWarps][GT];

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int64_t s = blockIdx.x;
  const int kvh = blockIdx.y / p.num_tiles;
  const int tile = blockIdx.y - kvh * p.num_tiles;
  const int part = blockIdx.z;
  const int group = p.num_heads / p.num_kv_heads;
  const int h0 = kvh * group + tile * GT;       // first query head of this CTA
  const int gv = min(GT, group - tile * GT);    // valid heads in this tile (rest are padding)

  // Visible positions of this sequence: [win_start, L).
  int64_t L = p.seq_lens[s * p.sl_stride];
  L = L < 0 ? 0 : (L > p.max_len ? p.max_len : L);
  const int64_t win_start =
      (p.sliding_window > 0 && L > p.sliding_window) ? L - p.sliding_window : 0;
  const int64_t part_begin = static_cast<int64_t>(part) * p.partition_tokens;
  const int64_t part_end = min(part_begin + p.partition_tokens, L);
  // 32-token tiles of this partition that hold a visible position (tiles wholly before the
  // window are skipped). Empty when the partition starts at or after L.
  const int64_t tile_lo = max(part_begin, win_start) / kTileTokens;
  const int64_t tile_hi = (part_end + kTileTokens - 1) / kTileTokens;

  // (scale q) . (k_scale k) = (scale k_scale q) . k for fp8 caches.
  float qscale = p.scale;
  if constexpr (kFp8) qscale *= __ldg(p.k_scale);
  const int64_t q0 = s * p.q_stride_seq;
  for (int i = tid; i < GT * D; i += kAttnThreads) {
    const int g = i / D;
    const int d = i - g * D;
    float v = 0.f;  // padding heads get a zero query; their results are never stored
    if (g < gv) {
      v = Q::load(p.query, q0 + static_cast<int64_t>(h0 + g) * p.q_stride_head + d, p.dtype) *
          qscale;
    }
    q_s[g][d] = v;
  }
  const bool has_alibi = p.alibi_slopes != nullptr;
  float slope[GT];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    slope[g] = (has_alibi && g < gv)
                   ? p.alibi_slopes[static_cast<int64_t>(h0 + g) * p.alibi_stride]
                   : 0.f;
  }
  const float cap = p.logits_soft_cap;
  const float inv_cap = cap > 0.f ? 1.f / cap : 0.f;
  __syncthreads();

  float m_run[GT], l_run[GT], acc[GT][NDL];
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    m_run[g] = -INFINITY;
    l_run[g] = 0.f;  // per-lane partial sum of this warp's probabilities
#pragma unroll
    for (int k = 0; k < NDL; ++k) acc[g][k] = 0.f;
  }

  const int tv = lane % VPR;  // value vector (tokens tv*VX .. tv*VX+VX-1 of a block)
  const int r0 = lane / VPR;  // first value row
  const int tt = lane % BS;   // key token offset in its block
  const int64_t head_off = static_cast<int64_t>(kvh) * D * BS;
  const CT* kc = static_cast<const CT*>(p.key_cache);
  const CT* vc = static_cast<const CT*>(p.value_cache);
  const int32_t* bt = p.block_tables + s * p.bt_stride_seq;

  for (int64_t ti = tile_lo + warp; ti < tile_hi; ti += kAttnWarps) {
    const int64_t t0 = ti * kTileTokens;
    const int64_t pos = t0 + lane;
    const int64_t bi = pos / BS;  // logical block of this lane's key token
    // Physical block, or -1 when no position of the block is visible or its id is out of range
    // (then it is never dereferenced). bi < block_tables.size(1) since L <= max_len.
    int blk = -1;
    if (bi * BS < L && (bi + 1) * BS > win_start) {
      const int32_t id = bt[bi * p.bt_stride_col];
      if (id >= 0 && id < p.num_blocks) blk = id;
    }
    const bool vis = blk >= 0 && pos >= win_start && pos < L;

    // ---- z = (scale q) . k for this lane's token, all heads of the tile ----
    float z[GT][2];
#pragma unroll
    for (int g = 0; g < GT; ++g) z[g][0] = z[g][1] = 0.f;
    if (blk >= 0) {
      const CT* kp = kc + static_cast<int64_t>(blk) * p.k_stride_block + head_off + tt * X;
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        float kf[X];
        E::unpack(ld_nc16(kp + c * (BS * X)), kf);
#pragma unroll
        for (int g = 0; g < GT; ++g) {
          const float4* qv = reinterpret_cast<const float4*>(&q_s[g][c * X]);
#pragma unroll
          for (int j = 0; j < X / 4; ++j) {
            const float4 qq = qv[j];
            float a = z[g][c & 1];  // two chains per head for ILP
            a = fmaf(kf[4 * j + 0], qq.x, a);
            a = fmaf(kf[4 * j + 1], qq.y, a);
            a = fmaf(kf[4 * j + 2], qq.z, a);
            a = fmaf(kf[4 * j + 3], qq.w, a);
            z[g][c & 1] = a;
          }
        }
      }
    }

    // ---- logits, masking, online softmax (m is warp-uniform) ----
    float alpha[GT];
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      float zz = z[g][0] + z[g][1];
      if (cap > 0.f) zz = cap * tanhf(zz * inv_cap);
      if (has_alibi) zz += slope[g] * static_cast<float>(pos - (L - 1));
      zz = vis ? zz : -INFINITY;
      const float m_new = fmaxf(m_run[g], warp_max(zz));
      // Nothing visible so far: keep the state (avoids e^(-inf - -inf)).
      const float a = (m_new == -INFINITY) ? 1.f : __expf(m_run[g] - m_new);
      const float pr = vis ? __expf(zz - m_new) : 0.f;
      l_run[g] = l_run[g] * a + pr;
      m_run[g] = m_new;
      alpha[g] = a;
      p_s[warp][g][lane] = pr;
    }
#pragma unroll
    for (int g = 0; g < GT; ++g) {
#pragma unroll
      for (int k = 0; k < NDL; ++k) acc[g][k] *= alpha[g];
    }
    __syncwarp();

    // ---- o += p . v over the tile's blocks ----
#pragma unroll
    for (int b = 0; b < TB; ++b) {
      const int vblk = __shfl_sync(kFullMask, blk, b * BS);
      if (vblk < 0) continue;  // warp-uniform: block not visible or id out of range
      const int64_t tb = t0 + b * BS;  // position of the block's first token
      const bool full = tb >= win_start && tb + BS <= L;
      float pv[GT][VX];
#pragma unroll
      for (int g = 0; g < GT; ++g) {
        const float4* pp = reinterpret_cast<const float4*>(&p_s[warp][g][b * BS + tv * VX]);
#pragma unroll
        for (int j = 0; j < VX / 4; ++j) {
          const float4 v4 = pp[j];
          pv[g][4 * j + 0] = v4.x;
          pv[g][4 * j + 1] = v4.y;
          pv[g][4 * j + 2] = v4.z;
          pv[g][4 * j + 3] = v4.w;
        }
      }
      const CT* vp = vc + static_cast<int64_t>(vblk) * p.v_stride_block + head_off + tv * VX;
#pragma unroll
      for (int k = 0; k < NDL; ++k) {
        const int d = r0 + k * R;
        if ((D % R) == 0 || d < D) {
          float vf[VX];
          if constexpr (kFp8) {
            E::unpack8(ld_nc8(vp + d * BS), vf);
          } else {
            E::unpack(ld_nc16(vp + d * BS), vf);
          }
          if (!full) {
            // Select, never multiply: 0 * NaN would still be NaN.
#pragma unroll
            for (int i = 0; i < VX; ++i) {
              const int64_t tp = tb + tv * VX + i;
              vf[i] = (tp >= win_start && tp < L) ? vf[i] : 0.f;
            }
          }
#pragma unroll
          for (int g = 0; g < GT; ++g) {
            float a = acc[g][k];
#pragma unroll
            for (int i = 0; i < VX; ++i) a = fmaf(pv[g][i], vf[i], a);
            acc[g][k] = a;
          }
        }
      }
    }
    __syncwarp();  // p_s is rewritten by the next tile
  }

  // ---- merge the warps of the CTA ----
#pragma unroll
  for (int g = 0; g < GT; ++g) {
    l_run[g] = warp_sum(l_run[g]);
#pragma unroll
    for (int k = 0; k < NDL; ++k) {
#pragma unroll
      for (int o = 1; o < VPR; o <<= 1) acc[g][k] += __shfl_xor_sync(kFullMask, acc[g][k], o);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
      m_s[warp][g] = m_run[g];
      l_s[warp][g] = l_run[g];
    }
  }
  if (tv == 0) {
#pragma unroll
    for (int g = 0; g < GT; ++g) {
#pragma unroll
      for (int k = 0; k < NDL; ++k) {
        const int d = r0 + k * R;
        if ((D % R) == 0 || d < D) acc_s[warp][g][d] = acc[g][k];
      }
    }
  }
  __syncthreads();

  const bool split = p.num_partitions > 1;
  float vscale = 1.f;
  if constexpr (kFp8) vscale = __ldg(p.v_scale);
  for (int i = tid; i < GT * D; i += kAttnThreads) {
    const int g = i / D;
    const int d = i - g * D;
    if (g >= gv) continue;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) M = fmaxf(M, m_s[w][g]);
    float l = 0.f, o = 0.f;
    if (M != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kAttnWarps; ++w) {
        const float mw = m_s[w][g];
        if (mw != -INFINITY) {  // a warp that saw nothing contributes nothing
          const float e = __expf(mw - M);
          l = fmaf(e, l_s[w][g], l);
          o = fmaf(e, acc_s[w][g][d], o);
        }
      }
    }
    if constexpr (kFp8) o *= vscale;  // (sum_t p_t v_scale v_t) = v_scale (sum_t p_t v_t)
    const int64_t h = h0 + g;
    if (split) {
      const int64_t row = (s * p.num_heads + h) * p.num_partitions + part;
      p.tmp_out[row * D + d] = o;
      if (d == 0) {
        p.tmp_max[row] = M;
        p.tmp_sum[row] = l;
      }
    } else {
      Q::store(p.out, s * p.out_stride_seq + h * p.out_stride_head + d, l > 0.f ? o / l : 0.f,
               p.dtype);
      if (p.lse != nullptr && d == 0) p.lse[s * p.num_heads + h] = row_lse(M, l);
    }
  }
}

// Block-wide max/sum over kReduceThreads threads; `red` holds one float per warp.
template <bool kMax>
__device__ __forceinline__ float block_reduce(float v, float* red) {
  constexpr int kWarps = kReduceThreads / 32;
  v = kMax ? warp_max(v) : warp_sum(v);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = kMax ? fmaxf(r, red[w]) : r + red[w];
  __syncthreads();  // red is reused by the next call
  return r;
}

// Split-K merge: one CTA per (sequence, query head) (per (query token, query head) for the
// multi-token kernel, which stores its partitions in the same layout).
template <typename T>
__global__ void __launch_bounds__(kReduceThreads)
    decode_reduce_kernel(const __grid_constant__ AttentionParams p) {
  __shared__ float w_s[kMaxPartitions];
  __shared__ float red[kReduceThreads / 32];
  const int64_t s = blockIdx.x;
  const int h = blockIdx.y;
  const int P = p.num_partitions;
  const int D = p.head_size;
  const int64_t row0 = (s * p.num_heads + h) * P;
  const float* mx = p.tmp_max + row0;
  const float* sm = p.tmp_sum + row0;
  const float* po = p.tmp_out + row0 * D;

  float M = -INFINITY;
  for (int i = threadIdx.x; i < P; i += kReduceThreads) M = fmaxf(M, mx[i]);
  M = block_reduce<true>(M, red);
  float lsum = 0.f;
  for (int i = threadIdx.x; i < P; i += kReduceThreads) {
    const float mi = mx[i];
    // Empty partitions (mi = -inf; also all of them when M = -inf) get weight 0 by selection.
    const float w = (mi == -INFINITY) ? 0.f : __expf(mi - M);
    w_s[i] = w;
    lsum = fmaf(w, sm[i], lsum);
  }
  lsum = block_reduce<false>(lsum, red);  // its barriers also publish w_s
  const float inv = lsum > 0.f ? 1.f / lsum : 0.f;
  if (p.lse != nullptr && threadIdx.x == 0) p.lse[s * p.num_heads + h] = row_lse(M, lsum);
  T* out = static_cast<T*>(p.out) + s * p.out_stride_seq + static_cast<int64_t>(h) * p.out_stride_head;
  for (int d = threadIdx.x; d < D; d += kReduceThreads) {
    float a = 0.f;
    for (int i = 0; i < P; ++i) {
      const float w = w_s[i];
      if (w != 0.f) a = fmaf(w, po[static_cast<int64_t>(i) * D + d], a);  // skip, don't multiply
    }
    out[d] = Elem<T>::from_float(a * inv);
  }
}

// The split-K merge for an output of the query's dtype (QT, or p.dtype for QAny), over `rows`
// query rows (sequences for decode, tokens for the multi-token kernel).
template <typename QT>
cudaError_t launch_split_reduce(const AttentionParams& p, int64_t rows, cudaStream_t stream) {
  const dim3 rgrid(static_cast<unsigned>(rows), static_cast<unsigned>(p.num_heads));
  if constexpr (std::is_same_v<QT, QAny>) {
    switch (p.dtype) {
      case DType::F16: decode_reduce_kernel<__half><<<rgrid, kReduceThreads, 0, stream>>>(p); break;
      case DType::BF16:
        decode_reduce_kernel<__nv_bfloat16><<<rgrid, kReduceThreads, 0, stream>>>(p);
        break;
      default: decode_reduce_kernel<float><<<rgrid, kReduceThreads, 0, stream>>>(p); break;
    }
  } else {
    decode_reduce_kernel<QT><<<rgrid, kReduceThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename QT, typename CT, int D, int BS, int GT>
cudaError_t launch_decode(const AttentionParams& p, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.num_seqs),
                  static_cast<unsigned>(p.num_kv_heads * p.num_tiles),
                  static_cast<unsigned>(p.num_partitions));
  decode_attention_kernel<QT, CT, D, BS, GT><<<grid, kAttnThreads, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_partitions <= 1) return err;
  return launch_split_reduce<QT>(p, p.num_seqs, stream);
}

// Group tiles instantiated per (cache type, head size, block size): 1 up to max_group_tile
// (plan_attention never asks for more).
template <typename QT, typename CT, int D, int BS>
cudaError_t launch_decode_gt(const AttentionParams& p, cudaStream_t stream) {
  constexpr int kElemSize = Elem<CT>::kFp8 ? 2 : static_cast<int>(sizeof(CT));
  constexpr int kGtMax = max_group_tile(kElemSize, D, BS);
  switch (p.group_tile) {
    case 1: return launch_decode<QT, CT, D, BS, 1>(p, stream);
    case 2: if constexpr (kGtMax >= 2) return launch_decode<QT, CT, D, BS, 2>(p, stream); break;
    case 4: if constexpr (kGtMax >= 4) return launch_decode<QT, CT, D, BS, 4>(p, stream); break;
    case 8: if constexpr (kGtMax >= 8) return launch_decode<QT, CT, D, BS, 8>(p, stream); break;
    default: break;
  }
  return cudaErrorInvalidValue;  // a plan the host never makes
}

// Head sizes and block sizes: the lists of cuda_sizes.h (fp8 caches: the head sizes that are
// multiples of x = 16).
template <typename QT, typename CT>
cudaError_t launch_decode_any(const AttentionParams& p, cudaStream_t stream) {
  return dispatch_int(p.head_size, CudaHeadSizes{}, cudaErrorInvalidValue, [&](auto d) {
    constexpr int D = decltype(d)::value;
    if constexpr (Elem<CT>::kFp8 && D % 16 != 0) {
      return cudaErrorInvalidValue;
    } else {
      return dispatch_int(p.block_size, CudaBlockSizes{}, cudaErrorInvalidValue, [&](auto bs) {
        return launch_decode_gt<QT, CT, D, decltype(bs)::value>(p, stream);
      });
    }
  });
}

}  // namespace paged::gpu
