// merge_attention_states: two partial attentions over disjoint key sets, (out_a, lse_a) and
// (out_b, lse_b), into the attention over their union, in fp32:
//   M = max(lse_a, lse_b);  w_x = e^(lse_x - M) (0 when lse_x = -inf);  S = w_a + w_b
//   lse = M + log S;  out = (w_a out_a + w_b out_b) / S
// A side with lse = -inf is dropped by selection, never multiplied by a zero weight, so NaN in
// its out (e.g. an uninitialised or empty partial) cannot leak; both -inf give zeros and -inf.
// A NaN lse gives NaN, as log(e^a + e^b) does.
//
// One warp per (token, head) row, grid-stride over rows; the lanes stride over the row's
// head_size elements, in 16-byte chunks when every row of out_a / out_b / out is 16-byte aligned.
#include <cstdint>

#include "cuda/common.cuh"
#include "cuda/launch.cuh"

namespace paged::gpu {
namespace {

constexpr int kMergeThreads = 128;
constexpr int kMergeWarps = kMergeThreads / 32;
constexpr int64_t kMergeMaxCtas = int64_t{1} << 20;  // grid-stride beyond this

template <typename T, bool kVec>
__global__ void __launch_bounds__(kMergeThreads)
    merge_states_kernel(const __grid_constant__ MergeStatesParams p) {
  constexpr int kN = 16 / static_cast<int>(sizeof(T));  // elements per 16-byte chunk
  const int lane = threadIdx.x & 31;
  const int64_t rows = p.num_tokens * p.num_heads;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kMergeWarps;
  const int D = p.head_size;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * kMergeWarps + (threadIdx.x >> 5); r < rows;
       r += step) {
    const int64_t n = r / p.num_heads;
    const int64_t h = r - n * p.num_heads;
    const float la = p.lse_a[n * p.la_stride_tok + h * p.la_stride_head];
    const float lb = p.lse_b[n * p.lb_stride_tok + h * p.lb_stride_head];
    const bool has_nan = isnan(la) || isnan(lb);
    const float M = has_nan ? NAN : fmaxf(la, lb);
    const bool use_a = la != -INFINITY;  // false for both when M = -inf
    const bool use_b = lb != -INFINITY;
    float wa = 0.f, wb = 0.f, lse = -INFINITY;
    if (has_nan) {
      wa = wb = lse = NAN;
    } else if (M != -INFINITY) {
      // Precise expf / log1pf: once per row, and lse feeds later merges.
      wa = use_a ? expf(la - M) : 0.f;
      wb = use_b ? expf(lb - M) : 0.f;
      // The larger weight is e^0 = 1: log(wa + wb) = log1p(the smaller one).
      lse = M == INFINITY ? INFINITY : M + log1pf(fminf(wa, wb));
      const float inv = 1.f / (wa + wb);
      wa *= inv;
      wb *= inv;
    }
    if (lane == 0) p.lse[r] = lse;
    const T* a = static_cast<const T*>(p.out_a) + n * p.a_stride_tok + h * p.a_stride_head;
    const T* b = static_cast<const T*>(p.out_b) + n * p.b_stride_tok + h * p.b_stride_head;
    T* o = static_cast<T*>(p.out) + r * D;
    if constexpr (kVec) {
      for (int c = lane * kN; c < D; c += 32 * kN) {
        float fa[kN], fb[kN];
        if (use_a) {
          Elem<T>::unpack(*reinterpret_cast<const uint4*>(a + c), fa);
        }
        if (use_b) {
          Elem<T>::unpack(*reinterpret_cast<const uint4*>(b + c), fb);
        }
        alignas(16) T res[kN];
#pragma unroll
        for (int i = 0; i < kN; ++i) {
          float v = 0.f;
          if (use_a) v = wa * fa[i];
          if (use_b) v = fmaf(wb, fb[i], v);
          res[i] = Elem<T>::from_float(v);
        }
        *reinterpret_cast<uint4*>(o + c) = *reinterpret_cast<const uint4*>(res);
      }
    } else {
      for (int c = lane; c < D; c += 32) {
        float v = 0.f;
        if (use_a) v = wa * Elem<T>::to_float(a[c]);
        if (use_b) v = fmaf(wb, Elem<T>::to_float(b[c]), v);
        o[c] = Elem<T>::from_float(v);
      }
    }
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

template <typename T>
cudaError_t launch_typed(const MergeStatesParams& p, int64_t ctas, cudaStream_t stream) {
  constexpr int64_t es = sizeof(T);
  const bool vec = (p.head_size * es) % 16 == 0 && aligned16(p.out_a) && aligned16(p.out_b) &&
                   aligned16(p.out) && (p.a_stride_tok * es) % 16 == 0 &&
                   (p.a_stride_head * es) % 16 == 0 && (p.b_stride_tok * es) % 16 == 0 &&
                   (p.b_stride_head * es) % 16 == 0;
  const dim3 grid(static_cast<unsigned>(ctas));
  if (vec) {
    merge_states_kernel<T, true><<<grid, kMergeThreads, 0, stream>>>(p);
  } else {
    merge_states_kernel<T, false><<<grid, kMergeThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_merge_states(const MergeStatesParams& p, cudaStream_t stream) {
  const int64_t rows = p.num_tokens * p.num_heads;
  if (rows <= 0) return cudaSuccess;
  int64_t ctas = (rows + kMergeWarps - 1) / kMergeWarps;
  if (ctas > kMergeMaxCtas) ctas = kMergeMaxCtas;
  switch (p.dtype) {
    case DType::F32: return launch_typed<float>(p, ctas, stream);
    case DType::F16: return launch_typed<__half>(p, ctas, stream);
    case DType::BF16: return launch_typed<__nv_bfloat16>(p, ctas, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace paged::gpu
