// Sampling with log-probs and truncated log-probs, CPU kernels.
//
// Every filter of the processed distribution keeps the tokens at or above a
// threshold logit (fastrl/reference.py, truncated_log_distribution), so a row
// is handled without sorting, on a shrinking list of candidate tokens:
//   1. the row's max m (a greedy row then only scans for its first argmax), and
//      s = sum_j e_j, e_j = exp((x_j - m) / T), exactly, in two vectorised reads;
//   2. the candidates, in one read that also finds the first argmax and any
//      NaN (a row with NaN or +inf, or of only -inf, is bad: token -1): every
//      token, or for top-k only the tokens whose order-preserving key has its
//      top 11 bits at or above a pivot bucket estimated from every 16th token
//      (a few times k tokens; the exact histogram when that gathers fewer
//      than k); a radix select, 8 bits per pass, finds the k-th largest key
//      among them, and the candidates shrink to key >= it;
//   3. top-p: the same descent with each bucket weighted by its mass in fixed
//      point, for the largest logit whose mass at or above reaches p * (mass
//      of the candidates);
//   4. min-p: candidates with (x_j - m) / T >= log(min_p);
//   5. over the kept candidates: their mass s_kept, and the exponential race
//      argmax_j (x_j - m) / T - log E_j with E_j ~ Exp(1) from Philox, which picks
//      j with probability e_j / s_kept.
// Each row is handled by one thread in a fixed order: deterministic, and
// independent of the other rows. Every mass is an exact sum (ExactMass, and
// top-p's integer units), the same in any order: a row split over vocabulary
// shards (sample_shard_pass, fastrl/_sharded/sampling.py) gives these bits.
#include "sampling.h"

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common.h"
#include "philox.h"
#include "softmax_stats.h"

