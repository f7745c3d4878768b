#include "checks.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>

#include "cuda_sizes.h"

namespace paged {
namespace {

std::string join(const std::vector<int64_t>& v) {
  std::ostringstream os;
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  return os.str();
}

bool is_float_dtype(c10::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Dims 1.. of `t` must be dense (row-major); a dim of size 1 may carry any stride.
void check_dense_after_dim0(const at::Tensor& t, const char* name) {
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 1; --d) {
    TORCH_CHECK(t.size(d) == 1 || t.stride(d) == expected, name,
                " must be dense in every dim after the block dim (only dim 0 may be strided); "
                "got sizes ", t.sizes(), " and strides ", t.strides());
    expected *= t.size(d);
  }
}

void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                       const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on the same device as ", ref_name,
              " (", ref.device(), "), got ", t.device());
}

void check_scale_tensor(const std::optional<at::Tensor>& s, const at::Tensor& ref,
                        const char* name) {
  if (!s.has_value()) return;
  TORCH_CHECK(s->scalar_type() == at::kFloat, name, " must be a float32 tensor, got ",
              s->scalar_type());
  TORCH_CHECK(s->numel() == 1, name, " must hold exactly one element (a per-tensor scale), got ",
              s->numel(), " elements");
  check_same_device(*s, ref, name, "the caches");
}

void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.size(-1) == 1 || t.stride(-1) == 1, name,
              " must be contiguous in its last dim (head_size); got strides ", t.strides());
}

// fp8 caches store x / scale: both per-tensor scales are required to write or read them.
void check_fp8_scales(c10::ScalarType cache_dtype, const std::optional<at::Tensor>& k_scale,
                      const std::optional<at::Tensor>& v_scale) {
  if (!is_fp8(cache_dtype)) return;
  TORCH_CHECK(k_scale.has_value(), "k_scale is required for an fp8 (", cache_dtype,
              ") cache: pass a float32 one-element tensor");
  TORCH_CHECK(v_scale.has_value(), "v_scale is required for an fp8 (", cache_dtype,
              ") cache: pass a float32 one-element tensor");
}

}  // namespace

int64_t cache_x(c10::ScalarType dtype) { return 16 / static_cast<int64_t>(c10::elementSize(dtype)); }

