"""Order-preserving integer keys of the logits (key(a) < key(b) iff a < b, the
same keys as csrc/sampling.cpp), their top digits (the bins of the top-digit
histogram), and the key and counter words of the race's Philox draws
(``_race_key``): the counter's first word is the token's vocabulary index."""

from __future__ import annotations

import triton
import triton.language as tl

from .params import _row_param

# The top digit of a key: its 12 highest bits (_top_digit_of).
_BINS = tl.constexpr(4096)


@triton.jit
def _order_key(x):
    """Unsigned integer keys ordered as the logits: uint32 for fp32 (and the 16-bit
    types, widened to it), uint64 for fp64, so that every compare of a key is one
    instruction of the element's width; -0.0 and +0.0 share a key. A negative
    logit's bits are all flipped, a positive one's sign bit alone: XOR with the
    sign bit spread by an arithmetic shift, OR the sign bit (two instructions, no
    compare and select)."""
    if x.dtype == tl.float64:
        b = (x + 0.0).to(tl.int64, bitcast=True)
        return (b ^ ((b >> 63) | -9223372036854775808)).to(tl.uint64, bitcast=True)
    else:
        b = (x + 0.0).to(tl.int32, bitcast=True)
        return (b ^ ((b >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def _key_to_value(key, ACC: tl.constexpr):
    """The logit whose key is ``key`` (the inverse of _order_key)."""
    if ACC == tl.float64:
        return tl.where((key >> 63) == 1, key & 0x7FFFFFFFFFFFFFFF, key ^ 0xFFFFFFFFFFFFFFFF).to(tl.float64, bitcast=True)
    else:
        return tl.where((key >> 31) == 1, key & 0x7FFFFFFF, key ^ 0xFFFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _top_digit_of(key):
    """The top digit of _order_key's keys: their 12 highest bits (the sign, the
    exponent and, for 32-bit keys, 3 mantissa bits), a bin of _BINS."""
    SHIFT: tl.constexpr = key.dtype.primitive_bitwidth - 12
    return (key >> SHIFT).to(tl.int32)


@triton.jit
def _digit_edge(digit, ACC: tl.constexpr, HIGHEST: tl.constexpr = False):
    """The logit of the lowest key whose top digit (_top_digit_of) is ``digit``
    (HIGHEST: of the highest key). Digits 0 to 7 start at NaN bits (-inf is the
    top of digit 7); from 8 up it is the lowest logit of the digit."""
    KEY: tl.constexpr = tl.uint64 if ACC == tl.float64 else tl.uint32
    SHIFT: tl.constexpr = KEY.primitive_bitwidth - 12
    key = digit.to(KEY) << SHIFT
    if HIGHEST:
        key |= (tl.full([], 1, KEY) << SHIFT) - 1
    return _key_to_value(key, ACC)


@triton.jit
def _race_key(row, seeds_ptr, seed, offset_ptr, offset, PER_ROW_SEED: tl.constexpr, OFFSET_FROM_PTR: tl.constexpr):
    """The race's Philox key and counter words but the first (the vocabulary index): (k0, k1) =
    the row's seed, then (salt, offset low, offset high), salt = the row for a batch-wide seed
    and 0 for per-row seeds (fastrl/sampling.py)."""
    row_seed = _row_param(seeds_ptr, seed, row, PER_ROW_SEED, tl.int64)
    k0 = (row_seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((row_seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    salt = tl.where(PER_ROW_SEED, 0, row).to(tl.uint32)
    off = _row_param(offset_ptr, offset, 0, OFFSET_FROM_PTR, tl.int64)
    return k0, k1, salt, (off & 0xFFFFFFFF).to(tl.uint32), ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
