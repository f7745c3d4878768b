// Non-finite values in the cache that the vector paths would not carry as reading them would:
// e4m3 NaNs the vector decode reads as finite numbers (scan_keys, scan_values), and non-finite
// values in V columns that some rows of a multi-token item see and others do not, which p.v
// would multiply by probability 0 for the latter (isolate_nonfinite, zero_isolated). Their
// shares of the outputs are added by finish (kernel.h) through Scratch::v_poison.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/attention/item.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// Zeroes the non-finite values isolate_nonfinite took out of a copy of value block k (all-zero
// bits are +0 in every cache type).
template <typename CT, typename T>
inline void zero_isolated(const ItemState<CT>& w, T* blk, const GroupBlocks<CT>& g, int64_t k) {
  const Layout<CT>& layout = w.layout;
  const int64_t bs = layout.bs;
  for (int64_t d = 0; d < layout.D; ++d)
    for (int64_t t = g.t0[k]; t < g.t1[k]; ++t)
      if ((t < g.a0[k] || t >= g.a1[k]) && !std::isfinite(to_f32(blk[d * bs + t])))
        std::memset(static_cast<void*>(blk + d * bs + t), 0, sizeof(T));
}

// Whether key block k of the group holds an e4m3 NaN in a token some row sees; if so,
// scratch.k_nan flags those tokens. (Layout [D / x][bs][x]: token t's elements are x bytes
// at t * x of each chunk.)
template <typename CT>
inline bool scan_keys(ItemState<CT>& w, const GroupBlocks<CT>& g, int64_t k) {
  const Layout<CT>& layout = w.layout;
  Scratch& scratch = w.scratch;
  const int64_t bs = layout.bs, x = layout.x, D = layout.D;
  const uint8_t* kb = reinterpret_cast<const uint8_t*>(g.k[k]);
  if (!e4m3_has_nan(kb, D * bs)) return false;
  bool any = false;
  for (int64_t t = 0; t < bs; ++t) {
    bool nan = false;
    if (t >= g.t0[k] && t < g.t1[k])
      for (int64_t c = 0; c < D / x; ++c)
        for (int64_t i = 0; i < x; ++i) nan |= is_e4m3_nan(kb[(c * bs + t) * x + i]);
    scratch.k_nan[k * bs + t] = nan;
    any |= nan;
  }
  return any;
}

// The share of the non-finite value v at row d, offset t of value block k of the group, in
// the output of each row that sees it, for finish: p * v is NaN, or the infinity times a
// probability that is 0 (NaN) or not (the infinity).
template <typename CT>
inline void add_nonfinite(ItemState<CT>& w, int64_t hl, const GroupBlocks<CT>& g, int64_t k,
                          int64_t d, int64_t t, float v) {
  const Layout<CT>& layout = w.layout;
  Scratch& scratch = w.scratch;
  const int64_t R = w.R;
  const int64_t pos = w.first_token(g.b0 + k) + t;
  for (int64_t r = 0; r < R; ++r) {
    if (pos < scratch.row_lo[r] || pos > scratch.row_P[r]) continue;
    const float p = scratch.p[r * layout.group_row + k * layout.block_row + t];
    const float add = std::isnan(v) || p == 0.f ? std::numeric_limits<float>::quiet_NaN() : v;
    scratch.v_poison.push_back({hl, r, d, add});
  }
}

// The e4m3 NaNs of the group's value blocks at positions some row sees (add_nonfinite).
template <typename CT>
inline void scan_values(ItemState<CT>& w, int64_t hl, int64_t nb, const GroupBlocks<CT>& g) {
  const Layout<CT>& layout = w.layout;
  auto& tiny_v = w.tiny_v;
  auto& tiny_off = w.tiny_off;
  int64_t& tiny_n = w.tiny_n;
  const int64_t bs = layout.bs, D = layout.D;
  if (layout.pv == PvPath::Tiny) {  // the cache's blocks pv_tiny reads (hidden columns zeroed)
    const int64_t cbs = layout.cache_bs;
    for (int64_t i = 0; i < tiny_n; ++i) {
      const uint8_t* vb = reinterpret_cast<const uint8_t*>(tiny_v[i]);
      if (!e4m3_has_nan(vb, D * cbs)) continue;
      const int64_t k = tiny_off[i] / layout.block_row, t0 = tiny_off[i] % layout.block_row;
      for (int64_t d = 0; d < D; ++d)
        for (int64_t t = 0; t < cbs; ++t)
          if (is_e4m3_nan(vb[d * cbs + t]))
            add_nonfinite(w, hl, g, k, d, t0 + t, std::numeric_limits<float>::quiet_NaN());
    }
    return;
  }
  for (int64_t k = 0; k < nb; ++k) {
    const uint8_t* vb = reinterpret_cast<const uint8_t*>(g.v[k]);
    if (!e4m3_has_nan(vb, D * bs)) continue;
    for (int64_t d = 0; d < D; ++d)
      for (int64_t t = g.t0[k]; t < g.t1[k]; ++t)
        if (is_e4m3_nan(vb[d * bs + t]))
          add_nonfinite(w, hl, g, k, d, t, std::numeric_limits<float>::quiet_NaN());
  }
}

// A multi-token item's rows see different columns of a block (the positions past the first
// row's, before the last row's window): p.v multiplies those with probability 0 for the rows
// that do not see them, and 0 * NaN or 0 * Inf would be NaN. Such blocks are checked by
// vectors, and only a block with a non-finite value is searched: a non-finite value in
// those columns is zeroed in the block's copy (isolated, see pv) and its share added to the
// output of each row that sees it instead (add_nonfinite).
template <typename CT>
inline void isolate_nonfinite(ItemState<CT>& w, int64_t hl, int64_t nb, GroupBlocks<CT>& g) {
  const Layout<CT>& layout = w.layout;
  const int64_t bs = layout.bs, D = layout.D;
  for (int64_t k = 0; k < nb; ++k) {
    if (g.a0[k] == g.t0[k] && g.a1[k] == g.t1[k]) continue;  // every row sees the same
    const CT* vb = g.v[k];
    // First the whole block by vectors: x - x is NaN exactly where x is not finite (an e4m3
    // NaN, which the vector decode reads as a finite number, by e4m3_has_nan).
    VecF any(0.f);
    int64_t j = 0;
    for (; j + W <= D * bs; j += W) {
      const VecF x = load_f32(vb + j);
      any = any + (x - x);
    }
    bool finite = !std::isnan(hsum(any));
    for (; j < D * bs; ++j) finite &= std::isfinite(to_f32(vb[j]));
    // p.v's Dot path reads e4m3 NaN by tables (scan_values does not run there).
    if constexpr (ItemState<CT>::kScanNan)
      finite = finite && !e4m3_has_nan(reinterpret_cast<const uint8_t*>(vb), D * bs);
    if (finite) continue;
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t t = g.t0[k]; t < g.t1[k]; ++t) {
        if (t == g.a0[k]) t = std::max(t, g.a1[k]);
        if (t >= g.t1[k]) break;
        const float v = to_f32(vb[d * bs + t]);
        if (std::isfinite(v)) continue;
        g.isolated[k] = true;
        add_nonfinite(w, hl, g, k, d, t, v);
      }
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
