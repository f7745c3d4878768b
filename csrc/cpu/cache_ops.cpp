// CPU cache ops: reshape_and_cache (write new keys/values into their slots), copy_blocks
// (copy-on-write block copies for every layer) and swap_blocks (block copies between pools).
// Every argument, including every slot / block id, is checked before the first write.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>

#include "checks.h"

namespace paged::cpu {
namespace {

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor here, got ", t.device());
}

// Scatter one token's heads into the caches: key in chunks of x (16 bytes) into the 5D layout,
// value transposed into [head_size, block_size]. E is an unsigned type of the element size.
template <typename E>
void write_tokens(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                  at::Tensor& value_cache, const int64_t* slots, const CacheWriteDims& d) {
  const int64_t H = d.cache.num_kv_heads, D = d.cache.head_size, bs = d.cache.block_size;
  const int64_t x = d.cache.x;
  const E* k = static_cast<const E*>(key.data_ptr());
  const E* v = static_cast<const E*>(value.data_ptr());
  E* kc = static_cast<E*>(key_cache.data_ptr());
  E* vc = static_cast<E*>(value_cache.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1);
  const int64_t kcs0 = key_cache.stride(0), vcs0 = value_cache.stride(0);
  at::parallel_for(0, d.num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;  // padding
      const int64_t blk = slot / bs, off = slot % bs;
      for (int64_t h = 0; h < H; ++h) {
        const E* ks = k + i * ks0 + h * ks1;
        E* kd = kc + blk * kcs0 + h * D * bs + off * x;
        for (int64_t c = 0; c < D / x; ++c) {
          std::memcpy(kd + c * bs * x, ks + c * x, x * sizeof(E));
        }
        const E* vs = v + i * vs0 + h * vs1;
        E* vd = vc + blk * vcs0 + h * D * bs + off;
        for (int64_t dd = 0; dd < D; ++dd) vd[dd * bs] = vs[dd];
      }
    }
  });
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& v_scale) {
  const CacheWriteDims d = check_reshape_and_cache(Backend::CPU, key, value, key_cache,
                                                   value_cache, slot_mapping, k_scale, v_scale);
  check_slots_cpu(slot_mapping, d.num_tokens, d.cache.num_blocks * d.cache.block_size);
  if (d.num_tokens == 0) return;
  // Gather the slots once (slot_mapping may be strided).
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  switch (key.element_size()) {
    case 4: write_tokens<uint32_t>(key, value, key_cache, value_cache, sp, d); break;
    case 2: write_tokens<uint16_t>(key, value, key_cache, value_cache, sp, d); break;
    default: TORCH_CHECK(false, "unsupported key element size ", key.element_size());
  }
}

// Copy whole blocks: `pairs` rows of (src, dst) within or between dense-after-dim-0 tensors.
void copy_block_list(const std::vector<std::pair<const char*, char*>>& bases,
                     const std::vector<std::pair<int64_t, int64_t>>& strides,
                     int64_t block_bytes, const at::Tensor& mapping) {
  const auto m = mapping.accessor<int64_t, 2>();
  const int64_t n = mapping.size(0);
  const int64_t nt = static_cast<int64_t>(bases.size());
  at::parallel_for(0, n * nt, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w / n, i = w % n;
      const char* src = bases[t].first + m[i][0] * strides[t].first;
      char* dst = bases[t].second + m[i][1] * strides[t].second;
      std::memmove(dst, src, block_bytes);
    }
  });
}

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  const CacheDims d = check_copy_blocks(key_caches, value_caches, block_mapping);
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  check_cpu(block_mapping, "block_mapping");
  check_cpu(key_caches[0], "key_caches[0]");
  check_block_mapping_ids(block_mapping, d.num_blocks, d.num_blocks);
  std::vector<std::pair<const char*, char*>> bases;
  std::vector<std::pair<int64_t, int64_t>> strides;
  const int64_t es = key_caches[0].element_size();
  for (size_t l = 0; l < key_caches.size(); ++l) {
    for (const at::Tensor* t : {&key_caches[l], &value_caches[l]}) {
      char* p = static_cast<char*>(t->data_ptr());
      bases.emplace_back(p, p);
      strides.emplace_back(t->stride(0) * es, t->stride(0) * es);
    }
  }
  // Key and value blocks hold the same number of elements: num_kv_heads * head_size * bs.
  const int64_t block_bytes = d.num_kv_heads * d.head_size * d.block_size * es;
  copy_block_list(bases, strides, block_bytes, block_mapping);
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  const int64_t block_elems = check_swap_blocks(src, dst, block_mapping);
  check_cpu(src, "src");
  check_cpu(dst, "dst");
  if (block_mapping.size(0) == 0 || block_elems == 0) return;
  const int64_t es = src.element_size();
  copy_block_list({{static_cast<const char*>(src.data_ptr()), static_cast<char*>(dst.data_ptr())}},
                  {{src.stride(0) * es, dst.stride(0) * es}}, block_elems * es, block_mapping);
}

}  // namespace
}  // namespace paged::cpu

TORCH_LIBRARY_IMPL(paged, CPU, m) {
  m.impl("reshape_and_cache", &paged::cpu::reshape_and_cache);
  m.impl("copy_blocks", &paged::cpu::copy_blocks);
  m.impl("swap_blocks", &paged::cpu::swap_blocks);
}