namespace fastrl {
namespace {

// Order-preserving integer keys: key(a) < key(b) iff a < b for non-NaN a, b
// (-0.0 and +0.0 map to the same key, so they tie as equal logits do).
FASTRL_INLINE uint32_t order_key(float v) {
  uint32_t u = float_to_bits(v + 0.0f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
FASTRL_INLINE uint64_t order_key(double v) {
  uint64_t u;
  v += 0.0;
  std::memcpy(&u, &v, sizeof u);
  return (u >> 63) ? ~u : (u | (uint64_t(1) << 63));
}
template <typename Acc>
using KeyOf = std::conditional_t<sizeof(Acc) == 8, uint64_t, uint32_t>;

// The logit whose key is `key` (order_key's inverse).
template <typename Acc>
Acc key_to_value(KeyOf<Acc> key) {
  constexpr KeyOf<Acc> top = KeyOf<Acc>(1) << (sizeof(Acc) * 8 - 1);
  const KeyOf<Acc> bits = (key & top) ? (key & ~top) : ~key;
  Acc value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// Candidate tokens of a row: their keys, indices and (once known) weights e_j.
// Filters shrink the list in place, keeping the order of the row. One set of
// buffers per thread lives across calls (grown, never shrunk), so a call pays
// no allocation or page faults for them.
template <typename Acc>
struct Candidates {
  std::vector<KeyOf<Acc>> keys, key_scratch;
  std::vector<int64_t> index;
  std::vector<Acc> weight;
  std::vector<Acc> terms;  // e_j of every token of the row (row_mass), which the weights gather
  std::vector<int64_t> units, unit_scratch;  // top-p's masses (top_p_units)
  int64_t n = 0;

  static Candidates& for_this_thread(int64_t vocab) {
    static thread_local Candidates c;
    if (int64_t(c.keys.size()) < vocab) {
      for (auto* v : {&c.keys, &c.key_scratch}) v->resize(vocab);
      for (auto* v : {&c.index, &c.units, &c.unit_scratch}) v->resize(vocab);
      for (auto* v : {&c.weight, &c.terms}) v->resize(vocab);
    }
    return c;
  }

  template <typename Keep>
  void filter(Keep keep) {  // keep(j) -> bool for candidate j
    int64_t out = 0;
    for (int64_t j = 0; j < n; ++j) {
      if (!keep(j)) continue;
      keys[out] = keys[j];
      index[out] = index[j];
      weight[out] = weight[j];
      ++out;
    }
    n = out;
  }
};

// Top-k's first pass histograms the keys' top bits: 2^11 buckets (8 KiB of
// counters) split each binade of float logits into 8, so the buckets at and
// above the k-th largest hold few tokens beyond the k.
constexpr int kTopDigitBits = 11;
constexpr int64_t kTopBuckets = int64_t(1) << kTopDigitBits;
template <typename Key>
constexpr int kTopDigitShift = int(sizeof(Key)) * 8 - kTopDigitBits;

// The k-th largest of n keys (1 <= k <= n), most significant digit first: at
// each digit keep the bucket in which the k-th largest lies, counting down from
// the top, and carry only that bucket's keys (in `scratch`) to the next digit.
template <typename Key>
Key kth_largest_key(const Key* keys, int64_t n, int64_t k, Key* scratch) {
  Key prefix = 0;
  int64_t need = k;
  const Key* cur = keys;
  for (int shift = int(sizeof(Key)) * 8 - 8; shift >= 0; shift -= 8) {
    int64_t hist[256] = {};
    for (int64_t i = 0; i < n; ++i) ++hist[(cur[i] >> shift) & 0xff];
    int b = 255;
    for (; b > 0; --b) {
      if (hist[b] >= need) break;
      need -= hist[b];
    }
    prefix |= Key(b) << shift;
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i)
      if (int((cur[i] >> shift) & 0xff) == b) scratch[kept++] = cur[i];
    cur = scratch;
    n = kept;
  }
  return prefix;
}

// The largest key u with mass(keys >= u) >= target among n keys weighted by
// mass units (the smallest key when rounding leaves every mass below the
// target): at each digit, walk the buckets from the top adding their units until
// the bucket that reaches the target, where the boundary lies, and carry only its
// keys to the next digit. The units are integers, so every sum is exact and the
// key is the tensor-parallel search's over the same units (fastrl/_sharded/sampling.py,
// _top_p_threshold), which compares the same int64 sums, as float64, with the same target.
template <typename Key>
Key mass_threshold_key(const Key* keys, const int64_t* units, int64_t n, double target, Key* scratch_keys,
                       int64_t* scratch_units) {
  Key prefix = 0;
  int64_t above = 0;  // units strictly above the current bucket
  const Key* cur = keys;
  const int64_t* w = units;
  for (int shift = int(sizeof(Key)) * 8 - 8; shift >= 0; shift -= 8) {
    int64_t hist[256] = {};
    bool present[256] = {};
    for (int64_t i = 0; i < n; ++i) {
      const int b = (cur[i] >> shift) & 0xff;
      hist[b] += w[i];
      present[b] = true;
    }
    int chosen = -1, lowest = -1;
    for (int b = 255; b >= 0; --b) {
      if (!present[b]) continue;
      lowest = b;
      if (double(above + hist[b]) >= target) {
        chosen = b;
        break;
      }
      above += hist[b];
    }
    if (chosen < 0) {  // target not reached: keep down to the lowest present value
      chosen = lowest;
      above -= hist[lowest];
    }
    prefix |= Key(chosen) << shift;
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (int((cur[i] >> shift) & 0xff) != chosen) continue;
      scratch_keys[kept] = cur[i];
      scratch_units[kept] = w[i];
      ++kept;
    }
    cur = scratch_keys;
    w = scratch_units;
    n = kept;
  }
  return prefix;
}

// Top-p's fixed point: a token's mass e = exp((x - m) / T) in [0, 1] as
// round(e * unit_scale), unit_scale = 2^(62 - bits of V), so that V of them sum
// below 2^63 (fastrl/_sharded/sampling.py, _mass_units; the clamp keeps a bad
// row, which the caller ignores, from overflowing). Exact sums in any order: the
// top-p threshold of a row is the same whole and over any split of its vocabulary.
FASTRL_INLINE double top_p_unit_scale(int64_t vocab) {
  int bits = 0;
  while (bits < 63 && (int64_t(1) << bits) <= vocab) ++bits;
  return std::ldexp(1.0, 62 - bits);
}
template <typename Acc>
FASTRL_INLINE int64_t top_p_units(Acc e, double unit_scale) {
  return int64_t(double(std::min(e, Acc(1))) * unit_scale + 0.5);
}

FASTRL_INLINE uint64_t double_to_bits(double v) {
  uint64_t u;
  std::memcpy(&u, &v, sizeof u);
  return u;
}

// A sum of masses held exactly: s = sum e_j, s_kept, u = sum e_j (-d_j) (each term in
// [0, 1]). Each term is split into two fixed-point limbs, its nearest multiple of
// 2^-32 and the rest to the nearest 2^-64, and the limbs are summed as int64: an
// integer sum is the same in any order and over any split of the row, so a
// vocabulary shard's sums, added over the ranks, are the whole row's to the bit
// (issue 39: the tensor-parallel degree changes no bit). A term is held to 2^-65
// (a float64 sum of terms >= 1 rounds each add by 2^-53 of the sum); V < 2^31
// terms cannot overflow a limb. The nearest integers come from the 2^52 shifters,
// with no conversion instruction, so that a row loop vectorises; every product
// is by a power of two, exact, so contracting one into a multiply-add changes no bit.
struct ExactMass {
  int64_t hi = 0, lo = 0;
  FASTRL_INLINE void add(double v) {
    constexpr double whole = 0x1p52, either_sign = 0x1.8p52;  // the shifters
    const double scaled = v * 0x1p32;
    const double rounded = scaled + whole;  // scaled's nearest integer, in the low mantissa bits
    hi += int64_t(double_to_bits(rounded) - double_to_bits(whole));
    const double rest = scaled - (rounded - whole);  // exact: |rest| <= 1/2
    lo += int64_t(double_to_bits(rest * 0x1p32 + either_sign) - double_to_bits(either_sign));
  }
  // The sum minus 1, for log1p: every set these sum holds its max (e = 1), and
  // log1p keeps the digits of a tail far below 1 that log(1 + tail) would round away.
  double above_one() const { return double(hi - (int64_t(1) << 32)) * 0x1p-32 + double(lo) * 0x1p-64; }
  double value() const { return double(hi) * 0x1p-32 + double(lo) * 0x1p-64; }
};

// (log s, log s_kept, entropy) of a row from its exact masses; the entropy of q_j
// = e_j / s_kept is -sum q_j log q_j = log s_kept + u / s_kept. The one formula of
// the unsharded kernels and the tensor-parallel combine (sample_mass_logs).
struct MassLogs {
  double log_s, log_s_kept, entropy;
};
FASTRL_INLINE MassLogs mass_logs(const ExactMass& s, const ExactMass& kept, const ExactMass& spread) {
  const double log_s_kept = std::log1p(kept.above_one());
  return {std::log1p(s.above_one()), log_s_kept, log_s_kept + spread.value() / kept.value()};
}

// The mass of a greedy row: its number of maxima (raw log-prob -log of it).
FASTRL_INLINE ExactMass count_mass(int64_t n) {
  ExactMass c;
  c.hi = n << 32;
  return c;
}

template <typename Acc>
struct RowParams {
  Acc t, top_p, min_p;
  int64_t top_k;
  // T is 0 (greedy) or positive with a finite 1/T: the kernels scale by 1/T,
  // and an infinite one would turn the max's (x - m) / T = 0 * inf into NaN.
  bool valid() const {
    constexpr Acc inf = std::numeric_limits<Acc>::infinity();
    const bool t_ok = t == 0 || (t > 0 && t < inf && Acc(1) / t < inf);
    return t_ok && top_k >= 0 && top_p > 0 && top_p <= 1 && min_p >= 0 && min_p <= 1;
  }
};

template <typename Acc>
RowParams<Acc> row_params(const TruncationArgs& a, int64_t r) {
  return {a.temps ? static_cast<const Acc*>(a.temps)[r] : static_cast<Acc>(a.temp_scalar),
          a.top_p ? static_cast<const Acc*>(a.top_p)[r] : static_cast<Acc>(a.top_p_scalar),
          a.min_p ? static_cast<const Acc*>(a.min_p)[r] : static_cast<Acc>(a.min_p_scalar),
          a.top_k ? a.top_k[r] : a.top_k_scalar};
}

// Everything the three entry points need to know about one row. After
// select_row, the candidates are exactly the kept tokens. A bad row (all -inf,
// a NaN or +inf logit, or an invalid parameter) has nothing to sample.
template <typename Acc>
struct Selection {
  bool bad = false, greedy = false;
  int64_t argmax = -1, n_max = 0;
  Acc m = 0, inv_t = 0, log_s = 0, log_s_kept = 0, log_min_p = 0;
  // The processed distribution's entropy, -sum_kept q log q (0 for a greedy row).
  Acc entropy = 0;
  KeyOf<Acc> threshold = 0;  // kept: key >= threshold and (x - m) / T >= log_min_p
};

// Top-k's pivot: the highest top-digit bucket such that the buckets from it up
// hold at least `need` of the counted tokens (every token when stride is 1, or
// every stride-th), or 0 when none does.
template <typename Acc, typename In>
int64_t top_k_bucket(const In* x, int64_t vocab, int64_t stride, int64_t need) {
  using Key = KeyOf<Acc>;
  int32_t hist[kTopBuckets] = {};
  for (int64_t i = 0; i < vocab; i += stride) ++hist[order_key(load_as<Acc>(x, i)) >> kTopDigitShift<Key>];
  int64_t above = 0;
  for (int64_t b = kTopBuckets - 1; b > 0; --b) {
    above += hist[b];
    if (above >= need) return b;
  }
  return 0;
}

// The pivot from every 16th token: the sample holds about k / 16 tokens above
// the k-th largest, so asking for four standard deviations (and 2) more makes
// the gathered buckets hold at least k tokens unless the row's order is
// adversarial to the stride; then select_row counts every token (stride 1).
template <typename Acc, typename In>
int64_t sampled_top_k_bucket(const In* x, int64_t vocab, int64_t k) {
  constexpr int64_t stride = 16;
  const double expected = double(k) / stride;
  return top_k_bucket<Acc>(x, vocab, stride, int64_t(std::ceil(expected + 4 * std::sqrt(expected))) + 2);
}

// Ends a row's full read (find_maxima or gather_candidates): a NaN logit, or
// a max that no token equals, leaves nothing to sample. The verdict is this
// file's own (it does not rest on how the max pass treats NaN), and it keeps an
// argmax of -1 from ever indexing the row.
template <typename Acc>
void mark_unsampleable(Selection<Acc>& sel, bool has_nan) {
  sel.bad = has_nan || sel.argmax < 0;
}

// The first argmax and the number of maxima of a row whose max is m.
template <typename In, typename Acc>
void find_maxima(const In* x, int64_t vocab, Acc m, Selection<Acc>& sel) {
  sel.argmax = -1;
  sel.n_max = 0;
  bool has_nan = false;
  for (int64_t i = 0; i < vocab; ++i) {
    const Acc v = load_as<Acc>(x, i);
    has_nan |= v != v;
    if (v == m) {
      if (sel.argmax < 0) sel.argmax = i;
      ++sel.n_max;
    }
  }
  mark_unsampleable(sel, has_nan);
}

// The candidates: the tokens whose key's top digit is >= `lowest`, in row
// order; and the first argmax and the number of maxima (all candidates, as the
// max's bucket is never below `lowest`).
template <typename In, typename Acc>
void gather_candidates(const In* x, int64_t vocab, int64_t lowest, Acc m, Selection<Acc>& sel,
                       Candidates<Acc>& cand) {
  using Key = KeyOf<Acc>;
  cand.n = 0;
  if (lowest == 0) {  // every token: a branch-free fill the compiler vectorises, then the maxima
    for (int64_t i = 0; i < vocab; ++i) {
      cand.keys[i] = order_key(load_as<Acc>(x, i));
      cand.index[i] = i;
    }
    cand.n = vocab;
    find_maxima(x, vocab, m, sel);
    return;
  }
  sel.argmax = -1;
  sel.n_max = 0;
  bool has_nan = false;
  for (int64_t i = 0; i < vocab; ++i) {
    const Acc v = load_as<Acc>(x, i);
    has_nan |= v != v;
    const Key key = order_key(v);
    if (int64_t(key >> kTopDigitShift<Key>) < lowest) continue;
    cand.keys[cand.n] = key;
    cand.index[cand.n] = i;
    ++cand.n;
    if (v == m) {
      if (sel.argmax < 0) sel.argmax = i;
      ++sel.n_max;
    }
  }
  mark_unsampleable(sel, has_nan);
}

// A kept token's term of u = sum_j e_j (-d_j), e_j = exp(d_j): 0 where e_j is
// (a -inf logit kept when nothing filters, d = -inf: never 0 * inf).
template <typename Acc>
FASTRL_INLINE double kept_spread(Acc e, Acc d) {
  return e > 0 ? -double(e) * double(d) : 0.0;
}

// The row's max, NaN aside (select_row's full read finds NaN), in a simd loop:
// a max is exact in any order.
template <typename In, typename Acc>
Acc row_max(const In* x, int64_t vocab) {
  Acc m = neg_inf<Acc>();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < vocab; ++i) {
    const Acc v = load_as<Acc>(x, i);
    m = v > m ? v : m;
  }
  return m;
}

// The row's exact mass s = sum_j e_j, e_j = exp((x_j - m) / T), a chunk at a time:
// the terms (kept in `terms` [vocab], the candidates' weights) in a simd loop,
// then their ExactMass limbs in one (int64 sums: the same bits in any order).
// Like all of this file's own code it runs at the baseline ISA, never in an isa.h
// trampoline: the baseline has no multiply-add, so no product and sum are fused,
// and each e_j has the same bits here and in sample_shard_pass, which the exact
// sums need (the AVX2 and AVX-512 trampolines contract the exp polynomial into FMAs).
template <typename In, typename Acc>
ExactMass row_mass(const In* x, int64_t vocab, Acc m, Acc inv_t, Acc* terms) {
  int64_t hi = 0, lo = 0;
  for (int64_t start = 0; start < vocab; start += kStatsChunk) {
    const int64_t n = std::min(kStatsChunk, vocab - start);
    Acc* chunk = terms + start;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) chunk[i] = exp_approx((load_as<Acc>(x, start + i) - m) * inv_t);
#pragma omp simd reduction(+ : hi, lo)
    for (int64_t i = 0; i < n; ++i) {
      ExactMass term;
      term.add(double(chunk[i]));
      hi += term.hi;
      lo += term.lo;
    }
  }
  return {hi, lo};
}

template <typename In, typename Acc>
Selection<Acc> select_row(const In* x, int64_t vocab, const RowParams<Acc>& prm, Candidates<Acc>& cand) {
  using Key = KeyOf<Acc>;
  Selection<Acc> sel;
  sel.greedy = prm.t == 0;
  sel.inv_t = prm.t > 0 ? Acc(1) / prm.t : Acc(1);
  sel.m = row_max<In, Acc>(x, vocab);
  // A row of only -inf has m = -inf, one with +inf m = +inf (where softmax is
  // NaN); NaN is looked for in the full read that follows.
  sel.bad = !(sel.m > neg_inf<Acc>() && sel.m < std::numeric_limits<Acc>::infinity()) || !prm.valid();
  if (sel.bad) return sel;
  if (sel.greedy) {  // T -> 0: only the first argmax and the number of maxima
    find_maxima(x, vocab, sel.m, sel);
    sel.log_s = static_cast<Acc>(mass_logs(count_mass(sel.n_max), {}, {}).log_s);
    return sel;
  }
  const ExactMass s = row_mass<In, Acc>(x, vocab, sel.m, sel.inv_t, cand.terms.data());

  // The candidates: every token, or for top-k the tokens of the top-digit
  // buckets from `lowest` up, which must hold at least k of them (then the
  // k-th largest is among them). The pivot bucket comes from a strided sample;
  // when the sample misleads (fewer than k gathered), from the exact histogram.
  const bool top_k = prm.top_k > 0 && prm.top_k < vocab;
  int64_t lowest = 0;
  if (top_k) lowest = sampled_top_k_bucket<Acc>(x, vocab, prm.top_k);
  gather_candidates(x, vocab, lowest, sel.m, sel, cand);
  if (top_k && cand.n < prm.top_k)
    gather_candidates(x, vocab, top_k_bucket<Acc>(x, vocab, 1, prm.top_k), sel.m, sel, cand);
  if (sel.bad) return sel;
  Key threshold = order_key(neg_inf<Acc>());  // keeps every non-NaN logit
  if (top_k) {
    threshold = kth_largest_key(cand.keys.data(), cand.n, prm.top_k, cand.key_scratch.data());
    cand.filter([&](int64_t j) { return cand.keys[j] >= threshold; });
  }
  for (int64_t j = 0; j < cand.n; ++j) cand.weight[j] = cand.terms[cand.index[j]];
  if (prm.top_p < 1) {
    const double unit_scale = top_p_unit_scale(vocab);
    int64_t mass = 0;
    for (int64_t j = 0; j < cand.n; ++j) {
      cand.units[j] = top_p_units(cand.weight[j], unit_scale);
      mass += cand.units[j];
    }
    threshold = mass_threshold_key(cand.keys.data(), cand.units.data(), cand.n, double(prm.top_p) * double(mass),
                                   cand.key_scratch.data(), cand.unit_scratch.data());
    cand.filter([&](int64_t j) { return cand.keys[j] >= threshold; });
  }
  sel.threshold = threshold;
  sel.log_min_p = prm.min_p > 0 ? std::log(prm.min_p) : neg_inf<Acc>();
  if (prm.min_p > 0)
    cand.filter([&](int64_t j) { return (load_as<Acc>(x, cand.index[j]) - sel.m) * sel.inv_t >= sel.log_min_p; });
  // u = sum_j e_j (-d_j) >= 0 over the kept tokens (d_j <= 0 below the row's
  // max, which is kept), for the entropy (mass_logs).
  ExactMass s_kept, u;
  for (int64_t j = 0; j < cand.n; ++j) {
    s_kept.add(double(cand.weight[j]));
    u.add(kept_spread(cand.weight[j], (load_as<Acc>(x, cand.index[j]) - sel.m) * sel.inv_t));
  }
  const MassLogs logs = mass_logs(s, s_kept, u);
  sel.log_s = static_cast<Acc>(logs.log_s);
  sel.log_s_kept = static_cast<Acc>(logs.log_s_kept);
  sel.entropy = static_cast<Acc>(logs.entropy);
  return sel;
}

template <typename Acc>
FASTRL_INLINE bool is_kept(const Selection<Acc>& sel, Acc x) {
  return order_key(x) >= sel.threshold && (x - sel.m) * sel.inv_t >= sel.log_min_p;
}

// The exponential race over the kept tokens (the candidates left by
// select_row, in row order): the winner of argmax_j d_j - log E_j is j with
// probability e^{d_j} / sum_kept e^{d}; ties go to the lowest index.
template <typename In, typename Acc>
int64_t race(const In* x, const Selection<Acc>& sel, const Candidates<Acc>& cand, uint64_t seed,
             uint32_t salt, uint64_t offset) {
  const uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  const uint32_t c2 = uint32_t(offset), c3 = uint32_t(offset >> 32);
  Acc best = neg_inf<Acc>();
  int64_t winner = sel.argmax;  // only if every kept draw lost (E = inf, ~2^-25 each)
  for (int64_t j = 0; j < cand.n; ++j) {
    const int64_t i = cand.index[j];
    const Words4 r = philox4x32_10(uint32_t(i), salt, c2, c3, k0, k1);
    const Acc d = (load_as<Acc>(x, i) - sel.m) * sel.inv_t;
    const Acc key = d - std::log(Acc(exponential_variate(r.w[0], r.w[1])));
    if (key > best) {
      best = key;
      winner = i;
    }
  }
  return winner;
}

// Runs fn(r, x, sel, cand) for every row after select_row, rows spread over
// the OpenMP threads, each with its own candidate buffers.
template <typename In, typename Acc, typename Fn>
void for_each_selected_row(const TruncationArgs& a, Fn fn) {
#pragma omp parallel if (a.n_rows > 1)
  {
    Candidates<Acc>& cand = Candidates<Acc>::for_this_thread(a.vocab);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a.n_rows; ++r) {
      const In* x = static_cast<const In*>(a.logits) + a.rows.offset(r);
      fn(r, x, select_row<In, Acc>(x, a.vocab, row_params<Acc>(a, r), cand), cand);
    }
  }
}

