// A float32-output GEMM of bfloat16 operands for the fused LM head on CPU.
//
// torch has no CPU GEMM that takes bf16 operands and returns the float32 sums
// (aten::mm.dtype is CUDA-only): its bf16 mm rounds every output to bf16, and
// rounding the logits (or a vocabulary slab's share of a gradient) to bf16 is
// exactly what the fused head must not do. The alternative, widening the
// operands to float32, runs the float32 GEMM at half the speed of the bf16 dot
// product instruction. This GEMM multiplies bf16 pairs with AVX512-BF16
// (vdpbf16ps: two exact bf16 products added to a float32 lane) and keeps every
// sum in float32.
#pragma once

#include <cstdint>

namespace fastrl {

// An operand of the GEMM: element (r, k) at data[r * row_stride + k * k_stride]
// (r: the output row for A, the output column for B; k: the summed index), in
// elements of dtype (kBFloat16, or kFloat32, rounded to bf16 to nearest even
// when packed: the gradient blocks the backward forms in float32).
struct GemmOperand {
  const void* data;
  int dtype;
  int64_t row_stride;
  int64_t k_stride;
};

// True where the CPU has AVX512-BF16 (and the build has the kernel).
bool gemm_bf16_supported();

// C[m, n] = sum_k A(m, k) B(n, k), or C[m, n] += that sum when accumulate, for
// m < M, n < N, k < K; C[m, n] at c[m * c_row + n * c_col] (float32). Each
// product of two bf16 is exact in float32. The sum: per block of 256 k a
// float32 partial from zero, vdpbf16ps adding the products one at a time (the
// two of a pair in the instruction's order), rounding to nearest even; then the
// partials added to C (to its old value with accumulate) in k order, so the
// order depends on the shapes alone, not on the layouts or the thread count.
// vdpbf16ps ignores MXCSR: bf16 subnormal operands are read as zero (so a
// subnormal times inf is NaN) and subnormal sums flushed to zero. A NaN operand
// gives a NaN (its payload is not kept). Throws std::runtime_error where
// gemm_bf16_supported() is false.
void gemm_bf16(const GemmOperand& a, const GemmOperand& b, float* c, int64_t c_row, int64_t c_col,
               int64_t m, int64_t n, int64_t k, bool accumulate);

}  // namespace fastrl
