// Tensor-core version of the multi-token kernel (multi_token.cuh) for fp16 / bf16 queries, with
// caches of the query's dtype or fp8 (converted to the query's dtype when staged: exact for both
// fp8 formats). mma.sync m16n8k16 with fp32 accumulation (sm_80+), FlashAttention-2 style:
//
// Work split, tile search, positions, masks and split-K: exactly as in multi_token.cuh (same
// MtTile, same plan with 64 rows per CTA). Each of the 4 warps owns 16 query rows.
//   S = Q K^T: A = Q rows (ldmatrix.x4 from q_s), B = K (ldmatrix.x4 from k_s[key][dim]); the C
//     fragment gives lane (g = lane / 4, c = lane % 4) rows g and g + 8, keys 8j + 2c, 8j + 2c + 1.
//     Logits are scaled in fp32 (scale, times k_scale for fp8), then soft-cap, ALiBi, masks by
//     selection, online softmax with the row max over the 4 lanes of a quad.
//   O += P V: P re-packed from the S fragments into A fragments (16-bit, the query's dtype),
//     B = V (ldmatrix.x4 from v_s[dim][key]), O in fp32 registers (head_size / 2 per lane).
// Staging (double-buffered over key tiles): 16-bit caches with cp.async (16-byte chunks: a key
// chunk is 8 dims of one token, a value chunk 8 positions of one dim, both contiguous in the
// paged layouts); chunks no row may see, or in blocks with bad ids, are zero-filled without a
// read. A value chunk crossing L (the unwritten tail of the last block) is loaded and masked
// by selection; other chunks hold only written positions (finite; the ones a row may not see
// get p = 0). fp8 caches: loaded, converted and stored by the threads.
// Shared rows are padded by 16 bytes: the 8 rows an ldmatrix phase reads fall in 8 different
// 16-byte bank groups (row strides of an odd number of 16-byte units).
#pragma once

#include <atomic>
#include <type_traits>

#include "cuda/multi_token.cuh"

