// Decode attention instantiations for fp8 e5m2 caches (torch.float8_e5m2), any query dtype
// (fp32 / fp16 / bf16, chosen at run time: it only matters when the query is loaded and the output
// stored).
#include "cuda/attention.cuh"

namespace paged::gpu {

cudaError_t launch_attention_e5m2(const AttentionParams& p, cudaStream_t stream) {
  return launch_decode_any<QAny, __nv_fp8_e5m2>(p, stream);
}

}  // namespace paged::gpu
