// The one-read online softmax statistic of a row, shared by the CPU kernels
// (the C++ twin of kernels/reduce.py). For a row x of V logits at 1/T > 0:
//   m = max_j x_j,   d_j = (x_j - m) / T,   s = sum_j e^{d_j},   w = sum_j e^{d_j} d_j
// so that logsumexp(x / T) = m / T + log s and the entropy is log s - w / s.
// The row is read once in L1-sized chunks: each chunk's max is taken first and
// (s, w) rescaled when the max grows, then the chunk's exponentials are added.
//
// Accuracy: each e^{d_j} is a float (exp_approx, about 1 ulp), summed in float
// 8 at a time per lane (add_chunk) and then in doubles, and s is kept as
// s = n + t: n counts the terms at the max (each exactly 1), t sums the rest.
// A peaked row (one logit far above the rest) has
// a tiny t, and its entropy is about t (1 + gap): a float accumulator holding
// the 1 dropped every term below half an ulp of 1 (6e-8; the entropy at
// V = 32000, T = 1.7 came out 2e-3 off), and even a double n + t loses t to
// rounding past a gap of about 33 (1e-6 of the entropy, 2% at a gap of 45).
// So t is never added to n: log s = log n + log1p(t / n) (RowStats::log_s).
// Only chunks that reach the running max count their terms at it (a random
// row has a few such chunks); the others add every term to t.
//
// Guards test the term, not the logit: (x - m) / T overflows to -inf for a
// finite logit too (finfo.min masking at T < 1, or +-3e38 in one row), so a
// term whose e^{d_j} is 0 adds exactly 0 to w (never 0 * -inf), and a rescale
// by e^c = 0 drops the old sums outright. A NaN anywhere in the row makes s and
// w NaN (a flag per row: a chunk of only NaN has no max and adds no term).
// A row of only -inf gives s = 0.
//
// Asked for (want_q), the same read also gives q = sum e^{2 d_j} over the
// terms below the max, so that sum_j e^{2 d_j} = n + q and sum_j p_j^2 =
// (n + q) / (n + t)^2: a term at the max is exactly 1 squared too, so n is
// shared. A peaked row's sum_j p_j^2 is about 1 and its tail q tiny (below
// t^2), so q is kept apart from n for the reason t is. Each e^{d_j} is
// squared and the squares summed as the terms are (8 at a time per lane in
// float, then in doubles), in a pass of their own over each chunk (add_chunk:
// asking for q leaves n, t and w their bits); a float square below the
// normal range (e^{d_j} < 1e-19) loses bits, under 1e-38 of the n >= 1 it
// joins. When the max rises by c the tail moves by a^2 = e^{2c} (q' = a^2
// (n + q)); a = 0 drops it. A NaN in the row makes q NaN as well.
//
// Also here: each row's temperature, as every kernel on softmax rows reads it.
#pragma once

#include <algorithm>
#include <initializer_list>

#include "common.h"
#include "isa.h"

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
// c may be -inf: the max rose beyond the float range of (x - m) / T.
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
  Acc m;
  double n, t, w;  // s = n + t, see the accuracy note above
  double q;        // sum of e^{2d} below the max: sum e^{2d} = n + q (0 unless asked for)
  double s() const { return n + t; }
  // log s to the rounding of the terms: log(n + t) would lose a tiny t. A row
  // with no term at its max (all -inf: s = 0, or NaN) gives log t.
  double log_s() const { return n > 0 ? std::log(n) + std::log1p(t / n) : std::log(t); }
  // sum_j p_j^2 = (n + q) / s^2 (with q asked for). Near 1 (one term at the max,
  // a small tail) it is 1 - delta, delta = (t (2 + t) - q) / s^2 taken as such:
  // q <= t^2, so the numerator does not cancel and a tiny delta keeps its digits
  // up to the rounding of the result (the ratio would add a few ulps of 1).
  // A row of only -inf gives 0 / 0 = NaN, a NaN row NaN.
  double sum_p_squared() const {
    const double s2 = (n + t) * (n + t);
    if (n == 1) {
      const double delta = (t * (2 + t) - q) / s2;
      if (delta <= 0.25) return 1 - delta;
    }
    return (n + q) / s2;
  }
};

// Moves s = sum e^d and w = sum e^d d (or any sum of e^d times a quantity that
// grows with d by the same c) to a reference point c lower:
//   s' = a s,   w' = a (w + c s),   a = e^c.
// a = 0 (c -inf or below the exp range) leaves nothing of the old terms; it is
// tested so that 0 * -inf never appears. NaN in s stays in s.
FASTRL_INLINE void shift_sums(double c, double& s, double& w) {
  const double a = std::exp(c);
  w = a == 0 ? 0.0 : a * (w + c * s);
  s = a * s;
}