template <typename In, typename Acc>
void sample_impl(const TruncationArgs& a, const RandomArgs& rng, int64_t* tokens, Acc* logprobs,
                 Acc* raw_logprobs, Acc* entropy) {
  const uint64_t offset = uint64_t(rng.offset_ptr ? *rng.offset_ptr : rng.offset);
  for_each_selected_row<In, Acc>(a, [&](int64_t r, const In* x, const Selection<Acc>& sel,
                                        const Candidates<Acc>& cand) {
    if (sel.bad) {
      tokens[r] = -1;
      logprobs[r] = raw_logprobs[r] = entropy[r] = quiet_nan<Acc>();
    } else if (sel.greedy) {  // T -> 0: a point mass on the first argmax
      tokens[r] = sel.argmax;
      logprobs[r] = entropy[r] = 0;
      raw_logprobs[r] = -sel.log_s;
    } else {
      const uint64_t seed = uint64_t(rng.per_row_seeds ? rng.seeds[r] : rng.seed);
      const uint32_t salt = rng.per_row_seeds ? 0u : uint32_t(r);
      const int64_t tok = race<In, Acc>(x, sel, cand, seed, salt, offset);
      const Acc d = (load_as<Acc>(x, tok) - sel.m) * sel.inv_t;
      tokens[r] = tok;
      logprobs[r] = d - sel.log_s_kept;
      raw_logprobs[r] = d - sel.log_s;
      entropy[r] = sel.entropy;
    }
  });
}

