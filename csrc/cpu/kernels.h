// Plain-pointer interface between the CPU op wrappers (ops_cpu.cpp, which check and unpack the
// tensors) and the attention kernel, which is compiled once per CPU capability (DEFAULT inside
// _C; AVX2, AVX-512, AVX-512 with BF16 dot products and with AMX as separate shared objects, see
// setup.py and docs/cpu_kernel.md). Nothing here includes torch's tensor headers, so a capability variant
// compiles fast and shares no torch inline code with _C.
#pragma once

#include <cstdint>

#include "dtype.h"

namespace paged::cpu {

using paged::DType;

// Kernel knobs of a tuned plan (paged_ops/_plans.py), run-time values: 0 in a field leaves the
// choice to the rules (attention/layout.h). A forced path is taken only where it is valid for
// the call, else the rules choose; AMX runs only where neither path is forced to another one.
struct KernelPlan {
  int32_t qk_path;   // 0, or 1 + QkPath (attention/layout.h)
  int32_t pv_path;   // 0, or 1 + PvPath
  int32_t group;     // 0, or blocks per softmax step (at most kGroup)
  int32_t prefetch;  // 0, or 1: no prefetches of the next step's blocks, 2: the next step's
  // 0, or 1: every key line of the next step's blocks asked for over q.k, 2: the rules' split
  // (Layout::split_keys)
  int32_t split_keys;
};

// What the rules and a plan make of a call (KernelTable::describe, for paged_ops.cpu_plan and
// the tuner): the paths taken, and which paths a plan may force (bit i: path i is honoured).
struct PlanInfo {
  int32_t qk_path, pv_path;    // QkPath, PvPath taken
  int32_t group;               // blocks per softmax step
  int32_t staged_block_size;   // the block size read when cache blocks are staged; else 0
  uint32_t qk_valid, pv_valid;
  int32_t split_keys;          // Layout::split_keys
};

struct AttentionParams {
  void* out;  // [num_tokens, num_heads, head_size], last dim contiguous
  int64_t out_stride_seq, out_stride_head;
  const void* query;  // [num_tokens, num_heads, head_size], last dim contiguous
  int64_t q_stride_seq, q_stride_head;
  const void* key_cache;  // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  const void* value_cache;  // [num_blocks, num_kv_heads, head_size, block_size]
  int64_t k_stride_block, v_stride_block;  // dim-0 strides (elements); inner dims are dense
  const int32_t* block_tables;
  int64_t bt_stride_seq, bt_stride_col;
  const int32_t* seq_lens;
  int64_t sl_stride;
  const float* alibi_slopes;  // null when absent
  int64_t alibi_stride;
  // Several query tokens per sequence: sequence s owns query rows [qsl[s], qsl[s + 1]), its
  // last positions. Null for decode (one row per sequence).
  const int32_t* query_start_loc;
  int64_t num_seqs, num_tokens, num_heads, num_kv_heads, head_size, block_size, x;
  float scale;
  float logits_soft_cap;   // <= 0: off
  int64_t sliding_window;  // <= 0: off
  float k_scale, v_scale;  // fp8 caches: real value = stored * scale (1 otherwise)
  int64_t num_threads;     // at::get_num_threads() of the caller, for the split heuristic
  DType dtype;             // query / output
  DType cache_dtype;
  // attention_with_lse: fp32 [num_tokens, num_heads], contiguous, the natural-log log-sum-exp
  // of each row's final logits (-inf for a row that sees no position); null otherwise.
  float* lse = nullptr;
  bool causal = true;  // false: every query row of a sequence sees all seq_len positions
  // A tuned plan's knobs (ops_cpu.cpp looks the call's plan up; zeros: the rules decide).
  KernelPlan plan;
};

struct KernelTable {
  int32_t abi_version;  // kKernelAbiVersion; guards against a stale variant library
  const char* name;     // "default", "avx2", "avx512", "avx512_bf16"
  void (*attention)(const AttentionParams&);
  // Tuned plans: the paths and group a call of these parameters takes (no data is read).
  void (*describe)(const AttentionParams&, PlanInfo*);
};

constexpr int32_t kKernelAbiVersion = 5;

}  // namespace paged::cpu

// Exported by each capability variant library; _C keeps its default table internal
// (builds/table.cpp) and takes a variant's through paged_ops_set_cpu_kernel_table.
extern "C" const paged::cpu::KernelTable* paged_ops_cpu_kernel_table();
