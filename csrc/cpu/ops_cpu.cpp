// CPU attention / attention_out: the shared op entry (attention_op.h: checks, output), the index
// checks that read block ids and lengths, then the kernel, through a kernel table that
// paged_ops/__init__.py may switch to a faster CPU-capability build (kernels.h). The cache ops
// (reshape_and_cache, copy_blocks, swap_blocks) are in cache_ops.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>

#include "attention_args.h"
#include "attention_op.h"
#include "checks.h"
#include "cpu/kernels.h"
#include "cuda_sizes.h"

namespace paged::cpu {

const KernelTable* default_kernel_table();  // builds/table.cpp

namespace {

std::atomic<const KernelTable*> g_kernels{nullptr};
// Per (cache dtype, block size) the build that runs such calls instead of g_kernels (null:
// g_kernels): on a CPU where builds lead at different block sizes and cache dtypes, each runs
// where it measured faster (docs/cpu_kernel_selection.md). Block sizes above
// kMaxCellBlockSize always run on g_kernels. Cleared by paged_ops_set_cpu_kernel_table.
constexpr int64_t kMaxCellBlockSize = 256;
constexpr int kCacheDTypes = static_cast<int>(DType::F8E5M2) + 1;
std::atomic<const KernelTable*> g_cells[kCacheDTypes][kMaxCellBlockSize + 1] = {};

const KernelTable* kernels() {
  const KernelTable* t = g_kernels.load(std::memory_order_acquire);
  return t ? t : default_kernel_table();
}

const KernelTable* kernels(int64_t block_size, DType cache_dtype) {
  const int d = static_cast<int>(cache_dtype);
  if (block_size >= 1 && block_size <= kMaxCellBlockSize && d >= 0 && d < kCacheDTypes) {
    const KernelTable* t = g_cells[d][block_size].load(std::memory_order_acquire);
    if (t != nullptr) return t;
  }
  return kernels();
}

// The CPU part of attention / attention_out / attention_with_lse (attention_op.h): the index
// checks, then the kernel.
void run_attention(at::Tensor& out, at::Tensor* lse, const AttentionArgs& a,
                   const AttentionDims& d) {
  check_attention_indices_cpu(d, a);
  if (d.num_seqs == 0 || d.num_tokens == 0) return;
  AttentionParams p{};
  set_attention_args(p, out, a, d);
  // query_start_loc is small and read on every item: a contiguous copy (a no-op if it is one).
  at::Tensor qsl;
  if (a.query_start_loc.has_value()) qsl = a.query_start_loc->contiguous();
  p.query_start_loc = qsl.defined() ? qsl.data_ptr<int32_t>() : nullptr;
  p.x = d.cache.x;
  const bool fp8 = is_fp8(a.key_cache.scalar_type());
  p.k_scale = fp8 ? host_scale(*a.k_scale) : 1.f;
  p.v_scale = fp8 ? host_scale(*a.v_scale) : 1.f;
  p.num_threads = at::get_num_threads();
  p.lse = lse != nullptr ? lse->data_ptr<float>() : nullptr;
  kernels(d.cache.block_size, p.cache_dtype)->attention(p);
}

using Op = AttentionOp<Backend::CPU, &run_attention>;

}  // namespace

}  // namespace paged::cpu

// Switch the attention kernel to a capability variant (called from paged_ops/__init__.py
// through ctypes); null restores the built-in default kernel. Sets the one kernel build run by
// calls of every block size and cache dtype. Returns 0 on success, -1 if the table is from an
// incompatible build.
extern "C" __attribute__((visibility("default"))) int paged_ops_set_cpu_kernel_table(
    const paged::cpu::KernelTable* table) {
  if (table != nullptr && table->abi_version != paged::cpu::kKernelAbiVersion) return -1;
  for (auto& by_size : paged::cpu::g_cells)
    for (auto& cell : by_size) cell.store(nullptr, std::memory_order_release);
  paged::cpu::g_kernels.store(table, std::memory_order_release);
  return 0;
}

// After paged_ops_set_cpu_kernel_table: calls of block size `block_size` (1-256) with a cache
// of DType `cache_dtype` run on `table` instead (null: the built-in default kernel). Returns
// 0, -1 for a table from an incompatible build, -2 for a block size or dtype out of range.
extern "C" __attribute__((visibility("default"))) int paged_ops_set_cpu_cell_kernel_table(
    const paged::cpu::KernelTable* table, int64_t block_size, int32_t cache_dtype) {
  if (table != nullptr && table->abi_version != paged::cpu::kKernelAbiVersion) return -1;
  if (block_size < 1 || block_size > paged::cpu::kMaxCellBlockSize || cache_dtype < 0 ||
      cache_dtype >= paged::cpu::kCacheDTypes)
    return -2;
  paged::cpu::g_cells[cache_dtype][block_size].store(
      table ? table : paged::cpu::default_kernel_table(), std::memory_order_release);
  return 0;
}

// The kernel build that runs calls of block size `block_size` with a cache of DType
// `cache_dtype` (block_size 0: the one for large blocks).
extern "C" __attribute__((visibility("default"))) const char* paged_ops_cpu_kernel_name(
    int64_t block_size, int32_t cache_dtype) {
  if (block_size <= 0 || cache_dtype < 0 ||
      cache_dtype > static_cast<int32_t>(paged::DType::F8E5M2))
    return paged::cpu::kernels()->name;
  return paged::cpu::kernels(block_size, static_cast<paged::DType>(cache_dtype))->name;
}

// The head sizes (which = 0) or block sizes (which = 1) of cuda_sizes.h, for the tests (through
// ctypes): their count, the values in *values. -1 for another `which`.
extern "C" __attribute__((visibility("default"))) int paged_ops_cuda_sizes(int which,
                                                                        const int** values) {
  if (which == 0) {
    *values = paged::CudaHeadSizes::values;
    return paged::CudaHeadSizes::size;
  }
  if (which == 1) {
    *values = paged::CudaBlockSizes::values;
    return paged::CudaBlockSizes::size;
  }
  return -1;
}

TORCH_LIBRARY_IMPL(paged, CPU, m) {
  m.impl("attention", &paged::cpu::Op::attention);
  m.impl("attention_out", &paged::cpu::Op::attention_out);
  m.impl("attention_with_lse", &paged::cpu::Op::attention_with_lse);
}
