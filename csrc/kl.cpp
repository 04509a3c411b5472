// KL between the policy and a reference policy, CPU kernels.
//
// kl_penalty: the sampled-token estimators of kl.h (kl_estimate), elementwise.
//
// full_kl: the exact KL(p || q) per row, p = softmax(x / T), q = softmax(y / T),
// for logits x and reference logits y at inv_t = 1/T > 0:
//   m = max_v x_v,  d_v = (x_v - m) inv_t,  e_v = exp(d_v),  s = sum_v e_v
//   m' = max_v y_v, d'_v = (y_v - m') inv_t,                s' = sum_v exp(d'_v)
//   t = sum_v e_v ((x_v - m) - (y_v - m'))         (in logit units, not over T)
//   KL = sum_v p_v (log p_v - log q_v) = inv_t t / s - log s + log s'
// (log p_v = d_v - log s, log q_v = d'_v - log s'). A term with e_v = 0 adds
// nothing, also where y_v = -inf (no 0 * inf); e_v > 0 where y_v = -inf makes
// the KL +inf, as it should. Taking the differences on the raw logits keeps
// the KL of two close distributions free of the cancellation of two entropies,
// and leaving inv_t out of t until the end keeps a reference masked with
// finfo.min finite at T < 1: (y_v - m') inv_t overflows to -inf there although
// the KL (e.g. 5e37 at T = 0.3) is a float.
//
// The forward reads each row once in L1-sized chunks, online as row_stats
// (softmax_stats.h) does. When a chunk raises the logits' max m to M, every d_v
// so far grows by c = (m - M) inv_t and every e_v is scaled by a = exp(c), while
// x_v - m grows by m - M:
//   s <- a s,   t <- a (t + (m - M) s)
// When it raises the reference max m' to M', every d'_v grows by c' = (m' - M') inv_t:
//   s' <- exp(c') s',   t <- t - (m' - M') s
// (c may be -inf when a max rises beyond the float range, which leaves nothing
// of the old terms, and s, s', t are summed in double for the accuracy
// softmax_stats.h explains.)
// While a running max is still -inf every value so far is -inf: there is
// nothing to rescale, and the chunk is measured from 0 instead (d = -inf, not
// -inf - -inf = NaN).
//
// Backward (the reference logits are constants), with g = dL/dKL of the row:
//   dKL/dx_j = inv_t p_j (log p_j - log q_j - KL),   0 where p_j = 0
//            = inv_t (inv_t (p_j r_j) - p_j (KL + log s - log s')),  r_j = (x_j - m) - (y_j - m')
// in that order, so that a gradient that is a float is one even where the
// finfo.min-masked reference has (y_j - m') inv_t = -inf (p_j r_j <= 3.4e38).
// One read of each row and one write of the gradient, which may alias the
// logits: each element is read before it is written.
//
// Each row is reduced by one thread in a fixed order, so results are bitwise
// reproducible and independent of the other rows in the batch.
#include "kl.h"

#include <algorithm>

#include "common.h"
#include "isa.h"
#include "softmax_stats.h"

