// q.k of the attention kernel: the logits of a tile of query rows against one key block,
// read in place from the cache's [head_size / x][block_size][x] layout.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "cpu/attention/element_loads.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// One q.k step over every chunk of a key block, for TOK units of H vectors each starting at
// element `in` of the chunk; unit t pairs with the q chunk (H vectors, q repeated to H * W
// lanes) and accumulates into raw[g][out + t * W ...]. Each q vector is loaded once per chunk
// for all TOK units (kept in a register, not folded into every FMA: loads bound the loop).
//   H = 1 (x <= W, q repeated): units are K vectors, several tokens' chunks each when x < W.
//   H = 2 (q repeated to 2 W lanes): units of 2 W elements whose two halves fold into one
//     accumulator. fp8 on AVX2 (x = 2 W): a unit is one token's chunk, raw holds W lanes per
//     token. bf16 on AVX2 read in pairs (load_bf16_pairs): a unit is two tokens' chunks split
//     into even and odd elements, raw holds W / 2 lanes per token.
//   H = 4: fp8 keys by table decode (qk_tile_fp8): a unit is 4 W bytes, four tokens' chunks
//     (x = W) in decode_fp8_by_tables' order, raw holds 4 lanes per token.
template <int G_T, int TOK, int H, typename T>
inline void qk_step(const T* kblk, const float* qrep, float* raw, int64_t num_chunks,
                    int64_t chunk_elems, int64_t raw_stride, PrefetchCursor& pf, int64_t in,
                    int64_t out) {
  VecF a[G_T][TOK];
  for (int g = 0; g < G_T; ++g)
    for (int t = 0; t < TOK; ++t) a[g][t] = VecF(0.f);
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t off = c * chunk_elems + in;
    pf.step();
    VecF k[TOK][H];
    for (int t = 0; t < TOK; ++t) {
      if constexpr (H == 4) {
        decode_fp8_by_tables<T>(reinterpret_cast<const uint8_t*>(kblk + off + t * 4 * W), k[t]);
      } else if constexpr (H == 2) {
        if constexpr (kSplitPairs<T>) {
          load_bf16_pairs(kblk + off + t * 2 * W, k[t][0], k[t][1]);  // q split to match
        } else {
          load2_f32(kblk + off + t * 2 * W, k[t][0], k[t][1]);
        }
      } else {
        k[t][0] = load_f32(kblk + off + t * W);
      }
    }
    for (int g = 0; g < G_T; ++g) {
      for (int h = 0; h < H; ++h) {
        const VecF q = in_register(VecF::loadu(qrep + (g * num_chunks + c) * H * W + h * W));
        for (int t = 0; t < TOK; ++t) a[g][t] = at::vec::fmadd(k[t][h], q, a[g][t]);
      }
    }
  }
  for (int g = 0; g < G_T; ++g)
    for (int t = 0; t < TOK; ++t) a[g][t].store(raw + g * raw_stride + out + t * W);
}

// qk_tile's four-vector step (16 lanes: 32 vector registers).
constexpr bool kQkFourVectors = W == 16;

