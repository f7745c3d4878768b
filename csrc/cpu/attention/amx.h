// q.k and p.v of a GQA group on AMX tiles (bf16 caches read with bf16 queries): the tiles are
// loaded straight from the cache layouts, no copies of whole blocks.
//
// q.k: a chunk c of a key block ([block_size][8] bf16, see the cache layout) read as a tile of
// rows of 64 bytes is 4 tokens x 8 elements per row, up to 16 rows (64 tokens). Against a
// block-diagonal operand holding 4 query rows (amx_pack_queries), column 4 m + j of the
// product is the partial dot product of query row m with token 4 row + j, so that
// C[row][4 m + j] accumulates z[m][4 row + j] over the chunks: 4 query rows per C tile, every
// key byte loaded once per tile. Three quarters of the multiply-adds are with zeros; the tile
// unit still does them far faster than memory delivers the keys.
// p.v: a V block ([head_size][block_size]) read as rows d of up to 32 tokens is the A operand
// as it is; the probabilities go in as B, [token pair][query row] (amx_pack_probabilities),
// and C[d][r] accumulates o[r][d] for 16 rows d at a time.
//
// The product of a NaN or Inf with the zeros of the block-diagonal operand is NaN, and a
// hidden V column meets probability 0: blocks with hidden positions are read through copies
// with those positions zeroed (k_block_masked, v_block_masked in pv.h; both stage_block).
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/arch/amx_tiles.h"
#include "cpu/attention/element_loads.h"
#include "cpu/attention/staging.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// Tiles: q.k's key tile, query operand and two accumulators (query rows 0-3 and 4-7 of a
// pass), p.v's value tile, probability operand and two accumulators (16 rows d each).
enum AmxTile : int { kQkA = 0, kQkB = 1, kQkC0 = 2, kQkC1 = 3, kPvA = 4, kPvB = 5, kPvC0 = 6, kPvC1 = 7 };

// Elements of a key chunk per token (x of the bf16 cache layout).
constexpr int64_t kAmxX = 8;

// Block sizes whose blocks split into whole tiles: q.k tiles of min(bs, 64) tokens, p.v tiles
// of min(bs, 32) tokens.
inline bool amx_block_size_ok(int64_t bs) { return bs == 8 || bs == 16 || bs == 32 || bs % 64 == 0; }
inline int64_t amx_qk_tokens(int64_t bs) { return std::min<int64_t>(bs, 64); }
inline int64_t amx_pv_tokens(int64_t bs) { return std::min<int64_t>(bs, 32); }
// From 64 tokens every tile is 16 rows of 64 bytes, so q.k and p.v may borrow each other's.
inline bool amx_tiles_alike(int64_t bs) { return bs % 64 == 0; }

inline void amx_configure(int64_t bs) {
  const int qk_rows = static_cast<int>(amx_qk_tokens(bs) / 4);
  const int pv_tok = static_cast<int>(amx_pv_tokens(bs));
  const amx::Shape s[8] = {{qk_rows, 64}, {16, 64},         {qk_rows, 64}, {qk_rows, 64},
                           {16, 2 * pv_tok}, {pv_tok / 2, 64}, {16, 64},      {16, 64}};
  amx::configure(s);
}

// The query operand of q.k for R rows of one kv head (q[r] the bf16 query row r, D elements):
// for each quad of rows and each chunk c, 16 pair rows x 16 columns of bf16 pairs (512 bf16),
// out[(quad * num_chunks + c) * 512 + i * 32 + 2 n + e] = q[4 quad + n / 4][8 c + (2 i + e) % 8]
// where (2 i + e) / 8 == n % 4, else 0 (also for rows past R).
inline void amx_pack_queries(const c10::BFloat16* const* q, int64_t R, int64_t D,
                             uint16_t* out) {
  const int64_t num_chunks = D / kAmxX, quads = (R + 3) / 4;
  std::memset(out, 0, quads * num_chunks * 512 * sizeof(uint16_t));
  for (int64_t r = 0; r < R; ++r) {
    const uint16_t* qr = reinterpret_cast<const uint16_t*>(q[r]);
    const int64_t quad = r / 4, m = r % 4;
    for (int64_t c = 0; c < num_chunks; ++c) {
      uint16_t* tile = out + (quad * num_chunks + c) * 512;
      for (int64_t j = 0; j < 4; ++j)      // token j of a row of the key tile
        for (int64_t e = 0; e < kAmxX; ++e) {  // element e of its chunk: k index 8 j + e
          const int64_t kk = 8 * j + e;
          tile[(kk / 2) * 32 + 2 * (4 * m + j) + kk % 2] = qr[c * kAmxX + e];
        }
    }
  }
}