namespace fastrl {
namespace {

// kl_penalty works on spans of this many tokens, one span per OpenMP task.
constexpr int64_t kSpan = 4096;

// The estimator (and straight_through) are template arguments, so that the
// element loops vectorise (kl_estimate).
template <typename Acc, int ESTIMATOR>
FASTRL_INLINE void kl_penalty_span_body(const Acc* logp, const Acc* ref, int64_t n, Acc* out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = kl_estimate<ESTIMATOR, false>(logp[i] - ref[i]).value;
}

template <typename Acc, int ESTIMATOR, bool STRAIGHT_THROUGH>
FASTRL_INLINE void kl_penalty_grad_span_body(const Acc* logp, const Acc* ref, const Acc* grad, int64_t n,
                                             Acc* grad_logp) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    grad_logp[i] = grad[i] * kl_estimate<ESTIMATOR, STRAIGHT_THROUGH>(logp[i] - ref[i]).grad;
}

// A trampoline set per estimator (isa.h; as policy.cpp's row kernels).
template <typename Acc, int ESTIMATOR>
void kl_penalty_span_at(const Acc* logp, const Acc* ref, int64_t n, Acc* out) {
  isa_dispatch([&]() FASTRL_ISA_BODY { kl_penalty_span_body<Acc, ESTIMATOR>(logp, ref, n, out); });
}

template <typename Acc, int ESTIMATOR, bool STRAIGHT_THROUGH>
void kl_penalty_grad_span_at(const Acc* logp, const Acc* ref, const Acc* grad, int64_t n, Acc* grad_logp) {
  isa_dispatch([&]() FASTRL_ISA_BODY {
    kl_penalty_grad_span_body<Acc, ESTIMATOR, STRAIGHT_THROUGH>(logp, ref, grad, n, grad_logp);
  });
}

template <typename Acc>
void kl_penalty_span(const Acc* logp, const Acc* ref, int64_t n, int estimator, Acc* out) {
  FASTRL_WITH_ESTIMATOR(estimator, kl_penalty_span_at, , (logp, ref, n, out))
}

template <typename Acc>
void kl_penalty_grad_span(const Acc* logp, const Acc* ref, const Acc* grad, int64_t n, int estimator,
                          bool straight_through, Acc* grad_logp) {
  if (straight_through) {
    FASTRL_WITH_ESTIMATOR(estimator, kl_penalty_grad_span_at, FASTRL_COMMA true, (logp, ref, grad, n, grad_logp))
  } else {
    FASTRL_WITH_ESTIMATOR(estimator, kl_penalty_grad_span_at, FASTRL_COMMA false, (logp, ref, grad, n, grad_logp))
  }
}

template <typename Acc>
void kl_penalty_forward_impl(const Acc* logp, const Acc* ref, int64_t n, int estimator, Acc* out) {
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t start = 0; start < n; start += kSpan) {
    kl_penalty_span<Acc>(logp + start, ref + start, std::min(kSpan, n - start), estimator, out + start);
  }
}

template <typename Acc>
void kl_penalty_backward_impl(const Acc* logp, const Acc* ref, const Acc* grad, int64_t n, int estimator,
                              bool straight_through, Acc* grad_logp) {
#pragma omp parallel for schedule(static) if (n > 32768)
  for (int64_t start = 0; start < n; start += kSpan) {
    kl_penalty_grad_span<Acc>(logp + start, ref + start, grad + start, std::min(kSpan, n - start),
                              estimator, straight_through, grad_logp + start);
  }
}

template <typename Acc>
struct KLRowStats {
  Acc m, m_ref;
  double s, s_ref, t;  // summed in double, as row_stats does (softmax_stats.h)
};

