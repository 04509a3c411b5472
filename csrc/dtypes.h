// Dtype codes shared by the CPU and CUDA kernels and mirrored in
// fastrl/_native.py (DTYPE_CODES). Plain C++, so nvcc can include it too.
#pragma once

#include <cstdint>

namespace fastrl {

enum DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat64 = 3,
  kInt32 = 10,
  kInt64 = 11,
};

}  // namespace fastrl
