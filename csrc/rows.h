// Row addressing of the kernels' interfaces. The logits arrive as an
// [outer, inner, V] strided view of the caller's tensor (fastrl/logprobs.py,
// row_view): rows are numbered row-major over the two leading dims, and a
// row's V elements have unit stride. Two leading strides read every layout that the frameworks slice in
// place, such as veRL's logits[:, -response_length - 1:-1] or a transposed
// [S, B, V], without copying it; a plain [N, V] tensor is outer = 1, inner = N.
#pragma once

#include <cstdint>

namespace fastrl {

struct RowLayout {
  int64_t inner;         // rows per outer index (>= 1)
  int64_t outer_stride;  // elements between outer indices
  int64_t inner_stride;  // elements between consecutive inner indices

  // Elements from the base pointer to the start of row r (int64: 32768 rows of
  // 151936 logits are more than 2^31 elements).
  int64_t offset(int64_t r) const { return (r / inner) * outer_stride + (r % inner) * inner_stride; }
};

}  // namespace fastrl
