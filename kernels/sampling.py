"""Sampling with log-probs, and truncated log-probs: Triton kernels and launchers.

One program per row; the processed distribution is the spec's
(fastrl/reference.py, truncated_log_distribution). Every filter keeps the tokens
at or above a threshold logit, and the thresholds are found without sorting:

    keys      unsigned order-preserving integers of the logits (key(a) < key(b)
              iff a < b), the same keys as csrc/sampling.cpp;
    top-k     the largest key u with #{key >= u} >= k (the k-th largest key);
    top-p     the largest key u with mass(key >= u) >= p * (top-k mass), among the
              top-k keys; the kept set {key >= u} is exactly the tokens whose mass
              strictly above is < p * (top-k mass);
    min-p     kept iff (x - m) / T >= log(min_p), per token;
    sample    an exponential race over the kept tokens, argmax (x - m) / T - log E
              with E ~ Exp(1) from Philox (kernels/random.py), which picks a token
              with its processed probability; ties go to the lowest index.

Top-k on 32-bit keys (fp32, bf16, fp16 logits) is a radix selection
(``_kth_largest_key32``): three passes, each a histogram of the next digit of
the keys that share the digits found so far (12, 12, 8 bits). Top-p, and top-k
on float64 keys, use ``_largest_key_reaching``: a 16-way descent on the key, 4
bits per pass, each pass testing 16 pivots against the row at once (8 passes for
32-bit keys, 16 for float64). Both find the same key, so the kept set does not
depend on which ran. Rows of the canonical sizes stay in L2 between passes.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from fastrl._rows import row_count, row_layout

from .random import exponential_variate, philox4x32_10
from .reduce import row_start

_MAX_BLOCK_V = 4096
# The digit search tests 16 pivots per element, a [block, 16] tile: a smaller
# block keeps it in registers.
_MAX_SEARCH_BLOCK = 512


def _launch_config(vocab: int) -> dict:
    """Block sizes and warps for a row of ``vocab`` logits (V only, never the batch)."""
    block = min(triton.next_power_of_2(vocab), _MAX_BLOCK_V)
    return {"BLOCK_V": block, "SEARCH_BLOCK": min(block, _MAX_SEARCH_BLOCK), "num_warps": 8 if block >= 2048 else 4}


def _acc(logits: torch.Tensor) -> tuple[torch.dtype, tl.dtype]:
    return (torch.float64, tl.float64) if logits.dtype == torch.float64 else (torch.float32, tl.float32)


@triton.jit
def _order_key(x):
    """Unsigned integer keys ordered as the logits: uint32 for fp32 (and the 16-bit
    types, widened to it), uint64 for fp64, so that every compare of a key is one
    instruction of the element's width; -0.0 and +0.0 share a key. Bits are
    flipped by XOR with all ones rather than ``~``: triton 3.6's interpreter builds
    ``~`` of an unsigned tensor from a -1 that numpy 2 refuses to cast to it."""
    if x.dtype == tl.float64:
        b = (x + 0.0).to(tl.uint64, bitcast=True)
        return tl.where((b >> 63) == 1, b ^ 0xFFFFFFFFFFFFFFFF, b | 0x8000000000000000)
    else:
        b = (x + 0.0).to(tl.uint32, bitcast=True)
        return tl.where((b >> 31) == 1, b ^ 0xFFFFFFFF, b | 0x80000000)


@triton.jit
def _key_to_value(key, ACC: tl.constexpr):
    """The logit whose key is ``key`` (the inverse of _order_key)."""
    if ACC == tl.float64:
        return tl.where((key >> 63) == 1, key & 0x7FFFFFFFFFFFFFFF, key ^ 0xFFFFFFFFFFFFFFFF).to(tl.float64, bitcast=True)
    else:
        return tl.where((key >> 31) == 1, key & 0x7FFFFFFF, key ^ 0xFFFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _largest_key_reaching(row_ptr, V, m, inv_t, floor_key, target, WEIGHTED: tl.constexpr,
                          BLOCK: tl.constexpr, ACC: tl.constexpr):
    """The largest key u with F(u) >= target, where F(u) counts (or, WEIGHTED,
    sums e_j = exp((x_j - m) / T) over) the tokens with key >= max(u, floor_key).
    F is non-increasing, so a descent digit by digit (16 pivots per pass, most
    significant first) keeps the largest pivot that still reaches the target."""
    KEY_BITS: tl.constexpr = 64 if ACC == tl.float64 else 32
    KEY: tl.constexpr = tl.uint64 if ACC == tl.float64 else tl.uint32  # _order_key's type
    digits = tl.arange(0, 16).to(KEY)
    prefix = tl.zeros([], KEY)
    for level in tl.static_range(KEY_BITS // 4):
        shift = KEY_BITS - 4 * (level + 1)  # a constexpr: level is one in static_range
        pivots = prefix + (digits << shift)
        if WEIGHTED:
            reach = tl.zeros([16], ACC)
        else:
            reach = tl.zeros([16], tl.int64)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(ACC)
            key = _order_key(x)
            live = (offs < V) & (key >= floor_key)
            above = (key[:, None] >= pivots[None, :]) & live[:, None]
            if WEIGHTED:
                e = tl.exp((x - m) * inv_t)
                reach += tl.sum(tl.where(above, e[:, None], 0.0), axis=0)
            else:
                reach += tl.sum(above.to(tl.int64), axis=0)
        best = tl.max(tl.where(reach >= target, digits, 0), axis=0)
        prefix = prefix + (best << shift)
    return prefix


@triton.jit
def _digit_histogram(row_ptr, V, floor_key, prefix, PREFIX_SHIFT: tl.constexpr, DIGIT_SHIFT: tl.constexpr,
                     BINS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Counts [BINS] of the digit (key >> DIGIT_SHIFT) % BINS over the row's 32-bit
    keys >= floor_key whose bits above PREFIX_SHIFT equal ``prefix``. The keys left
    out are masked out of the histogram (not sent to a bin of their own: on a GPU
    the histogram adds with shared-memory atomics, and most of a later pass's keys
    are left out, so one bin would serialise every warp's adds)."""
    counts = tl.zeros([BINS], tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        key = _order_key(tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32))
        live = (offs < V) & (key >= floor_key)
        if PREFIX_SHIFT < 32:
            live &= (key >> PREFIX_SHIFT) == prefix
        digit = ((key >> DIGIT_SHIFT) & (BINS - 1)).to(tl.int32)
        counts += tl.histogram(digit, BINS, mask=live)
    return counts


