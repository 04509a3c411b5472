// Shared pieces of fastrl's native CPU kernels: dtype codes, element loads and
// stores, a vectorisable exp and the dtype dispatch (isa.h compiles the kernels per
// x86-64 level).
//
// The extension does not link libtorch. Python passes raw data pointers, sizes,
// strides and a dtype code (DType below), and each kernel switches on the code
// once per call.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>

namespace fastrl {

// Dtype codes, mirrored in fastrl/_native.py (DTYPE_CODES).
enum DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat64 = 3,
  kInt32 = 10,
  kInt64 = 11,
};

// bfloat16 and float16 are stored as their raw 16 bits and converted with
// integer and float operations that vectorise at every x86-64 level (GCC
// leaves the compiler's _Float16 conversions scalar in the gradient loops, and
// calls libgcc for them on the SSE2 baseline).
struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

#define FASTRL_INLINE inline __attribute__((always_inline))

FASTRL_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
FASTRL_INLINE uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// Loads widen to the accumulation type Acc (float, or double for float64 input).
template <typename Acc>
FASTRL_INLINE Acc load_as(const float* p, int64_t i) { return static_cast<Acc>(p[i]); }
template <typename Acc>
FASTRL_INLINE Acc load_as(const double* p, int64_t i) { return static_cast<Acc>(p[i]); }
// float16 -> float, exact: the 15 exponent-and-mantissa bits moved to a float's
// place and scaled by 2^112 (= 2^(127 - 15)), which rebiases the exponent and
// turns a float16 subnormal into the float it stands for; inf and NaN keep an
// all-ones exponent.
template <typename Acc>
FASTRL_INLINE Acc load_as(const F16* p, int64_t i) {
  const uint32_t h = p[i].bits;
  const uint32_t magnitude = (h & 0x7fffu) << 13;
  const uint32_t finite = float_to_bits(bits_to_float(magnitude) * 0x1p112f);
  const uint32_t u = (h & 0x7fffu) >= 0x7c00u ? (magnitude | 0x7f800000u) : finite;
  return static_cast<Acc>(bits_to_float(u | ((h & 0x8000u) << 16)));
}
template <typename Acc>
FASTRL_INLINE Acc load_as(const BF16* p, int64_t i) {
  return static_cast<Acc>(bits_to_float(static_cast<uint32_t>(p[i].bits) << 16));
}

// Stores narrow with round-to-nearest-even, as torch's .to(dtype) does.
template <typename Acc>
FASTRL_INLINE void store_from(float* p, int64_t i, Acc v) { p[i] = static_cast<float>(v); }
template <typename Acc>
FASTRL_INLINE void store_from(double* p, int64_t i, Acc v) { p[i] = static_cast<double>(v); }
// float -> float16 with round-to-nearest-even: a NaN stays a (quiet) NaN, from
// 65520 up rounds to inf, below 2^-14 the float addition of 0.5 rounds the
// subnormal's mantissa into the low bits, and a normal value is rebiased with
// the dropped 13 bits rounded to even as for bfloat16.
template <typename Acc>
FASTRL_INLINE void store_from(F16* p, int64_t i, Acc v) {
  const uint32_t u = float_to_bits(static_cast<float>(v));
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t subnormal = float_to_bits(bits_to_float(a) + 0.5f) - 0x3f000000u;
  const uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;  // 0xc8000000: (15 - 127) << 23
  const uint32_t h = a > 0x7f800000u ? 0x7e00u : a >= 0x477ff000u ? 0x7c00u : a < 0x38800000u ? subnormal : normal;
  p[i].bits = static_cast<uint16_t>(h | ((u >> 16) & 0x8000u));
}
template <typename Acc>
FASTRL_INLINE void store_from(BF16* p, int64_t i, Acc v) {
  const uint32_t u = float_to_bits(static_cast<float>(v));
  const bool is_nan = (u & 0x7fffffffu) > 0x7f800000u;
  // Adding 0x7fff plus the lowest kept bit rounds the dropped half to even.
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  p[i].bits = static_cast<uint16_t>(is_nan ? 0x7fc0u : rounded);
}

