// Decode attention instantiations for fp8 e4m3 caches (torch.float8_e4m3fn), any query dtype
// (fp32 / fp16 / bf16, chosen at run time: it only matters when the query is loaded and the output
// stored).
#include "cuda/attention.cuh"

namespace paged::gpu {

cudaError_t launch_attention_e4m3(const AttentionParams& p, cudaStream_t stream) {
  return launch_decode_any<QAny, __nv_fp8_e4m3>(p, stream);
}

}  // namespace paged::gpu