template <typename In, typename Acc>
void truncated_forward_impl(const TruncationArgs& a, const void* labels, int label_dtype,
                            Acc* out, Acc* stats) {
  for_each_selected_row<In, Acc>(a, [&](int64_t r, const In* x, const Selection<Acc>& sel,
                                        const Candidates<Acc>&) {
    const int64_t y = load_label(labels, label_dtype, r);
    Acc lp;
    if (sel.bad || y < 0 || y >= a.vocab) {
      lp = quiet_nan<Acc>();
    } else if (sel.greedy) {
      lp = y == sel.argmax ? Acc(0) : neg_inf<Acc>();
    } else {
      const Acc v = load_as<Acc>(x, y);
      lp = is_kept(sel, v) ? (v - sel.m) * sel.inv_t - sel.log_s_kept : neg_inf<Acc>();
    }
    out[r] = lp;
    if (stats) {
      // The threshold as a logit value; keys compare like logits, so the
      // backward rebuilds the same kept set from it. A bad row's log-mass is
      // NaN, which makes its gradient NaN too.
      stats[3 * r] = sel.m;
      stats[3 * r + 1] = sel.bad ? quiet_nan<Acc>() : sel.log_s_kept;
      stats[3 * r + 2] = key_to_value<Acc>(sel.threshold);
    }
  });
}

