// CPU attention / attention_out: the shared op entry (attention_op.h: checks, output), the index
// checks that read block ids and lengths, then the kernel, through a kernel table that
// paged_ops/__init__.py may switch to a faster CPU-capability build (kernels.h). The cache ops
// (reshape_and_cache, copy_blocks, swap_blocks) are in cache_ops.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

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

// --- Tuned plans (paged_ops/_plans.py installs them through paged_ops_set_cpu_plans) ---
// A plan for the calls of one key: the build that runs them (null: the cell's) and the kernel's
// knobs. The C layout is shared with paged_ops/_plans.py (ctypes).
struct PlanEntry {
  int32_t cache_dtype, block_size, head_size, group, dtype;  // the key (DType codes; group:
                                                             // query heads per kv head)
  int32_t reserved;
  const KernelTable* table;
  KernelPlan knobs;
};
// Per (cache dtype, block size) the plans of that cell (a few head sizes, groups and query
// dtypes), immutable once published: a call finds its plan by one load and a short scan.
// Replaced lists stay allocated (a call may still read one); installs are rare.
struct CellPlans {
  std::vector<PlanEntry> entries;
};
std::atomic<const CellPlans*> g_plans[kCacheDTypes][kMaxCellBlockSize + 1] = {};
std::mutex g_plans_mutex;
std::vector<std::unique_ptr<CellPlans>> g_plans_store;  // every list ever published

const PlanEntry* find_plan(const AttentionParams& p) {
  const int d = static_cast<int>(p.cache_dtype);
  if (p.block_size < 1 || p.block_size > kMaxCellBlockSize || d < 0 || d >= kCacheDTypes)
    return nullptr;
  const CellPlans* cell = g_plans[d][p.block_size].load(std::memory_order_acquire);
  if (cell == nullptr) return nullptr;
  const int64_t group = p.num_heads / p.num_kv_heads;
  for (const PlanEntry& e : cell->entries)
    if (e.head_size == p.head_size && e.group == group && e.dtype == static_cast<int>(p.dtype))
      return &e;
  return nullptr;
}

// PAGED_OPS_AUTOTUNE=1 (paged_ops/_plans.py, through ctypes): called for a call whose key has no
// plan, with the key (DType codes; block size 1-256); it installs one (tuned, or the rules'
// own: zero knobs), so each key reaches it once.
using AutotuneHook = void (*)(int32_t dtype, int32_t cache_dtype, int64_t block_size,
                              int64_t head_size, int64_t num_heads, int64_t num_kv_heads);
std::atomic<AutotuneHook> g_autotune{nullptr};

// The CPU part of attention / attention_out (attention_op.h): the index checks, then the kernel.
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
  const KernelTable* table = kernels(d.cache.block_size, p.cache_dtype);
  const PlanEntry* e = find_plan(p);
  if (e == nullptr && p.block_size <= kMaxCellBlockSize) {
    if (AutotuneHook hook = g_autotune.load(std::memory_order_acquire)) {
      hook(static_cast<int32_t>(p.dtype), static_cast<int32_t>(p.cache_dtype), p.block_size,
           p.head_size, p.num_heads, p.num_kv_heads);
      e = find_plan(p);
    }
  }
  if (e != nullptr) {
    p.plan = e->knobs;
    if (e->table != nullptr) table = e->table;
  }
  table->attention(p);
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

