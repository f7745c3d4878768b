// Per-call constants of the CPU attention kernel (Layout): the scratch geometry, how the cache
// type CT is read, and the two paths a call takes, chosen once per call in Layout's
// constructor (choose_paths): the q.k path (QkPath, run by qk_paths.h) and the p.v path
// (PvPath, run by pv_paths.h). Block sizes no fast p.v path takes are read through staged
// copies of several cache blocks (staging.h), and the paths are chosen for the staged size.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <type_traits>

#include "cpu/arch/amx_tiles.h"
#include "cpu/attention/amx.h"
#include "cpu/attention/element_loads.h"
#include "cpu/attention/qk.h"
#include "cpu/attention/staging.h"
#include "cpu/attention/tuning.h"
#include "cpu/attention/work_plan.h"
#include "cpu/fp8.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// How the logits of a block are computed (qk_paths.h).
enum class QkPath {
  Tile,       // qk_tile: fp32 lanes of q chunks against key chunks, any cache type (qk.h)
  DotBF16,    // qk_tile_dot: bf16 pair dot products, bf16 queries on bf16 or fp8 (kDotCache)
  Fp8Tables,  // qk_tile_fp8: fp8 keys decoded by byte tables (kFp8Tables, 16 lanes)
  Amx,        // amx_qk_block: AMX tiles, bf16 queries on a bf16 cache (kAmx, amx.h)
};

// How the probabilities times V are summed (pv_paths.h).
enum class PvPath {
  Group,     // pv_group: V rows of 1-3 or a multiple of 4 vectors (block sizes W, 2 W, 3 W, 4k W)
  GroupAny,  // pv_group_any: other block sizes above W (whole or half vectors per V row)
  HalfTile,  // pv_half_tile: block sizes W / 2 and W / 4, 2 or 4 V rows per vector
  Dot,       // pv_dot_tile: bf16 pair dot products (kDotCache), bs W / 2, W, 2 W, 4k W
  Tiny,      // pv_tiny: staged block sizes below W in decode, V read in place
  RowAny,    // pv_row_any: any block size, V converted to fp32 rows
  Amx,       // amx_pv_group: AMX tiles (with QkPath::Amx)
};

