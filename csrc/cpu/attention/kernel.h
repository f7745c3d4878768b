// CPU paged attention, written once with at::vec and compiled per CPU capability (each build
// instantiates attention_cache per cache dtype, builds/cache_<dtype>.cpp).
//
// Plan -> items -> merge. make_plan (work_plan.h) cuts a call into work items = (sequence, kv
// heads, chunk of query tokens, split of the block range): every query row of a kv head (its
// tokens x the whole GQA group of heads) is handled together, so each K/V block is read from
// memory once. Decode has one token per sequence and an item takes all kv heads of its blocks
// (contiguous in the cache); when the sequences cannot keep every thread busy, long sequences
// are split over threads and the partial softmax states merged exactly (merge_splits,
// flash-decoding). Multi-token items take one kv head.
//
// An item runs on one thread (ItemState, item.h): start (query rows, empty softmax states),
// then for each group of blocks and each kv head: group_blocks (blocks.h: what to read through
// the block table, what to prefetch), logits (qk_paths.h: q.k by the call's QkPath), the
// softmax step (SoftmaxState::step, softmax.h) and pv (pv_paths.h: p.v by the call's PvPath);
// then finish (normalise, or store a split's partial state). Layout (layout.h) holds the
// per-call constants and chooses both paths; tuning.h the tuning constants; nonfinite.h what
// keeps non-finite cache values where they belong. Blocks are read straight from the cache
// with a blockwise online softmax (docs/concepts.md):
//   m_new = max(m, max_t z_t);  l = l * e^(m - m_new) + sum_t e^(z_t - m_new);
//   acc = acc * e^(m - m_new) + sum_t e^(z_t - m_new) v_t.
// Positions that are not visible (past seq_len in the last block, before the sliding window)
// are excluded by position, never by value, so NaN/Inf in unwritten slots cannot leak.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu/attention/blocks.h"
#include "cpu/attention/item.h"
#include "cpu/attention/pv_paths.h"
#include "cpu/attention/qk_paths.h"
#include "cpu/builds/build.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

template <typename CT>
inline void start(ItemState<CT>& w, const ItemInfo& info) {
  const AttentionParams& P = w.P;
  const Layout<CT>& layout = w.layout;
  Scratch& scratch = w.scratch;
  ItemInfo& it = w.it;
  int64_t& R = w.R;
  int64_t& real_last = w.real_last;
  it = info;
  real_last = it.b_last;
  if (layout.staged() && it.b_first <= it.b_last)
    it.b_last = it.b_first + (it.b_last - it.b_first) / layout.stage.per;
  scratch.v_poison.clear();
  const int64_t G = layout.G, D = layout.D, q_repeat = layout.q_repeat;
  const int64_t num_chunks = layout.num_chunks;
  R = (it.j1 - it.j0) * G;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t Ppos = row_position(P, it.L, it.q_len, it.j0 + r / G);
    scratch.row_P[r] = Ppos;
    scratch.row_lo[r] = first_visible(P, Ppos);
  }
  const bool multi = P.query_start_loc != nullptr;
  // Queries are read by their dtype at run time: the worker is compiled per cache dtype.
  const int64_t qsize = dtype_size(P.dtype);
  const char* q_base = static_cast<const char*>(P.query);
  auto query_row = [&](int64_t hr) {  // row hr % R of kv head it.kvh + hr / R
    const int64_t r = hr % R, j = it.j0 + r / G, h = (it.kvh + hr / R) * G + r % G;
    return q_base + ((it.row0 + (multi ? j : 0)) * P.q_stride_seq + h * P.q_stride_head) * qsize;
  };
  for (int64_t hr = 0; hr < it.nh * R; ++hr) {
    const char* q = query_row(hr);
    scratch.state[hr] = SoftmaxState{};
    if (layout.amx()) continue;  // the query operands are packed below
    if (layout.qk == QkPath::DotBF16) {  // bf16 queries: each chunk's x values, repeated to 2 W
      char* rp = reinterpret_cast<char*>(scratch.qrep.data() + hr * num_chunks * q_repeat);
      // fp8 keys (qk_dot_quads): the chunk's halves, each repeated to 2 W
      const int64_t piece = is_fp8_v<CT> ? layout.x / 2 : layout.x;
      for (int64_t c = 0; c < num_chunks; ++c)
        for (int64_t h = 0; h < layout.x; h += piece)
          for (int64_t i = 0; i < 2 * W; i += piece, rp += piece * qsize)
            std::memcpy(rp, q + (c * layout.x + h) * qsize, piece * qsize);
      continue;
    }
    float* qf = scratch.qf.data();
    query_row_to_f32(q, P.dtype, qf, D, layout.qk_scale);
    fill_qrep(w, qf, scratch.qrep.data() + hr * num_chunks * q_repeat);
  }
  if (layout.amx()) {  // bf16 queries
    const c10::BFloat16* rows[16];
    for (int64_t hl = 0; hl < it.nh; ++hl) {
      for (int64_t r = 0; r < R; ++r)
        rows[r] = reinterpret_cast<const c10::BFloat16*>(query_row(hl * R + r));
      amx_pack_queries(rows, R, D, w.query_tiles(hl));
    }
    // amx_pv_group starts its sums on the first group; an item without blocks has none.
    if (it.b_first > it.b_last || !PAGED_OPS_PHASE_PV)
      std::fill(scratch.amx_o.begin(), scratch.amx_o.begin() + it.nh * D * 16, 0.f);
    return;
  }
  // pv_group, pv_half_tile and pv_dot_tile start their sums themselves on the first group
  // (init); pv_row_any adds, and an item without blocks (empty split, seq_len 0) still
  // turns its sums into rows.
  const bool no_pv = !PAGED_OPS_PHASE_PV || it.b_first > it.b_last;  // sums start at 0
  const bool pv_inits =
      layout.group_pv() || layout.pv == PvPath::HalfTile || layout.pv == PvPath::Dot;
  if (!pv_inits || (no_pv && !layout.group_pv()))
    std::fill(scratch.acc.begin(), scratch.acc.begin() + it.nh * R * layout.acc_row, 0.f);
  else if (no_pv)
    std::fill(scratch.ot.begin(), scratch.ot.begin() + it.nh * R * D, 0.f);
}

