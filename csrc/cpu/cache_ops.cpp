// CPU cache ops: reshape_and_cache (write new keys/values into their slots), copy_blocks
// (copy-on-write block copies for every layer) and swap_blocks (block copies between pools).
// Every argument, including every slot / block id, is checked before the first write.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(_M_X64))
#include <immintrin.h>
#endif

#include "checks.h"
#include "cpu/fp8.h"

namespace paged::cpu {
namespace {

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor here, got ", t.device());
}

// ---------------------------------------------------------------------------------------------
// reshape_and_cache
//
// The slots of a call are first cut into *runs*: maximal groups of consecutive tokens
// i, i+1, ..., i+n-1 whose slots are s, s+1, ..., s+n-1 inside one block (a prefill chunk
// writes runs of up to block_size tokens; decode writes runs of one token). The work items are
// (run, kv head) pairs, parallelised in that order (consecutive items read neighbouring rows of
// key/value). For one item, with blk = s / block_size and off = s % block_size:
//   key:   for each x-chunk c, key_cache[blk, h, c, off..off+n, :] is contiguous (n * 16 bytes):
//          n 16-byte copies;
//   value: value_cache[blk, h, d, off..off+n) is contiguous for every d: the n x head_size tile
//          is transposed in 16-byte square blocks (SSE2 where available) and written row by
//          row, instead of head_size strided stores per token.
// Decode items (one token) touch a separate cache line per 16 bytes of key and per value row
// (per 64 / (block_size * element size) rows): the layout's cost, bound by the cache-line
// traffic, not by instructions (prefetching the next items' destination lines did not help;
// prefetching their source rows does, a little).
// fp8 caches: the rows of a run are first quantised (x / scale, saturated to the format's
// largest finite value, round-to-nearest-even; vectorised, with AVX2 intrinsics when the CPU
// has them) into a small per-thread byte tile, which then goes through the same byte scatter.

// Read-prefetch `rows` rows of `row_bytes` bytes, `stride_bytes` apart (the next item's source
// rows: on one core this overlaps their fetch with the current item's scatter / quantisation).
inline void prefetch_rows(const void* p, int64_t stride_bytes, int64_t rows, int64_t row_bytes) {
#if defined(__GNUC__) || defined(__clang__)
  const char* c = static_cast<const char*>(p);
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(c + j * stride_bytes + b, 0, 3);
  }
#else
  (void)p, (void)stride_bytes, (void)rows, (void)row_bytes;
#endif
}

struct Run {
  int64_t token;  // first token of the run
  int64_t slot;   // its slot
  int64_t len;    // tokens (and slots) in the run
};

// The runs of a call, in a vector of the calling thread that keeps its capacity from call to
// call (no allocation per call once warm; tests/test_no_alloc.py).
const std::vector<Run>& find_runs(const int64_t* slots, int64_t num_tokens, int64_t block_size) {
  static thread_local std::vector<Run> runs;
  runs.clear();
  for (int64_t i = 0; i < num_tokens; ++i) {
    const int64_t s = slots[i];
    if (s < 0) continue;  // padding
    if (!runs.empty()) {
      Run& r = runs.back();
      if (r.token + r.len == i && r.slot + r.len == s && s % block_size != 0) {
        ++r.len;
        continue;
      }
    }
    runs.push_back({i, s, 1});
  }
  return runs;
}

// Where items go: the caches' base pointers and geometry (strides in elements).
struct Dst {
  char* kc;
  char* vc;
  int64_t kcs0, vcs0;  // block strides
  int64_t D, bs, x;

  template <typename E>
  E* key(int64_t slot, int64_t h) const {
    return reinterpret_cast<E*>(kc) + (slot / bs) * kcs0 + h * D * bs + (slot % bs) * x;
  }
  template <typename E>
  E* value(int64_t slot, int64_t h) const {
    return reinterpret_cast<E*>(vc) + (slot / bs) * vcs0 + h * D * bs + slot % bs;
  }
};

// Bit reversal of m over log2(W) bits: the order in which the interleaving network of
// transpose_block leaves the columns.
template <int W>
constexpr int column_of(int m) {
  int r = 0;
  for (int b = 1; b < W; b <<= 1) r = (r << 1) | ((m & b) ? 1 : 0);
  return r;
}

