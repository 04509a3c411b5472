// Log-probs and entropy of chosen tokens: the CPU kernels' interface.
#pragma once

#include <cstdint>

#include "rows.h"

namespace fastrl {

// What both passes read. logits: n_rows rows of `vocab` elements with unit
// stride, row r at logits + rows.offset(r) elements (rows.h). labels: int32 / int64
// (label_dtype), or null when only the entropy is wanted. temps: one per-row
// temperature of the accumulation type (float, double for float64 logits), or
// null to use temp_scalar for every row.
struct LogprobsArgs {
  const void* logits;
  int dtype;
  int64_t n_rows;
  int64_t vocab;
  RowLayout rows;
  const void* labels;
  int label_dtype;
  int64_t ignore_index;
  const void* temps;
  double temp_scalar;
};

// Writes per-row log-prob, entropy, stats (the pair max logit, log s that
// the backward needs; [n_rows, 2]) and sum_pi_squared (sum_j p_j^2 of
// softmax(x / T)) into whichever output pointers are non-null, all of the
// accumulation type. Each row is reduced as segments of `segment` logits (a
// divisor of vocab: fastrl._rows.segment_length).
void logprobs_forward(const LogprobsArgs& args, int64_t segment, void* out_logprob, void* out_entropy,
                      void* out_stats, void* out_sum_pi_squared);

// The statistics (m, n, t, w, q: softmax_stats.h RowStats, w in natural units,
// w / q 0 unless asked for) of each of the vocab / segment segments of each row
// of a vocabulary shard, as doubles [n_rows, vocab / segment, 5].
void logprobs_segments(const LogprobsArgs& args, int64_t segment, bool with_entropy, bool with_sum_pi_squared,
                       double* out);

// logprobs_forward's outputs from rows' segments [n_rows, n_segments, 5]
// (logprobs_segments', gathered from the ranks in vocabulary order) and their
// label logits [n_rows] (of the accumulation type; read where the label is in
// [0, args.vocab), the whole vocabulary). Of args it reads dtype (the
// accumulation type's code), vocab, labels, ignore_index and the temperature.
void logprobs_combine(const double* segments, int64_t n_rows, int64_t n_segments, const void* label_logits,
                      const LogprobsArgs& args, void* out_logprob, void* out_entropy, void* out_stats,
                      void* out_sum_pi_squared);

// Writes dL/dlogits (logits' dtype, rows laid out by grad_rows; may alias the
// logits) from the saved stats / entropy and the incoming gradients. A null
// grad_logprob or grad_entropy means that output's gradient is zero. The rows
// may be a block of columns [label_base, label_base + vocab) of rows of
// label_vocab entries (the fused LM head's vocabulary slabs): a label is valid
// in [0, label_vocab), its one-hot term lands on column label - label_base when
// that is in the block. A whole row: label_base 0, label_vocab = vocab.
void logprobs_backward(const LogprobsArgs& args, const void* stats, const void* entropy,
                       const void* grad_logprob, const void* grad_entropy, void* grad_out,
                       RowLayout grad_rows, int64_t label_base, int64_t label_vocab);

}  // namespace fastrl
