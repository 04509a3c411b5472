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
#include <type_traits>
#include <utility>

#include "common.h"
#include "isa.h"
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

// The token loops below are written so that GCC vectorises them at every ISA
// level (isa.h):
// - no branch: a masked-out token goes through the arithmetic like any other
//   (its inputs may be NaN) and a select drops its result;
// - a setting that is the same for every token is a template argument
//   (sequence level, truncation, the KL estimator, straight_through) or is
//   turned into a comparison of a token's own value (with_pg: the mask byte
//   against 1 or 256; dual clip: A against 0 or -inf): GCC does not vectorise a
//   select on a loop-invariant flag;
// - an optional per-token input not given is read from a constant block.
// Tokens go in blocks of kBlock: simd loops write each token's terms to L1
// buffers, then the row sums add them in kLanes double lanes, lane j taking
// tokens j, j + kLanes, ... (the tail's one at a time), folded in lane order at
// the end: every ISA level adds the same numbers in the same order.
// kLoopSplit: the PPO terms and the KL term go in loops of their own. Each is a
// long chain of dependent operations (an exp; the k3 estimate's polynomial and
// exp); in one loop body the two made an iteration too long for the CPU to
// overlap with the next, and the loop ran at the chains' latency: one iteration
// took about as long at 16 lanes (AVX-512) as at 8 (AVX2).
constexpr int kLanes = 16;
constexpr int64_t kBlock = 256;

template <typename Acc>
struct Constants {
  static constexpr Acc ones[kBlock] = {
#define FASTRL_ONE8 1, 1, 1, 1, 1, 1, 1, 1
#define FASTRL_ONE64 FASTRL_ONE8, FASTRL_ONE8, FASTRL_ONE8, FASTRL_ONE8, FASTRL_ONE8, FASTRL_ONE8, FASTRL_ONE8, FASTRL_ONE8
      FASTRL_ONE64, FASTRL_ONE64, FASTRL_ONE64, FASTRL_ONE64};
#undef FASTRL_ONE64
#undef FASTRL_ONE8
  static constexpr Acc zeros[kBlock] = {};
};

// The block of an optional per-token input at token `start`, or a constant one.
template <typename Acc>
FASTRL_INLINE const Acc* block_or(const Acc* p, int64_t start, const Acc* constant) {
  return p ? p + start : constant;
}

// A block's mask bytes widened to the width of Acc. The token loops then hold
// lanes of one width only: reading the bytes there, GCC sized the vector by the
// byte (32 tokens an AVX2 iteration, four registers for each float value) and
// spilled most of them to the stack.
template <typename Acc>
using MaskWord = std::conditional_t<sizeof(Acc) == 8, uint64_t, uint32_t>;

template <typename Acc>
FASTRL_INLINE void widen_mask(const uint8_t* mask, int64_t n, MaskWord<Acc>* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = mask[i];
}

// The row's optional per-token inputs at the block starting at token `start`,
// each read from a constant block where not given (old_log_probs and
// advantages are null without with_pg).
template <typename Acc>
struct PolicyBlock {
  const Acc *w, *old, *adv, *ref;
  FASTRL_INLINE PolicyBlock(const PolicyRow<Acc>& row, int64_t start)
      : w(block_or(row.w, start, Constants<Acc>::ones)),
        old(block_or(row.old, start, Constants<Acc>::zeros)),
        adv(block_or(row.adv, start, Constants<Acc>::zeros)),
        ref(block_or(row.ref, start, Constants<Acc>::zeros)) {}
};

// Row sums in kLanes double lanes (see above).
struct LaneSums {
  double lane[kLanes] = {};
  // Adds terms[0, n) of the block, term i into lane i % kLanes.
  template <typename T>
  FASTRL_INLINE void add(const T* terms, int64_t n) {
    const int64_t whole = n / kLanes * kLanes;
    for (int64_t i = 0; i < whole; i += kLanes) {
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) lane[j] += static_cast<double>(terms[i + j]);
    }
    for (int64_t i = whole; i < n; ++i) lane[i - whole] += static_cast<double>(terms[i]);
  }
  double total() const {
    double sum = 0;
    for (double v : lane) sum += v;
    return sum;
  }
};

// Sum over the row's valid tokens of a - b (each difference in Acc, as the
// reference takes it; the sum in double), and the number of valid tokens.
template <typename Acc>
FASTRL_INLINE std::pair<double, int64_t> valid_diff_sum(const Acc* a, const Acc* b, const uint8_t* mask,
                                                        int64_t length) {
  LaneSums sum, count;
  Acc diff[kBlock], valid[kBlock];
  MaskWord<Acc> words[kBlock];
  for (int64_t start = 0; start < length; start += kBlock) {
    const int64_t n = std::min(kBlock, length - start);
    widen_mask<Acc>(mask + start, n, words);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const bool v = words[i] != 0;
      diff[i] = select_bits(v, a[start + i] - b[start + i], Acc(0));
      valid[i] = v ? Acc(1) : Acc(0);
    }
    sum.add(diff, n);
    count.add(valid, n);
  }
  return {sum.total(), static_cast<int64_t>(count.total())};
}

