// The CPU attention kernel's tuning constants, in one place. Each was chosen by interleaved
// A/B timings of calls reading their caches from DRAM (benchmarks/cpu_grid.py,
// benchmarks/ab_kernels.py; how: docs/cpu_kernel.md). No torch
// header: the work plan includes this and is tested without torch (tests/work_plan_check.cpp).
// Constants that depend on the vector width take it as `lanes` (fp32 lanes: 8 or 16).
#pragma once

#include <cstdint>

// Phase switches of benchmarks/kernel_phases.py, which times the phases by building the kernel
// without each one (the others then run on stale but finite data): q.k, the softmax step, p.v.
// PHASE_ARITH reads only the first two blocks of every sequence, alternately, so that K and V
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

namespace paged::cpu {

// The block table column read for the sequence's block b: b itself, or under PHASE_ARITH one
// of the first two.
constexpr int64_t block_column(int64_t b) { return PAGED_OPS_PHASE_ARITH ? b % 2 : b; }

// --- Work plan (work_plan.h) ---
// Blocks per softmax step: at most kGroup, and about kGroupBytes of one kv head's keys (as
// many of values), so that a group's K and V and the next group's, prefetched meanwhile, stay
// well inside L2 whatever the block size, head size and cache dtype.
constexpr int64_t kGroup = 8;
constexpr int64_t kGroupBytes = 64 << 10;
// A split of a sequence's blocks covers at least this many key elements (512 tokens at head
// size 128), so that each item runs long enough for its prefetches to pay and the merge of the
// splits' states stays negligible.
constexpr int64_t kMinSplitElements = 64 << 10;
// A parallel task covers at least this many key elements x query rows (about 2 us), a block
// visit counting at least kMinVisitTokens tokens (the per-block steps cost as much below it).
constexpr int64_t kMinTaskElements = 32 << 10;
constexpr int64_t kMinVisitTokens = 16;

// --- Prefetch (element_loads.h) ---
// The locality hint of the software prefetches of the next blocks: into L2 (1), so that the
// current blocks keep L1; -1 issues none.
constexpr int kPrefetchLocality = 1;

// --- q.k (qk.h) ---
// Two blocks of lanes / 2 tokens summed across lanes together where each fills half of the
// vectors one lane sum reads (at most 4 lanes per token).
constexpr bool kSumBlockPairs = true;
// fp8 keys by table decode: units of 4 vectors per q.k step, sharing each q vector.
constexpr int kQkFp8Units = 2;

// --- p.v (pv.h) ---
// p.v keeps a tile's sums in lanes between groups (acc) rather than summing them into its rows
// every group (tile_sums): on the 16-lane builds for V rows of 4 vectors and more (nv; block
// sizes 64 up), where a group holds few blocks. Summing every group instead, on a Zen 4:
// fp32 at block size 16 1.04-1.14x, the other dtypes at 16 and 32 0.98-1.06x; 16-bit caches
// at 128 0.78-0.81x.
constexpr bool keep_lane_sums(int64_t lanes, int64_t nv) { return lanes == 16 && nv >= 4; }
// pv_group_any's rows (5, 6, 7, 9, ... vectors, and half-vector rows) count as this many
// vectors: they keep their sums in lanes (summing every group is not measured there).
constexpr int64_t kAnyLaneNV = 4;
// V rows per pv_group step by vectors per V row (NV): where 32 vector registers hold them (16
// lanes), 4 rows: 16 accumulators for a tile of 4 query rows, 4 V vectors and a probability
// (at NV = 2, 4 rows against 3: fp16 and bf16 1.04-1.06x in arithmetic alone on a Zen 4).
// The 8-lane builds (16 registers) take 3 rows at NV = 2, else 2.
constexpr int pv_rows_per_step(int nv, int64_t lanes) {
  return lanes == 16 ? 4 : nv == 2 ? 3 : 2;
}

// --- Staging (staging.h) ---
// Block sizes staged although a fast p.v path takes them: those below kStageBelow (0: none);
// staged blocks of at least kStageMin tokens (0: as few as fill the vectors).
constexpr int64_t kStageBelow = 0;
constexpr int64_t kStageMin = 0;

// --- AMX (amx.h) ---
// q.k on tiles in two chains of accumulators, so that one chain's tile multiply overlaps the
// other's.
constexpr bool kAmxTwoChains = true;

}  // namespace paged::cpu
