// Decode attention instantiations for float caches (one file per dtype so that parallel builds
// compile them side by side).
#include "cuda/attention.cuh"

namespace paged::gpu {

cudaError_t launch_attention_f32(const AttentionParams& p, cudaStream_t stream) {
  return launch_decode_any<float, float>(p, stream);
}

}  // namespace paged::gpu