bool is_fp8(c10::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

const std::vector<int64_t>& cuda_head_sizes() {
  static const std::vector<int64_t> v(std::begin(CudaHeadSizes::values),
                                      std::end(CudaHeadSizes::values));
  return v;
}

const std::vector<int64_t>& cuda_block_sizes() {
  static const std::vector<int64_t> v(std::begin(CudaBlockSizes::values),
                                      std::end(CudaBlockSizes::values));
  return v;
}

CacheDims check_kv_cache_pair(const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const char* kname, const char* vname, bool any_dtype) {
  TORCH_CHECK(key_cache.dim() == 5, kname,
              " must have 5 dims [num_blocks, num_kv_heads, head_size // x, block_size, x], got ",
              key_cache.dim(), " dims with sizes ", key_cache.sizes());
  TORCH_CHECK(value_cache.dim() == 4, vname,
              " must have 4 dims [num_blocks, num_kv_heads, head_size, block_size], got ",
              value_cache.dim(), " dims with sizes ", value_cache.sizes());
  const auto dt = key_cache.scalar_type();
  TORCH_CHECK(any_dtype || is_float_dtype(dt) || is_fp8(dt), kname,
              " must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got ", dt);
  TORCH_CHECK(value_cache.scalar_type() == dt, vname, " dtype (", value_cache.scalar_type(),
              ") must equal ", kname, " dtype (", dt, ")");
  check_same_device(value_cache, key_cache, vname, kname);
  CacheDims d;
  d.x = cache_x(dt);
  TORCH_CHECK(key_cache.size(4) == d.x, kname, ".size(4) (x) must be 16 // element_size = ",
              d.x, " for ", dt, ", got ", key_cache.size(4));
  d.num_blocks = key_cache.size(0);
  d.num_kv_heads = key_cache.size(1);
  d.head_size = key_cache.size(2) * d.x;
  d.block_size = key_cache.size(3);
  TORCH_CHECK(d.num_kv_heads >= 1, kname, " must have at least one kv head");
  TORCH_CHECK(d.head_size >= 1, kname, " must have head_size >= 1");
  TORCH_CHECK(d.block_size >= 1, kname, " must have block_size >= 1");
  TORCH_CHECK(value_cache.size(0) == d.num_blocks, vname, ".size(0) (num_blocks) = ",
              value_cache.size(0), " must equal ", kname, ".size(0) = ", d.num_blocks);
  TORCH_CHECK(value_cache.size(1) == d.num_kv_heads, vname, ".size(1) (num_kv_heads) = ",
              value_cache.size(1), " must equal ", kname, ".size(1) = ", d.num_kv_heads);
  TORCH_CHECK(value_cache.size(2) == d.head_size, vname, ".size(2) (head_size) = ",
              value_cache.size(2), " must equal ", kname, ".size(2) * x = ", d.head_size);
  TORCH_CHECK(value_cache.size(3) == d.block_size, vname, ".size(3) (block_size) = ",
              value_cache.size(3), " must equal ", kname, ".size(3) = ", d.block_size);
  check_dense_after_dim0(key_cache, kname);
  check_dense_after_dim0(value_cache, vname);
  return d;
}

AttentionDims check_attention(Backend backend, const at::Tensor* out, const AttentionArgs& a) {
  // sliding_window: any value is valid (<= 0 means no window).
  const auto& [query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes,
               sliding_window, logits_soft_cap, k_scale, v_scale, max_seq_len,
               query_start_loc, causal] = a;
  TORCH_CHECK(query.dim() == 3, "query must have 3 dims [num_seqs, num_heads, head_size], got ",
              query.dim(), " dims with sizes ", query.sizes());
  TORCH_CHECK(is_float_dtype(query.scalar_type()),
              "query must be float32, float16 or bfloat16, got ", query.scalar_type());
  check_last_dim_contiguous(query, "query");
  AttentionDims d;
  d.cache = check_kv_cache_pair(key_cache, value_cache);
  d.num_tokens = query.size(0);
  d.num_seqs = query.size(0);
  d.num_heads = query.size(1);
  d.multi_token = query_start_loc.has_value();
  if (d.multi_token) {
    TORCH_CHECK(query_start_loc->scalar_type() == at::kInt, "query_start_loc must be int32, got ",
                query_start_loc->scalar_type());
    TORCH_CHECK(query_start_loc->dim() == 1 && query_start_loc->size(0) >= 1,
                "query_start_loc must have shape [num_seqs + 1], got ", query_start_loc->sizes());
    check_same_device(*query_start_loc, query, "query_start_loc", "query");
    d.num_seqs = query_start_loc->size(0) - 1;
    // Rows outside every sequence would be left unwritten; the values are checked on the CPU
    // (check_attention_indices_cpu), this case needs only the shapes.
    TORCH_CHECK(d.num_seqs >= 1 || d.num_tokens == 0,
                "query_start_loc has one element (no sequence) but query has ", d.num_tokens,
                " rows: every query row must belong to a sequence");
  }
  check_same_device(key_cache, query, "key_cache", "query");
  check_fp8_scales(key_cache.scalar_type(), k_scale, v_scale);
  TORCH_CHECK(is_fp8(key_cache.scalar_type()) || key_cache.scalar_type() == query.scalar_type(),
              "key_cache dtype (", key_cache.scalar_type(), ") must equal query dtype (",
              query.scalar_type(), ") unless the cache is fp8");
  TORCH_CHECK(query.size(2) == d.cache.head_size, "query.size(2) (head_size) = ", query.size(2),
              " must equal the caches' head_size = ", d.cache.head_size,
              " (key_cache.size(2) * key_cache.size(4))");
  TORCH_CHECK(d.num_heads >= 1, "query must have at least one head");
  TORCH_CHECK(d.num_heads % d.cache.num_kv_heads == 0, "query num_heads (", d.num_heads,
              ") must be a multiple of the caches' num_kv_heads (", d.cache.num_kv_heads, ")");

  TORCH_CHECK(block_tables.scalar_type() == at::kInt, "block_tables must be int32, got ",
              block_tables.scalar_type());
  TORCH_CHECK(block_tables.dim() == 2,
              "block_tables must have 2 dims [num_seqs, max_blocks_per_seq], got sizes ",
              block_tables.sizes());
  TORCH_CHECK(block_tables.size(0) == d.num_seqs, "block_tables.size(0) = ",
              block_tables.size(0), " must equal num_seqs = ", d.num_seqs,
              d.multi_token ? " (query_start_loc.size(0) - 1)" : " (query.size(0))");
  check_same_device(block_tables, query, "block_tables", "query");
  d.max_blocks_per_seq = block_tables.size(1);

  TORCH_CHECK(seq_lens.scalar_type() == at::kInt, "seq_lens must be int32, got ",
              seq_lens.scalar_type());
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == d.num_seqs,
              "seq_lens must have shape [num_seqs] = [", d.num_seqs, "], got ", seq_lens.sizes());
  check_same_device(seq_lens, query, "seq_lens", "query");

  TORCH_CHECK(std::isfinite(scale), "scale must be finite, got ", scale);
  TORCH_CHECK(std::isfinite(logits_soft_cap), "logits_soft_cap must be finite, got ",
              logits_soft_cap);
  if (alibi_slopes.has_value()) {
    TORCH_CHECK(alibi_slopes->scalar_type() == at::kFloat, "alibi_slopes must be float32, got ",
                alibi_slopes->scalar_type());
    TORCH_CHECK(alibi_slopes->dim() == 1 && alibi_slopes->size(0) == d.num_heads,
                "alibi_slopes must have shape [num_heads] = [", d.num_heads, "], got ",
                alibi_slopes->sizes());
    check_same_device(*alibi_slopes, query, "alibi_slopes", "query");
  }
  check_scale_tensor(k_scale, key_cache, "k_scale");
  check_scale_tensor(v_scale, key_cache, "v_scale");
  if (max_seq_len.has_value()) {
    TORCH_CHECK(*max_seq_len >= 0, "max_seq_len must be >= 0, got ", *max_seq_len);
  }
  if (out != nullptr) {
    TORCH_CHECK(out->sizes() == query.sizes(), "out must have the shape of query ",
                query.sizes(), ", got ", out->sizes());
    TORCH_CHECK(out->scalar_type() == query.scalar_type(), "out dtype (", out->scalar_type(),
                ") must equal query dtype (", query.scalar_type(), ")");
    check_same_device(*out, query, "out", "query");
    check_last_dim_contiguous(*out, "out");
  }
  if (backend == Backend::CUDA) {
    // Decode and multi-token (query_start_loc) kernels are instantiated for every head size
    // and block size below, with fp32 / fp16 / bf16 caches (query of the same dtype) and with
    // fp8 caches of either format (query fp32, fp16 or bf16). The fp8 key layout (x = 16)
    // cannot express head size 120, so only multiples of 16 exist there.
    TORCH_CHECK(!is_fp8(key_cache.scalar_type()) || d.cache.head_size % 16 == 0, "head_size ",
                d.cache.head_size, " is not supported by the CUDA backend for fp8 caches (",
                key_cache.scalar_type(), "): it must be a multiple of 16");
    const auto& hs = cuda_head_sizes();
    const auto& bs = cuda_block_sizes();
    TORCH_CHECK(std::find(hs.begin(), hs.end(), d.cache.head_size) != hs.end(), "head_size ",
                d.cache.head_size, " is not supported by the CUDA backend (supported: ", join(hs),
                ")");
    TORCH_CHECK(std::find(bs.begin(), bs.end(), d.cache.block_size) != bs.end(), "block_size ",
                d.cache.block_size, " is not supported by the CUDA backend (supported: ",
                join(bs), ")");
  }
  return d;
}

