// p.v of the attention kernel: probabilities times the [head_size][block_size] V blocks of
// a group, read in place from the cache (or from masked / fp32 copies of partial blocks).
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/attention/element_loads.h"
#include "cpu/attention/staging.h"
#include "cpu/attention/work_plan.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// tile_sums: the tile of p.v sums of pv_group, RT rows x DT consecutive d, into the running
// sums of its rows: o[u * RT + r] = o[u * RT + r] * alpha[r] + (sum of the lanes of a[r][u]),
// or = the lane sum on an item's first group (init: o may hold anything). o is tile-major
// ([D][RT] for the tile's rows), so the DT * RT sums of a step are contiguous; finish turns
// the tiles back into rows (rows_from_tiles). By shuffle trees where the build has them.
// tile_sums_each: the same, one lane sum (hsum) at a time; what the item's last group takes
// where the accumulators were kept across groups in lanes. Always inlined: a call takes the
// accumulators by reference, and where GCC leaves it out of line the accumulators stay in
// memory over the whole FMA loop (fp16 at block sizes 64-256: 0.61-0.65x). The shuffle trees
// are left to GCC: forced inline, fp16 at 16 and 32 and bf16 at 32 ran 0.60-0.67x.
template <int RT, int DT>
C10_ALWAYS_INLINE void tile_sums_each(const VecF (&a)[RT][DT], float* o, const float* alpha,
                                      bool init) {
  for (int u = 0; u < DT; ++u)
    for (int r = 0; r < RT; ++r) {
      const float sum = hsum(a[r][u]);
      o[u * RT + r] = init ? sum : o[u * RT + r] * alpha[r] + sum;
    }
}
template <int RT, int DT>
inline void tile_sums(const VecF (&a)[RT][DT], float* o, const float* alpha, bool init) {
  if constexpr (kTileSumsByShuffles<RT, DT>) {
    tile_sums_by_shuffles(a, o, alpha, init);
  } else {
    tile_sums_each(a, o, alpha, init);
  }
}

