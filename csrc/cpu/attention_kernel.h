// CPU paged attention, written once with at::vec and compiled per CPU capability (the including
// file defines CPU_CAPABILITY; see kernels.h and setup.py).
//
// Work item = (sequence, kv heads, chunk of query tokens, split of the block range): every query
// row of a kv head (its tokens x the whole GQA group of heads) is handled together, so each K/V
// block is read from memory once. Decode has one token per sequence and an item takes all kv
// heads of its blocks (contiguous in the cache); when the sequences cannot keep every thread
// busy, long sequences are split over threads and the partial softmax states merged exactly
// (flash-decoding), then the kv heads. Multi-token items take one kv head. Blocks are read
// straight from the cache through the block table (no gathered copy) with a blockwise online
// softmax (docs/concepts.md), each row's max m and sum l in a SoftmaxState (softmax.h):
//   m_new = max(m, max_t z_t);  l = l * e^(m - m_new) + sum_t e^(z_t - m_new);
//   acc = acc * e^(m - m_new) + sum_t e^(z_t - m_new) v_t.
// Positions that are not visible (past seq_len in the last block, before the sliding window)
// are excluded by position, never by value, so NaN/Inf in unwritten slots cannot leak.
//
// Reading order: make_plan cuts the call into items, item_info says what an item covers
// (work_plan.h), and ItemWorker (here) runs an item on one thread: start (query rows), then for
// each group of blocks and each kv head group_blocks (what to read and prefetch), logits (q.k,
// qk_tile in qk.h), softmax (SoftmaxState::step, softmax.h) and pv (pv_group, pv.h), and
// finish (normalise, or store a split's partial state for merge_splits, which combines them
// with SoftmaxState::merge). Loads of cache elements as fp32 lanes and prefetches:
// element_loads.h; the fp8 formats: fp8.h; what an instruction set does its own way (fp8
// decode, bf16 pairs, lane sums): isa.h, which picks isa_avx2.h, isa_avx512.h or the portable
// versions in isa_portable.h.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu/amx_attention.h"
#include "cpu/fp8.h"
#include "cpu/element_loads.h"
#include "cpu/kernels.h"
#include "cpu/pv.h"
#include "cpu/qk.h"
#include "cpu/softmax.h"
#include "cpu/staging.h"
#include "cpu/work_plan.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// Switches for benchmarks/kernel_phases.py, which times the phases of the kernel by building
// it without each one (the others then run on stale but finite data): q.k, the softmax step,
// p.v; PHASE_ARITH reads only the first two blocks of every sequence, alternately, so K and V
// come from the core's caches and a call costs its arithmetic alone. The library builds leave
// them as they are here.
#ifndef PAGED_OPS_PHASE_ARITH
#define PAGED_OPS_PHASE_ARITH 0
#endif
#ifndef PAGED_OPS_PHASE_QK
#define PAGED_OPS_PHASE_QK 1
#endif
#ifndef PAGED_OPS_PHASE_SM
#define PAGED_OPS_PHASE_SM 1
#endif
#ifndef PAGED_OPS_PHASE_PV
#define PAGED_OPS_PHASE_PV 1
#endif

// Two blocks of W / 2 tokens summed across lanes together (Layout::sum_blocks); 0 for one at a
// time.
#ifndef PAGED_OPS_SUM_BLOCK_PAIRS
#define PAGED_OPS_SUM_BLOCK_PAIRS 1
#endif

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
  LineVector<uint16_t> pdot;  // [R][kGroup][2 W] bf16 probabilities (dot_pv)
  LineVector<SoftmaxState> state;  // [HR] running max and normalizer
  std::vector<int64_t> row_P, row_lo;  // [R] per row: last and first visible position
  std::vector<uint8_t> k_nan;  // [kGroup][bs] per token of a key block: an element is an e4m3 NaN
  std::vector<ValuePoison> v_poison;  // the item's non-finite values p.v leaves out
  // The AMX path (Layout::amx, amx_attention.h):
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

// Per-call constants: the scratch geometry and how the cache type CT is read.
template <typename CT>
struct Layout {
  // bs: the block size the kernel reads, the cache's (cache_bs) or that of staged blocks
  // (stage, staging.h).
  int64_t G, D, bs, x, num_chunks, chunk_elems;
  int64_t cache_bs;
  StageShape stage;
  int64_t raw_row;  // raw row, padded to whole vectors
  // Probability row of one block: padded to whole vectors, except that block sizes dividing W
  // pack their rows densely (block size 8 on 16 lanes: a group's 32 logits take two vectors
  // in the softmax step, not four; 1.00-1.10x per call at block size 8).
  int64_t block_row;
  int64_t group_row;  // probabilities of a group of blocks, whole vectors
  int64_t group;  // blocks per group (kGroupBytes of keys, at most kGroup)
  // Row stride of the p.v accumulators: D * W lanes plus one cache line, so the rows of a tile
  // (touched together) do not fall in the same L1 sets when D * W * 4 is a multiple of 4 KiB.
  int64_t acc_row;
  // bf16 keys with an even block size are read in pairs (load_bf16_pairs): units of two
  // tokens' chunks, split into even and odd elements, each half paired with the q chunk's
  // even / odd elements.
  bool split_k;
  // q.k by bf16 pair dot products (qk_tile_dot): a bf16 cache read with bf16 queries where the
  // CPU has them (kDotBF16) and the block's chunk is whole units of 2 W elements. qrep then
  // holds the unscaled bf16 q (qk_scale multiplies the logits instead: q stays exact).
  bool dot_bf16;
  // q.k of fp8 keys by table decode (qk_tile_fp8): where the build has it (kFp8Tables, 16
  // lanes) and the chunk is whole units of 4 W bytes. qrep then holds each q chunk in the
  // order decode_fp8_by_tables leaves (4 W floats), and raw 4 lanes per token.
  bool fp8_tables;
  int64_t q_repeat;     // q chunk repetition length (x, W: powers of 2)
  int64_t x_sum;  // raw lanes per token
  // Blocks whose q.k sums are summed across lanes together (1 or 2): two blocks of W / 2
  // tokens at 4 lanes per token fill the 4 vectors that one sum of sum_lane_groups reads,
  // where one block fills half of them (bf16 pairs and fp8 tables at block size 8 on 16
  // lanes: 1.00-1.04x per call). At 8 lanes per token one block fills them already, and
  // pairs measured 0.95-0.98x (fp16).
  int64_t sum_blocks;
  int64_t NV;            // V row vectors in the fast PV path
  bool fast_pv;
  // Of fast_pv, the block sizes above W whose vector count pv_group does not take, or (16
  // lanes) that end half a vector short of one: p.v by pv_group_any (half_rows: the latter).
  bool any_pv, half_rows;
  // Block size W / 2, or W / 4 from 4 (acc_lanes >= 4): p.v by pv_half_tile, rows_per_vector
  // V rows per vector.
  bool half_pv;
  int64_t rows_per_vector;
  bool lane_acc;  // the p.v sums live in acc between groups (pv_row_any, or kLaneAcc)
  // p.v by bf16 pair dot products (pv_dot_tile): a bf16 cache read with bf16 queries where the
  // CPU has them (kDotBF16), block sizes W / 2 and W, off AMX. The probabilities are rounded
  // to bf16 for it, as for AMX tiles (bf16 queries: the output is bf16 too). No conversion of
  // V, and one instruction per 2 W multiply-adds where fp32 takes two: 15-18% less time in
  // p.v at block sizes 8 and 32 (kernel_phases.py), 1.02-1.08x per call at 8 and 16 on the
  // Xeon of benchmarks/RESULTS.md, 0.96-0.99x at 128 and 256 (vdpbf16ps there runs at a
  // quarter of the FMA rate, half the multiply-adds), hence the small blocks only.
  bool dot_pv;
  int64_t dot_accs;  // dot_pv: accumulators per query row, D * bs / 2 W
  int64_t acc_lanes;  // lanes of acc per row d, summed at the end (sum_lane_groups)
  int64_t acc_len;  // floats of a row of acc that hold sums (what SoftmaxState::step rescales)
  int64_t qk_iters;      // chunk iterations of one qk_tile call
  bool plain_logits;  // no soft cap, no ALiBi
  // (q . s_k k) scale = s_k scale (q . k); fp8_unit: see fp8_unit().
  float qk_scale, v_scale;
  // q.k and p.v on AMX tiles (amx_attention.h): a bf16 cache read with bf16 queries, in the
  // builds with tiles (kAmx) where the OS grants them, when the block size splits into whole
  // tiles and the rows of a kv head fit in one p.v tile (rows_max: tokens x GQA group).
  bool amx;

