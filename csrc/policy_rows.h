// The policy-loss CPU kernels' shared pieces: the stats layout, veRL's
// clamps, the per-row inputs, the lane sums and the per-token PPO arithmetic.
// policy.cpp holds the forward, the rollout correction and the finalize (and
// the math of each at its top), policy_backward.cpp the backward: two
// translation units that compile in parallel (each instantiates its row
// kernels for every estimator, level and ISA: one file of both took two
// minutes, most of the build).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "common.h"
#include "policy.h"

namespace fastrl {
namespace policy_rows {


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

}  // namespace policy_rows
}  // namespace fastrl