@triton.jit
def _top_digit(counts, k, BINS: tl.constexpr):
    """(d, k'): the largest digit d whose bin and the bins above hold >= k keys, and
    k' = k less the keys above d (the rank of the answer within bin d)."""
    bins = tl.arange(0, BINS)
    at_or_above = tl.sum(counts, axis=0) - tl.cumsum(counts, 0) + counts
    d = tl.max(tl.where(at_or_above >= k, bins, 0), axis=0)
    above = tl.sum(tl.where(bins > d, counts, 0), axis=0)
    return d.to(tl.uint32), k - above


@triton.jit
def _kth_largest_key32(row_ptr, V, floor_key, k, BLOCK: tl.constexpr):
    """The k-th largest 32-bit key of the row among keys >= floor_key (0 < k <= their
    count): the largest key u with #{key >= max(u, floor_key)} >= k, as
    _largest_key_reaching counts it, by radix selection in three passes: a
    histogram of the top 12 bits, then of the next 12 among the keys in the chosen
    bin, then of the last 8 among those left; each pass fixes a digit of the answer."""
    counts = _digit_histogram(row_ptr, V, floor_key, 0, 32, 20, 4096, BLOCK)
    d1, k = _top_digit(counts, k, 4096)
    counts = _digit_histogram(row_ptr, V, floor_key, d1, 20, 8, 4096, BLOCK)
    d2, k = _top_digit(counts, k, 4096)
    prefix = (d1 << 12) | d2
    counts = _digit_histogram(row_ptr, V, floor_key, prefix, 8, 0, 256, BLOCK)
    d3, _ = _top_digit(counts, k, 256)
    return (prefix << 8) | d3


