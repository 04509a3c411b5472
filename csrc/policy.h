// PPO / GRPO / GSPO policy loss and rollout-correction weights: the CPU
// kernels' interface.
#pragma once

#include <cstdint>

namespace fastrl {

// What the policy-loss passes read. Every per-token array is a contiguous
// [n_rows, length] array (row b, a sequence, at b * length) of the accumulation
// type `dtype` (float32 / float64); mask is uint8 0 / 1. A token with mask 0
// contributes nothing: its values may be anything, NaN included.
// old_log_probs and advantages are read only with with_pg, ref_log_probs only
// when estimator >= 0 (a kl.h code; -1: no KL term); weights (rollout
// correction) may be null. clip_c is the dual-clip constant when dual_clip.
struct PolicyArgs {
  const void* log_probs;
  const void* old_log_probs;
  const void* advantages;
  const uint8_t* mask;
  const void* weights;
  const void* ref_log_probs;
  int dtype;
  int64_t n_rows;
  int64_t length;
  int estimator;
  double clip_low;
  double clip_high;
  bool dual_clip;
  double clip_c;
  bool sequence;
  bool with_pg;
};

// Writes each row's float64 partial sums over its valid tokens into stats
// [n_rows, 8]: 0 tokens, 1 sum of the PPO loss (with_pg), 2 sum of the KL
// estimate (estimator >= 0), 3 sum of values (when non-null), 4 tokens clipped,
// 5 tokens dual-clipped, 6 sum of the ppo_kl term, 7 the mean log-ratio of
// the row (sequence level). Columns 4 to 7 need with_pg; a column not computed is 0.
void policy_forward(const PolicyArgs& args, const void* values, double* stats);

// Writes, for valid tokens (0 elsewhere), with the row's gradient
// g = acc(double(*grad_loss) row_weights[b]) (grad_loss: the incoming dL/dloss,
// one value of the accumulation type; row_weights: policy_finalize's float64 w_b):
//   grad_logp   = g (with_pg dl/dlogp + kl_coef dkl/dlogp)
//   grad_values = g value_coef
// into whichever of grad_logp / grad_values ([n_rows, length], accumulation
// type) is non-null. stats is the forward's (column 7 at sequence level).
void policy_backward(const PolicyArgs& args, const double* stats, const double* row_weights,
                     const void* grad_loss, bool straight_through, double kl_coef, double value_coef,
                     void* grad_logp, void* grad_values);

// Loss aggregation modes, the codes fastrl/_native.py passes for loss_agg_mode.
enum LossAggMode : int {
  kTokenMean = 0,            // "token-mean"
  kTokenSum = 1,             // "token-sum"
  kSeqMeanTokenSum = 2,      // "seq-mean-token-sum"
  kSeqMeanTokenMean = 3,     // "seq-mean-token-mean"
  kSeqMeanTokenSumNorm = 4,  // "seq-mean-token-sum-norm"
};

// A count the aggregation divides by, given or not: when given, *ptr if ptr is
// non-null (a float64 scalar in memory, so a caller holding it in a tensor
// needs no host sync), else value; when not given, counted from the stats.
struct OptionalCount {
  const double* ptr;
  double value;
  bool given;
};

struct PolicyFinalizeArgs {
  int mode;  // LossAggMode
  double dp_size;
  OptionalCount batch_num_tokens;   // N
  OptionalCount global_batch_size;  // G
  double norm;                      // seq-mean-token-sum-norm's divisor
  double kl_coef;
  double value_coef;
};

// Aggregates policy_forward's stats [n_rows, 8] (columns n, pg, kl, values,
// clipped, clipped_lower, ppo_kl, mean_u) into the loss and the metrics, in
// double, on one thread, rows in order (deterministic):
//   N = batch_num_tokens, default sum_b n_b;  G = global_batch_size, default #{b : n_b > 0}
//   w_b = token-mean dp / N;  token-sum dp;  seq-mean-token-sum dp / G;
//         seq-mean-token-mean dp / G / n_b;  seq-mean-token-sum-norm dp / G / norm
//         (x / 0 := 0 for the counts N, G, n_b and for norm = L = 0)
//   PG, KL, VAL = sum_b w_b (pg_b, kl_b, values_b)
//   loss = PG + kl_coef KL + value_coef VAL, stored as loss_dtype (float32 / float64)
//   metrics (float32 [6]) = [PG, KL, VAL, clipped / T, clipped_lower / T, ppo_kl / T],
//         the last three sums over rows, T = sum_b n_b (x / 0 := 0)
//   row_weights (float64 [n_rows]) = w_b, for policy_backward
void policy_finalize(const double* stats, int64_t n_rows, const PolicyFinalizeArgs& args, int loss_dtype,
                     void* loss, float* metrics, double* row_weights);

// Rollout correction: per-token arrays as in PolicyArgs. truncate: clamp the
// raw weight to [clip_min, clip_max]; else (mask mode) zero it outside that
// range. clip_min 0 sets no lower bound; low_threshold is the bound below
// which a raw weight counts as low.
struct RolloutCorrectionArgs {
  const void* old_log_probs;
  const void* rollout_log_probs;
  const uint8_t* mask;
  int dtype;
  int64_t n_rows;
  int64_t length;
  bool sequence;
  bool truncate;
  double clip_min;
  double clip_max;
  double low_threshold;
};

// Writes the weights (float32 [n_rows, length], 0 on invalid tokens) and each
// row's float64 stats [n_rows, 8]: 0 tokens, 1 sum w, 2 sum w^2, 3 max, 4 min,
// 5 high, 6 low, 7 weights zeroed by mask mode, where (veRL's metrics)
//   token level:     3 / 4 max / min of w (-inf / +inf for no token), 5 / 6 the
//                    tokens whose raw weight is > clip_max / < low_threshold
//   sequence level:  with the row's summed log-ratio S (for a row with a valid
//                    token; else as above): 3 e^min(S, 20), 4 e^S, 5 / 6 whether
//                    e^S > clip_max / < low_threshold (0 or 1: the row counts once)
void rollout_correction_forward(const RolloutCorrectionArgs& args, float* weights, double* stats);

// Combines rollout_correction_forward's stats [n_rows, 8] into the metrics
// (float32 [8]), in double, on one thread, rows in order; x / 0 := 0:
//   T = sum n,  mean = sum w / T,  mean_sq = sum w^2 / T
//   [mean, max, min (both 0 when T = 0), std = sqrt(max(mean_sq - mean^2, 0)),
//    ess = mean^2 / mean_sq, n_high / H, n_low / H, n_masked / T]
// with H = T at token level, and at sequence level H = the number of rows with
// a valid token (veRL's sequence-level fractions count sequences).
void rollout_finalize(const double* stats, int64_t n_rows, bool sequence, float* metrics);

}  // namespace fastrl