// p . v of a group of blocks for a tile of RT query rows: the [D][bs] V blocks (bs == NV * W)
// are read in steps of DT rows d; each lane of an accumulator a[r][u] sums p[r][t] * v[d + u][t]
// over the offsets t = lane (mod W) of every block of the group, in registers (one V row load
// and conversion feeds the RT rows of the tile; the probabilities p[r][k * block_row + t] are
// loaded once per step and row). Where to then:
// - 8 lanes (AVX2, portable), and 16 lanes for V rows of up to 3 vectors: the lanes are summed
//   once per group into the rows' running sums o (tile_sums, one shuffle tree per tile, which
//   also applies the softmax rescale alpha). The running sums are D floats per row, where
//   per-lane accumulators kept across groups would be D * W floats per row, loaded and stored
//   from L2 every group.
// - 16 lanes, rows of 4 vectors and more (kLaneAcc, keep_lane_sums): the accumulators are kept
//   across groups in acc (W lanes per d, rescaled by SoftmaxState::step) and summed into o
//   only on the item's last group (last; an item of one group never touches acc), by
//   ATen's hsum: with the shuffle tree inlined here, 16-bit rows at block sizes 64 and 128
//   ran 0.70x.
// next[k]: the blocks to prefetch; k_rest[k] (KREST): the next blocks' key lines q.k left for
// p.v, one step per vector iteration of block k. init: an item's first group (o and acc are
// written, not read). NB > 0: a full group of NB blocks, unrolled (pointers stay in
// registers); NB = 0: nb. NV = 1, 2, 3: that many vectors per V row; NV = 4: any multiple of 4
// (nv_in of them, block sizes 4 W and up), in steps of 4.
constexpr int pv_rows_per_step(int NV) { return paged::cpu::pv_rows_per_step(NV, W); }
inline int64_t pv_steps(int NV, int64_t D) {
  const int64_t dt = pv_rows_per_step(NV);
  int64_t n = D / dt, rest = D % dt;
  if (dt == 3 && rest == 2) return n + 1;  // one step of 2
  return n + rest;
}
// Long V rows (4 lines and more) have their next rows' prefetches spread over the vector
// iterations instead of issued together at the start of each step: a burst of prefetches
// waits for the core's miss buffers, and the FMAs behind it wait too. Rows of 2 lines gain
// nothing from pacing, hence only from 4 lines.
constexpr int64_t kPacedRowBytes = 256;
// The rows [d, d + rows) of the next block (next), asked for by a p.v step that reads the same
// rows of its block: each row where rows are at most a line, each line of them at once, or
// from kPacedRowBytes their lines spread over the step's `calls` vector iterations by the
// cursor returned (empty otherwise). pv_group_any calls it (GCC lays out its loop better
// that way); pv_group keeps the same code in place, where the call is slower.
template <typename NT>
inline PrefetchCursor prefetch_next_rows(const NT* next, int64_t d, int rows, int64_t vrow_bytes,
                                         int64_t calls) {
  const char* pf = reinterpret_cast<const char*>(next) + d * vrow_bytes;
  if (vrow_bytes >= kPacedRowBytes) return PrefetchCursor(pf, rows * vrow_bytes, calls);
  if (vrow_bytes <= 64) {
    for (int u = 0; u < rows; ++u) prefetch_l2(pf + u * vrow_bytes);
  } else {
    for (int64_t b = 0; b < rows * vrow_bytes; b += 64) prefetch_l2(pf + b);
  }
  return PrefetchCursor();
}
template <int NV, int RT, int NB, bool KREST, typename VT, typename NT>
inline void pv_group(const VT* const* src_in, int64_t nb_in, int64_t nv_in, const float* p,
                     int64_t p_stride, float* o, const float* alpha, float* acc,
                     int64_t acc_stride, int64_t D, const NT* const* next_in, int64_t vrow_bytes,
                     bool init, bool last, PrefetchCursor* k_rest) {
  constexpr bool kLaneAcc = keep_lane_sums(W, NV);  // as Layout::lane_acc decided: acc given
  const int64_t nv = NV == 4 ? nv_in : NV;
  const int64_t BPv = nv * W;
  constexpr int NBA = NB > 0 ? NB : static_cast<int>(kGroup);
  const int64_t nb = NB > 0 ? NB : nb_in;
  const VT* src[NBA];
  const NT* next[NBA];
  for (int64_t k = 0; k < nb; ++k) {
    src[k] = src_in[k];
    next[k] = next_in[k];
  }
  // DT V rows per step share each probability load (one load feeds DT FMAs). RT * DT
  // accumulators: each takes NV * nb dependent FMAs per step, so 8 (RT = 4, DT = 2) just
  // cover the FMA latency x throughput and stall on any delay; 12 (AVX2) and 16 (AVX-512)
  // leave slack (pv_rows_per_step, tuning.h). The V
  // vectors are loaded per vector iteration i (DT + RT * DT + 1 registers).
  constexpr int DT = pv_rows_per_step(NV);
  auto step = [&](int64_t d, auto dt_c) {
    constexpr int DTc = decltype(dt_c)::value;
    VecF a[RT][DTc];
    for (int r = 0; r < RT; ++r)
      for (int u = 0; u < DTc; ++u)
        a[r][u] = !kLaneAcc || init ? VecF(0.f) : VecF::loadu(acc + r * acc_stride + (d + u) * W);
#pragma GCC unroll 4
    for (int64_t k = 0; k < nb; ++k) {
      // The same rows of the next block: each row (short rows, at most a line), or each
      // line of the rows (as prefetch_next_rows, kept in place: see there).
      const char* pf = reinterpret_cast<const char*>(next[k]) + d * vrow_bytes;
      // Paced: the rows' lines spread over the step's nv vector iterations.
      const bool paced = vrow_bytes >= kPacedRowBytes;
      PrefetchCursor vpf = paced ? PrefetchCursor(pf, DTc * vrow_bytes, nv) : PrefetchCursor();
      if (vrow_bytes <= 64) {
        for (int u = 0; u < DTc; ++u) prefetch_l2(pf + u * vrow_bytes);
      } else if (!paced) {
        for (int64_t b = 0; b < DTc * vrow_bytes; b += 64) prefetch_l2(pf + b);
      }
      for (int64_t i0 = 0; i0 < nv; i0 += NV) {
        // fp8 rows two vectors at a time on the 16-lane builds: one 32-byte load, widened and
        // shifted once for both (load2_f32). (8 lanes: 16 registers do not hold twice the V
        // vectors of a step.) A loop of its own: folded into the one below (vectors per load
        // as a parameter), it slows the 16-bit caches.
        if constexpr (W == 16 && NV % 2 == 0 && is_fp8_v<VT> && kDecodeFp8) {
          for (int i = static_cast<int>(i0); i < i0 + NV; i += 2) {
            if constexpr (KREST) k_rest[k].step();
            if (paced) vpf.step();
            if constexpr (KREST) k_rest[k].step();
            if (paced) vpf.step();
            VecF v0[DTc], v1[DTc];
            for (int u = 0; u < DTc; ++u) load2_f32(src[k] + (d + u) * BPv + i * W, v0[u], v1[u]);
            for (int r = 0; r < RT; ++r) {
              const float* pr = p + r * p_stride + k * BPv + i * W;
              const VecF p0 = in_register(VecF::loadu(pr));
              for (int u = 0; u < DTc; ++u) a[r][u] = at::vec::fmadd(v0[u], p0, a[r][u]);
              const VecF p1 = in_register(VecF::loadu(pr + W));
              for (int u = 0; u < DTc; ++u) a[r][u] = at::vec::fmadd(v1[u], p1, a[r][u]);
            }
          }
          continue;
        }
        for (int i = static_cast<int>(i0); i < i0 + NV; ++i) {
          if constexpr (KREST) k_rest[k].step();
          if (paced) vpf.step();
          VecF v[DTc];
          for (int u = 0; u < DTc; ++u) {
            const VT* row = src[k] + (d + u) * BPv;
            if constexpr (NV == 2 && kSplitPairs<VT>) {
              v[u] = load_bf16_half(row, i);  // p split to match
            } else {
              v[u] = load_f32(row + i * W);
            }
          }
          for (int r = 0; r < RT; ++r) {
            const VecF pv = in_register(VecF::loadu(p + r * p_stride + k * BPv + i * W));
            for (int u = 0; u < DTc; ++u) a[r][u] = at::vec::fmadd(v[u], pv, a[r][u]);
          }
        }
      }
    }
    if (!kLaneAcc || last) {
      if constexpr (kLaneAcc) tile_sums_each(a, o + d * RT, alpha, true);
      else tile_sums(a, o + d * RT, alpha, init);
      return;
    }
    for (int r = 0; r < RT; ++r)
      for (int u = 0; u < DTc; ++u) a[r][u].store(acc + r * acc_stride + (d + u) * W);
  };
  int64_t d = 0;
  for (; d + DT <= D; d += DT) step(d, std::integral_constant<int, DT>{});
  if constexpr (DT == 3) {  // head size 128 leaves 2 rows: one step of 2, not 2 of 1
    if (d + 2 <= D) {
      step(d, std::integral_constant<int, 2>{});
      d += 2;
    }
  }
  for (; d < D; ++d) step(d, std::integral_constant<int, 1>{});
}

