// Decode attention instantiations for __nv_bfloat16 caches (one file per dtype so that parallel builds
// compile them side by side).
#include "cuda/attention.cuh"

namespace paged::gpu {

cudaError_t launch_attention_bf16(const AttentionParams& p, cudaStream_t stream) {
  return launch_decode_any<__nv_bfloat16, __nv_bfloat16>(p, stream);
}

}  // namespace paged::gpu