// exp(x) for x <= 20 (or NaN) in float, written so that the compiler vectorises
// it inside simd loops (libm's expf is a scalar call). The softmax kernels pass
// a logit minus the row max, scaled by 1/T > 0, so x <= 0; the policy and KL
// kernels a log-ratio clamped to [-20, 20]. Nothing clamps the top: 2^n stays
// a normal float up to x = 88. Range reduction x = n ln2 + r with |r| <= ln2 / 2, a degree-6
// polynomial for e^r (the classic Cephes expf coefficients, about 1 ulp), and
// 2^n assembled in the exponent bits. Below -87.3 the result would be
// subnormal; it is flushed to 0, which changes no sum of exponentials here by
// more than 1e-38 of its value. exp(-inf) = 0; NaN propagates.
FASTRL_INLINE float exp_approx(float x) {
  const float lo = -87.3f;
  const float xc = x < lo ? lo : x;  // NaN fails the test and stays NaN
  // Round x/ln2 to the nearest integer with the 1.5 * 2^23 shifter trick,
  // which needs no rounding instruction.
  const float shifter = 12582912.0f;
  const float t = xc * 1.44269504088896341f + shifter;
  const float n = t - shifter;
  const int32_t ni = static_cast<int32_t>(float_to_bits(t) - float_to_bits(shifter));
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 split hi + lo
  // The polynomial in Estrin's form: three independent pairs joined through r^2,
  // a dependency chain of 3 multiply-adds where Horner's form has 6 (the row
  // loops are bound by this chain's latency, not by their instruction count).
  const float r2 = r * r;
  const float p01 = 1.6666665459e-1f * r + 5.0000001201e-1f;
  const float p23 = 8.3334519073e-3f * r + 4.1665795894e-2f;
  const float p45 = 1.9875691500e-4f * r + 1.3981999507e-3f;
  const float p = (p45 * r2 + p23) * r2 + p01;
  const float e = p * r2 + r + 1.0f;
  const float scale = bits_to_float(static_cast<uint32_t>(ni + 127) << 23);
  const float res = e * scale;
  return x < lo ? 0.0f : res;
}
FASTRL_INLINE double exp_approx(double x) { return std::exp(x); }

// cond ? a : b as bit operations, for token loops that must vectorise: as a
// ternary, GCC moves a load that feeds only one side under a branch, and a
// loop with a conditional load stays scalar where the ISA has no masked load.
FASTRL_INLINE float select_bits(bool cond, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(cond);
  return bits_to_float((float_to_bits(a) & m) | (float_to_bits(b) & ~m));
}
FASTRL_INLINE double select_bits(bool cond, double a, double b) {
  uint64_t ua, ub;
  std::memcpy(&ua, &a, sizeof a);
  std::memcpy(&ub, &b, sizeof b);
  const uint64_t m = 0ull - static_cast<uint64_t>(cond), u = (ua & m) | (ub & ~m);
  double r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}

template <typename Acc>
constexpr Acc neg_inf() { return -std::numeric_limits<Acc>::infinity(); }
template <typename Acc>
constexpr Acc quiet_nan() { return std::numeric_limits<Acc>::quiet_NaN(); }

// Reads label i as int64 whichever integer type the caller passed.
FASTRL_INLINE int64_t load_label(const void* labels, int label_dtype, int64_t i) {
  return label_dtype == kInt32 ? static_cast<const int32_t*>(labels)[i]
                               : static_cast<const int64_t*>(labels)[i];
}

[[noreturn]] inline void fail(const std::string& what) { throw std::invalid_argument(what); }

// Runs CALL with In (the logits' element type) and Acc (its accumulation type)
// bound from a logits dtype code; WHAT names the entry point in the error.
#define FASTRL_DISPATCH_LOGITS(DTYPE, WHAT, CALL)                                         \
  switch (DTYPE) {                                                                        \
    case kFloat32: { using In = float; using Acc = float; CALL; break; }                  \
    case kFloat16: { using In = F16; using Acc = float; CALL; break; }                    \
    case kBFloat16: { using In = BF16; using Acc = float; CALL; break; }                  \
    case kFloat64: { using In = double; using Acc = double; CALL; break; }                \
    default: fail(std::string(WHAT) + ": unsupported logits dtype code " + std::to_string(DTYPE)); \
  }

// The same for per-token tensors, which arrive in the accumulation type itself.
#define FASTRL_DISPATCH_ACC(DTYPE, WHAT, CALL)                                            \
  switch (DTYPE) {                                                                        \
    case kFloat32: { using Acc = float; CALL; break; }                                    \
    case kFloat64: { using Acc = double; CALL; break; }                                   \
    default: fail(std::string(WHAT) + ": unsupported dtype code " + std::to_string(DTYPE)); \
  }

}  // namespace fastrl