// raw[g][j] = sum_c qrep[g][c][j % q_repeat] * kblk[c][j] for the G_T rows of a tile, where
// kblk[c] is the [bs][x] chunk c of a key block (flat index j = t * x + i) and qrep[g][c] holds
// q chunk c repeated to q_repeat = max(x, W) lanes, so the q vector at offset j % q_repeat lines
// up with the K vector at j. q_repeat == 2 W (fp8, or bf16 read in pairs, on AVX2): the two
// halves fold into
// W lanes per unit instead (qk_step, H = 2). Every chunk iteration steps the prefetch cursor
// once: qk_tile_iterations counts them and must follow any change to these loops.
template <int G_T, bool ONE_Q, typename T>
inline void qk_tile(const T* kblk, const float* qrep, float* raw, int64_t num_chunks,
                    int64_t chunk_elems, int64_t raw_stride, int64_t q_repeat, PrefetchCursor& pf) {
  // ONE_Q: q_repeat == W, so every K vector of a chunk pairs with the same q vector.
  if (!ONE_Q && q_repeat == 2 * W) {  // two units per step, each q half loaded once for both
    const int64_t units = chunk_elems / q_repeat;  // of 2 W elements: see qk_step, H = 2
    int64_t t = 0;
    for (; t + 2 <= units; t += 2)
      qk_step<G_T, 2, 2>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, t * q_repeat,
                         t * W);
    for (; t < units; ++t)
      qk_step<G_T, 1, 2>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, t * q_repeat,
                         t * W);
    return;
  }
  int64_t j = 0;
  if constexpr (ONE_Q) {
    // Four K vectors per step where 32 vector registers hold 4 G_T accumulators (16 lanes):
    // 4 K loads + G_T q loads feed 4 G_T FMAs (a chunk of 4 vectors, fp16 at block size 8,
    // would otherwise be taken as 3 + 1).
    if constexpr (kQkFourVectors) {
      for (; j + 4 * W <= chunk_elems; j += 4 * W)
        qk_step<G_T, 4, 1>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, j, j);
    }
    // Three K vectors per step: 3 K loads + G_T q loads feed 3 G_T FMAs (the two-vector step
    // below needs 2 G_T q loads for 2 G_T FMAs, and runs out of load slots first).
    for (; j + 3 * W <= chunk_elems; j += 3 * W)
      qk_step<G_T, 3, 1>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, j, j);
  }
  // Two K vectors per step: 2 loads + G_T (or 2 G_T) q loads feed 2 G_T FMAs.
  for (; j + 2 * W <= chunk_elems; j += 2 * W) {
    const int64_t o0 = j % q_repeat, o1 = (j + W) % q_repeat;
    VecF a[G_T], b[G_T];
    for (int g = 0; g < G_T; ++g) a[g] = b[g] = VecF(0.f);
    for (int64_t c = 0; c < num_chunks; ++c) {
      pf.step();
      const VecF k0 = load_f32(kblk + c * chunk_elems + j);
      const VecF k1 = load_f32(kblk + c * chunk_elems + j + W);
      for (int g = 0; g < G_T; ++g) {
        const float* q = qrep + (g * num_chunks + c) * q_repeat;
        const VecF q0 = VecF::loadu(q + (ONE_Q ? 0 : o0));
        a[g] = at::vec::fmadd(k0, q0, a[g]);
        b[g] = at::vec::fmadd(k1, ONE_Q ? q0 : VecF::loadu(q + o1), b[g]);
      }
    }
    for (int g = 0; g < G_T; ++g) {
      a[g].store(raw + g * raw_stride + j);
      b[g].store(raw + g * raw_stride + j + W);
    }
  }
  for (; j < chunk_elems; j += W) {
    const int64_t cnt = std::min<int64_t>(W, chunk_elems - j);
    const int64_t o0 = j % q_repeat;
    VecF a[G_T];
    for (int g = 0; g < G_T; ++g) a[g] = VecF(0.f);
    for (int64_t c = 0; c < num_chunks; ++c) {
      pf.step();
      const VecF k = load_f32(kblk + c * chunk_elems + j, cnt);
      for (int g = 0; g < G_T; ++g) {
        a[g] = at::vec::fmadd(k, VecF::loadu(qrep + (g * num_chunks + c) * q_repeat + o0), a[g]);
      }
    }
    for (int g = 0; g < G_T; ++g) a[g].store(raw + g * raw_stride + j);
  }
}

// Chunk iterations of one qk_tile call (one PrefetchCursor::step() each), mirroring its loops.
inline int64_t qk_tile_iterations(int64_t chunk_elems, int64_t num_chunks, int64_t q_repeat) {
  int64_t steps = 0;
  if (q_repeat == 2 * W) {
    const int64_t units = chunk_elems / q_repeat;
    steps = units / 2 + units % 2;
  } else {
    const int64_t four = q_repeat == W && kQkFourVectors ? chunk_elems / (4 * W) : 0;
    const int64_t after4 = chunk_elems - four * 4 * W;
    const int64_t three = q_repeat == W ? after4 / (3 * W) : 0;
    const int64_t two = (after4 - three * 3 * W) / (2 * W);
    steps = four + three + two + (after4 - three * 3 * W - two * 2 * W + W - 1) / W;
  }
  return steps * num_chunks;
}

