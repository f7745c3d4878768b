// The p.v phase of a group step: the probabilities of every row of a kv head times the group's
// V blocks, added to the rows' running sums, by the item's p.v path (Layout::pv, layout.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cpu/attention/amx.h"
#include "cpu/attention/item.h"
#include "cpu/attention/nonfinite.h"
#include "cpu/attention/pv.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// The group's V blocks converted to fp32 (scratch.vtmp), hidden columns zeroed: read by every
// tile of rows, they are converted once.
template <typename CT>
inline void v_blocks_f32(ItemState<CT>& w, int64_t nb, const GroupBlocks<CT>& g,
                         const float** out) {
  const int64_t D = w.layout.D, bs = w.layout.bs;
  for (int64_t k = 0; k < nb; ++k) {
    float* dst = w.scratch.vtmp.data() + k * D * bs;
    v_block_to_f32(g.v[k], dst, D, bs, g.t0[k], g.t1[k]);
    if (g.isolated[k]) zero_isolated(w, dst, g, k);
    out[k] = dst;
  }
}

// The group's V blocks in the cache's type: in place, or the partly visible ones through a
// copy with the hidden columns zeroed (scratch.vraw).
template <typename CT>
inline void v_blocks_own(ItemState<CT>& w, int64_t nb, const GroupBlocks<CT>& g,
                         const CT** out) {
  const int64_t D = w.layout.D, bs = w.layout.bs;
  CT* const masked = reinterpret_cast<CT*>(w.scratch.vraw.data());
  for (int64_t k = 0; k < nb; ++k) {
    if ((g.clean[k] || (g.t0[k] == 0 && g.t1[k] == bs)) && !g.isolated[k]) {
      out[k] = g.v[k];
      continue;
    }
    CT* dst = masked + k * D * bs;
    out[k] = v_block_masked(g.v[k], dst, D, bs, g.t0[k], g.t1[k]);
    if (g.isolated[k]) zero_isolated(w, dst, g, k);
  }
}

// The rows' p.v sums of kv head hl in acc (the paths that keep lane sums there).
template <typename CT>
inline float* acc_rows(ItemState<CT>& w, int64_t hl) {
  return w.scratch.acc.data() + hl * w.R * w.layout.acc_row;
}

// PvPath::Amx: amx_pv_group (amx.h) on the bf16 blocks, probabilities packed as tile operands.
template <typename CT>
inline void pv_path_amx(ItemState<CT>& w, int64_t hl, int64_t nb, bool first,
                        const GroupBlocks<CT>& g) {
  if constexpr (std::is_same_v<CT, c10::BFloat16>) {
    const Layout<CT>& layout = w.layout;
    Scratch& scratch = w.scratch;
    const int64_t R = w.R, D = layout.D;
    const CT* src[kGroup];
    v_blocks_own(w, nb, g, src);
    amx_pack_probabilities(scratch.p.data(), layout.group_row, R, nb, layout.bs,
                           layout.block_row, scratch.pvnni.data());
    alignas(64) float alpha[16] = {};
    std::copy(scratch.alpha.data() + hl * R, scratch.alpha.data() + (hl + 1) * R, alpha);
    amx_pv_group(src, nb, layout.bs, D, scratch.pvnni.data(), scratch.amx_o.data() + hl * D * 16,
                 alpha, first, scratch.cbuf.data(), g.v_next);
  }
}

// PvPath::Tiny: pv_tiny (pv.h) on the cache's V blocks stage_group listed (tiny_v), by
// probability patterns that repeat every tiny_period vectors.
template <typename CT>
inline void pv_path_tiny(ItemState<CT>& w, int64_t hl, int64_t nb) {
  const Layout<CT>& layout = w.layout;
  const int64_t R = w.R, group_row = layout.group_row, acc_row = layout.acc_row;
  float* const acc_h = acc_rows(w, hl);
  float* const pat = w.scratch.tiny_pat.data();
  const float* const pp = w.scratch.p.data();
  auto tiles = [&](auto h) {
    constexpr int H = decltype(h)::value;
    int64_t r = 0;
    auto tile = [&](auto rt) {
      constexpr int RT = decltype(rt)::value;
      const float* const pr = pp + r * group_row;
      if constexpr (H == 0)
        tiny_patterns<RT>(pr, group_row, w.tiny_off, w.tiny_n, layout.tiny_period,
                          layout.tiny_idx, pat);
      pv_tiny<RT, H, true>(w.tiny_v, w.tiny_off, w.tiny_n, pr, group_row, pat,
                           layout.tiny_period, layout.cache_bs, acc_h + r * acc_row, acc_row,
                           layout.D, w.k_rest, nb);
    };
    for (; r + 4 <= R; r += 4) tile(std::integral_constant<int, 4>{});
    for (; r < R; ++r) tile(std::integral_constant<int, 1>{});
  };
  if (layout.cache_bs == 1) tiles(std::integral_constant<int, 1>{});
  else if (layout.cache_bs == 2) tiles(std::integral_constant<int, 2>{});
  else if (layout.cache_bs == 4) tiles(std::integral_constant<int, 4>{});
  else tiles(std::integral_constant<int, 0>{});
}

