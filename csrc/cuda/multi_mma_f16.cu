// Tensor-core multi-token attention instantiations for fp16 caches and queries (head sizes that
// are multiples of 16; the block size is a run-time parameter).
#include "cuda/multi_token_mma.cuh"

namespace paged::gpu {

cudaError_t launch_multi_mma_f16(const AttentionParams& p, cudaStream_t stream) {
  return launch_multi_mma_any<__half, __half>(p, stream);
}

}  // namespace paged::gpu
