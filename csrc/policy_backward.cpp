// The policy loss's backward, CPU kernels: dl/dlogp per token (policy.cpp
// gives the math at its top; policy_rows.h holds what the two files share).
#include <algorithm>
#include <cstdint>

#include "common.h"
#include "isa.h"
#include "kl.h"
#include "policy.h"
#include "policy_rows.h"

namespace fastrl {
namespace {

using namespace policy_rows;

template <typename Acc, int ESTIMATOR, bool SEQUENCE, bool STRAIGHT_THROUGH>
FASTRL_INLINE void policy_backward_row_body(const PolicyArgs& a, int64_t b, const double* stats, Acc g, Acc kl_coef,
                                            Acc* grad_logp) {
  const int64_t base = b * a.length;
  const PolicyRow<Acc> row = policy_row<Acc>(a, base);
  const Acc* logp = row.logp;
  const Ratio<Acc> row_ratio = sequence_ratio(static_cast<Acc>(stats[b * kNumStats + kMeanU]));
  ClipParams<Acc> clip(a);
  MaskWord<Acc> words[kBlock];
  if (SEQUENCE && row_ratio.gate == 0) clip.pg_mask_min = 256;  // the clamp of the row's log-ratio stops every gradient
  Acc row_r[kBlock], grad_buf[kBlock];  // row_r as in the forward
  if (SEQUENCE) std::fill(row_r, row_r + kBlock, row_ratio.r);
  for (int64_t start = 0; start < a.length; start += kBlock) {
    const int64_t n = std::min(kBlock, a.length - start);
    widen_mask<Acc>(row.mask + start, n, words);
    const PolicyBlock<Acc> in(row, start);
    // grad = 0 + the PPO term + the KL term, each term in a loop of its own
    // (kLoopSplit), in that order.
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const Ratio<Acc> token = token_ratio(logp[start + i] - in.old[i]);
      const Acc r = SEQUENCE ? row_r[i] : token.r;
      const bool gate = words[i] >= clip.pg_mask_min && (SEQUENCE || token.gate != 0);
      const PPOLoss<Acc> pl = ppo_loss(clip, in.adv[i], r);
      grad_buf[i] = Acc(0) + select_bits(gate, pl.dloss_dr * in.w[i] * r, Acc(0));
    }
    if (ESTIMATOR >= 0) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i)
        grad_buf[i] += kl_coef * kl_estimate<ESTIMATOR, STRAIGHT_THROUGH>(logp[start + i] - in.ref[i]).grad;
    }
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) grad_logp[base + start + i] = select_bits(words[i] != 0, g * grad_buf[i], Acc(0));
  }
}

// Each variant (estimator, sequence level, straight-through) gets trampolines
// of its own (isa.h), so tests/test_native_isa.py sees every variant's code:
// one that stays scalar cannot hide among the vectorised ones.
template <typename Acc, int ESTIMATOR, bool SEQUENCE, bool STRAIGHT_THROUGH>
void policy_backward_row_at(const PolicyArgs& a, int64_t b, const double* stats, Acc g, Acc kl_coef,
                            Acc* grad_logp) {
  isa_dispatch([&]() FASTRL_ISA_BODY {
    policy_backward_row_body<Acc, ESTIMATOR, SEQUENCE, STRAIGHT_THROUGH>(a, b, stats, g, kl_coef, grad_logp);
  });
}

template <typename Acc>
void policy_backward_row(const PolicyArgs& a, int64_t b, const double* stats, Acc g, bool straight_through,
                         Acc kl_coef, Acc value_coef, Acc* grad_logp, Acc* grad_values) {
  const int64_t base = b * a.length;
  if (grad_values) {
    const Acc gv = g * value_coef;
    for (int64_t t = 0; t < a.length; ++t) grad_values[base + t] = a.mask[base + t] ? gv : Acc(0);
  }
  if (!grad_logp) return;
  const bool sequence = a.with_pg && a.sequence;
#define FASTRL_BACKWARD(SEQ, ST)                                                                      \
  FASTRL_WITH_ESTIMATOR(a.estimator, policy_backward_row_at, FASTRL_COMMA SEQ FASTRL_COMMA ST, \
                        (a, b, stats, g, kl_coef, grad_logp))
  if (sequence && straight_through) {
    FASTRL_BACKWARD(true, true)
  } else if (sequence) {
    FASTRL_BACKWARD(true, false)
  } else if (straight_through) {
    FASTRL_BACKWARD(false, true)
  } else {
    FASTRL_BACKWARD(false, false)
  }
#undef FASTRL_BACKWARD
}

// The row's gradient g = dL/dloss w_b is formed in double and rounded once to Acc.
template <typename Acc>
void policy_backward_impl(const PolicyArgs& a, const double* stats, const double* row_weights,
                          double grad_loss, bool straight_through, Acc kl_coef, Acc value_coef,
                          Acc* grad_logp, Acc* grad_values) {
#pragma omp parallel for schedule(static) if (a.n_rows * a.length > 32768)
  for (int64_t b = 0; b < a.n_rows; ++b)
    policy_backward_row<Acc>(a, b, stats, static_cast<Acc>(grad_loss * row_weights[b]), straight_through,
                             kl_coef, value_coef, grad_logp, grad_values);
}

}  // namespace

void policy_backward(const PolicyArgs& a, const double* stats, const double* row_weights, const void* grad_loss,
                     bool straight_through, double kl_coef, double value_coef, void* grad_logp,
                     void* grad_values) {
  FASTRL_DISPATCH_ACC(a.dtype, "policy_backward",
                      (policy_backward_impl<Acc>(a, stats, row_weights, *static_cast<const Acc*>(grad_loss),
                                                 straight_through, Acc(kl_coef), Acc(value_coef),
                                                 static_cast<Acc*>(grad_logp),
                                                 static_cast<Acc*>(grad_values))))
}

}  // namespace fastrl