// Softmax step of each row of kv head hl over the group: p = e^(z - m_new) (0 where
// hidden). Nothing is read from memory here, so the first rows of the next V blocks are
// prefetched meanwhile, 8 per row, rather than leaving memory idle.
template <typename CT>
inline void softmax(ItemState<CT>& w, int64_t hl, int64_t nb, const GroupBlocks<CT>& g) {
  const Layout<CT>& layout = w.layout;
  Scratch& scratch = w.scratch;
  const int64_t R = w.R;
  // Rows of up to a line each, else lines.
  const int64_t vrow_bytes = layout.bs * static_cast<int64_t>(sizeof(CT));
  const int64_t vpf_stride = std::min<int64_t>(vrow_bytes, 64);
  const int64_t ng = layout.group;  // the next group's blocks (this one's again past the end)
  const int64_t vpf_end = std::min<int64_t>(R * 8, ng * layout.D * vrow_bytes / vpf_stride);
  // The group's logits, padded to whole vectors by -inf (dense rows: nb * block_row may
  // end inside one).
  const int64_t n = round_up(nb * layout.block_row, W);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Accumulators in acc are rescaled here; pv_group's running sums o by pv_group (alpha).
  float* const acc_h = layout.lane_acc ? scratch.acc.data() + hl * R * layout.acc_row : nullptr;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = r * 8; i < std::min(r * 8 + 8, vpf_end); ++i)
      prefetch_l2(reinterpret_cast<const char*>(g.v_next[i % ng]) + i / ng * vpf_stride);
    if (!PAGED_OPS_PHASE_SM) continue;
    float* const pr = scratch.p.data() + r * layout.group_row;
    std::fill(pr + nb * layout.block_row, pr + n, neg_inf);
    scratch.alpha[hl * R + r] = scratch.state[hl * R + r].step(
        scratch.p.data() + r * layout.group_row, n,
        acc_h ? acc_h + r * layout.acc_row : nullptr, layout.acc_len);
  }
}

