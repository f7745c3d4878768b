// Multi-token attention (query_start_loc) instantiations for __nv_bfloat16 caches, one per head size; the
// block size and the query dtype are run-time parameters of the kernel.
#include "cuda/multi_token.cuh"

namespace paged::gpu {

cudaError_t launch_multi_bf16(const AttentionParams& p, cudaStream_t stream) {
  return launch_multi_any<__nv_bfloat16>(p, stream);
}

}  // namespace paged::gpu
