// PPO / GRPO / GSPO policy loss and rollout-correction weights, CPU kernels
// (the backward in policy_backward.cpp, what both share in policy_rows.h).
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
// A token outside the mask goes through the same branch-free arithmetic as the
// others (the loops vectorise that way) and a bitwise select then drops every
// term it produced, so a NaN or inf there reaches nothing. Each row is handled
// by one thread in a fixed order, so results are bitwise reproducible and
// independent of the other rows.
#include "policy.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <string>

#include "common.h"
#include "isa.h"
#include "kl.h"
#include "policy_rows.h"

namespace fastrl {
namespace {

using namespace policy_rows;

template <typename Acc, int ESTIMATOR, bool SEQUENCE>
FASTRL_INLINE void policy_forward_row_body(const PolicyArgs& a, int64_t b, const void* all_values, double* stats) {
  const int64_t base = b * a.length;
  const PolicyRow<Acc> row = policy_row<Acc>(a, base);
  const Acc* logp = row.logp;
  const Acc* values = row_of<Acc>(all_values, base);
  double mean_u = 0;
  if (SEQUENCE) {
    const auto [sum, n] = valid_diff_sum(logp, row.old, row.mask, a.length);
    mean_u = n > 0 ? sum / double(n) : 0.0;
  }
  const Ratio<Acc> row_ratio = sequence_ratio(static_cast<Acc>(mean_u));
  const ClipParams<Acc> clip(a);
  MaskWord<Acc> words[kBlock];
  LaneSums tokens, pg_loss, kl_sum, values_sum, clipped, clipped_lower, ppo_kl;
  Acc valid_buf[kBlock], loss_buf[kBlock], kl_buf[kBlock], values_buf[kBlock], clipped_buf[kBlock],
      lower_buf[kBlock], ppo_kl_buf[kBlock], row_r[kBlock];
  // The row's ratio read per token from memory: as one value, every test of it
  // would be a loop-invariant select.
  if (SEQUENCE) std::fill(row_r, row_r + kBlock, row_ratio.r);
  for (int64_t start = 0; start < a.length; start += kBlock) {
    const int64_t n = std::min(kBlock, a.length - start);
    widen_mask<Acc>(row.mask + start, n, words);
    const PolicyBlock<Acc> in(row, start);
    const Acc* values_block = block_or(values, start, Constants<Acc>::zeros);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = start + i;
      const bool valid = words[i] != 0, pg = words[i] >= clip.pg_mask_min;
      const Acc u = logp[t] - in.old[i];
      const Ratio<Acc> token = token_ratio(u);
      const Acc r = SEQUENCE ? row_r[i] : token.r;
      const PPOLoss<Acc> pl = ppo_loss(clip, in.adv[i], r);
      valid_buf[i] = valid ? Acc(1) : Acc(0);
      loss_buf[i] = select_bits(pg, pl.loss * in.w[i], Acc(0));
      clipped_buf[i] = select_bits(pg, pl.clipped, Acc(0));
      lower_buf[i] = select_bits(pg, pl.clipped_lower, Acc(0));
      ppo_kl_buf[i] = select_bits(pg, SEQUENCE ? -u : token.ppo_kl, Acc(0));
      values_buf[i] = select_bits(valid, values_block[i], Acc(0));
    }
    if (ESTIMATOR >= 0) {
      // The KL term in a loop of its own (kLoopSplit).
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const Acc kl = kl_estimate<ESTIMATOR, false>(logp[start + i] - in.ref[i]).value;
        kl_buf[i] = select_bits(words[i] != 0, kl, Acc(0));
      }
    }
    tokens.add(valid_buf, n);
    pg_loss.add(loss_buf, n);
    clipped.add(clipped_buf, n);
    clipped_lower.add(lower_buf, n);
    ppo_kl.add(ppo_kl_buf, n);
    if (ESTIMATOR >= 0) kl_sum.add(kl_buf, n);
    if (values) values_sum.add(values_buf, n);
  }
  double* col = stats + b * kNumStats;
  col[kTokens] = tokens.total();
  col[kPGLoss] = pg_loss.total();
  col[kKLSum] = kl_sum.total();
  col[kValuesSum] = values_sum.total();
  col[kClipped] = clipped.total();
  col[kClippedLower] = clipped_lower.total();
  col[kPPOKL] = ppo_kl.total();
  col[kMeanU] = mean_u;
}