// dst[i * ds + j] = src[j * ss + i] for a W x W block, W = 16 / sizeof(E) (one 16-byte vector
// per row). E is an unsigned type of the element size.
template <typename E>
inline void transpose_block(const E* src, int64_t ss, E* dst, int64_t ds) {
  constexpr int W = 16 / sizeof(E);
#if defined(__SSE2__)
  __m128i r[W];
  for (int j = 0; j < W; ++j) {
    r[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j * ss));
  }
  if constexpr (sizeof(E) == 4) {
    const __m128i t0 = _mm_unpacklo_epi32(r[0], r[1]), t1 = _mm_unpackhi_epi32(r[0], r[1]);
    const __m128i t2 = _mm_unpacklo_epi32(r[2], r[3]), t3 = _mm_unpackhi_epi32(r[2], r[3]);
    r[0] = _mm_unpacklo_epi64(t0, t2);
    r[1] = _mm_unpackhi_epi64(t0, t2);
    r[2] = _mm_unpacklo_epi64(t1, t3);
    r[3] = _mm_unpackhi_epi64(t1, t3);
  } else {
    // log2(W) rounds of interleaving: after round k, vector m holds 2^(k+1) source rows
    // interleaved in runs of the element width times 2^k.
    __m128i t[W];
    if constexpr (sizeof(E) == 1) {
      for (int m = 0; m < W / 2; ++m) {
        t[m] = _mm_unpacklo_epi8(r[2 * m], r[2 * m + 1]);
        t[m + W / 2] = _mm_unpackhi_epi8(r[2 * m], r[2 * m + 1]);
      }
      for (int m = 0; m < W; ++m) r[m] = t[m];
    }
    for (int m = 0; m < W / 2; ++m) {
      t[m] = _mm_unpacklo_epi16(r[2 * m], r[2 * m + 1]);
      t[m + W / 2] = _mm_unpackhi_epi16(r[2 * m], r[2 * m + 1]);
    }
    for (int m = 0; m < W / 2; ++m) {
      r[m] = _mm_unpacklo_epi32(t[2 * m], t[2 * m + 1]);
      r[m + W / 2] = _mm_unpackhi_epi32(t[2 * m], t[2 * m + 1]);
    }
    for (int m = 0; m < W / 2; ++m) {
      t[m] = _mm_unpacklo_epi64(r[2 * m], r[2 * m + 1]);
      t[m + W / 2] = _mm_unpackhi_epi64(r[2 * m], r[2 * m + 1]);
    }
    for (int m = 0; m < W; ++m) r[m] = t[m];
  }
  // r[m] now holds one column of the block (all W source rows): column m for fp32, column
  // column_of<W>(m) after the generic interleaving network.
  for (int m = 0; m < W; ++m) {
    const int col = sizeof(E) == 4 ? m : column_of<W>(m);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + col * ds), r[m]);
  }
#else
  for (int i = 0; i < W; ++i)
    for (int j = 0; j < W; ++j) dst[i * ds + j] = src[j * ss + i];
#endif
}

// Scatter one run of n tokens of one kv head. ksrc/vsrc: token 0's row of head_size elements,
// rows `ks`/`vs` elements apart; kd/vd: the run's first slot in the key / value cache. E is an
// unsigned type of the cache's element size: the bits are copied (NaN payloads included).
template <typename E>
inline void scatter_run(const E* ksrc, int64_t ks, const E* vsrc, int64_t vs, E* kd, E* vd,
                        int64_t n, int64_t D, int64_t bs, int64_t x) {
  // Per kv head, key_cache is [D / x, bs, x] and value_cache [D, bs]; x * sizeof(E) == 16.
  const int64_t chunks = D / x;
  if (n == 1) {
    for (int64_t c = 0; c < chunks; ++c) std::memcpy(kd + c * bs * x, ksrc + c * x, 16);
    for (int64_t d = 0; d < D; ++d) vd[d * bs] = vsrc[d];
    return;
  }
  for (int64_t c = 0; c < chunks; ++c) {
    E* dst = kd + c * bs * x;
    const E* src = ksrc + c * x;
    for (int64_t j = 0; j < n; ++j) std::memcpy(dst + j * x, src + j * ks, 16);
  }
  constexpr int64_t W = 16 / sizeof(E);  // == x; head_size is a multiple of it
  int64_t j0 = 0;
  for (; j0 + W <= n; j0 += W) {
    for (int64_t d0 = 0; d0 < D; d0 += W) {
      transpose_block<E>(vsrc + j0 * vs + d0, vs, vd + d0 * bs + j0, bs);
    }
  }
  if (j0 < n) {  // the last n % W tokens
    for (int64_t d = 0; d < D; ++d) {
      E* row = vd + d * bs;
      for (int64_t j = j0; j < n; ++j) row[j] = vsrc[j * vs + d];
    }
  }
}

// Items per parallel chunk: at least ~16K elements of key + value.
int64_t item_grain(const std::vector<Run>& runs, int64_t D) {
  int64_t tokens = 0;
  for (const Run& r : runs) tokens += r.len;
  const int64_t per_item = std::max<int64_t>(1, tokens / static_cast<int64_t>(runs.size())) * D;
  return std::max<int64_t>(1, 16384 / per_item);
}

template <typename E>
void write_plain(const at::Tensor& key, const at::Tensor& value, const Dst& g,
                 const std::vector<Run>& runs, int64_t H) {
  const E* k = static_cast<const E*>(key.data_ptr());
  const E* v = static_cast<const E*>(value.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1);
  const int64_t items = static_cast<int64_t>(runs.size()) * H;
  at::parallel_for(0, items, item_grain(runs, g.D), [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const Run& r = runs[w / H];
      const int64_t h = w % H;
      if (w + 1 < end) {
        const Run& rn = runs[(w + 1) / H];
        const int64_t hn = (w + 1) % H;
        prefetch_rows(k + rn.token * ks0 + hn * ks1, ks0 * sizeof(E), rn.len, g.D * sizeof(E));
        prefetch_rows(v + rn.token * vs0 + hn * vs1, vs0 * sizeof(E), rn.len, g.D * sizeof(E));
      }
      scatter_run<E>(k + r.token * ks0 + h * ks1, ks0, v + r.token * vs0 + h * vs1, vs0,
                     g.key<E>(r.slot, h), g.value<E>(r.slot, h), r.len, g.D, g.bs, g.x);
    }
  });
}

