// Which blocks a group step reads and which it prefetches meanwhile, for an item's rows:
// visibility (the offsets each block shows its rows), group_blocks (K and V of a kv head
// through the block table, and the next step's blocks), stage_group (the same for block sizes
// read through staged copies, staging.h).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cpu/attention/item.h"
#include "cpu/attention/staging.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// Visible offsets of the group's blocks [b0, b0 + nb) for the item's rows together.
template <typename CT>
inline void visibility(ItemState<CT>& w, int64_t b0, int64_t nb, GroupBlocks<CT>& g) {
  const Layout<CT>& layout = w.layout;
  Scratch& scratch = w.scratch;
  const ItemInfo& it = w.it;
  const int64_t R = w.R;
  g.b0 = b0;
  // Rows see ranges that grow with their position: the last row's start and the first
  // row's end bound what every row sees.
  const int64_t lo_all = scratch.row_lo[R - 1], P_all = scratch.row_P[0];
  for (int64_t k = 0; k < nb; ++k) {
    const int64_t pos = w.first_token(b0 + k), n = w.block_tokens(b0 + k);
    g.t0[k] = std::clamp<int64_t>(it.lo_min - pos, 0, n);
    g.t1[k] = std::clamp<int64_t>(it.P_max + 1 - pos, 0, n);
    g.a0[k] = std::clamp<int64_t>(lo_all - pos, g.t0[k], g.t1[k]);
    g.a1[k] = std::clamp<int64_t>(P_all + 1 - pos, g.a0[k], g.t1[k]);
    g.isolated[k] = false;
    g.clean[k] = layout.staged();
  }
}

// The blocks of kv head hl of the group and what to prefetch while they are read: the same
// blocks' next kv head (the bytes that follow), after the last one the next group's first,
// after the last group the first group of the thread's next item (next_item < end).
template <typename CT>
inline void group_blocks(ItemState<CT>& w, int64_t hl, int64_t b0, int64_t nb, int64_t next_item,
                         int64_t end, GroupBlocks<CT>& g) {
  const AttentionParams& P = w.P;
  const Layout<CT>& layout = w.layout;
  const Plan& plan = w.plan;
  const ItemInfo& it = w.it;
  if (layout.staged()) return stage_group(w, hl, b0, nb, next_item, end, g);
  const int64_t kvh = it.kvh + hl;
  w.blocks(it.s, kvh, b0, nb, g.k, g.v);
  int64_t nb_next = 0;
  if (!layout.prefetch) {
    // A plan without prefetches: the "next" blocks are this group's (below).
  } else if (hl + 1 < it.nh) {
    nb_next = nb;
    w.blocks(it.s, kvh + 1, b0, nb, g.k_next, g.v_next);
  } else if (b0 + nb <= it.b_last) {
    nb_next = std::min<int64_t>(layout.group, it.b_last - b0 - nb + 1);
    w.blocks(it.s, it.kvh, b0 + nb, nb_next, g.k_next, g.v_next);
  } else if (next_item < end) {
    const ItemInfo nx = item_info(P, plan, next_item);
    nb_next = std::clamp<int64_t>(nx.b_last - nx.b_first + 1, 0, layout.group);
    w.blocks(nx.s, nx.kvh, nx.b_first, nb_next, g.k_next, g.v_next);
  }
  for (int64_t k = nb_next; k < kGroup; ++k) {  // nothing left: this group again, harmless
    g.k_next[k] = g.k[std::min<int64_t>(k, nb - 1)];
    g.v_next[k] = g.v[std::min<int64_t>(k, nb - 1)];
  }
}