// Each variant (estimator, sequence level, straight-through) gets trampolines
// of its own (isa.h), so tests/test_native_isa.py sees every variant's code:
// one that stays scalar cannot hide among the vectorised ones.
template <typename Acc, int ESTIMATOR, bool SEQUENCE>
void policy_forward_row_at(const PolicyArgs& a, int64_t b, const void* all_values, double* stats) {
  isa_dispatch([&]() FASTRL_ISA_BODY { policy_forward_row_body<Acc, ESTIMATOR, SEQUENCE>(a, b, all_values, stats); });
}

template <typename Acc>
void policy_forward_row(const PolicyArgs& a, int64_t b, const void* all_values, double* stats) {
  if (a.with_pg && a.sequence) {
    FASTRL_WITH_ESTIMATOR(a.estimator, policy_forward_row_at, FASTRL_COMMA true, (a, b, all_values, stats))
  } else {
    FASTRL_WITH_ESTIMATOR(a.estimator, policy_forward_row_at, FASTRL_COMMA false, (a, b, all_values, stats))
  }
}

// Rollout correction of one row (see the top of the file).
template <typename Acc, bool SEQUENCE, bool TRUNCATE>
FASTRL_INLINE void rollout_correction_row_body(const RolloutCorrectionArgs& a, int64_t b, float* weights,
                                               double* stats) {
  const int64_t base = b * a.length;
  const Acc* old = row_of<Acc>(a.old_log_probs, base);
  const Acc* rollout = row_of<Acc>(a.rollout_log_probs, base);
  const uint8_t* mask = a.mask + base;
  const Acc clip_min = Acc(a.clip_min), clip_max = Acc(a.clip_max), low = Acc(a.low_threshold);
  const Acc lim = Acc(kCorrectionLogClamp);
  const Acc seq_log_w = SEQUENCE ? static_cast<Acc>(valid_diff_sum(old, rollout, mask, a.length).first) : Acc(0);
  LaneSums n_valid, sum, sum_sq, high, low_count, zeroed;
  double lane_max[kLanes], lane_min[kLanes];
  std::fill(lane_max, lane_max + kLanes, -std::numeric_limits<double>::infinity());
  std::fill(lane_min, lane_min + kLanes, std::numeric_limits<double>::infinity());
  // max_buf / min_buf in Acc too (a max picks one of the weights, exact in
  // any type): a float-to-double conversion kept the AVX loops scalar.
  Acc valid_buf[kBlock], w_buf[kBlock], w_sq_buf[kBlock], high_buf[kBlock], low_buf[kBlock], zeroed_buf[kBlock],
      max_buf[kBlock], min_buf[kBlock], row_raw[kBlock];
  MaskWord<Acc> words[kBlock];
  // The sequence's raw weight read per token from memory, as the policy loss's
  // row ratio: as one value, the tests of it are loop-invariant selects, which
  // GCC does not vectorise.
  if (SEQUENCE) std::fill(row_raw, row_raw + kBlock, std::exp(std::clamp(seq_log_w, -lim, lim)));
  for (int64_t start = 0; start < a.length; start += kBlock) {
    const int64_t n = std::min(kBlock, a.length - start);
    widen_mask<Acc>(mask + start, n, words);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = start + i;
      const bool valid = words[i] != 0;
      const Acc raw = SEQUENCE ? row_raw[i] : exp_approx(std::clamp(old[t] - rollout[t], -lim, lim));
      const bool kept = raw >= clip_min && raw <= clip_max;
      const Acc w = TRUNCATE ? std::clamp(raw, clip_min, clip_max) : kept ? raw : Acc(0);
      // Every test of `valid` goes through select_bits: as a vector mask, the
      // byte-wide mask's compare needed a conversion to the float lanes' mask
      // that AVX2 and AVX-512 lack, and the loop stayed scalar.
      valid_buf[i] = select_bits(valid, Acc(1), Acc(0));
      w_buf[i] = select_bits(valid, w, Acc(0));
      w_sq_buf[i] = select_bits(valid, w * w, Acc(0));
      zeroed_buf[i] = select_bits(valid, !TRUNCATE && !kept ? Acc(1) : Acc(0), Acc(0));
      // Token level only (the sequence level's come from e^S below); an invalid
      // token stands in as -inf / +inf, which no max / min keeps.
      max_buf[i] = select_bits(valid, w, neg_inf<Acc>());
      min_buf[i] = select_bits(valid, w, -neg_inf<Acc>());
      high_buf[i] = select_bits(valid, raw > clip_max ? Acc(1) : Acc(0), Acc(0));
      low_buf[i] = select_bits(valid, raw < low ? Acc(1) : Acc(0), Acc(0));
    }
    // The weights leave from w_buf in a loop of their own: a store through
    // `weights` in the loop above may alias the mask bytes as far as GCC
    // knows, which held that loop to 128-bit vectors.
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) weights[base + start + i] = static_cast<float>(w_buf[i]);
    n_valid.add(valid_buf, n);
    sum.add(w_buf, n);
    sum_sq.add(w_sq_buf, n);
    zeroed.add(zeroed_buf, n);
    if (!SEQUENCE) {
      high.add(high_buf, n);
      low_count.add(low_buf, n);
      for (int64_t i = 0; i < n; ++i) {
        lane_max[i % kLanes] = nan_max(lane_max[i % kLanes], static_cast<double>(max_buf[i]));
        lane_min[i % kLanes] = nan_min(lane_min[i % kLanes], static_cast<double>(min_buf[i]));
      }
    }
  }
  double w_max = -std::numeric_limits<double>::infinity(), w_min = std::numeric_limits<double>::infinity();
  for (int j = 0; j < kLanes; ++j) {
    w_max = nan_max(w_max, lane_max[j]);
    w_min = nan_min(w_min, lane_min[j]);
  }
  double high_count = high.total(), low_total = low_count.total();
  const double tokens = n_valid.total();
  if (SEQUENCE && tokens > 0) {
    // veRL's sequence-level extremes and fractions are of the sequence's raw weight
    // e^S, one per sequence: max e^min(S, 20), min e^S, and whether e^S is high / low.
    const Acc e = std::exp(seq_log_w);
    w_max = std::exp(std::min(seq_log_w, lim));
    w_min = e;
    high_count = e > clip_max;
    low_total = e < low;
  }
  double* out = stats + b * kNumStats;
  out[kRCTokens] = tokens;
  out[kRCSum] = sum.total();
  out[kRCSumSq] = sum_sq.total();
  out[kRCMax] = w_max;
  out[kRCMin] = w_min;
  out[kRCHigh] = high_count;
  out[kRCLow] = low_total;
  out[kRCMasked] = zeroed.total();
}

template <typename Acc, bool SEQUENCE, bool TRUNCATE>
void rollout_correction_row_at(const RolloutCorrectionArgs& a, int64_t b, float* weights, double* stats) {
  isa_dispatch([&]() FASTRL_ISA_BODY { rollout_correction_row_body<Acc, SEQUENCE, TRUNCATE>(a, b, weights, stats); });
}

template <typename Acc>
void rollout_correction_row(const RolloutCorrectionArgs& a, int64_t b, float* weights, double* stats) {
  if (a.sequence) {
    a.truncate ? rollout_correction_row_at<Acc, true, true>(a, b, weights, stats)
               : rollout_correction_row_at<Acc, true, false>(a, b, weights, stats);
  } else {
    a.truncate ? rollout_correction_row_at<Acc, false, true>(a, b, weights, stats)
               : rollout_correction_row_at<Acc, false, false>(a, b, weights, stats);
  }
}

template <typename Acc>
void policy_forward_impl(const PolicyArgs& a, const void* values, double* stats) {
#pragma omp parallel for schedule(static) if (a.n_rows * a.length > 32768)
  for (int64_t b = 0; b < a.n_rows; ++b) policy_forward_row<Acc>(a, b, values, stats);
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