MergeStatesDims check_merge_attention_states(const at::Tensor& out_a, const at::Tensor& lse_a,
                                             const at::Tensor& out_b, const at::Tensor& lse_b) {
  TORCH_CHECK(out_a.dim() == 3, "out_a must have 3 dims [num_tokens, num_heads, head_size], got ",
              out_a.dim(), " dims with sizes ", out_a.sizes());
  TORCH_CHECK(is_float_dtype(out_a.scalar_type()),
              "out_a must be float32, float16 or bfloat16, got ", out_a.scalar_type());
  TORCH_CHECK(out_b.sizes() == out_a.sizes(), "out_b must have the shape of out_a ",
              out_a.sizes(), ", got ", out_b.sizes());
  TORCH_CHECK(out_b.scalar_type() == out_a.scalar_type(), "out_b dtype (", out_b.scalar_type(),
              ") must equal out_a dtype (", out_a.scalar_type(), ")");
  check_last_dim_contiguous(out_a, "out_a");
  check_last_dim_contiguous(out_b, "out_b");
  MergeStatesDims d{out_a.size(0), out_a.size(1), out_a.size(2)};
  for (const auto& [lse, name] : {std::pair<const at::Tensor&, const char*>{lse_a, "lse_a"},
                                  std::pair<const at::Tensor&, const char*>{lse_b, "lse_b"}}) {
    TORCH_CHECK(lse.scalar_type() == at::kFloat, name, " must be float32, got ",
                lse.scalar_type());
    TORCH_CHECK(lse.dim() == 2 && lse.size(0) == d.num_tokens && lse.size(1) == d.num_heads,
                name, " must have shape [num_tokens, num_heads] = [", d.num_tokens, ", ",
                d.num_heads, "], got ", lse.sizes());
    check_same_device(lse, out_a, name, "out_a");
  }
  check_same_device(out_b, out_a, "out_b", "out_a");
  return d;
}