template <typename CT>
struct Layout {
  // bs: the block size the kernel reads, the cache's (cache_bs) or that of staged blocks
  // (stage, staging.h).
  int64_t G, D, bs, x, num_chunks, chunk_elems;
  int64_t cache_bs;
  StageShape stage;
  QkPath qk = QkPath::Tile;
  PvPath pv = PvPath::RowAny;
  int64_t raw_row;  // raw row, padded to whole vectors
  // Probability row of one block: padded to whole vectors, except that block sizes dividing W
  // pack their rows densely (block size 8 on 16 lanes: a group's 32 logits take two vectors
  // in the softmax step, not four).
  int64_t block_row;
  int64_t group_row;  // probabilities of a group of blocks, whole vectors
  int64_t group;  // blocks per group (kGroupBytes of keys, at most kGroup)
  // Row stride of the p.v accumulators: D * W lanes plus one cache line, so the rows of a tile
  // (touched together) do not fall in the same L1 sets when D * W * 4 is a multiple of 4 KiB.
  int64_t acc_row;
  // Tile path: bf16 keys with an even block size are read in pairs (load_bf16_pairs): units of
  // two tokens' chunks, split into even and odd elements, each half paired with the q chunk's
  // even / odd elements.
  bool split_k;
  // q chunk repetition length (x, W: powers of 2). DotBF16: qrep holds the unscaled bf16 q
  // (qk_scale multiplies the logits instead: q stays exact), on fp8 keys in qk_dot_quads'
  // order (2 W floats), and raw 4 lanes per token; Fp8Tables: each q chunk in the order
  // decode_fp8_by_tables leaves (4 W floats), and raw 4 lanes per token.
  int64_t q_repeat;
  int64_t x_sum;  // raw lanes per token
  // Blocks whose q.k sums are summed across lanes together (1 or 2): two blocks of W / 2
  // tokens at 4 lanes per token fill the 4 vectors that one sum of sum_lane_groups reads,
  // where one block fills half of them. At 8 lanes per token one block fills them already.
  int64_t sum_blocks;
  // Blocks summed in pairs whose chunks are 2 units (DotBF16: 2 W elements each; fp8: 2
  // decodes) or 2 vectors (Tile: fp32 at W / 2): the q.k of a pair runs as one step over both
  // blocks (qk_pair_step, qk_dot_quads' pair step).
  bool pair_qk = false;
  int64_t NV;  // Group, GroupAny: V row vectors
  bool half_rows;  // GroupAny: block sizes (16 lanes) that end half a vector short of one
  int64_t rows_per_vector;  // HalfTile: V rows per vector
  bool lane_acc;  // the p.v sums live in acc between groups (RowAny, Dot, Tiny, or kLaneAcc)
  int64_t dot_accs;  // Dot: accumulators per query row, D * bs / 2 W (D above 2 W)
  int64_t acc_lanes;  // lanes of acc per row d, summed at the end (sum_lane_groups)
  int64_t acc_len;  // floats of a row of acc that hold sums (what SoftmaxState::step rescales)
  int64_t qk_iters;      // chunk iterations of one q.k tile call
  bool plain_logits;  // no soft cap, no ALiBi
  // (q . s_k k) scale = s_k scale (q . k); fp8_unit: see fp8_unit().
  float qk_scale, v_scale;
  // Tiny: its probability patterns repeat every tiny_period vectors, lane i of pattern q
  // holding token tiny_idx[q * W + i] (tiny_patterns).
  int64_t tiny_period = 1;
  int32_t tiny_idx[W * W] = {};
  // A tuned plan (KernelPlan): the next step's blocks are prefetched (else not).
  bool prefetch = true;
  // The next step's key lines: half asked for over q.k and half over p.v (k_rest), or all over
  // q.k. The rules split them for 16-bit caches on the 16-lane builds where the p.v path
  // carries k_rest: their q.k is short next to p.v, and on the Xeon of RESULTS.md all of them
  // over q.k wait for the miss buffers (split: 1.02-1.07x). On Zen 4 all over q.k runs
  // 0.98-1.12x of the split, so a tuned plan may choose (KernelPlan::split_keys). pv_dot_tile
  // (bf16 at block size 8 on avx512_bf16; the Xeon takes AMX tiles there) gets none: all over
  // q.k ran 1.09-1.16x in the probe's low state on Zen 4, 0.97-1.01x in its high one.
  static constexpr bool kSplitKeyPrefetch = sizeof(CT) == 2 && W == 16;
  bool split_keys = false;

  bool staged() const { return stage.per > 0; }
  bool amx() const { return qk == QkPath::Amx; }
  bool group_pv() const { return pv == PvPath::Group || pv == PvPath::GroupAny; }

  Layout(const AttentionParams& P, int64_t rows_max)
      : G(P.num_heads / P.num_kv_heads), D(P.head_size), bs(P.block_size), x(P.x),
        cache_bs(P.block_size) {
    Candidates c = derive(P, rows_max);
    // Block sizes below W that no fast p.v path takes (pv_row_any's) are staged, as are those
    // below kStageBelow. W / 4 on 16 lanes (pv_half_tile's) is staged for caches narrower than
    // fp32. Above W, pv_row_any's block sizes are staged for caches narrower than fp32 where
    // whole blocks fill a staged one (on 8 lanes 12 in 24, 28 in 224; on 16 lanes those that
    // could be are multiples of W / 2, pv_group_any's).
    const bool fast = c.group || c.half || c.dot || c.amx;
    const bool quarter = W == 16 && 4 * cache_bs == W && sizeof(CT) < 4 && !c.amx;
    const bool above = !fast && cache_bs > W && sizeof(CT) < 4;
    if ((!fast && cache_bs < W) || cache_bs < kStageBelow || quarter || above) {
      stage = stage_shape(cache_bs, kStageMin);
      if (above && stage.per * cache_bs != stage.size) stage = {};
      if (stage.per > 0) {
        bs = stage.size;
        c = derive(P, rows_max);
      }
    }
    // Staged keys, values read in place by pv_tiny (decode: multi-token items isolate
    // non-finite values in staged copies; not on AMX tiles).
    c.tiny = staged() && cache_bs < W && D * cache_bs % W == 0 && P.query_start_loc == nullptr &&
             !c.amx;
    choose_paths(c, P.plan.pv_path - 1);
    if (P.plan.prefetch == 1) prefetch = false;
    split_keys = kSplitKeyPrefetch && prefetch && P.plan.split_keys != 1 &&
                 (group_pv() || pv == PvPath::HalfTile);
  }