// The same for a row's stats when its max rose: the terms at the old max join
// the tail (t' = a (n + t), n' = 0), and with WITH_Q their squares the tail of
// squares (q' = a^2 (n + q), a^2 = e^{2c}: it is 0 wherever a is, and keeps
// the subnormal range of a^2 that a * a would round twice). a = 0 drops q.
template <bool WITH_Q = false, typename Acc>
FASTRL_INLINE void shift_row_stats(double c, RowStats<Acc>& st) {
  if (WITH_Q) {
    const double a2 = std::exp(2 * c);
    st.q = a2 == 0 ? 0.0 : a2 * (st.n + st.q);
  }
  double s = st.s();
  shift_sums(c, s, st.w);
  st.t = s;
  st.n = 0;
}

// The chunk sums' lanes: kLanes running sums, each adding kLaneTerms
// consecutive terms of its lane (elements j, j + kLanes, ...) in Acc before it
// joins its double lane total, and the lane totals folded in lane order at the
// end of the chunk. The lane loop is the vectorised one (16 floats are one
// AVX-512 register or two AVX2 ones), so no vector is reduced across lanes
// within the row, and every ISA adds the same terms in the same order: the
// AVX2 and AVX-512 paths give the same bits. A float lane sum of 8 terms below
// 1 is off by at most 7 ulps of itself, on top of each term's 1 ulp; the double
// sums then add nothing to that (the Triton kernels add 16 terms a tile in
// float).
constexpr int kLanes = 16;
constexpr int kLaneTerms = 8;
constexpr int64_t kLaneBlock = kLanes * kLaneTerms;
static_assert(kStatsChunk % kLaneBlock == 0, "a chunk is whole lane blocks");

// The squares e^{2d} = (e^d)^2 of one chunk's terms into q, by lanes as
// add_chunk adds the terms (COUNT: the terms at the max add 0, as to t).
template <typename Acc, bool COUNT>
FASTRL_INLINE void add_chunk_squares(const Acc* xs, int64_t n, Acc inv_t, RowStats<Acc>& st) {
  double lane_q[kLanes] = {};
  const Acc m = st.m;
  for (int64_t block = 0; block < n; block += kLaneBlock) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      Acc block_q = 0;
      for (int k = 0; k < kLaneTerms; ++k) {
        const Acc d = (xs[block + k * kLanes + j] - m) * inv_t;
        const Acc e = exp_approx(d);
        block_q += COUNT && d == 0 ? Acc(0) : e * e;
      }
      lane_q[j] += block_q;
    }
  }
  for (int j = 0; j < kLanes; ++j) st.q += lane_q[j];
}

// One chunk's terms at the running max m: adds to t (and to n the terms at
// the max when COUNT: d == 0 exactly; they would be the 1s that swallow t),
// and with WITH_Q their squares to q (add_chunk_squares).
// n is a multiple of kLaneBlock (row_stats pads with -inf, whose term is 0).
//
// The squares take a loop of their own over the chunk (in L1; a second exp per
// term), so that n, t and w keep their bits with q and q its bits with or
// without w: GCC contracts a product and a sum into an FMA or not by the code
// around them. Summed in the one loop, e * e + q was fused only where w was
// computed too (AVX2, float), and in the scalar float64 loop (a libm exp per
// term) w's e * d + w was fused in other places once q was there.
template <typename Acc, bool WITH_W, bool COUNT, bool WITH_Q = false>
FASTRL_INLINE void add_chunk(const Acc* xs, int64_t n, Acc inv_t, RowStats<Acc>& st) {
  double lane_n[kLanes] = {}, lane_t[kLanes] = {}, lane_w[kLanes] = {};
  const Acc m = st.m;
  for (int64_t block = 0; block < n; block += kLaneBlock) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      Acc block_n = 0, block_t = 0, block_w = 0;
      for (int k = 0; k < kLaneTerms; ++k) {
        const Acc d = (xs[block + k * kLanes + j] - m) * inv_t;
        const Acc e = exp_approx(d);
        if (COUNT) {
          block_n += d == 0 ? Acc(1) : Acc(0);
          block_t += d == 0 ? Acc(0) : e;
        } else {
          block_t += e;
        }
        if (WITH_W) block_w += e == 0 ? Acc(0) : e * d;  // d may be -inf where e = 0
      }
      lane_n[j] += block_n;
      lane_t[j] += block_t;
      lane_w[j] += block_w;
    }
  }
  for (int j = 0; j < kLanes; ++j) {
    st.n += lane_n[j];
    st.t += lane_t[j];
    st.w += lane_w[j];
  }
  if constexpr (WITH_Q) add_chunk_squares<Acc, COUNT>(xs, n, inv_t, st);
}