// group_blocks for staged blocks: the group's cache blocks of kv head hl copied into staged
// blocks (stage_block), and the lines of the next step's cache blocks (as group_blocks
// chooses them) listed for the prefetch cursors of q.k and p.v, next staged block j in slot
// j % nb. The copies' own prefetches (next) point at the staged blocks: cache hits.
template <typename CT>
inline void stage_group(ItemState<CT>& w, int64_t hl, int64_t b0, int64_t nb, int64_t next_item,
                        int64_t end, GroupBlocks<CT>& g) {
  const AttentionParams& P = w.P;
  const Layout<CT>& layout = w.layout;
  const Plan& plan = w.plan;
  Scratch& scratch = w.scratch;
  const ItemInfo& it = w.it;
  int64_t& real_last = w.real_last;
  auto& tiny_v = w.tiny_v;
  auto& tiny_off = w.tiny_off;
  int64_t& tiny_n = w.tiny_n;
  const int64_t D = layout.D, cbs = layout.cache_bs, size = layout.bs, per = layout.stage.per;
  const int64_t esize = static_cast<int64_t>(sizeof(CT));
  const int64_t block_bytes = D * size * esize, run = D * cbs * esize;
  const CT* rk[kMaxStagePer];
  const CT* rv[kMaxStagePer];
  int64_t t0[kMaxStagePer], t1[kMaxStagePer];
  for (int64_t k = 0; k < nb; ++k) {
    const int64_t rf = w.real_first(b0 + k), n = std::min(per, real_last - rf + 1);
    w.blocks(it.s, it.kvh + hl, rf, n, rk, rv);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = (rf + j) * cbs;
      t0[j] = std::clamp<int64_t>(it.lo_min - pos, 0, cbs);
      t1[j] = std::clamp<int64_t>(it.P_max + 1 - pos, 0, cbs);
    }
    char* kdst = reinterpret_cast<char*>(scratch.kstage.data()) + k * block_bytes;
    stage_block(reinterpret_cast<const char* const*>(rk), n, t0, t1, cbs, size,
                layout.num_chunks, layout.x * esize, kdst);
    g.k[k] = g.k_next[k] = reinterpret_cast<const CT*>(kdst);
    if (layout.pv == PvPath::Tiny) {
      if (k == 0) tiny_n = 0;
      CT* const masked = reinterpret_cast<CT*>(scratch.vraw.data());
      for (int64_t j = 0; j < n; ++j) {
        if (t0[j] >= t1[j]) continue;  // its probabilities are 0 for every row
        tiny_v[tiny_n] = t0[j] == 0 && t1[j] == cbs
                             ? rv[j]
                             : v_block_masked(rv[j], masked + tiny_n * D * cbs, D, cbs, t0[j],
                                              t1[j]);
        tiny_off[tiny_n++] = k * layout.block_row + j * cbs;
      }
      g.v[k] = g.v_next[k] = rv[0];  // read by no one but the softmax step's prefetches
      continue;
    }
    char* vdst = reinterpret_cast<char*>(scratch.vstage.data()) + k * block_bytes;
    stage_block(reinterpret_cast<const char* const*>(rv), n, t0, t1, cbs, size, D, esize, vdst);
    g.v[k] = g.v_next[k] = reinterpret_cast<const CT*>(vdst);
  }
  for (int64_t k = nb; k < kGroup; ++k) {
    g.k_next[k] = g.k[nb - 1];
    g.v_next[k] = g.v[nb - 1];
  }
  const char** lines = scratch.next_lines.data();
  int64_t n_lines = 0;
  // The next step: (sequence, kv head, first cache block, cache blocks) of its staged blocks.
  int64_t s = it.s, kvh = it.kvh + hl + 1, first = w.real_first(b0), last = real_last;
  int64_t count = 0;  // staged blocks
  if (!layout.prefetch) {
    // A plan without prefetches: no lines listed.
  } else if (hl + 1 < it.nh) {
    count = nb;
    last = std::min(last, first + nb * per - 1);
  } else if (b0 + nb <= it.b_last) {
    kvh = it.kvh;
    first = w.real_first(b0 + nb);
    count = std::min<int64_t>(layout.group, it.b_last - b0 - nb + 1);
  } else if (next_item < end) {
    const ItemInfo nx = item_info(P, plan, next_item);
    s = nx.s;
    kvh = nx.kvh;
    first = nx.b_first;
    last = nx.b_last;
    count = nx.b_last >= nx.b_first
                ? std::min<int64_t>(layout.group, (nx.b_last - nx.b_first) / per + 1)
                : 0;
  }
  for (int64_t k = 0; k < nb; ++k) {  // slot k: its blocks' key lines, then value lines
    g.line_begin[k] = n_lines;
    const CT* slot_v[kGroup * kMaxStagePer];
    int64_t n_v = 0;
    for (int64_t j = k; j < count; j += nb) {
      const int64_t rf = first + j * per, n = std::min(per, last - rf + 1);
      w.blocks(s, kvh, rf, n, rk, slot_v + n_v);
      for (int64_t i = 0; i < n; ++i) n_lines = add_lines(rk[i], run, lines, n_lines);
      n_v += n;
    }
    for (int64_t i = 0; i < n_v; ++i) n_lines = add_lines(slot_v[i], run, lines, n_lines);
  }
  g.line_begin[nb] = n_lines;
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