void check_attention_indices_cpu(const AttentionDims& d, const AttentionArgs& a) {
  const at::Tensor& block_tables = a.block_tables;
  const at::Tensor& seq_lens = a.seq_lens;
  const std::optional<int64_t>& max_seq_len = a.max_seq_len;
  const std::optional<at::Tensor>& query_start_loc = a.query_start_loc;
  const auto bt = block_tables.accessor<int32_t, 2>();
  const auto sl = seq_lens.accessor<int32_t, 1>();
  const int64_t capacity = d.max_blocks_per_seq * d.cache.block_size;
  if (query_start_loc.has_value()) {
    const auto qsl = query_start_loc->accessor<int32_t, 1>();
    TORCH_CHECK(qsl[0] == 0, "query_start_loc[0] must be 0, got ", qsl[0]);
    TORCH_CHECK(qsl[d.num_seqs] == d.num_tokens, "query_start_loc[-1] = ", qsl[d.num_seqs],
                " must equal the number of query rows (query.size(0) = ", d.num_tokens, ")");
    for (int64_t s = 0; s < d.num_seqs; ++s) {
      const int64_t q_len = static_cast<int64_t>(qsl[s + 1]) - qsl[s];
      TORCH_CHECK(q_len >= 0, "query_start_loc must not decrease: query_start_loc[", s + 1,
                  "] = ", qsl[s + 1], " < query_start_loc[", s, "] = ", qsl[s]);
      // Causal rows are the sequence's last positions; non-causal rows all sit at its end, so
      // any number of them is valid (a group of branches over a short shared prefix).
      TORCH_CHECK(!a.causal || q_len <= sl[s], "sequence ", s, " has ", q_len,
                  " query tokens (query_start_loc) but seq_lens[", s, "] = ", sl[s],
                  ": causal query tokens are the last positions of the sequence");
    }
  }
  for (int64_t s = 0; s < d.num_seqs; ++s) {
    const int64_t len = sl[s];
    TORCH_CHECK(len >= 0, "seq_lens[", s, "] = ", len, " must be >= 0");
    TORCH_CHECK(!max_seq_len.has_value() || len <= *max_seq_len, "seq_lens[", s, "] = ", len,
                " exceeds max_seq_len = ", *max_seq_len);
    TORCH_CHECK(len <= capacity, "seq_lens[", s, "] = ", len,
                " exceeds what block_tables can address (", d.max_blocks_per_seq,
                " blocks of ", d.cache.block_size, " = ", capacity, " positions)");
    const int64_t nblocks = (len + d.cache.block_size - 1) / d.cache.block_size;
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t id = bt[s][b];
      TORCH_CHECK(id >= 0 && id < d.cache.num_blocks, "block_tables[", s, "][", b, "] = ", id,
                  " is out of range for a cache of ", d.cache.num_blocks, " blocks");
    }
  }
}

