// The decode write of reshape_and_cache as a plain loop, with and without prefetching the
// destination lines for writing: one token per scattered slot, key_cache [blocks, H, D / x,
// bs, x] and value_cache [blocks, H, D, bs] (x * element = 16 bytes), H = 8, D = 128, bs = 16.
// Nanoseconds per token on one thread (median of 200 passes), for 64 tokens (their lines fit
// in L3) and 256 (the benchmark's decode row). Figures: benchmarks/RESULTS.md.
//
//   g++ -O3 -mavx2 benchmarks/cache_write_lines.cpp -o /tmp/cache_write_lines
//   /tmp/cache_write_lines
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

constexpr int H = 8, D = 128, BS = 16;

// PDV / PDK: prefetch for writing the value row PDV rows / the key chunk PDK chunks ahead (0:
// none). Past the head, the rows are the next head's, which the next item writes.
template <typename E, int PDV, int PDK>
void write(const E* k, const E* v, E* kc, E* vc, const int64_t* slots, int ntok) {
  constexpr int x = 16 / sizeof(E);
  for (int i = 0; i < ntok; ++i) {
    const int64_t blk = slots[i] / BS, off = slots[i] % BS;
    for (int h = 0; h < H; ++h) {
      E* kd = kc + (blk * H + h) * D * BS + off * x;
      E* vd = vc + (blk * H + h) * D * BS + off;
      const E* ks = k + (int64_t(i) * H + h) * D;
      const E* vs = v + (int64_t(i) * H + h) * D;
      for (int c = 0; c < D / x; ++c) {
        if (PDK) __builtin_prefetch(kd + (c + PDK) * BS * x, 1, 3);
        std::memcpy(kd + c * BS * x, ks + c * x, 16);
      }
      for (int d = 0; d < D; ++d) {
        if (PDV) __builtin_prefetch(vd + (d + PDV) * BS, 1, 3);
        vd[d * BS] = vs[d];
      }
    }
  }
}

template <typename E, int PDV, int PDK>
double ns_per_token(int ntok) {
  const int nb = ntok + 64;
  std::vector<E> kc(size_t(nb) * H * D * BS), vc(kc.size()), k(size_t(ntok) * H * D, 1),
      v(k.size(), 1);
  std::mt19937 g(0);
  std::vector<int64_t> perm(nb);
  for (int i = 0; i < nb; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), g);
  std::vector<int64_t> slots(ntok);
  for (int i = 0; i < ntok; ++i) slots[i] = perm[i] * BS + g() % BS;
  for (int w = 0; w < 5; ++w)
    write<E, PDV, PDK>(k.data(), v.data(), kc.data(), vc.data(), slots.data(), ntok);
  std::vector<double> ts;
  for (int r = 0; r < 200; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    write<E, PDV, PDK>(k.data(), v.data(), kc.data(), vc.data(), slots.data(), ntok);
    ts.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2] / ntok * 1e9;
}

template <typename E>
void row(const char* name, int n) {
  std::printf("%-5s %4d tokens: none %5.0f | V +16 %5.0f | V +32 %5.0f | V +64 %5.0f | "
              "V +32, K +8 %5.0f | K +8 %5.0f ns/token\n", name, n,
              ns_per_token<E, 0, 0>(n), ns_per_token<E, 16, 0>(n), ns_per_token<E, 32, 0>(n),
              ns_per_token<E, 64, 0>(n), ns_per_token<E, 32, 8>(n), ns_per_token<E, 0, 8>(n));
}

int main() {
  for (int n : {64, 256}) {
    row<uint32_t>("fp32", n);
    row<uint16_t>("16bit", n);
  }
}