template <typename In, typename Acc>
FASTRL_INLINE KLRowStats<Acc> full_kl_row_body(const In* x, const In* y, int64_t vocab, Acc inv_t) {
  Acc m = neg_inf<Acc>(), m_ref = neg_inf<Acc>();
  double s = 0, s_ref = 0, t = 0;
  Acc xs[kStatsChunk], ys[kStatsChunk];
  for (int64_t start = 0; start < vocab; start += kStatsChunk) {
    const int64_t n = std::min(kStatsChunk, vocab - start);
    Acc chunk_max = neg_inf<Acc>(), chunk_max_ref = neg_inf<Acc>();
#pragma omp simd reduction(max : chunk_max, chunk_max_ref)
    for (int64_t i = 0; i < n; ++i) {
      xs[i] = load_as<Acc>(x, start + i);
      ys[i] = load_as<Acc>(y, start + i);
      chunk_max = xs[i] > chunk_max ? xs[i] : chunk_max;
      chunk_max_ref = ys[i] > chunk_max_ref ? ys[i] : chunk_max_ref;
    }
    Acc c;
    const Acc m_old = m, m_ref_old = m_ref;
    if (raise_max(m, chunk_max, inv_t, c)) {  // every d_v grows by c, every x_v - m by m_old - m
      const double a = std::exp(double(c));
      t = a == 0 ? 0.0 : a * (t + double(m_old - m) * s);
      s = a * s;
    }
    if (raise_max(m_ref, chunk_max_ref, inv_t, c)) {  // every d'_v grows by c
      s_ref = std::exp(double(c)) * s_ref;
      if (s != 0) t -= double(m_ref_old - m_ref) * s;  // may be -inf; s = 0 means no term yet
    }
    const Acc origin = m == neg_inf<Acc>() ? Acc(0) : m;
    const Acc origin_ref = m_ref == neg_inf<Acc>() ? Acc(0) : m_ref;
    double chunk_s = 0, chunk_s_ref = 0, chunk_t = 0;
#pragma omp simd reduction(+ : chunk_s, chunk_s_ref, chunk_t)
    for (int64_t i = 0; i < n; ++i) {
      const Acc dx = xs[i] - origin, dy = ys[i] - origin_ref;
      const Acc e = exp_approx(dx * inv_t);
      chunk_s += e;
      chunk_s_ref += exp_approx(dy * inv_t);
      chunk_t += e == 0 ? Acc(0) : e * (dx - dy);
    }
    s += chunk_s;
    s_ref += chunk_s_ref;
    t += chunk_t;
  }
  return {m, m_ref, s, s_ref, t};
}

template <typename In, typename Acc>
KLRowStats<Acc> full_kl_row(const In* x, const In* y, int64_t vocab, Acc inv_t) {
  KLRowStats<Acc> out;
  isa_dispatch([&]() FASTRL_ISA_BODY { out = full_kl_row_body<In, Acc>(x, y, vocab, inv_t); });
  return out;
}

template <typename In, typename Acc>
FASTRL_INLINE void full_kl_row_grad_body(const In* x, const In* y, In* grad, int64_t vocab, Acc inv_t,
                                         Acc m, Acc log_s, Acc m_ref, Acc log_s_ref, Acc kl, Acc g) {
  const Acc scale = g * inv_t, offset = kl + log_s - log_s_ref;
  // Through an L1 buffer, as row_grad. r goes there first: read in the loop
  // that needs it only where p > 0, the reference row's load became a
  // conditional one, which AVX2 (for bf16) and SSE2 cannot vectorise.
  Acc buf[kStatsChunk];
  for (int64_t start = 0; start < vocab; start += kStatsChunk) {
    const int64_t n = std::min(kStatsChunk, vocab - start);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) buf[i] = (load_as<Acc>(x, start + i) - m) - (load_as<Acc>(y, start + i) - m_ref);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const Acc p = exp_approx((load_as<Acc>(x, start + i) - m) * inv_t - log_s);
      const Acc term = scale * (inv_t * (p * buf[i]) - p * offset);
      buf[i] = p == 0 ? Acc(0) : term;  // r may be inf or NaN where p = 0
    }
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) store_from(grad, start + i, buf[i]);
  }
}

template <typename In, typename Acc>
void full_kl_row_grad(const In* x, const In* y, In* grad, int64_t vocab, Acc inv_t, Acc m, Acc log_s, Acc m_ref,
                      Acc log_s_ref, Acc kl, Acc g) {
  isa_dispatch([&]() FASTRL_ISA_BODY {
    full_kl_row_grad_body<In, Acc>(x, y, grad, vocab, inv_t, m, log_s, m_ref, log_s_ref, kl, g);
  });
}