// p . v where pv_group takes no V row of the block size: rows of nv whole vectors for any nv
// (bs = nv W: 80, 96, 112, ... on 16 lanes; 40, 48, 56, ... on 8), and on 16 lanes (HALF)
// rows of nv - 1/2 vectors (bs = (nv - 1/2) W: 24, 40, 56, ...). HALF reads the rows in
// pairs, every vector whole: an even row d from its start, its last vector running W / 2
// lanes into row d + 1; the odd row d + 1 from W / 2 before its start, its first vector's low
// lanes in row d's tail, and its probabilities from W / 2 before theirs to match (the first
// vector by a masked load: those lanes lie before the row). The lanes of the other row are
// left out by masked FMAs (fmadd_lanes), so no value of one row reaches another's sums, a NaN
// included. Otherwise as pv_group: a tile of RT query rows, DT rows d per step, accumulators
// in registers over the group's blocks and in acc between groups (16 lanes), the next
// blocks' rows prefetched, one vector per iteration (k_rest and the paced prefetches step once
// each). Against pv_row_any (rows converted to fp32 with a partial last vector): see
// docs/cpu_kernel.md.
constexpr int kAnyRowsPerStep = W == 16 ? 4 : 2;
inline int64_t pv_any_steps(int64_t D) { return D / kAnyRowsPerStep + D % kAnyRowsPerStep; }
template <int RT, bool HALF, bool KREST, typename VT, typename NT>
inline void pv_group_any(const VT* const* src, int64_t nb, int64_t nv, int64_t bs,
                         const float* p, int64_t p_stride, int64_t block_row, float* o,
                         const float* alpha, float* acc, int64_t acc_stride, int64_t D,
                         const NT* const* next, int64_t vrow_bytes, bool init, bool last,
                         PrefetchCursor* k_rest) {
  static_assert(!HALF || W == 16, "half-vector rows need masked FMAs (16 lanes)");
  constexpr bool kLaneAcc = keep_lane_sums(W, kAnyLaneNV);  // as Layout::lane_acc decided
  constexpr int64_t kHalf = W / 2;
  constexpr uint32_t kLow = (uint32_t{1} << kHalf) - 1, kHigh = kLow << kHalf;
  // PAR: the parity of row d (HALF: which rows are odd); DT rows from d.
  auto step = [&](int64_t d, auto dt_c, auto par_c) {
    constexpr int DTc = decltype(dt_c)::value;
    constexpr int PAR = decltype(par_c)::value;
    auto odd = [](int u) { return HALF && ((PAR + u) & 1) != 0; };
    VecF a[RT][DTc];
    for (int r = 0; r < RT; ++r)
      for (int u = 0; u < DTc; ++u)
        a[r][u] = !kLaneAcc || init ? VecF(0.f) : VecF::loadu(acc + r * acc_stride + (d + u) * W);
    for (int64_t k = 0; k < nb; ++k) {
      const bool paced = vrow_bytes >= kPacedRowBytes;
      PrefetchCursor vpf = prefetch_next_rows(next[k], d, DTc, vrow_bytes, nv);
      const VT* rows[DTc];
      for (int u = 0; u < DTc; ++u) rows[u] = src[k] + (d + u) * bs - (odd(u) ? kHalf : 0);
      const float* const pk = p + k * block_row;
      // MODE 0: the first vector (HALF: the odd rows' straddles), 1: whole vectors,
      // 2: the last (HALF: the even rows' straddles).
      auto iteration = [&](int64_t i, auto mode_c) {
        constexpr int MODE = decltype(mode_c)::value;
        if constexpr (KREST) k_rest[k].step();
        if (paced) vpf.step();
        VecF v[DTc];
        for (int u = 0; u < DTc; ++u) v[u] = load_f32(rows[u] + i * W);
        for (int r = 0; r < RT; ++r) {
          const float* pr = pk + r * p_stride + i * W;
          const VecF pe = in_register(VecF::loadu(pr));
          VecF po = pe;
          if constexpr (HALF)
            po = MODE == 0 ? load_lanes(pr - kHalf, kHigh) : in_register(VecF::loadu(pr - kHalf));
          for (int u = 0; u < DTc; ++u) {
            if (HALF && odd(u) && MODE == 0) {
              a[r][u] = fmadd_lanes(v[u], po, a[r][u], kHigh);
            } else if (HALF && !odd(u) && MODE == 2) {
              a[r][u] = fmadd_lanes(v[u], pe, a[r][u], kLow);
            } else {
              a[r][u] = at::vec::fmadd(v[u], odd(u) ? po : pe, a[r][u]);
            }
          }
        }
      };
      if constexpr (HALF) {  // nv >= 2
        iteration(0, std::integral_constant<int, 0>{});
        for (int64_t i = 1; i + 1 < nv; ++i) iteration(i, std::integral_constant<int, 1>{});
        iteration(nv - 1, std::integral_constant<int, 2>{});
      } else {
        for (int64_t i = 0; i < nv; ++i) iteration(i, std::integral_constant<int, 1>{});
      }
    }
    if (!kLaneAcc || last) {
      if constexpr (kLaneAcc) tile_sums_each(a, o + d * RT, alpha, true);
      else tile_sums(a, o + d * RT, alpha, init);
      return;
    }
    for (int r = 0; r < RT; ++r)
      for (int u = 0; u < DTc; ++u) a[r][u].store(acc + r * acc_stride + (d + u) * W);
  };
  using Even = std::integral_constant<int, 0>;
  using Odd = std::integral_constant<int, 1>;
  constexpr int DT = kAnyRowsPerStep;
  int64_t d = 0;
  for (; d + DT <= D; d += DT) step(d, std::integral_constant<int, DT>{}, Even{});
  for (; d < D; ++d) {  // D % DT rows (none for the head sizes a cache layout allows)
    if (HALF && d % 2 == 1) step(d, std::integral_constant<int, 1>{}, Odd{});
    else step(d, std::integral_constant<int, 1>{}, Even{});
  }
}

