// Checks the CPU attention kernel's work plan (csrc/cpu/attention/work_plan.h) without torch: for a call's
// shape, make_plan's items, taken together through item_info, must cover every (sequence, kv
// head, query row, visible block) exactly once and nothing out of bounds, and the plan's sizes
// must follow the heuristic the header documents. A wrong plan computes wrong attention only
// for the shapes it mis-cuts, which the numeric tests may never draw.
//
// Build: g++ -std=c++20 -DCPU_CAPABILITY=DEFAULT -Icsrc tests/work_plan_check.cpp
// Run:   work_plan_check key=value...   one case (keys below), or
//        work_plan_check sweep          a built-in grid of cases.
// Keys: lens=a,b,c (seq_lens), q=a,b,c (query tokens per sequence: multi-token; absent:
// decode), heads=H/KV, bs, threads, window (sliding window, 0: off), stride (seq_lens
// stride), d (head size, 128), dtype (cache: fp32, fp16, bf16 (the default), fp8_e4m3,
// fp8_e5m2; the plan must not depend on it), and what the plan must come to: splits, hpi
// (heads per item), items.
// Prints "ok ..." and exits 0, or prints the first failure and exits 1 (2: bad arguments).

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cpu/attention/work_plan.h"

using namespace paged::cpu;

namespace {

// Cache dtypes by the names the dtype= key takes (and describe prints).
constexpr std::pair<const char*, DType> kDTypeNames[] = {{"fp32", DType::F32},
                                                        {"fp16", DType::F16},
                                                        {"bf16", DType::BF16},
                                                        {"fp8_e4m3", DType::F8E4M3},
                                                        {"fp8_e5m2", DType::F8E5M2}};

const char* dtype_name(DType t) {
  for (const auto& [name, u] : kDTypeNames)
    if (u == t) return name;
  return "?";
}

struct Case {
  std::vector<int32_t> lens, q_lens;
  bool multi = false;
  int64_t heads = 32, kv_heads = 8, bs = 16, threads = 2, window = 0, stride = 1, d = 128;
  DType dtype = DType::BF16;
  int64_t want_splits = -1, want_hpi = -1, want_items = -1;  // -1: not pinned

  std::string describe() const {
    std::ostringstream o;
    o << (multi ? "multi" : "decode") << " lens=";
    for (size_t i = 0; i < lens.size(); ++i) o << (i ? "," : "") << lens[i];
    if (multi) {
      o << " q=";
      for (size_t i = 0; i < q_lens.size(); ++i) o << (i ? "," : "") << q_lens[i];
    }
    o << " heads=" << heads << "/" << kv_heads << " bs=" << bs << " threads=" << threads
      << " window=" << window << " stride=" << stride << " d=" << d
      << " dtype=" << dtype_name(dtype);
    return o.str();
  }
};

// The failing check and the case, then exit: the first failure is the one to read.
[[noreturn]] void fail(const Case& c, const std::string& what) {
  std::printf("FAIL %s\n  %s\n", c.describe().c_str(), what.c_str());
  std::exit(1);
}

#define CHECK(cond, msg)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      std::ostringstream m_;                               \
      m_ << "check failed: " #cond "\n  " << msg;          \
      fail(c, m_.str());                                   \
    }                                                      \
  } while (0)

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string item_str(int64_t item, const ItemInfo& it) {
  std::ostringstream o;
  o << "item " << item << " {s=" << it.s << " kvh=" << it.kvh << " nh=" << it.nh
    << " split=" << it.split << " j=[" << it.j0 << "," << it.j1 << ") q_len=" << it.q_len
    << " row0=" << it.row0 << " L=" << it.L << " lo_min=" << it.lo_min << " P_max=" << it.P_max
    << " blocks=[" << it.b_first << "," << it.b_last << "]}";
  return o.str();
}

// One (sequence, kv head, query row)'s share of an item: its split and block range.
struct Piece {
  int64_t item, split, b_first, b_last;
};