template <typename In, typename Acc>
void truncated_backward_impl(const TruncationArgs& a, const void* labels, int label_dtype,
                             const Acc* stats, const Acc* grad_logprob, In* grad_out,
                             RowLayout grad_rows, int64_t label_base, const uint8_t* label_kept) {
#pragma omp parallel for schedule(static) if (a.n_rows * a.vocab > 32768)
  for (int64_t r = 0; r < a.n_rows; ++r) {
    const In* x = static_cast<const In*>(a.logits) + a.rows.offset(r);
    In* gx = grad_out + grad_rows.offset(r);
    const RowParams<Acc> prm = row_params<Acc>(a, r);
    Selection<Acc> sel;
    sel.m = stats[3 * r];
    sel.log_s_kept = stats[3 * r + 1];
    sel.threshold = order_key(stats[3 * r + 2]);
    sel.inv_t = prm.t > 0 ? Acc(1) / prm.t : Acc(0);
    sel.log_min_p = prm.min_p > 0 ? std::log(prm.min_p) : neg_inf<Acc>();
    // The label's column in this row (outside [0, vocab) when another shard holds it).
    const int64_t y = load_label(labels, label_dtype, r) - label_base;
    const Acc g = grad_logprob[r];
    const bool y_kept = label_kept ? label_kept[r] != 0 : y >= 0 && y < a.vocab && is_kept(sel, load_as<Acc>(x, y));
    // Zero gradient where the log-prob is a constant: greedy rows and labels
    // outside the kept set (-inf). NaN rows stay NaN.
    Acc scale = 0;
    if (sel.m != sel.m || sel.log_s_kept != sel.log_s_kept || !prm.valid()) {
      scale = quiet_nan<Acc>();
    } else if (prm.t > 0 && y_kept) {
      scale = g * sel.inv_t;
    }
    for (int64_t j = 0; j < a.vocab; ++j) {
      Acc grad = 0;
      if (scale != 0) {
        const Acc v = load_as<Acc>(x, j);
        const Acc q = is_kept(sel, v) ? exp_approx((v - sel.m) * sel.inv_t - sel.log_s_kept) : Acc(0);
        grad = scale * ((j == y ? Acc(1) : Acc(0)) - q);
      }
      store_from(gx, j, grad);
    }
  }
}