// Rows [0, R) of o (row-major, D each) from the running sums ot of pv_group: tiles of 4 rows
// ([D][4]), then single rows.
inline void rows_from_tiles(const float* ot, int64_t R, int64_t D, float* o) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4, ot += 4 * D)
    for (int64_t d = 0; d < D; ++d)
      for (int64_t i = 0; i < 4; ++i) o[(r + i) * D + d] = ot[d * 4 + i];
  std::copy(ot, ot + (R - r) * D, o + r * D);
}

// Any block size: p . v of a group's [D][bs] fp32 V blocks (vb[k]) for a tile of RT query
// rows, vectors over the offsets t (the last one partial where W does not divide bs, its
// lanes past bs zero in both factors: a padded probability row holds 0 there, a dense one
// (block_row < a whole vector) the next block's or the next row's probabilities, which may
// be NaN for a row that sees a NaN key, and 0 * NaN would reach this row). Each row's
// accumulators stay in registers over the nb blocks (one acc load and store per row d and
// group, one V load per RT FMAs), where one row and one block at a time would load and store
// the accumulators per block.
template <int RT>
inline void pv_row_any(const float* const* vb, int64_t nb, const float* p, int64_t p_stride,
                       int64_t block_row, float* acc, int64_t acc_stride, int64_t D,
                       int64_t bs) {
  const int64_t nvec = (bs + W - 1) / W, tail = bs - (nvec - 1) * W;
  const bool p_padded = block_row >= nvec * W;
  for (int64_t d = 0; d < D; ++d) {
    VecF a[RT];
    for (int r = 0; r < RT; ++r) a[r] = VecF::loadu(acc + r * acc_stride + d * W);
    for (int64_t k = 0; k < nb; ++k) {
      const float* row = vb[k] + d * bs;
      const float* pk = p + k * block_row;
      for (int64_t i = 0; i < nvec; ++i) {
        const bool part = i + 1 == nvec;
        const VecF v = part ? VecF::loadu(row + i * W, tail) : VecF::loadu(row + i * W);
        for (int r = 0; r < RT; ++r) {
          const float* pr = pk + r * p_stride + i * W;
          const VecF pv = part && !p_padded ? VecF::loadu(pr, tail) : VecF::loadu(pr);
          a[r] = at::vec::fmadd(v, pv, a[r]);
        }
      }
    }
    for (int r = 0; r < RT; ++r) a[r].store(acc + r * acc_stride + d * W);
  }
}