  Layout(const AttentionParams& P, int64_t rows_max)
      : G(P.num_heads / P.num_kv_heads), D(P.head_size), bs(P.block_size), x(P.x),
        cache_bs(P.block_size) {
    derive(P, rows_max);
    // Block sizes below W that no fast p.v path takes (pv_row_any's) are staged, as are those
    // below PAGED_OPS_STAGE_BELOW; staged blocks of at least PAGED_OPS_STAGE_MIN tokens. W / 4
    // on 16 lanes (pv_half_tile's) staged: 16-bit caches 1.01-1.12x, fp8 1.08-1.22x, fp32
    // 0.89-0.95x; on 8 lanes (W / 2) 0.60-0.92x. Above W, pv_row_any's block sizes are staged
    // for caches narrower than fp32 where whole blocks fill a staged one: on 8 lanes 12 in 24,
    // 28 in 224; on 16 lanes none (those that could be are multiples of W / 2, pv_group_any's:
    // at 24, against 2 in 48, 0.99-1.07x for 16-bit caches and 1.13-1.22x for fp8, where 2 in
    // 48 measured 1.25-1.35x over pv_row_any; fp32 staged 0.85-0.94x; 40 and 80, padded,
    // 0.91-1.02x).
    const bool fast = fast_pv || half_pv || dot_pv || amx;
    const bool quarter = W == 16 && 4 * cache_bs == W && sizeof(CT) < 4 && !amx;
    const bool above = !fast && cache_bs > W && sizeof(CT) < 4;
    if ((!fast && cache_bs < W) || cache_bs < PAGED_OPS_STAGE_BELOW || quarter || above) {
      stage = stage_shape(cache_bs, PAGED_OPS_STAGE_MIN);
      if (above && stage.per * cache_bs != stage.size) stage = {};
      if (stage.per > 0) {
        bs = stage.size;
        derive(P, rows_max);
      }
    }
    // Staged keys, values read in place by pv_tiny (decode: multi-token items isolate
    // non-finite values in staged copies; not on AMX tiles).
    tiny_pv = staged() && cache_bs < W && D * cache_bs % W == 0 &&
              P.query_start_loc == nullptr && !amx;
    if (tiny_pv) {
      fast_pv = half_pv = dot_pv = false;
      lane_acc = true;
      acc_lanes = cache_bs;
      acc_len = D * acc_lanes;
      tiny_period = cache_bs / std::gcd(cache_bs, W);
      for (int64_t q = 0; q < tiny_period; ++q)
        for (int64_t i = 0; i < W; ++i)
          tiny_idx[q * W + i] = static_cast<int32_t>((q * W + i) % cache_bs);
    }
  }

  bool staged() const { return stage.per > 0; }
  // Block sizes below W, staged: p.v by pv_tiny on the cache's V blocks, not staged copies;
  // its probability patterns repeat every tiny_period vectors, lane i of pattern q holding
  // token tiny_idx[q * W + i] (tiny_patterns).
  bool tiny_pv = false;
  int64_t tiny_period = 1;
  int32_t tiny_idx[W * W] = {};

  // Everything that follows from the block size read (bs).
  void derive(const AttentionParams& P, int64_t rows_max) {
    num_chunks = D / x;
    chunk_elems = bs * x;
    raw_row = round_up(chunk_elems, W);
    block_row = bs < W && W % bs == 0 ? bs : round_up(bs, W);
    group_row = round_up(kGroup * block_row, W);
    group = std::clamp<int64_t>(kGroupBytes / (bs * D * static_cast<int64_t>(sizeof(CT))), 1,
                                kGroup);
    acc_row = D * W + 16;
    dot_bf16 = kDotBF16 && std::is_same_v<CT, c10::BFloat16> && P.dtype == DType::BF16 &&
               chunk_elems % (2 * W) == 0;
    split_k = kSplitPairs<CT> && x == W && bs % 2 == 0;
    fp8_tables = kFp8Tables && is_fp8_v<CT> && W == 16 && x == W && chunk_elems % (4 * W) == 0;
    q_repeat = fp8_tables ? 4 * W : dot_bf16 ? W : split_k ? 2 * W : std::max<int64_t>(x, W);
    x_sum = fp8_tables ? 4 : dot_bf16 || q_repeat == 2 * W ? x / 2 : x;
    NV = bs / W;
    fast_pv = bs % W == 0 && (NV <= 3 || NV % 4 == 0);
    any_pv = !fast_pv && bs > W && D % 2 == 0 && (bs % W == 0 || (W == 16 && 2 * bs % W == 0));
    half_rows = any_pv && bs % W != 0;
    if (any_pv) {
      fast_pv = true;
      NV = (bs + W - 1) / W;
    }
    rows_per_vector = 2 * bs == W ? 2 : 4 * bs == W && bs >= 4 ? 4 : 0;
    half_pv = rows_per_vector > 0 && D % rows_per_vector == 0;
    lane_acc = !fast_pv || kLaneAcc;
    plain_logits = P.logits_soft_cap <= 0.f && P.alibi_slopes == nullptr;
    qk_iters = dot_bf16      ? qk_dot_iterations(chunk_elems, num_chunks)
               : fp8_tables ? qk_fp8_iterations(chunk_elems, num_chunks)
                            : qk_tile_iterations(chunk_elems, num_chunks, q_repeat);
    qk_scale = P.scale * P.k_scale * fp8_unit<CT>();
    v_scale = P.v_scale * fp8_unit<CT>();
    amx = kAmx && std::is_same_v<CT, c10::BFloat16> && P.dtype == DType::BF16 && x == kAmxX &&
          D % 16 == 0 && amx_block_size_ok(bs) && rows_max <= 16 && amx::usable();
    if (amx) lane_acc = false;
    sum_blocks = PAGED_OPS_SUM_BLOCK_PAIRS && 2 * bs == W && x_sum <= 4 && !amx ? 2 : 1;
    raw_row = std::max(raw_row, round_up(sum_blocks * bs * x_sum, W));
    dot_pv = kDotBF16 && std::is_same_v<CT, c10::BFloat16> && P.dtype == DType::BF16 && !amx &&
             (bs == W / 2 || bs == W) && D * bs % (2 * W) == 0;
    dot_accs = D * bs / (2 * W);
    if (dot_pv) {
      fast_pv = half_pv = false;
      lane_acc = true;
    }
    acc_lanes = dot_pv ? bs / 2 : half_pv ? bs : W;
    acc_len = D * acc_lanes;
  }
};

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
template <typename QT, typename CT>
struct ItemWorker {
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
  // cursor per block of the group: 16-bit caches on the 16-lane builds (see logits).
  static constexpr bool kSplitKeyPrefetch = sizeof(CT) == 2 && W == 16;
  PrefetchCursor k_rest[kGroup];
  // e4m3 caches where the vector decode reads NaN as a finite number (fp8.h, is_e4m3_nan):
  // each key and value block is scanned before it is read (e4m3_has_nan), and a NaN found at
  // a visible position sets the logit of its token (scan_keys) or the output element of its
  // row d (scan_values, through add_nonfinite and finish) to NaN, for the rows that see it, as
  // reading it would. Keys read by table decode (Layout::fp8_tables) carry their NaN themselves.
  static constexpr bool kScanNan = kDecodeFp8 && std::is_same_v<CT, c10::Float8_e4m3fn>;