// sample_shard_pass (sampling.h): one read of the shard's row.
template <typename In, typename Acc>
void shard_pass_impl(const TruncationArgs& a, const RandomArgs* rng, int64_t column_base, const Acc* given,
                     const void* labels, int label_dtype, double* scores, int64_t* masses, int64_t* picks) {
  const uint64_t offset = rng ? uint64_t(rng->offset_ptr ? *rng->offset_ptr : rng->offset) : 0;
#pragma omp parallel for schedule(static) if (a.n_rows > 1)
  for (int64_t r = 0; r < a.n_rows; ++r) {
    const In* x = static_cast<const In*>(a.logits) + a.rows.offset(r);
    const RowParams<Acc> prm = row_params<Acc>(a, r);
    double* score = scores + 2 * r;
    int64_t* mass = masses + 6 * r;
    int64_t* pick = picks + 2 * r;
    Selection<Acc> sel;
    sel.m = given[2 * r];
    sel.threshold = order_key(given[2 * r + 1]);
    sel.inv_t = prm.t > 0 ? Acc(1) / prm.t : Acc(1);
    sel.log_min_p = prm.min_p > 0 ? std::log(prm.min_p) : neg_inf<Acc>();
    score[0] = score[1] = quiet_nan<double>();
    std::fill(mass, mass + 6, int64_t(0));
    pick[0] = pick[1] = -1;
    if (!(sel.m > neg_inf<Acc>() && sel.m < std::numeric_limits<Acc>::infinity()) || !prm.valid()) continue;
    int64_t first_max = -1;
    if (prm.t == 0) {  // greedy: the maxima alone
      int64_t n_max = 0;
      for (int64_t i = 0; i < a.vocab; ++i) {
        if (load_as<Acc>(x, i) != sel.m) continue;
        if (first_max < 0) first_max = i;
        ++n_max;
      }
      pick[1] = first_max < 0 ? -1 : column_base + first_max;
      mass[0] = count_mass(n_max).hi;
      score[0] = score[1] = 0;
      continue;
    }
    const bool racing = rng != nullptr;
    const uint64_t seed = racing ? uint64_t(rng->per_row_seeds ? rng->seeds[r] : rng->seed) : 0;
    const uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
    const uint32_t salt = racing && !rng->per_row_seeds ? uint32_t(r) : 0u;
    // Exactly, as select_row sums its masses: the ranks' limbs add up to the whole row's.
    ExactMass s, s_kept, u;
    Acc best = neg_inf<Acc>(), d_best = neg_inf<Acc>();
    int64_t winner = -1;
    for (int64_t i = 0; i < a.vocab; ++i) {
      const Acc v = load_as<Acc>(x, i);
      const Acc d = (v - sel.m) * sel.inv_t;
      const Acc e = exp_approx(d);
      s.add(double(e));
      if (v == sel.m && first_max < 0) first_max = i;
      if (!is_kept(sel, v)) continue;
      s_kept.add(double(e));
      u.add(kept_spread(e, d));
      if (!racing) continue;
      const Words4 w = philox4x32_10(uint32_t(column_base + i), salt, uint32_t(offset), uint32_t(offset >> 32), k0, k1);
      const Acc key = d - std::log(Acc(exponential_variate(w.w[0], w.w[1])));
      if (key > best) {  // ties to the lowest index, as race()
        best = key;
        d_best = d;
        winner = i;
      }
    }
    const ExactMass limbs[3] = {s, s_kept, u};
    for (int j = 0; j < 3; ++j) {
      mass[2 * j] = limbs[j].hi;
      mass[2 * j + 1] = limbs[j].lo;
    }
    pick[1] = first_max < 0 ? -1 : column_base + first_max;
    if (racing) {
      score[0] = best;
      score[1] = d_best;
      pick[0] = winner < 0 ? -1 : column_base + winner;
    } else {
      const int64_t y = load_label(labels, label_dtype, r) - column_base;
      if (y >= 0 && y < a.vocab) {
        const Acc v = load_as<Acc>(x, y);
        score[0] = is_kept(sel, v) ? (v - sel.m) * sel.inv_t : neg_inf<Acc>();
      }
      score[1] = 0;
    }
  }
}