void check_case(const Case& c) {
  const int64_t B = static_cast<int64_t>(c.lens.size());
  const int64_t G = c.heads / c.kv_heads;
  const int64_t bs = c.bs;
  // Inputs as the op passes them: q_len <= seq_len (the op checks it), seq_lens with a stride.
  std::vector<int32_t> seq_lens(std::max<int64_t>(B * c.stride, 1), -7);
  for (int64_t s = 0; s < B; ++s) seq_lens[s * c.stride] = c.lens[s];
  std::vector<int32_t> qsl(B + 1, 0);
  if (c.multi) {
    if (static_cast<int64_t>(c.q_lens.size()) != B) fail(c, "bad case: q and lens differ");
    for (int64_t s = 0; s < B; ++s) {
      if (c.q_lens[s] < 0 || c.q_lens[s] > c.lens[s]) fail(c, "bad case: need 0 <= q <= len");
      qsl[s + 1] = qsl[s] + c.q_lens[s];
    }
  }
  auto q_len_of = [&](int64_t s) -> int64_t { return c.multi ? c.q_lens[s] : 1; };
  const int64_t num_tokens = c.multi ? qsl[B] : B;

  AttentionParams P{};
  P.seq_lens = seq_lens.data();
  P.sl_stride = c.stride;
  P.query_start_loc = c.multi ? qsl.data() : nullptr;
  P.num_seqs = B;
  P.num_tokens = num_tokens;
  P.num_heads = c.heads;
  P.num_kv_heads = c.kv_heads;
  P.head_size = c.d;
  P.cache_dtype = c.dtype;
  P.block_size = bs;
  P.x = 8;
  P.scale = 1.f;
  P.sliding_window = c.window;
  P.k_scale = P.v_scale = 1.f;
  P.num_threads = c.threads;

  const Plan plan = make_plan(P);
  std::ostringstream ps;
  ps << "plan {tokens_per_chunk=" << plan.tokens_per_chunk
     << " heads_per_item=" << plan.heads_per_item << " head_chunks=" << plan.head_chunks
     << " splits=" << plan.splits << " num_items=" << plan.num_items << " grain=" << plan.grain
     << "}";
  const std::string plan_s = ps.str();

  // The plan's sizes, in key elements of one kv head, tokens x head size (x query rows for
  // the cost), whatever the block size and cache dtype.
  const int64_t key_elems = bs * c.d;
  const int64_t split_blocks = cdiv(64 << 10, key_elems);  // 512 tokens at head size 128
  const int64_t task_cost = 32 << 10;                      // 16 blocks of 16 at 128
  const int64_t visit_elems = std::max<int64_t>(bs, 16) * c.d;  // a block counts >= 16 tokens
  int64_t max_blocks = 0, total_cost = 0;
  for (int64_t s = 0; s < B; ++s) {
    const int64_t nblk = cdiv(c.lens[s], bs);
    max_blocks = std::max(max_blocks, nblk);
    total_cost += nblk * (c.multi ? c.q_lens[s] * G : G) * c.kv_heads * visit_elems;
  }
  CHECK(plan.splits >= 1 && plan.heads_per_item >= 1 && plan.tokens_per_chunk >= 1, plan_s);
  CHECK(plan.heads_per_item <= c.kv_heads, plan_s);
  CHECK(plan.head_chunks == cdiv(c.kv_heads, plan.heads_per_item), plan_s);
  if (c.multi) {
    // About 64 query rows (tokens x G) per item, one kv head each, no splits.
    CHECK(plan.tokens_per_chunk == std::max<int64_t>(1, 64 / G), plan_s);
    CHECK(plan.heads_per_item == 1 && plan.splits == 1, plan_s);
    int64_t chunks = 0;
    for (int64_t s = 0; s < B; ++s) {
      CHECK(plan.chunk_start[s] == chunks, plan_s << ", chunk_start[" << s << "] = "
                                                  << plan.chunk_start[s] << ", want " << chunks);
      chunks += cdiv(c.q_lens[s], plan.tokens_per_chunk);
    }
    CHECK(plan.chunk_start[B] == chunks, plan_s);
    CHECK(plan.num_items == chunks * c.kv_heads, plan_s << ", chunks " << chunks);
  } else {
    CHECK(plan.tokens_per_chunk == 1, plan_s);
    CHECK(plan.num_items == B * plan.head_chunks * plan.splits, plan_s);
    const int64_t want_items = 2 * c.threads;
    if (c.threads <= 1 || B >= want_items) {
      // Enough items already (or one thread): one item per sequence, all its kv heads.
      CHECK(plan.splits == 1 && plan.heads_per_item == c.kv_heads, plan_s);
    } else {
      // Split the block range first: as many splits as make 2 items per thread, but at least
      // 64 Ki key elements (512 tokens at head size 128) per split on average over the
      // longest sequence.
      const int64_t want = cdiv(want_items, std::max<int64_t>(B, 1));
      CHECK(plan.splits <= want, plan_s << ", want " << want << " splits");
      if (plan.splits > 1)
        CHECK(plan.splits * split_blocks <= max_blocks,
              plan_s << ", " << max_blocks << " blocks at most, " << split_blocks
                     << " per split at least");
      CHECK(plan.splits == want || (plan.splits + 1) * split_blocks > max_blocks,
            plan_s << ": more splits were possible (want " << want << ", " << max_blocks
                   << " blocks at most)");
      // Then halve the heads per item until 2 items per thread (or one head per item), and no
      // further.
      CHECK(plan.num_items >= want_items || plan.heads_per_item == 1, plan_s);
      int64_t h = c.kv_heads, prev = 0;  // the halving steps: h -> ceil(h / 2)
      while (h > plan.heads_per_item) prev = h, h = cdiv(h, 2);
      CHECK(h == plan.heads_per_item, plan_s << ": not a halving of " << c.kv_heads << " heads");
      if (prev > 0)
        CHECK(B * cdiv(c.kv_heads, prev) * plan.splits < want_items,
              plan_s << ": halved past " << prev << " heads per item, which made " << want_items
                     << " items already");
    }
  }
  // Grain: each parallel task gets at least 32 Ki key elements x query rows on average (a
  // block counting at least 16 tokens), the smallest such count of items; a call with less
  // than that per thread runs as one task.
  CHECK(plan.grain >= 1, plan_s);
  if (total_cost < task_cost * std::max<int64_t>(c.threads, 1)) {
    CHECK(plan.grain >= plan.num_items, plan_s << ", total cost " << total_cost);
  } else {
    CHECK(plan.grain <= std::max<int64_t>(plan.num_items, 1), plan_s);
    CHECK(plan.grain * total_cost >= task_cost * plan.num_items,
          plan_s << ", total cost " << total_cost);
    CHECK((plan.grain - 1) * total_cost < task_cost * plan.num_items,
          plan_s << ", total cost " << total_cost << ": grain larger than needed");
  }
  // Tasks: the items cut into contiguous runs, as many as at::parallel_for would give threads
  // for the grain, none empty, each within one item's cost of an equal share (an item's cost:
  // the blocks it visits, each counting at least 16 tokens, x its query rows x its kv heads).
  const int64_t want_tasks =
      std::clamp<int64_t>(cdiv(plan.num_items, plan.grain), 1, std::max<int64_t>(c.threads, 1));
  CHECK(plan.num_tasks == want_tasks, plan_s << ", " << want_tasks << " tasks expected");
  CHECK(plan.task_start[0] == 0 && plan.task_start[plan.num_tasks] == plan.num_items, plan_s);
  {
    std::vector<double> cost(plan.num_items);
    double all = 0, biggest = 0;
    for (int64_t item = 0; item < plan.num_items; ++item) {
      const ItemInfo it = item_info(P, plan, item);
      cost[item] = static_cast<double>(std::max<int64_t>(it.b_last - it.b_first + 1, 1) *
                                       std::max<int64_t>(bs, 16) * (it.j1 - it.j0) * G * it.nh);
      all += cost[item];
      biggest = std::max(biggest, cost[item]);
    }
    for (int64_t t = 0; t < plan.num_tasks; ++t) {
      const int64_t a = plan.task_start[t], b = plan.task_start[t + 1];
      CHECK(a < b || plan.num_items == 0, plan_s << ", task " << t << " empty");
      double mine = 0;
      for (int64_t item = a; item < b; ++item) mine += cost[item];
      if (plan.num_tasks > 1)
        CHECK(mine <= all / plan.num_tasks + biggest * (1 + 1e-9),
              plan_s << ", task " << t << " costs " << mine << " of " << all);
    }
  }
  if (c.want_splits >= 0) CHECK(plan.splits == c.want_splits, plan_s);
  if (c.want_hpi >= 0) CHECK(plan.heads_per_item == c.want_hpi, plan_s);
  if (c.want_items >= 0) CHECK(plan.num_items == c.want_items, plan_s);

  // Visible blocks of query row j of sequence s (position L - q_len + j): [lo / bs, Ppos / bs].
  auto row_pos = [&](int64_t s, int64_t j) { return c.lens[s] - q_len_of(s) + j; };

  // Every item: in bounds, and its visible range the union of its rows' (before splitting).
  std::vector<int64_t> row_base(B + 1, 0);  // index of (s, j) in the per-row tables
  for (int64_t s = 0; s < B; ++s) row_base[s + 1] = row_base[s] + q_len_of(s);
  std::vector<std::vector<Piece>> pieces(row_base[B] * c.kv_heads);
  for (int64_t item = 0; item < plan.num_items; ++item) {
    const ItemInfo it = item_info(P, plan, item);
    auto is = [&] { return plan_s + ", " + item_str(item, it); };  // on failure only
    CHECK(it.s >= 0 && it.s < B, is());
    const int64_t L = c.lens[it.s], q_len = q_len_of(it.s);
    CHECK(it.L == L && it.q_len == q_len, is());
    CHECK(it.kvh >= 0 && it.nh >= 1 && it.kvh + it.nh <= c.kv_heads, is());
    CHECK(it.nh <= plan.heads_per_item, is());
    CHECK(it.split >= 0 && it.split < plan.splits, is());
    CHECK(0 <= it.j0 && it.j0 < it.j1 && it.j1 <= q_len, is() << ": no query rows or out of range");
    CHECK(it.j1 - it.j0 <= plan.tokens_per_chunk, is());
    CHECK(it.row0 == (c.multi ? qsl[it.s] : it.s), is());
    CHECK(it.row0 + it.j1 <= num_tokens || !c.multi, is());
    if (L == 0) {  // decode only (q_len <= L): a row that sees nothing, so no blocks
      CHECK(!c.multi && it.b_first > it.b_last, is());
    } else {
      // Rows j0..j1-1 see positions [first_visible(Ppos), Ppos], both growing with j.
      const int64_t p_first = row_pos(it.s, it.j0), p_last = row_pos(it.s, it.j1 - 1);
      CHECK(p_first >= 0, is());
      const int64_t lo = c.window > 0 ? std::max<int64_t>(0, p_first - c.window + 1) : 0;
      CHECK(it.lo_min == lo && it.P_max == p_last,
            is() << ", want lo_min " << lo << " P_max " << p_last);
      if (it.b_first <= it.b_last) {
        CHECK(it.b_first >= 0 && it.b_last < cdiv(L, bs), is() << ": blocks out of range");
        // Every block of the item is visible to one of its rows at least.
        CHECK(it.b_first >= lo / bs && it.b_last <= p_last / bs, is() << ": an invisible block");
      }
      if (plan.splits == 1)
        CHECK(it.b_first == lo / bs && it.b_last == p_last / bs,
              is() << ", want blocks [" << lo / bs << "," << p_last / bs << "]");
    }
    for (int64_t h = it.kvh; h < it.kvh + it.nh; ++h)
      for (int64_t j = it.j0; j < it.j1; ++j)
        pieces[(row_base[it.s] + j) * c.kv_heads + h].push_back(
            {item, it.split, it.b_first, it.b_last});
  }

  // Every (sequence, kv head, row): one piece per split, the pieces' blocks tiling the row's
  // visible blocks with no gap or overlap (empty splits allowed; a split merges by index).
  for (int64_t s = 0; s < B; ++s) {
    for (int64_t j = 0; j < q_len_of(s); ++j) {
      const int64_t L = c.lens[s];
      const int64_t p = row_pos(s, j);
      for (int64_t h = 0; h < c.kv_heads; ++h) {
        const std::vector<Piece>& ps_ = pieces[(row_base[s] + j) * c.kv_heads + h];
        auto where = [&] {
          std::ostringstream o;
          o << plan_s << ", sequence " << s << " kv head " << h << " row " << j << " (position "
            << p << ", L " << L << "): ";
          return o.str();
        };
        CHECK(static_cast<int64_t>(ps_.size()) == plan.splits,
              where() << ps_.size() << " items cover it, want " << plan.splits);
        std::vector<bool> seen(plan.splits, false);
        for (const Piece& pc : ps_) {
          CHECK(!seen[pc.split], where() << "split " << pc.split << " twice");
          seen[pc.split] = true;
        }
        std::vector<Piece> nonempty;
        for (const Piece& pc : ps_)
          if (pc.b_first <= pc.b_last) nonempty.push_back(pc);
        std::sort(nonempty.begin(), nonempty.end(),
                  [](const Piece& a, const Piece& b) { return a.b_first < b.b_first; });
        if (L == 0) {
          CHECK(nonempty.empty(), where() << "blocks for an empty sequence");
          continue;
        }
        const int64_t lo = c.window > 0 ? std::max<int64_t>(0, p - c.window + 1) : 0;
        CHECK(!nonempty.empty(), where() << "no block covers it");
        // With splits (decode: one row) the pieces tile exactly the row's blocks; without, the
        // one piece is its item's range, which holds the row's blocks.
        if (plan.splits > 1) {
          CHECK(nonempty.front().b_first == lo / bs && nonempty.back().b_last == p / bs,
                where() << "blocks [" << nonempty.front().b_first << ","
                            << nonempty.back().b_last << "], want [" << lo / bs << "," << p / bs
                            << "]");
        } else {
          CHECK(nonempty.front().b_first <= lo / bs && nonempty.back().b_last >= p / bs,
                where() << "blocks [" << nonempty.front().b_first << ","
                            << nonempty.back().b_last << "] miss some of [" << lo / bs << ","
                            << p / bs << "]");
        }
        for (size_t k = 1; k < nonempty.size(); ++k)
          CHECK(nonempty[k].b_first == nonempty[k - 1].b_last + 1,
                where() << "splits " << nonempty[k - 1].split << " (item " << nonempty[k - 1].item
                         << ") and " << nonempty[k].split << " (item " << nonempty[k].item
                         << ") cover [" << nonempty[k - 1].b_first << ","
                         << nonempty[k - 1].b_last << "] and [" << nonempty[k].b_first << ","
                         << nonempty[k].b_last << "]: a gap or an overlap");
      }
    }
  }
}

