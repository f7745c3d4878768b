// The online-softmax step of the attention kernel: one row's running max and normalizer
// over a group's logits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/element_loads.h"

namespace paged::cpu {
inline namespace CPU_CAPABILITY {

// Online-softmax step of one row over a group's logits pr[0, n): pr becomes e^(z - m_new)
// (0 where z = -inf, and all 0 when the row sees none of the group). Returns the factor
// e^(m - m_new) by which the running max m's growth rescales the normalizer l (done here) and
// the row's sum of p * v (done here when acc is given: acc[0, acc_len); pv_group does it
// otherwise); 1 when m does not grow or nothing was seen before.
inline float softmax_step(float* pr, int64_t n, float& m, float& l, float* acc,
                          int64_t acc_len) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  VecF vmax(neg_inf);
  for (int64_t j = 0; j < n; j += W) vmax = at::vec::maximum(vmax, VecF::loadu(pr + j));
  const float bmax = hmax(vmax);
  if (bmax == neg_inf) {  // the row sees none of the group
    std::fill(pr, pr + n, 0.f);
    return 1.f;
  }
  const float m_new = std::max(m, bmax);
  float a = 1.f;
  if (m_new > m && m != neg_inf) {
    a = std::exp(m - m_new);
    l *= a;
    if (acc != nullptr) {
      const VecF alpha(a);
      for (int64_t j = 0; j < acc_len; j += W) (VecF::loadu(acc + j) * alpha).store(acc + j);
    }
  }
  m = m_new;
  VecF sum(0.f);
  const VecF vm(m_new);
  for (int64_t j = 0; j < n; j += W) {
    const VecF e = (VecF::loadu(pr + j) - vm).exp_u20();
    e.store(pr + j);
    sum = sum + e;
  }
  l += hsum(sum);
  return a;
}

}  // namespace CPU_CAPABILITY
}  // namespace paged::cpu
