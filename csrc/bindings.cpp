// pybind11 bindings of fastrl._C. Tensors cross as integers (data pointers)
// with sizes, strides and dtype codes, and CUDA streams as integers too, so the
// extension never links libtorch and one build serves every torch version. The
// GIL is released while a kernel runs (or is launched, on CUDA).
#include <pybind11/pybind11.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <cstdint>

#include "common.h"
#include "logprobs.h"

namespace py = pybind11;

namespace {

const void* cptr(std::uintptr_t p) { return reinterpret_cast<const void*>(p); }
void* mptr(std::uintptr_t p) { return reinterpret_cast<void*>(p); }

fastrl::LogprobsArgs logprobs_args(std::uintptr_t logits, int dtype, int64_t n_rows, int64_t vocab,
                                   int64_t row_stride, std::uintptr_t labels, int label_dtype,
                                   int64_t ignore_index, std::uintptr_t temps, double temp_scalar) {
  return {cptr(logits), dtype,       n_rows,     vocab,      row_stride, cptr(labels),
          label_dtype,  ignore_index, cptr(temps), temp_scalar};
}

const char* cpu_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return "x86-64-v4 (AVX-512)";
  if (__builtin_cpu_supports("avx2")) return "x86-64-v3 (AVX2)";
  return "x86-64 (SSE2)";
#else
  return "generic";
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastrl native kernels (CPU; CUDA when built with a toolkit)";

  m.def(
      "logprobs_forward",
      [](std::uintptr_t logits, int dtype, int64_t n_rows, int64_t vocab, int64_t row_stride,
         std::uintptr_t labels, int label_dtype, int64_t ignore_index, std::uintptr_t temps,
         double temp_scalar, std::uintptr_t out_logprob, std::uintptr_t out_entropy,
         std::uintptr_t out_stats) {
        fastrl::logprobs_forward(logprobs_args(logits, dtype, n_rows, vocab, row_stride, labels,
                                               label_dtype, ignore_index, temps, temp_scalar),
                                 mptr(out_logprob), mptr(out_entropy), mptr(out_stats));
      },
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "logprobs_backward",
      [](std::uintptr_t logits, int dtype, int64_t n_rows, int64_t vocab, int64_t row_stride,
         std::uintptr_t labels, int label_dtype, int64_t ignore_index, std::uintptr_t temps,
         double temp_scalar, std::uintptr_t stats, std::uintptr_t entropy,
         std::uintptr_t grad_logprob, std::uintptr_t grad_entropy, std::uintptr_t grad_out,
         int64_t grad_row_stride) {
        fastrl::logprobs_backward(logprobs_args(logits, dtype, n_rows, vocab, row_stride, labels,
                                                label_dtype, ignore_index, temps, temp_scalar),
                                  cptr(stats), cptr(entropy), cptr(grad_logprob),
                                  cptr(grad_entropy), mptr(grad_out), grad_row_stride);
      },
      py::call_guard<py::gil_scoped_release>());

#ifdef FASTRL_WITH_CUDA
  m.def(
      "logprobs_forward_cuda",
      [](std::uintptr_t logits, int dtype, int64_t n_rows, int64_t vocab, int64_t row_stride,
         std::uintptr_t labels, int label_dtype, int64_t ignore_index, std::uintptr_t temps,
         double temp_scalar, std::uintptr_t out_logprob, std::uintptr_t out_entropy,
         std::uintptr_t out_stats, std::uintptr_t stream) {
        fastrl::logprobs_forward_cuda(logprobs_args(logits, dtype, n_rows, vocab, row_stride, labels,
                                                    label_dtype, ignore_index, temps, temp_scalar),
                                      mptr(out_logprob), mptr(out_entropy), mptr(out_stats), stream);
      },
      py::call_guard<py::gil_scoped_release>());

  m.def(
      "logprobs_backward_cuda",
      [](std::uintptr_t logits, int dtype, int64_t n_rows, int64_t vocab, int64_t row_stride,
         std::uintptr_t labels, int label_dtype, int64_t ignore_index, std::uintptr_t temps,
         double temp_scalar, std::uintptr_t stats, std::uintptr_t entropy,
         std::uintptr_t grad_logprob, std::uintptr_t grad_entropy, std::uintptr_t grad_out,
         int64_t grad_row_stride, std::uintptr_t stream) {
        fastrl::logprobs_backward_cuda(logprobs_args(logits, dtype, n_rows, vocab, row_stride,
                                                     labels, label_dtype, ignore_index, temps,
                                                     temp_scalar),
                                       cptr(stats), cptr(entropy), cptr(grad_logprob),
                                       cptr(grad_entropy), mptr(grad_out), grad_row_stride, stream);
      },
      py::call_guard<py::gil_scoped_release>());
#endif

  m.def("build_info", []() {
    py::dict d;
#ifdef _OPENMP
    d["openmp_threads"] = omp_get_max_threads();
#else
    d["openmp_threads"] = 0;  // built without OpenMP: one thread
#endif
    d["cpu_isa"] = cpu_isa();
#ifdef FASTRL_WITH_CUDA
    d["cuda"] = true;
#else
    d["cuda"] = false;
#endif
    return d;
  });
}
