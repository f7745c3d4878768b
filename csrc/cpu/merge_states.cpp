// CPU merge_attention_states: two partial attentions over disjoint key sets, (out_a, lse_a) and
// (out_b, lse_b), combined into the attention over their union, row by row (a row: one token's
// head). In fp32:
//   lse = log(e^lse_a + e^lse_b),  out = e^(lse_a - lse) out_a + e^(lse_b - lse) out_b.
// A side with lse = -inf saw no key: it contributes nothing, and its out is never read (it may
// hold anything, NaN included); both -inf gives zeros and -inf. A NaN lse on either side gives
// NaN (out and lse); a +inf lse gives lse +inf and out NaN (e^(inf - inf)), as torch's
// logaddexp and exp give (paged_ops/reference.py).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>

#include "checks.h"

namespace paged::cpu {
namespace {

using VecF = at::vec::Vectorized<float>;

struct Side {
  const char* out;  // row (0, 0), in bytes
  int64_t stride_tok, stride_head;  // elements
  const float* lse;
  int64_t lse_stride_tok, lse_stride_head;
};

Side side(const at::Tensor& out, const at::Tensor& lse) {
  return {static_cast<const char*>(out.data_ptr()), out.stride(0), out.stride(1),
          lse.data_ptr<float>(), lse.stride(0), lse.stride(1)};
}

// log(e^a + e^b) for a, b not both -inf: NaN if either is NaN, +inf if either is +inf.
float log_add_exp(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<float>::quiet_NaN();
  const float m = std::max(a, b);
  if (m == std::numeric_limits<float>::infinity()) return m;
  return m + std::log1p(std::exp(-std::fabs(a - b)));
}

// dst[0, D) = wa * a + wb * b in fp32, stored as T. A null side (lse -inf) is not read: it
// adds 0, whatever its out holds.
template <typename T>
void merge_row(const T* a, float wa, const T* b, float wb, T* dst, int64_t D) {
  const VecF va(wa), vb(wb);
  int64_t d = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; d + VecF::size() <= D; d += VecF::size()) {
      const VecF x = a != nullptr ? VecF::loadu(a + d) * va : VecF(0.f);
      const VecF y = b != nullptr ? VecF::loadu(b + d) * vb : VecF(0.f);
      (x + y).store(dst + d);
    }
  } else {
    using VecT = at::vec::Vectorized<T>;
    for (; d + VecT::size() <= D; d += VecT::size()) {
      VecF x0(0.f), x1(0.f), y0(0.f), y1(0.f);
      if (a != nullptr) {
        std::tie(x0, x1) = at::vec::convert_to_float<T>(VecT::loadu(a + d));
        x0 = x0 * va;
        x1 = x1 * va;
      }
      if (b != nullptr) {
        std::tie(y0, y1) = at::vec::convert_to_float<T>(VecT::loadu(b + d));
        y0 = y0 * vb;
        y1 = y1 * vb;
      }
      at::vec::convert_from_float<T>(x0 + y0, x1 + y1).store(dst + d);
    }
  }
  for (; d < D; ++d) {
    const float x = a != nullptr ? static_cast<float>(a[d]) * wa : 0.f;
    const float y = b != nullptr ? static_cast<float>(b[d]) * wb : 0.f;
    dst[d] = static_cast<T>(x + y);
  }
}

template <typename T>
void merge(const Side& A, const Side& B, T* out, float* lse, const MergeStatesDims& d) {
  const int64_t H = d.num_heads, D = d.head_size;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // About 16 Ki elements per task: the op is a pass over memory.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1));
  at::parallel_for(0, d.num_tokens * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t n = row / H, h = row % H;
      const float la = A.lse[n * A.lse_stride_tok + h * A.lse_stride_head];
      const float lb = B.lse[n * B.lse_stride_tok + h * B.lse_stride_head];
      const bool use_a = la != neg_inf, use_b = lb != neg_inf;
      const float l = use_a || use_b ? log_add_exp(la, lb) : neg_inf;
      lse[row] = l;
      const T* a = use_a ? reinterpret_cast<const T*>(A.out) + n * A.stride_tok + h * A.stride_head
                         : nullptr;
      const T* b = use_b ? reinterpret_cast<const T*>(B.out) + n * B.stride_tok + h * B.stride_head
                         : nullptr;
      merge_row(a, use_a ? std::exp(la - l) : 0.f, b, use_b ? std::exp(lb - l) : 0.f,
                out + row * D, D);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> merge_attention_states(const at::Tensor& out_a,
                                                          const at::Tensor& lse_a,
                                                          const at::Tensor& out_b,
                                                          const at::Tensor& lse_b) {
  const MergeStatesDims d = check_merge_attention_states(out_a, lse_a, out_b, lse_b);
  at::Tensor out = at::empty({d.num_tokens, d.num_heads, d.head_size}, out_a.options());
  at::Tensor lse = at::empty({d.num_tokens, d.num_heads}, lse_a.options());
  if (d.num_tokens == 0 || d.num_heads == 0) return {out, lse};
  const Side A = side(out_a, lse_a), B = side(out_b, lse_b);
  float* const l = lse.data_ptr<float>();
  switch (out_a.scalar_type()) {
    case at::kFloat: merge(A, B, out.data_ptr<float>(), l, d); break;
    case at::kHalf: merge(A, B, out.data_ptr<c10::Half>(), l, d); break;
    case at::kBFloat16: merge(A, B, out.data_ptr<c10::BFloat16>(), l, d); break;
    default: TORCH_CHECK(false, "out_a must be float32, float16 or bfloat16, got ",
                         out_a.scalar_type());
  }
  return {out, lse};
}

}  // namespace
}  // namespace paged::cpu

TORCH_LIBRARY_IMPL(paged, CPU, m) {
  m.impl("merge_attention_states", &paged::cpu::merge_attention_states);
}