namespace paged::gpu {

template <typename QT>
struct MmaOps;

template <>
struct MmaOps<__nv_bfloat16> {
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct MmaOps<__half> {
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// 16-byte global -> shared copy; src_bytes == 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Eight fp32 values as eight 16-bit values of QT (one 16-byte chunk).
template <typename QT>
__device__ __forceinline__ uint4 pack8(const float* f) {
  using M = MmaOps<QT>;
  return make_uint4(M::pack(f[0], f[1]), M::pack(f[2], f[3]), M::pack(f[4], f[5]),
                    M::pack(f[6], f[7]));
}

template <int D>
struct MmaCfg {
  static constexpr int kRows = 64;  // 4 warps x 16 rows
  static constexpr int KT = D <= 128 ? 64 : 32;  // key positions per tile
  static constexpr int kQS = D + 8;   // row strides in elements: + 16 bytes
  static constexpr int kKS = D + 8;
  static constexpr int kVS = KT + 8;
  static constexpr int kQElems = kRows * kQS;
  static constexpr int kKElems = KT * kKS;
  static constexpr int kVElems = D * kVS;
  static constexpr size_t kSmemBytes =
      2 * (kQElems + 2 * (kKElems + kVElems)) + 2 * KT * sizeof(int);
  static_assert(D % 16 == 0 && kRows == kMultiMmaRows, "unsupported head size");
  static_assert(KT % 16 == 0 && KT <= kMultiThreads, "key tile");
};

template <typename QT, typename CT, int D>
__global__ void __launch_bounds__(kMultiThreads, 2)
    multi_token_mma_kernel(const __grid_constant__ AttentionParams p) {
  using C = MmaCfg<D>;
  using E = Elem<CT>;
  using M = MmaOps<QT>;
  constexpr bool kFp8 = E::kFp8;
  static_assert(kFp8 || std::is_same_v<QT, CT>, "16-bit caches hold the query's dtype");
  constexpr int X = E::kX;  // elements per key vector of the cache layout (8, or 16 for fp8)
  constexpr int KT = C::KT;
  constexpr int NT = KT / 8;  // S n-tiles (8 keys each)
  constexpr int DT = D / 8;   // O n-tiles (8 dims each)
  constexpr int KS = C::kKS, VS = C::kVS, QS = C::kQS;

  extern __shared__ uint4 smem_u4[];
  QT* q_s = reinterpret_cast<QT*>(smem_u4);  // [64][QS]
  QT* k_s = q_s + C::kQElems;                // [2][KT][KS]
  QT* v_s = k_s + 2 * C::kKElems;            // [2][D][VS]
  int* kvis_s = reinterpret_cast<int*>(v_s + 2 * C::kVElems);  // [2][KT]

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int GH = p.mt_heads_per_tile;
  MtTile tl;
  if (!mt_find_tile(p, lane, tl)) return;  // surplus virtual tile (CTA-uniform)
  const int n_tok = tl.n_tok;
  const int h0 = tl.h0, gv = tl.gv;
  const int64_t qrow0 = tl.qs0 + tl.j0;
  const int64_t W = p.sliding_window;
  const int k_lo = tl.k_lo, k_hi = tl.k_hi, L = tl.L;

  // ---- query rows, as they are (the scale is applied to the fp32 logits) ----
  const QT* qg = static_cast<const QT*>(p.query);
  for (int i = tid; i < C::kRows * D; i += kMultiThreads) {
    const int r = i / D;
    const int d = i - r * D;
    const int jj = r / GH;
    const int g = r - jj * GH;
    QT v = Elem<QT>::from_float(0.f);
    if (jj < n_tok && g < gv) {
      v = qg[(qrow0 + jj) * p.q_stride_seq + static_cast<int64_t>(h0 + g) * p.q_stride_head + d];
    }
    q_s[r * QS + d] = v;
  }

  // ---- this lane's rows: g and g + 8 of the warp's 16 ----
  const int gq = lane >> 2;  // groupID of the mma fragments
  const int cq = lane & 3;   // thread in group
  bool rvalid[2];
  int rP[2], rlo[2];
  float slope[2];
  const bool has_alibi = p.alibi_slopes != nullptr;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int r = warp * 16 + gq + 8 * hh;
    const int jj = r / GH;
    const int g = r - jj * GH;
    rvalid[hh] = jj < n_tok && g < gv;
    rP[hh] = tl.row_pos(jj);
    rlo[hh] = static_cast<int>(mt_first_visible(rP[hh], W));
    slope[hh] = (has_alibi && rvalid[hh])
                    ? p.alibi_slopes[static_cast<int64_t>(h0 + g) * p.alibi_stride]
                    : 0.f;
  }
  const int wj0 = (warp * 16) / GH;
  const int wj1 = min((warp * 16 + 15) / GH, n_tok - 1);
  const bool warp_active = __any_sync(kFullMask, rvalid[0] || rvalid[1]);
  const int warp_lo = static_cast<int>(mt_first_visible(tl.row_pos(wj0), W));
  const int warp_hi = tl.row_pos(wj1) + 1;

  float s_scale = p.scale;
  if constexpr (kFp8) s_scale *= __ldg(p.k_scale);
  const float cap = p.logits_soft_cap;
  const float inv_cap = cap > 0.f ? 1.f / cap : 0.f;

  float acc[DT][4];
#pragma unroll
  for (int n = 0; n < DT; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
  }
  float m_run[2] = {-INFINITY, -INFINITY};
  float l_run[2] = {0.f, 0.f};  // per-lane partial sums (reduced over the quad at the end)

  const CT* kc = static_cast<const CT*>(p.key_cache);
  const CT* vc = static_cast<const CT*>(p.value_cache);
  const int32_t* bt = p.block_tables + tl.s * p.bt_stride_seq;
  const int bs = p.block_size;
  const int lg_bs = __ffs(bs) - 1;  // block sizes are powers of two (checked on the host)
  const int64_t head_off = static_cast<int64_t>(tl.kvh) * D * bs;
  auto block_of = [&](int pos) -> int {  // pos < k_hi <= L: the table column exists
    const int32_t id = bt[(pos >> lg_bs) * p.bt_stride_col];
    return (id >= 0 && id < p.num_blocks) ? id : -1;
  };

  // Stage the K and V tile at t0 into buffer `buf` (cp.async for 16-bit caches).
  auto stage = [&](int t0, int buf) {
    QT* kb = k_s + buf * C::kKElems;
    QT* vb = v_s + buf * C::kVElems;
    int* kv = kvis_s + buf * KT;
    for (int i = tid; i < KT * (D / X); i += kMultiThreads) {
      const int t = i % KT;  // consecutive threads: consecutive tokens of one key vector
      const int c = i / KT;
      const int pos = t0 + t;
      const int blk = (pos >= k_lo && pos < k_hi) ? block_of(pos) : -1;
      if (c == 0) kv[t] = blk >= 0;
      const CT* src = kc + static_cast<int64_t>(max(blk, 0)) * p.k_stride_block + head_off +
                      static_cast<int64_t>(c) * bs * X + (pos & (bs - 1)) * X;
      QT* dst = kb + t * KS + c * X;
      if constexpr (!kFp8) {
        cp_async16(dst, blk >= 0 ? static_cast<const void*>(src) : p.key_cache, blk >= 0 ? 16 : 0);
      } else {
        float f[16];
        if (blk >= 0) {
          E::unpack(ld_nc16(src), f);
        } else {
#pragma unroll
          for (int e = 0; e < 16; ++e) f[e] = 0.f;
        }
        *reinterpret_cast<uint4*>(dst) = pack8<QT>(f);
        *reinterpret_cast<uint4*>(dst + 8) = pack8<QT>(f + 8);
      }
    }
    for (int i = tid; i < D * (KT / 8); i += kMultiThreads) {
      const int tc = i % (KT / 8);  // 8 positions of one dim
      const int d = i / (KT / 8);
      const int pos = t0 + tc * 8;
      const int blk = (pos < k_hi && pos + 8 > k_lo) ? block_of(pos) : -1;
      const CT* src = vc + static_cast<int64_t>(max(blk, 0)) * p.v_stride_block + head_off +
                      static_cast<int64_t>(d) * bs + (pos & (bs - 1));
      QT* dst = vb + d * VS + tc * 8;
      if (!kFp8 && (blk < 0 || pos + 8 <= L)) {
        cp_async16(dst, blk >= 0 ? static_cast<const void*>(src) : p.value_cache,
                   blk >= 0 ? 16 : 0);
      } else {
        float f[8];
        if (blk >= 0) {
          if constexpr (kFp8) {
            E::unpack8(ld_nc8(src), f);
          } else {
            E::unpack(ld_nc16(src), f);
          }
#pragma unroll
          for (int e = 0; e < 8; ++e) f[e] = (pos + e < L) ? f[e] : 0.f;  // select
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) f[e] = 0.f;
        }
        *reinterpret_cast<uint4*>(dst) = pack8<QT>(f);
      }
    }
  };