@triton.jit
def _row_param(ptr, scalar, row, PER_ROW: tl.constexpr, DTYPE: tl.constexpr):
    """This row's value of a parameter: ptr[row], or the scalar. A float scalar
    arrives as the int64 bits of its float64 value (``_scalar_arg``) and is
    rounded once to DTYPE here, as the C++ kernels' cast does."""
    if PER_ROW:
        return tl.load(ptr + row).to(DTYPE)
    elif DTYPE == tl.int64:
        return tl.full([], scalar, DTYPE)
    else:
        return tl.full([], scalar, tl.int64).to(tl.float64, bitcast=True).to(DTYPE)


@triton.jit
def _row_params(row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
                PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr,
                PER_ROW_MIN_P: tl.constexpr, ACC: tl.constexpr):
    """This row's (T, top_k, top_p, min_p, whether they are all valid). T is 0
    (greedy) or positive with a finite 1/T: the kernels scale by 1/T, and an
    infinite one would make the max's (x - m) / T = 0 * inf NaN."""
    t = _row_param(temps_ptr, temp, row, PER_ROW_T, ACC)
    k = _row_param(top_k_ptr, top_k, row, PER_ROW_K, tl.int64)
    p = _row_param(top_p_ptr, top_p, row, PER_ROW_P, ACC)
    mp = _row_param(min_p_ptr, min_p, row, PER_ROW_MIN_P, ACC)
    t_ok = (t == 0) | ((t > 0) & (t < float("inf")) & (1.0 / t < float("inf")))
    valid = t_ok & (k >= 0) & (p > 0) & (p <= 1) & (mp >= 0) & (mp <= 1)
    return t, k, p, mp, valid


@triton.jit
def _select(row_ptr, V, t, k, p, min_p, valid, BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
            ACC: tl.constexpr):
    """Everything about one row's processed distribution: (bad, greedy, m, first
    argmax, number of maxima, 1/T, log s, threshold key, log min_p, log s_kept)
    with s = sum_j e_j over the row, e_j = exp((x_j - m) / T), and s_kept over
    the kept tokens (key >= threshold and (x - m) / T >= log min_p). A row is bad
    (nothing to sample) with a NaN, a +inf (m = inf: softmax is NaN), only -inf
    (m = -inf), or an invalid parameter."""
    neg_inf = float("-inf")
    m = tl.full([], neg_inf, ACC)
    arg = tl.full([], 0, tl.int64)
    n_max = tl.zeros([], tl.int64)
    has_nan = tl.zeros([], tl.int1)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=neg_inf).to(ACC)
        has_nan |= tl.max((x != x).to(tl.int32), axis=0) > 0
        b_max = tl.max(x, axis=0)
        b_arg = tl.min(tl.where(x == b_max, offs, V), axis=0).to(tl.int64)
        b_cnt = tl.sum((x == b_max).to(tl.int64), axis=0)
        n_max = tl.where(b_max > m, b_cnt, tl.where(b_max == m, n_max + b_cnt, n_max))
        arg = tl.where(b_max > m, b_arg, arg)
        m = tl.maximum(m, b_max)
    bad = has_nan | (m == neg_inf) | (m == float("inf")) | (~valid)
    greedy = t == 0
    inv_t = tl.where(greedy | bad, 1.0, 1.0 / t).to(ACC)
    m_safe = tl.where(bad, 0.0, m).to(ACC)

    s = tl.zeros([], ACC)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=neg_inf).to(ACC)
        s += tl.sum(tl.exp((x - m_safe) * inv_t), axis=0)

    active = (~bad) & (~greedy)
    threshold = _order_key(tl.full([], neg_inf, ACC))  # keeps every non-NaN logit
    if active & (k > 0) & (k < V):
        if ACC == tl.float64:
            threshold = _largest_key_reaching(row_ptr, V, m_safe, inv_t, threshold, k, False, SEARCH_BLOCK, ACC)
        else:
            threshold = _kth_largest_key32(row_ptr, V, threshold, k, BLOCK_V)
    if active & (p < 1):
        top_k_mass = tl.zeros([], ACC)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            x = tl.load(row_ptr + offs, mask=offs < V, other=neg_inf).to(ACC)
            top_k_mass += tl.sum(tl.where(_order_key(x) >= threshold, tl.exp((x - m_safe) * inv_t), 0.0), axis=0)
        target = p.to(ACC) * top_k_mass
        threshold = _largest_key_reaching(row_ptr, V, m_safe, inv_t, threshold, target, True, SEARCH_BLOCK, ACC)

    log_min_p = tl.where(min_p > 0, tl.log(min_p.to(ACC)), neg_inf).to(ACC)
    s_kept = tl.zeros([], ACC)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=neg_inf).to(ACC)
        d = (x - m_safe) * inv_t
        kept = (_order_key(x) >= threshold) & (d >= log_min_p)
        s_kept += tl.sum(tl.where(kept, tl.exp(d), 0.0), axis=0)
    return bad, greedy, m_safe, arg, n_max, inv_t, tl.log(s), threshold, log_min_p, tl.log(s_kept)