// p . v for block sizes W / RPV, RPV = 2 or 4 (8 and 4 on the 16-lane builds, 4 on the 8-lane
// ones): a vector holds V rows [d, d + RPV) of a block, and the block's probabilities go in
// each of its RPV parts, so lanes [j bs, (j + 1) bs) of the accumulator acc[(d / RPV) * W] sum
// row d + j's products (the end of the item sums them by sum_lane_groups, bs lanes per row
// d), with no conversion of the blocks to fp32 rows (pv_row_any's). A tile of RT rows
// keeps DT accumulators each in registers over the nb blocks of the group (one V load feeds RT
// FMAs); acc holds them between groups (rescaled by SoftmaxState::step). Partly visible blocks
// arrive with their hidden columns zeroed. init: the item's first group (acc is written, not
// read).
//
// Each step reads rows [d, d + 2 RPV) of every block and asks for the same rows of the next
// blocks (next[k]; each line once, in the step whose rows it starts in), and k_rest[k] (KREST)
// steps once per block and step: without them the core's miss buffers sit idle through p.v
// and the V loads miss.
// pv_tiny's V vectors per step (RT * kTinySteps accumulators), and its steps over D rows.
constexpr int kTinySteps = 4;
inline int64_t pv_tiny_steps(int64_t D, int64_t bs) {
  const int64_t nvec = D * bs / W;
  return nvec / kTinySteps + nvec % kTinySteps;
}
constexpr int kHalfPairsPerStep = 2;  // pv_half_tile's V vectors per step
// pv_half_tile's steps of a pass over D rows (each block's k_rest steps once per step).
inline int64_t pv_half_steps(int64_t D, int64_t rpv) { return D / (rpv * kHalfPairsPerStep); }
template <int RT, int RPV, bool KREST, typename VT, typename NT>
inline void pv_half_tile(const VT* const* src, int64_t nb, const float* p, int64_t p_stride,
                         int64_t block_row, float* acc, int64_t acc_stride, int64_t D,
                         const NT* const* next, PrefetchCursor* k_rest, bool init) {
  constexpr int64_t H = W / RPV;  // the block size
  constexpr int DT = kHalfPairsPerStep;
  constexpr int64_t kRowBytes = H * static_cast<int64_t>(sizeof(NT));
  alignas(64) float p2[RT][kGroup][W];
  for (int r = 0; r < RT; ++r)
    for (int64_t k = 0; k < nb; ++k)
      for (int64_t t = 0; t < W; ++t) p2[r][k][t] = p[r * p_stride + k * block_row + t % H];
  int64_t d = 0;
  for (; d + RPV * DT <= D; d += RPV * DT) {
    VecF a[RT][DT];
    for (int r = 0; r < RT; ++r)
      for (int u = 0; u < DT; ++u)
        a[r][u] = init ? VecF(0.f) : VecF::loadu(acc + r * acc_stride + (d / RPV + u) * W);
    for (int64_t k = 0; k < nb; ++k) {
      if constexpr (KREST) k_rest[k].step();
      const char* nx = reinterpret_cast<const char*>(next[k]);
      for (int64_t b = (d * kRowBytes + 63) / 64 * 64; b < (d + RPV * DT) * kRowBytes; b += 64)
        prefetch_l2(nx + b);
      VecF v[DT];  // rows [d, d + 2 RPV): contiguous, one load2_f32 (one fp8 decode for both)
      static_assert(DT == 2);
      load2_f32(src[k] + d * H, v[0], v[1]);
      for (int r = 0; r < RT; ++r) {
        const VecF pv = in_register(VecF::loadu(p2[r][k]));
        for (int u = 0; u < DT; ++u) a[r][u] = at::vec::fmadd(v[u], pv, a[r][u]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int u = 0; u < DT; ++u) a[r][u].store(acc + r * acc_stride + (d / RPV + u) * W);
  }
  for (; d < D; d += RPV) {  // D % (2 RPV) == RPV
    for (int r = 0; r < RT; ++r) {
      VecF a = init ? VecF(0.f) : VecF::loadu(acc + r * acc_stride + d / RPV * W);
      for (int64_t k = 0; k < nb; ++k)
        a = at::vec::fmadd(load_f32(src[k] + d * H), VecF::loadu(p2[r][k]), a);
      a.store(acc + r * acc_stride + d / RPV * W);
    }
  }
}

// p . v straight from the cache's V blocks at block sizes bs < W (Layout::tiny_pv, whose keys
// are staged): a [D][bs] block is D * bs contiguous values, and lane i of its vector a sums row
// (a W + i) / bs against the probability of token (a W + i) % bs. The accumulators are the
// rows' acc as it is (D * bs floats: bs lanes per row d), summed at the end of the item
// (Layout::acc_lanes). Where bs divides W (H = bs: 1, 2, 4) that probability pattern is the
// same for every vector, one broadcast load (repeat_lanes); else (H = 0) it repeats every Pv
// vectors and tiny_patterns lays the Pv patterns of each block and row out in pat first.
// src[j]: the n blocks some row sees (hidden columns zeroed), row r's probabilities at
// p + r * p_stride + off[j]. Staged, such V blocks cost two moves per row d and block, more
// than their p.v. k_rest (KREST): the nrest cursors of the next step's lines, one step each
// per step.
template <int RT>
inline void tiny_patterns(const float* p, int64_t p_stride, const int64_t* off, int64_t n,
                          int64_t Pv, const int32_t* idx, float* pat) {
  for (int64_t j = 0; j < n; ++j)
    for (int r = 0; r < RT; ++r) {
      const float* pr = p + r * p_stride + off[j];
      float* out = pat + (j * RT + r) * Pv * W;
      const VecF pj = VecF::loadu(pr);  // bs < W of them, and the row's slack
      for (int64_t q = 0; q < Pv; ++q) permute_lanes(pj, idx + q * W).store(out + q * W);
    }
}
template <int RT, int H, bool KREST, typename VT>
inline void pv_tiny(const VT* const* src, const int64_t* off, int64_t n, const float* p,
                    int64_t p_stride, const float* pat, int64_t Pv, int64_t bs, float* acc,
                    int64_t acc_stride, int64_t D, PrefetchCursor* k_rest, int64_t nrest) {
  static_assert(H == 0 || W % H == 0);
  const int64_t nvec = D * bs / W;
  auto step = [&](int64_t a0, auto dt_c) {
    constexpr int DT = decltype(dt_c)::value;
    VecF a[RT][DT];
    for (int r = 0; r < RT; ++r)
      for (int u = 0; u < DT; ++u) a[r][u] = VecF::loadu(acc + r * acc_stride + (a0 + u) * W);
    int64_t res[DT];  // each vector's pattern
    for (int u = 0; u < DT; ++u) res[u] = H > 0 ? 0 : (a0 + u) % Pv * W;
    if constexpr (KREST)
      for (int64_t s = 0; s < nrest; ++s) k_rest[s].step();
    for (int64_t j = 0; j < n; ++j) {
      VecF v[DT];
      if constexpr (DT % 2 == 0) {
        for (int u = 0; u < DT; u += 2) load2_f32(src[j] + (a0 + u) * W, v[u], v[u + 1]);
      } else {
        for (int u = 0; u < DT; ++u) v[u] = load_f32(src[j] + (a0 + u) * W);
      }
      for (int r = 0; r < RT; ++r) {
        if constexpr (H > 0) {
          const VecF pr = repeat_lanes<H>(p + r * p_stride + off[j]);
          for (int u = 0; u < DT; ++u) a[r][u] = at::vec::fmadd(v[u], pr, a[r][u]);
        } else {
          const float* pj = pat + (j * RT + r) * Pv * W;
          for (int u = 0; u < DT; ++u)
            a[r][u] = at::vec::fmadd(v[u], VecF::loadu(pj + res[u]), a[r][u]);
        }
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int u = 0; u < DT; ++u) a[r][u].store(acc + r * acc_stride + (a0 + u) * W);
  };
  int64_t a = 0;
  for (; a + kTinySteps <= nvec; a += kTinySteps)
    step(a, std::integral_constant<int, kTinySteps>{});
  for (; a < nvec; ++a) step(a, std::integral_constant<int, 1>{});
}

// p . v by bf16 pair dot products (Layout::dot_pv) for a tile of RT query rows, on [D][bs] V
// blocks (bf16, or fp8 decoded to bf16 pairs by load_pairs2) read as operands of 2 W elements;
// lane j of an operand pairs its elements 2 j and 2 j + 1 with the matching probabilities of
// pb[r][k] (the block's probabilities, pack_dot_probabilities). Block sizes:
// - W / 2, W, 2 W: operand a holds V rows [a * 2 W / bs, (a + 1) * 2 W / bs), all of each, and
//   is accumulator a's: lane j sums row d = a * 2 W / bs + j / L (L = bs / 2 lanes per row),
//   flat index d * L + j % L of the row's acc. fp8 decodes operands a and a + 1 at once.
// - multiples of 4 W: a V row is m = bs / 2 W operands, all accumulator d's (its W lanes), taken
//   two at a time (fp8: one decode).
// sum_lane_groups reads acc so at the end of the item. acc is kept across groups (rescaled by
// SoftmaxState::step); init: the item's first group (acc is written, not read). One V load
// feeds RT dot products and one probability load DT; each V line read asks for the same line
// of the next block (the next key lines all go out over q.k: Layout::split_keys). Steps of 4,
// 2 and 1 accumulators (fp8: 2, an even number of them, Layout::derive). MULTI: bs > 2 W, a
// compile-time choice (as a run-time one, bf16 at block size 16 ran 0.86-0.91x).
template <int RT, bool MULTI, typename T>
inline void pv_dot_tile(const T* const* src, int64_t nb, const uint16_t* pb, int64_t pb_stride,
                        float* acc, int64_t acc_stride, int64_t accs, int64_t bs, bool init,
                        const T* const* next) {
  // Accumulators per step: RT * DT + 2 DT + 2 vectors live, and fp8's 6 table and order
  // vectors (with 4, GCC keeps fp8's sums on the stack).
  constexpr int DT = is_fp8_v<T> ? 2 : 4;
  constexpr int64_t kOp = 2 * W;  // elements per operand
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(T));
  const int64_t m = MULTI ? bs / kOp : 1;  // operands per V row
  const int64_t vrow = m * kOp;            // elements from accumulator a's operands to a + 1's
  auto step = [&](int64_t a0, auto dt_c) {
    constexpr int DTc = decltype(dt_c)::value;
    VecF s[RT][DTc];
    PAGED_UNROLL
    for (int r = 0; r < RT; ++r)
      PAGED_UNROLL
      for (int u = 0; u < DTc; ++u)
        s[r][u] = init ? VecF(0.f) : VecF::loadu(acc + r * acc_stride + (a0 + u) * W);
    for (int64_t k = 0; k < nb; ++k) {
      const char* nx = reinterpret_cast<const char*>(next[k] + a0 * vrow);
      const T* vk = src[k] + a0 * vrow;
      const uint16_t* pk = pb + k * vrow;
      if constexpr (!MULTI) {
        static_assert(DTc % 2 == 0 || !is_fp8_v<T>, "fp8 is decoded two operands at a time");
        for (int64_t i = 0; i < DTc * kOp * kSize; i += 64) prefetch_l2(nx + i);
        BF16Pairs v[DTc];
        for (int u = 0; u + 1 < DTc; u += 2) load_pairs2(vk + u * kOp, v[u], v[u + 1]);
        if constexpr (DTc % 2 == 1) v[DTc - 1] = load_pairs(vk + (DTc - 1) * kOp);
        for (int r = 0; r < RT; ++r) {
          const BF16Pairs p = pairs_in_register(load_pairs(pk + r * pb_stride));
          for (int u = 0; u < DTc; ++u) s[r][u] = dot_pairs(s[r][u], v[u], p);
        }
      } else {
        for (int64_t i = 0; i < m; i += 2) {
          BF16Pairs v0[DTc], v1[DTc];
          for (int u = 0; u < DTc; ++u) {
            for (int64_t b = 0; b < 2 * kOp * kSize; b += 64)
              prefetch_l2(nx + (u * vrow + i * kOp) * kSize + b);
            load_pairs2(vk + u * vrow + i * kOp, v0[u], v1[u]);
          }
          for (int r = 0; r < RT; ++r) {
            const BF16Pairs p0 = pairs_in_register(load_pairs(pk + r * pb_stride + i * kOp));
            const BF16Pairs p1 = pairs_in_register(load_pairs(pk + r * pb_stride + (i + 1) * kOp));
            for (int u = 0; u < DTc; ++u)
              s[r][u] = dot_pairs(dot_pairs(s[r][u], v0[u], p0), v1[u], p1);
          }
        }
      }
    }
    PAGED_UNROLL
    for (int r = 0; r < RT; ++r)
      PAGED_UNROLL
      for (int u = 0; u < DTc; ++u) s[r][u].store(acc + r * acc_stride + (a0 + u) * W);
  };
  int64_t a = 0;
  for (; a + DT <= accs; a += DT) step(a, std::integral_constant<int, DT>{});
  for (; a + 2 <= accs; a += 2) step(a, std::integral_constant<int, 2>{});
  if constexpr (!is_fp8_v<T>)
    for (; a < accs; ++a) step(a, std::integral_constant<int, 1>{});
}

// pv_dot_tile over the tiles of 4 rows of [0, R), inlined into one loop (flatten): multi-token
// items, 64 rows. Returns the rows done (a multiple of 4). Each tile a call, as decode's one
// tile of a kv head is, causal bf16 prefill (block size 16, head sizes 64 and 128, one thread,
// Zen 4) ran 0.75-0.80x of this; the loop inlined into the kernel's group step instead of
// here, decode at block sizes 8 and 16 0.88-0.97x.
template <bool MULTI, typename T>
[[gnu::flatten]] __attribute__((noinline)) int64_t pv_dot_tiles(
    const T* const* src, int64_t nb, const uint16_t* pb, int64_t pb_stride, float* acc,
    int64_t acc_stride, int64_t accs, bool init, const T* const* next, int64_t R, int64_t bs) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4)
    pv_dot_tile<4, MULTI>(src, nb, pb + r * pb_stride, pb_stride, acc + r * acc_stride,
                          acc_stride, accs, bs, init, next);
  return r;
}

