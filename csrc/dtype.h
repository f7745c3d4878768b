// Element types of queries, outputs and caches as the kernels see them. No torch header here:
// the CPU capability variants and the .cu files include this (see cpu/kernels.h,
// cuda/launch.cuh); attention_args.h maps torch dtypes onto it (kernel_dtype).
#pragma once

#include <cstdint>

namespace paged {

// Query / output dtypes are F32, F16, BF16; caches may also be fp8 (torch.float8_e4m3fn,
// torch.float8_e5m2). The values are part of the CPU kernel table's ABI (cpu/kernels.h).
enum class DType : int32_t { F32 = 0, F16 = 1, BF16 = 2, F8E4M3 = 3, F8E5M2 = 4 };

constexpr int64_t dtype_size(DType t) {
  return t == DType::F32 ? 4 : t == DType::F16 || t == DType::BF16 ? 2 : 1;
}

}  // namespace paged
