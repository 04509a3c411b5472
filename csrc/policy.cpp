// PPO / GRPO / GSPO policy loss and rollout-correction weights, CPU kernels.
//
// Forward, per valid token of row b (fastrl/reference.py, policy_loss, is the spec):
//   u = logp - old
//   token level:     log r = clamp(u, -20, 20),  ppo_kl term = -log r
//   sequence level:  log r = min(mean_b(u), 10), ppo_kl term = -u   (GSPO; mean_b a first pass)
//   l1 = -A r,  l2 = -A clamp(r, 1 - clip_low, 1 + clip_high),  l = max(l1, l2)
//   dual clip, A < 0:  l = min(l, l3),  l3 = -A clip_c
//   l *= w (rollout weights)
// and the row's sums go to its stats in float64; the caller turns them into the
// aggregated loss and the metrics.
//
// Backward: dl/dlogp = w (dl/dr) r gate, where gate is whether the clamp of
// log r passes the gradient ([-20 <= u <= 20], or [mean_b(u) <= 10]; at
// sequence level the token's own log-prob carries the sequence ratio's
// gradient), and dl/dr follows torch's rule for max / min, a tie splitting the
// gradient in halves:
//   dl1 = -A,  dl2 = -A [1 - clip_low <= r <= 1 + clip_high]
//   dmax = dl1 if l1 > l2, dl2 if l2 > l1, (dl1 + dl2) / 2 if l1 == l2
//   dual clip, A < 0:  dl = dmax if max < l3, dmax / 2 if max == l3, else 0
//
// Rollout correction, per valid token: u = old - rollout, log w = u (token) or
// the row's sum S of u (sequence), raw = exp(clamp(log w, -20, 20)); truncate
// clamps raw to [clip_min, clip_max], mask mode zeroes it outside. The extremes
// and the high / low counts are of the applied weights and the raw ones per token,
// or of the raw sequence weight e^S once per sequence (veRL's metrics).
//
// Finalize: the rows' stats become the aggregated loss, the row weights w_b
// with loss = sum_b w_b (row b's sums) that the backward scales each row by,
// and the metrics (policy.h gives the formulas), in double on one thread, rows
// in order: B is the number of sequences, small, and one pass in a fixed order
// is deterministic where a parallel reduction would not be. On GPU this is one
// launch in place of a dozen small torch ops.
//
// A token outside the mask is skipped before any arithmetic, so NaN there
// reaches nothing. Each row is handled by one thread in a fixed order, so
// results are bitwise reproducible and independent of the other rows.
#include "policy.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <string>
#include <utility>

#include "common.h"
#include "kl.h"

