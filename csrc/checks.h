// Input checks shared by the CPU and CUDA backends (docs/design.md, section 4).
//
// Every op validates all of its arguments here before touching memory, so a failed call leaves
// every cache unchanged. Messages name the argument and what was expected. Checks that need to
// read index tensors (slot ids, block ids, seq_lens) are the *_cpu functions: the CPU backend
// calls them; the CUDA backend must not read device memory on the host, so its kernels instead
// skip anything out of range.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace paged {

enum class Backend { CPU, CUDA };

// Elements per 16-byte vector of the cache dtype: the `x` of the 5D key layout.
int64_t cache_x(c10::ScalarType dtype);
bool is_fp8(c10::ScalarType dtype);

// Head sizes / block sizes the CUDA backend instantiates (cuda_sizes.h; the CPU backend takes
// any head size that is a multiple of x and any block size >= 1).
const std::vector<int64_t>& cuda_head_sizes();
const std::vector<int64_t>& cuda_block_sizes();

struct CacheDims {
  int64_t num_blocks;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t x;
};

// Layout (docs/design.md, section 2) and consistency of one key/value cache pair: ranks,
// dtypes, x, dense inner dims, matching dims between the two, same device. any_dtype: accept every dtype (x is still
// 16 // element_size), for ops that only move bytes.
CacheDims check_kv_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const char* key_name = "key_cache",
                              const char* value_name = "value_cache", bool any_dtype = false);

struct AttentionDims {
  CacheDims cache;
  int64_t num_seqs;            // sequences (query_start_loc.size(0) - 1 when given)
  int64_t num_tokens;          // query rows: num_seqs for decode
  int64_t num_heads;
  int64_t max_blocks_per_seq;
  bool multi_token;            // query_start_loc given
};

// The arguments of paged::attention / attention_out after `out`, as in the schema (ops.cpp).
struct AttentionArgs {
  const at::Tensor& query;
  const at::Tensor& key_cache;
  const at::Tensor& value_cache;
  const at::Tensor& block_tables;
  const at::Tensor& seq_lens;
  double scale;
  const std::optional<at::Tensor>& alibi_slopes;
  int64_t sliding_window;
  double logits_soft_cap;
  const std::optional<at::Tensor>& k_scale;
  const std::optional<at::Tensor>& v_scale;
  std::optional<int64_t> max_seq_len;
  const std::optional<at::Tensor>& query_start_loc;
  bool causal;  // false: every query row of a sequence sees all seq_len positions
};

// All metadata checks of paged::attention / attention_out (`out` may be null).
AttentionDims check_attention(Backend backend, const at::Tensor* out, const AttentionArgs& a);

// check_attention checks the shape of query_start_loc, and that a call with no sequence
// (query_start_loc of one element) has no query row: both backends, no device data read.
// CPU only (reads the index tensors): 0 <= seq_lens[s] <= max_seq_len (when given) and
// <= max_blocks_per_seq * block_size, every block id the sequence uses is in range, and
// query_start_loc (when given) starts at 0, never decreases, ends at the number of query rows,
// and gives no sequence more query tokens than its seq_len (causal rows only).
void check_attention_indices_cpu(const AttentionDims& dims, const AttentionArgs& a);

struct MergeStatesDims {
  int64_t num_tokens, num_heads, head_size;
};

// paged::merge_attention_states: out_a / out_b [N, H, D] of one float dtype, last dim
// contiguous; lse_a / lse_b fp32 [N, H]; all on one device.
MergeStatesDims check_merge_attention_states(const at::Tensor& out_a, const at::Tensor& lse_a,
                                             const at::Tensor& out_b, const at::Tensor& lse_b);

struct CacheWriteDims {
  CacheDims cache;
  int64_t num_tokens;  // slot_mapping.size(0): tokens actually written
};

// All metadata checks of paged::reshape_and_cache.
CacheWriteDims check_reshape_and_cache(Backend backend, const at::Tensor& key,
                                       const at::Tensor& value, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache,
                                       const at::Tensor& slot_mapping,
                                       const std::optional<at::Tensor>& k_scale,
                                       const std::optional<at::Tensor>& v_scale);

// The value of a checked fp8 scale (fp32, one element) of a CPU op, read on the host.
float host_scale(const at::Tensor& scale);

// CPU only: every non-negative slot < num_blocks * block_size.
void check_slots_cpu(const at::Tensor& slot_mapping, int64_t num_tokens, int64_t num_slots);

// Shape/dtype of a block_mapping: int64 [n, 2].
void check_block_mapping(const at::Tensor& block_mapping);

// Host-readable block_mapping only: sources in [0, num_src), destinations in [0, num_dst).
void check_block_mapping_ids(const at::Tensor& block_mapping, int64_t num_src, int64_t num_dst);

// Host-readable block_mapping of copy_blocks only: no block is the destination of two pairs, and
// no destination is the source of another pair. The pairs are copied in parallel, so either
// would make the result depend on their order. A pair (b, b) on its own is a harmless no-op.
void check_block_mapping_unchained(const at::Tensor& block_mapping);

// Metadata of paged::copy_blocks: same number of key and value caches, every pair a valid cache
// pair of any dtype (a block copy moves bytes), all layers of one dtype, device and block count,
// mapping int64 [n, 2].
CacheDims check_copy_blocks(const std::vector<at::Tensor>& key_caches,
                            const std::vector<at::Tensor>& value_caches,
                            const at::Tensor& block_mapping);

// Metadata of paged::swap_blocks: same dtype, same per-block shape, dense inner dims, mapping
// int64 [n, 2] on the CPU. Returns the number of elements of one block.
int64_t check_swap_blocks(const at::Tensor& src, const at::Tensor& dst,
                          const at::Tensor& block_mapping);

}  // namespace paged