// Logits of R query rows against one key block (bs tokens, the [D / 8][bs][8] layout), unscaled:
// z[r * z_stride + t]. cbuf: 512 floats of scratch. The next block's lines are prefetched on
// pf, one step per chunk iteration (amx_qk_iterations counts them).
inline void amx_qk_block(const c10::BFloat16* kblk, const uint16_t* qtiles, int64_t R,
                         int64_t D, int64_t bs, float* z, int64_t z_stride, float* cbuf,
                         PrefetchCursor& pf) {
  const int64_t num_chunks = D / kAmxX, tok = amx_qk_tokens(bs), rows = tok / 4;
  const int64_t quads = (R + 3) / 4;
  const bool wide = amx_tiles_alike(bs);
  for (int64_t s = 0; s < bs; s += tok) {
    for (int64_t q0 = 0; q0 < quads; q0 += 2) {
      const bool two = q0 + 1 < quads;
      amx::zero<kQkC0>();
      // One quad with every tile of one shape (64-token tiles): the odd chunks go to a second
      // chain on p.v's tiles, so that two key tile loads are in flight, not one at a time
      // behind its product (the tiles are not renamed).
      const bool chains = !two && kAmxTwoChains && wide;
      if (two || chains) amx::zero<kQkC1>();
      int64_t c = 0;
      if (chains) {
        for (; c + 2 <= num_chunks; c += 2) {
          pf.step();
          amx::load<kQkA>(kblk + (c * bs + s) * kAmxX, 64);
          amx::load<kQkB>(qtiles + (q0 * num_chunks + c) * 512, 64);
          pf.step();
          amx::load<kPvA>(kblk + ((c + 1) * bs + s) * kAmxX, 64);
          amx::load<kPvB>(qtiles + (q0 * num_chunks + c + 1) * 512, 64);
          amx::dp_bf16<kQkC0, kQkA, kQkB>();
          amx::dp_bf16<kQkC1, kPvA, kPvB>();
        }
      }
      for (; c < num_chunks; ++c) {
        pf.step();
        amx::load<kQkA>(kblk + (c * bs + s) * kAmxX, 64);
        amx::load<kQkB>(qtiles + (q0 * num_chunks + c) * 512, 64);
        amx::dp_bf16<kQkC0, kQkA, kQkB>();
        if (two) {
          amx::load<kQkB>(qtiles + ((q0 + 1) * num_chunks + c) * 512, 64);
          amx::dp_bf16<kQkC1, kQkA, kQkB>();
        }
      }
      amx::store<kQkC0>(cbuf, 64);
      if (two || chains) amx::store<kQkC1>(cbuf + 256, 64);
      for (int64_t qd = q0; qd < q0 + (two ? 2 : 1); ++qd) {
        const float* cb = cbuf + (qd - q0) * 256;
        for (int64_t m = 0; m < 4 && qd * 4 + m < R; ++m) {
          float* zr = z + (qd * 4 + m) * z_stride + s;
          for (int64_t row = 0; row < rows; ++row)
            for (int64_t j = 0; j < 4; ++j) {
              const int64_t i = row * 16 + 4 * m + j;
              zr[4 * row + j] = chains ? cb[i] + cb[256 + i] : cb[i];
            }
        }
      }
    }
  }
}

inline int64_t amx_qk_iterations(int64_t R, int64_t D, int64_t bs) {
  const int64_t quads = (R + 3) / 4;
  return bs / amx_qk_tokens(bs) * ((quads + 1) / 2) * (D / kAmxX);
}