template <typename F, typename In>
void write_fp8(const at::Tensor& key, const at::Tensor& value, const Dst& g,
               const std::vector<Run>& runs, int64_t H, float k_scale, float v_scale) {
  const In* k = static_cast<const In*>(key.data_ptr());
  const In* v = static_cast<const In*>(value.data_ptr());
  const int64_t ks0 = key.stride(0), ks1 = key.stride(1);
  const int64_t vs0 = value.stride(0), vs1 = value.stride(1);
  const int64_t D = g.D;
  const int64_t items = static_cast<int64_t>(runs.size()) * H;
  const QuantizeFn quantize = pick_quantize<F, In>();
  constexpr int64_t kTile = 16;  // tokens quantised at a time (one 16 x 16 byte transpose)
  at::parallel_for(0, items, item_grain(runs, D), [&](int64_t begin, int64_t end) {
    static thread_local std::vector<uint8_t> buf;  // kept from call to call
    if (static_cast<int64_t>(buf.size()) < 2 * kTile * D) buf.resize(2 * kTile * D);
    uint8_t* kb = buf.data();
    uint8_t* vb = kb + kTile * D;
    for (int64_t w = begin; w < end; ++w) {
      const Run& r = runs[w / H];
      const int64_t h = w % H;
      if (w + 1 < end) {
        const Run& rn = runs[(w + 1) / H];
        const int64_t hn = (w + 1) % H;
        prefetch_rows(k + rn.token * ks0 + hn * ks1, ks0 * sizeof(In), rn.len, D * sizeof(In));
        prefetch_rows(v + rn.token * vs0 + hn * vs1, vs0 * sizeof(In), rn.len, D * sizeof(In));
      }
      for (int64_t j0 = 0; j0 < r.len; j0 += kTile) {
        const int64_t n = std::min(kTile, r.len - j0);
        const int64_t t0 = r.token + j0;
        quantize(k + t0 * ks0 + h * ks1, ks0, n, D, kb, k_scale);
        quantize(v + t0 * vs0 + h * vs1, vs0, n, D, vb, v_scale);
        scatter_run<uint8_t>(kb, D, vb, D, g.key<uint8_t>(r.slot + j0, h),
                             g.value<uint8_t>(r.slot + j0, h), n, D, g.bs, g.x);
      }
    }
  });
}

template <typename F>
void write_fp8_dispatch(const at::Tensor& key, const at::Tensor& value, const Dst& g,
                        const std::vector<Run>& runs, int64_t H, float ks, float vs) {
  switch (key.scalar_type()) {
    case at::kFloat: write_fp8<F, float>(key, value, g, runs, H, ks, vs); break;
    case at::kHalf: write_fp8<F, c10::Half>(key, value, g, runs, H, ks, vs); break;
    case at::kBFloat16: write_fp8<F, c10::BFloat16>(key, value, g, runs, H, ks, vs); break;
    default: TORCH_CHECK(false, "unsupported key dtype ", key.scalar_type());
  }
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
  const std::vector<Run>& runs =
      find_runs(slots.const_data_ptr<int64_t>(), d.num_tokens, d.cache.block_size);
  if (runs.empty()) return;
  const Dst g{static_cast<char*>(key_cache.data_ptr()),
              static_cast<char*>(value_cache.data_ptr()),
              key_cache.stride(0),
              value_cache.stride(0),
              d.cache.head_size,
              d.cache.block_size,
              d.cache.x};
  const int64_t H = d.cache.num_kv_heads;
  switch (key_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      write_fp8_dispatch<E4M3>(key, value, g, runs, H, host_scale(*k_scale),
                               host_scale(*v_scale));
      return;
    case at::kFloat8_e5m2:
      write_fp8_dispatch<E5M2>(key, value, g, runs, H, host_scale(*k_scale),
                               host_scale(*v_scale));
      return;
    default:
      break;
  }
  switch (key.element_size()) {
    case 4: write_plain<uint32_t>(key, value, g, runs, H); break;
    case 2: write_plain<uint16_t>(key, value, g, runs, H); break;
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
  // Threads only for copies of at least ~256 KiB per task: a copy-on-write step copies a few
  // blocks, and waking threads for that costs more than the copy.
  const int64_t grain = std::max<int64_t>(1, (256 << 10) / std::max<int64_t>(block_bytes, 1));
  at::parallel_for(0, n * nt, grain, [&](int64_t begin, int64_t end) {
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
  check_block_mapping_unchained(block_mapping);
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