  const int t_first = (k_lo / KT) * KT;
  const int n_tiles = k_lo < k_hi ? (k_hi - t_first + KT - 1) / KT : 0;
  if (n_tiles > 0) {
    stage(t_first, 0);
    cp_async_commit();
  }
  for (int it = 0; it < n_tiles; ++it) {
    const int t0 = t_first + it * KT;
    const int buf = it & 1;
    if (it + 1 < n_tiles) {
      stage(t0 + KT, buf ^ 1);  // overlaps this tile's math (buffer freed by the last barrier)
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile `it` (and q_s) visible to every warp

    if (warp_active && t0 < warp_hi && t0 + KT > warp_lo) {  // warp-uniform
      const QT* kb = k_s + buf * C::kKElems;
      const QT* vb = v_s + buf * C::kVElems;
      const int* kv = kvis_s + buf * KT;
      // ---- S = Q K^T ----
      float sc[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[j][e] = 0.f;
      }
      const QT* qw = q_s + (warp * 16 + (lane & 15)) * QS + (lane >> 4) * 8;
      const QT* kr = kb + ((lane >> 4) * 8 + (lane & 7)) * KS + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[4];
        ldmatrix_x4(a, qw + ks * 16);
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
          uint32_t b[4];
          ldmatrix_x4(b, kr + j * 8 * KS + ks * 16);
          M::mma(sc[j], a, b[0], b[1]);
          M::mma(sc[j + 1], a, b[2], b[3]);
        }
      }
      // ---- logits, masks, online softmax; sc becomes p ----
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const int key = 8 * j + 2 * cq + e2;
            const int pos = t0 + key;
            const bool vis = rvalid[hh] && kv[key] != 0 && pos >= rlo[hh] && pos <= rP[hh];
            float z = sc[j][2 * hh + e2] * s_scale;
            if (cap > 0.f) z = cap * tanhf(z * inv_cap);
            if (has_alibi) z += slope[hh] * static_cast<float>(pos - rP[hh]);
            z = vis ? z : -INFINITY;
            sc[j][2 * hh + e2] = z;
            mx = fmaxf(mx, z);
          }
        }
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, 2));
        const float m_new = fmaxf(m_run[hh], mx);
        // Nothing visible so far: keep the state (avoids e^(-inf - -inf)).
        const float alpha = (m_new == -INFINITY) ? 1.f : __expf(m_run[hh] - m_new);
        float psum = 0.f;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int e2 = 0; e2 < 2; ++e2) {
            const float z = sc[j][2 * hh + e2];
            const float pr = (z == -INFINITY) ? 0.f : __expf(z - m_new);
            sc[j][2 * hh + e2] = pr;
            psum += pr;
          }
        }
        l_run[hh] = l_run[hh] * alpha + psum;
        m_run[hh] = m_new;
