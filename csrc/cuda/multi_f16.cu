// Multi-token attention (query_start_loc) instantiations for __half caches, one per head size; the
// block size and the query dtype are run-time parameters of the kernel.
#include "cuda/multi_token.cuh"

namespace paged::gpu {

cudaError_t launch_multi_f16(const AttentionParams& p, cudaStream_t stream) {
  return launch_multi_any<__half>(p, stream);
}

}  // namespace paged::gpu
