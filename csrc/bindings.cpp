// pybind11 bindings of fastrl._C. Tensors cross as integers (data pointers)
// with sizes, strides and dtype codes, so the extension never links libtorch and
// one build serves every torch version. The GIL is released while a kernel runs.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <cstdint>
#include <tuple>

#include "common.h"
#include "gemm.h"
#include "isa.h"
#include "kl.h"
#include "logprobs.h"
#include "philox.h"
#include "policy.h"
#include "sampling.h"

namespace py = pybind11;

namespace {

const void* cptr(std::uintptr_t p) { return reinterpret_cast<const void*>(p); }
void* mptr(std::uintptr_t p) { return reinterpret_cast<void*>(p); }

// A row layout (rows.h) crosses as the tuple (inner, outer_stride, inner_stride).
using RowsTuple = std::tuple<int64_t, int64_t, int64_t>;

fastrl::RowLayout row_layout(const RowsTuple& t) {
  const auto& [inner, outer_stride, inner_stride] = t;
  return {inner, outer_stride, inner_stride};
}

fastrl::LogprobsArgs logprobs_args(std::uintptr_t logits, int dtype, int64_t n_rows, int64_t vocab,
                                   const RowsTuple& rows, std::uintptr_t labels, int label_dtype,
                                   int64_t ignore_index, std::uintptr_t temps, double temp_scalar) {
  return {cptr(logits), dtype,        n_rows,      vocab,      row_layout(rows), cptr(labels),
          label_dtype,  ignore_index, cptr(temps), temp_scalar};
}

// The processed-distribution arguments, in the order fastrl/_native.py passes them.
using TruncationTuple = std::tuple<std::uintptr_t, int, int64_t, int64_t, RowsTuple, std::uintptr_t,
                                   double, std::uintptr_t, int64_t, std::uintptr_t, double,
                                   std::uintptr_t, double>;

fastrl::TruncationArgs truncation_args(const TruncationTuple& t) {
  const auto& [logits, dtype, n_rows, vocab, rows, temps, temp, top_k, top_k_scalar, top_p,
               top_p_scalar, min_p, min_p_scalar] = t;
  return {cptr(logits), dtype,  n_rows,        vocab,
          row_layout(rows), cptr(temps), temp, reinterpret_cast<const int64_t*>(top_k),
          top_k_scalar, cptr(top_p), top_p_scalar, cptr(min_p),
          min_p_scalar};
}

fastrl::FullKLArgs full_kl_args(std::uintptr_t logits, std::uintptr_t ref_logits, int dtype, int64_t n_rows,
                                int64_t vocab, const RowsTuple& rows, const RowsTuple& ref_rows,
                                std::uintptr_t temps, double temp_scalar) {
  return {cptr(logits),     cptr(ref_logits),     dtype,       n_rows,     vocab,
          row_layout(rows), row_layout(ref_rows), cptr(temps), temp_scalar};
}

// The policy-loss arguments, in the order fastrl/_native.py passes them.
using PolicyTuple = std::tuple<std::uintptr_t, std::uintptr_t, std::uintptr_t, std::uintptr_t,
                               std::uintptr_t, std::uintptr_t, int, int64_t, int64_t, int, double,
                               double, bool, double, bool, bool>;

fastrl::PolicyArgs policy_args(const PolicyTuple& t) {
  const auto& [log_probs, old_log_probs, advantages, mask, weights, ref_log_probs, dtype, n_rows,
               length, estimator, clip_low, clip_high, dual_clip, clip_c, sequence, with_pg] = t;
  return {cptr(log_probs), cptr(old_log_probs), cptr(advantages),
          static_cast<const uint8_t*>(cptr(mask)), cptr(weights), cptr(ref_log_probs),
          dtype, n_rows, length, estimator, clip_low, clip_high, dual_clip, clip_c, sequence, with_pg};
}

// The x86-64 levels by the names FASTRL_CPU_ISA takes (fastrl/_backend.py).
constexpr std::pair<const char*, fastrl::Isa> kIsaLevels[] = {
    {"x86-64-v4", fastrl::Isa::kAvx512},
    {"x86-64-v3", fastrl::Isa::kAvx2},
    {"x86-64", fastrl::Isa::kBaseline},
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastrl native kernels (CPU)";

  m.def("gemm_bf16_supported", &fastrl::gemm_bf16_supported);
  m.def(
      "gemm_bf16",
      [](std::uintptr_t a, int a_dtype, int64_t a_row, int64_t a_k, std::uintptr_t b, int b_dtype, int64_t b_row,
         int64_t b_k, std::uintptr_t c, int64_t c_row, int64_t c_col, int64_t m, int64_t n, int64_t k,
         bool accumulate) {
        fastrl::gemm_bf16({cptr(a), a_dtype, a_row, a_k}, {cptr(b), b_dtype, b_row, b_k},
                          static_cast<float*>(mptr(c)), c_row, c_col, m, n, k, accumulate);
      },
      py::arg("a"), py::arg("a_dtype"), py::arg("a_row"), py::arg("a_k"), py::arg("b"), py::arg("b_dtype"),
      py::arg("b_row"), py::arg("b_k"), py::arg("c"), py::arg("c_row"), py::arg("c_col"), py::arg("m"),
      py::arg("n"), py::arg("k"), py::arg("accumulate"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "logprobs_forward",
      [](std::uintptr_t logits, int dtype, int64_t n_rows, int64_t vocab, const RowsTuple& rows,
         std::uintptr_t labels, int label_dtype, int64_t ignore_index, std::uintptr_t temps,
         double temp_scalar, int64_t segment, std::uintptr_t out_logprob, std::uintptr_t out_entropy,
         std::uintptr_t out_stats, std::uintptr_t out_sum_pi_squared) {
        fastrl::logprobs_forward(logprobs_args(logits, dtype, n_rows, vocab, rows, labels,
                                               label_dtype, ignore_index, temps, temp_scalar),
                                 segment, mptr(out_logprob), mptr(out_entropy), mptr(out_stats),
                                 mptr(out_sum_pi_squared));
      },
      py::arg("logits"), py::arg("dtype"), py::arg("n_rows"), py::arg("vocab"), py::arg("rows"),
      py::arg("labels"), py::arg("label_dtype"), py::arg("ignore_index"), py::arg("temps"),
      py::arg("temp_scalar"), py::arg("segment"), py::arg("out_logprob"), py::arg("out_entropy"),
      py::arg("out_stats"), py::arg("out_sum_pi_squared"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "logprobs_segments",
      [](std::uintptr_t logits, int dtype, int64_t n_rows, int64_t vocab, const RowsTuple& rows,
         std::uintptr_t temps, double temp_scalar, int64_t segment, bool with_entropy,
         bool with_sum_pi_squared, std::uintptr_t out) {
        fastrl::logprobs_segments(logprobs_args(logits, dtype, n_rows, vocab, rows, 0, -1, 0, temps, temp_scalar),
                                  segment, with_entropy, with_sum_pi_squared, static_cast<double*>(mptr(out)));
      },
      py::arg("logits"), py::arg("dtype"), py::arg("n_rows"), py::arg("vocab"), py::arg("rows"),
      py::arg("temps"), py::arg("temp_scalar"), py::arg("segment"), py::arg("with_entropy"),
      py::arg("with_sum_pi_squared"), py::arg("out"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "logprobs_combine",
      [](std::uintptr_t segments, int64_t n_rows, int64_t n_segments, std::uintptr_t label_logits, int acc_dtype,
         int64_t vocab, std::uintptr_t labels, int label_dtype, int64_t ignore_index, std::uintptr_t temps,
         double temp_scalar, std::uintptr_t out_logprob, std::uintptr_t out_entropy, std::uintptr_t out_stats,
         std::uintptr_t out_sum_pi_squared) {
        fastrl::logprobs_combine(static_cast<const double*>(cptr(segments)), n_rows, n_segments, cptr(label_logits),
                                 logprobs_args(0, acc_dtype, n_rows, vocab, RowsTuple{1, 0, 0}, labels, label_dtype,
                                               ignore_index, temps, temp_scalar),
                                 mptr(out_logprob), mptr(out_entropy), mptr(out_stats), mptr(out_sum_pi_squared));
      },
      py::arg("segments"), py::arg("n_rows"), py::arg("n_segments"), py::arg("label_logits"),
      py::arg("acc_dtype"), py::arg("vocab"), py::arg("labels"), py::arg("label_dtype"), py::arg("ignore_index"),
      py::arg("temps"), py::arg("temp_scalar"), py::arg("out_logprob"), py::arg("out_entropy"),
      py::arg("out_stats"), py::arg("out_sum_pi_squared"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "logprobs_backward",
      [](std::uintptr_t logits, int dtype, int64_t n_rows, int64_t vocab, const RowsTuple& rows,
         std::uintptr_t labels, int label_dtype, int64_t ignore_index, std::uintptr_t temps,
         double temp_scalar, std::uintptr_t stats, std::uintptr_t entropy,
         std::uintptr_t grad_logprob, std::uintptr_t grad_entropy, std::uintptr_t grad_out,
         const RowsTuple& grad_rows, int64_t label_base, int64_t label_vocab) {
        fastrl::logprobs_backward(logprobs_args(logits, dtype, n_rows, vocab, rows, labels,
                                                label_dtype, ignore_index, temps, temp_scalar),
                                  cptr(stats), cptr(entropy), cptr(grad_logprob),
                                  cptr(grad_entropy), mptr(grad_out), row_layout(grad_rows),
                                  label_base, label_vocab);
      },
      py::arg("logits"), py::arg("dtype"), py::arg("n_rows"), py::arg("vocab"), py::arg("rows"),
      py::arg("labels"), py::arg("label_dtype"), py::arg("ignore_index"), py::arg("temps"),
      py::arg("temp_scalar"), py::arg("stats"), py::arg("entropy"), py::arg("grad_logprob"),
      py::arg("grad_entropy"), py::arg("grad_out"), py::arg("grad_rows"), py::arg("label_base"),
      py::arg("label_vocab"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "sample_forward",
      [](const TruncationTuple& truncation, std::uintptr_t seeds, int64_t seed, bool per_row_seeds,
         std::uintptr_t offset_ptr, int64_t offset, std::uintptr_t tokens, std::uintptr_t logprobs,
         std::uintptr_t raw_logprobs, std::uintptr_t entropy) {
        const fastrl::RandomArgs rng{reinterpret_cast<const int64_t*>(seeds), seed, per_row_seeds,
                                     reinterpret_cast<const int64_t*>(offset_ptr), offset};
        fastrl::sample_forward(truncation_args(truncation), rng, static_cast<int64_t*>(mptr(tokens)),
                               mptr(logprobs), mptr(raw_logprobs), mptr(entropy));
      },
      py::arg("truncation"), py::arg("seeds"), py::arg("seed"), py::arg("per_row_seeds"),
      py::arg("offset_ptr"), py::arg("offset"), py::arg("tokens"), py::arg("logprobs"),
      py::arg("raw_logprobs"), py::arg("entropy"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "truncated_logprobs_forward",
      [](const TruncationTuple& truncation, std::uintptr_t labels, int label_dtype, std::uintptr_t out,
         std::uintptr_t stats) {
        fastrl::truncated_logprobs_forward(truncation_args(truncation), cptr(labels), label_dtype, mptr(out),
                                           mptr(stats));
      },
      py::arg("truncation"), py::arg("labels"), py::arg("label_dtype"), py::arg("out"), py::arg("stats"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "truncated_logprobs_backward",
      [](const TruncationTuple& truncation, std::uintptr_t labels, int label_dtype, std::uintptr_t stats,
         std::uintptr_t grad_logprob, std::uintptr_t grad_out, const RowsTuple& grad_rows,
         int64_t label_base, std::uintptr_t label_kept) {
        fastrl::truncated_logprobs_backward(truncation_args(truncation), cptr(labels), label_dtype,
                                            cptr(stats), cptr(grad_logprob), mptr(grad_out),
                                            row_layout(grad_rows), label_base,
                                            reinterpret_cast<const uint8_t*>(label_kept));
      },
      py::arg("truncation"), py::arg("labels"), py::arg("label_dtype"), py::arg("stats"),
      py::arg("grad_logprob"), py::arg("grad_out"), py::arg("grad_rows"), py::arg("label_base"),
      py::arg("label_kept"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "shard_digit_histogram",
      [](const TruncationTuple& truncation, std::uintptr_t prefix, int shift, std::uintptr_t given, double unit_scale,
         std::uintptr_t hist) {
        fastrl::shard_digit_histogram(truncation_args(truncation), reinterpret_cast<const int64_t*>(prefix), shift,
                                      cptr(given), unit_scale, static_cast<int64_t*>(mptr(hist)));
      },
      py::arg("truncation"), py::arg("prefix"), py::arg("shift"), py::arg("given"), py::arg("unit_scale"),
      py::arg("hist"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "sample_shard_pass",
      [](const TruncationTuple& truncation, bool racing, std::uintptr_t seeds, int64_t seed, bool per_row_seeds,
         std::uintptr_t offset_ptr, int64_t offset, int64_t column_base, std::uintptr_t given,
         std::uintptr_t labels, int label_dtype, std::uintptr_t scores, std::uintptr_t masses, std::uintptr_t picks) {
        const fastrl::RandomArgs rng{reinterpret_cast<const int64_t*>(seeds), seed, per_row_seeds,
                                     reinterpret_cast<const int64_t*>(offset_ptr), offset};
        fastrl::sample_shard_pass(truncation_args(truncation), racing ? &rng : nullptr, column_base, cptr(given),
                                  cptr(labels), label_dtype, static_cast<double*>(mptr(scores)),
                                  static_cast<int64_t*>(mptr(masses)), static_cast<int64_t*>(mptr(picks)));
      },
      py::arg("truncation"), py::arg("racing"), py::arg("seeds"), py::arg("seed"), py::arg("per_row_seeds"),
      py::arg("offset_ptr"), py::arg("offset"), py::arg("column_base"), py::arg("given"), py::arg("labels"),
      py::arg("label_dtype"), py::arg("scores"), py::arg("masses"), py::arg("picks"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "sample_mass_logs",
      [](std::uintptr_t masses, int64_t n_rows, std::uintptr_t logs) {
        fastrl::sample_mass_logs(reinterpret_cast<const int64_t*>(masses), n_rows, static_cast<double*>(mptr(logs)));
      },
      py::arg("masses"), py::arg("n_rows"), py::arg("logs"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "kl_penalty_forward",
      [](std::uintptr_t log_probs, std::uintptr_t ref_log_probs, int dtype, int64_t n, int estimator,
         std::uintptr_t out) {
        fastrl::kl_penalty_forward(cptr(log_probs), cptr(ref_log_probs), dtype, n, estimator, mptr(out));
      },
      py::arg("log_probs"), py::arg("ref_log_probs"), py::arg("dtype"), py::arg("n"), py::arg("estimator"),
      py::arg("out"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "kl_penalty_backward",
      [](std::uintptr_t log_probs, std::uintptr_t ref_log_probs, std::uintptr_t grad, int dtype, int64_t n,
         int estimator, bool straight_through, std::uintptr_t grad_logp) {
        fastrl::kl_penalty_backward(cptr(log_probs), cptr(ref_log_probs), cptr(grad), dtype, n, estimator,
                                    straight_through, mptr(grad_logp));
      },
      py::arg("log_probs"), py::arg("ref_log_probs"), py::arg("grad"), py::arg("dtype"), py::arg("n"),
      py::arg("estimator"), py::arg("straight_through"), py::arg("grad_logp"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "full_kl_forward",
      [](std::uintptr_t logits, std::uintptr_t ref_logits, int dtype, int64_t n_rows, int64_t vocab,
         const RowsTuple& rows, const RowsTuple& ref_rows, std::uintptr_t temps, double temp_scalar,
         std::uintptr_t out_kl, std::uintptr_t out_stats) {
        fastrl::full_kl_forward(full_kl_args(logits, ref_logits, dtype, n_rows, vocab, rows,
                                             ref_rows, temps, temp_scalar),
                                mptr(out_kl), mptr(out_stats));
      },
      py::arg("logits"), py::arg("ref_logits"), py::arg("dtype"), py::arg("n_rows"), py::arg("vocab"),
      py::arg("rows"), py::arg("ref_rows"), py::arg("temps"), py::arg("temp_scalar"), py::arg("out_kl"),
      py::arg("out_stats"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "full_kl_backward",
      [](std::uintptr_t logits, std::uintptr_t ref_logits, int dtype, int64_t n_rows, int64_t vocab,
         const RowsTuple& rows, const RowsTuple& ref_rows, std::uintptr_t temps, double temp_scalar,
         std::uintptr_t stats, std::uintptr_t kl, std::uintptr_t grad_kl, std::uintptr_t grad_out,
         const RowsTuple& grad_rows) {
        fastrl::full_kl_backward(full_kl_args(logits, ref_logits, dtype, n_rows, vocab, rows,
                                              ref_rows, temps, temp_scalar),
                                 cptr(stats), cptr(kl), cptr(grad_kl), mptr(grad_out), row_layout(grad_rows));
      },
      py::arg("logits"), py::arg("ref_logits"), py::arg("dtype"), py::arg("n_rows"), py::arg("vocab"),
      py::arg("rows"), py::arg("ref_rows"), py::arg("temps"), py::arg("temp_scalar"), py::arg("stats"),
      py::arg("kl"), py::arg("grad_kl"), py::arg("grad_out"), py::arg("grad_rows"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "policy_forward",
      [](const PolicyTuple& policy, std::uintptr_t values, std::uintptr_t stats) {
        fastrl::policy_forward(policy_args(policy), cptr(values), static_cast<double*>(mptr(stats)));
      },
      py::arg("policy"), py::arg("values"), py::arg("stats"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "policy_backward",
      [](const PolicyTuple& policy, std::uintptr_t stats, std::uintptr_t row_weights, std::uintptr_t grad_loss,
         bool straight_through, double kl_coef, double value_coef, std::uintptr_t grad_logp,
         std::uintptr_t grad_values) {
        fastrl::policy_backward(policy_args(policy), static_cast<const double*>(cptr(stats)),
                                static_cast<const double*>(cptr(row_weights)), cptr(grad_loss),
                                straight_through, kl_coef, value_coef, mptr(grad_logp), mptr(grad_values));
      },
      py::arg("policy"), py::arg("stats"), py::arg("row_weights"), py::arg("grad_loss"),
      py::arg("straight_through"), py::arg("kl_coef"), py::arg("value_coef"), py::arg("grad_logp"),
      py::arg("grad_values"),
      py::call_guard<py::gil_scoped_release>());

  // batch_num_tokens and global_batch_size each arrive as (pointer to a float64
  // scalar or 0, scalar value, given).
  m.def(
      "policy_finalize",
      [](std::uintptr_t stats, int64_t n_rows, int mode, double dp_size, std::uintptr_t batch_num_tokens_ptr,
         double batch_num_tokens, bool batch_num_tokens_given, std::uintptr_t global_batch_size_ptr,
         double global_batch_size, bool global_batch_size_given, double norm, double kl_coef,
         double value_coef, int loss_dtype, std::uintptr_t loss, std::uintptr_t metrics,
         std::uintptr_t row_weights) {
        const fastrl::PolicyFinalizeArgs args{
            mode,
            dp_size,
            {static_cast<const double*>(cptr(batch_num_tokens_ptr)), batch_num_tokens, batch_num_tokens_given},
            {static_cast<const double*>(cptr(global_batch_size_ptr)), global_batch_size, global_batch_size_given},
            norm,
            kl_coef,
            value_coef};
        fastrl::policy_finalize(static_cast<const double*>(cptr(stats)), n_rows, args, loss_dtype, mptr(loss),
                                static_cast<float*>(mptr(metrics)), static_cast<double*>(mptr(row_weights)));
      },
      py::arg("stats"), py::arg("n_rows"), py::arg("mode"), py::arg("dp_size"),
      py::arg("batch_num_tokens_ptr"), py::arg("batch_num_tokens"), py::arg("batch_num_tokens_given"),
      py::arg("global_batch_size_ptr"), py::arg("global_batch_size"), py::arg("global_batch_size_given"),
      py::arg("norm"), py::arg("kl_coef"), py::arg("value_coef"), py::arg("loss_dtype"), py::arg("loss"),
      py::arg("metrics"), py::arg("row_weights"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "rollout_correction_forward",
      [](std::uintptr_t old_log_probs, std::uintptr_t rollout_log_probs, std::uintptr_t mask, int dtype,
         int64_t n_rows, int64_t length, bool sequence, bool truncate, double clip_min, double clip_max,
         double low_threshold, std::uintptr_t weights, std::uintptr_t stats) {
        const fastrl::RolloutCorrectionArgs args{cptr(old_log_probs), cptr(rollout_log_probs),
                                                 static_cast<const uint8_t*>(cptr(mask)), dtype, n_rows,
                                                 length, sequence, truncate, clip_min, clip_max,
                                                 low_threshold};
        fastrl::rollout_correction_forward(args, static_cast<float*>(mptr(weights)),
                                           static_cast<double*>(mptr(stats)));
      },
      py::arg("old_log_probs"), py::arg("rollout_log_probs"), py::arg("mask"), py::arg("dtype"),
      py::arg("n_rows"), py::arg("length"), py::arg("sequence"), py::arg("truncate"), py::arg("clip_min"),
      py::arg("clip_max"), py::arg("low_threshold"), py::arg("weights"), py::arg("stats"),
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "rollout_finalize",
      [](std::uintptr_t stats, int64_t n_rows, bool sequence, std::uintptr_t metrics) {
        fastrl::rollout_finalize(static_cast<const double*>(cptr(stats)), n_rows, sequence,
                                 static_cast<float*>(mptr(metrics)));
      },
      py::arg("stats"), py::arg("n_rows"), py::arg("sequence"), py::arg("metrics"),
      py::call_guard<py::gil_scoped_release>());

  // Philox4x32-10 of one counter under one key, for the known-answer tests.
  m.def("philox4x32_10", [](uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0, uint32_t k1) {
    const fastrl::Words4 r = fastrl::philox4x32_10(c0, c1, c2, c3, k0, k1);
    return py::make_tuple(r.w[0], r.w[1], r.w[2], r.w[3]);
  },
      py::arg("c0"), py::arg("c1"), py::arg("c2"), py::arg("c3"), py::arg("k0"), py::arg("k1"));

  m.def(
      "set_cpu_isa",
      [](const std::string& level) {
        for (const auto& [name, isa] : kIsaLevels) {
          if (level == name) return fastrl::set_active_isa(isa);
        }
        throw std::invalid_argument("unknown x86-64 level '" + level + "' (x86-64-v4, x86-64-v3 or x86-64)");
      },
      py::arg("level"),
      "Runs the CPU kernels at this x86-64 level (x86-64-v4, x86-64-v3, x86-64) from the next call on; "
      "ValueError for a level this CPU lacks.");
  m.def("cpu_isa_levels", []() {
    std::vector<std::string> levels;
    for (const auto& [name, isa] : kIsaLevels) {
      if (isa <= fastrl::best_isa()) levels.emplace_back(name);
    }
    return levels;
  }, "The x86-64 levels this CPU runs, best first.");
  m.def("build_info", []() {
    py::dict d;
#ifdef _OPENMP
    d["openmp_threads"] = omp_get_max_threads();
#else
    d["openmp_threads"] = 0;  // built without OpenMP: one thread
#endif
    d["cpu_isa"] = fastrl::isa_name(fastrl::active_isa());
    d["cpu_isa_best"] = fastrl::isa_name(fastrl::best_isa());
    d["bf16_gemm"] = fastrl::gemm_bf16_supported();
    return d;
  });
}
