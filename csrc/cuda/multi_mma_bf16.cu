// Tensor-core multi-token attention instantiations for bf16 caches and queries (head sizes that
// are multiples of 16; the block size is a run-time parameter).
#include "cuda/multi_token_mma.cuh"

namespace paged::gpu {

cudaError_t launch_multi_mma_bf16(const AttentionParams& p, cudaStream_t stream) {
  return launch_multi_mma_any<__nv_bfloat16, __nv_bfloat16>(p, stream);
}

}  // namespace paged::gpu