#pragma unroll
        for (int n = 0; n < DT; ++n) {
          acc[n][2 * hh] *= alpha;
          acc[n][2 * hh + 1] *= alpha;
        }
      }
      // ---- O += P V ----
      const QT* vr = vb + ((lane >> 4) * 8 + (lane & 7)) * VS + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int kk = 0; kk < KT / 16; ++kk) {
        uint32_t a[4];
        a[0] = M::pack(sc[2 * kk][0], sc[2 * kk][1]);          // row g,     keys 16kk + 2c
        a[1] = M::pack(sc[2 * kk][2], sc[2 * kk][3]);          // row g + 8, keys 16kk + 2c
        a[2] = M::pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);  // row g,     keys 16kk + 8 + 2c
        a[3] = M::pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);  // row g + 8, keys 16kk + 8 + 2c
#pragma unroll
        for (int n = 0; n < DT; n += 2) {
          uint32_t b[4];
          ldmatrix_x4(b, vr + n * 8 * VS + kk * 16);
          M::mma(acc[n], a, b[0], b[1]);
          M::mma(acc[n + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();  // buffer `buf` is restaged two tiles later
  }

  // ---- results ----
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    l_run[hh] += __shfl_xor_sync(kFullMask, l_run[hh], 1);
    l_run[hh] += __shfl_xor_sync(kFullMask, l_run[hh], 2);
  }
  const bool split = p.num_partitions > 1;
  float vscale = 1.f;
  if constexpr (kFp8) vscale = __ldg(p.v_scale);
  QT* out = static_cast<QT*>(p.out);
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    if (!rvalid[hh]) continue;
    const int r = warp * 16 + gq + 8 * hh;
    const int jj = r / GH;
    const int64_t h = h0 + (r - jj * GH);
    const int64_t row = qrow0 + jj;
    const float l = l_run[hh];
    if (split) {
      const int64_t prow = (row * p.num_heads + h) * p.num_partitions + blockIdx.z;
      float* po = p.tmp_out + prow * D;
#pragma unroll
      for (int n = 0; n < DT; ++n) {
        po[8 * n + 2 * cq] = acc[n][2 * hh] * vscale;
        po[8 * n + 2 * cq + 1] = acc[n][2 * hh + 1] * vscale;
      }
      if (cq == 0) {
        p.tmp_max[prow] = m_run[hh];
        p.tmp_sum[prow] = l;
      }
    } else {
      const float inv = l > 0.f ? vscale / l : 0.f;  // a row that saw nothing gives 0
      QT* o = out + row * p.out_stride_seq + h * p.out_stride_head;
#pragma unroll
      for (int n = 0; n < DT; ++n) {
        o[8 * n + 2 * cq] = Elem<QT>::from_float(acc[n][2 * hh] * inv);
        o[8 * n + 2 * cq + 1] = Elem<QT>::from_float(acc[n][2 * hh + 1] * inv);
      }
      if (p.lse != nullptr && cq == 0) p.lse[row * p.num_heads + h] = row_lse(m_run[hh], l);
    }
  }
}

template <typename QT, typename CT, int D>
cudaError_t launch_multi_mma(const AttentionParams& p, cudaStream_t stream) {
  using C = MmaCfg<D>;
  auto* kernel = &multi_token_mma_kernel<QT, CT, D>;
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
  return launch_split_reduce<QT>(p, p.num_tokens, stream);
}

// Head sizes: the multiples of 16 of cuda_sizes.h (120 takes the CUDA-core kernel:
// multi_token_mma_supported on the host).
template <typename QT, typename CT>
cudaError_t launch_multi_mma_any(const AttentionParams& p, cudaStream_t stream) {
  return dispatch_int(p.head_size, CudaHeadSizes{}, cudaErrorInvalidValue, [&](auto d) {
    constexpr int D = decltype(d)::value;
    if constexpr (D % 16 != 0) {
      return cudaErrorInvalidValue;
    } else {
      return launch_multi_mma<QT, CT, D>(p, stream);
    }
  });
}

// fp8 caches: the mma type is the query's (fp16 or bf16).
template <typename CT>
cudaError_t launch_multi_mma_fp8(const AttentionParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::F16: return launch_multi_mma_any<__half, CT>(p, stream);
    case DType::BF16: return launch_multi_mma_any<__nv_bfloat16, CT>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace paged::gpu