  ItemWorker(const AttentionParams& P_, const Layout<CT>& layout_, const Plan& plan_,
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
    if (layout.amx) {
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
    if (layout.dot_pv) grow(scratch.pdot, R_max * pdot_row());
    grow(scratch.state, HR_max);
    scratch.row_P.resize(R_max);
    scratch.row_lo.resize(R_max);
    if (kScanNan) scratch.k_nan.resize(kGroup * layout.bs);
    if (layout.staged()) {
      const int64_t bytes = kGroup * layout.D * layout.bs * static_cast<int64_t>(sizeof(CT));
      grow(scratch.kstage, bytes);
      if (!layout.tiny_pv) grow(scratch.vstage, bytes);
      // Lines of kGroup * per cache blocks, keys and values, each run one line more where
      // it does not start a line.
      const int64_t run = layout.D * layout.cache_bs * static_cast<int64_t>(sizeof(CT));
      grow(scratch.next_lines, kGroup * layout.stage.per * 2 * (run / 64 + 2));
      if (layout.tiny_pv)
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
      const int64_t col = PAGED_OPS_PHASE_ARITH ? (b + k) % 2 : b + k;
      const int64_t blk = table[col * P.bt_stride_col];
      k_out[k] = kc + blk * P.k_stride_block + head;
      v_out[k] = vc + blk * P.v_stride_block + head;
    }
  }

  // One query row's q.k operand: chunk c of qf (x elements) repeated to q_repeat lanes, element
  // lane mod x in each lane; split_k: lanes [0, W) hold the even elements, [W, 2W) the odd
  // ones, each twice (the two tokens of a unit). With vector moves: it runs for every row of
  // every item, which short items feel.
  void fill_qrep(const float* qf, float* rp) const {
    const int64_t x = layout.x, q_repeat = layout.q_repeat;
    if (layout.fp8_tables) {  // decode_fp8_by_tables' order, chunk by chunk
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

  // Starts item `info`: visible ranges of its rows, query rows (pre-scaled, chunks repeated
  // across lanes for q.k), empty softmax states.
  void start(const ItemInfo& info) {
    it = info;
    real_last = it.b_last;
    if (layout.staged() && it.b_first <= it.b_last)
      it.b_last = it.b_first + (it.b_last - it.b_first) / layout.stage.per;
    scratch.v_poison.clear();
    const int64_t G = layout.G, D = layout.D, q_repeat = layout.q_repeat;
    const int64_t num_chunks = layout.num_chunks;
    R = (it.j1 - it.j0) * G;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t Ppos = it.L - it.q_len + it.j0 + r / G;
      scratch.row_P[r] = Ppos;
      scratch.row_lo[r] = first_visible(P, Ppos);
    }
    const bool multi = P.query_start_loc != nullptr;
    const QT* q_base = static_cast<const QT*>(P.query);
    auto query_row = [&](int64_t hr) {  // row hr % R of kv head it.kvh + hr / R
      const int64_t r = hr % R, j = it.j0 + r / G, h = (it.kvh + hr / R) * G + r % G;
      return q_base + (it.row0 + (multi ? j : 0)) * P.q_stride_seq + h * P.q_stride_head;
    };
    for (int64_t hr = 0; hr < it.nh * R; ++hr) {
      const QT* q = query_row(hr);
      scratch.state[hr] = SoftmaxState{};
      if (layout.amx) continue;  // the query operands are packed below
      if constexpr (std::is_same_v<QT, c10::BFloat16>) {
        if (layout.dot_bf16) {  // each chunk's x bf16 values as they are, repeated to 2 W
          QT* rp = reinterpret_cast<QT*>(scratch.qrep.data() + hr * num_chunks * q_repeat);
          for (int64_t c = 0; c < num_chunks; ++c)
            for (int64_t i = 0; i < 2 * W; i += layout.x, rp += layout.x)
              std::memcpy(rp, q + c * layout.x, layout.x * sizeof(QT));
          continue;
        }
      }
      float* qf = scratch.qf.data();
      for (int64_t d = 0; d < D; d += W) {
        const int64_t n = std::min<int64_t>(W, D - d);
        (load_f32(q + d, n) * VecF(layout.qk_scale)).store(qf + d, n);
      }
      fill_qrep(qf, scratch.qrep.data() + hr * num_chunks * q_repeat);
    }
    if constexpr (std::is_same_v<QT, c10::BFloat16>) {
      if (layout.amx) {
        const c10::BFloat16* rows[16];
        for (int64_t hl = 0; hl < it.nh; ++hl) {
          for (int64_t r = 0; r < R; ++r) rows[r] = query_row(hl * R + r);
          amx_pack_queries(rows, R, D, query_tiles(hl));
        }
        // amx_pv_group starts its sums on the first group; an item without blocks has none.
        if (it.b_first > it.b_last || !PAGED_OPS_PHASE_PV)
          std::fill(scratch.amx_o.begin(), scratch.amx_o.begin() + it.nh * D * 16, 0.f);
        return;
      }
    }
    // pv_group, pv_half_tile and pv_dot_tile start their sums themselves on the first group
    // (init); pv_row_any adds, and an item without blocks (empty split, seq_len 0) still
    // turns its sums into rows.
    const bool no_pv = !PAGED_OPS_PHASE_PV || it.b_first > it.b_last;  // sums start at 0
    const bool pv_inits = layout.fast_pv || layout.half_pv || layout.dot_pv;
    if (!pv_inits || (no_pv && !layout.fast_pv))
      std::fill(scratch.acc.begin(), scratch.acc.begin() + it.nh * R * layout.acc_row, 0.f);
    else if (no_pv)
      std::fill(scratch.ot.begin(), scratch.ot.begin() + it.nh * R * D, 0.f);
  }

  // Steps of p.v per block over all rows of a kv head (k_rest's): pv_half_tile's steps, or
  // pv_group's vector iterations.
  int64_t pv_calls() const {
    if (layout.tiny_pv) return (R / 4 + R % 4) * pv_tiny_steps(layout.D, layout.cache_bs);
    if (layout.half_pv) return (R / 4 + R % 4) * pv_half_steps(layout.D, layout.rows_per_vector);
    if (layout.dot_pv) return (R / 4 + R % 4) * pv_dot_steps(layout.dot_accs);
    if (layout.any_pv) return (R / 4 + R % 4) * pv_any_steps(layout.D) * layout.NV;
    const int nv_template = static_cast<int>(std::min<int64_t>(layout.NV, 4));  // pv's NVc
    return (R / 4 + R % 4) * pv_steps(nv_template, layout.D) * layout.NV;
  }

  // A row of pdot: the probability operand of pv_dot_tile for the blocks of a group.
  int64_t pdot_row() const { return kGroup * 2 * W; }

  // The AMX query operands of kv head hl (amx_pack_queries): R / 4 quads of D / 8 tiles.
  uint16_t* query_tiles(int64_t hl) {
    return scratch.qtiles.data() + hl * ((R + 3) / 4) * (layout.D / kAmxX) * 512;
  }

  // Visible offsets of the group's blocks [b0, b0 + nb) for the item's rows together.
  void visibility(int64_t b0, int64_t nb, GroupBlocks<CT>& g) const {
    g.b0 = b0;
    // Rows see ranges that grow with their position: the last row's start and the first
    // row's end bound what every row sees.
    const int64_t lo_all = scratch.row_lo[R - 1], P_all = scratch.row_P[0];
    for (int64_t k = 0; k < nb; ++k) {
      const int64_t pos = first_token(b0 + k), n = block_tokens(b0 + k);
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
  void group_blocks(int64_t hl, int64_t b0, int64_t nb, int64_t next_item, int64_t end,
                    GroupBlocks<CT>& g) {
    if (layout.staged()) return stage_group(hl, b0, nb, next_item, end, g);
    const int64_t kvh = it.kvh + hl;
    blocks(it.s, kvh, b0, nb, g.k, g.v);
    int64_t nb_next = 0;
    if (hl + 1 < it.nh) {
      nb_next = nb;
      blocks(it.s, kvh + 1, b0, nb, g.k_next, g.v_next);
    } else if (b0 + nb <= it.b_last) {
      nb_next = std::min<int64_t>(layout.group, it.b_last - b0 - nb + 1);
      blocks(it.s, it.kvh, b0 + nb, nb_next, g.k_next, g.v_next);
    } else if (next_item < end) {
      const ItemInfo nx = item_info(P, plan, next_item);
      nb_next = std::clamp<int64_t>(nx.b_last - nx.b_first + 1, 0, layout.group);
      blocks(nx.s, nx.kvh, nx.b_first, nb_next, g.k_next, g.v_next);
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
  void stage_group(int64_t hl, int64_t b0, int64_t nb, int64_t next_item, int64_t end,
                   GroupBlocks<CT>& g) {
    const int64_t D = layout.D, cbs = layout.cache_bs, size = layout.bs, per = layout.stage.per;
    const int64_t esize = static_cast<int64_t>(sizeof(CT));
    const int64_t block_bytes = D * size * esize, run = D * cbs * esize;
    const CT* rk[kMaxStagePer];
    const CT* rv[kMaxStagePer];
    int64_t t0[kMaxStagePer], t1[kMaxStagePer];
    for (int64_t k = 0; k < nb; ++k) {
      const int64_t rf = real_first(b0 + k), n = std::min(per, real_last - rf + 1);
      blocks(it.s, it.kvh + hl, rf, n, rk, rv);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = (rf + j) * cbs;
        t0[j] = std::clamp<int64_t>(it.lo_min - pos, 0, cbs);
        t1[j] = std::clamp<int64_t>(it.P_max + 1 - pos, 0, cbs);
      }
      char* kdst = reinterpret_cast<char*>(scratch.kstage.data()) + k * block_bytes;
      stage_block(reinterpret_cast<const char* const*>(rk), n, t0, t1, cbs, size,
                  layout.num_chunks, layout.x * esize, kdst);
      g.k[k] = g.k_next[k] = reinterpret_cast<const CT*>(kdst);
      if (layout.tiny_pv) {
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
    int64_t s = it.s, kvh = it.kvh + hl + 1, first = real_first(b0), last = real_last;
    int64_t count = 0;  // staged blocks
    if (hl + 1 < it.nh) {
      count = nb;
      last = std::min(last, first + nb * per - 1);
    } else if (b0 + nb <= it.b_last) {
      kvh = it.kvh;
      first = real_first(b0 + nb);
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
        blocks(s, kvh, rf, n, rk, slot_v + n_v);
        for (int64_t i = 0; i < n; ++i) n_lines = add_lines(rk[i], run, lines, n_lines);
        n_v += n;
      }
      for (int64_t i = 0; i < n_v; ++i) n_lines = add_lines(slot_v[i], run, lines, n_lines);
    }
    g.line_begin[nb] = n_lines;
  }

  // Whether key block k of the group holds an e4m3 NaN in a token some row sees; if so,
  // scratch.k_nan flags those tokens. (Layout [D / x][bs][x]: token t's elements are x bytes
  // at t * x of each chunk.)
  bool scan_keys(const GroupBlocks<CT>& g, int64_t k) {
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
  void add_nonfinite(int64_t hl, const GroupBlocks<CT>& g, int64_t k, int64_t d, int64_t t,
                     float v) {
    const int64_t pos = first_token(g.b0 + k) + t;
    for (int64_t r = 0; r < R; ++r) {
      if (pos < scratch.row_lo[r] || pos > scratch.row_P[r]) continue;
      const float p = scratch.p[r * layout.group_row + k * layout.block_row + t];
      const float add = std::isnan(v) || p == 0.f ? std::numeric_limits<float>::quiet_NaN() : v;
      scratch.v_poison.push_back({hl, r, d, add});
    }
  }

  // The e4m3 NaNs of the group's value blocks at positions some row sees (add_nonfinite).
  void scan_values(int64_t hl, int64_t nb, const GroupBlocks<CT>& g) {
    const int64_t bs = layout.bs, D = layout.D;
    if (layout.tiny_pv) {  // the cache's blocks pv_tiny reads (hidden columns zeroed)
      const int64_t cbs = layout.cache_bs;
      for (int64_t i = 0; i < tiny_n; ++i) {
        const uint8_t* vb = reinterpret_cast<const uint8_t*>(tiny_v[i]);
        if (!e4m3_has_nan(vb, D * cbs)) continue;
        const int64_t k = tiny_off[i] / layout.block_row, t0 = tiny_off[i] % layout.block_row;
        for (int64_t d = 0; d < D; ++d)
          for (int64_t t = 0; t < cbs; ++t)
            if (is_e4m3_nan(vb[d * cbs + t]))
              add_nonfinite(hl, g, k, d, t0 + t, std::numeric_limits<float>::quiet_NaN());
      }
      return;
    }
    for (int64_t k = 0; k < nb; ++k) {
      const uint8_t* vb = reinterpret_cast<const uint8_t*>(g.v[k]);
      if (!e4m3_has_nan(vb, D * bs)) continue;
      for (int64_t d = 0; d < D; ++d)
        for (int64_t t = g.t0[k]; t < g.t1[k]; ++t)
          if (is_e4m3_nan(vb[d * bs + t]))
            add_nonfinite(hl, g, k, d, t, std::numeric_limits<float>::quiet_NaN());
    }
  }

  // A multi-token item's rows see different columns of a block (the positions past the first
  // row's, before the last row's window): p.v multiplies those with probability 0 for the rows
  // that do not see them, and 0 * NaN or 0 * Inf would be NaN. Such blocks are checked by
  // vectors, and only a block with a non-finite value is searched: a non-finite value in
  // those columns is zeroed in the block's copy (isolated, see pv) and its share added to the
  // output of each row that sees it instead (add_nonfinite).
  void isolate_nonfinite(int64_t hl, int64_t nb, GroupBlocks<CT>& g) {
    const int64_t bs = layout.bs, D = layout.D;
    for (int64_t k = 0; k < nb; ++k) {
      if (g.a0[k] == g.t0[k] && g.a1[k] == g.t1[k]) continue;  // every row sees the same
      const CT* vb = g.v[k];
      // First the whole block by vectors: x - x is NaN exactly where x is not finite (as the
      // kernel reads it: an e4m3 NaN through the vector decode is scan_values' business).
      VecF any(0.f);
      int64_t j = 0;
      for (; j + W <= D * bs; j += W) {
        const VecF x = load_f32(vb + j);
        any = any + (x - x);
      }
      bool finite = !std::isnan(hsum(any));
      for (; j < D * bs; ++j) finite &= std::isfinite(to_f32(vb[j]));
      if (finite) continue;
      for (int64_t d = 0; d < D; ++d) {
        for (int64_t t = g.t0[k]; t < g.t1[k]; ++t) {
          if (t == g.a0[k]) t = std::max(t, g.a1[k]);
          if (t >= g.t1[k]) break;
          const float v = to_f32(vb[d * bs + t]);
          if (std::isfinite(v)) continue;
          g.isolated[k] = true;
          add_nonfinite(hl, g, k, d, t, v);
        }
      }
    }
  }

  // Logits of every row of kv head hl for each block of the group: p[r][k * block_row + t]; hidden
  // offsets and the padding up to block_row are -inf by position, never computed from cache data.
  void logits(int64_t hl, int64_t b0, int64_t nb, const GroupBlocks<CT>& g) {
    const int64_t num_chunks = layout.num_chunks, q_repeat = layout.q_repeat;
    const int64_t raw_row = layout.raw_row, block_row = layout.block_row, bs = layout.bs;
    // What the q.k sums are multiplied by (in the vectors that sum them): q is scaled already,
    // except in bf16 pairs.
    const float z_scale = layout.dot_bf16 ? layout.qk_scale : 1.f;
    const float* const qrep_h = scratch.qrep.data() + hl * R * num_chunks * q_repeat;
    // The next block's key lines go out over the q.k loop's iterations: every tile of rows
    // (R / 4 + R % 4 tiles), or the AMX loop's.
    const int64_t pf_steps = layout.amx ? amx_qk_iterations(R, layout.D, bs)
                                        : (R / 4 + R % 4) * layout.qk_iters;
    // 16-bit caches: q.k (bf16 pairs, or a widening load) is short next to p.v, and the next
    // block's key lines all asked for during it wait for the core's miss buffers; the first
    // `head` bytes go out over q.k, the rest over p.v (k_rest).
    const int64_t kbytes = layout.D * bs * static_cast<int64_t>(sizeof(CT));
    // pv_tiny prefetches the next step's V lines itself (every cache type).
    const bool split =
        (kSplitKeyPrefetch && (layout.fast_pv || layout.half_pv || layout.dot_pv) && !layout.amx) ||
        layout.tiny_pv;
    const int64_t head = split ? kbytes / 2 / 64 * 64 : kbytes;
    const int64_t rest_steps = head < kbytes ? pv_calls() : 0;
    const int64_t sum_blocks = layout.sum_blocks;
    bool k_nan[kGroup] = {};
    for (int64_t k = 0; k < nb; ++k) {
      int64_t r = 0;
      if constexpr (kScanNan) k_nan[k] = !layout.fp8_tables && scan_keys(g, k);
      PrefetchCursor pf;
      if (layout.staged()) {  // the listed lines, split as above (keys first)
        const char* const* lines = scratch.next_lines.data() + g.line_begin[k];
        const int64_t n = g.line_begin[k + 1] - g.line_begin[k], n_head = split ? n / 2 : n;
        pf = PrefetchCursor(lines, n_head, pf_steps);
        k_rest[k] =
            split ? PrefetchCursor(lines + n_head, n - n_head, pv_calls()) : PrefetchCursor();
      } else {
        pf = PrefetchCursor(g.k_next[k], head, pf_steps);
        k_rest[k] = head < kbytes
                        ? PrefetchCursor(reinterpret_cast<const char*>(g.k_next[k]) + head,
                                         kbytes - head, rest_steps)
                        : PrefetchCursor();
      }
      if (layout.amx) {
        const CT* kb = g.k[k];
        if (!g.clean[k] && (g.t0[k] > 0 || g.t1[k] < bs))
          kb = k_block_masked(kb, reinterpret_cast<CT*>(scratch.kraw.data()), num_chunks, bs,
                              layout.x, g.t0[k], g.t1[k]);
        if constexpr (std::is_same_v<CT, c10::BFloat16>) {
          if (PAGED_OPS_PHASE_QK)
            amx_qk_block(kb, query_tiles(hl), R, layout.D, bs, scratch.p.data() + k * block_row,
                         layout.group_row, scratch.cbuf.data(), pf);
        }
      }
      auto qk = [&](auto tile, auto one_q) {
        constexpr int G_T = decltype(tile)::value;
        for (; r + G_T <= R; r += G_T) {
          const float* qr = qrep_h + r * num_chunks * q_repeat;
          // Tokens of the blocks summed together follow each other in raw.
          float* raw = scratch.raw.data() + r * raw_row + k % sum_blocks * bs * layout.x_sum;
          if constexpr (std::is_same_v<CT, c10::BFloat16>) {
            if (layout.dot_bf16) {
              qk_tile_dot<G_T>(g.k[k], qr, raw, num_chunks, layout.chunk_elems, raw_row, pf);
              continue;
            }
          }
          if constexpr (is_fp8_v<CT> && W == 16) {
            if (layout.fp8_tables) {
              qk_tile_fp8<G_T>(g.k[k], qr, raw, num_chunks, layout.chunk_elems, raw_row, pf);
              continue;
            }
          }
          qk_tile<G_T, decltype(one_q)::value>(g.k[k], qr, raw, num_chunks, layout.chunk_elems,
                                               raw_row, q_repeat, pf);
        }
      };
      if (!PAGED_OPS_PHASE_QK || layout.amx) {
      } else if (q_repeat == W) {
        qk(std::integral_constant<int, 4>{}, std::true_type{});
        qk(std::integral_constant<int, 1>{}, std::true_type{});
      } else {
        qk(std::integral_constant<int, 4>{}, std::false_type{});
        qk(std::integral_constant<int, 1>{}, std::false_type{});
      }
      // The logits of blocks [k_first, k]: a pair's once both are summed in raw.
      if (k % sum_blocks + 1 < sum_blocks && k + 1 < nb) continue;
      const int64_t k_first = k - k % sum_blocks;
      if (!layout.amx)
        for (r = 0; r < R; ++r)
          sum_lane_groups(scratch.raw.data() + r * raw_row, layout.x_sum, (k - k_first + 1) * bs,
                          scratch.p.data() + r * layout.group_row + k_first * block_row,
                          z_scale);
      for (int64_t kk = k_first; kk <= k; ++kk) finish_logits(hl, kk, b0 + kk, k_nan[kk]);
    }
  }

  // The logits of block k (b of the sequence) from its q.k sums (in p already): -inf where a
  // row does not see it and in the padding up to block_row, NaN for a key with an e4m3 NaN
  // (k_nan), then the soft cap and ALiBi.
  void finish_logits(int64_t hl, int64_t k, int64_t b, bool k_nan) {
    const int64_t bs = layout.bs, block_row = layout.block_row;
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const int64_t h0 = (it.kvh + hl) * layout.G;
    const int64_t pos = first_token(b), n = block_tokens(b);
    for (int64_t r = 0; r < R; ++r) {
      float* pr = scratch.p.data() + r * layout.group_row + k * block_row;
      const int64_t t0 = std::clamp<int64_t>(scratch.row_lo[r] - pos, 0, n);
      const int64_t t1 = std::clamp<int64_t>(scratch.row_P[r] + 1 - pos, 0, n);
      if (t0 >= t1) {  // nothing of this block is visible to this row
        std::fill(pr, pr + block_row, neg_inf);
        continue;
      }
      if (layout.amx)
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

  // Softmax step of each row of kv head hl over the group: p = e^(z - m_new) (0 where
  // hidden). Nothing is read from memory here, so the first rows of the next V blocks are
  // prefetched meanwhile, 8 per row (measured 2-7% faster than leaving memory idle).
  void softmax(int64_t hl, int64_t nb, const GroupBlocks<CT>& g) {
    // Rows of up to a line each, else lines.
    const int64_t vrow_bytes = layout.bs * static_cast<int64_t>(sizeof(CT));
    const int64_t vpf_stride = std::min<int64_t>(vrow_bytes, 64);
    const int64_t vpf_end = std::min<int64_t>(R * 8, kGroup * layout.D * vrow_bytes / vpf_stride);
    // The group's logits, padded to whole vectors by -inf (dense rows: nb * block_row may
    // end inside one).
    const int64_t n = round_up(nb * layout.block_row, W);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    // Accumulators in acc are rescaled here; pv_group's running sums o by pv_group (alpha).
    float* const acc_h = layout.lane_acc ? scratch.acc.data() + hl * R * layout.acc_row : nullptr;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t i = r * 8; i < std::min(r * 8 + 8, vpf_end); ++i)
        prefetch_l2(reinterpret_cast<const char*>(g.v_next[i % kGroup]) + i / kGroup * vpf_stride);
      if (!PAGED_OPS_PHASE_SM) continue;
      float* const pr = scratch.p.data() + r * layout.group_row;
      std::fill(pr + nb * layout.block_row, pr + n, neg_inf);
      scratch.alpha[hl * R + r] = scratch.state[hl * R + r].step(
          scratch.p.data() + r * layout.group_row, n,
          acc_h ? acc_h + r * layout.acc_row : nullptr, layout.acc_len);
    }
  }

  // Zeroes the non-finite values isolate_nonfinite took out of a copy of value block k (all-zero
  // bits are +0 in every cache type).
  template <typename T>
  void zero_isolated(T* blk, const GroupBlocks<CT>& g, int64_t k) const {
    const int64_t bs = layout.bs;
    for (int64_t d = 0; d < layout.D; ++d)
      for (int64_t t = g.t0[k]; t < g.t1[k]; ++t)
        if ((t < g.a0[k] || t >= g.a1[k]) && !std::isfinite(to_f32(blk[d * bs + t])))
          std::memset(static_cast<void*>(blk + d * bs + t), 0, sizeof(T));
  }

  // p . v for all rows of kv head hl. V columns no row sees may hold NaN (0 * NaN = NaN), so
  // a partly visible block is read through a copy with those columns zeroed. Blocks are read
  // in place (the partly visible ones from a copy in their own type) when one tile of rows
  // covers them or the cache is fp32; else the group is converted to fp32 once, for all
  // tiles. (Converting a whole group for its one partial block made calls of odd lengths
  // 13-25% slower.)
  void pv(int64_t hl, int64_t nb, bool first, bool last, GroupBlocks<CT>& g) {
    if constexpr (kScanNan) scan_values(hl, nb, g);
    if (P.query_start_loc != nullptr) isolate_nonfinite(hl, nb, g);
    const int64_t D = layout.D, bs = layout.bs;
    const int64_t group_row = layout.group_row, acc_row = layout.acc_row;
    float* const acc_h = layout.lane_acc ? scratch.acc.data() + hl * R * acc_row : nullptr;
    const int64_t vrow_bytes = bs * static_cast<int64_t>(sizeof(CT));
    auto vcopy = [&]() {
      for (int64_t k = 0; k < nb; ++k) {
        float* dst = scratch.vtmp.data() + k * D * bs;
        v_block_to_f32(g.v[k], dst, D, bs, g.t0[k], g.t1[k]);
        if (g.isolated[k]) zero_isolated(dst, g, k);
      }
    };
    // The group's V blocks in the cache's type: in place, or the partly visible ones through
    // a copy with the hidden columns zeroed.
    auto in_own_type = [&](const CT** src) {
      CT* const masked = reinterpret_cast<CT*>(scratch.vraw.data());
      for (int64_t k = 0; k < nb; ++k) {
        if ((g.clean[k] || (g.t0[k] == 0 && g.t1[k] == bs)) && !g.isolated[k]) {
          src[k] = g.v[k];
          continue;
        }
        CT* dst = masked + k * D * bs;
        src[k] = v_block_masked(g.v[k], dst, D, bs, g.t0[k], g.t1[k]);
        if (g.isolated[k]) zero_isolated(dst, g, k);
      }
    };
    if (layout.amx) {
      if constexpr (std::is_same_v<CT, c10::BFloat16>) {
        const CT* src[kGroup];
        in_own_type(src);
        amx_pack_probabilities(scratch.p.data(), group_row, R, nb, bs, layout.block_row,
                               scratch.pvnni.data());
        alignas(64) float alpha[16] = {};
        std::copy(scratch.alpha.data() + hl * R, scratch.alpha.data() + (hl + 1) * R, alpha);
        amx_pv_group(src, nb, bs, D, scratch.pvnni.data(), scratch.amx_o.data() + hl * D * 16,
                     alpha, first, scratch.cbuf.data(), g.v_next);
      }
      return;
    }
    if (layout.tiny_pv) {
      const int64_t Pv = layout.tiny_period;
      float* const pat = scratch.tiny_pat.data();
      int64_t r_tile = 0;
      auto tiles = [&](auto h) {
        constexpr int H = decltype(h)::value;
        const float* const pp = scratch.p.data();
        auto tile = [&](auto rt) {
          constexpr int RT = decltype(rt)::value;
          const float* const pr = pp + r_tile * group_row;
          if constexpr (H == 0)
            tiny_patterns<RT>(pr, group_row, tiny_off, tiny_n, Pv, layout.tiny_idx, pat);
          pv_tiny<RT, H, true>(tiny_v, tiny_off, tiny_n, pr, group_row, pat, Pv, layout.cache_bs,
                                            acc_h + r_tile * acc_row, acc_row, D, k_rest, nb);
        };
        for (r_tile = 0; r_tile + 4 <= R; r_tile += 4) tile(std::integral_constant<int, 4>{});
        for (; r_tile < R; ++r_tile) tile(std::integral_constant<int, 1>{});
      };
      if (layout.cache_bs == 1) tiles(std::integral_constant<int, 1>{});
      else if (layout.cache_bs == 2) tiles(std::integral_constant<int, 2>{});
      else if (layout.cache_bs == 4) tiles(std::integral_constant<int, 4>{});
      else tiles(std::integral_constant<int, 0>{});
      return;
    }
    if (layout.dot_pv) {
      if constexpr (std::is_same_v<CT, c10::BFloat16>) {
        const CT* src[kGroup];
        in_own_type(src);
        uint16_t* const pd = scratch.pdot.data();
        const int64_t pd_row = pdot_row();
        pack_dot_probabilities(scratch.p.data(), group_row, layout.block_row, R, nb, bs, pd,
                               pd_row);
        const int64_t accs = layout.dot_accs;
        int64_t r = 0;
        for (; r + 4 <= R; r += 4)
          pv_dot_tile<4, kSplitKeyPrefetch>(src, nb, pd + r * pd_row, pd_row, acc_h + r * acc_row,
                                            acc_row, accs, first, g.v_next, k_rest);
        for (; r < R; ++r)
          pv_dot_tile<1, kSplitKeyPrefetch>(src, nb, pd + r * pd_row, pd_row, acc_h + r * acc_row,
                                            acc_row, accs, first, g.v_next, k_rest);
      }
      return;
    }
    if (layout.half_pv) {
      const CT* src[kGroup];
      in_own_type(src);
      auto tiles = [&](auto rpv) {
        constexpr int RPV = decltype(rpv)::value;
        int64_t r = 0;
        for (; r + 4 <= R; r += 4)
          pv_half_tile<4, RPV, kSplitKeyPrefetch>(src, nb, scratch.p.data() + r * group_row,
                                                  group_row, layout.block_row, acc_h + r * acc_row,
                                                  acc_row, D, g.v_next, k_rest, first);
        for (; r < R; ++r)
          pv_half_tile<1, RPV, kSplitKeyPrefetch>(src, nb, scratch.p.data() + r * group_row,
                                                  group_row, layout.block_row, acc_h + r * acc_row,
                                                  acc_row, D, g.v_next, k_rest, first);
      };
      if (layout.rows_per_vector == 2) tiles(std::integral_constant<int, 2>{});
      else tiles(std::integral_constant<int, 4>{});
      return;
    }
    if (!layout.fast_pv) {
      vcopy();
      const float* vb[kGroup];
      for (int64_t k = 0; k < nb; ++k) vb[k] = scratch.vtmp.data() + k * D * bs;
      const float* const pp = scratch.p.data();
      int64_t r = 0;
      for (; r + 4 <= R; r += 4)
        pv_row_any<4>(vb, nb, pp + r * group_row, group_row, layout.block_row,
                      acc_h + r * acc_row, acc_row, D, bs);
      for (; r < R; ++r)
        pv_row_any<1>(vb, nb, pp + r * group_row, group_row, layout.block_row,
                      acc_h + r * acc_row, acc_row, D, bs);
      return;
    }
    // The operands of pv_group and pv_group_any.
    const float* const pp = scratch.p.data();
    float* const ot = scratch.ot.data() + hl * R * D;  // tiles of 4 rows, then single rows
    const float* const al = scratch.alpha.data() + hl * R;
    auto acc = [&](int64_t r) { return acc_h ? acc_h + r * acc_row : nullptr; };
    auto run = [&](auto nv, auto src) {
      constexpr int NVc = decltype(nv)::value;
      int64_t r2 = 0;
      if (nb == kGroup) {
        for (; r2 + 4 <= R; r2 += 4)
          pv_group<NVc, 4, kGroup, kSplitKeyPrefetch>(
              src, nb, layout.NV, pp + r2 * group_row, group_row, ot + r2 * D, al + r2, acc(r2),
              acc_row, D, g.v_next, vrow_bytes, first, last, k_rest);
      }
      for (; r2 + 4 <= R; r2 += 4)
        pv_group<NVc, 4, 0, kSplitKeyPrefetch>(
            src, nb, layout.NV, pp + r2 * group_row, group_row, ot + r2 * D, al + r2, acc(r2),
            acc_row, D, g.v_next, vrow_bytes, first, last, k_rest);
      for (; r2 < R; ++r2)
        pv_group<NVc, 1, 0, kSplitKeyPrefetch>(
            src, nb, layout.NV, pp + r2 * group_row, group_row, ot + r2 * D, al + r2, acc(r2),
            acc_row, D, g.v_next, vrow_bytes, first, last, k_rest);
    };
    auto run_any = [&](auto half, auto src) {
      constexpr bool HALF = decltype(half)::value;
      int64_t r2 = 0;
      for (; r2 + 4 <= R; r2 += 4)
        pv_group_any<4, HALF, kSplitKeyPrefetch>(
            src, nb, layout.NV, bs, pp + r2 * group_row, group_row, layout.block_row,
            ot + r2 * D, al + r2, acc(r2), acc_row, D, g.v_next, vrow_bytes, first, last, k_rest);
      for (; r2 < R; ++r2)
        pv_group_any<1, HALF, kSplitKeyPrefetch>(
            src, nb, layout.NV, bs, pp + r2 * group_row, group_row, layout.block_row,
            ot + r2 * D, al + r2, acc(r2), acc_row, D, g.v_next, vrow_bytes, first, last, k_rest);
    };
    auto dispatch = [&](auto src) {
      if (layout.any_pv) {
        if constexpr (W == 16) {
          if (layout.half_rows) {
            run_any(std::true_type{}, src);
            return;
          }
        }
        run_any(std::false_type{}, src);
        return;
      }
      if (layout.NV == 1) run(std::integral_constant<int, 1>{}, src);
      else if (layout.NV == 2) run(std::integral_constant<int, 2>{}, src);
      else if (layout.NV == 3) run(std::integral_constant<int, 3>{}, src);
      else run(std::integral_constant<int, 4>{}, src);
    };
    if (std::is_same_v<CT, float> || R <= 4) {
      // pv_group reads bf16 rows split (even, odd)
      if (kSplitPairs<CT> && layout.NV == 2 && !layout.any_pv) {
        for (int64_t r = 0; r < R; ++r)
          for (int64_t k = 0; k < nb; ++k)
            split_pairs(scratch.p.data() + r * group_row + k * layout.block_row);
      }
      const CT* src[kGroup];
      in_own_type(src);
      dispatch(static_cast<const CT* const*>(src));
    } else {
      vcopy();
      const float* vf[kGroup];
      for (int64_t k = 0; k < nb; ++k) vf[k] = scratch.vtmp.data() + k * D * bs;
      dispatch(static_cast<const float* const*>(vf));
    }
  }

  // Ends the item: the sums of p * v in rows (from pv_group's tiles, or pv_row_any's
  // accumulators with their lanes summed), then each row normalised into the output, or
  // (split) its unnormalised state stored for merge_splits.
  void finish(float* part_ml, float* part_o) {
    const int64_t G = layout.G, D = layout.D;
    const bool multi = P.query_start_loc != nullptr;
    QT* o_base = static_cast<QT*>(P.out);
    for (int64_t hl = 0; hl < it.nh; ++hl) {
      const int64_t kvh = it.kvh + hl;
      float* const o_h = scratch.o.data() + hl * R * D;
      if (layout.amx) {
        const float* ao = scratch.amx_o.data() + hl * D * 16;
        for (int64_t r = 0; r < R; ++r)
          for (int64_t d = 0; d < D; ++d) o_h[r * D + d] = ao[d * 16 + r];
      } else if (layout.fast_pv) {
        rows_from_tiles(scratch.ot.data() + hl * R * D, R, D, o_h);
      } else {
        for (int64_t r = 0; r < R; ++r) {
          const float* acc = scratch.acc.data() + (hl * R + r) * layout.acc_row;
          float* const o = o_h + r * D;
          const int64_t lanes = layout.acc_lanes;
          if (layout.tiny_pv) {  // any number of lanes per row d
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
        QT* o = o_base + (it.row0 + (multi ? j : 0)) * P.out_stride_seq +
                (kvh * G + g) * P.out_stride_head;
        store_scaled(o_h + r * D, st_h[r].output_scale(layout.v_scale), o, D);
      }
    }
  }
};

// Exact merge of the splits of each (sequence, kv head, row) by SoftmaxState::merge: the
// unnormalised outputs o summed with the weights it returns, then o / sum. Empty splits
// (sum = 0, max = -inf, o = 0) contribute nothing.
template <typename QT>
void merge_splits(const AttentionParams& P, const Plan& plan, float v_scale,
                  const std::vector<float>& part_ml, const std::vector<float>& part_o) {
  const int64_t G = P.num_heads / P.num_kv_heads;
  const int64_t D = P.head_size;
  QT* o_base = static_cast<QT*>(P.out);
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
      // (merge leaves st's weight at 1), whatever order the maxima come in.
      SoftmaxState st;  // sum 0 until the first non-empty split
      for (int64_t sp = 0; sp < plan.splits; ++sp) {
        const SoftmaxState si = state(sp);
        if (!si.empty()) st.max = std::max(st.max, si.max);
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
      QT* o = o_base + s * P.out_stride_seq + (kvh * G + g) * P.out_stride_head;
      store_scaled(acc.data(), st.output_scale(v_scale), o, D);
    }
  });
}

template <typename QT, typename CT>
void attention_impl(const AttentionParams& P) {
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
  at::parallel_for(0, plan.num_items, plan.grain, [&](int64_t begin, int64_t end) {
    ItemWorker<QT, CT> w(P, layout, plan, thread_scratch());
    GroupBlocks<CT> g;
    if (layout.amx) amx_configure(layout.bs);
    for (int64_t item = begin; item < end; ++item) {
      w.start(item_info(P, plan, item));
      // Blocks go in groups of up to kGroup: one softmax step per row and one pass of the
      // p.v accumulators per group, kv head after kv head.
      for (int64_t b0 = w.it.b_first; b0 <= w.it.b_last; b0 += layout.group) {
        const int64_t nb = std::min<int64_t>(layout.group, w.it.b_last - b0 + 1);
        w.visibility(b0, nb, g);
        for (int64_t hl = 0; hl < w.it.nh; ++hl) {
          w.group_blocks(hl, b0, nb, item + 1, end, g);
          w.logits(hl, b0, nb, g);
          w.softmax(hl, nb, g);
          if (PAGED_OPS_PHASE_PV) w.pv(hl, nb, b0 == w.it.b_first, b0 + nb > w.it.b_last, g);
        }
      }
      w.finish(part_ml.data(), part_o.data());
    }
    if (layout.amx) amx::release();
  });
  if (plan.splits > 1) merge_splits<QT>(P, plan, layout.v_scale, part_ml, part_o);
}

template <typename QT>
inline void attention_q(const AttentionParams& P) {
  switch (P.cache_dtype) {
    case DType::F32: return attention_impl<QT, float>(P);
    case DType::F16: return attention_impl<QT, c10::Half>(P);
    case DType::BF16: return attention_impl<QT, c10::BFloat16>(P);
    case DType::F8E4M3: return attention_impl<QT, c10::Float8_e4m3fn>(P);
    case DType::F8E5M2: return attention_impl<QT, c10::Float8_e5m2>(P);
  }
}

inline void attention(const AttentionParams& P) {
  switch (P.dtype) {
    case DType::F32: return attention_q<float>(P);
    case DType::F16: return attention_q<c10::Half>(P);
    case DType::BF16: return attention_q<c10::BFloat16>(P);
    default: return;  // unreachable: queries are checked to be fp32 / fp16 / bf16
  }
}

inline const KernelTable* kernel_table() {
  static const KernelTable t{kKernelAbiVersion, CPU_CAPABILITY_NAME, &attention};
  return &t;
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
