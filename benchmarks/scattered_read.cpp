// Read bandwidth of scattered runs, by run length: what the layout of the paged cache lets the
// CPU attention kernel read at (docs/cpu_kernel.md; figures in benchmarks/RESULTS.md). One pass
// over 1 GiB cut into runs of RUN bytes visited in random order (each thread its own share),
// summed with AVX2, with and without a software prefetch of a later run (the next one, and the
// 16th after the current one: how far ahead the prefetches must go before a core's misses in
// flight, not the distance, bound small runs); then the same memory in address order, in runs
// of 4 and 64 KiB with the same prefetches (where the hardware prefetchers alone read fastest:
// software prefetches are not a way past one core's misses in flight).
//
//   g++ -O3 -mavx2 -fopenmp benchmarks/scattered_read.cpp -o /tmp/scattered_read
//   OMP_NUM_THREADS=2 /tmp/scattered_read          # 4 KiB pages
//   OMP_NUM_THREADS=2 /tmp/scattered_read huge     # transparent huge pages (Linux), as
//                                                  # paged_ops.allocate_kv_cache asks for
//
// One head of one block of the cache is head_size * block_size * element bytes (8 KiB for fp32,
// 4 KiB for 16-bit at head size 128, block size 16); all kv heads of a block are contiguous.
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

static float sum_runs(const char* const* runs, size_t n, size_t run_bytes, size_t ahead) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (size_t r = 0; r < n; ++r) {
    const char* p = runs[r];
    const char* next = runs[r + ahead < n ? r + ahead : r];
    for (size_t o = 0; o < run_bytes; o += 64) {
      if (ahead > 0) _mm_prefetch(next + o, _MM_HINT_T1);
      a0 = _mm256_add_ps(a0, _mm256_loadu_ps(reinterpret_cast<const float*>(p + o)));
      a1 = _mm256_add_ps(a1, _mm256_loadu_ps(reinterpret_cast<const float*>(p + o + 32)));
    }
  }
  const __m256 s = _mm256_add_ps(a0, a1);
  return s[0] + s[7];
}

int main(int argc, char** argv) {
  const size_t total = size_t(1) << 30;
  char* buf = static_cast<char*>(std::aligned_alloc(2 << 20, total));
  const bool huge = argc > 1 && std::strcmp(argv[1], "huge") == 0;
  if (huge && madvise(buf, total, MADV_HUGEPAGE) != 0) std::perror("madvise");
  std::memset(buf, 1, total);  // touch every page before timing
  const int threads = omp_get_max_threads();
  auto gbs = [&](size_t run_bytes, bool shuffled, size_t ahead) {
    const size_t n = total / run_bytes, per = n / threads;
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    if (shuffled) std::shuffle(order.begin(), order.end(), std::mt19937(1));
    std::vector<const char*> runs(n);
    for (size_t i = 0; i < n; ++i) runs[i] = buf + order[i] * run_bytes;
    double best = 1e30;
    for (int rep = 0; rep < 3; ++rep) {
      float sink = 0;
      const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : sink)
      sink += sum_runs(runs.data() + omp_get_thread_num() * per, per, run_bytes, ahead);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::min(best, s);
      if (sink == 1.5f) std::printf(" ");  // keep the sums
    }
    return double(per * threads * run_bytes) / best / 1e9;
  };
  std::printf("%d threads, %s pages, GB/s\n", threads, huge ? "huge" : "4 KiB");
  std::printf("%10s %12s %12s %12s\n", "run", "no prefetch", "next run", "16 runs on");
  // From 256 B: one kv head of one block at block sizes 1-4 (head size 128, 16-bit or fp32).
  for (size_t bytes : {256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072})
    std::printf("%10zu B %11.1f %12.1f %12.1f\n", bytes, gbs(bytes, true, 0), gbs(bytes, true, 1),
                gbs(bytes, true, 16));
  for (size_t bytes : {4096, 65536})
    std::printf("%10zu B in order %2s %8.1f %12.1f %12.1f\n", bytes, "", gbs(bytes, false, 0),
                gbs(bytes, false, 1), gbs(bytes, false, 16));
}