namespace fastrl {
namespace {

// veRL's clamps: the token log-ratio, the GSPO sequence log-ratio (above only),
// and the log of a rollout-correction weight.
constexpr double kLogRatioClamp = 20.0;
constexpr double kSeqLogRatioMax = 10.0;
constexpr double kCorrectionLogClamp = 20.0;

// Columns of the per-row stats (policy.h), 8 in both layouts.
constexpr int64_t kNumStats = 8;
enum PolicyStat { kTokens, kPGLoss, kKLSum, kValuesSum, kClipped, kClippedLower, kPPOKL, kMeanU };
enum CorrectionStat { kRCTokens, kRCSum, kRCSumSq, kRCMax, kRCMin, kRCHigh, kRCLow, kRCMasked };

// x / y with x / 0 := 0 (y counts tokens or sequences).
FASTRL_INLINE double safe_div(double x, double y) { return y == 0 ? 0.0 : x / y; }

// The running max / min with x, a NaN sticking as in torch's max / min.
FASTRL_INLINE double nan_max(double m, double x) { return x > m || x != x ? x : m; }
FASTRL_INLINE double nan_min(double m, double x) { return x < m || x != x ? x : m; }

// A count's given value, or `counted` when it is not given.
FASTRL_INLINE double count_or(const OptionalCount& c, double counted) {
  return !c.given ? counted : c.ptr ? *c.ptr : c.value;
}

// The row at element `base` of a per-token array, or null for an array not given.
template <typename Acc>
FASTRL_INLINE const Acc* row_of(const void* p, int64_t base) {
  return p ? static_cast<const Acc*>(p) + base : nullptr;
}

// One row's per-token inputs, null where not given.
template <typename Acc>
struct PolicyRow {
  const Acc *logp, *old, *adv, *w, *ref;
  const uint8_t* mask;
};

template <typename Acc>
FASTRL_INLINE PolicyRow<Acc> policy_row(const PolicyArgs& a, int64_t base) {
  return {row_of<Acc>(a.log_probs, base),   row_of<Acc>(a.old_log_probs, base),
          row_of<Acc>(a.advantages, base),  row_of<Acc>(a.weights, base),
          row_of<Acc>(a.ref_log_probs, base), a.mask + base};
}

// Sum over the row's valid tokens of a - b (each difference in Acc, as the
// reference takes it; the sum in double), and the number of valid tokens.
template <typename Acc>
std::pair<double, int64_t> valid_diff_sum(const Acc* a, const Acc* b, const uint8_t* mask, int64_t length) {
  double sum = 0;
  int64_t n = 0;
  for (int64_t t = 0; t < length; ++t) {
    if (!mask[t]) continue;
    sum += static_cast<double>(a[t] - b[t]);
    ++n;
  }
  return {sum, n};
}

// The importance ratio of a token, whether the clamp of its log passes the
// gradient, and the token's ppo_kl term.
template <typename Acc>
struct Ratio {
  Acc r;
  bool gate;
  Acc ppo_kl;
};

template <typename Acc>
FASTRL_INLINE Ratio<Acc> importance_ratio(Acc u, Acc mean_u, bool sequence) {
  if (sequence) {
    const Acc hi = Acc(kSeqLogRatioMax);
    return {std::exp(std::min(mean_u, hi)), mean_u <= hi, -u};
  }
  const Acc lim = Acc(kLogRatioClamp);
  const Acc log_r = std::clamp(u, -lim, lim);
  return {std::exp(log_r), u >= -lim && u <= lim, -log_r};
}

// The clipped PPO loss of one token at ratio r, before the rollout weight:
// its value, dl/dr, and whether the clip / the dual clip is active.
template <typename Acc>
struct PPOLoss {
  Acc loss, dloss_dr;
  bool clipped, clipped_lower;
};

template <typename Acc>
FASTRL_INLINE PPOLoss<Acc> ppo_loss(const PolicyArgs& a, Acc adv, Acc r) {
  const Acc lo = Acc(1 - a.clip_low), hi = Acc(1 + a.clip_high);
  const Acc l1 = -adv * r;
  const Acc l2 = -adv * std::clamp(r, lo, hi);
  const Acc dl1 = -adv;
  const Acc dl2 = r >= lo && r <= hi ? -adv : Acc(0);
  PPOLoss<Acc> out;
  out.loss = l2 > l1 || l2 != l2 ? l2 : l1;  // torch.maximum: NaN if either is
  out.dloss_dr = l1 > l2 ? dl1 : l2 > l1 ? dl2 : Acc(0.5) * (dl1 + dl2);
  out.clipped = l2 > l1;
  out.clipped_lower = false;
  if (a.dual_clip && adv < 0) {
    const Acc l3 = -adv * Acc(a.clip_c);
    out.clipped_lower = out.loss > l3;
    out.dloss_dr = out.loss < l3 ? out.dloss_dr : out.loss == l3 ? Acc(0.5) * out.dloss_dr : Acc(0);
    out.loss = std::min(out.loss, l3);
  }
  return out;
}

template <typename Acc>
FASTRL_ISA_CLONES void policy_forward_row(const PolicyArgs& a, int64_t b, const void* all_values,
                                          double* stats) {
  const int64_t base = b * a.length;
  const auto [logp, old, adv, w, ref, mask] = policy_row<Acc>(a, base);
  const Acc* values = row_of<Acc>(all_values, base);
  double mean_u = 0;
  if (a.with_pg && a.sequence) {
    const auto [sum, n] = valid_diff_sum(logp, old, mask, a.length);
    mean_u = n > 0 ? sum / double(n) : 0.0;
  }
  double col[kNumStats] = {};
  col[kMeanU] = mean_u;
  for (int64_t t = 0; t < a.length; ++t) {
    if (!mask[t]) continue;
    col[kTokens] += 1;
    if (a.with_pg) {
      const Ratio<Acc> rt = importance_ratio(logp[t] - old[t], Acc(mean_u), a.sequence);
      const PPOLoss<Acc> pl = ppo_loss(a, adv[t], rt.r);
      col[kPGLoss] += w ? pl.loss * w[t] : pl.loss;
      col[kClipped] += pl.clipped;
      col[kClippedLower] += pl.clipped_lower;
      col[kPPOKL] += rt.ppo_kl;
    }
    if (a.estimator >= 0) col[kKLSum] += kl_estimate(a.estimator, false, logp[t] - ref[t]).value;
    if (values) col[kValuesSum] += values[t];
  }
  std::copy(col, col + kNumStats, stats + b * kNumStats);
}

template <typename Acc>
FASTRL_ISA_CLONES void policy_backward_row(const PolicyArgs& a, int64_t b, const double* stats, Acc g,
                                           bool straight_through, Acc kl_coef, Acc value_coef,
                                           Acc* grad_logp, Acc* grad_values) {
  const int64_t base = b * a.length;
  const auto [logp, old, adv, w, ref, mask] = policy_row<Acc>(a, base);
  const Acc mean_u = static_cast<Acc>(stats[b * kNumStats + kMeanU]);
  for (int64_t t = 0; t < a.length; ++t) {
    const bool valid = mask[t] != 0;
    if (grad_values) grad_values[base + t] = valid ? g * value_coef : Acc(0);
    if (!grad_logp) continue;
    if (!valid) {
      grad_logp[base + t] = 0;
      continue;
    }
    Acc grad = 0;
    if (a.with_pg) {
      const Ratio<Acc> rt = importance_ratio(logp[t] - old[t], mean_u, a.sequence);
      const PPOLoss<Acc> pl = ppo_loss(a, adv[t], rt.r);
      const Acc dl = w ? pl.dloss_dr * w[t] : pl.dloss_dr;
      grad += rt.gate ? dl * rt.r : Acc(0);
    }
    if (a.estimator >= 0) grad += kl_coef * kl_estimate(a.estimator, straight_through, logp[t] - ref[t]).grad;
    grad_logp[base + t] = g * grad;
  }
}

template <typename Acc>
FASTRL_ISA_CLONES void rollout_correction_row(const RolloutCorrectionArgs& a, int64_t b, float* weights,
                                              double* stats) {
  const int64_t base = b * a.length;
  const Acc* old = row_of<Acc>(a.old_log_probs, base);
  const Acc* rollout = row_of<Acc>(a.rollout_log_probs, base);
  const uint8_t* mask = a.mask + base;
  const Acc clip_min = Acc(a.clip_min), clip_max = Acc(a.clip_max), low = Acc(a.low_threshold);
  const Acc lim = Acc(kCorrectionLogClamp);
  const Acc seq_log_w = a.sequence ? static_cast<Acc>(valid_diff_sum(old, rollout, mask, a.length).first) : Acc(0);
  double n = 0, sum = 0, sum_sq = 0, w_max = -std::numeric_limits<double>::infinity(),
         w_min = std::numeric_limits<double>::infinity(), high = 0, low_count = 0, zeroed = 0;
  for (int64_t t = 0; t < a.length; ++t) {
    if (!mask[t]) {
      weights[base + t] = 0;
      continue;
    }
    const Acc log_w = a.sequence ? seq_log_w : old[t] - rollout[t];
    const Acc raw = std::exp(std::clamp(log_w, -lim, lim));
    Acc w;
    if (a.truncate) {
      w = std::clamp(raw, clip_min, clip_max);
    } else {
      const bool kept = raw >= clip_min && raw <= clip_max;
      w = kept ? raw : Acc(0);
      zeroed += !kept;
    }
    weights[base + t] = static_cast<float>(w);
    const double wd = w;
    n += 1;
    sum += wd;
    sum_sq += wd * wd;
    if (!a.sequence) {
      w_max = nan_max(w_max, wd);
      w_min = nan_min(w_min, wd);
      high += raw > clip_max;
      low_count += raw < low;
    }
  }
  if (a.sequence && n > 0) {
    // veRL's sequence-level extremes and fractions are of the sequence's raw weight
    // e^S, one per sequence: max e^min(S, 20), min e^S, and whether e^S is high / low.
    const Acc e = std::exp(seq_log_w);
    w_max = std::exp(std::min(seq_log_w, lim));
    w_min = e;
    high = e > clip_max;
    low_count = e < low;
  }
  double* out = stats + b * kNumStats;
  out[kRCTokens] = n;
  out[kRCSum] = sum;
  out[kRCSumSq] = sum_sq;
  out[kRCMax] = w_max;
  out[kRCMin] = w_min;
  out[kRCHigh] = high;
  out[kRCLow] = low_count;
  out[kRCMasked] = zeroed;
}

template <typename Acc>
void policy_forward_impl(const PolicyArgs& a, const void* values, double* stats) {
#pragma omp parallel for schedule(static) if (a.n_rows * a.length > 32768)
  for (int64_t b = 0; b < a.n_rows; ++b) policy_forward_row<Acc>(a, b, values, stats);
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

template <typename Acc>
void rollout_correction_impl(const RolloutCorrectionArgs& a, float* weights, double* stats) {
#pragma omp parallel for schedule(static) if (a.n_rows * a.length > 32768)
  for (int64_t b = 0; b < a.n_rows; ++b) rollout_correction_row<Acc>(a, b, weights, stats);
}

}  // namespace

void policy_forward(const PolicyArgs& a, const void* values, double* stats) {
  FASTRL_DISPATCH_ACC(a.dtype, "policy_forward",
                      (policy_forward_impl<Acc>(a, values, stats)))
}

void policy_backward(const PolicyArgs& a, const double* stats, const double* row_weights, const void* grad_loss,
                     bool straight_through, double kl_coef, double value_coef, void* grad_logp,
                     void* grad_values) {
  FASTRL_DISPATCH_ACC(a.dtype, "policy_backward",
                      (policy_backward_impl<Acc>(a, stats, row_weights, *static_cast<const Acc*>(grad_loss),
                                                 straight_through, Acc(kl_coef), Acc(value_coef),
                                                 static_cast<Acc*>(grad_logp),
                                                 static_cast<Acc*>(grad_values))))
}

void policy_finalize(const double* stats, int64_t n_rows, const PolicyFinalizeArgs& a, int loss_dtype,
                     void* loss, float* metrics, double* row_weights) {
  if (a.mode < kTokenMean || a.mode > kSeqMeanTokenSumNorm)
    fail("policy_finalize: unsupported loss_agg_mode code " + std::to_string(a.mode));
  if (loss_dtype != kFloat32 && loss_dtype != kFloat64)
    fail("policy_finalize: unsupported loss dtype code " + std::to_string(loss_dtype));
  // First pass: the counts the weights divide by.
  double tokens = 0, seqs = 0;
  for (int64_t b = 0; b < n_rows; ++b) {
    const double n = stats[b * kNumStats + kTokens];
    tokens += n;
    seqs += n > 0;
  }
  const double token_weight = safe_div(a.dp_size, count_or(a.batch_num_tokens, tokens));
  const double seq_weight = safe_div(a.dp_size, count_or(a.global_batch_size, seqs));
  const auto row_weight = [&](double n) {
    switch (a.mode) {
      case kTokenMean: return token_weight;
      case kTokenSum: return a.dp_size;
      case kSeqMeanTokenSum: return seq_weight;
      case kSeqMeanTokenMean: return safe_div(seq_weight, n);
      default: return safe_div(seq_weight, a.norm);  // kSeqMeanTokenSumNorm (norm = L may be 0)
    }
  };
  // Second pass: the weighted sums (pg, kl, values) and the plain ones (clip counts, ppo_kl).
  double sum[kNumStats] = {};
  for (int64_t b = 0; b < n_rows; ++b) {
    const double* row = stats + b * kNumStats;
    const double w = row_weight(row[kTokens]);
    row_weights[b] = w;
    for (const int c : {kPGLoss, kKLSum, kValuesSum}) sum[c] += w * row[c];
    for (const int c : {kClipped, kClippedLower, kPPOKL}) sum[c] += row[c];
  }
  const double value = sum[kPGLoss] + a.kl_coef * sum[kKLSum] + a.value_coef * sum[kValuesSum];
  if (loss_dtype == kFloat32) {
    *static_cast<float*>(loss) = static_cast<float>(value);
  } else {
    *static_cast<double*>(loss) = value;
  }
  const double out[] = {sum[kPGLoss], sum[kKLSum], sum[kValuesSum], safe_div(sum[kClipped], tokens),
                        safe_div(sum[kClippedLower], tokens), safe_div(sum[kPPOKL], tokens)};
  std::copy(std::begin(out), std::end(out), metrics);
}

void rollout_correction_forward(const RolloutCorrectionArgs& a, float* weights, double* stats) {
  FASTRL_DISPATCH_ACC(a.dtype, "rollout_correction_forward",
                      (rollout_correction_impl<Acc>(a, weights, stats)))
}

void rollout_finalize(const double* stats, int64_t n_rows, bool sequence, float* metrics) {
  double sum[kNumStats] = {};  // column sums; max / min of their columns
  sum[kRCMax] = -std::numeric_limits<double>::infinity();
  sum[kRCMin] = std::numeric_limits<double>::infinity();
  double sequences = 0;  // rows with a valid token
  for (int64_t b = 0; b < n_rows; ++b) {
    const double* row = stats + b * kNumStats;
    for (const int c : {kRCTokens, kRCSum, kRCSumSq, kRCHigh, kRCLow, kRCMasked}) sum[c] += row[c];
    sum[kRCMax] = nan_max(sum[kRCMax], row[kRCMax]);
    sum[kRCMin] = nan_min(sum[kRCMin], row[kRCMin]);
    sequences += row[kRCTokens] > 0;
  }
  const double t = sum[kRCTokens], high_low_count = sequence ? sequences : t;
  const double mean = safe_div(sum[kRCSum], t), mean_sq = safe_div(sum[kRCSumSq], t);
  const double out[] = {mean,
                        t > 0 ? sum[kRCMax] : 0.0,
                        t > 0 ? sum[kRCMin] : 0.0,
                        std::sqrt(std::max(mean_sq - mean * mean, 0.0)),  // NaN passes std::max
                        safe_div(mean * mean, mean_sq),
                        safe_div(sum[kRCHigh], high_low_count),
                        safe_div(sum[kRCLow], high_low_count),
                        safe_div(sum[kRCMasked], t)};
  std::copy(std::begin(out), std::end(out), metrics);
}

}  // namespace fastrl