std::vector<int32_t> parse_list(const Case& c, const std::string& v) {
  std::vector<int32_t> out;
  std::stringstream ss(v);
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    if (tok.empty()) continue;
    try {
      out.push_back(std::stoi(tok));
    } catch (...) {
      std::printf("bad number '%s' in %s\n", tok.c_str(), c.describe().c_str());
      std::exit(2);
    }
  }
  return out;
}

Case parse_case(int argc, char** argv) {
  Case c;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    if (eq == std::string::npos) {
      std::printf("bad argument '%s' (want key=value)\n", a.c_str());
      std::exit(2);
    }
    const std::string k = a.substr(0, eq), v = a.substr(eq + 1);
    if (k == "lens") {
      c.lens = parse_list(c, v);
    } else if (k == "q") {
      c.q_lens = parse_list(c, v);
      c.multi = true;
    } else if (k == "heads") {
      const size_t sl = v.find('/');
      if (sl == std::string::npos) {
        std::printf("heads=H/KV, got '%s'\n", v.c_str());
        std::exit(2);
      }
      c.heads = std::stoll(v.substr(0, sl));
      c.kv_heads = std::stoll(v.substr(sl + 1));
    } else if (k == "dtype") {
      bool found = false;
      for (const auto& [name, t] : kDTypeNames)
        if (v == name) c.dtype = t, found = true;
      if (!found) {
        std::printf("dtype=fp32|fp16|bf16|fp8_e4m3|fp8_e5m2, got '%s'\n", v.c_str());
        std::exit(2);
      }
    } else if (k == "bs" || k == "threads" || k == "window" || k == "stride" || k == "splits" ||
               k == "hpi" || k == "items" || k == "d") {
      const int64_t n = std::stoll(v);
      (k == "bs"        ? c.bs
       : k == "d"       ? c.d
       : k == "threads" ? c.threads
       : k == "window"  ? c.window
       : k == "stride"  ? c.stride
       : k == "splits"  ? c.want_splits
       : k == "hpi"     ? c.want_hpi
                        : c.want_items) = n;
    } else {
      std::printf("unknown key '%s'\n", k.c_str());
      std::exit(2);
    }
  }
  if (c.kv_heads < 1 || c.heads % c.kv_heads != 0 || c.bs < 1 || c.stride < 1 || c.d < 1) {
    std::printf("bad case: %s\n", c.describe().c_str());
    std::exit(2);
  }
  return c;
}