CacheWriteDims check_reshape_and_cache(Backend backend, const at::Tensor& key,
                                       const at::Tensor& value, const at::Tensor& key_cache,
                                       const at::Tensor& value_cache,
                                       const at::Tensor& slot_mapping,
                                       const std::optional<at::Tensor>& k_scale,
                                       const std::optional<at::Tensor>& v_scale) {
  // Both backends accept every head size and block size for the cache write.
  TORCH_CHECK(key.dim() == 3, "key must have 3 dims [num_tokens, num_kv_heads, head_size], got ",
              key.dim(), " dims with sizes ", key.sizes());
  TORCH_CHECK(value.dim() == 3,
              "value must have 3 dims [num_tokens, num_kv_heads, head_size], got ", value.dim(),
              " dims with sizes ", value.sizes());
  TORCH_CHECK(is_float_dtype(key.scalar_type()),
              "key must be float32, float16 or bfloat16, got ", key.scalar_type());
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "value dtype (", value.scalar_type(),
              ") must equal key dtype (", key.scalar_type(), ")");
  check_last_dim_contiguous(key, "key");
  check_last_dim_contiguous(value, "value");
  CacheWriteDims d;
  d.cache = check_kv_cache_pair(key_cache, value_cache);
  check_fp8_scales(key_cache.scalar_type(), k_scale, v_scale);
  // fp8 caches: both backends quantise any head size and block size the layout allows, from
  // fp32 / fp16 / bf16 key and value.
  (void)backend;
  TORCH_CHECK(is_fp8(key_cache.scalar_type()) || key_cache.scalar_type() == key.scalar_type(),
              "key_cache dtype (", key_cache.scalar_type(), ") must equal key dtype (",
              key.scalar_type(), ") unless the cache is fp8");
  check_same_device(value, key, "value", "key");
  check_same_device(key_cache, key, "key_cache", "key");
  check_same_device(slot_mapping, key, "slot_mapping", "key");
  TORCH_CHECK(key.size(1) == d.cache.num_kv_heads && key.size(2) == d.cache.head_size,
              "key must have shape [num_tokens, ", d.cache.num_kv_heads, ", ", d.cache.head_size,
              "] to match the caches, got ", key.sizes());
  TORCH_CHECK(value.size(1) == d.cache.num_kv_heads && value.size(2) == d.cache.head_size,
              "value must have shape [num_tokens, ", d.cache.num_kv_heads, ", ",
              d.cache.head_size, "] to match the caches, got ", value.sizes());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64, got ",
              slot_mapping.scalar_type());
  TORCH_CHECK(slot_mapping.dim() == 1, "slot_mapping must have 1 dim [num_tokens], got sizes ",
              slot_mapping.sizes());
  d.num_tokens = slot_mapping.size(0);
  TORCH_CHECK(d.num_tokens <= key.size(0) && d.num_tokens <= value.size(0),
              "slot_mapping has ", d.num_tokens, " entries but key has ", key.size(0),
              " rows and value has ", value.size(0),
              " (key and value need at least slot_mapping.size(0) rows)");
  check_scale_tensor(k_scale, key_cache, "k_scale");
  check_scale_tensor(v_scale, key_cache, "v_scale");
  return d;
}

float host_scale(const at::Tensor& scale) { return *scale.const_data_ptr<float>(); }

void check_slots_cpu(const at::Tensor& slot_mapping, int64_t num_tokens, int64_t num_slots) {
  const auto sm = slot_mapping.accessor<int64_t, 1>();
  for (int64_t i = 0; i < num_tokens; ++i) {
    TORCH_CHECK(sm[i] < num_slots, "slot_mapping[", i, "] = ", sm[i],
                " is out of range for a cache of ", num_slots,
                " slots (num_blocks * block_size); negative slots mean padding");
  }
}

void check_block_mapping(const at::Tensor& block_mapping) {
  TORCH_CHECK(block_mapping.scalar_type() == at::kLong, "block_mapping must be int64, got ",
              block_mapping.scalar_type());
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2,
              "block_mapping must have shape [n, 2] (rows of (src_block, dst_block)), got ",
              block_mapping.sizes());
}

void check_block_mapping_ids(const at::Tensor& block_mapping, int64_t num_src, int64_t num_dst) {
  const auto m = block_mapping.accessor<int64_t, 2>();
  for (int64_t i = 0; i < block_mapping.size(0); ++i) {
    TORCH_CHECK(m[i][0] >= 0 && m[i][0] < num_src, "block_mapping[", i, "][0] (src) = ", m[i][0],
                " is out of range for a source of ", num_src, " blocks");
    TORCH_CHECK(m[i][1] >= 0 && m[i][1] < num_dst, "block_mapping[", i, "][1] (dst) = ", m[i][1],
                " is out of range for a destination of ", num_dst, " blocks");
  }
}

