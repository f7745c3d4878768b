// CUDA implementations of every paged op: the shared argument checks (checks.h, Backend::CUDA),
// a device guard, the current stream, outputs and split-K scratch from the caching allocator,
// then the launchers of csrc/cuda/*.cu (launch.cuh).
//
// Nothing here reads device memory on the host or synchronises: checks that need device data
// (slot ids, block ids, seq_lens) are done by the kernels, which skip or clamp what is out of
// range. The work split depends on host-known sizes only, so every op can be captured in a CUDA
// graph and replayed with seq_lens / slot_mapping changed in place.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winterference-size"  // torch's header, not our ABI
#endif
#include <ATen/core/CachingHostAllocator.h>
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <tuple>

#include "attention_args.h"
#include "attention_op.h"
#include "checks.h"
#include "cuda/launch.cuh"

namespace paged::gpu {
namespace {

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor here, got ", t.device());
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Dim-0 stride in bytes is a multiple of 16 (irrelevant when there is a single block).
bool block_stride_aligned16(const at::Tensor& t) {
  return t.size(0) <= 1 || (t.stride(0) * t.element_size()) % 16 == 0;
}

// The decode kernel reads the caches in 16-byte vectors: every block must start 16-byte aligned.
void check_cache_alignment(const at::Tensor& t, const char* name) {
  TORCH_CHECK(aligned16(t.data_ptr()) && block_stride_aligned16(t), name,
              " must start at a 16-byte aligned address and have a dim-0 stride whose size in "
              "bytes is a multiple of 16 for the CUDA kernels (got storage offset ",
              t.storage_offset(), ", strides ", t.strides(), ")");
}

int sm_count(int device) {
  static std::array<std::atomic<int>, 64> cache{};
  const bool cacheable = device >= 0 && device < static_cast<int>(cache.size());
  if (cacheable) {
    const int v = cache[device].load(std::memory_order_relaxed);
    if (v > 0) return v;
  }
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  if (cacheable) cache[device].store(n, std::memory_order_relaxed);
  return n;
}

// One-element fp32 scale tensor on the caches' device (checked): the kernels read it.
const float* scale_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// Split-K scratch when p.num_partitions > 1 (else undefined): `rows` query rows x
// num_partitions, each head_size partial outputs + max + sum, fp32; p.tmp_* point into it.
// Returned so that it lives until the launch is queued (the caching allocator orders reuse
// on the stream).
at::Tensor split_scratch(AttentionParams& p, int64_t rows, const at::Tensor& query) {
  if (p.num_partitions <= 1) return {};
  rows *= p.num_partitions;
  at::Tensor scratch = at::empty({rows * (p.head_size + 2)}, query.options().dtype(at::kFloat));
  p.tmp_out = scratch.data_ptr<float>();
  p.tmp_max = p.tmp_out + rows * p.head_size;
  p.tmp_sum = p.tmp_max + rows;
  return scratch;
}

// The CUDA part of attention / attention_out / attention_with_lse (attention_op.h): device and
// alignment checks, the work split, the launch. lse (when given) is written by the kernel that
// writes out: the attention kernel, or the split-K reduce kernel.
void run_attention(at::Tensor& out, at::Tensor* lse, const AttentionArgs& a,
                   const AttentionDims& d) {
  const auto& [query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes,
               sliding_window, logits_soft_cap, k_scale, v_scale, max_seq_len,
               query_start_loc, causal] = a;
  if (d.num_seqs == 0 || d.num_tokens == 0) return;
  check_cuda(query, "query");
  check_cache_alignment(key_cache, "key_cache");
  check_cache_alignment(value_cache, "value_cache");
  const c10::cuda::CUDAGuard guard(query.device());

  AttentionParams p{};
  set_attention_args(p, out, a, d);
  p.lse = lse != nullptr ? lse->data_ptr<float>() : nullptr;
  p.num_blocks = d.cache.num_blocks;
  // Device-side clamp of seq_lens: what the block table can address, and max_seq_len if given.
  int64_t max_len = d.max_blocks_per_seq * d.cache.block_size;
  if (max_seq_len.has_value() && *max_seq_len < max_len) max_len = *max_seq_len;
  p.max_len = max_len;
  if (is_fp8(key_cache.scalar_type())) {  // scales of other caches are ignored
    p.k_scale = scale_ptr(k_scale);
    p.v_scale = scale_ptr(v_scale);
  }
  const int device = query.device().index();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();

  if (d.multi_token) {
    const at::Tensor& qsl = *query_start_loc;
    p.query_start_loc = qsl.data_ptr<int32_t>();
    p.qsl_stride = qsl.stride(0);
    // Tensor cores for fp16 / bf16 queries and head sizes that are multiples of 16, unless
    // PAGED_OPS_CUDA_MULTI_TOKEN_SIMT=1 asks for the CUDA-core kernel (fp32 queries and head
    // size 120 always take it).
    const char* simt_env = std::getenv("PAGED_OPS_CUDA_MULTI_TOKEN_SIMT");
    const bool mma = multi_token_mma_supported(p.dtype, p.head_size) &&
                     !(simt_env != nullptr && simt_env[0] == '1');
    const int rows = mma ? kMultiMmaRows : multi_rows_per_cta(p.head_size);
    const MultiTokenPlan mp = plan_multi_token(d.num_tokens, d.num_seqs, p.num_heads,
                                               p.num_kv_heads, rows, max_len, sm_count(device));
    p.mt_tokens_per_tile = mp.tokens_per_tile;
    p.mt_heads_per_tile = mp.heads_per_tile;
    p.mt_group_tiles = mp.group_tiles;
    p.mt_virtual_tiles = mp.virtual_tiles;
    p.num_partitions = mp.num_partitions;
    p.partition_tokens = mp.partition_tokens;
    TORCH_CHECK(mp.virtual_tiles <= INT32_MAX,
                "too many query tokens / sequences for one launch of the CUDA kernel");
    TORCH_CHECK(static_cast<int64_t>(p.num_kv_heads) * mp.group_tiles <= 65535 &&
                    p.num_heads <= 65535,
                "too many heads for the CUDA multi-token kernel's grid (num_heads = ",
                p.num_heads, ")");
    // [num_tokens, num_heads, num_partitions] rows.
    const at::Tensor scratch = split_scratch(p, d.num_tokens * d.num_heads, query);
    cudaError_t err = cudaErrorInvalidValue;
    switch (p.cache_dtype) {
      case DType::F32: err = launch_multi_f32(p, stream); break;
      case DType::F16:
        err = mma ? launch_multi_mma_f16(p, stream) : launch_multi_f16(p, stream);
        break;
      case DType::BF16:
        err = mma ? launch_multi_mma_bf16(p, stream) : launch_multi_bf16(p, stream);
        break;
      case DType::F8E4M3:
        err = mma ? launch_multi_mma_e4m3(p, stream) : launch_multi_e4m3(p, stream);
        break;
      case DType::F8E5M2:
        err = mma ? launch_multi_mma_e5m2(p, stream) : launch_multi_e5m2(p, stream);
        break;
    }
    C10_CUDA_CHECK(err);
    return;
  }

  const AttentionPlan plan = plan_attention(
      plan_elem_size(p.cache_dtype), d.num_seqs, p.num_heads, p.num_kv_heads,
      p.head_size, p.block_size, max_len, sm_count(device));
  p.group_tile = plan.group_tile;
  p.num_tiles = plan.num_tiles;
  p.num_partitions = plan.num_partitions;
  p.partition_tokens = plan.partition_tokens;
  TORCH_CHECK(static_cast<int64_t>(p.num_kv_heads) * p.num_tiles <= 65535 && p.num_heads <= 65535,
              "too many heads for the CUDA decode kernel's grid (num_heads = ", p.num_heads, ")");
  TORCH_CHECK(d.num_seqs <= INT32_MAX, "too many sequences for one launch: ", d.num_seqs);

  // [num_seqs, num_heads, num_partitions] rows.
  const at::Tensor scratch = split_scratch(p, d.num_seqs * d.num_heads, query);

  cudaError_t err = cudaErrorInvalidValue;
  switch (p.cache_dtype) {
    case DType::F32: err = launch_attention_f32(p, stream); break;
    case DType::F16: err = launch_attention_f16(p, stream); break;
    case DType::BF16: err = launch_attention_bf16(p, stream); break;
    case DType::F8E4M3: err = launch_attention_e4m3(p, stream); break;
    case DType::F8E5M2: err = launch_attention_e5m2(p, stream); break;
  }
  C10_CUDA_CHECK(err);
}

using AttentionOps = AttentionOp<Backend::CUDA, &run_attention>;

std::tuple<at::Tensor, at::Tensor> merge_attention_states(const at::Tensor& out_a,
                                                          const at::Tensor& lse_a,
                                                          const at::Tensor& out_b,
                                                          const at::Tensor& lse_b) {
  const MergeStatesDims d = check_merge_attention_states(out_a, lse_a, out_b, lse_b);
  check_cuda(out_a, "out_a");
  TORCH_CHECK(d.num_heads <= INT32_MAX && d.head_size <= INT32_MAX,
              "merge_attention_states: too many heads or too large a head size for the CUDA "
              "kernel, got [", d.num_tokens, ", ", d.num_heads, ", ", d.head_size, "]");
  const c10::cuda::CUDAGuard guard(out_a.device());
  at::Tensor out = at::empty({d.num_tokens, d.num_heads, d.head_size}, out_a.options());
  at::Tensor lse = at::empty({d.num_tokens, d.num_heads}, lse_a.options());
  if (d.num_tokens == 0 || d.num_heads == 0) return {out, lse};
  MergeStatesParams p{};
  p.out_a = out_a.data_ptr();
  p.out_b = out_b.data_ptr();
  p.a_stride_tok = out_a.stride(0);
  p.a_stride_head = out_a.stride(1);
  p.b_stride_tok = out_b.stride(0);
  p.b_stride_head = out_b.stride(1);
  p.lse_a = lse_a.data_ptr<float>();
  p.lse_b = lse_b.data_ptr<float>();
  p.la_stride_tok = lse_a.stride(0);
  p.la_stride_head = lse_a.stride(1);
  p.lb_stride_tok = lse_b.stride(0);
  p.lb_stride_head = lse_b.stride(1);
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.num_tokens = d.num_tokens;
  p.num_heads = static_cast<int32_t>(d.num_heads);
  p.head_size = static_cast<int32_t>(d.head_size);
  p.dtype = kernel_dtype(out_a.scalar_type());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(out_a.device().index()).stream();
  C10_CUDA_CHECK(launch_merge_states(p, stream));
  return {out, lse};
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::optional<at::Tensor>& k_scale,
                       const std::optional<at::Tensor>& v_scale) {
  const CacheWriteDims d = check_reshape_and_cache(Backend::CUDA, key, value, key_cache,
                                                   value_cache, slot_mapping, k_scale, v_scale);
  if (d.num_tokens == 0) return;
  check_cuda(key, "key");
  const c10::cuda::CUDAGuard guard(key.device());
  const int64_t es = key.element_size();
  CacheWriteParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  p.key_stride_tok = key.stride(0);
  p.key_stride_head = key.stride(1);
  p.value_stride_tok = value.stride(0);
  p.value_stride_head = value.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.kc_stride_block = key_cache.stride(0);
  p.vc_stride_block = value_cache.stride(0);
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.slot_stride = slot_mapping.stride(0);
  p.num_tokens = d.num_tokens;
  p.num_slots = d.cache.num_blocks * d.cache.block_size;
  p.num_kv_heads = static_cast<int32_t>(d.cache.num_kv_heads);
  p.head_size = static_cast<int32_t>(d.cache.head_size);
  p.block_size = static_cast<int32_t>(d.cache.block_size);
  p.elem_size = static_cast<int32_t>(es);
  p.in_dtype = kernel_dtype(key.scalar_type());
  p.cache_dtype = kernel_dtype(key_cache.scalar_type());
  if (is_fp8(key_cache.scalar_type())) {
    p.k_scale = scale_ptr(k_scale);
    p.v_scale = scale_ptr(v_scale);
  }
  // 16-byte key/value loads and key stores need every address of a chunk aligned: the bases and
  // the token/head strides (the chunk offsets inside a row are multiples of 16 bytes).
  auto stride_ok = [es](int64_t stride) { return (stride * es) % 16 == 0; };
  p.vectorized = aligned16(p.key) && aligned16(p.value) && aligned16(p.key_cache) &&
                 stride_ok(p.key_stride_tok) && stride_ok(p.key_stride_head) &&
                 stride_ok(p.value_stride_tok) && stride_ok(p.value_stride_head) &&
                 block_stride_aligned16(key_cache);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(key.device().index()).stream();
  C10_CUDA_CHECK(launch_reshape_and_cache(p, stream));
}

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  const CacheDims d = check_copy_blocks(key_caches, value_caches, block_mapping);
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  check_cuda(key_caches[0], "key_caches[0]");
  const at::Device device = key_caches[0].device();
  TORCH_CHECK(block_mapping.is_cpu() || block_mapping.device() == device,
              "block_mapping must be a CPU tensor or on the caches' device (", device, "), got ",
              block_mapping.device());
  TORCH_CHECK(block_mapping.size(0) <= INT32_MAX, "too many block pairs for one launch");
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  at::Tensor mapping = block_mapping;
  if (block_mapping.is_cpu()) {
    // A captured graph would replay the host-to-device copy from a pinned staging buffer that
    // the caching host allocator recycles once the capture is over: the replay would read
    // whatever that memory holds by then.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    TORCH_CHECK(capture == cudaStreamCaptureStatusNone,
                "copy_blocks: block_mapping must be a CUDA tensor on the caches' device while "
                "the stream is being captured into a CUDA graph (a CPU mapping would be staged "
                "in a host buffer that the graph cannot keep), got a CPU tensor");
    // Host ids can be checked before anything is touched; the copy to the device goes through
    // pinned memory so it is asynchronous (the caching host allocator keeps the pinned buffer
    // alive until the copy has run).
    check_block_mapping_ids(block_mapping, d.num_blocks, d.num_blocks);
    check_block_mapping_unchained(block_mapping);
    mapping = block_mapping.contiguous().pin_memory().to(device, /*non_blocking=*/true);
  }
  // else: ids on the device are checked by the kernel (out-of-range pairs are skipped). Chained
  // pairs or repeated destinations cannot be found without reading the mapping back (a host
  // synchronisation): their result is undefined (the pairs run in parallel). BlockManager never
  // produces them: every destination is a block it has just allocated.

