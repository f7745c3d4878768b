// The state of one work item as a thread runs it (ItemState), the per-thread scratch it lives
// in and the blocks of one group step (GroupBlocks). The phases of an item are functions of an
// ItemState: kernel.h (start, softmax step, finish), blocks.h (which blocks a step reads),
// qk_paths.h (logits), pv_paths.h (p.v), nonfinite.h (non-finite values p.v must not spread).
#pragma once

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/attention/layout.h"
#include "cpu/attention/pv.h"
#include "cpu/attention/softmax.h"
#include "cpu/attention/work_plan.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// A non-finite value of a value block that p.v does not carry to the output itself (an e4m3
// NaN read by the vector decode, scan_values; a value some rows of a multi-token item see and
// others do not, isolate_nonfinite): what it adds to row r's output element d (finish).
struct ValuePoison {
  int64_t hl, r, d;
  float add;
};

// Per-thread scratch, grown on demand and reused across calls (no allocation per block or call
// once warm). R = query rows of one kv head of a work item (tokens x GQA group), HR = rows of
// all its kv heads: the state that lives through the item (qrep, acc, state) has HR rows, the
// per-step buffers R.
struct Scratch {
  LineVector<float> qrep;     // [HR][D/x][q_repeat]: q chunk c (pre-scaled) repeated to q_repeat
  LineVector<float> raw;      // [R][raw_row] per-lane partial q.k sums of a block or a pair of
                              // blocks (Layout::sum_blocks): x_sum lanes per token
  LineVector<float> p;        // [R][group_row] logits, then probabilities of a group
  LineVector<float> acc;      // [HR][acc_row] running sum of p * v, lanes not yet summed (lane_acc)
  LineVector<float> ot;       // [HR][D] running sum of p * v (pv_group), tile-major (tile_sums)
  LineVector<float> alpha;    // [HR] the group's rescale factor of each row's sum (step)
  LineVector<float> o;        // [HR][D] the sum of p * v in rows, at the end of an item
  LineVector<float> qf;       // [D] one query row in fp32, pre-scaled (to fill qrep)
  LineVector<float> vtmp;     // [kGroup][D * bs] fp32 copies of V blocks, hidden columns zeroed
  LineVector<uint8_t> vraw;   // [kGroup][D * bs] copies of V blocks in the cache's type, ditto
  LineVector<uint16_t> pdot;  // [R][kGroup][max(bs, 2 W)] bf16 probabilities (dot_pv)
  LineVector<SoftmaxState> state;  // [HR] running max and normalizer
  std::vector<int64_t> row_P, row_lo;  // [R] per row: last and first visible position
  std::vector<uint8_t> k_nan;  // [kGroup][bs] per token of a key block: an element is an e4m3 NaN
  std::vector<ValuePoison> v_poison;  // the item's non-finite values p.v leaves out
  // The AMX path (PvPath::Amx, amx.h):
  LineVector<uint16_t> qtiles;  // [nh][R / 4][D / 8][512] query operands of q.k
  LineVector<uint32_t> pvnni;   // [group tokens / 2][16] probability operand of p.v
  LineVector<float> amx_o;    // [HR / R][D][16] running sums of p * v, d-major
  LineVector<uint8_t> kraw;   // [D * bs] a key block with hidden tokens zeroed
  LineVector<float> cbuf;     // [512] accumulator tiles stored
  // Staged blocks (Layout::stage, staging.h):
  LineVector<uint8_t> kstage, vstage;  // [kGroup][D * bs] a group's staged K and V blocks
  std::vector<const char*> next_lines;  // the lines of the next step's cache blocks, by slot
  LineVector<float> tiny_pat;  // [kGroup * per][4][tiny_period][W] pv_tiny's patterns
};

inline Scratch& thread_scratch() {
  static thread_local Scratch s;
  return s;
}

