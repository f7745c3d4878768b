// What the CPU and CUDA op wrappers copy from checked attention arguments into their kernels'
// parameter structs (cpu/kernels.h, cuda/launch.cuh): one copy of the tensor-to-field mapping,
// so the two backends cannot drift apart. Backend-specific fields (fp8 scales as host values
// or device pointers, the work split, clamps) stay with each backend.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "checks.h"
#include "dtype.h"

namespace paged {

// The kernels' element type of a checked query / output / cache dtype.
inline DType kernel_dtype(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kFloat8_e4m3fn: return DType::F8E4M3;
    case at::kFloat8_e5m2: return DType::F8E5M2;
    default: TORCH_CHECK(false, "unsupported dtype ", t);  // unreachable after the checks
  }
}

// Pointers, strides, sizes, scalars and dtypes of paged::attention / attention_out, after
// check_attention (d is its result). Sizes are narrowed to the struct's own field types.
template <typename Params>
void set_attention_args(Params& p, at::Tensor& out, const AttentionArgs& a,
                        const AttentionDims& d) {
  const auto& [query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes,
               sliding_window, logits_soft_cap, k_scale, v_scale, max_seq_len,
               query_start_loc, causal] = a;
  using Size = decltype(p.num_heads);
  p.out = out.data_ptr();
  p.out_stride_seq = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.query = query.data_ptr();
  p.q_stride_seq = query.stride(0);
  p.q_stride_head = query.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.k_stride_block = key_cache.stride(0);
  p.v_stride_block = value_cache.stride(0);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.bt_stride_seq = block_tables.stride(0);
  p.bt_stride_col = block_tables.stride(1);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.sl_stride = seq_lens.stride(0);
  p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  p.alibi_stride = alibi_slopes.has_value() ? alibi_slopes->stride(0) : 0;
  p.num_seqs = d.num_seqs;
  p.num_tokens = d.num_tokens;
  p.num_heads = static_cast<Size>(d.num_heads);
  p.num_kv_heads = static_cast<Size>(d.cache.num_kv_heads);
  p.head_size = static_cast<Size>(d.cache.head_size);
  p.block_size = static_cast<Size>(d.cache.block_size);
  p.scale = static_cast<float>(scale);
  p.logits_soft_cap = static_cast<float>(logits_soft_cap);
  p.sliding_window = sliding_window;
  p.dtype = kernel_dtype(query.scalar_type());
  p.cache_dtype = kernel_dtype(key_cache.scalar_type());
  p.causal = causal;
}

}  // namespace paged