  const int64_t es = key_caches[0].element_size();
  CopyBlocksParams p{};
  p.mapping = mapping.data_ptr<int64_t>();
  p.map_stride0 = mapping.stride(0);
  p.map_stride1 = mapping.stride(1);
  p.num_pairs = mapping.size(0);
  p.num_blocks = d.num_blocks;
  p.block_bytes = d.num_kv_heads * d.head_size * d.block_size * es;
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  for (int64_t l0 = 0; l0 < layers; l0 += kMaxCopyLayers) {
    const int64_t n = std::min<int64_t>(kMaxCopyLayers, layers - l0);
    p.num_layers = static_cast<int32_t>(n);
    p.vectorized = true;
    for (int64_t i = 0; i < n; ++i) {
      const at::Tensor& k = key_caches[l0 + i];
      const at::Tensor& v = value_caches[l0 + i];
      p.key_base[i] = static_cast<char*>(k.data_ptr());
      p.value_base[i] = static_cast<char*>(v.data_ptr());
      p.key_stride[i] = k.stride(0) * es;
      p.value_stride[i] = v.stride(0) * es;
      p.vectorized = p.vectorized && aligned16(k.data_ptr()) && aligned16(v.data_ptr()) &&
                     block_stride_aligned16(k) && block_stride_aligned16(v);
    }
    C10_CUDA_CHECK(launch_copy_blocks(p, stream));
  }
}

