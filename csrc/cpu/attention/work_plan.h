// How a call of the CPU attention kernel is cut into work items (make_plan) and what an item
// covers (item_info). Plain C++ on the kernel's parameters (kernels.h): no torch, no vectors.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <vector>

#include "cpu/attention/tuning.h"
#include "cpu/kernels.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// kGroup, kGroupBytes, kMinSplitElements, kMinTaskElements, kMinVisitTokens: tuning.h.

template <typename T, typename A>
inline void grow(std::vector<T, A>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

// Storage aligned to cache lines. The kernel's scratch rows are whole lines (multiples of 16
// floats) and are read and written by 64-byte vectors and tile rows, each of which touches
// two lines when the row is not aligned (malloc aligns to 16 bytes only).
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

// Per-call buffers shared by the threads of a call, owned by the calling thread and reused from
// call to call (grow-only): a call allocates nothing once the shapes have been seen. (Split-K
// states reach MiBs on many-core machines, where malloc hands them out with mmap: fresh pages,
// faulted in on every call.)
struct CallScratch {
  std::vector<int64_t> chunk_start;  // Plan::chunk_start
  std::vector<int64_t> task_start;   // Plan::task_start
  std::vector<double> item_cost;     // make_plan: each item's cost (item_cost)
  std::vector<float> part_ml, part_o;  // split-K partial states (attention_cache)
};

inline CallScratch& call_scratch() {
  static thread_local CallScratch s;
  return s;
}

// The position of query row j of a sequence of length L with q_len query rows: its last
// visible position. Causal rows are the sequence's last q_len positions; non-causal rows
// (P.causal false) all sit at L - 1 and see the whole sequence. Decode (q_len 1) is L - 1 both
// ways.
inline int64_t row_position(const AttentionParams& P, int64_t L, int64_t q_len, int64_t j) {
  return P.causal ? L - q_len + j : L - 1;
}

// First position visible to a query row at position Ppos (sliding window; else 0).
inline int64_t first_visible(const AttentionParams& P, int64_t Ppos) {
  return P.sliding_window > 0 ? std::max<int64_t>(0, Ppos - P.sliding_window + 1) : 0;
}

// The plan sizes work in key elements of one kv head (tokens x head size), not in blocks, so
// that it holds at every block size. Not in bytes: a small call's time follows its arithmetic,
// the same per element for every cache dtype.
// How the work is cut: items enumerate (sequence, kv heads, token chunk, split).
struct Plan {
  int64_t tokens_per_chunk;  // query tokens per item (1 for decode)
  int64_t heads_per_item;    // kv heads per item (decode; 1 for multi-token)
  int64_t head_chunks;       // items per sequence and split: num_kv_heads / heads_per_item,
                             // rounded up (the last chunk may have fewer heads)
  int64_t splits;            // block-range splits per sequence (decode only)
  const int64_t* chunk_start;  // multi-token: prefix sums of chunks per sequence (in
                               // call_scratch(), num_seqs + 1 of them)
  int64_t num_items;
  int64_t grain;             // items per parallel task, on average
  // The parallel tasks: task t runs items [task_start[t], task_start[t + 1]) (in
  // call_scratch(), num_tasks + 1 of them), cut where the items' costs (item_cost) reach
  // equal shares. at::parallel_for hands each thread one contiguous run of equal counts, and
  // items of equal counts can differ in cost many times over (a causal prompt's later chunks
  // see more blocks; sequences of different lengths).
  int64_t num_tasks;
  const int64_t* task_start;
};

// What a work item covers: its sequence, kv heads [kvh, kvh + nh), split, query tokens
// [j0, j1) of the sequence's q_len (rows from row0), and the block range [b_first, b_last]
// visible to some row (lo_min: first visible position, P_max: last; L: the sequence length).
struct ItemInfo {
  int64_t s, kvh, nh, split, j0, j1, q_len, row0, L, lo_min, P_max, b_first, b_last;
};

inline ItemInfo item_info(const AttentionParams& P, const Plan& plan, int64_t item) {
  const int64_t bs = P.block_size;
  ItemInfo it{};
  it.j0 = 0;
  it.j1 = 1;
  it.q_len = 1;
  it.nh = 1;
  it.split = 0;
  if (P.query_start_loc != nullptr) {
    const int64_t c = item / P.num_kv_heads;
    it.kvh = item % P.num_kv_heads;
    it.s = std::upper_bound(plan.chunk_start, plan.chunk_start + P.num_seqs + 1, c) -
           plan.chunk_start - 1;
    it.q_len = P.query_start_loc[it.s + 1] - P.query_start_loc[it.s];
    it.j0 = (c - plan.chunk_start[it.s]) * plan.tokens_per_chunk;
    it.j1 = std::min(it.q_len, it.j0 + plan.tokens_per_chunk);
    it.row0 = P.query_start_loc[it.s];
  } else {
    it.split = item % plan.splits;
    it.kvh = (item / plan.splits) % plan.head_chunks * plan.heads_per_item;
    it.nh = std::min(plan.heads_per_item, P.num_kv_heads - it.kvh);
    it.s = item / (plan.splits * plan.head_chunks);
    it.row0 = it.s;
  }
  it.L = P.seq_lens[it.s * P.sl_stride];
  // Row j sees [max(0, Ppos - window + 1), Ppos] with Ppos = row_position(j): both bounds
  // grow with j (non-causal: both are constant).
  it.lo_min = first_visible(P, row_position(P, it.L, it.q_len, it.j0));
  it.P_max = row_position(P, it.L, it.q_len, it.j1 - 1);
  it.b_first = it.L > 0 ? it.lo_min / bs : 0;
  it.b_last = it.L > 0 ? it.P_max / bs : -1;
  if (plan.splits > 1) {
    const int64_t nblk = it.b_last - it.b_first + 1;
    const int64_t per = (nblk + plan.splits - 1) / plan.splits;
    const int64_t a = it.b_first + it.split * per;
    it.b_last = std::min(it.b_last, a + per - 1);
    it.b_first = a;
  }
  return it;
}

// An item's share of the work, in the units of make_plan's cost: the blocks its rows visit
// (each counting at least kMinVisitTokens tokens) x its query rows x its kv heads.
inline double item_cost(const AttentionParams& P, const Plan& plan, int64_t item) {
  const ItemInfo it = item_info(P, plan, item);
  const int64_t G = P.num_heads / P.num_kv_heads;
  const double blocks = static_cast<double>(std::max<int64_t>(it.b_last - it.b_first + 1, 1));
  const double tokens = static_cast<double>(std::max<int64_t>(P.block_size, kMinVisitTokens));
  return blocks * tokens * static_cast<double>((it.j1 - it.j0) * G * it.nh);
}

inline Plan make_plan(const AttentionParams& P) {
  const int64_t G = P.num_heads / P.num_kv_heads;
  const int64_t bs = P.block_size;
  const bool multi = P.query_start_loc != nullptr;
  const int64_t block_elems = bs * P.head_size;
  const int64_t visit_elems = std::max(bs, kMinVisitTokens) * P.head_size;
  // One pass over the sequences: the longest one (for the split) and the key elements x query
  // rows of the whole call (for the grain below; a double: a long prefill's tokens x rows x
  // head size can pass 2^63).
  int64_t max_len = 0;
  double total_cost = 0;
  for (int64_t s = 0; s < P.num_seqs; ++s) {
    const int64_t len = P.seq_lens[s * P.sl_stride];
    const int64_t rows = multi ? (P.query_start_loc[s + 1] - P.query_start_loc[s]) * G : G;
    max_len = std::max(max_len, len);
    total_cost += static_cast<double>((len + bs - 1) / bs) * static_cast<double>(rows) *
                  static_cast<double>(P.num_kv_heads * visit_elems);
  }

  Plan plan;
  plan.chunk_start = nullptr;
  plan.splits = 1;
  plan.heads_per_item = 1;
  plan.head_chunks = P.num_kv_heads;
  if (multi) {
    // Chunks of query tokens: about 64 query rows per item keeps the scratch in L2 and gives
    // long prompts parallelism.
    plan.tokens_per_chunk = std::max<int64_t>(1, 64 / G);
    std::vector<int64_t>& starts = call_scratch().chunk_start;
    grow(starts, P.num_seqs + 1);
    starts[0] = 0;
    for (int64_t s = 0; s < P.num_seqs; ++s) {
      const int64_t q_len = P.query_start_loc[s + 1] - P.query_start_loc[s];
      starts[s + 1] = starts[s] + (q_len + plan.tokens_per_chunk - 1) / plan.tokens_per_chunk;
    }
    plan.chunk_start = starts.data();
    plan.num_items = starts[P.num_seqs] * P.num_kv_heads;
  } else {
    plan.tokens_per_chunk = 1;
    // An item reads every kv head of its blocks: a block's heads are contiguous in the cache,
    // and scattered runs are read much faster when long (benchmarks/scattered_read.cpp, 2
    // cores: 19-26 GB/s for the 4-8 KiB of one head, 29-31 for 32-64 KiB). Too few items
    // for the threads (2 per thread): split the block range of each sequence first (keeping
    // kMinSplitElements per split), then its kv heads.
    plan.heads_per_item = P.num_kv_heads;
    plan.head_chunks = 1;
    const int64_t want_items = 2 * P.num_threads;
    if (P.num_threads > 1 && P.num_seqs < want_items) {
      const int64_t max_blocks = (max_len + bs - 1) / bs;
      // >= 1: the op checks block_size and head_size >= 1.
      const int64_t split_blocks = (kMinSplitElements + block_elems - 1) / block_elems;
      const int64_t want = (want_items + P.num_seqs - 1) / std::max<int64_t>(P.num_seqs, 1);
      plan.splits = std::max<int64_t>(1, std::min<int64_t>(want, max_blocks / split_blocks));
      while (P.num_seqs * plan.head_chunks * plan.splits < want_items && plan.heads_per_item > 1) {
        plan.heads_per_item = (plan.heads_per_item + 1) / 2;
        plan.head_chunks = (P.num_kv_heads + plan.heads_per_item - 1) / plan.heads_per_item;
      }
    }
    plan.num_items = P.num_seqs * plan.head_chunks * plan.splits;
  }
  // Fork threads only for enough work: each task covers at least kMinTaskElements (~2 us),
  // and a call forks only when the whole team (at::parallel_for wakes every thread) has that
  // much each on average. Measured on 2 cores at block size 16, hot or with the threads asleep
  // (3 ms between calls), even one block per kv head ran faster on both threads: B=1, L=16
  // 21 -> 14 us (asleep 37 -> 28), L=128 60 -> 35 us.
  const double task = kMinTaskElements, items = plan.num_items;
  plan.grain = total_cost < task * static_cast<double>(std::max<int64_t>(P.num_threads, 1))
                   ? std::max<int64_t>(plan.num_items, 1)
                   : std::max<int64_t>(
                         1, static_cast<int64_t>(std::ceil(task * items / total_cost)));
  // As many tasks as at::parallel_for would give threads for that grain, each a run of items
  // of about equal cost.
  const int64_t n = plan.num_items;
  plan.num_tasks = std::clamp<int64_t>((n + plan.grain - 1) / plan.grain, 1,
                                       std::max<int64_t>(P.num_threads, 1));
  std::vector<int64_t>& ts = call_scratch().task_start;
  grow(ts, plan.num_tasks + 1);
  plan.task_start = ts.data();
  ts[0] = 0;
  ts[plan.num_tasks] = n;
  if (plan.num_tasks > 1) {
    std::vector<double>& cost = call_scratch().item_cost;
    grow(cost, n);
    double all = 0;
    for (int64_t i = 0; i < n; ++i) all += cost[i] = item_cost(P, plan, i);
    // Task t takes at least one item, leaves one to each later task, and ends where its
    // items' cost prefix comes nearest to t + 1 shares.
    double acc = 0;
    int64_t j = 0;
    for (int64_t t = 0; t + 1 < plan.num_tasks; ++t) {
      const double target = all * static_cast<double>(t + 1) / static_cast<double>(plan.num_tasks);
      const int64_t hi = n - (plan.num_tasks - 1 - t);
      acc += cost[j++];
      for (; j < hi && acc + cost[j] / 2 <= target; ++j) acc += cost[j];
      ts[t + 1] = j;
    }
  }
  return plan;
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
