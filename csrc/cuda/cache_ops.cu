// reshape_and_cache and copy_blocks kernels.
#include "cuda/common.cuh"
#include "cuda/launch.cuh"

namespace paged::gpu {
namespace {

// Element carriers by size: the cache write only moves bits.
template <int kSize>
struct Carrier;
template <>
struct Carrier<2> {
  using type = uint16_t;
};
template <>
struct Carrier<4> {
  using type = uint32_t;
};

// Element j (compile-time after unrolling) of a 16-byte vector.
template <typename E>
__device__ __forceinline__ E vec_elem(const uint4& v, int j) {
  constexpr int kPerWord = 4 / sizeof(E);
  const int w = j / kPerWord;
  const uint32_t word = w == 0 ? v.x : (w == 1 ? v.y : (w == 2 ? v.z : v.w));
  if constexpr (kPerWord == 1) {
    return static_cast<E>(word);
  } else {
    return static_cast<E>(word >> (16 * (j % 2)));
  }
}

// One CTA per token (grid-stride over tokens), threads stride over the token's
// num_kv_heads * head_size / x 16-byte chunks, so any head count and head size is covered
// (no cap on threads per token). Chunk c of head h goes to
//   key_cache[blk][h][c][off][0..x)         (one 16-byte store)
//   value_cache[blk][h][c*x + j][off]       (x scalar stores, the layout is transposed)
// A negative slot is padding; a slot >= num_slots is out of range and skipped as well (the CUDA
// path cannot raise on device data, and must never write outside the caches).
template <typename E, bool kVec>
__global__ void reshape_and_cache_kernel(const __grid_constant__ CacheWriteParams p) {
  constexpr int X = 16 / sizeof(E);
  const int D = p.head_size;
  const int bs = p.block_size;
  const int nch = D / X;
  const int n = p.num_kv_heads * nch;
  const E* key = static_cast<const E*>(p.key);
  const E* value = static_cast<const E*>(p.value);
  E* kc = static_cast<E*>(p.key_cache);
  E* vc = static_cast<E*>(p.value_cache);
  for (int64_t i = blockIdx.x; i < p.num_tokens; i += gridDim.x) {
    const int64_t slot = p.slot_mapping[i * p.slot_stride];
    if (slot < 0 || slot >= p.num_slots) continue;  // CTA-uniform
    const int64_t blk = slot / bs;
    const int64_t off = slot - blk * bs;
    E* kd0 = kc + blk * p.kc_stride_block + off * X;
    E* vd0 = vc + blk * p.vc_stride_block + off;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
      const int h = c / nch;
      const int cc = c - h * nch;
      const E* ks = key + i * p.key_stride_tok + h * p.key_stride_head + cc * X;
      const E* vs = value + i * p.value_stride_tok + h * p.value_stride_head + cc * X;
      // h*D*bs + cc*bs*x for the key chunk; h*D*bs + (cc*x + j)*bs for value element j.
      const int64_t rowbase = (static_cast<int64_t>(h) * D + cc * X) * bs;
      E* kd = kd0 + rowbase;
      E* vd = vd0 + rowbase;
      if constexpr (kVec) {
        *reinterpret_cast<uint4*>(kd) = ld_nc16(ks);
        const uint4 vv = ld_nc16(vs);
#pragma unroll
        for (int j = 0; j < X; ++j) vd[static_cast<int64_t>(j) * bs] = vec_elem<E>(vv, j);
      } else {
#pragma unroll
        for (int j = 0; j < X; ++j) {
          kd[j] = ks[j];
          vd[static_cast<int64_t>(j) * bs] = vs[j];
        }
      }
    }
  }
}

// ---- fp8 caches: round(x / scale), saturated to +-max finite, round-to-nearest-even -----------

// x / y in IEEE fp32 (correctly rounded, denormals kept) whatever the compile flags (fast math
// would turn `/` into an approximation): the stored bytes must equal the CPU kernel's.
__device__ __forceinline__ float div_rn(float x, float y) {
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(x), "f"(y));
  return r;
}

// The fp8 bits nearest to v (ties to even), saturated to the largest finite value of the format
// (also for +-Inf); NaN becomes the format's NaN with v's sign, as on the CPU.
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ uint32_t to_fp8(float v) {
  const uint32_t bits = __float_as_uint(v);
  uint32_t r = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kFmt);
  if ((bits & 0x7fffffffu) > 0x7f800000u) r = 0x7fu | ((bits >> 24) & 0x80u);
  return r;
}