// Replaces the tuned plans by `n` entries (paged::cpu::PlanEntry; n = 0 drops them all); a
// later entry of the same key wins. Returns 0, -1 for a table from an incompatible build
// (nothing changed), -2 for a key out of range (nothing changed).
extern "C" __attribute__((visibility("default"))) int paged_ops_set_cpu_plans(
    const paged::cpu::PlanEntry* entries, int64_t n) {
  using namespace paged::cpu;
  for (int64_t i = 0; i < n; ++i) {
    const PlanEntry& e = entries[i];
    if (e.table != nullptr && e.table->abi_version != kKernelAbiVersion) return -1;
    if (e.block_size < 1 || e.block_size > kMaxCellBlockSize || e.cache_dtype < 0 ||
        e.cache_dtype >= kCacheDTypes || e.head_size < 1 || e.group < 1 || e.dtype < 0 ||
        e.dtype >= kCacheDTypes)
      return -2;
  }
  std::lock_guard<std::mutex> lock(g_plans_mutex);
  std::vector<std::unique_ptr<CellPlans>> cells(kCacheDTypes * (kMaxCellBlockSize + 1));
  for (int64_t i = 0; i < n; ++i) {
    const PlanEntry& e = entries[i];
    auto& cell = cells[e.cache_dtype * (kMaxCellBlockSize + 1) + e.block_size];
    if (!cell) cell = std::make_unique<CellPlans>();
    auto same = [&](const PlanEntry& o) {
      return o.head_size == e.head_size && o.group == e.group && o.dtype == e.dtype;
    };
    std::erase_if(cell->entries, same);
    cell->entries.push_back(e);
  }
  for (int d = 0; d < kCacheDTypes; ++d)
    for (int64_t b = 0; b <= kMaxCellBlockSize; ++b) {
      auto& cell = cells[d * (kMaxCellBlockSize + 1) + b];
      g_plans[d][b].store(cell.get(), std::memory_order_release);
      if (cell) g_plans_store.push_back(std::move(cell));
    }
  return 0;
}

// Sets the PAGED_OPS_AUTOTUNE hook (null: none).
extern "C" __attribute__((visibility("default"))) void paged_ops_set_cpu_autotune_hook(
    paged::cpu::AutotuneHook hook) {
  paged::cpu::g_autotune.store(hook, std::memory_order_release);
}

// What a call of these sizes takes on `table` (null: the built-in default kernel) with the
// knobs `knobs` (null: the rules): paths, group and the paths a plan may force (PlanInfo).
// Decode (multi_token = 0) or several query tokens per sequence. Returns 0, -1 for a table
// from an incompatible build, -2 for sizes out of range.
extern "C" __attribute__((visibility("default"))) int paged_ops_describe_cpu_plan(
    const paged::cpu::KernelTable* table, int32_t dtype, int32_t cache_dtype, int64_t block_size,
    int64_t head_size, int64_t num_heads, int64_t num_kv_heads, int32_t multi_token,
    const paged::cpu::KernelPlan* knobs, paged::cpu::PlanInfo* info) {
  using namespace paged::cpu;
  if (table == nullptr) table = default_kernel_table();
  if (table->abi_version != kKernelAbiVersion) return -1;
  if (dtype < 0 || dtype > static_cast<int32_t>(paged::DType::BF16) || cache_dtype < 0 ||
      cache_dtype >= kCacheDTypes || block_size < 1 || num_kv_heads < 1 ||
      num_heads % num_kv_heads != 0 || num_heads < 1 || head_size < 1)
    return -2;
  const int64_t x = 16 / paged::dtype_size(static_cast<paged::DType>(cache_dtype));
  if (head_size % x != 0) return -2;
  static const int32_t qsl[2] = {0, 1};
  AttentionParams p{};
  p.num_seqs = p.num_tokens = 1;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_size = head_size;
  p.block_size = block_size;
  p.x = x;
  p.scale = p.k_scale = p.v_scale = 1.f;
  p.num_threads = 1;
  p.dtype = static_cast<paged::DType>(dtype);
  p.cache_dtype = static_cast<paged::DType>(cache_dtype);
  p.query_start_loc = multi_token ? qsl : nullptr;
  if (knobs != nullptr) p.plan = *knobs;
  table->describe(p, info);
  return 0;
}

// The built-in default kernel's table, for plans that name it.
extern "C" __attribute__((visibility("default"))) const paged::cpu::KernelTable*
paged_ops_cpu_default_kernel_table() {
  return paged::cpu::default_kernel_table();
}

// kKernelAbiVersion of this build (plan files record it: plans of another kernel are stale).
extern "C" __attribute__((visibility("default"))) int32_t paged_ops_cpu_kernel_abi() {
  return paged::cpu::kKernelAbiVersion;
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
