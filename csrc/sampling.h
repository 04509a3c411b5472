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
// has an invalid parameter; its log-probs are NaN), logprobs under the processed
// distribution and raw_logprobs under log_softmax(logits / T), both of the
// accumulation type.
void sample_forward(const TruncationArgs& args, const RandomArgs& rng, int64_t* tokens,
                    void* logprobs, void* raw_logprobs);

// Log-prob of labels under the processed distribution (-inf outside the kept
// set; NaN for a bad row), and per-row stats [n_rows, 3] (max logit, log of
// the kept mass (NaN for a bad row), the threshold logit) that the backward
// needs when stats is non-null.
void truncated_logprobs_forward(const TruncationArgs& args, const void* labels, int label_dtype,
                                void* out_logprob, void* stats);

// dL/dlogits for the kept set held fixed: (1/T) g ([j == label] - q_j) over the
// kept tokens j when the label is kept; zero for rows whose label is not kept,
// greedy rows and ignore rows. grad_out has the logits' dtype.
void truncated_logprobs_backward(const TruncationArgs& args, const void* labels, int label_dtype,
                                 const void* stats, const void* grad_logprob, void* grad_out,
                                 RowLayout grad_rows);

}  // namespace fastrl