// PvPath::Dot: pv_dot_tile (pv.h) on the bf16 or fp8 blocks, probabilities rounded to bf16
// pairs.
template <typename CT>
inline void pv_path_dot(ItemState<CT>& w, int64_t hl, int64_t nb, bool first,
                        const GroupBlocks<CT>& g) {
  if constexpr (kDotCache<CT>) {
    const Layout<CT>& layout = w.layout;
    const int64_t R = w.R, acc_row = layout.acc_row, accs = layout.dot_accs, bs = layout.bs;
    float* const acc_h = acc_rows(w, hl);
    const CT* src[kGroup];
    v_blocks_own(w, nb, g, src);
    uint16_t* const pd = w.scratch.pdot.data();
    const int64_t pd_row = w.pdot_row();
    pack_dot_probabilities(w.scratch.p.data(), layout.group_row, layout.block_row, R, nb,
                           layout.bs, pd, pd_row);
    auto tiles = [&](auto multi) {
      constexpr bool M = decltype(multi)::value;
      int64_t r = 0;
      if (R > 4)
        r = pv_dot_tiles<M>(src, nb, pd, pd_row, acc_h, acc_row, accs, first, g.v_next, R, bs);
      for (; r + 4 <= R; r += 4)
        pv_dot_tile<4, M>(src, nb, pd + r * pd_row, pd_row, acc_h + r * acc_row, acc_row, accs,
                          bs, first, g.v_next);
      for (; r < R; ++r)
        pv_dot_tile<1, M>(src, nb, pd + r * pd_row, pd_row, acc_h + r * acc_row, acc_row, accs,
                          bs, first, g.v_next);
    };
    if (bs > 2 * W) tiles(std::true_type{});
    else tiles(std::false_type{});
  }
}

// PvPath::HalfTile: pv_half_tile (pv.h), 2 or 4 V rows per vector.
template <typename CT>
inline void pv_path_half(ItemState<CT>& w, int64_t hl, int64_t nb, bool first,
                         const GroupBlocks<CT>& g) {
  constexpr bool kSplit = Layout<CT>::kSplitKeyPrefetch;
  const Layout<CT>& layout = w.layout;
  const int64_t R = w.R, group_row = layout.group_row, acc_row = layout.acc_row;
  float* const acc_h = acc_rows(w, hl);
  const float* const pp = w.scratch.p.data();
  const CT* src[kGroup];
  v_blocks_own(w, nb, g, src);
  auto tiles = [&](auto rpv) {
    constexpr int RPV = decltype(rpv)::value;
    int64_t r = 0;
    for (; r + 4 <= R; r += 4)
      pv_half_tile<4, RPV, kSplit>(src, nb, pp + r * group_row, group_row, layout.block_row,
                                   acc_h + r * acc_row, acc_row, layout.D, g.v_next, w.k_rest,
                                   first);
    for (; r < R; ++r)
      pv_half_tile<1, RPV, kSplit>(src, nb, pp + r * group_row, group_row, layout.block_row,
                                   acc_h + r * acc_row, acc_row, layout.D, g.v_next, w.k_rest,
                                   first);
  };
  if (layout.rows_per_vector == 2) tiles(std::integral_constant<int, 2>{});
  else tiles(std::integral_constant<int, 4>{});
}

// PvPath::RowAny: pv_row_any (pv.h) on fp32 copies of the blocks, any block size.
template <typename CT>
inline void pv_path_row_any(ItemState<CT>& w, int64_t hl, int64_t nb,
                            const GroupBlocks<CT>& g) {
  const Layout<CT>& layout = w.layout;
  const int64_t R = w.R, group_row = layout.group_row, acc_row = layout.acc_row;
  float* const acc_h = acc_rows(w, hl);
  const float* vb[kGroup];
  v_blocks_f32(w, nb, g, vb);
  const float* const pp = w.scratch.p.data();
  int64_t r = 0;
  for (; r + 4 <= R; r += 4)
    pv_row_any<4>(vb, nb, pp + r * group_row, group_row, layout.block_row, acc_h + r * acc_row,
                  acc_row, layout.D, layout.bs);
  for (; r < R; ++r)
    pv_row_any<1>(vb, nb, pp + r * group_row, group_row, layout.block_row, acc_h + r * acc_row,
                  acc_row, layout.D, layout.bs);
}

