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
