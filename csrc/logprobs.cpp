// Log-probs and entropy of the chosen tokens, CPU kernels.
//
// For one row of logits x (length V) at temperature T (inv_t = 1/T > 0):
//   m   = max_j x_j,   d_j = (x_j - m) * inv_t
//   s   = sum_j exp(d_j),   w = sum_j exp(d_j) * d_j
//   logprob = (x_label - m) * inv_t - log s
//   entropy = -sum_j p_j log p_j = log s - w / s          (log p_j = d_j - log s)
//   sum_pi_squared = sum_j p_j^2 = (n + q) / s^2           (s = n + t; q, n: softmax_stats.h)
// Differences are taken on the raw logits before scaling, so large logits lose
// no absolute accuracy when T != 1, and keeping w relative to the max avoids
// cancelling two numbers of size |x| when the entropy is small.
//
// Forward reads the row once (row_stats, softmax_stats.h), as segments
// (fastrl._rows.segment_length) whose statistics are folded left to right
// (fold_row_stats): a rank holding whole segments of a vocabulary shard gives
// their statistics (logprobs_segments), the ranks gather them, and
// logprobs_combine folds and finishes them with the forward's own code, so the
// tensor-parallel degree changes no bit. The backward gets each row's
// (m, log s) from the forward.
//
// Backward, with g = dL/dlogprob and h = dL/dentropy of the row:
//   dL/dx_j = inv_t * ( g * ([j == label] - p_j)  -  h * p_j * (log p_j + entropy) )
// a term with p_j = 0 (a -inf logit, or one so far below the max that
// (x_j - m) / T overflows) contributes nothing. A row with g = h = 0 (an
// ignore_index label or a zero dL/dlogprob, and no entropy gradient or a zero
// one: a padding row) gets +0 everywhere without reading its logits, which may
// then be anything (NaN, all -inf), as if it were not in the batch: 0 * NaN
// would put NaN into every weight the gradient reaches. One read of the row and
// one write of the gradient, which may alias the logits (inplace_backward): each
// chunk is read fully before it is written.
//
// Each row is reduced by one thread in a fixed order, so results are bitwise
// reproducible and independent of the other rows in the batch.
#include "logprobs.h"

#include <algorithm>

#include "common.h"
#include "isa.h"
#include "softmax_stats.h"

namespace fastrl {
namespace {

constexpr int64_t kChunk = 2048;

template <typename In, typename Acc>
FASTRL_INLINE void row_grad_body(const In* x, In* grad, int64_t vocab, Acc inv_t, Acc m,
                                 Acc log_s, Acc g_logprob, int64_t label, bool with_entropy, Acc g_entropy,
                                 Acc entropy) {
  Acc buf[kChunk];
  for (int64_t start = 0; start < vocab; start += kChunk) {
    const int64_t n = std::min(kChunk, vocab - start);
    if (with_entropy) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const Acc xi = load_as<Acc>(x, start + i);
        const Acc logp = (xi - m) * inv_t - log_s;
        const Acc p = exp_approx(logp);
        // p = 0 adds nothing; logp may be -inf there, also for a finite logit
        // whose (x - m) / T overflowed, so the term is tested, not the logit.
        const Acc logp_finite = p == 0 ? Acc(0) : logp;
        buf[i] = -g_logprob * p - g_entropy * p * (logp_finite + entropy);
      }
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const Acc logp = (load_as<Acc>(x, start + i) - m) * inv_t - log_s;
        buf[i] = -g_logprob * exp_approx(logp);
      }
    }
    if (label >= start && label < start + n) buf[label - start] += g_logprob;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) store_from(grad, start + i, buf[i] * inv_t);
  }
}

template <typename In, typename Acc>
void row_grad(const In* x, In* grad, int64_t vocab, Acc inv_t, Acc m, Acc log_s, Acc g_logprob, int64_t label,
              bool with_entropy, Acc g_entropy, Acc entropy) {
  isa_dispatch([&]() FASTRL_ISA_BODY {
    row_grad_body<In, Acc>(x, grad, vocab, inv_t, m, log_s, g_logprob, label, with_entropy, g_entropy, entropy);
  });
}

// The forward's outputs, each null when not asked for (logprobs.h).
template <typename Acc>
struct ForwardOutputs {
  Acc* logprob;
  Acc* entropy;
  Acc* stats;
  Acc* sum_pi_squared;

  ForwardOutputs(void* lp, void* ent, void* st, void* spq)
      : logprob(static_cast<Acc*>(lp)), entropy(static_cast<Acc*>(ent)), stats(static_cast<Acc*>(st)),
        sum_pi_squared(static_cast<Acc*>(spq)) {}

  // Row r of a row whose temperature is not usable: NaN everywhere.
  void poison(int64_t r) const {
    if (logprob) logprob[r] = quiet_nan<Acc>();
    if (entropy) entropy[r] = quiet_nan<Acc>();
    if (stats) stats[2 * r] = stats[2 * r + 1] = quiet_nan<Acc>();
    if (sum_pi_squared) sum_pi_squared[r] = quiet_nan<Acc>();
  }

