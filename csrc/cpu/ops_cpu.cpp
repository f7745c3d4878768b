// CPU attention / attention_out: argument checks (checks.h, including the index checks that
// read block ids and lengths), then the kernel, through a kernel table that
// paged_ops/__init__.py may switch to a faster CPU-capability build (kernels.h). The cache ops
// (reshape_and_cache, copy_blocks, swap_blocks) are in cache_ops.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <atomic>

#include "attention_args.h"
#include "checks.h"
#include "cpu/kernels.h"

namespace paged::cpu {

const KernelTable* default_kernel_table();  // kernels_default.cpp

namespace {

std::atomic<const KernelTable*> g_kernels{nullptr};

const KernelTable* kernels() {
  const KernelTable* t = g_kernels.load(std::memory_order_acquire);
  return t ? t : default_kernel_table();
}

void attention_into(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, double scale,
                    const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                    double logits_soft_cap, const std::optional<at::Tensor>& k_scale,
                    const std::optional<at::Tensor>& v_scale,
                    const std::optional<at::Tensor>& query_start_loc, const AttentionDims& d) {
  if (d.num_seqs == 0 || d.num_tokens == 0) return;
  AttentionParams p{};
  set_attention_args(p, out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                     alibi_slopes, sliding_window, logits_soft_cap, d);
  // query_start_loc is small and read on every item: a contiguous copy (a no-op if it is one).
  at::Tensor qsl;
  if (query_start_loc.has_value()) qsl = query_start_loc->contiguous();
  p.query_start_loc = qsl.defined() ? qsl.data_ptr<int32_t>() : nullptr;
  p.x = d.cache.x;
  const bool fp8 = is_fp8(key_cache.scalar_type());
  p.k_scale = fp8 ? host_scale(*k_scale) : 1.f;
  p.v_scale = fp8 ? host_scale(*v_scale) : 1.f;
  p.num_threads = at::get_num_threads();
  kernels()->attention(p);
}

at::Tensor attention(const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, double scale,
                     const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                     double logits_soft_cap, const std::optional<at::Tensor>& k_scale,
                     const std::optional<at::Tensor>& v_scale, std::optional<int64_t> max_seq_len,
                     const std::optional<at::Tensor>& query_start_loc) {
  const AttentionDims d =
      check_attention(Backend::CPU, nullptr, query, key_cache, value_cache, block_tables,
                      seq_lens, scale, alibi_slopes, sliding_window, logits_soft_cap, k_scale,
                      v_scale, max_seq_len, query_start_loc);
  check_attention_indices_cpu(d, block_tables, seq_lens, max_seq_len, query_start_loc);
  at::Tensor out = at::empty(query.sizes(), query.options());
  attention_into(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                 alibi_slopes, sliding_window, logits_soft_cap, k_scale, v_scale,
                 query_start_loc, d);
  return out;
}

void attention_out(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                   const at::Tensor& value_cache, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, double scale,
                   const std::optional<at::Tensor>& alibi_slopes, int64_t sliding_window,
                   double logits_soft_cap, const std::optional<at::Tensor>& k_scale,
                   const std::optional<at::Tensor>& v_scale, std::optional<int64_t> max_seq_len,
                   const std::optional<at::Tensor>& query_start_loc) {
  const AttentionDims d =
      check_attention(Backend::CPU, &out, query, key_cache, value_cache, block_tables, seq_lens,
                      scale, alibi_slopes, sliding_window, logits_soft_cap, k_scale, v_scale,
                      max_seq_len, query_start_loc);
  check_attention_indices_cpu(d, block_tables, seq_lens, max_seq_len, query_start_loc);
  attention_into(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                 alibi_slopes, sliding_window, logits_soft_cap, k_scale, v_scale,
                 query_start_loc, d);
}

}  // namespace

}  // namespace paged::cpu

// Switch the attention kernel to a capability variant (called once from paged_ops/__init__.py
// through ctypes); null restores the built-in default kernel. Returns 0 on success, -1 if the
// table is from an incompatible build.
extern "C" __attribute__((visibility("default"))) int paged_ops_set_cpu_kernel_table(
    const paged::cpu::KernelTable* table) {
  if (table != nullptr && table->abi_version != paged::cpu::kKernelAbiVersion) return -1;
  paged::cpu::g_kernels.store(table, std::memory_order_release);
  return 0;
}

extern "C" __attribute__((visibility("default"))) const char* paged_ops_cpu_kernel_name() {
  return paged::cpu::kernels()->name;
}

TORCH_LIBRARY_IMPL(paged, CPU, m) {
  m.impl("attention", &paged::cpu::attention);
  m.impl("attention_out", &paged::cpu::attention_out);
}