// q.k of bf16 keys by bf16 pair dot products (Layout::dot_bf16; fp8 keys: qk_dot_quads): a
// unit is 2 W elements of a chunk (2 W / x tokens' chunks), qrep[g][c] the q chunk's x bf16
// values repeated to 2 W (in W float slots), and raw gets W lanes per unit, x / 2 pair sums per
// token. TOK units per step share each q load.
template <int G_T, int TOK, typename T>
inline void qk_dot_step(const T* kblk, const float* qrep, float* raw, int64_t num_chunks,
                        int64_t chunk_elems, int64_t raw_stride, PrefetchCursor& pf,
                        int64_t unit0) {
  VecF a[G_T][TOK];
  PAGED_UNROLL
  for (int g = 0; g < G_T; ++g)
    PAGED_UNROLL
    for (int t = 0; t < TOK; ++t) a[g][t] = VecF(0.f);
  for (int64_t c = 0; c < num_chunks; ++c) {
    pf.step();
    const T* kc = kblk + c * chunk_elems + unit0 * 2 * W;
    BF16Pairs k[TOK];
    for (int t = 0; t + 1 < TOK; t += 2) load_pairs2(kc + t * 2 * W, k[t], k[t + 1]);
    if constexpr (TOK % 2 == 1) k[TOK - 1] = load_pairs(kc + (TOK - 1) * 2 * W);
    for (int g = 0; g < G_T; ++g) {
      const BF16Pairs q = load_pairs(qrep + (g * num_chunks + c) * W);
      for (int t = 0; t < TOK; ++t) a[g][t] = dot_pairs(a[g][t], k[t], q);
    }
  }
  PAGED_UNROLL
  for (int g = 0; g < G_T; ++g)
    PAGED_UNROLL
    for (int t = 0; t < TOK; ++t) a[g][t].store(raw + g * raw_stride + (unit0 + t) * W);
}

// q.k of a pair of blocks summed together (Layout::pair_qk) whose chunks are two operands
// each: bf16 pairs (DOT: qk_dot_step's units, bf16 at block size W / 2) or fp32 vectors
// (qk_tile's, fp32 at W / 2, chunks of 2 W elements). One step of four operands over both
// blocks, 0-1 from kb0 and 2-3 from kb1 (raw holds the pair's sums one block after the other),
// so that the four share each q load (a call per fp32 block ran 6 loads per 8 FMAs) and the 16
// accumulators of a tile overlap their latencies; each block's cursor steps once per chunk, as
// in a call per block.
template <int G_T, bool DOT, typename T>
inline void qk_pair_step(const T* kb0, const T* kb1, const float* qrep, float* raw,
                         int64_t num_chunks, int64_t chunk_elems, int64_t raw_stride,
                         PrefetchCursor& pf0, PrefetchCursor& pf1) {
  const int64_t ce = DOT ? chunk_elems : 2 * W;  // fp32: a constant stride
  VecF a[G_T][4];
  PAGED_UNROLL
  for (int g = 0; g < G_T; ++g)
    PAGED_UNROLL
    for (int t = 0; t < 4; ++t) a[g][t] = VecF(0.f);
  for (int64_t c = 0; c < num_chunks; ++c) {
    pf0.step();
    pf1.step();
    const T* k0 = kb0 + c * ce;
    const T* k1 = kb1 + c * ce;
    if constexpr (DOT) {
      BF16Pairs k[4];
      load_pairs2(k0, k[0], k[1]);
      load_pairs2(k1, k[2], k[3]);
      for (int g = 0; g < G_T; ++g) {
        const BF16Pairs q = load_pairs(qrep + (g * num_chunks + c) * W);
        for (int t = 0; t < 4; ++t) a[g][t] = dot_pairs(a[g][t], k[t], q);
      }
    } else {
      const VecF k[4] = {load_f32(k0), load_f32(k0 + W), load_f32(k1), load_f32(k1 + W)};
      for (int g = 0; g < G_T; ++g) {
        const VecF q = in_register(VecF::loadu(qrep + (g * num_chunks + c) * W));
        for (int t = 0; t < 4; ++t) a[g][t] = at::vec::fmadd(k[t], q, a[g][t]);
      }
    }
  }
  PAGED_UNROLL
  for (int g = 0; g < G_T; ++g)
    PAGED_UNROLL
    for (int t = 0; t < 4; ++t) a[g][t].store(raw + g * raw_stride + t * W);
}

