// Tensor-core multi-token attention instantiations for fp8 e4m3 caches with fp16 or bf16 queries
// (the values are converted to the query's dtype when staged; head sizes that are multiples of
// 16, i.e. all the fp8 layout allows; the block size is a run-time parameter).
#include "cuda/multi_token_mma.cuh"

namespace paged::gpu {

cudaError_t launch_multi_mma_e4m3(const AttentionParams& p, cudaStream_t stream) {
  return launch_multi_mma_fp8<__nv_fp8_e4m3>(p, stream);
}

}  // namespace paged::gpu