// The probability operand of pv_dot_tile for rows [0, R) and blocks [0, nb) of a group (p:
// rows p_stride apart, blocks block_row apart, bs <= block_row), rounded to bf16 (to nearest
// even, as for AMX tiles): block k's at out[r * out_stride + k * n], n = max(bs, 2 W) values,
// out[... + j] = p[r][k][j % bs].
inline void pack_dot_probabilities(const float* p, int64_t p_stride, int64_t block_row,
                                   int64_t R, int64_t nb, int64_t bs, uint16_t* out,
                                   int64_t out_stride) {
  const int64_t n = std::max<int64_t>(bs, 2 * W);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t k = 0; k < nb; ++k) {
      const float* src = p + r * p_stride + k * block_row;
      uint16_t* dst = out + r * out_stride + k * n;
      if (bs >= 2 * W) {  // multiples of 2 W
        for (int64_t j = 0; j < bs; j += 2 * W)
          at::vec::convert_from_float<c10::BFloat16>(VecF::loadu(src + j),
                                                     VecF::loadu(src + j + W))
              .store(dst + j);
        continue;
      }
      if (bs == W) {  // the half stored, then copied (one conversion)
        at::vec::convert_from_float<c10::BFloat16>(VecF::loadu(src), VecF(0.f)).store(dst);
        std::memcpy(dst + W, dst, W * sizeof(uint16_t));
        continue;
      }
      // W / 2: repeated in registers. Copied twice through memory instead, the second copy's
      // load waits for the first one's store (no store forwarding): 40% of the time of
      // attention_cache's own code at block size 8 (perf, Zen 4).
      const VecF v = repeat_lanes<W / 2>(src);
      at::vec::convert_from_float<c10::BFloat16>(v, v).store(dst);
    }
  }
}