  // Row r's outputs from its folded statistics and its label: ignored (log-prob
  // 0), outside [0, vocab) (NaN) or at a logit of x_label (read only then). One
  // code for a whole row and for the ranks' gathered segments (combine_impl).
  template <typename LabelLogit>
  void finish(int64_t r, const RowStats<Acc>& st, Acc inv_t, int64_t label, int64_t ignore_index, int64_t vocab,
              LabelLogit x_label) const {
    const double log_s_exact = st.log_s();  // from the double sums (softmax_stats.h)
    const Acc log_s = static_cast<Acc>(log_s_exact);
    if (stats) {
      stats[2 * r] = st.m;
      stats[2 * r + 1] = log_s;
    }
    if (entropy) entropy[r] = static_cast<Acc>(log_s_exact - st.w / st.s());
    if (sum_pi_squared) sum_pi_squared[r] = static_cast<Acc>(st.sum_p_squared());  // from the double sums
    if (logprob) {
      if (label == ignore_index) {
        logprob[r] = 0;
      } else if (label < 0 || label >= vocab) {
        logprob[r] = quiet_nan<Acc>();
      } else {
        logprob[r] = (x_label() - st.m) * inv_t - log_s;
      }
    }
  }
};

template <typename In, typename Acc>
void forward_impl(const LogprobsArgs& a, int64_t segment, const ForwardOutputs<Acc>& out) {
  const In* logits = static_cast<const In*>(a.logits);
  const bool want_w = out.entropy != nullptr;
  const bool want_q = out.sum_pi_squared != nullptr;
#pragma omp parallel for schedule(static) if (a.n_rows * a.vocab > 32768)
  for (int64_t r = 0; r < a.n_rows; ++r) {
    const In* x = logits + a.rows.offset(r);
    const Acc t = row_temperature<Acc>(a.temps, a.temp_scalar, r);
    if (!usable_temperature(t)) {
      out.poison(r);
      continue;
    }
    const Acc inv_t = Acc(1) / t;
    const RowStats<Acc> st = segmented_row_stats<In, Acc>(x, a.vocab, segment, inv_t, want_w, want_q);
    const int64_t label = out.logprob ? load_label(a.labels, a.label_dtype, r) : a.ignore_index;
    out.finish(r, st, inv_t, label, a.ignore_index, a.vocab, [&] { return load_as<Acc>(x, label); });
  }
}

// Each segment's RowStats of a shard's rows, unfolded, as [n_rows, vocab / segment, 5] doubles (m, n, t, w, q).
template <typename In, typename Acc>
void segments_impl(const LogprobsArgs& a, int64_t segment, bool want_w, bool want_q, double* out) {
  const In* logits = static_cast<const In*>(a.logits);
  const int64_t n_segments = a.vocab / segment;
#pragma omp parallel for schedule(static) if (a.n_rows * a.vocab > 32768)
  for (int64_t r = 0; r < a.n_rows; ++r) {
    const Acc t = row_temperature<Acc>(a.temps, a.temp_scalar, r);
    const Acc inv_t = usable_temperature(t) ? Acc(1) / t : quiet_nan<Acc>();
    for (int64_t g = 0; g < n_segments; ++g) {
      const RowStats<Acc> st = row_stats<In, Acc>(logits + a.rows.offset(r) + g * segment, segment, inv_t, want_w,
                                                  want_q);
      double* o = out + (r * n_segments + g) * 5;
      o[0] = st.m;
      o[1] = st.n;
      o[2] = st.t;
      o[3] = st.w;
      o[4] = st.q;
    }
  }
}

// forward_impl's fold and finish over gathered segments [n_rows, n_segments, 5] (in vocabulary order) and
// the label logits [n_rows] (read where the label is in [0, vocab)).
template <typename Acc>
void combine_impl(const double* segments, int64_t n_rows, int64_t n_segments, const Acc* label_logits,
                  const LogprobsArgs& a, const ForwardOutputs<Acc>& out) {
  const bool want_q = out.sum_pi_squared != nullptr;
#pragma omp parallel for schedule(static) if (n_rows * n_segments > 32768)
  for (int64_t r = 0; r < n_rows; ++r) {
    const Acc t = row_temperature<Acc>(a.temps, a.temp_scalar, r);
    if (!usable_temperature(t)) {
      out.poison(r);
      continue;
    }
    const Acc inv_t = Acc(1) / t;
    RowStats<Acc> st{neg_inf<Acc>(), 0, 0, 0, 0};
    for (int64_t g = 0; g < n_segments; ++g) {
      const double* s = segments + (r * n_segments + g) * 5;
      fold_row_stats(st, RowStats<Acc>{static_cast<Acc>(s[0]), s[1], s[2], s[3], s[4]}, inv_t, want_q);
    }
    const int64_t label = out.logprob ? load_label(a.labels, a.label_dtype, r) : a.ignore_index;
    out.finish(r, st, inv_t, label, a.ignore_index, a.vocab, [&] { return label_logits[r]; });
  }
}