// Ends the item: the sums of p * v in rows (from pv_group's tiles, or pv_row_any's
// accumulators with their lanes summed), then each row normalised into the output, or
// (split) its unnormalised state stored for merge_splits.
template <typename CT>
inline void finish(ItemState<CT>& w, float* part_ml, float* part_o) {
  const AttentionParams& P = w.P;
  const Layout<CT>& layout = w.layout;
  const Plan& plan = w.plan;
  Scratch& scratch = w.scratch;
  const ItemInfo& it = w.it;
  const int64_t R = w.R;
  const int64_t G = layout.G, D = layout.D;
  const bool multi = P.query_start_loc != nullptr;
  const int64_t osize = dtype_size(P.dtype);
  char* o_base = static_cast<char*>(P.out);
  for (int64_t hl = 0; hl < it.nh; ++hl) {
    const int64_t kvh = it.kvh + hl;
    float* const o_h = scratch.o.data() + hl * R * D;
    if (layout.amx()) {
      const float* ao = scratch.amx_o.data() + hl * D * 16;
      for (int64_t r = 0; r < R; ++r)
        for (int64_t d = 0; d < D; ++d) o_h[r * D + d] = ao[d * 16 + r];
    } else if (layout.group_pv()) {
      rows_from_tiles(scratch.ot.data() + hl * R * D, R, D, o_h);
    } else {
      for (int64_t r = 0; r < R; ++r) {
        const float* acc = scratch.acc.data() + (hl * R + r) * layout.acc_row;
        float* const o = o_h + r * D;
        const int64_t lanes = layout.acc_lanes;
        if (layout.pv == PvPath::Tiny) {  // any number of lanes per row d
          for (int64_t d = 0; d < D; ++d) {
            float sum = 0.f;
            for (int64_t t = 0; t < lanes; ++t) sum += acc[d * lanes + t];
            o[d] = sum;
          }
        } else if (lanes < W) sum_lane_groups(acc, lanes, D, o);
        else reduce_acc(acc, o, D);
      }
    }
    for (const ValuePoison& v : scratch.v_poison)
      if (v.hl == hl) o_h[v.r * D + v.d] += v.add;
    const SoftmaxState* st_h = scratch.state.data() + hl * R;
    if (plan.splits > 1) {
      const int64_t part = (it.s * P.num_kv_heads + kvh) * plan.splits + it.split;
      for (int64_t g = 0; g < G; ++g) {
        part_ml[(part * G + g) * 2] = st_h[g].max;
        part_ml[(part * G + g) * 2 + 1] = st_h[g].sum;
        std::copy(o_h + g * D, o_h + g * D + D, part_o + (part * G + g) * D);
      }
      continue;
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t j = it.j0 + r / G, g = r % G;
      const int64_t token = it.row0 + (multi ? j : 0);
      char* o = o_base + (token * P.out_stride_seq + (kvh * G + g) * P.out_stride_head) * osize;
      store_scaled_as(P.dtype, o_h + r * D, st_h[r].output_scale(layout.v_scale), o, D);
      if (P.lse != nullptr) P.lse[token * P.num_heads + kvh * G + g] = st_h[r].lse();
    }
  }
}

// Exact merge of the splits of each (sequence, kv head, row) by SoftmaxState::merge: the
// unnormalised outputs o summed with the weights it returns, then o / sum. Empty splits
// (sum = 0, max = -inf, o = 0) contribute nothing.
inline void merge_splits(const AttentionParams& P, const Plan& plan, float v_scale,
                  const std::vector<float>& part_ml, const std::vector<float>& part_o) {
  const int64_t G = P.num_heads / P.num_kv_heads;
  const int64_t D = P.head_size;
  const int64_t osize = dtype_size(P.dtype);
  char* o_base = static_cast<char*>(P.out);
  at::parallel_for(0, P.num_seqs * P.num_kv_heads * G, 64, [&](int64_t begin, int64_t end) {
    LineVector<float>& acc = thread_scratch().qf;  // free: the items are done
    grow(acc, D);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t g = w % G;
      const int64_t pair = w / G;  // s * num_kv_heads + kvh
      const int64_t s = pair / P.num_kv_heads, kvh = pair % P.num_kv_heads;
      const int64_t first = pair * plan.splits * G + g;  // row g of the pair's first split
      auto state = [&](int64_t sp) {
        const float* ml = part_ml.data() + (first + sp * G) * 2;
        return SoftmaxState{ml[0], ml[1]};
      };
      // The merged max first: each split's output is then weighted once, by e^(max_i - max)
      // (merge leaves st's weight at 1), whatever order the maxima come in. std::max drops a
      // split's NaN max: nan keeps it for the lse.
      SoftmaxState st;  // sum 0 until the first non-empty split
      bool nan = false;
      for (int64_t sp = 0; sp < plan.splits; ++sp) {
        const SoftmaxState si = state(sp);
        if (!si.empty()) st.max = std::max(st.max, si.max);
        nan |= std::isnan(si.max);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t sp = 0; sp < plan.splits; ++sp) {
        const MergeWeights mw = st.merge(state(sp));
        if (mw.other == 0.f) continue;  // nothing to add (then mw.self is 1)
        if (mw.self != 1.f)
          for (int64_t d = 0; d < D; ++d) acc[d] *= mw.self;
        const float* oi = part_o.data() + (first + sp * G) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] += oi[d] * mw.other;
      }
      char* o = o_base + (s * P.out_stride_seq + (kvh * G + g) * P.out_stride_head) * osize;
      store_scaled_as(P.dtype, acc.data(), st.output_scale(v_scale), o, D);
      if (P.lse != nullptr)
        P.lse[s * P.num_heads + kvh * G + g] =
            nan ? std::numeric_limits<float>::quiet_NaN() : st.lse();
    }
  });
}