@triton.jit
def _sample_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
    seeds_ptr, seed, offset_ptr, offset,
    tokens_ptr, logprobs_ptr, raw_ptr,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    PER_ROW_SEED: tl.constexpr, OFFSET_FROM_PTR: tl.constexpr, BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    bad, greedy, m, arg, n_max, inv_t, log_s, threshold, log_min_p, log_s_kept = _select(
        row_ptr, V, *_row_params(
            row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
            PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC,
        ), BLOCK_V, SEARCH_BLOCK, ACC,
    )  # fmt: skip

    # Philox key = the row's seed; counter = (vocab index, salt, offset).
    row_seed = _row_param(seeds_ptr, seed, row, PER_ROW_SEED, tl.int64)
    k0 = (row_seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((row_seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    salt = tl.where(PER_ROW_SEED, 0, row).to(tl.uint32)
    off = _row_param(offset_ptr, offset, 0, OFFSET_FROM_PTR, tl.int64)
    c2 = (off & 0xFFFFFFFF).to(tl.uint32)
    c3 = ((off >> 32) & 0xFFFFFFFF).to(tl.uint32)
    best = tl.full([], float("-inf"), ACC)
    winner = arg  # only if every kept draw lost (E = inf, ~2^-25 each)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(ACC)
        d = (x - m) * inv_t
        kept = (_order_key(x) >= threshold) & (d >= log_min_p) & (offs < V)
        zeros = tl.zeros([BLOCK_V], tl.uint32)
        w0, w1, _, _ = philox4x32_10(offs.to(tl.uint32), zeros + salt, zeros + c2, zeros + c3, zeros + k0, zeros + k1)
        race = tl.where(kept, d - tl.log(exponential_variate(w0, w1).to(ACC)), float("-inf"))
        b_best = tl.max(race, axis=0)
        b_arg = tl.min(tl.where(race == b_best, offs, V), axis=0).to(tl.int64)
        winner = tl.where(b_best > best, b_arg, winner)
        best = tl.maximum(best, b_best)
    winner = tl.where(greedy, arg, winner)
    d_win = (tl.load(row_ptr + winner, mask=~bad, other=0.0).to(ACC) - m) * inv_t  # a bad row's winner may be anything
    logprob = tl.where(greedy, 0.0, d_win - log_s_kept)
    raw = tl.where(greedy, -tl.log(n_max.to(ACC)), d_win - log_s)
    tl.store(tokens_ptr + row, tl.where(bad, -1, winner))
    tl.store(logprobs_ptr + row, tl.where(bad, float("nan"), logprob))
    tl.store(raw_ptr + row, tl.where(bad, float("nan"), raw))


@triton.jit
def _truncated_fwd_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V, labels_ptr,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
    out_ptr, stats_ptr,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    WITH_STATS: tl.constexpr, BLOCK_V: tl.constexpr, SEARCH_BLOCK: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    bad, greedy, m, arg, n_max, inv_t, log_s, threshold, log_min_p, log_s_kept = _select(
        row_ptr, V, *_row_params(
            row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
            PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC,
        ), BLOCK_V, SEARCH_BLOCK, ACC,
    )  # fmt: skip
    label = tl.load(labels_ptr + row).to(tl.int64)
    in_range = (label >= 0) & (label < V)
    x = tl.load(row_ptr + label, mask=in_range, other=0.0).to(ACC)
    d = (x - m) * inv_t
    kept = (_order_key(x) >= threshold) & (d >= log_min_p)
    lp = tl.where(kept, d - log_s_kept, float("-inf"))
    lp = tl.where(greedy, tl.where(label == arg, 0.0, float("-inf")), lp)
    tl.store(out_ptr + row, tl.where(bad | (~in_range), float("nan"), lp))
    if WITH_STATS:
        tl.store(stats_ptr + 3 * row, m)
        tl.store(stats_ptr + 3 * row + 1, tl.where(bad, float("nan"), log_s_kept))
        tl.store(stats_ptr + 3 * row + 2, _key_to_value(threshold, ACC))


@triton.jit
def _truncated_bwd_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V, labels_ptr, stats_ptr, grad_logprob_ptr,
    grad_ptr, grad_inner, grad_outer_stride, grad_inner_stride,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    grad_row_ptr = row_start(grad_ptr, row, grad_inner, grad_outer_stride, grad_inner_stride)
    t, k, p, mp, valid = _row_params(
        row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
        PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC,
    )  # fmt: skip
    m = tl.load(stats_ptr + 3 * row).to(ACC)
    log_s_kept = tl.load(stats_ptr + 3 * row + 1).to(ACC)
    threshold = _order_key(tl.load(stats_ptr + 3 * row + 2).to(ACC))
    inv_t = tl.where(t > 0, 1.0 / t, 0.0).to(ACC)
    log_min_p = tl.where(mp > 0, tl.log(mp), float("-inf")).to(ACC)
    label = tl.load(labels_ptr + row).to(tl.int64)
    in_range = (label >= 0) & (label < V)
    x_label = tl.load(row_ptr + label, mask=in_range, other=0.0).to(ACC)
    label_kept = in_range & (_order_key(x_label) >= threshold) & ((x_label - m) * inv_t >= log_min_p) & (t > 0)
    g = tl.load(grad_logprob_ptr + row).to(ACC)
    # Zero where the log-prob is a constant (greedy rows, labels outside the
    # kept set); NaN rows stay NaN.
    scale = tl.where(label_kept, g * inv_t, 0.0)
    scale = tl.where((m != m) | (log_s_kept != log_s_kept) | (~valid), float("nan"), scale)
    # The label as a 32-bit index like the offsets (-1 when outside the row, where
    # the scale is 0 anyway): one compare per element, not a 64-bit pair.
    label_in_row = tl.where(in_range, label, -1).to(tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.load(row_ptr + offs, mask=mask, other=float("-inf")).to(ACC)
        d = (x - m) * inv_t
        kept = (_order_key(x) >= threshold) & (d >= log_min_p)
        q = tl.where(kept, tl.exp(d - log_s_kept), 0.0)
        grad = scale * (tl.where(offs == label_in_row, 1.0, 0.0) - q)
        grad = tl.where(scale == 0, 0.0, grad)
        tl.store(grad_row_ptr + offs, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def _scalar_arg(value: int | float) -> int:
    """A scalar parameter as the kernels take it. Triton passes a Python float as
    float32, which would round a float64 kernel's T, top-p and min-p; a float
    goes as the int64 bits of its float64 value instead (``_row_param``)."""
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return value


def _params(temperature, top_k, top_p, min_p) -> tuple[list, dict]:
    """Kernel arguments (pointer-or-None, scalar) per parameter, and the PER_ROW_* flags."""
    args, flags = [], {}
    for value, flag in ((temperature, "PER_ROW_T"), (top_k, "PER_ROW_K"), (top_p, "PER_ROW_P"), (min_p, "PER_ROW_MIN_P")):
        per_row = isinstance(value, torch.Tensor)
        args += [value if per_row else None, 0 if per_row else _scalar_arg(value)]
        flags[flag] = per_row
    return args, flags


def sample_forward(logits, *, temperature, top_k, top_p, min_p, seed, offset):
    """One draw per row of ``logits`` [N, V] or [outer, inner, V] (unit stride in V,
    any leading strides: ``fastrl._rows.row_layout``): (tokens int64
    [N], log-probs under the processed distribution [N], raw log-probs [N]).
    Parameters are scalars or flat per-row tensors (accumulation dtype, int64
    for top_k); ``seed`` an int64 or int64 [N] per-row seeds; ``offset`` an int
    or a one-element int64 tensor read on the device."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    acc, acc_tl = _acc(logits)
    tokens = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(n_rows, dtype=acc, device=logits.device)
    raw = torch.empty(n_rows, dtype=acc, device=logits.device)
    args, flags = _params(temperature, top_k, top_p, min_p)
    per_row_seed, offset_from_ptr = isinstance(seed, torch.Tensor), isinstance(offset, torch.Tensor)
    _sample_kernel[(n_rows,)](
        logits, *row_layout(logits), vocab, *args,
        seed if per_row_seed else None, 0 if per_row_seed else seed,
        offset if offset_from_ptr else None, 0 if offset_from_ptr else offset,
        tokens, logprobs, raw, **flags, PER_ROW_SEED=per_row_seed, OFFSET_FROM_PTR=offset_from_ptr,
        ACC=acc_tl, **_launch_config(vocab),
    )  # fmt: skip
    return tokens, logprobs, raw


def truncated_forward(logits, labels, *, temperature, top_k, top_p, min_p, with_stats):
    """(log-prob of ``labels`` under the processed distribution [N], stats [N, 3]
    = per row (max logit, log kept mass, threshold logit) for the backward, or None)."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    acc, acc_tl = _acc(logits)
    out = torch.empty(n_rows, dtype=acc, device=logits.device)
    stats = torch.empty(n_rows, 3, dtype=acc, device=logits.device) if with_stats else None
    args, flags = _params(temperature, top_k, top_p, min_p)
    _truncated_fwd_kernel[(n_rows,)](
        logits, *row_layout(logits), vocab, labels, *args, out, stats, **flags,
        WITH_STATS=with_stats, ACC=acc_tl, **_launch_config(vocab),
    )  # fmt: skip
    return out, stats


def truncated_backward(logits, labels, stats, grad_logprob, grad_out, *, temperature, top_k, top_p, min_p):
    """Writes dL/dlogits into ``grad_out`` (the logits' rows, in its own layout)
    with the kept set held fixed."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    _, acc_tl = _acc(logits)
    args, flags = _params(temperature, top_k, top_p, min_p)
    config = _launch_config(vocab)
    _truncated_bwd_kernel[(n_rows,)](
        logits, *row_layout(logits), vocab, labels, stats, grad_logprob, grad_out, *row_layout(grad_out),
        *args, **flags, ACC=acc_tl, BLOCK_V=config["BLOCK_V"], num_warps=config["num_warps"],
    )  # fmt: skip
