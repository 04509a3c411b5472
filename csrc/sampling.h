// Temperature / top-k / top-p / min-p sampling with log-probs, and the matching
// training-side truncated log-probs: the CPU kernels' interface.
#pragma once

#include <cstdint>

#include "rows.h"

namespace fastrl {

// The processed distribution of each row (see fastrl/reference.py,
// truncated_log_distribution). Each parameter is per row when its pointer is
// set (temps / top_p / min_p of the accumulation type, top_k int64), else the
// scalar applies to every row. Off: top_k 0, top_p 1, min_p 0; temperature 0
// is greedy.
struct TruncationArgs {
  const void* logits;
  int dtype;
  int64_t n_rows;
  int64_t vocab;
  RowLayout rows;  // row r at logits + rows.offset(r) (rows.h)
  const void* temps;
  double temp_scalar;
  const int64_t* top_k;
  int64_t top_k_scalar;
  const void* top_p;
  double top_p_scalar;
  const void* min_p;
  double min_p_scalar;
};

// Philox key and counter of the draws. Row r uses key = its seed (seeds[r]
// when per_row_seeds, else seed) and counter (vocab index, salt, offset), where
// salt = r for a batch-wide seed and 0 for per-row seeds, so that a row with
// its own seed draws the same token wherever it sits in the batch.
struct RandomArgs {
  const int64_t* seeds;
  int64_t seed;
  bool per_row_seeds;
  const int64_t* offset_ptr;  // when set, the offset is read from here (a tensor offset)
  int64_t offset;
};

// tokens [n_rows] int64 (-1 for a row that is all -inf, has NaN or +inf, or
// has an invalid parameter; its log-probs and entropy are NaN), logprobs under
// the processed distribution, raw_logprobs under log_softmax(logits / T), and
// entropy, the processed distribution's (0 for a greedy row), all of the
// accumulation type.
void sample_forward(const TruncationArgs& args, const RandomArgs& rng, int64_t* tokens,
                    void* logprobs, void* raw_logprobs, void* entropy);

// Log-prob of labels under the processed distribution (-inf outside the kept
// set; NaN for a bad row), and per-row stats [n_rows, 3] (max logit, log of
// the kept mass (NaN for a bad row), the threshold logit) that the backward
// needs when stats is non-null.
void truncated_logprobs_forward(const TruncationArgs& args, const void* labels, int label_dtype,
                                void* out_logprob, void* stats);

// dL/dlogits for the kept set held fixed: (1/T) g ([j == label] - q_j) over the
// kept tokens j when the label is kept; zero for rows whose label is not kept,
// greedy rows and ignore rows. grad_out has the logits' dtype.
// A vocabulary shard (fastrl/vocab_parallel.py) passes label_base, where its
// columns start (labels are global ids), and label_kept (one byte a row):
// whether the label is kept, which the shard cannot see when another holds it.
void truncated_logprobs_backward(const TruncationArgs& args, const void* labels, int label_dtype,
                                 const void* stats, const void* grad_logprob, void* grad_out,
                                 RowLayout grad_rows, int64_t label_base, const uint8_t* label_kept);

// One vocabulary shard's part of a row of the tensor-parallel sampler
// (fastrl/_sharded/sampling.py). The ranks have agreed on the row's max logit m
// and kept threshold tau (given [n_rows, 2], accumulation type): the kept
// tokens are x >= tau with (x - m) / T >= log(min_p); top_k and top_p are not
// read. The shard's columns are the global indices column_base + j, which are
// also the Philox counters, so the race is the unsharded one. Writes, per row:
//   scores [n_rows, 2] float64: with rng the best race score d_j - log E_j of
//     its kept tokens (-inf: none) and that token's d_j, or with labels d of the
//     label where the shard holds it (-inf when not kept, NaN when another shard
//     holds it) and 0;
//   masses [n_rows, 6] int64: the exact sums (sampling.cpp, ExactMass: two limbs
//     each, which the ranks add as integers) of s = sum_j e_j over the shard,
//     s_kept over its kept tokens and u = sum_j e_j (-d_j) over them (e_j =
//     exp(d_j), d_j = (x_j - m) / T); a greedy row's s is its number of logits
//     equal to m, the rest 0;
//   picks [n_rows, 2] int64: the race winner and the first logit equal to m,
//     as global indices, -1 for none.
// A row whose m is not finite or whose parameters are invalid is left to the
// caller (its scores hold NaN, its masses 0 and its picks -1).
void sample_shard_pass(const TruncationArgs& args, const RandomArgs* rng, int64_t column_base,
                       const void* given, const void* labels, int label_dtype, double* scores,
                       int64_t* masses, int64_t* picks);

// The rows' (log s, log s_kept, entropy) [n_rows, 3] float64 from masses [n_rows, 6]
// (sample_shard_pass's, summed over the ranks) by the unsharded sampler's own
// formula, so that the tensor-parallel sampler's log-probs and entropy are its bits.
void sample_mass_logs(const int64_t* masses, int64_t n_rows, double* logs);

// One round of the tensor-parallel sampler's threshold search (fastrl/_sharded/sampling.py):
// for each row, hist[r][0] (int64 [256]) counts the 8-bit digit at `shift` of the
// order keys (as sample's top-k compares them) of the row's tokens whose key agrees
// with prefix[r] (the key's bits, in int64) above that digit. With given [n_rows, 2]
// (max m, floor; accumulation type) only the tokens x >= floor count, and hist[r][1]
// sums their masses in fixed point, exp((x - m) / T) * unit_scale rounded to nearest
// (exact in any order; the ranks add them so; the caller picks a scale at which V of
// them cannot overflow). hist: [n_rows, 1 or (with given) 2, 256].
void shard_digit_histogram(const TruncationArgs& args, const int64_t* prefix, int shift,
                           const void* given, double unit_scale, int64_t* hist);

}  // namespace fastrl