// Like reshape_and_cache_kernel, for fp8 caches (x = 16): chunk c of head h is 16 input elements
// of type In, quantised with the per-tensor scales (read from device memory), then one 16-byte
// key store and 16 byte stores into the transposed value layout. kVec: 16-byte input loads (the
// input strides and addresses, and the key cache, are 16-byte aligned); otherwise scalar.
template <typename In, __nv_fp8_interpretation_t kFmt, bool kVec>
__global__ void reshape_and_cache_fp8_kernel(const __grid_constant__ CacheWriteParams p) {
  constexpr int X = 16;
  constexpr int kInX = Elem<In>::kX;  // input elements per 16-byte load
  const int D = p.head_size;
  const int bs = p.block_size;
  const int nch = D / X;
  const int n = p.num_kv_heads * nch;
  const In* key = static_cast<const In*>(p.key);
  const In* value = static_cast<const In*>(p.value);
  uint8_t* kc = static_cast<uint8_t*>(p.key_cache);
  uint8_t* vc = static_cast<uint8_t*>(p.value_cache);
  const float ks = __ldg(p.k_scale);
  const float vs = __ldg(p.v_scale);
  for (int64_t i = blockIdx.x; i < p.num_tokens; i += gridDim.x) {
    const int64_t slot = p.slot_mapping[i * p.slot_stride];
    if (slot < 0 || slot >= p.num_slots) continue;  // CTA-uniform
    const int64_t blk = slot / bs;
    const int64_t off = slot - blk * bs;
    uint8_t* kd0 = kc + blk * p.kc_stride_block + off * X;
    uint8_t* vd0 = vc + blk * p.vc_stride_block + off;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
      const int h = c / nch;
      const int cc = c - h * nch;
      const In* ksrc = key + i * p.key_stride_tok + h * p.key_stride_head + cc * X;
      const In* vsrc = value + i * p.value_stride_tok + h * p.value_stride_head + cc * X;
      float kf[X], vf[X];
      if constexpr (kVec) {
#pragma unroll
        for (int j = 0; j < X / kInX; ++j) {
          float a[kInX], b[kInX];
          Elem<In>::unpack(ld_nc16(ksrc + j * kInX), a);
          Elem<In>::unpack(ld_nc16(vsrc + j * kInX), b);
#pragma unroll
          for (int e = 0; e < kInX; ++e) {
            kf[j * kInX + e] = a[e];
            vf[j * kInX + e] = b[e];
          }
        }
      } else {
#pragma unroll
        for (int j = 0; j < X; ++j) {
          kf[j] = Elem<In>::to_float(ksrc[j]);
          vf[j] = Elem<In>::to_float(vsrc[j]);
        }
      }
      uint32_t kw[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        kw[w] = to_fp8<kFmt>(div_rn(kf[4 * w], ks)) |
                (to_fp8<kFmt>(div_rn(kf[4 * w + 1], ks)) << 8) |
                (to_fp8<kFmt>(div_rn(kf[4 * w + 2], ks)) << 16) |
                (to_fp8<kFmt>(div_rn(kf[4 * w + 3], ks)) << 24);
      }
      // h*D*bs + cc*bs*x for the key chunk; h*D*bs + (cc*x + j)*bs for value element j.
      const int64_t rowbase = (static_cast<int64_t>(h) * D + cc * X) * bs;
      uint8_t* kd = kd0 + rowbase;
      uint8_t* vd = vd0 + rowbase;
      if constexpr (kVec) {
        *reinterpret_cast<uint4*>(kd) = make_uint4(kw[0], kw[1], kw[2], kw[3]);
      } else {
#pragma unroll
        for (int j = 0; j < X; ++j) kd[j] = static_cast<uint8_t>(kw[j / 4] >> (8 * (j % 4)));
      }
#pragma unroll
      for (int j = 0; j < X; ++j) {
        vd[static_cast<int64_t>(j) * bs] = static_cast<uint8_t>(to_fp8<kFmt>(div_rn(vf[j], vs)));
      }
    }
  }
}