template <typename In, typename Acc>
void full_kl_forward_impl(const FullKLArgs& a, Acc* kl, Acc* stats) {
  const In* logits = static_cast<const In*>(a.logits);
  const In* ref_logits = static_cast<const In*>(a.ref_logits);
#pragma omp parallel for schedule(static) if (a.n_rows * a.vocab > 32768)
  for (int64_t r = 0; r < a.n_rows; ++r) {
    const Acc temp = row_temperature<Acc>(a.temps, a.temp_scalar, r);
    if (!usable_temperature(temp)) {
      kl[r] = quiet_nan<Acc>();
      if (stats) std::fill(stats + 4 * r, stats + 4 * r + 4, quiet_nan<Acc>());
      continue;
    }
    const KLRowStats<Acc> st = full_kl_row<In, Acc>(logits + a.rows.offset(r),
                                                    ref_logits + a.ref_rows.offset(r), a.vocab,
                                                    Acc(1) / temp);
    const double log_s = std::log(st.s), log_s_ref = std::log(st.s_ref);
    kl[r] = static_cast<Acc>(double(Acc(1) / temp) * st.t / st.s - log_s + log_s_ref);
    if (stats) {
      stats[4 * r] = st.m;
      stats[4 * r + 1] = log_s;
      stats[4 * r + 2] = st.m_ref;
      stats[4 * r + 3] = log_s_ref;
    }
  }
}

template <typename In, typename Acc>
void full_kl_backward_impl(const FullKLArgs& a, const Acc* stats, const Acc* kl, const Acc* grad_kl,
                           In* grad_out, RowLayout grad_rows) {
  const In* logits = static_cast<const In*>(a.logits);
  const In* ref_logits = static_cast<const In*>(a.ref_logits);
#pragma omp parallel for schedule(static) if (a.n_rows * a.vocab > 32768)
  for (int64_t r = 0; r < a.n_rows; ++r) {
    const Acc temp = row_temperature<Acc>(a.temps, a.temp_scalar, r);
    const Acc inv_t = usable_temperature(temp) ? Acc(1) / temp : quiet_nan<Acc>();
    full_kl_row_grad<In, Acc>(logits + a.rows.offset(r), ref_logits + a.ref_rows.offset(r),
                              grad_out + grad_rows.offset(r), a.vocab, inv_t, stats[4 * r],
                              stats[4 * r + 1], stats[4 * r + 2], stats[4 * r + 3], kl[r], grad_kl[r]);
  }
}

}  // namespace

void kl_penalty_forward(const void* log_probs, const void* ref_log_probs, int dtype, int64_t n,
                        int estimator, void* out) {
  FASTRL_DISPATCH_ACC(dtype, "kl_penalty_forward",
                      (kl_penalty_forward_impl<Acc>(static_cast<const Acc*>(log_probs),
                                                    static_cast<const Acc*>(ref_log_probs), n,
                                                    estimator, static_cast<Acc*>(out))))
}

void kl_penalty_backward(const void* log_probs, const void* ref_log_probs, const void* grad, int dtype,
                         int64_t n, int estimator, bool straight_through, void* grad_logp) {
  FASTRL_DISPATCH_ACC(dtype, "kl_penalty_backward",
                      (kl_penalty_backward_impl<Acc>(static_cast<const Acc*>(log_probs),
                                                     static_cast<const Acc*>(ref_log_probs),
                                                     static_cast<const Acc*>(grad), n, estimator,
                                                     straight_through, static_cast<Acc*>(grad_logp))))
}

void full_kl_forward(const FullKLArgs& a, void* out_kl, void* out_stats) {
  FASTRL_DISPATCH_LOGITS(a.dtype, "full_kl_forward",
                         (full_kl_forward_impl<In, Acc>(a, static_cast<Acc*>(out_kl),
                                                        static_cast<Acc*>(out_stats))))
}

void full_kl_backward(const FullKLArgs& a, const void* stats, const void* kl, const void* grad_kl,
                      void* grad_out, RowLayout grad_rows) {
  FASTRL_DISPATCH_LOGITS(a.dtype, "full_kl_backward",
                         (full_kl_backward_impl<In, Acc>(a, static_cast<const Acc*>(stats),
                                                         static_cast<const Acc*>(kl),
                                                         static_cast<const Acc*>(grad_kl),
                                                         static_cast<In*>(grad_out), grad_rows)))
}

}  // namespace fastrl