// The blocks a group step reads (K and V of one kv head, up to kGroup blocks) and the ones to
// prefetch meanwhile (next).
template <typename CT>
struct GroupBlocks {
  int64_t b0;  // the group's first block (of the sequence)
  const CT* k[kGroup];
  const CT* v[kGroup];
  const CT* k_next[kGroup];
  const CT* v_next[kGroup];
  int64_t t0[kGroup], t1[kGroup];  // offsets of block k visible to some row of the item
  int64_t a0[kGroup], a1[kGroup];  // offsets of block k visible to every row (may be empty)
  bool isolated[kGroup];  // block k holds non-finite values in [t0, t1) outside [a0, a1)
  bool clean[kGroup];  // block k is staged: zero outside [t0, t1) already
  // Staged blocks: the lines of the next step's cache blocks for block k's prefetch cursors,
  // next_lines[line_begin[k], line_begin[k + 1]), its keys' lines first.
  int64_t line_begin[kGroup + 1];
};

// The work of one thread on its items: the per-item state lives in the thread's Scratch.
// Rows of each kv head are token-major, head-minor (R per kv head; the state of kv head
// it.kvh + hl is rows [hl * R, (hl + 1) * R) of qrep, acc and state).
template <typename CT>
struct ItemState {
  const AttentionParams& P;
  const Layout<CT>& layout;
  const Plan& plan;
  Scratch& scratch;
  const CT* const kc;
  const CT* const vc;
  ItemInfo it{};
  int64_t R = 0;  // query rows of one kv head of the item
  // Staged blocks: it.b_last is the item's last staged block, counted from it.b_first (staged
  // block b starts at cache block real_first(b)), and real_last its last cache block.
  int64_t real_last = -1;
  // pv_tiny's V blocks of the group step (stage_group): those some row sees, in place or
  // through copies with hidden columns zeroed, and their offsets in the probability rows.
  const CT* tiny_v[kGroup * kMaxStagePer];
  int64_t tiny_off[kGroup * kMaxStagePer];
  int64_t tiny_n = 0;
  // The key lines of the next blocks that p.v prefetches (the rest after q.k's share), one
  // cursor per block of the group: 16-bit caches on the 16-lane builds (Layout::split_keys).
  PrefetchCursor k_rest[kGroup];
  // e4m3 caches where the vector decode reads NaN as a finite number (fp8.h, is_e4m3_nan):
  // each key and value block is scanned before it is read (e4m3_has_nan), and a NaN found at
  // a visible position sets the logit of its token (scan_keys) or the output element of its
  // row d (scan_values, through add_nonfinite and finish) to NaN, for the rows that see it, as
  // reading it would. Keys read by table decode (Layout::fp8_tables) carry their NaN themselves.
  static constexpr bool kScanNan = kDecodeFp8 && std::is_same_v<CT, c10::Float8_e4m3fn>;