  // The paths open to the block size read: several may be; choose_paths takes one of each.
  struct Candidates {
    bool dot_bf16, fp8_tables, amx, group, any, half, dot, tiny;
  };

  // Whether p.v path `pv` (a PvPath, or -1) is open to the candidates: a plan may force it.
  static bool pv_open(const Candidates& c, int pv) {
    switch (pv) {
      case static_cast<int>(PvPath::Group): return c.group && !c.any && !c.amx;
      case static_cast<int>(PvPath::GroupAny): return c.any && !c.amx;
      case static_cast<int>(PvPath::HalfTile): return c.half && !c.amx;
      case static_cast<int>(PvPath::Dot): return c.dot;
      case static_cast<int>(PvPath::Tiny): return c.tiny;
      case static_cast<int>(PvPath::RowAny): return !c.amx;
      case static_cast<int>(PvPath::Amx): return c.amx;
      default: return false;
    }
  }

  // The chosen paths and what follows from them; forced_pv: a plan's p.v path (-1: none),
  // taken where open.
  void choose_paths(const Candidates& c, int forced_pv = -1) {
    qk = c.amx ? QkPath::Amx
         : c.dot_bf16 ? QkPath::DotBF16
         : c.fp8_tables ? QkPath::Fp8Tables
                        : QkPath::Tile;
    pv = c.amx ? PvPath::Amx
         : c.tiny ? PvPath::Tiny
         : c.dot ? PvPath::Dot
         : c.half ? PvPath::HalfTile
         : !c.group ? PvPath::RowAny
         : c.any ? PvPath::GroupAny
                 : PvPath::Group;
    if (forced_pv >= 0 && pv_open(c, forced_pv)) pv = static_cast<PvPath>(forced_pv);
    lane_acc = pv == PvPath::Dot || pv == PvPath::Tiny || pv == PvPath::RowAny ||
               pv == PvPath::HalfTile ||
               (group_pv() && keep_lane_sums(W, pv == PvPath::Group ? NV : kAnyLaneNV));
    acc_lanes = pv == PvPath::Dot ? std::min<int64_t>(bs / 2, W) : pv == PvPath::HalfTile ? bs : W;
    if (pv == PvPath::Tiny) {
      acc_lanes = cache_bs;
      tiny_period = cache_bs / std::gcd(cache_bs, W);
      for (int64_t q = 0; q < tiny_period; ++q)
        for (int64_t i = 0; i < W; ++i)
          tiny_idx[q * W + i] = static_cast<int32_t>((q * W + i) % cache_bs);
    }
    acc_len = D * acc_lanes;
  }

