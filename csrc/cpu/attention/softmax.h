// The online softmax of the attention kernel: one row's running max and normalizer, advanced
// over a group's logits (step) and combined across the splits of a sequence (merge).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/attention/element_loads.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// The weights that a merge puts on the two partial outputs (sums of p * v): the merged output
// is o_self * self + o_other * other.
struct MergeWeights {
  float self, other;
};

// One row's online-softmax state over the logits z it has seen: max = max z, sum =
// sum e^(z - max). The default state is the empty one (nothing seen: max = -inf, sum = 0);
// sum > 0 once the row has seen a visible logit (its max term is e^0).
struct SoftmaxState {
  float max = -std::numeric_limits<float>::infinity();
  float sum = 0.f;

  bool empty() const { return sum == 0.f; }  // a NaN sum is not: it reaches the output

  // The factor that turns the row's sum of p * v into its output, times v_scale: 0 for a row
  // that sees nothing (seq_len 0), whose output is 0.
  float output_scale(float v_scale) const { return sum > 0.f ? v_scale / sum : 0.f; }

  // The natural-log log-sum-exp of the logits seen: max + log(sum) (the logits are the final
  // ones, in natural units: step takes e^(z - max)). -inf for a row that saw nothing; NaN once
  // a NaN logit was seen; +inf when the largest logit is +inf (sum is then NaN: e^(inf - inf)),
  // as torch.logsumexp gives.
  float lse() const {
    if (empty()) return -std::numeric_limits<float>::infinity();
    if (std::isnan(max) || max == std::numeric_limits<float>::infinity()) return max;
    return max + std::log(sum);
  }

  // One step over a group's logits pr[0, n): pr becomes e^(z - max') (0 where z = -inf, and
  // all 0 when the row sees none of the group). Returns the factor e^(max - max') by which the
  // max's growth rescales sum (done here) and the row's sum of p * v (done here when acc is
  // given: acc[0, acc_len); pv_group does it otherwise); 1 when the max does not grow or
  // nothing was seen before.
  float step(float* pr, int64_t n, float* acc, int64_t acc_len) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    VecF vmax(neg_inf);
    for (int64_t j = 0; j < n; j += W) vmax = at::vec::maximum(vmax, VecF::loadu(pr + j));
    const float bmax = hmax(vmax);
    if (bmax == neg_inf) {  // the row sees none of the group
      std::fill(pr, pr + n, 0.f);
      return 1.f;
    }
    // A NaN logit (a NaN key, which reads as NaN) makes the max NaN and with it every
    // probability and output of the row, as softmax over it does: std::max alone would drop
    // it (a NaN compares false) and leave the row finite.
    const float m_new = std::isnan(bmax) ? bmax : std::max(max, bmax);
    float a = 1.f;
    if (m_new > max && max != neg_inf) {
      a = std::exp(max - m_new);
      sum *= a;
      if (acc != nullptr) {
        const VecF alpha(a);
        for (int64_t j = 0; j < acc_len; j += W) (VecF::loadu(acc + j) * alpha).store(acc + j);
      }
    }
    max = m_new;
    VecF vsum(0.f);
    const VecF vm(m_new);
    for (int64_t j = 0; j < n; j += W) {
      const VecF e = (VecF::loadu(pr + j) - vm).exp_u20();
      e.store(pr + j);
      vsum = vsum + e;
    }
    sum += hsum(vsum);
    return a;
  }

  // Exact merge of another partial state over disjoint logits (another split of the same row):
  // max' = max of both, sum' = sum e^(max - max') + other.sum e^(other.max - max'). Returns
  // those two weights, to apply to the two partial outputs (sums of p * v). An empty `other`
  // contributes nothing ({1, 0}); an empty state's weight multiplies an output of 0.
  MergeWeights merge(const SoftmaxState& other) {
    if (other.empty()) return {1.f, 0.f};
    const float m_new = std::max(max, other.max);
    const MergeWeights w{std::exp(max - m_new), std::exp(other.max - m_new)};
    if (w.self != 1.f) sum *= w.self;
    sum += other.sum * w.other;
    max = m_new;
    return w;
  }
};

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
