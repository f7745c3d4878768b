// Device helpers shared by the CUDA kernels: element types, 16-byte vector loads, warp reductions.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace paged::gpu {

constexpr unsigned kFullMask = 0xffffffffu;

// Per element type: x (elements per 16-byte vector), fp32 conversions, unpacking a 16-byte
// vector into fp32 lanes. Conversions are exact (bf16/fp16/fp8 -> fp32) or round-to-nearest.
// kVX: elements per value-cache load of the decode kernel (x, except fp8: 8, so that a lane
// holds as many values as for a 16-bit cache and block size 8 still gives whole loads).
// kFp8: the cache stores round(x / scale); the kernels apply the per-tensor scales.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static constexpr int kX = 4;
  static constexpr int kVX = kX;
  static constexpr bool kFp8 = false;
  __device__ __forceinline__ static float to_float(float v) { return v; }
  __device__ __forceinline__ static float from_float(float v) { return v; }
  __device__ __forceinline__ static void unpack(const uint4& r, float (&f)[4]) {
    f[0] = __uint_as_float(r.x);
    f[1] = __uint_as_float(r.y);
    f[2] = __uint_as_float(r.z);
    f[3] = __uint_as_float(r.w);
  }
};

template <>
struct Elem<__half> {
  static constexpr int kX = 8;
  static constexpr int kVX = kX;
  static constexpr bool kFp8 = false;
  __device__ __forceinline__ static float to_float(__half v) { return __half2float(v); }
  __device__ __forceinline__ static __half from_float(float v) { return __float2half_rn(v); }
  __device__ __forceinline__ static void unpack2(uint32_t w, float& lo, float& hi) {
    lo = __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)));
    hi = __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  __device__ __forceinline__ static void unpack(const uint4& r, float (&f)[8]) {
    unpack2(r.x, f[0], f[1]);
    unpack2(r.y, f[2], f[3]);
    unpack2(r.z, f[4], f[5]);
    unpack2(r.w, f[6], f[7]);
  }
};

template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kX = 8;
  static constexpr int kVX = kX;
  static constexpr bool kFp8 = false;
  __device__ __forceinline__ static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ __forceinline__ static __nv_bfloat16 from_float(float v) {
    return __float2bfloat16_rn(v);
  }
  // bf16 is the top half of an fp32: widening is a shift or a mask.
  __device__ __forceinline__ static void unpack2(uint32_t w, float& lo, float& hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  }
  __device__ __forceinline__ static void unpack(const uint4& r, float (&f)[8]) {
    unpack2(r.x, f[0], f[1]);
    unpack2(r.y, f[2], f[3]);
    unpack2(r.z, f[4], f[5]);
    unpack2(r.w, f[6], f[7]);
  }
};

// fp8 caches (__nv_fp8_e4m3 = torch.float8_e4m3fn, __nv_fp8_e5m2 = torch.float8_e5m2): only the
// types' size and name are used; the bytes are decoded here, two at a time through fp16 (exact
// for both formats; one cvt.f16x2 instruction on sm_89+). NaN stays NaN.
template <__nv_fp8_interpretation_t kFmt>
struct Fp8Elem {
  static constexpr int kX = 16;
  static constexpr int kVX = 8;
  static constexpr bool kFp8 = true;
  static constexpr __nv_fp8_interpretation_t kFormat = kFmt;
  __device__ __forceinline__ static void unpack2(uint32_t w16, float& lo, float& hi) {
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w16 & 0xffffu), kFmt);
    lo = __half2float(__ushort_as_half(h.x));
    hi = __half2float(__ushort_as_half(h.y));
  }
  // Four fp8 values of a 32-bit word, lowest byte first.
  __device__ __forceinline__ static void unpack4(uint32_t w, float* f) {
    unpack2(w, f[0], f[1]);
    unpack2(w >> 16, f[2], f[3]);
  }
  __device__ __forceinline__ static void unpack(const uint4& r, float (&f)[16]) {
    unpack4(r.x, f + 0);
    unpack4(r.y, f + 4);
    unpack4(r.z, f + 8);
    unpack4(r.w, f + 12);
  }
  __device__ __forceinline__ static void unpack8(const uint2& r, float (&f)[8]) {
    unpack4(r.x, f + 0);
    unpack4(r.y, f + 4);
  }
};

template <>
struct Elem<__nv_fp8_e4m3> : Fp8Elem<__NV_E4M3> {};
template <>
struct Elem<__nv_fp8_e5m2> : Fp8Elem<__NV_E5M2> {};

// 16-byte load through the read-only path (the caches are not written by the kernel reading them).
__device__ __forceinline__ uint4 ld_nc16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// 8-byte load through the read-only path.
__device__ __forceinline__ uint2 ld_nc8(const void* p) {
  return __ldg(reinterpret_cast<const uint2*>(p));
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

}  // namespace paged::gpu
