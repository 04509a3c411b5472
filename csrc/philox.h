// Counter-based randomness of the CPU samplers: Philox4x32-10
// (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), and the
// exponential variate the samplers draw from two of its words. The Triton
// kernels implement the same functions (kernels/random.py); tests check both
// against the published known-answer vectors.
#pragma once

#include <cmath>
#include <cstdint>

#include "common.h"

namespace fastrl {

struct Words4 {
  uint32_t w[4];
};

// Ten rounds of Philox4x32 on counter c under key (k0, k1).
FASTRL_INLINE Words4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                               uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0;
    const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2;
    const uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    const uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return {{c0, c1, c2, c3}};
}

// An Exp(1) variate E = -log(1 - U) from two random words, U = w0 2^-32 +
// (w1 + 1/2) 2^-64 in (0, 1]. U is resolved to 2^-65 near 0, so E reaches down
// to ~2^-65 and a token of any probability above ~1e-15 can win an exponential
// race at its exact rate. For U < 1/16, where 1 - U would lose the low bits of
// U, E comes from the series U + U^2/2 + ... + U^8/8 (truncation < 1e-10
// relative); U = 1 (a 2^-25 chance) gives E = inf, a draw that loses the race.
FASTRL_INLINE float exponential_variate(uint32_t w0, uint32_t w1) {
  const float u = static_cast<float>(w0) * 2.3283064365386963e-10f +
                  (static_cast<float>(w1) + 0.5f) * 5.421010862427522e-20f;
  if (u >= 0.0625f) return -logf(1.0f - u);
  float s = 0.125f;
  s = s * u + 0.14285714285714285f;
  s = s * u + 0.16666666666666666f;
  s = s * u + 0.2f;
  s = s * u + 0.25f;
  s = s * u + 0.3333333333333333f;
  s = s * u + 0.5f;
  s = s * u + 1.0f;
  return s * u;
}

}  // namespace fastrl
