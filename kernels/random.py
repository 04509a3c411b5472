"""Counter-based randomness shared by the Triton kernels: Philox4x32-10 and the
exponential variate drawn from two of its words. Bit-for-bit the functions of
csrc/philox.h (see there for the derivation of the variate); the tests check
Philox against the published known-answer vectors."""

import triton
import triton.language as tl


@triton.jit
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Ten rounds of Philox4x32 on counter (c0..c3) under key (k0, k1); uint32 in and out."""
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c1 = a2 * 0xCD9E8D57
        c2 = tl.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c3 = a0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def exponential_variate(w0, w1):
    """Exp(1) variate -log(1 - U), U = w0 2^-32 + (w1 + 1/2) 2^-64 in (0, 1];
    a series below U = 1/16 keeps full relative precision for small E."""
    u = w0.to(tl.float32) * 2.3283064365386963e-10 + (w1.to(tl.float32) + 0.5) * 5.421010862427522e-20
    s = 0.125 * u + 0.14285714285714285
    s = s * u + 0.16666666666666666
    s = s * u + 0.2
    s = s * u + 0.25
    s = s * u + 0.3333333333333333
    s = s * u + 0.5
    s = s * u + 1.0
    return tl.where(u >= 0.0625, -tl.log(1.0 - u), s * u)
