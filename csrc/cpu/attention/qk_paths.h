// The q.k phase of a group step: the logits of every row of a kv head for each block of the
// group, by the item's q.k path (Layout::qk): qk_tile, qk_tile_dot, qk_tile_fp8 (qk.h) or
// amx_qk_block (amx.h); then the hidden positions, the soft cap and ALiBi (finish_logits).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "cpu/attention/amx.h"
#include "cpu/attention/item.h"
#include "cpu/attention/nonfinite.h"
#include "cpu/attention/qk.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// One query row's q.k operand: chunk c of qf (x elements) repeated to q_repeat lanes, element
// lane mod x in each lane; split_k: lanes [0, W) hold the even elements, [W, 2W) the odd
// ones, each twice (the two tokens of a unit). With vector moves: it runs for every row of
// every item, which short items feel.
template <typename CT>
inline void fill_qrep(ItemState<CT>& w, const float* qf, float* rp) {
  const Layout<CT>& layout = w.layout;
  const int64_t x = layout.x, q_repeat = layout.q_repeat;
  if (layout.qk == QkPath::Fp8Tables) {  // decode_fp8_by_tables' order, chunk by chunk
    for (int64_t c = 0; c < layout.num_chunks; ++c, rp += q_repeat, qf += x)
      for (int h = 0; h < 4; ++h)
        for (int64_t L = 0; L < 4; ++L)
          for (int64_t j = 0; j < 4; ++j) rp[h * W + 4 * L + j] = qf[kFp8TableOrder[h] + 2 * j];
    return;
  }
  if (q_repeat == x) {  // chunk by chunk, the row itself
    std::memcpy(rp, qf, layout.D * sizeof(float));
    return;
  }
  for (int64_t c = 0; c < layout.num_chunks; ++c, rp += q_repeat)
    fill_qrep_chunk(qf + c * x, rp, x, q_repeat, layout.split_k);  // x < q_repeat
}

// The logits of block k (b of the sequence) from its q.k sums (in p already): -inf where a
// row does not see it and in the padding up to block_row, NaN for a key with an e4m3 NaN
// (k_nan), then the soft cap and ALiBi.
template <typename CT>
inline void finish_logits(ItemState<CT>& w, int64_t hl, int64_t k, int64_t b, bool k_nan) {
  const AttentionParams& P = w.P;
  const Layout<CT>& layout = w.layout;
  Scratch& scratch = w.scratch;
  const ItemInfo& it = w.it;
  const int64_t R = w.R;
  const int64_t bs = layout.bs, block_row = layout.block_row;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const int64_t h0 = (it.kvh + hl) * layout.G;
  const int64_t pos = w.first_token(b), n = w.block_tokens(b);
  for (int64_t r = 0; r < R; ++r) {
    float* pr = scratch.p.data() + r * layout.group_row + k * block_row;
    const int64_t t0 = std::clamp<int64_t>(scratch.row_lo[r] - pos, 0, n);
    const int64_t t1 = std::clamp<int64_t>(scratch.row_P[r] + 1 - pos, 0, n);
    if (t0 >= t1) {  // nothing of this block is visible to this row
      std::fill(pr, pr + block_row, neg_inf);
      continue;
    }
    if (layout.amx())
      for (int64_t t = 0; t < bs; ++t) pr[t] *= layout.qk_scale;
    if (k_nan)
      for (int64_t t = 0; t < bs; ++t)
        if (scratch.k_nan[k * bs + t]) pr[t] = std::numeric_limits<float>::quiet_NaN();
    for (int64_t t = bs; t < block_row; ++t) pr[t] = neg_inf;
    if (!layout.plain_logits || t0 > 0 || t1 < bs) {
      const float slope =
          P.alibi_slopes ? P.alibi_slopes[(h0 + r % layout.G) * P.alibi_stride] : 0.f;
      for (int64_t t = 0; t < bs; ++t) {
        if (t < t0 || t >= t1) {
          pr[t] = neg_inf;
          continue;
        }
        float v = pr[t];
        if (P.logits_soft_cap > 0.f) v = P.logits_soft_cap * std::tanh(v / P.logits_soft_cap);
        if (P.alibi_slopes) v += slope * static_cast<float>(pos + t - scratch.row_P[r]);
        pr[t] = v;
      }
    }
  }
}