// shard_digit_histogram (sampling.h): one read of the shard's row.
template <typename In, typename Acc>
void digit_histogram_impl(const TruncationArgs& a, const int64_t* prefix, int shift, const Acc* given,
                          double unit_scale, int64_t* hist) {
  using Key = KeyOf<Acc>;
  constexpr int kKeyBits = int(sizeof(Key)) * 8;
  const int above = shift + 8;  // the prefix's bits: those above the digit (none in the first round)
#pragma omp parallel for schedule(static) if (a.n_rows > 1)
  for (int64_t r = 0; r < a.n_rows; ++r) {
    const In* x = static_cast<const In*>(a.logits) + a.rows.offset(r);
    const int planes = given ? 2 : 1;
    int64_t* count = hist + planes * 256 * r;
    int64_t* unit = given ? count + 256 : nullptr;
    std::fill(count, count + planes * 256, int64_t(0));
    const Key want = Key(uint64_t(prefix[r]));
    const Acc m = given ? given[2 * r] : Acc(0), floor = given ? given[2 * r + 1] : neg_inf<Acc>();
    const RowParams<Acc> prm = row_params<Acc>(a, r);
    const Acc inv_t = prm.t > 0 ? Acc(1) / prm.t : Acc(1);
    for (int64_t i = 0; i < a.vocab; ++i) {
      const Acc v = load_as<Acc>(x, i);
      const Key key = order_key(v);
      if (above < kKeyBits && ((key ^ want) >> above) != 0) continue;
      if (given && !(v >= floor)) continue;
      const int digit = int((key >> shift) & 0xff);
      ++count[digit];
      // (e <= 1 below the row's max; the clamp keeps a row the caller ignores (bad) from overflowing)
      if (unit) unit[digit] += top_p_units(exp_approx((v - m) * inv_t), unit_scale);
    }
  }
}

}  // namespace