template <typename CT>
void attention_cache(const AttentionParams& P) {
  const Plan plan = make_plan(P);
  const Layout<CT> layout(P, plan.tokens_per_chunk * (P.num_heads / P.num_kv_heads));
  // Split-K partial states, per (sequence, kv head, split): [G] of a SoftmaxState's (max, sum),
  // [G][D] of unnormalised output. finish writes every one (an empty split: the empty state,
  // o = 0).
  std::vector<float>& part_ml = call_scratch().part_ml;
  std::vector<float>& part_o = call_scratch().part_o;
  if (plan.splits > 1) {
    const int64_t parts = P.num_seqs * P.num_kv_heads * plan.splits;
    grow(part_ml, parts * layout.G * 2);
    grow(part_o, parts * layout.G * layout.D);
  }
  at::parallel_for(0, plan.num_tasks, 1, [&](int64_t task_begin, int64_t task_end) {
    const int64_t begin = plan.task_start[task_begin], end = plan.task_start[task_end];
    ItemState<CT> w(P, layout, plan, thread_scratch());
    GroupBlocks<CT> g;
    if (layout.amx()) amx_configure(layout.bs);
    for (int64_t item = begin; item < end; ++item) {
      start(w, item_info(P, plan, item));
      // Blocks go in groups of up to kGroup: one softmax step per row and one pass of the
      // p.v accumulators per group, kv head after kv head.
      for (int64_t b0 = w.it.b_first; b0 <= w.it.b_last; b0 += layout.group) {
        const int64_t nb = std::min<int64_t>(layout.group, w.it.b_last - b0 + 1);
        visibility(w, b0, nb, g);
        for (int64_t hl = 0; hl < w.it.nh; ++hl) {
          group_blocks(w, hl, b0, nb, item + 1, end, g);
          logits(w, hl, b0, nb, g);
          softmax(w, hl, nb, g);
          if (PAGED_OPS_PHASE_PV) pv(w, hl, nb, b0 == w.it.b_first, b0 + nb > w.it.b_last, g);
        }
      }
      finish(w, part_ml.data(), part_o.data());
    }
    if (layout.amx()) amx::release();
  });
  if (plan.splits > 1) merge_splits(P, plan, layout.v_scale, part_ml, part_o);
}

// The paths and group a call takes, and which paths a plan may force (KernelTable::describe).
template <typename CT>
void describe_cache(const AttentionParams& P, PlanInfo* info) {
  const int64_t G = P.num_heads / P.num_kv_heads;
  const int64_t rows_max = (P.query_start_loc ? std::max<int64_t>(1, 64 / G) : 1) * G;
  auto with = [&](int32_t qk, int32_t pv) {
    AttentionParams Q = P;
    Q.plan.qk_path = qk;
    Q.plan.pv_path = pv;
    return Layout<CT>(Q, rows_max);
  };
  const Layout<CT> layout(P, rows_max);
  info->qk_path = static_cast<int32_t>(layout.qk);
  info->pv_path = static_cast<int32_t>(layout.pv);
  info->group = static_cast<int32_t>(layout.group);
  info->staged_block_size = layout.staged() ? static_cast<int32_t>(layout.bs) : 0;
  info->split_keys = layout.split_keys;
  info->qk_valid = info->pv_valid = 0;
  for (int i = 0; i <= static_cast<int>(QkPath::Amx); ++i)
    if (static_cast<int>(with(i + 1, 0).qk) == i) info->qk_valid |= 1u << i;
  for (int i = 0; i <= static_cast<int>(PvPath::Amx); ++i)
    if (static_cast<int>(with(0, i + 1).pv) == i) info->pv_valid |= 1u << i;
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
