// The attention / attention_out / attention_with_lse ops of one backend (csrc/cpu/ops_cpu.cpp,
// csrc/cuda/ops_cuda.cpp): the shared checks (checks.h), the outputs, then the backend's run
// function, which gets the arguments in one struct.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <tuple>

#include "checks.h"

namespace paged {

// The backend's part, after check_attention (d is its result) with `out` allocated (attention,
// attention_with_lse) or given (attention_out): its own checks first (nothing is written before
// them), then the kernels. lse: fp32 [num_tokens, num_heads], contiguous, to be filled with each
// row's log-sum-exp (attention_with_lse); null for the other two ops.
using AttentionRun = void (*)(at::Tensor& out, at::Tensor* lse, const AttentionArgs& a,
                              const AttentionDims& d);

// The ops' functions for m.impl: their parameter lists are the schemas' (ops.cpp).
template <Backend kBackend, AttentionRun kRun>
struct AttentionOp {
  static at::Tensor attention(const at::Tensor& query, const at::Tensor& key_cache,
                              const at::Tensor& value_cache, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, double scale,
                              const std::optional<at::Tensor>& alibi_slopes,
                              int64_t sliding_window, double logits_soft_cap,
                              const std::optional<at::Tensor>& k_scale,
                              const std::optional<at::Tensor>& v_scale,
                              std::optional<int64_t> max_seq_len,
                              const std::optional<at::Tensor>& query_start_loc, bool causal) {
    const AttentionArgs a{query,        key_cache,      value_cache,     block_tables, seq_lens,
                          scale,        alibi_slopes,   sliding_window,  logits_soft_cap,
                          k_scale,      v_scale,        max_seq_len,     query_start_loc,
                          causal};
    const AttentionDims d = check_attention(kBackend, nullptr, a);
    at::Tensor out = at::empty(query.sizes(), query.options());
    kRun(out, nullptr, a, d);
    return out;
  }

  static std::tuple<at::Tensor, at::Tensor> attention_with_lse(
      const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
      const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
      double logits_soft_cap, const std::optional<at::Tensor>& k_scale,
      const std::optional<at::Tensor>& v_scale, std::optional<int64_t> max_seq_len,
      const std::optional<at::Tensor>& query_start_loc, bool causal) {
    const AttentionArgs a{query,        key_cache,      value_cache,     block_tables, seq_lens,
                          scale,        alibi_slopes,   sliding_window,  logits_soft_cap,
                          k_scale,      v_scale,        max_seq_len,     query_start_loc,
                          causal};
    const AttentionDims d = check_attention(kBackend, nullptr, a);
    at::Tensor out = at::empty(query.sizes(), query.options());
    at::Tensor lse = at::empty({d.num_tokens, d.num_heads}, query.options().dtype(at::kFloat));
    kRun(out, &lse, a, d);
    return {out, lse};
  }

  static void attention_out(at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, const std::optional<at::Tensor>& alibi_slopes,
                            int64_t sliding_window, double logits_soft_cap,
                            const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale,
                            std::optional<int64_t> max_seq_len,
                            const std::optional<at::Tensor>& query_start_loc, bool causal) {
    const AttentionArgs a{query,        key_cache,      value_cache,     block_tables, seq_lens,
                          scale,        alibi_slopes,   sliding_window,  logits_soft_cap,
                          k_scale,      v_scale,        max_seq_len,     query_start_loc,
                          causal};
    const AttentionDims d = check_attention(kBackend, &out, a);
    kRun(out, nullptr, a, d);
  }
};

}  // namespace paged