void sample_forward(const TruncationArgs& a, const RandomArgs& rng, int64_t* tokens, void* logprobs,
                    void* raw_logprobs, void* entropy) {
  FASTRL_DISPATCH_LOGITS(a.dtype, "sample_forward",
                         (sample_impl<In, Acc>(a, rng, tokens, static_cast<Acc*>(logprobs),
                                               static_cast<Acc*>(raw_logprobs), static_cast<Acc*>(entropy))))
}

void truncated_logprobs_forward(const TruncationArgs& a, const void* labels, int label_dtype,
                                void* out_logprob, void* stats) {
  FASTRL_DISPATCH_LOGITS(a.dtype, "truncated_logprobs_forward",
                         (truncated_forward_impl<In, Acc>(a, labels, label_dtype,
                                                          static_cast<Acc*>(out_logprob),
                                                          static_cast<Acc*>(stats))))
}

void truncated_logprobs_backward(const TruncationArgs& a, const void* labels, int label_dtype,
                                 const void* stats, const void* grad_logprob, void* grad_out,
                                 RowLayout grad_rows, int64_t label_base, const uint8_t* label_kept) {
  FASTRL_DISPATCH_LOGITS(a.dtype, "truncated_logprobs_backward",
                         (truncated_backward_impl<In, Acc>(a, labels, label_dtype,
                                                           static_cast<const Acc*>(stats),
                                                           static_cast<const Acc*>(grad_logprob),
                                                           static_cast<In*>(grad_out), grad_rows,
                                                           label_base, label_kept)))
}

void sample_shard_pass(const TruncationArgs& a, const RandomArgs* rng, int64_t column_base,
                       const void* given, const void* labels, int label_dtype, double* scores,
                       int64_t* masses, int64_t* picks) {
  FASTRL_DISPATCH_LOGITS(a.dtype, "sample_shard_pass",
                         (shard_pass_impl<In, Acc>(a, rng, column_base, static_cast<const Acc*>(given),
                                                   labels, label_dtype, scores, masses, picks)))
}

void sample_mass_logs(const int64_t* masses, int64_t n_rows, double* logs) {
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t* m = masses + 6 * r;
    const MassLogs row = mass_logs({m[0], m[1]}, {m[2], m[3]}, {m[4], m[5]});
    logs[3 * r] = row.log_s;
    logs[3 * r + 1] = row.log_s_kept;
    logs[3 * r + 2] = row.entropy;
  }
}

void shard_digit_histogram(const TruncationArgs& a, const int64_t* prefix, int shift, const void* given,
                           double unit_scale, int64_t* hist) {
  FASTRL_DISPATCH_LOGITS(a.dtype, "shard_digit_histogram",
                         (digit_histogram_impl<In, Acc>(a, prefix, shift, static_cast<const Acc*>(given),
                                                        unit_scale, hist)))
}

}  // namespace fastrl