// The per-row settings as the token loops use them (see above).
template <typename Acc>
struct ClipParams {
  Acc lo, hi, clip_c, dual_below;
  MaskWord<Acc> pg_mask_min;  // a token's policy-gradient terms count where mask >= this: 1, or 256 for none
  explicit ClipParams(const PolicyArgs& a)
      : lo(Acc(1 - a.clip_low)),
        hi(Acc(1 + a.clip_high)),
        clip_c(Acc(a.clip_c)),
        dual_below(a.dual_clip ? Acc(0) : neg_inf<Acc>()),
        pg_mask_min(a.with_pg ? 1 : 256) {}
};

// The importance ratio r of a token, whether the clamp of log r passes the
// gradient (gate: 1 or 0, not a bool, for the reason PPOLoss gives), and the
// token's ppo_kl term. SEQUENCE (GSPO): r and the gate are the row's, from
// mean_u, and ppo_kl = -u; token level: log r = clamp(u, +-20).
template <typename Acc>
struct Ratio {
  Acc r, gate, ppo_kl;
};

template <typename Acc>
FASTRL_INLINE Ratio<Acc> token_ratio(Acc u) {
  const Acc lim = Acc(kLogRatioClamp);
  const Acc log_r = std::clamp(u, -lim, lim);
  return {exp_approx(log_r), u >= -lim && u <= lim ? Acc(1) : Acc(0), -log_r};
}

template <typename Acc>
Ratio<Acc> sequence_ratio(Acc mean_u) {
  const Acc hi = Acc(kSeqLogRatioMax);
  return {std::exp(std::min(mean_u, hi)), mean_u <= hi ? Acc(1) : Acc(0), Acc(0)};
}

// The clipped PPO loss of one token at ratio r, before the rollout weight:
// its value, dl/dr, and whether the clip / the dual clip is active (1 or 0:
// as bools, the struct stayed in memory and its flag stores kept the token
// loop from being if-converted, so it did not vectorise).
template <typename Acc>
struct PPOLoss {
  Acc loss, dloss_dr, clipped, clipped_lower;
};

template <typename Acc>
FASTRL_INLINE PPOLoss<Acc> ppo_loss(const ClipParams<Acc>& c, Acc adv, Acc r) {
  const Acc l1 = -adv * r;
  const Acc l2 = -adv * std::clamp(r, c.lo, c.hi);
  const Acc dl1 = -adv;
  const Acc dl2 = r >= c.lo && r <= c.hi ? -adv : Acc(0);
  const Acc loss = l2 > l1 || l2 != l2 ? l2 : l1;  // torch.maximum: NaN if either is
  const Acc dloss_dr = l1 > l2 ? dl1 : l2 > l1 ? dl2 : Acc(0.5) * (dl1 + dl2);
  // Dual clip (A < 0, and dual_below = 0 when it is on): min(loss, l3), a tie
  // halving the gradient.
  const bool dual = adv < c.dual_below;
  const Acc l3 = -adv * c.clip_c;
  const Acc dual_dloss_dr = loss < l3 ? dloss_dr : loss == l3 ? Acc(0.5) * dloss_dr : Acc(0);
  return {dual ? std::min(loss, l3) : loss, dual ? dual_dloss_dr : dloss_dr, l2 > l1 ? Acc(1) : Acc(0),
          dual && loss > l3 ? Acc(1) : Acc(0)};
}

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
template <typename Acc, int ESTIMATOR, bool SEQUENCE>
void policy_forward_row_at(const PolicyArgs& a, int64_t b, const void* all_values, double* stats) {
  isa_dispatch([&]() FASTRL_ISA_BODY { policy_forward_row_body<Acc, ESTIMATOR, SEQUENCE>(a, b, all_values, stats); });
}

template <typename Acc, int ESTIMATOR, bool SEQUENCE, bool STRAIGHT_THROUGH>
void policy_backward_row_at(const PolicyArgs& a, int64_t b, const double* stats, Acc g, Acc kl_coef,
                            Acc* grad_logp) {
  isa_dispatch([&]() FASTRL_ISA_BODY {
    policy_backward_row_body<Acc, ESTIMATOR, SEQUENCE, STRAIGHT_THROUGH>(a, b, stats, g, kl_coef, grad_logp);
  });
}

template <typename Acc>
void policy_forward_row(const PolicyArgs& a, int64_t b, const void* all_values, double* stats) {
  if (a.with_pg && a.sequence) {
    FASTRL_WITH_ESTIMATOR(a.estimator, policy_forward_row_at, FASTRL_COMMA true, (a, b, all_values, stats))
  } else {
    FASTRL_WITH_ESTIMATOR(a.estimator, policy_forward_row_at, FASTRL_COMMA false, (a, b, all_values, stats))
  }
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