// A grid over block sizes, cache dtypes, head sizes, head counts, threads and windows, on
// fixed and pseudo-random sequence sets, decode and multi-token.
int sweep() {
  uint64_t rng = 12345;
  auto next = [&](int64_t n) {  // uniform-ish in [0, n)
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<int64_t>((rng >> 33) % static_cast<uint64_t>(n));
  };
  const std::vector<std::vector<int32_t>> fixed = {
      {}, {0}, {1}, {7}, {16}, {17}, {0, 0, 3}, {1, 2, 3, 4, 5}, {200, 0, 64, 65}, {1000},
      {4096}, {16384}, {129, 128, 127, 1}};
  // GQA, MQA, MHA, G = 64 and 128 (one token per chunk), kv heads that halve unevenly.
  const std::pair<int64_t, int64_t> heads[] = {{32, 8}, {8, 1},  {4, 4},  {64, 1},
                                               {128, 2}, {24, 3}, {40, 5}, {36, 12}};
  int64_t n = 0;
  const DType dtypes[] = {DType::BF16, DType::F32, DType::F8E4M3, DType::F16, DType::F8E5M2};
  for (int64_t bs : {1, 7, 8, 16, 128, 256})
    for (auto [h, kv] : heads)
      for (int64_t threads : {1, 2, 3, 16})
        for (int64_t window : {0, 1, 5, 100}) {
          std::vector<std::vector<int32_t>> sets = fixed;
          for (int r = 0; r < 3; ++r) {  // random batches, some long sequences
            std::vector<int32_t> lens(1 + next(6));
            for (auto& l : lens) l = static_cast<int32_t>(next(4) == 0 ? next(5000) : next(300));
            sets.push_back(lens);
          }
          for (const auto& lens : sets)
            for (int mode = 0; mode < 3; ++mode) {
              Case c;
              c.lens = lens;
              c.heads = h;
              c.kv_heads = kv;
              c.bs = bs;
              c.threads = threads;
              c.window = window;
              c.stride = 1 + (n % 2);
              c.dtype = dtypes[n % 5];
              c.d = n % 3 == 0 ? 64 : 128;
              // mode 0: decode; 1: multi with q = whole sequence (prefill) or random q_len;
              // 2: multi with q_len 0 or 1 mixed in.
              c.multi = mode > 0;
              for (int32_t l : lens) {
                int32_t q = 0;
                if (mode == 1) q = next(2) ? l : static_cast<int32_t>(next(l + 1));
                if (mode == 2) q = static_cast<int32_t>(std::min<int64_t>(l, next(3)));
                c.q_lens.push_back(std::min<int32_t>(q, 400));  // bound the row tables
              }
              check_case(c);
              ++n;
            }
        }
  std::printf("ok sweep: %lld cases\n", static_cast<long long>(n));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "sweep") return sweep();
  const Case c = parse_case(argc, argv);
  check_case(c);
  std::printf("ok %s\n", c.describe().c_str());
  return 0;
}
