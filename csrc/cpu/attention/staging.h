// Staged blocks: block sizes below the vector width W that none of the fast q.k and p.v paths
// takes (1, 2, 3, 5, 12, ...: not W / 2 or W / 4) are read through copies. Each group step
// copies `per` consecutive cache blocks of one kv head into a staged block of `size` tokens (a
// block size the fast paths take), in the cache's own layout and type: cache block j at
// tokens [j bs, (j + 1) bs), hidden tokens and the padding up to `size` zeroed. The kernel
// then runs on staged blocks as on any other block; positions come from the first cache
// block of each (ItemState::first_token). Values are copied only where pv_tiny cannot read
// them in place (pv.h).
//
// At block size 1 a group of 4 blocks is 4 tokens: one softmax step per 4 tokens, V rows of
// one element each, and a partial vector for every q.k chunk. Staged, a group step is 64
// tokens or more and every loop runs on whole vectors; the copies cost two moves per piece
// (a chunk of a token's keys, a V row's tokens), from lines prefetched one step ahead.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/attention/element_loads.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {


// At most this many cache blocks per staged block (the copies' pointer arrays).
constexpr int64_t kMaxStagePer = 64;

// per: cache blocks per staged block (0: not staged); size: tokens of a staged block.
struct StageShape {
  int64_t per = 0, size = 0;
};

// The smallest staged size of 1, 2, 3, 4, 8, 12, ... vectors (up to 256 tokens; the counts
// pv_group takes) that whole cache blocks fill to 90% or more, else the fullest one: 1 -> 16 x
// 1 (on 16 lanes), 3 -> 5 x 3 in 16, 12 -> 4 x 12 in 48, 24 -> 2 x 24 in 48. Padding costs
// arithmetic, not memory: it is never read from the cache (block size 12 in 48 rather than 5
// x 12 in 64: less padding).
inline StageShape stage_shape(int64_t bs, int64_t min_size) {
  StageShape best;
  int64_t best_tokens = 0, best_size = 1;
  for (int64_t size = W; size <= 256; size += W) {
    const int64_t n = size / W;  // vectors per V row: those pv_group takes
    if (size < min_size || (n > 3 && n % 4 != 0)) continue;
    const int64_t per = size / bs;
    if (per == 0 || per > kMaxStagePer) continue;
    if (per * bs * best_size > best_tokens * size) {  // a fuller staged block
      best = {per, size};
      best_tokens = per * bs;
      best_size = size;
    }
    if (10 * per * bs >= 9 * size) break;
  }
  return best;
}

// n > 0 bytes: at most two overlapping moves up to 64 bytes (where the pieces of staged blocks
// are), 64-byte moves beyond.
inline void copy_bytes(void* dst, const void* src, int64_t n) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  auto two = [&](auto size) {
    constexpr int64_t K = decltype(size)::value;
    char a[K], b[K];
    std::memcpy(a, s, K);
    std::memcpy(b, s + n - K, K);
    std::memcpy(d, a, K);
    std::memcpy(d + n - K, b, K);
  };
  if (n >= 64) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) std::memcpy(d + i, s + i, 64);
    if (i < n) std::memcpy(d + n - 64, s + n - 64, 64);
  } else if (n >= 32) {
    two(std::integral_constant<int64_t, 32>{});
  } else if (n >= 16) {
    two(std::integral_constant<int64_t, 16>{});
  } else if (n >= 8) {
    two(std::integral_constant<int64_t, 8>{});
  } else if (n >= 4) {
    two(std::integral_constant<int64_t, 4>{});
  } else if (n >= 2) {
    two(std::integral_constant<int64_t, 2>{});
  } else {
    *d = *s;
  }
}

// rows pieces of n bytes, src_stride and dst_stride bytes apart: one move each where n is a
// power of two up to 64 (the loop then has a fixed-size copy).
inline void copy_pieces(char* dst, int64_t dst_stride, const char* src, int64_t src_stride,
                        int64_t rows, int64_t n) {
  auto fixed = [&](auto size) {
    constexpr int64_t K = decltype(size)::value;
    for (int64_t i = 0; i < rows; ++i, dst += dst_stride, src += src_stride)
      std::memcpy(dst, src, K);
  };
  switch (n) {
    case 2: return fixed(std::integral_constant<int64_t, 2>{});
    case 4: return fixed(std::integral_constant<int64_t, 4>{});
    case 8: return fixed(std::integral_constant<int64_t, 8>{});
    case 16: return fixed(std::integral_constant<int64_t, 16>{});
    case 32: return fixed(std::integral_constant<int64_t, 32>{});
    case 64: return fixed(std::integral_constant<int64_t, 64>{});
    default:
      for (int64_t i = 0; i < rows; ++i, dst += dst_stride, src += src_stride)
        copy_bytes(dst, src, n);
  }
}

// Zeroes rows pieces of n >= 0 bytes, stride bytes apart.
inline void zero_pieces(char* dst, int64_t stride, int64_t rows, int64_t n) {
  if (n <= 0) return;
  for (int64_t i = 0; i < rows; ++i, dst += stride) std::memset(dst, 0, n);
}

// Cache blocks src[0, n) of one kv head into a staged block (see the top): pieces of `unit`
// tokens' worth of `rows` rows, where a cache block's row is bs units of `unit` bytes and the
// staged block's row `size` units. Keys: rows = D / x chunks, unit = x elements; values:
// rows = D, unit = one element. Tokens of cache block j outside [t0[j], t1[j]) and from n bs
// on are zeroed.
inline void stage_block(const char* const* src, int64_t n, const int64_t* t0, const int64_t* t1,
                        int64_t bs, int64_t size, int64_t rows, int64_t unit, char* dst) {
  const int64_t src_row = bs * unit, dst_row = size * unit;
  for (int64_t j = 0; j < n; ++j) {
    char* out = dst + j * src_row;
    if (t0[j] == 0 && t1[j] == bs) {
      copy_pieces(out, dst_row, src[j], src_row, rows, src_row);
      continue;
    }
    zero_pieces(out, dst_row, rows, t0[j] * unit);
    if (t1[j] > t0[j])
      for (int64_t r = 0; r < rows; ++r)
        copy_bytes(out + r * dst_row + t0[j] * unit, src[j] + r * src_row + t0[j] * unit,
                   (t1[j] - t0[j]) * unit);
    zero_pieces(out + t1[j] * unit, dst_row, rows, (bs - t1[j]) * unit);
  }
  zero_pieces(dst + n * src_row, dst_row, rows, (size - n * bs) * unit);
}

// Appends the addresses of the lines of [p, p + bytes) to out (at out[n], returns the new n).
inline int64_t add_lines(const void* p, int64_t bytes, const char** out, int64_t n) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  for (uintptr_t l = a & ~uintptr_t{63}; l < a + bytes; l += 64)
    out[n++] = reinterpret_cast<const char*>(l);
  return n;
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
