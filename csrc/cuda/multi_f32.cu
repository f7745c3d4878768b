// Multi-token attention (query_start_loc) instantiations for float caches, one per head size; the
// block size and the query dtype are run-time parameters of the kernel.
#include "cuda/multi_token.cuh"

namespace paged::gpu {

cudaError_t launch_multi_f32(const AttentionParams& p, cudaStream_t stream) {
  return launch_multi_any<float>(p, stream);
}

}  // namespace paged::gpu
