// The attention / attention_out ops of one backend (csrc/cpu/ops_cpu.cpp, csrc/cuda/ops_cuda.cpp):
// the shared checks (checks.h), the output, then the backend's run function, which gets the
// arguments in one struct.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>

#include "checks.h"

namespace paged {

// The backend's part, after check_attention (d is its result) with `out` allocated (attention)
// or given (attention_out): its own checks first (nothing is written before them), then the
// kernels.
using AttentionRun = void (*)(at::Tensor& out, const AttentionArgs& a, const AttentionDims& d);

// The two ops' functions for m.impl: their parameter lists are the schemas' (ops.cpp).
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
                              const std::optional<at::Tensor>& query_start_loc) {
    const AttentionArgs a{query,        key_cache,      value_cache,     block_tables, seq_lens,
                          scale,        alibi_slopes,   sliding_window,  logits_soft_cap,
                          k_scale,      v_scale,        max_seq_len,     query_start_loc};
    const AttentionDims d = check_attention(kBackend, nullptr, a);
    at::Tensor out = at::empty(query.sizes(), query.options());
    kRun(out, a, d);
    return out;
  }

  static void attention_out(at::Tensor& out, const at::Tensor& query,
                            const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            double scale, const std::optional<at::Tensor>& alibi_slopes,
                            int64_t sliding_window, double logits_soft_cap,
                            const std::optional<at::Tensor>& k_scale,
                            const std::optional<at::Tensor>& v_scale,
                            std::optional<int64_t> max_seq_len,
                            const std::optional<at::Tensor>& query_start_loc) {
    const AttentionArgs a{query,        key_cache,      value_cache,     block_tables, seq_lens,
                          scale,        alibi_slopes,   sliding_window,  logits_soft_cap,
                          k_scale,      v_scale,        max_seq_len,     query_start_loc};
    const AttentionDims d = check_attention(kBackend, &out, a);
    kRun(out, a, d);
  }
};

}  // namespace paged