// Tiles of 4 query rows of kv head hl, then single rows: run(rows, q operands, q.k sums) for
// block k of the group (the tokens of blocks summed together follow each other in raw).
template <typename CT, typename F>
inline void qk_row_tiles(ItemState<CT>& w, int64_t hl, int64_t k, F&& run) {
  const Layout<CT>& layout = w.layout;
  const int64_t R = w.R, q_row = layout.num_chunks * layout.q_repeat;
  const float* const qrep_h = w.scratch.qrep.data() + hl * R * q_row;
  float* const raw = w.scratch.raw.data() + k % layout.sum_blocks * layout.bs * layout.x_sum;
  int64_t r = 0;
  for (; r + 4 <= R; r += 4)
    run(std::integral_constant<int, 4>{}, qrep_h + r * q_row, raw + r * layout.raw_row);
  for (; r < R; ++r)
    run(std::integral_constant<int, 1>{}, qrep_h + r * q_row, raw + r * layout.raw_row);
}

// QkPath::Amx: amx_qk_block (amx.h) writes the unscaled logits into p; a partly visible block
// is read through a copy with its hidden tokens zeroed.
template <typename CT>
inline void qk_path_amx(ItemState<CT>& w, int64_t hl, int64_t k, const GroupBlocks<CT>& g,
                        PrefetchCursor& pf) {
  if constexpr (std::is_same_v<CT, c10::BFloat16>) {
    const Layout<CT>& layout = w.layout;
    const int64_t bs = layout.bs;
    const CT* kb = g.k[k];
    if (!g.clean[k] && (g.t0[k] > 0 || g.t1[k] < bs))
      kb = k_block_masked(kb, reinterpret_cast<CT*>(w.scratch.kraw.data()), layout.num_chunks,
                          bs, layout.x, g.t0[k], g.t1[k]);
    amx_qk_block(kb, w.query_tiles(hl), w.R, layout.D, bs,
                 w.scratch.p.data() + k * layout.block_row, layout.group_row,
                 w.scratch.cbuf.data(), pf);
  }
}

// q.k of key block k of the group for every row of kv head hl, by the call's q.k path: the
// per-lane sums in raw (or, on AMX, the logits in p).
template <typename CT>
inline void qk_block(ItemState<CT>& w, int64_t hl, int64_t k, const GroupBlocks<CT>& g,
                     PrefetchCursor& pf) {
  if (!PAGED_OPS_PHASE_QK) return;
  const Layout<CT>& layout = w.layout;
  const CT* const kb = g.k[k];
  const int64_t nc = layout.num_chunks, ce = layout.chunk_elems, rr = layout.raw_row;
  const int64_t q_repeat = layout.q_repeat;
  switch (layout.qk) {
    case QkPath::Amx: return qk_path_amx(w, hl, k, g, pf);
    case QkPath::DotBF16:  // qk_tile_dot (qk.h)
      if constexpr (kDotCache<CT>)
        qk_row_tiles(w, hl, k, [&](auto rows, const float* qr, float* raw) {
          qk_tile_dot<decltype(rows)::value>(kb, qr, raw, nc, ce, rr, pf);
        });
      return;
    case QkPath::Fp8Tables:  // qk_tile_fp8 (qk.h)
      if constexpr (is_fp8_v<CT> && W == 16)
        qk_row_tiles(w, hl, k, [&](auto rows, const float* qr, float* raw) {
          qk_tile_fp8<decltype(rows)::value>(kb, qr, raw, nc, ce, rr, pf);
        });
      return;
    case QkPath::Tile:  // qk_tile (qk.h), one q chunk per vector where q_repeat is W
      if (q_repeat == W)
        qk_row_tiles(w, hl, k, [&](auto rows, const float* qr, float* raw) {
          qk_tile<decltype(rows)::value, true>(kb, qr, raw, nc, ce, rr, q_repeat, pf);
        });
      else
        qk_row_tiles(w, hl, k, [&](auto rows, const float* qr, float* raw) {
          qk_tile<decltype(rows)::value, false>(kb, qr, raw, nc, ce, rr, q_repeat, pf);
        });
      return;
  }
}

// A pair of blocks k, k + 1 summed together (Layout::pair_qk) for every row: qk_pair_step
// (fp8 keys on QkPath::DotBF16: qk_dot_quads' pair step); pf0 and pf1 are the two blocks'
// cursors.
template <typename CT>
inline void qk_pair(ItemState<CT>& w, int64_t hl, int64_t k, const GroupBlocks<CT>& g,
                    PrefetchCursor& pf0, PrefetchCursor& pf1) {
  if (!PAGED_OPS_PHASE_QK) return;
  const Layout<CT>& layout = w.layout;
  if (layout.qk == QkPath::Tile) {  // fp32 blocks of 2 W elements per chunk
    qk_row_tiles(w, hl, k, [&](auto rows, const float* qr, float* raw) {
      qk_pair_step<decltype(rows)::value, false>(g.k[k], g.k[k + 1], qr, raw, layout.num_chunks,
                                                 layout.chunk_elems, layout.raw_row, pf0, pf1);
    });
    return;
  }
  if constexpr (kDotCache<CT>) {
    qk_row_tiles(w, hl, k, [&](auto rows, const float* qr, float* raw) {
      if constexpr (is_fp8_v<CT>)  // blocks of 2 decodes
        qk_dot_quads<decltype(rows)::value, 4, true>(g.k[k], qr, raw, layout.num_chunks,
                                                     layout.chunk_elems, layout.raw_row, pf0, 0,
                                                     g.k[k + 1], &pf1);
      else
        qk_pair_step<decltype(rows)::value, true>(g.k[k], g.k[k + 1], qr, raw,
                                                  layout.num_chunks, layout.chunk_elems,
                                                  layout.raw_row, pf0, pf1);
    });
  }
}