// WITH_Q: also q (RowStats::q), in an instantiation of its own, so that the
// code without it is the code that ran before q existed.
template <typename In, typename Acc, bool WITH_Q = false>
FASTRL_INLINE RowStats<Acc> row_stats_body(const In* x, int64_t vocab, Acc inv_t, bool want_w) {
  RowStats<Acc> st{neg_inf<Acc>(), 0, 0, 0, 0};
  bool nan = false;
  alignas(64) Acc xs[kStatsChunk];
  for (int64_t start = 0; start < vocab; start += kStatsChunk) {
    const int64_t n = std::min(kStatsChunk, vocab - start);
    Acc chunk_max = neg_inf<Acc>();
    int chunk_nan = 0;
#pragma omp simd reduction(max : chunk_max) reduction(| : chunk_nan)
    for (int64_t i = 0; i < n; ++i) {
      xs[i] = load_as<Acc>(x, start + i);
      chunk_max = xs[i] > chunk_max ? xs[i] : chunk_max;
      chunk_nan |= xs[i] != xs[i];
    }
    const int64_t padded = (n + kLaneBlock - 1) / kLaneBlock * kLaneBlock;
    for (int64_t i = n; i < padded; ++i) xs[i] = neg_inf<Acc>();
    nan |= chunk_nan != 0;
    Acc c;
    if (raise_max(st.m, chunk_max, inv_t, c)) shift_row_stats<WITH_Q>(c, st);
    if (st.m == neg_inf<Acc>()) continue;  // every logit so far is -inf (or NaN, flagged)
    const bool reaches_max = chunk_max == st.m;
    if (want_w) {
      reaches_max ? add_chunk<Acc, true, true, WITH_Q>(xs, padded, inv_t, st)
                  : add_chunk<Acc, true, false, WITH_Q>(xs, padded, inv_t, st);
    } else {
      reaches_max ? add_chunk<Acc, false, true, WITH_Q>(xs, padded, inv_t, st)
                  : add_chunk<Acc, false, false, WITH_Q>(xs, padded, inv_t, st);
    }
  }
  if (nan) {
    st.t = st.w = std::numeric_limits<double>::quiet_NaN();
    if (WITH_Q) st.q = st.t;
  }
  return st;
}

// want_q: also q (RowStats::q; 0 otherwise). n, t and w have the same bits
// either way.
template <typename In, typename Acc>
RowStats<Acc> row_stats(const In* x, int64_t vocab, Acc inv_t, bool want_w, bool want_q = false) {
  RowStats<Acc> st;
  if (want_q) {
    isa_dispatch([&]() FASTRL_ISA_BODY { st = row_stats_body<In, Acc, true>(x, vocab, inv_t, want_w); });
  } else {
    isa_dispatch([&]() FASTRL_ISA_BODY { st = row_stats_body<In, Acc>(x, vocab, inv_t, want_w); });
  }
  return st;
}

// The statistics of two consecutive spans of a row from each span's own, into
// st: a span at the max of both keeps its count and tails apart, the other
// moves to that max (shift_row_stats, c = (m_span - M) / T in double; a span
// with nothing finite, m = -inf, has c = -inf and adds nothing, NaN stays in t).
// From the empty span {-inf, 0, 0, 0, 0} it gives the other span bit for bit.
// Folded left to right over a row's segments (fastrl._rows.segment_length) it
// gives the same bits whether the segments were reduced here or on the ranks
// that hold them (logprobs.cpp: the tensor-parallel degree changes no bit).
template <typename Acc>
void fold_row_stats(RowStats<Acc>& st, RowStats<Acc> seg, Acc inv_t, bool want_q) {
  const Acc top = std::max(st.m, seg.m);
  for (RowStats<Acc>* span : {&st, &seg}) {
    if (!(span->m < top)) continue;
    const double c = (static_cast<double>(span->m) - static_cast<double>(top)) * static_cast<double>(inv_t);
    want_q ? shift_row_stats<true>(c, *span) : shift_row_stats<false>(c, *span);
  }
  st.m = top;
  st.n += seg.n;
  st.t += seg.t;
  st.w += seg.w;
  st.q += seg.q;
}

// row_stats of a row of `vocab` logits reduced as segments of `segment`
// (a divisor of vocab; fastrl._rows.segment_length), folded left to right.
template <typename In, typename Acc>
RowStats<Acc> segmented_row_stats(const In* x, int64_t vocab, int64_t segment, Acc inv_t, bool want_w,
                                  bool want_q) {
  RowStats<Acc> st{neg_inf<Acc>(), 0, 0, 0, 0};
  for (int64_t start = 0; start < vocab; start += segment) {
    fold_row_stats(st, row_stats<In, Acc>(x + start, segment, inv_t, want_w, want_q), inv_t, want_q);
  }
  return st;
}

}  // namespace fastrl