// PvPath::Group and GroupAny: pv_group / pv_group_any (pv.h), tiles of 4 query rows. Blocks
// are read in place (the partly visible ones from a copy in their own type) when one tile of
// rows covers them or the cache is fp32; else the group is converted to fp32 once, for all
// tiles (converting the whole group for one partial block would slow calls of odd lengths).
template <typename CT>
inline void pv_path_group(ItemState<CT>& w, int64_t hl, int64_t nb, bool first, bool last,
                          const GroupBlocks<CT>& g) {
  constexpr bool kSplit = Layout<CT>::kSplitKeyPrefetch;
  const Layout<CT>& layout = w.layout;
  Scratch& scratch = w.scratch;
  const int64_t R = w.R, D = layout.D, bs = layout.bs, NV = layout.NV;
  const int64_t group_row = layout.group_row, acc_row = layout.acc_row;
  const int64_t vrow_bytes = bs * static_cast<int64_t>(sizeof(CT));
  float* const acc_h = layout.lane_acc ? acc_rows(w, hl) : nullptr;
  const float* const pp = scratch.p.data();
  float* const ot = scratch.ot.data() + hl * R * D;  // tiles of 4 rows, then single rows
  const float* const al = scratch.alpha.data() + hl * R;
  auto acc = [&](int64_t r) { return acc_h ? acc_h + r * acc_row : nullptr; };
  auto& k_rest = w.k_rest;
  auto run = [&](auto nv, auto src) {
    constexpr int NVc = decltype(nv)::value;
    int64_t r = 0;
    if (nb == kGroup) {
      for (; r + 4 <= R; r += 4)
        pv_group<NVc, 4, kGroup, kSplit>(src, nb, NV, pp + r * group_row, group_row, ot + r * D,
                                         al + r, acc(r), acc_row, D, g.v_next, vrow_bytes, first,
                                         last, k_rest);
    }
    for (; r + 4 <= R; r += 4)
      pv_group<NVc, 4, 0, kSplit>(src, nb, NV, pp + r * group_row, group_row, ot + r * D, al + r,
                                  acc(r), acc_row, D, g.v_next, vrow_bytes, first, last, k_rest);
    for (; r < R; ++r)
      pv_group<NVc, 1, 0, kSplit>(src, nb, NV, pp + r * group_row, group_row, ot + r * D, al + r,
                                  acc(r), acc_row, D, g.v_next, vrow_bytes, first, last, k_rest);
  };
  auto run_any = [&](auto half, auto src) {
    constexpr bool HALF = decltype(half)::value;
    int64_t r = 0;
    for (; r + 4 <= R; r += 4)
      pv_group_any<4, HALF, kSplit>(src, nb, NV, bs, pp + r * group_row, group_row,
                                    layout.block_row, ot + r * D, al + r, acc(r), acc_row, D,
                                    g.v_next, vrow_bytes, first, last, k_rest);
    for (; r < R; ++r)
      pv_group_any<1, HALF, kSplit>(src, nb, NV, bs, pp + r * group_row, group_row,
                                    layout.block_row, ot + r * D, al + r, acc(r), acc_row, D,
                                    g.v_next, vrow_bytes, first, last, k_rest);
  };
  auto dispatch = [&](auto src) {
    if (layout.pv == PvPath::GroupAny) {
      if constexpr (W == 16) {
        if (layout.half_rows) return run_any(std::true_type{}, src);
      }
      return run_any(std::false_type{}, src);
    }
    if (NV == 1) run(std::integral_constant<int, 1>{}, src);
    else if (NV == 2) run(std::integral_constant<int, 2>{}, src);
    else if (NV == 3) run(std::integral_constant<int, 3>{}, src);
    else run(std::integral_constant<int, 4>{}, src);
  };
  if (std::is_same_v<CT, float> || R <= 4) {
    // pv_group reads bf16 rows split (even, odd)
    if (kSplitPairs<CT> && NV == 2 && layout.pv == PvPath::Group) {
      for (int64_t r = 0; r < R; ++r)
        for (int64_t k = 0; k < nb; ++k)
          split_pairs(scratch.p.data() + r * group_row + k * layout.block_row);
    }
    const CT* src[kGroup];
    v_blocks_own(w, nb, g, src);
    dispatch(static_cast<const CT* const*>(src));
  } else {
    const float* vf[kGroup];
    v_blocks_f32(w, nb, g, vf);
    dispatch(static_cast<const float* const*>(vf));
  }
}

// p . v for all rows of kv head hl over the group, by the call's p.v path. V columns no row
// sees may hold NaN (0 * NaN = NaN): every path reads a partly visible block through a copy
// with those columns zeroed, and non-finite values only some rows see are isolated first.
template <typename CT>
inline void pv(ItemState<CT>& w, int64_t hl, int64_t nb, bool first, bool last,
               GroupBlocks<CT>& g) {
  // Dot decodes e4m3 by tables, which keep NaN (isolate_nonfinite finds those only some rows
  // see).
  if constexpr (ItemState<CT>::kScanNan)
    if (w.layout.pv != PvPath::Dot) scan_values(w, hl, nb, g);
  if (w.P.query_start_loc != nullptr) isolate_nonfinite(w, hl, nb, g);
  switch (w.layout.pv) {
    case PvPath::Amx: return pv_path_amx(w, hl, nb, first, g);
    case PvPath::Tiny: return pv_path_tiny(w, hl, nb);
    case PvPath::Dot: return pv_path_dot(w, hl, nb, first, g);
    case PvPath::HalfTile: return pv_path_half(w, hl, nb, first, g);
    case PvPath::RowAny: return pv_path_row_any(w, hl, nb, g);
    case PvPath::Group:
    case PvPath::GroupAny: return pv_path_group(w, hl, nb, first, last, g);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
