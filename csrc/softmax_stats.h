// The one-read online softmax statistic of a row, shared by the CPU kernels
// (the C++ twin of kernels/reduce.py). For a row x of V logits at 1/T > 0:
//   m = max_j x_j,   d_j = (x_j - m) / T,   s = sum_j e^{d_j},   w = sum_j e^{d_j} d_j
// so that logsumexp(x / T) = m / T + log s and the entropy is log s - w / s.
// The row is read once in L1-sized chunks: each chunk's max is taken first and
// (s, w) rescaled when the max grows, then the chunk's exponentials are added.
// -inf logits add exactly nothing; a row of only -inf gives s = 0; NaN reaches s.
// Also here: each row's temperature, as every kernel on softmax rows reads it.
#pragma once

#include <algorithm>

#include "common.h"

namespace fastrl {

constexpr int64_t kStatsChunk = 2048;

// Row r's temperature: temps[r] (of the accumulation type) when per-row
// temperatures are given, else the scalar.
template <typename Acc>
Acc row_temperature(const void* temps, double temp_scalar, int64_t r) {
  return temps ? static_cast<const Acc*>(temps)[r] : static_cast<Acc>(temp_scalar);
}

// A temperature that is not a positive finite number poisons its row with NaN
// (the Python layer rejects it before this on CPU; this keeps the kernel total).
template <typename Acc>
bool usable_temperature(Acc t) {
  return t > 0 && t < std::numeric_limits<Acc>::infinity();
}

// A running max m meeting a chunk's max: raises m, and returns true with
// c = (m_old - m_new) / T when terms already summed must move to the new
// reference point (each of their exponents shifts by c, so e^d scales by e^c).
// False when the max did not grow or nothing was summed yet (m was -inf).
template <typename Acc>
FASTRL_INLINE bool raise_max(Acc& m, Acc chunk_max, Acc inv_t, Acc& c) {
  if (!(chunk_max > m)) return false;
  const bool rescale = m != neg_inf<Acc>();
  c = (m - chunk_max) * inv_t;
  m = chunk_max;
  return rescale;
}

template <typename Acc>
struct RowStats {
  Acc m, s, w;
};

template <typename In, typename Acc>
FASTRL_ISA_CLONES RowStats<Acc> row_stats(const In* x, int64_t vocab, Acc inv_t, bool want_w) {
  Acc m = neg_inf<Acc>(), s = 0, w = 0;
  Acc xs[kStatsChunk];
  for (int64_t start = 0; start < vocab; start += kStatsChunk) {
    const int64_t n = std::min(kStatsChunk, vocab - start);
    Acc chunk_max = neg_inf<Acc>();
#pragma omp simd reduction(max : chunk_max)
    for (int64_t i = 0; i < n; ++i) {
      xs[i] = load_as<Acc>(x, start + i);
      chunk_max = xs[i] > chunk_max ? xs[i] : chunk_max;
    }
    Acc c;
    if (raise_max(m, chunk_max, inv_t, c)) {
      // Move (s, w) to the new reference point: s' = a s, w' = a (w + c s), a = exp(c).
      const Acc a = std::exp(c);
      w = a * (w + c * s);
      s = a * s;
    }
    if (m == neg_inf<Acc>()) continue;  // every logit so far is -inf
    Acc chunk_s = 0, chunk_w = 0;
    if (want_w) {
#pragma omp simd reduction(+ : chunk_s, chunk_w)
      for (int64_t i = 0; i < n; ++i) {
        const Acc d = (xs[i] - m) * inv_t;
        const Acc e = exp_approx(d);
        chunk_s += e;
        chunk_w += xs[i] == neg_inf<Acc>() ? Acc(0) : e * d;
      }
    } else {
#pragma omp simd reduction(+ : chunk_s)
      for (int64_t i = 0; i < n; ++i) chunk_s += exp_approx((xs[i] - m) * inv_t);
    }
    s += chunk_s;
    w += chunk_w;
  }
  return {m, s, w};
}

}  // namespace fastrl
