// KL between the policy and a reference policy: the CPU kernels' interface, and
// the per-token estimator that the policy-loss kernels (policy.cpp) share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"
#include "rows.h"

namespace fastrl {

// Estimator codes, mirrored in fastrl/kl.py (ESTIMATOR_CODES) and kernels/kl.py.
enum KLEstimator : int {
  kKL = 0,        // "kl" / "k1"
  kAbs = 1,       // "abs"
  kMSE = 2,       // "mse" / "k2"
  kLowVarKL = 3,  // "low_var_kl" / "k3"
};

// veRL's clamps of the k3 estimator: its log-ratio and its value.
constexpr double kK3LogRatioClamp = 20.0;
constexpr double kK3ValueClamp = 10.0;

template <typename Acc>
struct KLTerm {
  Acc value, grad;  // the estimate and its derivative d value / d logp
};

// (e^c - 1, e^c - 1 - c), each to a few ulps for every c. e^c - 1 - c ~ c^2 / 2
// near 0, where e^c - c - 1 cancels (relative error ~ eps / c^2: 2e-5 in float32 at
// c = -0.086); so for |c| <= 1 it is c^2/2 q(c) with q the Taylor series of
// (e^c - 1 - c) / (c^2/2) = sum_j a_j c^j, a_j = 2 / (j + 2)! (a_0 = 1, a_1 = 1/3),
// to j = kTaylorTerms - 1: the first term left out is under 2 / (kTaylorTerms + 1)!
// relative, less than half an ulp (9 terms for float32, 17 for float64). q is summed
// as E(c^2) + c O(c^2), its even and odd halves in Horner form in c^2: two chains
// of half the length, which the token loops (latency-bound on one long chain per
// token) overlap. Each half adds terms of one sign; for c < 0, |c O| <= 0.35 <= E / 2
// at |c| <= 1, so the one subtraction loses at most a factor 2 (a few ulps of q).
// Then e^c - 1 = c + (e^c - 1 - c) adds two terms of one sign, or (c < 0)
// |e^c - 1 - c| <= |c| / 2 to c. For |c| > 1 the direct forms lose at most a factor
// 4.4 (at c = -1) to cancellation.
template <typename Acc>
struct ExpM1Parts {
  Acc expm1, k;  // e^c - 1, e^c - 1 - c
};

template <typename Acc>
constexpr int kTaylorTerms = sizeof(Acc) == sizeof(double) ? 17 : 9;

// a_j = 2 / (j + 2)! for j < 17, in double (each rounded once to Acc where used).
struct TaylorQCoefficients {
  double a[17] = {};
  constexpr TaylorQCoefficients() {
    double factorial = 1;
    for (int j = 0; j < 17; ++j) {
      factorial *= j + 2;
      a[j] = 2 / factorial;
    }
  }
};
constexpr TaylorQCoefficients kTaylorQ{};

template <typename Acc>
FASTRL_INLINE Acc taylor_q(Acc c) {
  constexpr int last = kTaylorTerms<Acc> - 1;
  constexpr int last_even = last / 2 * 2, last_odd = (last - 1) / 2 * 2 + 1;
  const Acc c2 = c * c;
  Acc even = Acc(kTaylorQ.a[last_even]), odd = Acc(kTaylorQ.a[last_odd]);
  for (int j = last_even - 2; j >= 0; j -= 2) even = even * c2 + Acc(kTaylorQ.a[j]);
  for (int j = last_odd - 2; j >= 1; j -= 2) odd = odd * c2 + Acc(kTaylorQ.a[j]);
  return even + c * odd;
}

template <typename Acc>
FASTRL_INLINE ExpM1Parts<Acc> expm1_parts(Acc c) {
  // Both forms, then a select: a branch would keep the token loops scalar.
  const Acc k = Acc(0.5) * c * c * taylor_q(c);
  const Acc em1 = exp_approx(c) - Acc(1);  // NaN lands here and stays NaN
  const bool small = std::abs(c) <= Acc(1);
  return {small ? c + k : em1, small ? k : em1 - c};
}

// The sampled-token estimate of KL(pi || pi_ref) at d = logp - ref_logp
// (J. Schulman, "Approximating KL divergence"), with the derivative torch
// autograd gives for fastrl.reference.kl_penalty:
//   kl / k1          v = d                        dv/dlogp = 1
//   abs              v = |d|                      sign(d), 0 at d = 0
//   mse / k2         v = d^2 / 2                  d
//   low_var_kl / k3  c = clamp(-d, -20, 20), k = e^c - c - 1, v = clamp(k, -10, 10)
//                    dv/dlogp = -(e^c - 1) where neither clamp is active, else 0
// (a clamp passes its gradient on the closed interval; k and e^c - 1 from
// expm1_parts, accurate near d = 0). straight_through keeps the value and takes
// k2's derivative d, whose expectation is the true KL gradient. std::clamp keeps
// NaN, as torch.clamp does. c reaches +20, within exp_approx's range. The
// estimator and straight_through are template arguments: the token loops that
// call this must vectorise, and GCC does not vectorise a select on a flag that
// is the same for every token (nor a switch).
template <int ESTIMATOR, bool STRAIGHT_THROUGH, typename Acc>
FASTRL_INLINE KLTerm<Acc> kl_estimate(Acc d) {
  KLTerm<Acc> k;
  if (ESTIMATOR == kKL) {
    k = {d, Acc(1)};
  } else if (ESTIMATOR == kAbs) {
    k = {std::abs(d), d > 0 ? Acc(1) : d < 0 ? Acc(-1) : Acc(0)};
  } else if (ESTIMATOR == kMSE) {
    k = {Acc(0.5) * d * d, d};
  } else {  // kLowVarKL
    const Acc c_lim = Acc(kK3LogRatioClamp), v_lim = Acc(kK3ValueClamp);
    const Acc c = std::clamp(-d, -c_lim, c_lim);
    const ExpM1Parts<Acc> p = expm1_parts(c);
    const bool passes = -d >= -c_lim && -d <= c_lim && p.k >= -v_lim && p.k <= v_lim;
    k = {std::clamp(p.k, -v_lim, v_lim), passes ? -p.expm1 : Acc(0)};
  }
  if (STRAIGHT_THROUGH) k.grad = d;
  return k;
}

#define FASTRL_COMMA ,

// Calls BODY<Acc, E, ...> ARGS with E the estimator code (-1, no KL term, for
// any other code) as a compile-time constant; EXTRA is the template arguments
// after it, each after FASTRL_COMMA (or nothing).
#define FASTRL_WITH_ESTIMATOR(ESTIMATOR, BODY, EXTRA, ARGS) \
  switch (ESTIMATOR) {                                      \
    case kKL: BODY<Acc, kKL EXTRA> ARGS; break;             \
    case kAbs: BODY<Acc, kAbs EXTRA> ARGS; break;           \
    case kMSE: BODY<Acc, kMSE EXTRA> ARGS; break;           \
    case kLowVarKL: BODY<Acc, kLowVarKL EXTRA> ARGS; break; \
    default: BODY<Acc, -1 EXTRA> ARGS;                      \
  }

// kl_penalty over n tokens: log_probs, ref_log_probs, grad and the outputs are
// contiguous arrays of the accumulation type `dtype` (float32 / float64).
//   forward:  out[i] = v(d_i)
//   backward: grad_logp[i] = grad[i] * dv/dlogp(d_i)   (the reference's is its negative)
void kl_penalty_forward(const void* log_probs, const void* ref_log_probs, int dtype, int64_t n,
                        int estimator, void* out);
void kl_penalty_backward(const void* log_probs, const void* ref_log_probs, const void* grad, int dtype,
                         int64_t n, int estimator, bool straight_through, void* grad_logp);

// What both full-KL passes read. logits and ref_logits: n_rows rows of `vocab`
// elements of the same dtype with unit stride, each with its own row stride.
// temps: per-row temperatures of the accumulation type, or null to use
// temp_scalar for every row (the same T for both distributions).
struct FullKLArgs {
  const void* logits;
  const void* ref_logits;
  int dtype;
  int64_t n_rows;
  int64_t vocab;
  RowLayout rows;      // rows.h
  RowLayout ref_rows;
  const void* temps;
  double temp_scalar;
};

// Writes KL(softmax(x / T) || softmax(y / T)) per row into out_kl and, when
// out_stats is non-null, the row's (m, log s, m', log s') ([n_rows, 4]) that
// the backward needs; both of the accumulation type.
void full_kl_forward(const FullKLArgs& args, void* out_kl, void* out_stats);

// Writes grad_kl[r] * dKL/dx (logits' dtype, rows laid out by grad_rows; may
// alias the logits) from the forward's stats and KL.
void full_kl_backward(const FullKLArgs& args, const void* stats, const void* kl, const void* grad_kl,
                      void* grad_out, RowLayout grad_rows);

}  // namespace fastrl