  ItemState(const AttentionParams& P_, const Layout<CT>& layout_, const Plan& plan_,
             Scratch& scratch_)
      : P(P_), layout(layout_), plan(plan_), scratch(scratch_),
        kc(static_cast<const CT*>(P_.key_cache)),
        vc(static_cast<const CT*>(P_.value_cache)) {
    const int64_t R_max = plan.tokens_per_chunk * layout.G;     // rows of one kv head
    const int64_t HR_max = R_max * plan.heads_per_item;    // rows of an item
    grow(scratch.qrep, HR_max * layout.num_chunks * layout.q_repeat);
    grow(scratch.raw, R_max * layout.raw_row);
    // pack_dot_probabilities reads a whole vector at each block's row: with dense rows, the
    // last block of the last row ends short of it.
    grow(scratch.p, R_max * layout.group_row + W);
    if (layout.lane_acc) grow(scratch.acc, HR_max * layout.acc_row);
    if (layout.amx()) {
      const int64_t D = layout.D;
      grow(scratch.qtiles, plan.heads_per_item * ((R_max + 3) / 4) * (D / kAmxX) * 512);
      grow(scratch.pvnni, kGroup * layout.bs / 2 * 16);
      grow(scratch.amx_o, plan.heads_per_item * D * 16);
      grow(scratch.kraw, D * layout.bs * static_cast<int64_t>(sizeof(CT)));
      grow(scratch.cbuf, 512);
    }
    grow(scratch.ot, HR_max * layout.D);
    grow(scratch.alpha, HR_max);
    grow(scratch.o, HR_max * layout.D);
    grow(scratch.qf, layout.D);
    grow(scratch.vtmp, kGroup * layout.D * layout.bs);
    grow(scratch.vraw, kGroup * layout.D * layout.bs * static_cast<int64_t>(sizeof(CT)));
    if (layout.pv == PvPath::Dot) grow(scratch.pdot, R_max * pdot_row());
    grow(scratch.state, HR_max);
    scratch.row_P.resize(R_max);
    scratch.row_lo.resize(R_max);
    if (kScanNan) scratch.k_nan.resize(kGroup * layout.bs);
    if (layout.staged()) {
      const int64_t bytes = kGroup * layout.D * layout.bs * static_cast<int64_t>(sizeof(CT));
      grow(scratch.kstage, bytes);
      if (layout.pv != PvPath::Tiny) grow(scratch.vstage, bytes);
      // Lines of kGroup * per cache blocks, keys and values, each run one line more where
      // it does not start a line.
      const int64_t run = layout.D * layout.cache_bs * static_cast<int64_t>(sizeof(CT));
      grow(scratch.next_lines, kGroup * layout.stage.per * 2 * (run / 64 + 2));
      if (layout.pv == PvPath::Tiny)
        grow(scratch.tiny_pat, kGroup * layout.stage.per * 4 * layout.tiny_period * W);
    }
  }

  // Staged blocks (Layout::stage): the first cache block of staged block b, its first token's
  // position and its tokens (the item's last staged block may hold fewer cache blocks). Not
  // staged: block b itself.
  int64_t real_first(int64_t b) const {
    return layout.staged() ? it.b_first + (b - it.b_first) * layout.stage.per : b;
  }
  int64_t first_token(int64_t b) const { return real_first(b) * layout.cache_bs; }
  int64_t block_tokens(int64_t b) const {
    if (!layout.staged()) return layout.bs;
    return std::min(layout.stage.per, real_last - real_first(b) + 1) * layout.cache_bs;
  }

  // K and V of blocks [b, b + n) of sequence s, kv head kvh, through the block table.
  void blocks(int64_t s, int64_t kvh, int64_t b, int64_t n, const CT** k_out,
              const CT** v_out) const {
    const int32_t* table = P.block_tables + s * P.bt_stride_seq;
    const int64_t head = kvh * (layout.D * layout.cache_bs);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t col = block_column(b + k);
      const int64_t blk = table[col * P.bt_stride_col];
      k_out[k] = kc + blk * P.k_stride_block + head;
      v_out[k] = vc + blk * P.v_stride_block + head;
    }
  }

  // Steps of p.v per block over all rows of a kv head (k_rest's): pv_half_tile's steps, or
  // pv_group's vector iterations.
  int64_t pv_calls() const {
    const int64_t tiles = R / 4 + R % 4;
    switch (layout.pv) {
      case PvPath::Tiny: return tiles * pv_tiny_steps(layout.D, layout.cache_bs);
      case PvPath::HalfTile: return tiles * pv_half_steps(layout.D, layout.rows_per_vector);
      case PvPath::GroupAny: return tiles * pv_any_steps(layout.D) * layout.NV;
      default: {  // pv_group's, with its template NVc
        const int nv = static_cast<int>(std::min<int64_t>(layout.NV, 4));
        return tiles * pv_steps(nv, layout.D) * layout.NV;
      }
    }
  }

  // A row of pdot: the probability operand of pv_dot_tile for the blocks of a group.
  int64_t pdot_row() const { return kGroup * std::max<int64_t>(layout.bs, 2 * W); }

  // The AMX query operands of kv head hl (amx_pack_queries): R / 4 quads of D / 8 tiles.
  uint16_t* query_tiles(int64_t hl) {
    return scratch.qtiles.data() + hl * ((R + 3) / 4) * (layout.D / kAmxX) * 512;
  }
};

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
