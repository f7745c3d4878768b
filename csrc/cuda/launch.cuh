// Plain-pointer interface between the CUDA op wrappers (ops_cuda.cpp: checks, device guard,
// stream, allocations) and the kernels (*.cu). Plain C++ with no device code: g++ compiles it in
// ops_cuda.cpp. No torch header here: the .cu files include only the CUDA headers and this,
// which keeps nvcc compile times low.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda_sizes.h"
#include "dtype.h"

namespace paged::gpu {

using paged::DType;

// ---------------------------------------------------------------------------------------------
// Decode attention
// ---------------------------------------------------------------------------------------------

constexpr int kAttnWarps = 4;                     // warps per CTA of the decode kernel
constexpr int kAttnThreads = kAttnWarps * 32;
constexpr int kTileTokens = 32;                   // tokens per warp step (one per lane in q.k)
constexpr int kPartitionUnit = kAttnWarps * kTileTokens;  // split-K partitions are multiples
constexpr int kMaxPartitions = 512;               // bound of the reduce kernel's weight buffer
constexpr int kReduceThreads = 128;
constexpr int kMaxGroupTile = 8;

// Largest group tile (query heads of one GQA group handled together by one CTA) the decode
// kernel is instantiated with for (element size, head size, block size). Bounds the per-lane
// fp32 output accumulators (gt * D * vectors_per_value_row / 32 <= 64 registers) and the CTA
// merge buffer (kAttnWarps * gt * D floats <= 16 KB). fp8 caches count as element size 2: the
// kernel reads their values 8 at a time, as many per lane as for a 16-bit cache
// (plan_elem_size).
constexpr int plan_elem_size(DType cache_dtype) {
  return cache_dtype == DType::F32 ? 4 : 2;
}

constexpr int max_group_tile(int elem_size, int head_size, int block_size) {
  const int vpr = block_size * elem_size / 16;  // 16-byte vectors per value row of a block
  int gt = kMaxGroupTile;
  while (gt > 1 && (gt * head_size * vpr > 2048 || gt * head_size > 1024)) gt /= 2;
  return gt;
}

struct AttentionParams {
  void* out;  // [num_seqs, num_heads, head_size], last dim contiguous
  int64_t out_stride_seq, out_stride_head;
  const void* query;  // [num_seqs, num_heads, head_size], last dim contiguous
  int64_t q_stride_seq, q_stride_head;
  const void* key_cache;    // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  const void* value_cache;  // [num_blocks, num_kv_heads, head_size, block_size]
  int64_t k_stride_block, v_stride_block;  // dim-0 strides (elements); inner dims dense
  const int32_t* block_tables;
  int64_t bt_stride_seq, bt_stride_col;
  const int32_t* seq_lens;
  int64_t sl_stride;
  const float* alibi_slopes;  // null when absent
  int64_t alibi_stride;
  int64_t num_seqs;
  int32_t num_heads, num_kv_heads, head_size, block_size;
  int64_t num_blocks;       // block ids outside [0, num_blocks) are never dereferenced
  float scale;
  float logits_soft_cap;    // <= 0: off
  int64_t sliding_window;   // <= 0: off
  int64_t max_len;          // seq_lens are clamped to [0, max_len] on the device
  // Work split (plan_attention).
  int32_t group_tile;       // query heads per CTA (power of two <= max_group_tile)
  int32_t num_tiles;        // CTAs per kv head along the GQA group
  int32_t num_partitions;   // split-K partitions per sequence (1: no reduce kernel)
  int64_t partition_tokens; // multiple of kPartitionUnit
  // Split-K scratch (num_partitions > 1): [num_seqs, num_heads, num_partitions] (x head_size).
  // Multi-token: [num_tokens, num_heads, num_partitions] (x head_size).
  float* tmp_out;  // unnormalised partial outputs, fp32 (times v_scale for fp8 caches)
  float* tmp_max;  // running max per partition (-inf: the partition saw nothing)
  float* tmp_sum;  // softmax denominator per partition, relative to its max
  DType dtype;        // query and output
  DType cache_dtype;  // == dtype, or an fp8 format
  // fp8 caches: one-element fp32 device tensors, read by the kernels (real = stored * scale);
  // null otherwise.
  const float* k_scale;
  const float* v_scale;
  // Several query tokens per sequence (null: decode): sequence s owns query rows
  // [qsl[s], qsl[s + 1]), clamped on the device to [0, num_tokens].
  const int32_t* query_start_loc;
  int64_t qsl_stride;
  int64_t num_tokens;        // query rows (num_seqs for decode)
  // Multi-token work split (plan_multi_token).
  int32_t mt_tokens_per_tile;  // query tokens of one sequence per CTA (TQ)
  int32_t mt_heads_per_tile;   // query heads of one GQA group per CTA (GH)
  int32_t mt_group_tiles;      // CTAs per kv head along the GQA group
  int64_t mt_virtual_tiles;    // grid.x: num_tokens / TQ + num_seqs (see multi_token.cuh)
  // attention_with_lse: fp32 [num_tokens, num_heads], contiguous, the natural-log log-sum-exp
  // of each row's final logits (-inf for a row that sees no position); null otherwise.
  float* lse = nullptr;
  bool causal = true;  // false: every query row of a sequence sees all seq_len positions
};

struct AttentionPlan {
  int32_t group_tile, num_tiles, num_partitions;
  int64_t partition_tokens;
};

// Work split from host-known sizes only (never from device data), so that a captured CUDA graph
// stays valid when seq_lens change in place. One CTA per (sequence, kv head, group tile,
// partition); partitions are added until the grid has about two CTAs per SM.
inline AttentionPlan plan_attention(int elem_size, int64_t num_seqs, int num_heads,
                                    int num_kv_heads, int head_size, int block_size,
                                    int64_t max_len, int num_sms) {
  AttentionPlan p{};
  const int group = num_heads / num_kv_heads;
  const int gt_max = max_group_tile(elem_size, head_size, block_size);
  p.num_tiles = (group + gt_max - 1) / gt_max;
  const int per_tile = (group + p.num_tiles - 1) / p.num_tiles;
  p.group_tile = 1;
  while (p.group_tile < per_tile) p.group_tile *= 2;
  const int64_t base = num_seqs * num_kv_heads * static_cast<int64_t>(p.num_tiles);
  const int64_t units = max_len > 0 ? (max_len + kPartitionUnit - 1) / kPartitionUnit : 1;
  const int64_t target = 2 * static_cast<int64_t>(num_sms > 0 ? num_sms : 1);
  int64_t parts = (target + base - 1) / base;
  if (parts > units) parts = units;
  if (parts > kMaxPartitions) parts = kMaxPartitions;
  if (parts < 1) parts = 1;
  const int64_t units_per_part = (units + parts - 1) / parts;
  p.partition_tokens = units_per_part * kPartitionUnit;
  p.num_partitions = static_cast<int32_t>((units + units_per_part - 1) / units_per_part);
  return p;
}

// Decode kernels, by cache dtype (query dtype = cache dtype; any query dtype for fp8 caches).
cudaError_t launch_attention_f32(const AttentionParams& p, cudaStream_t stream);
cudaError_t launch_attention_f16(const AttentionParams& p, cudaStream_t stream);
cudaError_t launch_attention_bf16(const AttentionParams& p, cudaStream_t stream);
cudaError_t launch_attention_e4m3(const AttentionParams& p, cudaStream_t stream);
cudaError_t launch_attention_e5m2(const AttentionParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Attention with several query tokens per sequence (multi_token.cuh)
// ---------------------------------------------------------------------------------------------

constexpr int kMultiThreads = 128;           // 4 warps
constexpr int kMultiKeyTile = 32;            // key positions per step
constexpr int kMultiPartitionUnit = 256;     // split-K partitions are multiples of this

// Query rows (tokens x heads of one GQA group) per CTA of the CUDA-core kernel: 16 per warp up
// to head size 128, 8 above (the per-lane output accumulators are 4 rows x head_size / 8 or / 16
// floats).
constexpr int multi_rows_per_cta(int head_size) { return head_size <= 128 ? 64 : 32; }

// The tensor-core kernel (multi_token_mma.cuh): 16 rows per warp, fp16 / bf16 queries (caches of
// the same dtype or fp8), head sizes that are multiples of 16.
constexpr int kMultiMmaRows = 64;
constexpr bool multi_token_mma_supported(DType query_dtype, int head_size) {
  return (query_dtype == DType::F16 || query_dtype == DType::BF16) && head_size % 16 == 0;
}

struct MultiTokenPlan {
  int32_t tokens_per_tile, heads_per_tile, group_tiles, num_partitions;
  int64_t virtual_tiles, partition_tokens;
};

// Work split from host-known sizes only. A CTA takes TQ consecutive query tokens of ONE sequence
// times GH heads of one GQA group (TQ * GH <= rows per CTA). Sequence s gets the "virtual tiles"
// [v(s), v(s + 1)) with v(s) = qsl[s] / TQ + s: at least ceil(q_len / TQ) of them whatever the
// q_lens (v(s + 1) - v(s) = floor(qsl[s + 1] / TQ) - floor(qsl[s] / TQ) + 1), so the grid
// num_tokens / TQ + num_seqs is known on the host and each CTA finds its sequence by a binary
// search over query_start_loc; the at most one or two surplus tiles per sequence exit at once.
// Partitions split the key range when the grid is small (few query tokens, long contexts).
inline MultiTokenPlan plan_multi_token(int64_t num_tokens, int64_t num_seqs, int num_heads,
                                       int num_kv_heads, int rows, int64_t max_len,
                                       int num_sms) {
  MultiTokenPlan p{};
  const int group = num_heads / num_kv_heads;
  p.group_tiles = (group + rows - 1) / rows;
  p.heads_per_tile = (group + p.group_tiles - 1) / p.group_tiles;
  p.tokens_per_tile = rows / p.heads_per_tile;
  p.virtual_tiles = num_tokens / p.tokens_per_tile + num_seqs;
  const int64_t busy = ((num_tokens + p.tokens_per_tile - 1) / p.tokens_per_tile) *
                       num_kv_heads * static_cast<int64_t>(p.group_tiles);
  const int64_t units =
      max_len > 0 ? (max_len + kMultiPartitionUnit - 1) / kMultiPartitionUnit : 1;
  const int64_t target = 2 * static_cast<int64_t>(num_sms > 0 ? num_sms : 1);
  int64_t parts = busy > 0 ? (target + busy - 1) / busy : 1;
  if (parts > units) parts = units;
  if (parts > kMaxPartitions) parts = kMaxPartitions;
  if (parts < 1) parts = 1;
  const int64_t units_per_part = (units + parts - 1) / parts;
  p.partition_tokens = units_per_part * kMultiPartitionUnit;
  p.num_partitions = static_cast<int32_t>((units + units_per_part - 1) / units_per_part);
  return p;
}

// Multi-token kernels, by cache dtype (the query dtype is read from AttentionParams::dtype).
// CUDA cores (multi_token.cuh), rows per CTA multi_rows_per_cta(head_size):
cudaError_t launch_multi_f32(const AttentionParams& p, cudaStream_t stream);
cudaError_t launch_multi_f16(const AttentionParams& p, cudaStream_t stream);
cudaError_t launch_multi_bf16(const AttentionParams& p, cudaStream_t stream);
cudaError_t launch_multi_e4m3(const AttentionParams& p, cudaStream_t stream);
cudaError_t launch_multi_e5m2(const AttentionParams& p, cudaStream_t stream);
// Tensor cores (multi_token_mma.cuh), kMultiMmaRows rows per CTA, multi_token_mma_supported():
cudaError_t launch_multi_mma_f16(const AttentionParams& p, cudaStream_t stream);
cudaError_t launch_multi_mma_bf16(const AttentionParams& p, cudaStream_t stream);
cudaError_t launch_multi_mma_e4m3(const AttentionParams& p, cudaStream_t stream);
cudaError_t launch_multi_mma_e5m2(const AttentionParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// merge_attention_states (merge_states.cu)
// ---------------------------------------------------------------------------------------------

struct MergeStatesParams {
  const void* out_a;  // [num_tokens, num_heads, head_size] of `dtype`, last dim contiguous
  const void* out_b;
  int64_t a_stride_tok, a_stride_head, b_stride_tok, b_stride_head;
  const float* lse_a;  // [num_tokens, num_heads], any strides
  const float* lse_b;
  int64_t la_stride_tok, la_stride_head, lb_stride_tok, lb_stride_head;
  void* out;   // [num_tokens, num_heads, head_size] of `dtype`, contiguous
  float* lse;  // [num_tokens, num_heads], contiguous
  int64_t num_tokens;
  int32_t num_heads, head_size;
  DType dtype;  // F32, F16 or BF16
};

cudaError_t launch_merge_states(const MergeStatesParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Cache write and block copies
// ---------------------------------------------------------------------------------------------

struct CacheWriteParams {
  const void* key;    // [>= num_tokens, num_kv_heads, head_size], last dim contiguous
  const void* value;
  int64_t key_stride_tok, key_stride_head, value_stride_tok, value_stride_head;
  void* key_cache;    // 5D layout, dim-0 stride below, inner dims dense
  void* value_cache;  // 4D layout
  int64_t kc_stride_block, vc_stride_block;
  const int64_t* slot_mapping;
  int64_t slot_stride;
  int64_t num_tokens;  // slot_mapping.size(0)
  int64_t num_slots;   // num_blocks * block_size: larger slots are skipped on the device
  int32_t num_kv_heads, head_size, block_size;
  int32_t elem_size;   // of key / value: 2 or 4
  bool vectorized;     // every key/value/key_cache address and stride is 16-byte aligned
  // fp8 caches: key / value are quantised to round(x / scale) (fp32 division, saturated to the
  // format's largest finite value, round-to-nearest-even); otherwise the bits are copied.
  DType cache_dtype;   // F8E4M3 / F8E5M2, or the dtype of key (plain copy)
  DType in_dtype;      // dtype of key / value
  const float* k_scale;  // device, one element (fp8 only)
  const float* v_scale;
};

cudaError_t launch_reshape_and_cache(const CacheWriteParams& p, cudaStream_t stream);

constexpr int kMaxCopyLayers = 64;  // layers per copy_blocks launch (pointers passed by value)

struct CopyBlocksParams {
  char* key_base[kMaxCopyLayers];
  char* value_base[kMaxCopyLayers];
  int64_t key_stride[kMaxCopyLayers];    // bytes between blocks
  int64_t value_stride[kMaxCopyLayers];
  const int64_t* mapping;  // device [num_pairs, 2]: (src, dst); out-of-range ids are skipped
  int64_t map_stride0, map_stride1;
  int64_t num_pairs;
  int64_t num_blocks;
  int64_t block_bytes;  // same for key and value blocks
  int32_t num_layers;   // <= kMaxCopyLayers
  bool vectorized;      // bases and strides 16-byte aligned (block_bytes always is)
};

cudaError_t launch_copy_blocks(const CopyBlocksParams& p, cudaStream_t stream);

}  // namespace paged::gpu
