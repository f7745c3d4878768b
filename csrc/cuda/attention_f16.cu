// Decode attention instantiations for __half caches (one file per dtype so that parallel builds
// compile them side by side).
#include "cuda/attention.cuh"

namespace paged::gpu {

cudaError_t launch_attention_f16(const AttentionParams& p, cudaStream_t stream) {
  return launch_decode_any<__half, __half>(p, stream);
}

}  // namespace paged::gpu