void check_block_mapping_unchained(const at::Tensor& block_mapping) {
  const auto m = block_mapping.accessor<int64_t, 2>();
  const int64_t n = block_mapping.size(0);
  if (n <= 1) return;
  // (block id, row) sorted by id: equal ids are adjacent, each id's rows in row order.
  std::vector<std::pair<int64_t, int64_t>> src(n), dst(n);
  for (int64_t i = 0; i < n; ++i) {
    src[i] = {m[i][0], i};
    dst[i] = {m[i][1], i};
  }
  std::sort(src.begin(), src.end());
  std::sort(dst.begin(), dst.end());
  for (int64_t i = 1; i < n; ++i) {
    TORCH_CHECK(dst[i].first != dst[i - 1].first, "block_mapping[", dst[i - 1].second,
                "] and block_mapping[", dst[i].second, "] both write block ", dst[i].first,
                ": a block may be the destination of at most one pair per copy_blocks call");
  }
  for (const auto& [block, row] : dst) {
    auto it = std::lower_bound(src.begin(), src.end(), std::pair<int64_t, int64_t>{block, 0});
    for (; it != src.end() && it->first == block; ++it) {
      TORCH_CHECK(it->second == row, "block_mapping[", row, "] writes block ", block,
                  ", which block_mapping[", it->second,
                  "] reads: a destination must not be the source of another pair (the pairs are "
                  "copied in parallel); split the mapping into separate calls");
    }
  }
}

CacheDims check_copy_blocks(const std::vector<at::Tensor>& key_caches,
                            const std::vector<at::Tensor>& value_caches,
                            const at::Tensor& block_mapping) {
  TORCH_CHECK(key_caches.size() == value_caches.size(), "key_caches has ", key_caches.size(),
              " tensors but value_caches has ", value_caches.size(), " (one of each per layer)");
  check_block_mapping(block_mapping);
  CacheDims first{};
  for (size_t l = 0; l < key_caches.size(); ++l) {
    const std::string kn = "key_caches[" + std::to_string(l) + "]";
    const std::string vn = "value_caches[" + std::to_string(l) + "]";
    const CacheDims d = check_kv_cache_pair(key_caches[l], value_caches[l], kn.c_str(),
                                            vn.c_str(), /*any_dtype=*/true);
    if (l == 0) {
      first = d;
      continue;
    }
    TORCH_CHECK(key_caches[l].scalar_type() == key_caches[0].scalar_type(), kn, " dtype (",
                key_caches[l].scalar_type(), ") must equal key_caches[0] dtype (",
                key_caches[0].scalar_type(), ")");
    check_same_device(key_caches[l], key_caches[0], kn.c_str(), "key_caches[0]");
    TORCH_CHECK(key_caches[l].sizes() == key_caches[0].sizes(), kn, " shape ",
                key_caches[l].sizes(), " must equal key_caches[0] shape ",
                key_caches[0].sizes());
  }
  return first;
}

int64_t check_swap_blocks(const at::Tensor& src, const at::Tensor& dst,
                          const at::Tensor& block_mapping) {
  TORCH_CHECK(src.dim() >= 1, "src must have a block dim (dim 0)");
  TORCH_CHECK(dst.dim() == src.dim(), "dst must have as many dims as src (", src.dim(),
              "), got ", dst.dim());
  TORCH_CHECK(dst.scalar_type() == src.scalar_type(), "dst dtype (", dst.scalar_type(),
              ") must equal src dtype (", src.scalar_type(), ")");
  TORCH_CHECK(src.sizes().slice(1) == dst.sizes().slice(1),
              "src and dst must have the same block shape (every dim after dim 0); got src ",
              src.sizes(), " and dst ", dst.sizes());
  check_dense_after_dim0(src, "src");
  check_dense_after_dim0(dst, "dst");
  check_block_mapping(block_mapping);
  TORCH_CHECK(block_mapping.device().is_cpu(),
              "block_mapping for swap_blocks must be a CPU tensor (the copies are issued from the "
              "host), got ", block_mapping.device());
  check_block_mapping_ids(block_mapping, src.size(0), dst.size(0));
  int64_t n = 1;
  for (int64_t d = 1; d < src.dim(); ++d) n *= src.size(d);
  return n;
}

}  // namespace paged