// q.k of fp8 keys by bf16 pair dot products (Layout::dot_bf16 on fp8): DEC decodes of 4 W
// bytes (four tokens' chunks, x = 16) per step, each in decode_fp8_quads' order: block L of lo
// is token L's elements 0-7, of hi its elements 8-15, against qrep[g][c] = the q chunk's
// elements 0-7 repeated to 2 W bf16, then 8-15 likewise (2 W float slots). Both go to one
// accumulator per decode: raw gets W lanes per decode, 4 per token (Layout::x_sum), half the
// lanes decode_fp8_pairs' order leaves to sum, and without its byte reordering.
// PAIR: decodes [0, DEC / 2) of kblk and as many of kblk1 (blocks of DEC / 2 decodes, summed
// together: Layout::pair_qk), each block's cursor stepped once per chunk.
template <int G_T, int DEC, bool PAIR = false, typename T>
inline void qk_dot_quads(const T* kblk, const float* qrep, float* raw, int64_t num_chunks,
                         int64_t chunk_elems, int64_t raw_stride, PrefetchCursor& pf,
                         int64_t dec0, const T* kblk1 = nullptr, PrefetchCursor* pf1 = nullptr) {
  VecF a[G_T][DEC];
  PAGED_UNROLL
  for (int g = 0; g < G_T; ++g)
    PAGED_UNROLL
    for (int d = 0; d < DEC; ++d) a[g][d] = VecF(0.f);
  for (int64_t c = 0; c < num_chunks; ++c) {
    pf.step();
    if constexpr (PAIR) pf1->step();
    const uint8_t* kc = reinterpret_cast<const uint8_t*>(kblk + c * chunk_elems) + dec0 * 4 * W;
    BF16Pairs kl[DEC], kh[DEC];
    if constexpr (PAIR) {
      const uint8_t* kc1 = reinterpret_cast<const uint8_t*>(kblk1 + c * chunk_elems);
      for (int d = 0; d < DEC / 2; ++d) {
        decode_fp8_quads<T>(kc + d * 4 * W, kl[d], kh[d]);
        decode_fp8_quads<T>(kc1 + d * 4 * W, kl[DEC / 2 + d], kh[DEC / 2 + d]);
      }
    } else {
      for (int d = 0; d < DEC; ++d) decode_fp8_quads<T>(kc + d * 4 * W, kl[d], kh[d]);
    }
    for (int g = 0; g < G_T; ++g) {
      const float* q = qrep + (g * num_chunks + c) * 2 * W;
      const BF16Pairs ql = load_pairs(q), qh = load_pairs(q + W);
      for (int d = 0; d < DEC; ++d) a[g][d] = dot_pairs(dot_pairs(a[g][d], kl[d], ql), kh[d], qh);
    }
  }
  PAGED_UNROLL
  for (int g = 0; g < G_T; ++g)
    PAGED_UNROLL
    for (int d = 0; d < DEC; ++d) a[g][d].store(raw + g * raw_stride + (dec0 + d) * W);
}

// Steps of 4, 2 and 1 units: 4 G_T + 4 + 1 vectors live at once (21 of AVX-512's 32 registers
// for a tile of 4 rows). fp8: qk_dot_quads' steps of 4, 2 and 1 decodes, 4 G_T + 8 + 2 and the
// 5 table vectors at 4 (31 registers). Every chunk iteration steps the prefetch cursor once,
// as in qk_tile; qk_dot_iterations counts them.
template <int G_T, typename T>
inline void qk_tile_dot(const T* kblk, const float* qrep, float* raw, int64_t num_chunks,
                        int64_t chunk_elems, int64_t raw_stride, PrefetchCursor& pf) {
  if constexpr (is_fp8_v<T>) {
    const int64_t decs = chunk_elems / (4 * W);
    int64_t d = 0;
    for (; d + 4 <= decs; d += 4)
      qk_dot_quads<G_T, 4>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, d);
    for (; d + 2 <= decs; d += 2)
      qk_dot_quads<G_T, 2>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, d);
    if (d < decs) qk_dot_quads<G_T, 1>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, d);
  } else {
    const int64_t units = chunk_elems / (2 * W);
    int64_t u = 0;
    for (; u + 4 <= units; u += 4)
      qk_dot_step<G_T, 4>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, u);
    for (; u + 2 <= units; u += 2)
      qk_dot_step<G_T, 2>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, u);
    for (; u < units; ++u)
      qk_dot_step<G_T, 1>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, u);
  }
}