// out[d] = sum of the W lanes of acc[d].
inline void reduce_acc(const float* acc, float* out, int64_t D) {
  int64_t d = 0;
  for (; d + W <= D; d += W) {
    VecF r[W];
    for (int64_t k = 0; k < W; ++k) r[k] = VecF::loadu(acc + (d + k) * W);
    reduce_rows(r).store(out + d);
  }
  for (; d < D; ++d) out[d] = hsum(VecF::loadu(acc + d * W));
}

// Copy a [D][bs] V block in its own type with the columns outside [t0, t1) zeroed (all-zero
// bits are +0 in every cache type), so that p.v reads it like a block of the cache: only the
// partly visible blocks of a group (the last one, the first under a sliding window) are copied.
template <typename T>
inline const T* v_block_masked(const T* vblk, T* dst, int64_t D, int64_t bs, int64_t t0,
                               int64_t t1) {
  const char* src = reinterpret_cast<const char*>(vblk);  // a staged block of one block
  stage_block(&src, 1, &t0, &t1, bs, bs, D, static_cast<int64_t>(sizeof(T)),
              reinterpret_cast<char*>(dst));
  return dst;
}

// out[0, n) = src * s in the output type (vectorised conversion: same rounding as the scalar
// one, to nearest even).
template <typename QT>
inline void store_scaled(const float* src, float s, QT* out, int64_t n) {
  const VecF vs(s);
  int64_t d = 0;
  if constexpr (std::is_same_v<QT, float>) {
    for (; d + W <= n; d += W) (VecF::loadu(src + d) * vs).store(out + d);
  } else {
    for (; d + 2 * W <= n; d += 2 * W)
      at::vec::convert_from_float<QT>(VecF::loadu(src + d) * vs, VecF::loadu(src + d + W) * vs)
          .store(out + d);
  }
  for (; d < n; ++d) out[d] = static_cast<QT>(src[d] * s);
}