template <typename In, typename Acc>
void backward_impl(const LogprobsArgs& a, const void* stats_in, const void* entropy_in,
                   const void* grad_logprob, const void* grad_entropy, void* grad_out,
                   RowLayout grad_rows, int64_t label_base, int64_t label_vocab) {
  const In* logits = static_cast<const In*>(a.logits);
  In* grad = static_cast<In*>(grad_out);
  const Acc* stats = static_cast<const Acc*>(stats_in);
  const Acc* entropy = static_cast<const Acc*>(entropy_in);
  const Acc* g_lp = static_cast<const Acc*>(grad_logprob);
  const Acc* g_ent = static_cast<const Acc*>(grad_entropy);
#pragma omp parallel for schedule(static) if (a.n_rows * a.vocab > 32768)
  for (int64_t r = 0; r < a.n_rows; ++r) {
    const Acc t = row_temperature<Acc>(a.temps, a.temp_scalar, r);
    const Acc inv_t = usable_temperature(t) ? Acc(1) / t : quiet_nan<Acc>();
    Acc g = 0;
    int64_t label = -1;
    if (g_lp) {
      label = load_label(a.labels, a.label_dtype, r);
      if (label == a.ignore_index) {
        label = -1;
      } else if (label < 0 || label >= label_vocab) {
        label = -1;
        g = quiet_nan<Acc>();  // the forward marked this row NaN; so does its gradient
      } else {
        g = g_lp[r];
        label -= label_base;  // outside [0, vocab): no column of this block
      }
    }
    const Acc h = g_ent ? g_ent[r] : Acc(0);
    if (g == 0 && h == 0) {  // nothing flows into this row (the header)
      In* row = grad + grad_rows.offset(r);
      for (int64_t i = 0; i < a.vocab; ++i) store_from(row, i, Acc(0));
      continue;
    }
    row_grad<In, Acc>(logits + a.rows.offset(r), grad + grad_rows.offset(r), a.vocab, inv_t,
                      stats[2 * r], stats[2 * r + 1], g, label, g_ent != nullptr, h, g_ent ? entropy[r] : Acc(0));
  }
}

}  // namespace

void logprobs_forward(const LogprobsArgs& a, int64_t segment, void* out_logprob, void* out_entropy,
                      void* out_stats, void* out_sum_pi_squared) {
  FASTRL_DISPATCH_LOGITS(a.dtype, "logprobs_forward",
                         (forward_impl<In, Acc>(a, segment, {out_logprob, out_entropy, out_stats,
                                                             out_sum_pi_squared})));
}

void logprobs_segments(const LogprobsArgs& a, int64_t segment, bool with_entropy, bool with_sum_pi_squared,
                       double* out) {
  FASTRL_DISPATCH_LOGITS(a.dtype, "logprobs_segments",
                         (segments_impl<In, Acc>(a, segment, with_entropy, with_sum_pi_squared, out)));
}

void logprobs_combine(const double* segments, int64_t n_rows, int64_t n_segments, const void* label_logits,
                      const LogprobsArgs& a, void* out_logprob, void* out_entropy, void* out_stats,
                      void* out_sum_pi_squared) {
  FASTRL_DISPATCH_ACC(a.dtype, "logprobs_combine",
                      (combine_impl<Acc>(segments, n_rows, n_segments, static_cast<const Acc*>(label_logits), a,
                                         {out_logprob, out_entropy, out_stats, out_sum_pi_squared})));
}

void logprobs_backward(const LogprobsArgs& a, const void* stats, const void* entropy,
                       const void* grad_logprob, const void* grad_entropy, void* grad_out,
                       RowLayout grad_rows, int64_t label_base, int64_t label_vocab) {
  switch (a.dtype) {
    case kFloat32:
      return backward_impl<float, float>(a, stats, entropy, grad_logprob, grad_entropy, grad_out,
                                         grad_rows, label_base, label_vocab);
    case kFloat16:
      return backward_impl<F16, float>(a, stats, entropy, grad_logprob, grad_entropy, grad_out,
                                       grad_rows, label_base, label_vocab);
    case kBFloat16:
      return backward_impl<BF16, float>(a, stats, entropy, grad_logprob, grad_entropy, grad_out,
                                        grad_rows, label_base, label_vocab);
    case kFloat64:
      return backward_impl<double, double>(a, stats, entropy, grad_logprob, grad_entropy, grad_out,
                                           grad_rows, label_base, label_vocab);
    default: fail("logprobs_backward: unsupported logits dtype code " + std::to_string(a.dtype));
  }
}

}  // namespace fastrl