inline int64_t qk_dot_iterations(int64_t chunk_elems, int64_t num_chunks, bool fp8) {
  const int64_t n = chunk_elems / (fp8 ? 4 * W : 2 * W);  // decodes (fp8) or units per chunk
  return (n / 4 + n % 4 / 2 + n % 2) * num_chunks;
}

// q.k of an fp8 key block by table decode (Layout::fp8_tables): qk_step's units of H = 4
// vectors; qrep[g][c] holds the q chunk in decode_fp8_by_tables' order (4 W floats, fill_qrep).
// Two units per step share each q vector (8 accumulators, 8 K vectors and the tables live).
template <int G_T, typename T>
inline void qk_tile_fp8(const T* kblk, const float* qrep, float* raw, int64_t num_chunks,
                        int64_t chunk_elems, int64_t raw_stride, PrefetchCursor& pf) {
  constexpr int U = kQkFp8Units;
  const int64_t units = chunk_elems / (4 * W);
  int64_t u = 0;
  for (; u + U <= units; u += U)
    qk_step<G_T, U, 4>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, u * 4 * W,
                       u * W);
  for (; u < units; ++u)
    qk_step<G_T, 1, 4>(kblk, qrep, raw, num_chunks, chunk_elems, raw_stride, pf, u * 4 * W,
                       u * W);
}

inline int64_t qk_fp8_iterations(int64_t chunk_elems, int64_t num_chunks) {
  const int64_t units = chunk_elems / (4 * W);
  return (units / kQkFp8Units + units % kQkFp8Units) * num_chunks;
}

// z[t] = scale * sum_i raw[t * X + i] for t < ntok: the tokens sum_lane_groups_by_shuffles
// leaves (all of them where the build has none), with X a constant so that the compiler
// vectorizes it.
template <int X>
inline void sum_lanes(const float* __restrict raw, int64_t ntok, float* __restrict z,
                      float scale) {
  for (int64_t t = 0; t < ntok; ++t) {
    float v = 0.f;
    for (int i = 0; i < X; ++i) v += raw[t * X + i];
    z[t] = scale * v;
  }
}

// z[t] = scale * sum_i raw[t * x + i] for t < ntok: the per-token q.k dot products (scaled
// here where q is not: Layout::dot_bf16), or the rows of p.v accumulators whose lanes hold x
// partial sums per row (Layout::acc_lanes).
inline void sum_lane_groups(const float* raw, int64_t x, int64_t ntok, float* z,
                            float scale = 1.f) {
  const int64_t t = sum_lane_groups_by_shuffles(raw, x, ntok, z, scale);  // tokens [0, t) done
  if (t == ntok) return;
  // x is Layout::x_sum (16 / sizeof(cache element) or half of it) or acc_lanes: 4, 8 or 16.
  switch (x) {
    case 4: return sum_lanes<4>(raw + t * x, ntok - t, z + t, scale);
    case 8: return sum_lanes<8>(raw + t * x, ntok - t, z + t, scale);
    case 16: return sum_lanes<16>(raw + t * x, ntok - t, z + t, scale);
    default: TORCH_INTERNAL_ASSERT(false, "sum_lane_groups: ", x, " lanes per token");
  }
}

// sum_lane_groups of `rows` rows (raw rows raw_stride apart, z rows z_stride apart) in one
// call: the rows' shuffle trees are independent of each other and overlap, where a call per
// row waits out each tree's latency (block size 8, 4 rows: a third of the time outside q.k,
// the softmax step and p.v).
inline void sum_lane_groups_rows(const float* raw, int64_t raw_stride, int64_t rows, int64_t x,
                                 int64_t ntok, float* z, int64_t z_stride, float scale) {
  int64_t t = 0;
  for (int64_t r = 0; r < rows; ++r)
    t = sum_lane_groups_by_shuffles(raw + r * raw_stride, x, ntok, z + r * z_stride, scale);
  if (t == ntok) return;
  for (int64_t r = 0; r < rows; ++r)  // the tokens the shuffles leave, the same in every row
    sum_lane_groups(raw + r * raw_stride + t * x, x, ntok - t, z + r * z_stride + t, scale);
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