// The probability operand of p.v for a group of nb blocks: out[(k * bs + t) / 2][r] holds the
// bf16 pair (p[r][k * block_row + t], p[r][k * block_row + t + 1]) for even t, rows r < R of
// p (p_stride apart), 0 in the columns r >= R. Rounded to nearest even: the probabilities lose
// their low 16 bits, as they do in every bf16 p.v.
inline void amx_pack_probabilities(const float* p, int64_t p_stride, int64_t R, int64_t nb,
                                   int64_t bs, int64_t block_row, uint32_t* out) {
  std::memset(out, 0, nb * bs / 2 * 16 * sizeof(uint32_t));
  alignas(64) uint32_t pairs[W];  // 2 W bf16: W pairs
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t k = 0; k < nb; ++k) {
      const float* src = p + r * p_stride + k * block_row;
      uint32_t* dst = out + (k * bs / 2) * 16 + r;
      for (int64_t t = 0; t < bs; t += 2 * W) {
        const int64_t n = std::min<int64_t>(2 * W, bs - t);  // even: bs is
        at::vec::convert_from_float<c10::BFloat16>(VecF::loadu(src + t, std::min<int64_t>(W, n)),
                                                   VecF::loadu(src + t + W, std::max<int64_t>(n - W, 0)))
            .store(pairs, n);
        for (int64_t i = 0; i < n / 2; ++i) dst[(t / 2 + i) * 16] = pairs[i];
      }
    }
  }
}

// p.v of a group of nb V blocks (v[k]: [D][bs] bf16, hidden columns zeroed) for up to 16 rows:
// acc[d * 16 + r] = acc * alpha[r] + sum_t p[r][t] v[t][d] (init: = the sum). pvnni: from
// amx_pack_probabilities. next[k]: the blocks to prefetch (vrow_bytes per row d). cbuf: 512
// floats of scratch.
inline void amx_pv_group(const c10::BFloat16* const* v, int64_t nb, int64_t bs, int64_t D,
                         const uint32_t* pvnni, float* acc, const float* alpha, bool init,
                         float* cbuf, const c10::BFloat16* const* next) {
  static_assert(!kAmx || W == 16, "the p.v accumulators are 16 rows, one vector per d");
  const int64_t tok = amx_pv_tokens(bs), vrow_bytes = bs * 2;
  const VecF va = VecF::loadu(alpha);
  const bool chains = kAmxTwoChains && amx_tiles_alike(bs);
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    const bool two = d0 + 16 < D;
    amx::zero<kPvC0>();
    if (two) amx::zero<kPvC1>();
    for (int64_t k = 0; k < nb; ++k) {
      // The same rows of the next block, meanwhile, a share before each tile load: asked for
      // in one burst (8 KiB at block size 128) they wait for the core's miss buffers, and so
      // do the tile loads behind them.
      const char* pf = reinterpret_cast<const char*>(next[k]) + d0 * vrow_bytes;
      const int64_t pf_bytes = (two ? 32 : 16) * vrow_bytes;
      PrefetchCursor vpf(pf, pf_bytes, bs / tok * (two ? 2 : 1));
      for (int64_t s = 0; s < bs; s += tok) {
        vpf.step();
        amx::load<kPvB>(pvnni + (k * bs + s) / 2 * 16, 64);
        amx::load<kPvA>(v[k] + d0 * bs + s, vrow_bytes);
        if (two && chains) {  // the second rows' tile loads while the first one's product runs
          vpf.step();
          amx::load<kQkA>(v[k] + (d0 + 16) * bs + s, vrow_bytes);
          amx::dp_bf16<kPvC0, kPvA, kPvB>();
          amx::dp_bf16<kPvC1, kQkA, kPvB>();
          continue;
        }
        amx::dp_bf16<kPvC0, kPvA, kPvB>();
        if (two) {
          vpf.step();
          amx::load<kPvA>(v[k] + (d0 + 16) * bs + s, vrow_bytes);
          amx::dp_bf16<kPvC1, kPvA, kPvB>();
        }
      }
    }
    amx::store<kPvC0>(cbuf, 64);
    if (two) amx::store<kPvC1>(cbuf + 256, 64);
    for (int64_t d = d0; d < d0 + (two ? 32 : 16); ++d) {
      const VecF c = VecF::loadu(cbuf + (d - d0) * 16);
      (init ? c : at::vec::fmadd(VecF::loadu(acc + d * 16), va, c)).store(acc + d * 16);
    }
  }
}

// A [D / x][bs][x] key block copied with the tokens outside [t0, t1) zeroed (see the top).
template <typename T>
inline const T* k_block_masked(const T* kblk, T* dst, int64_t num_chunks, int64_t bs,
                               int64_t x, int64_t t0, int64_t t1) {
  const char* src = reinterpret_cast<const char*>(kblk);  // a staged block of one block
  stage_block(&src, 1, &t0, &t1, bs, bs, num_chunks, x * static_cast<int64_t>(sizeof(T)),
              reinterpret_cast<char*>(dst));
  return dst;
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