// store_scaled into an output row of dtype `dt` (fp32, fp16 or bf16, checked by the op).
inline void store_scaled_as(DType dt, const float* src, float s, void* out, int64_t n) {
  switch (dt) {
    case DType::F16: return store_scaled(src, s, static_cast<c10::Half*>(out), n);
    case DType::BF16: return store_scaled(src, s, static_cast<c10::BFloat16*>(out), n);
    default: return store_scaled(src, s, static_cast<float*>(out), n);
  }
}

// A query row of dtype `dt` times s, in fp32.
template <typename QT>
inline void scaled_row_to_f32(const QT* q, float* dst, int64_t n, float s) {
  for (int64_t d = 0; d < n; d += W) {
    const int64_t m = std::min<int64_t>(W, n - d);
    (load_f32(q + d, m) * VecF(s)).store(dst + d, m);
  }
}
inline void query_row_to_f32(const void* q, DType dt, float* dst, int64_t n, float s) {
  switch (dt) {
    case DType::F16: return scaled_row_to_f32(static_cast<const c10::Half*>(q), dst, n, s);
    case DType::BF16: return scaled_row_to_f32(static_cast<const c10::BFloat16*>(q), dst, n, s);
    default: return scaled_row_to_f32(static_cast<const float*>(q), dst, n, s);
  }
}

// Convert (16-bit / fp8 caches) or copy a [D][bs] V block to fp32, zeroing columns outside
// [t0, t1): their probability is 0 for every row, but 0 * NaN would still be NaN.
template <typename T>
inline void v_block_to_f32(const T* vblk, float* dst, int64_t D, int64_t bs, int64_t t0,
                           int64_t t1) {
  const int64_t n = D * bs;
  int64_t j = 0;
  for (; j + W <= n; j += W) load_f32(vblk + j).store(dst + j);
  for (; j < n; ++j) dst[j] = to_f32(vblk[j]);
  if (t0 > 0 || t1 < bs) {
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t t = 0; t < t0; ++t) dst[d * bs + t] = 0.f;
      for (int64_t t = t1; t < bs; ++t) dst[d * bs + t] = 0.f;
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