// Orders `waiter` after the work queued so far on `producer` (no host synchronisation).
void stream_wait(cudaStream_t waiter, const c10::cuda::CUDAStream& producer) {
  const c10::cuda::CUDAGuard guard(producer.device_index());
  cudaEvent_t ev = nullptr;
  C10_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  C10_CUDA_CHECK(cudaEventRecord(ev, producer.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(waiter, ev, 0));
  C10_CUDA_CHECK(cudaEventDestroy(ev));  // released once the recorded work has completed
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  // Shapes, dtypes, mapping on the CPU and its ids (against both block counts) are all checked
  // here, before anything is copied.
  const int64_t block_elems = check_swap_blocks(src, dst, block_mapping);
  TORCH_CHECK(src.is_cuda() || dst.is_cuda(), "swap_blocks: expected src or dst on CUDA, got ",
              src.device(), " and ", dst.device());
  TORCH_CHECK((src.is_cuda() || src.is_cpu()) && (dst.is_cuda() || dst.is_cpu()),
              "swap_blocks copies between CUDA and CPU tensors, got ", src.device(), " and ",
              dst.device());
  const int64_t n = block_mapping.size(0);
  if (n == 0 || block_elems == 0) return;
  const at::Device device = dst.is_cuda() ? dst.device() : src.device();
  const c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream cstream = c10::cuda::getCurrentCUDAStream(device.index());
  const cudaStream_t stream = cstream.stream();
  // GPU -> GPU across two devices: run on dst's stream, after the work queued on src's, and make
  // src's stream wait for the copy before it may overwrite src.
  const bool cross_device = src.is_cuda() && dst.is_cuda() && src.device() != dst.device();
  if (cross_device) stream_wait(stream, c10::cuda::getCurrentCUDAStream(src.device().index()));

  const int64_t es = src.element_size();
  const int64_t bytes = block_elems * es;
  const int64_t sstride = src.stride(0) * es;
  const int64_t dstride = dst.stride(0) * es;
  const char* sbase = static_cast<const char*>(src.data_ptr());
  char* dbase = static_cast<char*>(dst.data_ptr());
  // Runs of consecutive (src, dst) pairs over densely packed blocks become one copy.
  const bool mergeable = (src.size(0) <= 1 || sstride == bytes) && (dst.size(0) <= 1 || dstride == bytes);
  const auto m = block_mapping.accessor<int64_t, 2>();
  for (int64_t i = 0; i < n;) {
    const int64_t s0 = m[i][0], d0 = m[i][1];
    int64_t run = 1;
    while (mergeable && i + run < n && m[i + run][0] == s0 + run && m[i + run][1] == d0 + run) {
      ++run;
    }
    C10_CUDA_CHECK(cudaMemcpyAsync(dbase + d0 * dstride, sbase + s0 * sstride, run * bytes,
                                   cudaMemcpyDefault, stream));
    i += run;
  }
  if (cross_device) {
    const c10::cuda::CUDAStream src_stream = c10::cuda::getCurrentCUDAStream(src.device().index());
    stream_wait(src_stream.stream(), cstream);
  }
  // A pinned host buffer must outlive the asynchronous copy: tell the caching host allocator
  // (as torch's own copy_ does) so it does not hand the buffer out again before the copy has run.
  for (const at::Tensor* t : {&src, static_cast<const at::Tensor*>(&dst)}) {
    if (t->is_cpu() && t->is_pinned()) {
      const auto& dp = t->storage().data_ptr();
      at::getHostAllocator(at::kCUDA)->record_event(t->data_ptr(), dp.get_context(),
                                                     cstream.unwrap());
    }
  }
}

}  // namespace
}  // namespace paged::gpu

TORCH_LIBRARY_IMPL(paged, CUDA, m) {
  m.impl("reshape_and_cache", &paged::gpu::reshape_and_cache);
  m.impl("attention", &paged::gpu::AttentionOps::attention);
  m.impl("attention_out", &paged::gpu::AttentionOps::attention_out);
  m.impl("attention_with_lse", &paged::gpu::AttentionOps::attention_with_lse);
  m.impl("merge_attention_states", &paged::gpu::merge_attention_states);
  m.impl("copy_blocks", &paged::gpu::copy_blocks);
  m.impl("swap_blocks", &paged::gpu::swap_blocks);
}
