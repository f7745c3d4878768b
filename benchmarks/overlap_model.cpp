// The decode kernel's memory scheme as a plain loop: how much of the read bandwidth it can
// reach when its arithmetic overlaps the reads (docs/cpu_kernel.md, "What bounds it"; figures
// in benchmarks/RESULTS.md). K and V live in blocks of 8 kv heads x PIECE bytes scattered over
// 1 GiB; a step reads one kv head's pieces of 8 blocks: q.k reads the K pieces (QK dependent
// FMAs per line) while it prefetches the next step's K lines, a softmax gap (SM FMAs) reads
// nothing, then p.v reads the V pieces (PV FMAs per line) while it prefetches the next step's
// V lines; the next step is the next kv head of the same blocks, after the last one the next
// blocks' first, as the kernel's group steps go. Printed: the model from memory, the same
// with every block read from the cores' caches (its arithmetic alone), and the memory read in
// address order, timed in turn, 3 rounds.
//
//   g++ -O3 -mavx2 -mfma -fopenmp benchmarks/overlap_model.cpp -o /tmp/overlap_model
//   OMP_NUM_THREADS=2 /tmp/overlap_model 8192 2 3 50   # PIECE QK PV SM: bf16 at block size 32
//   OMP_NUM_THREADS=2 /tmp/overlap_model 2048 2 3 50   # the same arithmetic at block size 8
//
// One head of one block is head_size * block_size * element bytes: 8 KiB for a 16-bit cache
// at head size 128 and block size 32, 2 KiB at 8.
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

static inline __m256 work(__m256 a, int n) {  // n dependent FMAs
  const __m256 m = _mm256_set1_ps(0.999f), x = _mm256_set1_ps(0.001f);
  for (int i = 0; i < n; ++i) a = _mm256_fmadd_ps(a, m, x);
  return a;
}

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s PIECE_BYTES QK_FMAS PV_FMAS SOFTMAX_FMAS\n", argv[0]);
    return 2;
  }
  const size_t piece = std::atoi(argv[1]), heads = 8, group = 8, lines = piece / 64;
  const int qk = std::atoi(argv[2]), pv = std::atoi(argv[3]), sm = std::atoi(argv[4]);
  const size_t total = size_t(1) << 30;
  char* buf = static_cast<char*>(std::aligned_alloc(2 << 20, total));
  madvise(buf, total, MADV_HUGEPAGE);  // as allocate_kv_cache asks
  std::memset(buf, 1, total);
  const size_t nblocks = total / 2 / (heads * piece);  // K blocks, then as many V blocks
  std::vector<size_t> scattered(nblocks), cached(nblocks);
  for (size_t i = 0; i < nblocks; ++i) scattered[i] = i, cached[i] = i % 2;
  std::shuffle(scattered.begin(), scattered.end(), std::mt19937(1));
  const int threads = omp_get_max_threads();
  const size_t per = nblocks / threads / group * group;  // blocks per thread

  auto timed = [&](auto body, double bytes) {
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      float sink = 0;
      const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : sink)
      sink += body(omp_get_thread_num());
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                                .count());
      if (sink == 1.5f) std::printf(" ");  // keep the sums
    }
    return bytes / best / 1e9;
  };
  auto model = [&](const std::vector<size_t>& order) {
    return [&, order_p = &order](int t) {
      const size_t first = t * per;
      auto block = [&](const char* base, size_t i) {
        return base + (*order_p)[first + std::min(i, per - 1)] * heads * piece;
      };
      const char* kbase = buf;
      const char* vbase = buf + total / 2;
      __m256 a = _mm256_setzero_ps();
      for (size_t b0 = 0; b0 < per; b0 += group)
        for (size_t h = 0; h < heads; ++h) {
          auto next = [&](const char* base, size_t k) {
            return h + 1 < heads ? block(base, b0 + k) + (h + 1) * piece
                                 : block(base, b0 + group + k);
          };
          // One phase: the group's pieces of kv head h, each line prefetched for the next step
          // as the same line of this one is read.
          auto phase = [&](const char* base, int fmas) {
            for (size_t k = 0; k < group; ++k) {
              const char* p = block(base, b0 + k) + h * piece;
              const char* pf = next(base, k);
              for (size_t l = 0; l < lines; ++l) {
                _mm_prefetch(pf + l * 64, _MM_HINT_T2);
                a = work(_mm256_add_ps(a, _mm256_loadu_ps((const float*)(p + l * 64))), fmas);
              }
            }
          };
          phase(kbase, qk);  // q.k
          a = work(a, sm);   // softmax
          phase(vbase, pv);  // p.v
        }
      return a[0];
    };
  };
  auto in_order = [&](int t) {
    const size_t share = total / threads;
    const char* p = buf + t * share;
    __m256 a = _mm256_setzero_ps();
    for (size_t o = 0; o < share; o += 64)
      a = _mm256_add_ps(a, _mm256_loadu_ps((const float*)(p + o)));
    return a[0];
  };
  const double model_bytes = double(per) * threads * heads * piece * 2;
  std::printf("%d threads, %zu B per kv head and block, %d/%d/%d FMAs per line of q.k/p.v and "
              "per softmax step; GB/s (arithmetic alone: GB/s-equivalent)\n",
              threads, piece, qk, pv, sm);
  for (int round = 0; round < 3; ++round) {
    const double mem = timed(model(scattered), model_bytes);
    const double arith = timed(model(cached), model_bytes);
    const double order = timed(in_order, double(total));
    std::printf("  model %5.1f  arithmetic alone %5.1f  address order %5.1f  -> %3.0f%% of "
                "min(arithmetic, address order)\n",
                mem, arith, order, 100 * mem / std::min(arith, order));
  }
}
