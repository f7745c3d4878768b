// Head sizes and block sizes the CUDA attention kernels are instantiated for: the one list that
// the argument checks (checks.cpp), the kernels' dispatch (csrc/cuda/*.cuh) and the tests
// (paged_ops_cuda_sizes, through ctypes) use. No torch or CUDA header: every part includes it.
#pragma once

#include <type_traits>

namespace paged {

template <int... Vs>
struct IntList {
  static constexpr int size = sizeof...(Vs);
  static constexpr int values[] = {Vs...};
};

// fp8 caches take the head sizes of this list that are multiples of x = 16 (all but 120, which
// their key layout cannot express); the tensor-core multi-token kernel takes the same ones.
using CudaHeadSizes = IntList<32, 64, 80, 96, 112, 120, 128, 192, 256>;
using CudaBlockSizes = IntList<8, 16, 32>;

// f(std::integral_constant<int, V>{}) for the V of the list equal to v; `none` when no V is.
template <typename R, typename F, int... Vs>
R dispatch_int(int v, IntList<Vs...>, R none, F&& f) {
  R r = none;
  (void)((v == Vs && (r = f(std::integral_constant<int, Vs>{}), true)) || ...);
  return r;
}

}  // namespace paged
