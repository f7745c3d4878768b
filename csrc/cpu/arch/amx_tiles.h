// The AMX tile operations the attention kernel uses, behind a thin wrapper: the hardware
// instructions in the avx512_amx build (compiled with -mamx-tile -mamx-bf16), a portable
// emulation in builds that define PAGED_OPS_AMX without them (the lanes16_amx test build), so
// that every AMX code path of the kernel runs in the tests on any CPU.
//
// A tile is up to 16 rows of up to 64 bytes; its shape (rows, bytes per row) is set for all 8
// tiles at once by configure(), per thread. dp_bf16<C, A, B>() is TDPBF16PS: for each row m of
// C and A and each fp32 column n of C,
//   C[m][n] += sum_k A.bf16[m][2k] B.bf16[k][2n] + A.bf16[m][2k + 1] B.bf16[k][2n + 1],
// k over the bf16 pairs of A's row (B's rows): B is "VNNI" packed, each 32-bit element a pair
// of consecutive k.
#pragma once

#include <c10/util/bit_cast.h>

#include <cstdint>
#include <cstring>

#if defined(PAGED_OPS_AMX) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGED_OPS_AMX_NATIVE 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

#if defined(PAGED_OPS_AMX)
constexpr bool kAmx = true;
#else
constexpr bool kAmx = false;
#endif

namespace amx {

struct Shape {
  int rows = 0;   // <= 16
  int colsb = 0;  // bytes per row, <= 64 (a multiple of 4)
};

#if defined(PAGED_OPS_AMX_NATIVE)
constexpr bool kNative = true;

// Linux hands out the tile registers' state only to processes that ask for it
// (ARCH_REQ_XCOMP_PERM for XTILEDATA); without it the first tile instruction faults. Asked
// once per process: false where the CPU or kernel has no AMX, and the kernel then takes its
// vector paths.
inline bool usable() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

inline void configure(const Shape (&s)[8]) {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;  // palette 1
  for (int t = 0; t < 8; ++t) {
    std::memcpy(cfg + 16 + 2 * t, &s[t].colsb, 2);  // little endian, colsb < 65536
    cfg[48 + t] = static_cast<uint8_t>(s[t].rows);
  }
  // Not _tile_loadconfig: GCC 12's declares only the first 8 bytes as read, and the stores of
  // the shapes were dropped as dead (tiles left unconfigured: the next tile instruction
  // faults). The operand here is all 64 bytes.
  asm volatile("ldtilecfg %0" ::"m"(*reinterpret_cast<const uint8_t(*)[64]>(cfg)));
}
inline void release() { _tile_release(); }
// The tile intrinsics take the register number as a literal (it is pasted into the assembly),
// hence one case per tile.
#define PAGED_OPS_AMX_EACH_TILE(OP) \
  if constexpr (T == 0) OP(0);      \
  else if constexpr (T == 1) OP(1); \
  else if constexpr (T == 2) OP(2); \
  else if constexpr (T == 3) OP(3); \
  else if constexpr (T == 4) OP(4); \
  else if constexpr (T == 5) OP(5); \
  else if constexpr (T == 6) OP(6); \
  else OP(7)
template <int T>
inline void load(const void* p, int64_t stride) {
#define PAGED_OPS_AMX_LOAD(t) _tile_loadd(t, p, stride)
  PAGED_OPS_AMX_EACH_TILE(PAGED_OPS_AMX_LOAD);
#undef PAGED_OPS_AMX_LOAD
}
template <int T>
inline void zero() {
#define PAGED_OPS_AMX_ZERO(t) _tile_zero(t)
  PAGED_OPS_AMX_EACH_TILE(PAGED_OPS_AMX_ZERO);
#undef PAGED_OPS_AMX_ZERO
}
template <int T>
inline void store(void* p, int64_t stride) {
#define PAGED_OPS_AMX_STORE(t) _tile_stored(t, p, stride)
  PAGED_OPS_AMX_EACH_TILE(PAGED_OPS_AMX_STORE);
#undef PAGED_OPS_AMX_STORE
}
#undef PAGED_OPS_AMX_EACH_TILE
// The combinations the kernel uses (attention/amx.h: q.k into tiles 2 and 3 from 0 and 1,
// p.v into 6 and 7 from 4 and 5; from 64 tokens the second chains borrow the other phase's
// tiles: q.k into 3 from 4 and 5, p.v into 7 from 0 and 5).
template <int C, int A, int B>
inline void dp_bf16() {
  constexpr int k = C * 100 + A * 10 + B;
  static_assert(k == 201 || k == 301 || k == 645 || k == 745 || k == 345 || k == 705,
                "add the combination here");
  if constexpr (k == 201) _tile_dpbf16ps(2, 0, 1);
  else if constexpr (k == 301) _tile_dpbf16ps(3, 0, 1);
  else if constexpr (k == 645) _tile_dpbf16ps(6, 4, 5);
  else if constexpr (k == 745) _tile_dpbf16ps(7, 4, 5);
  else if constexpr (k == 345) _tile_dpbf16ps(3, 4, 5);
  else _tile_dpbf16ps(7, 0, 5);
}

#else
constexpr bool kNative = false;

// The emulation: the tiles of the calling thread in memory, unused bytes zero (as loads leave
// them on the hardware).
struct Tiles {
  Shape shape[8];
  alignas(64) uint8_t data[8][16][64];
};
inline Tiles& tiles() {
  static thread_local Tiles t;
  return t;
}

inline bool usable() { return true; }
inline void configure(const Shape (&s)[8]) {
  Tiles& t = tiles();
  std::memcpy(t.shape, s, sizeof(t.shape));
  std::memset(t.data, 0, sizeof(t.data));
}
inline void release() {}
template <int T>
inline void load(const void* p, int64_t stride) {
  Tiles& t = tiles();
  std::memset(t.data[T], 0, sizeof(t.data[T]));
  for (int r = 0; r < t.shape[T].rows; ++r)
    std::memcpy(t.data[T][r], static_cast<const uint8_t*>(p) + r * stride, t.shape[T].colsb);
}
template <int T>
inline void zero() {
  std::memset(tiles().data[T], 0, sizeof(tiles().data[T]));
}
template <int T>
inline void store(void* p, int64_t stride) {
  Tiles& t = tiles();
  for (int r = 0; r < t.shape[T].rows; ++r)
    std::memcpy(static_cast<uint8_t*>(p) + r * stride, t.data[T][r], t.shape[T].colsb);
}
template <int C, int A, int B>
inline void dp_bf16() {
  Tiles& t = tiles();
  auto bf16 = [](const uint8_t* row, int i) {
    uint16_t bits;
    std::memcpy(&bits, row + 2 * i, 2);
    return c10::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
  };
  for (int m = 0; m < t.shape[C].rows; ++m) {
    for (int n = 0; n < t.shape[C].colsb / 4; ++n) {
      float c;
      std::memcpy(&c, t.data[C][m] + 4 * n, 4);
      for (int k = 0; k < t.shape[A].colsb / 4; ++k) {
        c += bf16(t.data[A][m], 2 * k) * bf16(t.data[B][k], 2 * n);
        c += bf16(t.data[A][m], 2 * k + 1) * bf16(t.data[B][k], 2 * n + 1);
      }
      std::memcpy(t.data[C][m] + 4 * n, &c, 4);
    }
  }
}
#endif

}  // namespace amx
}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