  // Everything that follows from the block size read (bs), and the paths open to it.
  Candidates derive(const AttentionParams& P, int64_t rows_max) {
    Candidates c{};
    num_chunks = D / x;
    chunk_elems = bs * x;
    raw_row = round_up(chunk_elems, W);
    block_row = bs < W && W % bs == 0 ? bs : round_up(bs, W);
    group = std::clamp<int64_t>(kGroupBytes / (bs * D * static_cast<int64_t>(sizeof(CT))), 1,
                                kGroup);
    if (P.plan.group > 0) group = std::min<int64_t>(P.plan.group, kGroup);
    group_row = round_up(group * block_row, W);
    acc_row = D * W + 16;
    const bool bf16 = std::is_same_v<CT, c10::BFloat16> && P.dtype == DType::BF16;
    // The dot paths: bf16 queries on a kDotCache cache, whole loads (kDotLoad) of its blocks.
    const bool dot = kDotCache<CT> && P.dtype == DType::BF16;
    c.dot_bf16 = dot && chunk_elems % kDotLoad<CT> == 0;
    split_k = kSplitPairs<CT> && x == W && bs % 2 == 0;
    c.fp8_tables = kFp8Tables && is_fp8_v<CT> && W == 16 && x == W && chunk_elems % (4 * W) == 0;
    // A plan's forced q.k path, where open (Tile always is): the paths before it are closed.
    const int fqk = P.plan.qk_path - 1, fpv = P.plan.pv_path - 1;
    const bool qk_forced = fqk == static_cast<int>(QkPath::Tile) ||
                           (fqk == static_cast<int>(QkPath::DotBF16) && c.dot_bf16) ||
                           (fqk == static_cast<int>(QkPath::Fp8Tables) && c.fp8_tables);
    if (qk_forced) {
      c.dot_bf16 = c.dot_bf16 && fqk == static_cast<int>(QkPath::DotBF16);
      c.fp8_tables = c.fp8_tables && fqk == static_cast<int>(QkPath::Fp8Tables);
    }
    if (c.dot_bf16) c.fp8_tables = false;  // fp8 keys: DotBF16 reads them by the same tables
    // fp8 on DotBF16: two q operands per chunk and 4 lanes per token (qk_dot_quads).
    const bool dot_fp8 = c.dot_bf16 && is_fp8_v<CT>;
    q_repeat = c.fp8_tables ? 4 * W
               : c.dot_bf16 ? (dot_fp8 ? 2 * W : W)
               : split_k    ? 2 * W
                            : std::max<int64_t>(x, W);
    x_sum = c.fp8_tables || dot_fp8 ? 4 : c.dot_bf16 || q_repeat == 2 * W ? x / 2 : x;
    NV = bs / W;
    c.group = bs % W == 0 && (NV <= 3 || NV % 4 == 0);
    c.any = !c.group && bs > W && D % 2 == 0 && (bs % W == 0 || (W == 16 && 2 * bs % W == 0));
    half_rows = c.any && bs % W != 0;
    if (c.any) {
      c.group = true;
      NV = (bs + W - 1) / W;
    }
    rows_per_vector = 2 * bs == W ? 2 : 4 * bs == W && bs >= 4 ? 4 : 0;
    c.half = rows_per_vector > 0 && D % rows_per_vector == 0;
    plain_logits = P.logits_soft_cap <= 0.f && P.alibi_slopes == nullptr;
    qk_iters = c.dot_bf16     ? qk_dot_iterations(chunk_elems, num_chunks, is_fp8_v<CT>)
               : c.fp8_tables ? qk_fp8_iterations(chunk_elems, num_chunks)
                              : qk_tile_iterations(chunk_elems, num_chunks, q_repeat);
    qk_scale = P.scale * P.k_scale * fp8_unit<CT>();
    v_scale = P.v_scale * fp8_unit<CT>();
    // AMX takes both paths: not where a plan forces another q.k or p.v path.
    const bool no_amx = qk_forced || (fpv >= 0 && fpv != static_cast<int>(PvPath::Amx));
    c.amx = kAmx && bf16 && x == kAmxX && D % 16 == 0 && amx_block_size_ok(bs) &&
            rows_max <= 16 && !no_amx && amx::usable();
    sum_blocks = kSumBlockPairs && 2 * bs == W && x_sum <= 4 && !c.amx ? 2 : 1;
    raw_row = std::max(raw_row, round_up(sum_blocks * bs * x_sum, W));
    pair_qk = sum_blocks == 2 &&
              (c.dot_bf16 ? chunk_elems == (dot_fp8 ? 8 : 4) * W
                          : !c.fp8_tables && q_repeat == W && chunk_elems == 2 * W);
    // pv_dot_tile's block sizes; fp8 decodes two operands at once (an even number of sums).
    // From W up, bf16 takes Dot only where a plan forces it: pv_group ran 1.04-1.05x as fast
    // at block size 16 and 1.02-1.12x at 32-256 (Zen 4), while fp8 ran 1.23-1.50x as fast on
    // Dot.
    const bool dot_block = bs == W / 2 ||
                           ((bs == W || bs == 2 * W || bs % (4 * W) == 0) &&
                            (is_fp8_v<CT> || fpv == static_cast<int>(PvPath::Dot)));
    dot_accs = bs > 2 * W ? D : D * bs / (2 * W);
    c.dot = dot && !c.amx && dot_block && D * bs % (2 * W) == 0 &&
            (!is_fp8_v<CT> || dot_accs % 2 == 0);
    // A plan forcing another open p.v path closes Dot (which closes Group and HalfTile).
    if (fpv >= 0 && fpv != static_cast<int>(PvPath::Dot)) {
      Candidates o = c;
      o.dot = false;
      if (pv_open(o, fpv)) c.dot = false;
    }
    if (c.dot) c.group = c.half = false;
    return c;
  }
};

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