// Logits of every row of kv head hl for each block of the group: p[r][k * block_row + t]; hidden
// offsets and the padding up to block_row are -inf by position, never computed from cache data.
template <typename CT>
inline void logits(ItemState<CT>& w, int64_t hl, int64_t b0, int64_t nb,
                   const GroupBlocks<CT>& g) {
  const Layout<CT>& layout = w.layout;
  Scratch& scratch = w.scratch;
  const int64_t R = w.R;
  auto& k_rest = w.k_rest;
  constexpr bool kScanNan = ItemState<CT>::kScanNan;
  const int64_t raw_row = layout.raw_row, block_row = layout.block_row, bs = layout.bs;
  // What the q.k sums are multiplied by (in the vectors that sum them): q is scaled already,
  // except in bf16 pairs.
  const float z_scale = layout.qk == QkPath::DotBF16 ? layout.qk_scale : 1.f;
  // The next block's key lines go out over the q.k loop's iterations: every tile of rows
  // (R / 4 + R % 4 tiles), or the AMX loop's.
  const int64_t pf_steps = layout.amx() ? amx_qk_iterations(R, layout.D, bs)
                                      : (R / 4 + R % 4) * layout.qk_iters;
  // Layout::split_keys: the first `head` bytes go out over q.k, the rest over p.v (k_rest);
  // pv_tiny prefetches the next step's V lines itself (every cache type).
  const int64_t kbytes = layout.D * bs * static_cast<int64_t>(sizeof(CT));
  const bool split = layout.split_keys || layout.pv == PvPath::Tiny;
  const int64_t head = split ? kbytes / 2 / 64 * 64 : kbytes;
  const int64_t rest_steps = head < kbytes ? w.pv_calls() : 0;
  const int64_t sum_blocks = layout.sum_blocks;
  bool k_nan[kGroup] = {};
  // Block k's cursor of the next key lines over q.k (pf), and k_rest[k].
  auto cursors = [&](int64_t k, PrefetchCursor& pf) {
    if (layout.staged()) {  // the listed lines, split as above (keys first)
      const char* const* lines = scratch.next_lines.data() + g.line_begin[k];
      const int64_t n = g.line_begin[k + 1] - g.line_begin[k], n_head = split ? n / 2 : n;
      pf = PrefetchCursor(lines, n_head, pf_steps);
      k_rest[k] =
          split ? PrefetchCursor(lines + n_head, n - n_head, w.pv_calls()) : PrefetchCursor();
    } else {
      pf = PrefetchCursor(g.k_next[k], head, pf_steps);
      k_rest[k] = head < kbytes
                      ? PrefetchCursor(reinterpret_cast<const char*>(g.k_next[k]) + head,
                                       kbytes - head, rest_steps)
                      : PrefetchCursor();
    }
  };
  for (int64_t k = 0; k < nb; ++k) {
    if constexpr (kScanNan)  // keys decoded by tables carry their NaN
      k_nan[k] = layout.qk == QkPath::Tile && scan_keys(w, g, k);
    if (layout.pair_qk && k % 2 == 0 && k + 1 < nb) {  // the pair's q.k at once
      PrefetchCursor pf0, pf1;
      cursors(k, pf0);
      cursors(k + 1, pf1);
      qk_pair(w, hl, k, g, pf0, pf1);
    } else if (!layout.pair_qk || k % 2 == 0) {  // (an odd block of a pair is done)
      PrefetchCursor pf;
      cursors(k, pf);
      qk_block(w, hl, k, g, pf);
    }
    // The logits of blocks [k_first, k]: a pair's once both are summed in raw.
    if (k % sum_blocks + 1 < sum_blocks && k + 1 < nb) continue;
    const int64_t k_first = k - k % sum_blocks;
    if (!layout.amx())
      sum_lane_groups_rows(scratch.raw.data(), raw_row, R, layout.x_sum, (k - k_first + 1) * bs,
                           scratch.p.data() + k_first * block_row, layout.group_row, z_scale);
    for (int64_t kk = k_first; kk <= k; ++kk) finish_logits(w, hl, kk, b0 + kk, k_nan[kk]);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