template <typename In, __nv_fp8_interpretation_t kFmt>
cudaError_t launch_rac_fp8(const CacheWriteParams& p, unsigned grid, int threads,
                           cudaStream_t stream) {
  if (p.vectorized) {
    reshape_and_cache_fp8_kernel<In, kFmt, true><<<grid, threads, 0, stream>>>(p);
  } else {
    reshape_and_cache_fp8_kernel<In, kFmt, false><<<grid, threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <__nv_fp8_interpretation_t kFmt>
cudaError_t launch_rac_fp8_in(const CacheWriteParams& p, unsigned grid, int threads,
                              cudaStream_t stream) {
  switch (p.in_dtype) {
    case DType::F32: return launch_rac_fp8<float, kFmt>(p, grid, threads, stream);
    case DType::F16: return launch_rac_fp8<__half, kFmt>(p, grid, threads, stream);
    case DType::BF16: return launch_rac_fp8<__nv_bfloat16, kFmt>(p, grid, threads, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_fp8_write(const CacheWriteParams& p, cudaStream_t stream) {
  const int64_t chunks = static_cast<int64_t>(p.num_kv_heads) * (p.head_size / 16);
  int threads = static_cast<int>(((chunks + 31) / 32) * 32);
  threads = threads < 32 ? 32 : (threads > 256 ? 256 : threads);
  const int64_t max_grid = int64_t{1} << 20;
  const unsigned grid = static_cast<unsigned>(p.num_tokens < max_grid ? p.num_tokens : max_grid);
  switch (p.cache_dtype) {
    case DType::F8E4M3: return launch_rac_fp8_in<__NV_E4M3>(p, grid, threads, stream);
    case DType::F8E5M2: return launch_rac_fp8_in<__NV_E5M2>(p, grid, threads, stream);
    default: return cudaErrorInvalidValue;
  }
}

template <typename E>
cudaError_t launch_rac(const CacheWriteParams& p, cudaStream_t stream) {
  constexpr int X = 16 / sizeof(E);
  const int64_t chunks = static_cast<int64_t>(p.num_kv_heads) * (p.head_size / X);
  int threads = static_cast<int>(((chunks + 31) / 32) * 32);
  threads = threads < 32 ? 32 : (threads > 256 ? 256 : threads);
  const int64_t max_grid = int64_t{1} << 20;
  const unsigned grid = static_cast<unsigned>(p.num_tokens < max_grid ? p.num_tokens : max_grid);
  if (p.vectorized) {
    reshape_and_cache_kernel<E, true><<<grid, threads, 0, stream>>>(p);
  } else {
    reshape_and_cache_kernel<E, false><<<grid, threads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

// One CTA per (pair, layer, key|value): copies one block of one cache. The per-layer pointers
// are kernel arguments (read straight from parameter space thanks to __grid_constant__), so no
// host-to-device copy is needed for them. Pairs with an id out of [0, num_blocks) are skipped.
template <bool kVec>
__global__ void copy_blocks_kernel(const __grid_constant__ CopyBlocksParams p) {
  const int64_t pair = blockIdx.x;
  const int layer = blockIdx.y;
  const bool is_value = blockIdx.z != 0;
  const int64_t src = p.mapping[pair * p.map_stride0];
  const int64_t dst = p.mapping[pair * p.map_stride0 + p.map_stride1];
  if (src < 0 || src >= p.num_blocks || dst < 0 || dst >= p.num_blocks) return;
  char* base = is_value ? p.value_base[layer] : p.key_base[layer];
  const int64_t stride = is_value ? p.value_stride[layer] : p.key_stride[layer];
  const char* s = base + src * stride;
  char* d = base + dst * stride;
  if constexpr (kVec) {
    const int64_t n = p.block_bytes / 16;
    const uint4* s4 = reinterpret_cast<const uint4*>(s);
    uint4* d4 = reinterpret_cast<uint4*>(d);
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d4[i] = s4[i];
  } else {
    for (int64_t i = threadIdx.x; i < p.block_bytes; i += blockDim.x) d[i] = s[i];
  }
}

}  // namespace

cudaError_t launch_reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream) {
  if (p.num_tokens <= 0) return cudaSuccess;
  if (p.cache_dtype == DType::F8E4M3 || p.cache_dtype == DType::F8E5M2) {
    return launch_fp8_write(p, stream);
  }
  switch (p.elem_size) {
    case 2: return launch_rac<Carrier<2>::type>(p, stream);
    case 4: return launch_rac<Carrier<4>::type>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t launch_copy_blocks(const CopyBlocksParams& p, cudaStream_t stream) {
  if (p.num_pairs <= 0 || p.num_layers <= 0) return cudaSuccess;
  if (p.num_layers > kMaxCopyLayers) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(p.num_pairs), static_cast<unsigned>(p.num_layers), 2);
  if (p.vectorized) {
    copy_blocks_kernel<true><<<grid, 256, 0, stream>>>(p);
  } else {
    copy_blocks_kernel<false><<<grid, 256, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace paged::gpu
