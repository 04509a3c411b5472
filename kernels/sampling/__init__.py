"""Sampling with log-probs, and truncated log-probs: Triton kernels and launchers.

One program per row; the processed distribution is the spec's
(fastrl/reference.py, truncated_log_distribution). Every filter keeps the tokens
at or above a threshold logit, and the thresholds are found without sorting the
row:

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

A row is read twice (``_select``): its softmax statistics
(reduce.softmax_stats) with a histogram of its keys' top 12 bits from the same
loads, and the compaction into the row's candidate list of the tokens whose top
digit can hold a kept token (from the k-th largest's digit up, for top-p alone the
digits above a mass bound, ``_top_p_floor``, for greedy rows the max's digit).
The thresholds (a radix selection for top-k, ``_kth_largest_key32``; a 16-way
descent for top-p and for float64 keys, ``_largest_key_reaching``), the kept
mass, the first argmax and the race then read the list of at most
list_capacity(V) entries, so Philox runs for the candidates only. A row with
more candidates than that (top-p over a flat row) runs the same steps with the
row as its list; rows with min-p or temperature alone (nothing to list) and
float64 rows skip the histogram and the compaction and read the row twice
more, for the kept mass and the race.

Where triton's tl.histogram costs a vote and a popcount per bin and element
(< 3.8, _uses_window), the 4096 top-digit bins would dominate the sampler; it
takes instead a window histogram (_window_bin) of 128 bins below the row's
max, in a read of the row between the statistics and the compaction, and the
same steps after it (the list's floor as a logit, _window_edge).

A batch small against the GPU (_split_parts) splits those reads over
many programs a row (_split_selection): each reads a slice of one tile of the
statistics pass and writes its lanes' statistics of that tile alone, and adds
its top digits to the row's histogram; one program a row folds the tiles in
order and finds the list's floor; the slices compact their candidates; the
last launch works on the list as above. The one-program pass folds its tiles
the same way (reduce.softmax_stats, FOLD_TILES), and every launch compiles
without fused multiply-adds, so both paths give the same bits and a row's
result does not depend on the batch it comes in.

A vocabulary shard of the tensor-parallel sampler (fastrl.vocab_parallel) takes
three kernels, a program a tile of a row each but the fold: the threshold
search's digit histogram (_digit_histogram_kernel, integer atomics: exact in
any order), then the shard pass: each tile's masses, maxima and race winner
(_shard_tile_kernel, the race's score rounding as _sample_kernel's, Philox only
in tiles holding a kept token), folded a row at a time in a fixed tree
(_shard_fold_kernel).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fastrl._rows import row_count, row_layout

from .._launch import CONTRACTED, acc_dtypes, float_scalar, float_scalar_arg, tile_config, triton_histogram_is_slow
from ..random import exponential_variate, philox4x32_10
from ..reduce import (exp2_scale, fold_lanes, lane_tile, log_sum, merge_lanes, row_start, slice_offsets,
                     softmax_stats, tile_lane_stats)

_MAX_BLOCK_V = 4096
# The digit search tests 16 pivots per element, a [block, 16] tile: a smaller
# block keeps it in registers.
_MAX_SEARCH_BLOCK = 512
# A program's warps. The forward holds far more than a log-prob forward (a
# 4096-bin histogram, the digit search, the race): 16 warps.
_WARPS = 16
# The registers of the final launch's threads (_sample_kernel,
# _truncated_fwd_kernel): 64 (no spills in the sm_90 and sm_80 cubins, against
# 94 uncapped) fits two programs an SM, so that one's histogram barriers overlap
# the other's loads (sm_90 model, sample top-k 50 at B = 1024: ~10% faster).
_MAXNREG = 64
# The top digit of a key: its 12 highest bits (_top_digit_of).
_BINS = tl.constexpr(4096)
# The bins of the window histogram (_window_bin), the statistics pass's
# histogram where triton's tl.histogram is slow (_uses_window).
_WINDOW_BINS = tl.constexpr(128)
# A window bin's y (_window_bin) keeps the float32 bits from this one up: 16
# bins a doubling (8 made the sampler's top-p lists 1.4x as long, the window
# pass 14% cheaper on triton 3.6).
_WINDOW_SHIFT = tl.constexpr(19)
_WINDOW_ONE = tl.constexpr(0x3F800000 >> _WINDOW_SHIFT.value)  # 1.0's bin
# Entries of a row's candidate list (_select): a top-k 50 row of an LLM holds a
# few dozen to a few hundred tokens in the digits from its 50th largest up; a
# top-p 0.9 row whole digits above _top_p_floor (randn * 3 at T = 0.7: 205 to
# 1538 tokens, top-p 0.99 2322 to 10261). 32 KB a row at most.
_CANDIDATES = 4096
# Entries a pass over the list reads at once.
_LIST_BLOCK = 1024
# A split row's programs (_split_selection): 4 warps read a quarter of a tile's
# lanes, so that a row of 19 tiles (V = 151936 bfloat16) fills 76 SMs at B = 1.
_SLICE_WARPS = 4
# Rows are split while the batch is at most this share of the SMs (_split_parts):
# one program a row leaves the other half idle.
_SPLIT_SM_SHARE = 0.5
# The sampler's forward launches compile without fused multiply-adds: a split
# row's statistics must round as one program's (reduce.fold_lanes), and a
# contraction depends on the code around it.
_EXACT = {"enable_fp_fusion": False}
# A split row's statistics fold 8 tiles a trip (_split_rows_kernel): their loads issued together.
_FOLD_GROUP = tl.constexpr(8)
# The tile of the tensor-parallel shard pass (_shard_tile_kernel) and threshold search
# (_digit_histogram_kernel), a program each, over 4 warps: 8 bf16 (128 bits) a thread.
_SHARD_PASS_BLOCK = 1024
# A split row's record (_split_rows_kernel, _record_list): 6 int64, padded to 8.
_SPLIT_RECORD = tl.constexpr(8)


def _row_block(vocab: int) -> int:
    return min(triton.next_power_of_2(vocab), _MAX_BLOCK_V)


def _launch_config(logits: torch.Tensor) -> dict:
    """The forward kernels' meta-parameters for rows of ``logits`` (V, dtype and
    alignment only, never the batch): the statistics and compaction passes'
    tile (_launch.tile_config, whose num_warps the launch takes), the block of
    the passes over the candidate list, and of the digit search."""
    vocab = logits.shape[-1]
    block = _row_block(vocab)
    return tile_config(logits, num_warps=_WARPS) | {
        "LIST_BLOCK": min(block, _LIST_BLOCK), "SEARCH_BLOCK": min(block, _MAX_SEARCH_BLOCK),
        "LIST_CAP": list_capacity(vocab),
    }  # fmt: skip


def list_capacity(vocab: int) -> int:
    """Entries of a row's candidate list: _CANDIDATES, and at most V / 8 (the list
    never outweighs the row: 8 bytes an entry, half a bfloat16 row at most)."""
    return max(1, min(_CANDIDATES, vocab // 8))


def workspace_bytes(logits: torch.Tensor) -> int:
    """Bytes of the temporaries the forward launches allocate for ``logits``' rows
    (_workspace), with the device's histogram (_uses_window)."""
    n_rows = row_count(logits)
    config = _launch_config(logits)
    split = bool(_split_parts(logits, n_rows, config)[0])
    window = _uses_window(logits.device)
    return sum(t.numel() * t.element_size() for t in _workspace(logits, n_rows, config, split, window, "meta").values())


def _workspace(logits: torch.Tensor, n_rows: int, config: dict, split: bool, window: bool,
               device) -> dict[str, torch.Tensor]:  # fmt: skip
    """The forward launches' temporaries for ``logits``' rows, on ``device``: each
    row's candidate list (_select, _compact: list_capacity int64 entries, 32 KB a
    row at most) and its counter (zero); for split rows (_split_selection) also
    each row's histogram (top-digit, or with ``window`` the window's; zero, in
    one zeroed buffer with the counters), the tiles' lane statistics and the
    rows' records."""
    vocab = logits.shape[-1]
    bins = (_WINDOW_BINS.value if window else _BINS.value) if split else 0
    zeroed = torch.zeros(n_rows * (bins + 1), dtype=torch.int32, device=device)
    workspace = {
        "lists": torch.empty(n_rows, list_capacity(vocab), dtype=torch.int64, device=device),
        "counters": zeroed[n_rows * bins :],
    }
    if split:
        groups = triton.cdiv(_tiles(vocab, config), _FOLD_GROUP.value)
        workspace |= {
            "hist": zeroed[: n_rows * bins],
            "lane_stats": torch.empty(n_rows, groups, 3, _FOLD_GROUP.value, config["LANES"],
                                      dtype=acc_dtypes(logits)[0], device=device),  # fmt: skip
            "records": torch.empty(n_rows, _SPLIT_RECORD.value, dtype=torch.int64, device=device),
        }
    return workspace


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
def _largest_key_reaching(row_ptr, cand_ptr, compacted, n, m, inv_t, floor_key, target, WEIGHTED: tl.constexpr,
                          BLOCK: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """The largest key u with F(u) >= target, where F(u) counts (or, WEIGHTED,
    sums e_j = exp((x_j - m) / T) over, in _mass_units; the target a float64 mass)
    the list's tokens (_list_entries) with key >= max(u, floor_key).
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
            reach = tl.zeros([16], tl.float64 if ACC == tl.float64 else tl.int64)
        else:
            reach = tl.zeros([16], tl.int64)
        for start in range(0, n, BLOCK):
            x, _, live = _list_entries(row_ptr, cand_ptr, compacted, n, start + tl.arange(0, BLOCK), ACC)
            key = _order_key(x)
            live = live & (key >= floor_key)
            above = (key[:, None] >= pivots[None, :]) & live[:, None]
            if WEIGHTED:
                e = _mass_units(tl.exp((x - m) * inv_t), ACC)
                reach += tl.sum(tl.where(above, e[:, None], 0), axis=0)
            else:
                reach += tl.sum(above.to(tl.int64), axis=0)
        if WEIGHTED:
            best = tl.max(tl.where(_mass_value(reach, ACC) >= target, digits, 0), axis=0)
        else:
            best = tl.max(tl.where(reach >= target, digits, 0), axis=0)
        prefix = prefix + (best << shift)
    return prefix


@triton.jit
def _digit_histogram(row_ptr, cand_ptr, compacted, n, floor_key, prefix, PREFIX_SHIFT: tl.constexpr,
                     DIGIT_SHIFT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Counts [256] of the digit (key >> DIGIT_SHIFT) % 256 over the list's
    (_list_entries) 32-bit keys >= floor_key whose bits from PREFIX_SHIFT up
    equal ``prefix`` (every key for PREFIX_SHIFT = 32). The keys left out are
    masked out of the histogram (not sent to a bin of their own: on a GPU the
    histogram adds with shared-memory atomics, and most of a later pass's keys
    are left out, so one bin would serialise every warp's adds). 256 bins: a
    triton < 3.8 histogram costs a vote per bit and a popcount per bin and
    element (_launch.FAST_HISTOGRAM_TRITON), 2.5 instructions an element here."""
    counts = tl.zeros([256], tl.int32)
    for start in range(0, n, BLOCK):
        x, _, live = _list_entries(row_ptr, cand_ptr, compacted, n, start + tl.arange(0, BLOCK), tl.float32)
        key = _order_key(x)
        live = live & (key >= floor_key)
        if PREFIX_SHIFT < 32:
            live = live & ((key >> PREFIX_SHIFT) == prefix)
        digit = ((key >> DIGIT_SHIFT) & 255).to(tl.int32)
        counts += tl.histogram(digit, 256, mask=live)
    return counts


@triton.jit
def _top_digit(counts, k, BINS: tl.constexpr):
    """(d, k'): the largest digit d whose bin and the bins above hold >= k keys, and
    k' = k less the keys above d (the rank of the answer within bin d)."""
    bins = tl.arange(0, BINS)
    at_or_above = tl.cumsum(counts, 0, reverse=True)
    d = tl.max(tl.where(at_or_above >= k, bins, 0), axis=0)
    above = tl.sum(tl.where(bins > d, counts, 0), axis=0)
    return d.to(tl.uint32), k - above


@triton.jit
def _kth_largest_key32(row_ptr, cand_ptr, compacted, n, floor_key, k, BLOCK: tl.constexpr):
    """The k-th largest 32-bit key of the list (_list_entries) among keys >=
    floor_key: the largest key u with #{key >= max(u, floor_key)} >= k, as
    _largest_key_reaching counts it, by radix selection over the list: a
    histogram of the keys' top 8 bits, then of the next 8 among the keys with
    the digits found so far, four passes; each fixes a byte of the answer and
    the answer's rank among the keys that share it."""
    prefix = tl.zeros([], tl.uint32)
    counts = _digit_histogram(row_ptr, cand_ptr, compacted, n, floor_key, prefix, 32, 24, BLOCK)
    d, k = _top_digit(counts, k, 256)
    prefix = d
    for level in tl.static_range(1, 4):
        shift = 24 - 8 * level  # a constexpr: level is one in static_range
        counts = _digit_histogram(row_ptr, cand_ptr, compacted, n, floor_key, prefix, shift + 8, shift, BLOCK)
        d, k = _top_digit(counts, k, 256)
        prefix = (prefix << 8) | d
    return prefix


@triton.jit
def _row_param(ptr, scalar, row, PER_ROW: tl.constexpr, DTYPE: tl.constexpr):
    """This row's value of a parameter: ptr[row], or the scalar (a float one as
    _launch.float_scalar_arg passes it)."""
    if PER_ROW:
        return tl.load(ptr + row).to(DTYPE)
    elif DTYPE == tl.int64:
        return tl.full([], scalar, DTYPE)
    else:
        return float_scalar(scalar, DTYPE)


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
def _tile_top_digits(x, mask):
    """The counts [_BINS] of the top digits (_top_digit_of) of a tile's 32-bit
    keys: x of any shape, mask None (every element) or of x's shape. One
    histogram of the whole tile (reduce.softmax_stats' HISTOGRAM). A masked-off
    element counts as -inf, in -inf's digit, and is taken back out of it after:
    a masked histogram branches around each element's shared-memory atomic."""
    SIZE: tl.constexpr = x.numel
    if mask is not None:
        x = tl.where(mask, x, float("-inf"))
    counts = tl.histogram(tl.reshape(_top_digit_of(_order_key(x.to(tl.float32))), [SIZE]), _BINS)
    if mask is not None:
        masked = SIZE - tl.sum(tl.reshape(mask.to(tl.int32), [SIZE]), axis=0)
        neg_inf_digit = _top_digit_of(_order_key(tl.full([], float("-inf"), tl.float32)))
        counts -= tl.where(tl.arange(0, _BINS) == neg_inf_digit, masked, 0)
    return counts


@triton.jit
def _digit_masses(bins, HIGHEST: tl.constexpr, counts, m, inv_t, ACC: tl.constexpr):
    """Each digit's mass were its tokens all at its lowest (HIGHEST: highest)
    logit, count * exp((edge - m) / T); 0 for an empty digit, whatever its edge."""
    return tl.where(counts > 0, tl.exp((_digit_edge(bins, ACC, HIGHEST) - m) * inv_t) * counts, 0.0)


@triton.jit
def _top_p_floor(counts, p, m, inv_t, s, ACC: tl.constexpr):
    """For top-p alone, the lowest top digit a kept token can have: the higher of
    two floors, each leaving out digits whose tokens have at least p * s of mass
    strictly above them, so that top-p drops them.
    - From above: the largest digit b whose higher digits hold a mass of at least
      p * s even at their lowest logits (count * exp((lowest logit - m) / T) per
      digit, a lower bound); the tokens of digit <= b are dropped.
    - From below: one above the largest digit b whose digits <= b hold at most
      (1 - p) * s even at their highest logits (an upper bound), so that the
      digits above b hold at least p * s. A digit's edges are up to 2^-3 of its
      logits apart, so the lower bound alone falls short on real rows (randn * 3
      at T = 0.7: the lower bounds of all digits sum to 0.59 s, the whole row
      became the list; this floor leaves 205 to 1538 candidates of 151936); the
      upper bound of the thin tail is tight where it matters.
    Each bound is taken with a margin of 2^-8, far above its float32 rounding
    (4096 terms: < 2^-11 relative), so that a rounding never drops a token the
    exact search keeps; the one from below also 2^-20 s less, since its slack is
    relative to (1 - p) s, which for p near 1 falls below the rounding of s itself
    (float32, 2^-24 s): such a p then gets no floor from below. 0 (every token)
    when neither reaches."""
    bins = tl.arange(0, _BINS)
    # reach[b]: the lower bound on the mass of digits >= b. Digit 7 (-inf's)
    # starts at NaN bits: a row with -inf makes reach[b] NaN for b <= 7, which
    # reaches nothing, as 0 would (and a floor that low keeps every token anyway).
    reach = tl.cumsum(_digit_masses(bins, False, counts, m, inv_t, ACC), 0, reverse=True)
    from_above = tl.max(tl.where(reach >= p * s * 1.00390625, bins, 0), axis=0) - 1
    # below[b]: the upper bound on the mass of digits <= b (-inf's digit tops at
    # -inf: nothing; NaN and +inf digits hold tokens only in rows that are bad).
    below = tl.cumsum(_digit_masses(bins, True, counts, m, inv_t, ACC), 0)
    from_below = tl.max(tl.where(below <= ((1.0 - p) * 0.99609375 - 9.5367431640625e-07) * s, bins, -1), axis=0) + 1
    return tl.maximum(tl.maximum(from_above, from_below), 0)


@triton.jit
def _window_scale(inv_t):
    """c of _window_bin: 1/T, at most 4 (a logit), so that the window resolves
    247 / c >= 61 logits below the max for top-k at any T, and >= 247 T for
    top-p, whose kept tokens lie within T log(V / (1 - p)) of it (20 T at V =
    151936, p = 0.99999). Its first bin spans 1/(16 c) of a logit: a row whose
    top tokens lie closer than that (randn * 0.01) lists them all, or with
    more than the list holds, becomes the list."""
    return tl.minimum(inv_t.to(tl.float32), 4.0)


@triton.jit
def _window_bin(x, m, c):
    """The window bin of float32 logits x of a row with max m (the window
    histogram, _list_floor with WINDOW): y = (m - x) c + 1 >= 1 in float32, and
    its exponent and top 4 mantissa bits above 1.0's, 16 bins a doubling of y:
    bin 0 holds the max, 127 everything from y = 248 on (-inf too). A
    non-increasing function of x (each rounding is monotone), so the tokens in
    bins <= b are those >= one logit (_window_edge). The same float32 steps
    wherever it runs (the launches compile without fused multiply-adds)."""
    y = (m - x) * c + 1.0
    return tl.minimum((y.to(tl.int32, bitcast=True) >> _WINDOW_SHIFT) - _WINDOW_ONE, _WINDOW_BINS - 1)


@triton.jit
def _window_edge(b, m, c):
    """The lowest float32 logit x with _window_bin(x, m, c) <= b (b < 127; bin
    0 holds m): a binary search over the keys from -inf's to m's, 32 steps of
    _window_bin itself, so the compaction's x >= edge takes exactly the
    histogram's tokens in bins <= b."""
    lo = _order_key(tl.full([], float("-inf"), tl.float32))  # its bin, 127, is above b
    hi = _order_key(m)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        inside = _window_bin(_key_to_value(mid, tl.float32), m, c) <= b
        hi = tl.where(inside, mid, hi)
        lo = tl.where(inside, lo, mid)
    return _key_to_value(hi, tl.float32)


@triton.jit
def _window_floor(counts, k, p, c, inv_t, s, k_on, p_on):
    """The last window bin (_window_bin) the row's list needs: every kept token
    is in a bin <= b. ``counts`` [_WINDOW_BINS]: the row's window histogram.
    - top-k: the first bin where the bins so far hold >= k tokens.
    - top-p alone: the lower of two bins, each past which top-p drops every
      token (as _top_p_floor, with bins for digits): from above, the first bin
      b whose bins <= b hold >= p * s even at their lowest logits; from below,
      the first b whose bins > b hold <= (1 - p) * s even at their highest.
      Bin i holds y in [y_i, y_i+1) (its float32 edges); y rounds (m - x) c + 1
      three times, so (m - x) c is taken >= (y_i (1 - 2^-23) - 1)(1 - 2^-22) and
      < (y_i+1 (1 + 2^-23) - 1)(1 + 2^-22), float64 bounds on each token's
      mass exp(-(m - x) / T); the same margins as _top_p_floor on the sums.
    - greedy rows (neither): bin 0, the max's.
    127 (every token) when nothing closer reaches."""
    bins = tl.arange(0, _WINDOW_BINS)
    last = _WINDOW_BINS - 1
    b = tl.zeros([], tl.int32)
    if k_on:
        b = tl.min(tl.where(tl.cumsum(counts, 0) >= k, bins, last), axis=0)
    elif p_on:
        y_lo = ((bins + _WINDOW_ONE) << _WINDOW_SHIFT).to(tl.float32, bitcast=True).to(tl.float64)
        y_hi = ((bins + _WINDOW_ONE + 1) << _WINDOW_SHIFT).to(tl.float32, bitcast=True).to(tl.float64)
        y_hi = tl.where(bins == last, float("inf"), y_hi)
        per_logit = inv_t.to(tl.float64) / c.to(tl.float64)  # (m - x) / T = (m - x) c * per_logit
        far = (y_hi * 1.00000011920928955 - 1.0) * 1.0000002384185791 * per_logit
        near = tl.maximum(y_lo * 0.99999988079071045 - 1.0, 0.0) * 0.99999976158142090 * per_logit
        lowest_mass = tl.where(counts > 0, tl.exp(-far) * counts, 0.0)
        highest_mass = tl.where(counts > 0, tl.exp(-near) * counts, 0.0)
        mass = s.to(tl.float64)
        share = p.to(tl.float64)
        from_above = tl.min(tl.where(tl.cumsum(lowest_mass, 0) >= share * mass * 1.00390625, bins, last), axis=0)
        beyond = tl.cumsum(highest_mass, 0, reverse=True) - highest_mass  # bins > b
        drop = ((1.0 - share) * 0.99609375 - 9.5367431640625e-07) * mass
        from_below = tl.min(tl.where(beyond <= drop, bins, last), axis=0)
        b = tl.minimum(from_above, from_below)
    return b


@triton.jit
def _window_histogram(row_ptr, V, m, c, TILE: tl.constexpr):
    """The row's window histogram [_WINDOW_BINS] (_window_bin of every token), a
    read of the row in tiles of TILE."""
    counts = tl.zeros([_WINDOW_BINS], tl.int32)
    for start in range(0, V, TILE):
        offs = start + tl.arange(0, TILE)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        counts += tl.histogram(_window_bin(x, m, c), _WINDOW_BINS, mask=offs < V)
    return counts


@triton.jit
def _compact(row_ptr, begin, end, V, first_lane, lowest, cand_ptr, counter_ptr, REPS: tl.constexpr,
             LANES: tl.constexpr, VEC: tl.constexpr, TILE_LANES: tl.constexpr):  # fmt: skip
    """Writes the row's tokens x >= lowest (a float32 logit above -inf; at most
    the list's capacity, _list_floor) to the candidate list at cand_ptr, one int64 per token: the bits of
    its logit as a float32 (exact for the 16- and 32-bit types) above its index
    (_list_entries reads them). The tokens are those of the tiles from ``begin``
    (a tile's first element) to ``end`` in lanes first_lane .. first_lane + LANES
    - 1 of a tile of TILE_LANES lanes: the whole row (0, V, 0, LANES), or one
    program's slice of a tile (_split_compact_kernel).

    One read, in softmax_stats' tile (a thread's REPS x VEC elements,
    reduce.slice_offsets): each thread counts its tile's candidates, takes a range
    of the list with one atomic add on the row's counter (zero at launch), and
    stores its candidates there one element at a time: element (r, v) of every
    thread's tile as a [LANES] tensor (one per thread, taken out of the tile by
    a reduction over the thread's own axes), so no value crosses threads and no
    store needs the tile in another layout (a store of the [REPS, LANES, VEC]
    tile at data-dependent addresses makes Triton move it through shared memory
    first), and each candidate costs one 64-bit store. The ranges' order is the
    atomics' (any): everything computed from the list is independent of its
    order (counts, a max with ties to the lowest index, and masses summed in
    fixed point, _mass_units)."""
    lane_offs, rep_offs = slice_offsets(REPS, LANES, VEC, first_lane, TILE_LANES)
    rep_of = tl.arange(0, REPS)[:, None, None]
    vec_of = tl.arange(0, VEC)[None, None, :]
    lane = first_lane + tl.arange(0, LANES)
    for start in range(begin, end, REPS * TILE_LANES * VEC):
        offs = (start + lane_offs) + rep_offs
        x = lane_tile(tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")), LANES, VEC).to(tl.float32)
        take = (x >= lowest).to(tl.int32)  # masked lanes: -inf < lowest
        count = tl.sum(tl.sum(take, axis=2), axis=0)  # [LANES]: inside each thread
        # relaxed: the list is read only after the barrier below
        at = tl.atomic_add(counter_ptr + tl.zeros_like(count), count, mask=count > 0, sem="relaxed")
        bits = x.to(tl.int32, bitcast=True)
        for r in tl.static_range(REPS):
            for v in tl.static_range(VEC):
                # element (r, v) of each thread's tile: a sum of one term (of
                # bits, which a float sum would not keep for -0.0)
                here = (rep_of == r) & (vec_of == v)
                bits_here = tl.sum(tl.sum(tl.where(here, bits, 0), axis=2), axis=0)
                index = (start + r * (TILE_LANES * VEC) + lane * VEC + v).to(tl.uint32)  # >= 0: zero-extended
                take_here = bits_here.to(tl.float32, bitcast=True) >= lowest
                tl.store(cand_ptr + at, (bits_here.to(tl.int64) << 32) | index.to(tl.int64), mask=take_here)
                at += take_here.to(tl.int32)
    tl.debug_barrier()  # the list is written before any thread reads it


@triton.jit
def _mass_units(e, ACC: tl.constexpr):
    """Probability mass e = exp(d) in [0, 1] as the kernels sum it: float64 as
    is; float32 in fixed point, round-down(e * 2^42) in int64, so that a sum is
    exact and the same in any order (the candidate list's order is not fixed,
    _compact). The units drop e < 2^-42 and round each term down by < 2^-42: on a
    sum >= 1 (every kept set holds its max, e = 1) at most V * 2^-42 <= 4e-8
    relative at V = 2^18, under float32's own rounding of the sum."""
    if ACC == tl.float64:
        return e
    else:
        return (e * 4398046511104.0).to(tl.int64)


@triton.jit
def _mass_value(units, ACC: tl.constexpr):
    """The float64 mass of a sum of _mass_units."""
    if ACC == tl.float64:
        return units
    else:
        return units.to(tl.float64) * 2.2737367544323206e-13


@triton.jit
def _list_entries(row_ptr, cand_ptr, compacted, n, offs, ACC: tl.constexpr):
    """(logits in ACC, vocabulary indices, live) of entries ``offs`` of the list:
    the candidates at cand_ptr when ``compacted`` (_compact's int64 entries), else
    the row itself (entry j is token j)."""
    live = offs < n
    if ACC == tl.float64:  # never compacted (_select)
        return tl.load(row_ptr + offs, mask=live, other=float("-inf")).to(ACC), offs, live
    else:
        # (masks as compares with n or 0: a scalar-and-tensor & of booleans fails
        # in Triton's interpreter)
        entry = tl.load(cand_ptr + offs, mask=offs < tl.where(compacted, n, 0), other=0)
        x = tl.load(row_ptr + offs, mask=offs < tl.where(compacted, 0, n), other=float("-inf")).to(ACC)
        listed = (entry >> 32).to(tl.int32).to(tl.float32, bitcast=True).to(ACC)
        x = tl.where(live, tl.where(compacted, listed, x), float("-inf"))
        return x, tl.where(compacted, entry.to(tl.int32), offs), live


@triton.jit
def _inverse_temperature(t, valid, ACC: tl.constexpr):
    """1/T, and 1 for greedy rows and rows with an invalid parameter (whose
    statistics are the row's at T = 1)."""
    return tl.where((t == 0) | (~valid), 1.0, 1.0 / t).to(ACC)


@triton.jit
def _row_state(V, t, k, p, valid, m, n_max, tail, ACC: tl.constexpr):
    """From the row's statistics (m, n_max, tail: reduce.softmax_stats): (bad,
    greedy, m_safe, s, log s, k_on, p_on). A row is bad (nothing to sample) with
    a NaN (s is NaN: reduce.softmax_stats), a +inf (m = inf: softmax is NaN),
    only -inf (m = -inf), or an invalid parameter."""
    neg_inf = float("-inf")
    greedy = t == 0
    s = n_max + tail  # float64
    log_s = log_sum(n_max, tail).to(ACC)
    bad = (s != s) | (m != m) | (m == neg_inf) | (m == float("inf")) | (~valid)
    m_safe = tl.where(bad, 0.0, m).to(ACC)
    active = (~bad) & (~greedy)
    return bad, greedy, m_safe, s, log_s, active & (k > 0) & (k < V), active & (p < 1)


@triton.jit
def _may_list(V, t, k, p):
    """Whether a row with these parameters may list candidates: a superset of
    the rows _list_floor lists (those also need a row that is not bad), known
    before the row is read, so that only they pay for the top-digit histogram."""
    return (t == 0) | ((k > 0) & (k < V)) | (p < 1)


@triton.jit
def _list_floor(V, k, p, inv_t, bad, greedy, k_on, p_on, m_safe, s, counts, LIST_CAP: tl.constexpr,
                WINDOW: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """Which tokens go on the row's candidate list: (lowest, n_candidates,
    compacted); the list holds the n_candidates tokens x >= lowest (a float32
    logit) when ``compacted``, else the list is the row. ``counts``: the row's
    histogram, read only for the rows that list (a row that lists none may
    pass anything): of its keys' top digits (_tile_top_digits), or with WINDOW
    of its window bins (_window_bin)."""
    # The candidates: the tokens at or above a floor where no other can be kept:
    # the k-th largest key's digit or bin (top-p only narrows the top-k set),
    # or top-p's mass bound, or the max's digit or bin (greedy: the first
    # argmax). Rows with min-p or temperature alone keep too many tokens to
    # list: they skip the histogram and read the row. Float64 rows never
    # compact: their sums stay float64, in row order (_mass_units).
    lowest = tl.full([], float("-inf"), tl.float32)
    n_candidates = V + tl.zeros([], tl.int32)
    compacted = False
    if ACC != tl.float64:
        if (~bad) & (k_on | p_on | greedy):
            if WINDOW:
                c = _window_scale(inv_t)
                b = _window_floor(counts, k, p, c, inv_t, s, k_on, p_on)
                lowest = _window_edge(b, m_safe, c)
                n_candidates = tl.sum(tl.where(tl.arange(0, _WINDOW_BINS) <= b, counts, 0), axis=0)
            else:
                if k_on:
                    floor, _ = _top_digit(counts, k, _BINS)
                    floor = floor.to(tl.int32)
                elif p_on:
                    floor = _top_p_floor(counts, p.to(ACC), m_safe, inv_t, s.to(ACC), ACC)
                else:
                    floor = _top_digit_of(_order_key(m_safe))
                # the digit's lowest logit; NaN bits for digits < 8, which hold
                # every token (-inf is in digit 7): such a row is never compacted
                lowest = _digit_edge(floor, tl.float32)
                n_candidates = tl.sum(tl.where(tl.arange(0, _BINS) >= floor, counts, 0), axis=0)
        compacted = (~bad) & (n_candidates <= LIST_CAP) & (n_candidates < V)
    return lowest, n_candidates, compacted


@triton.jit
def _select(row_ptr, V, t, k, p, min_p, valid, cand_ptr, counter_ptr, split_ptr,
            SPLIT: tl.constexpr, WINDOW: tl.constexpr, REPS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr,
            ALIGNED: tl.constexpr, MAX_IN_STORAGE_TYPE: tl.constexpr, LIST_BLOCK: tl.constexpr,
            SEARCH_BLOCK: tl.constexpr, LIST_CAP: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """Everything about one row's processed distribution: (bad, greedy, m, first
    argmax, number of maxima, 1/T, log s, threshold key, log min_p, log s_kept,
    whether the row's kept tokens are on its candidate list (compacted; else
    the list is the row, _list_entries), the list's length) with s = sum_j e_j
    over the row, e_j = exp((x_j - m) / T), and s_kept over the kept tokens (key
    >= threshold and (x - m) / T >= log min_p); bad as _row_state.

    At most two reads of the row: its statistics (reduce.softmax_stats: m, s
    and the number of maxima) with, for a row that may list candidates
    (_may_list), its top-digit histogram (_tile_top_digits) from the same
    loads; and the compaction of the candidates into this row's list of
    LIST_CAP entries (_list_floor, _compact). With WINDOW (_uses_window) the
    histogram is the window's (_window_histogram), a read of its own between
    the two, for the rows that list. With SPLIT, other programs made those
    reads (_split_selection) and left the row's statistics and list at
    split_ptr (_split_rows_kernel).
    The thresholds, s_kept, the first argmax and the draw then read the list
    only. A row with more candidates than that (top-p over a flat row) uses the
    row itself as its list: the same code, each step a read of the row."""
    neg_inf = float("-inf")
    inv_t = _inverse_temperature(t, valid, ACC)
    HIST_BINS: tl.constexpr = _WINDOW_BINS if WINDOW else _BINS
    counts = tl.zeros([HIST_BINS], tl.int32)  # the histogram of a row that may list
    if SPLIT:
        m, n_max, tail = _record_stats(split_ptr, ACC)
    elif ACC == tl.float64:  # never lists
        m, n_max, tail, _no_w = softmax_stats(row_ptr, V, inv_t, False, REPS, LANES, VEC, ALIGNED, MAX_IN_STORAGE_TYPE,
                                              ACC, True)  # fmt: skip
    elif WINDOW:  # the window histogram is a read of its own, after the statistics
        m, n_max, tail, _no_w = softmax_stats(row_ptr, V, inv_t, False, REPS, LANES, VEC, ALIGNED, MAX_IN_STORAGE_TYPE,
                                              ACC, True)  # fmt: skip
    elif _may_list(V, t, k, p):
        m, n_max, tail, _no_w, counts = softmax_stats(row_ptr, V, inv_t, False, REPS, LANES, VEC, ALIGNED,
                                                      MAX_IN_STORAGE_TYPE, ACC, True, _tile_top_digits,
                                                      _BINS)  # fmt: skip
    else:
        m, n_max, tail, _no_w = softmax_stats(row_ptr, V, inv_t, False, REPS, LANES, VEC, ALIGNED, MAX_IN_STORAGE_TYPE,
                                              ACC, True)  # fmt: skip
    bad, greedy, m_safe, s, log_s, k_on, p_on = _row_state(V, t, k, p, valid, m, n_max, tail, ACC)
    if SPLIT:
        n_candidates = tl.load(split_ptr + 4).to(tl.int32)
        compacted = tl.load(split_ptr + 5) != 0
    else:
        if WINDOW and ACC != tl.float64:
            if (~bad) & (k_on | p_on | greedy):
                counts = _window_histogram(row_ptr, V, m_safe, _window_scale(inv_t), REPS * LANES * VEC)
        lowest, n_candidates, compacted = _list_floor(V, k, p, inv_t, bad, greedy, k_on, p_on, m_safe, s, counts,
                                                      LIST_CAP, WINDOW, ACC)  # fmt: skip
        if compacted:
            _compact(row_ptr, 0, V, V, 0, lowest, cand_ptr, counter_ptr, REPS, LANES, VEC, LANES)
    n_list = tl.where(compacted, n_candidates, V)

    threshold = _order_key(tl.full([], neg_inf, ACC))  # keeps every non-NaN logit
    if k_on:  # k <= n_list: the list holds the digits from the k-th largest's up
        if ACC == tl.float64:
            threshold = _largest_key_reaching(row_ptr, cand_ptr, compacted, n_list, m_safe, inv_t, threshold, k, False,
                                              SEARCH_BLOCK, ACC)  # fmt: skip
        else:
            threshold = _kth_largest_key32(row_ptr, cand_ptr, compacted, n_list, threshold, k, LIST_BLOCK)
    if p_on:
        top_k_mass = s  # top-k off: the row's mass (float64)
        if k_on:
            units = tl.zeros([], tl.float64 if ACC == tl.float64 else tl.int64)
            for start in range(0, n_list, LIST_BLOCK):
                x, _, live = _list_entries(row_ptr, cand_ptr, compacted, n_list, start + tl.arange(0, LIST_BLOCK), ACC)
                e = _mass_units(tl.exp((x - m_safe) * inv_t), ACC)
                units += tl.sum(tl.where(live & (_order_key(x) >= threshold), e, 0), axis=0)
            top_k_mass = _mass_value(units, ACC)
        target = p.to(tl.float64) * top_k_mass
        threshold = _largest_key_reaching(row_ptr, cand_ptr, compacted, n_list, m_safe, inv_t, threshold, target, True,
                                          SEARCH_BLOCK, ACC)  # fmt: skip

    log_min_p = tl.where(min_p > 0, tl.log(min_p.to(ACC)), neg_inf).to(ACC)
    kept_units = tl.zeros([], tl.float64 if ACC == tl.float64 else tl.int64)
    # and the first argmax (the lowest index with x == m), which the list holds
    first = tl.full([LIST_BLOCK], V, tl.int32)
    for start in range(0, n_list, LIST_BLOCK):
        x, index, live = _list_entries(row_ptr, cand_ptr, compacted, n_list, start + tl.arange(0, LIST_BLOCK), ACC)
        d = (x - m_safe) * inv_t
        kept = live & (_order_key(x) >= threshold) & (d >= log_min_p)
        kept_units += tl.sum(tl.where(kept, _mass_units(tl.exp(d), ACC), 0), axis=0)
        first = tl.minimum(first, tl.where(live & (x == m), index, V))
    s_kept = _mass_value(kept_units, ACC).to(ACC)
    arg = tl.min(first, axis=0)
    return (bad, greedy, m_safe, arg.to(tl.int64), n_max.to(ACC), inv_t, log_s, threshold, log_min_p, tl.log(s_kept),
            compacted, n_list)  # fmt: skip


@triton.jit
def _split_tiles_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
    lane_stats_ptr, hist_ptr, n_groups,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    REPS: tl.constexpr, LANES: tl.constexpr, SLICE_LANES: tl.constexpr, VEC: tl.constexpr, ALIGNED: tl.constexpr,
    MAX_IN_STORAGE_TYPE: tl.constexpr, WINDOW: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The first launch of a split row (_split_selection), program (row, part):
    lanes first_lane .. + SLICE_LANES of the row's tile ``part // SLICES`` of
    softmax_stats' tiling. Writes each lane's (m, n, t) over that tile alone
    (reduce.tile_lane_stats) to lane_stats (_split_rows_kernel), and adds the
    slice's top-digit counts to the row's histogram (zero at launch) for rows
    that may list candidates (not with WINDOW: _split_window_kernel)."""
    SLICES: tl.constexpr = LANES // SLICE_LANES
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    tile = part // SLICES
    first_lane = (part % SLICES) * SLICE_LANES
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    if ALIGNED:  # every row starts on a 16-byte boundary (the launcher checked)
        row_ptr = tl.multiple_of(row_ptr, 16)
    t, k, p, _, valid = _row_params(
        row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
        PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC,
    )  # fmt: skip
    lane_offs, rep_offs = slice_offsets(REPS, SLICE_LANES, VEC, first_lane, LANES)
    start = tile * (REPS * LANES * VEC)
    offs = (start + lane_offs) + rep_offs
    # one masked load (128 bits a lane where V is a multiple of 16, which Triton
    # specialises on: the mask is then whole 16-byte runs)
    x = lane_tile(tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")), SLICE_LANES, VEC)
    m, n, tail = tile_lane_stats(x, exp2_scale(_inverse_temperature(t, valid, ACC)), MAX_IN_STORAGE_TYPE)
    out = (lane_stats_ptr + (row * n_groups + tile // _FOLD_GROUP) * (3 * _FOLD_GROUP * LANES)
           + (tile % _FOLD_GROUP) * LANES + first_lane + tl.arange(0, SLICE_LANES))  # fmt: skip
    tl.store(out, m)
    tl.store(out + _FOLD_GROUP * LANES, n)
    tl.store(out + 2 * _FOLD_GROUP * LANES, tail)
    if ACC != tl.float64 and not WINDOW:
        if _may_list(V, t, k, p):
            if start + REPS * LANES * VEC <= V:  # a whole tile: no mask to count out
                counts = _tile_top_digits(x, None)
            else:
                counts = _tile_top_digits(x, lane_tile(offs < V, SLICE_LANES, VEC))
            tl.atomic_add(hist_ptr + row * _BINS + tl.arange(0, _BINS), counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _split_rows_kernel(
    V, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
    lane_stats_ptr, n_tiles, n_groups, hist_ptr, split_ptr,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    LANES: tl.constexpr, LIST_CAP: tl.constexpr, WINDOW: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The second launch of a split row, one program a row: its statistics, the
    tiles' lane statistics folded in tile order and merged as softmax_stats
    folds and merges them (the same bits as one program's read of the row), to
    the row's record of _SPLIT_RECORD int64 at split_ptr: the float64 bits of
    m, n and t; then which tokens go on its list (_record_list, from the
    histogram; with WINDOW, _split_floor_kernel does, after the window's)."""
    row = tl.program_id(0).to(tl.int64)
    t, k, p, _, valid = _row_params(
        row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
        PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC,
    )  # fmt: skip
    inv_t = _inverse_temperature(t, valid, ACC)
    scale = exp2_scale(inv_t)
    # A trip folds a group of _FOLD_GROUP tiles' statistics in tile order,
    # lane_stats [rows, groups, 3, _FOLD_GROUP, LANES]: each tile's m, n and t are
    # a coalesced load of the lanes, the group's 3 x _FOLD_GROUP loads all issued
    # before its folds (a trip a tile waited for a memory latency each).
    lanes = tl.arange(0, LANES)
    m = tl.full([LANES], float("-inf"), ACC)
    n = tl.zeros([LANES], ACC)
    tail = tl.zeros([LANES], ACC)
    for group in range(0, n_groups):  # n_groups = cdiv(n_tiles, _FOLD_GROUP)
        at = lane_stats_ptr + (row * n_groups + group) * (3 * _FOLD_GROUP * LANES) + lanes
        for j in tl.static_range(_FOLD_GROUP):
            # tile < n_tiles, as one compare of the lanes (a scalar condition
            # as a mask fails in Triton's interpreter)
            live = (group * _FOLD_GROUP + j) * LANES + lanes < n_tiles * LANES
            tile_m = tl.load(at + j * LANES, mask=live, other=float("-inf"))
            tile_n = tl.load(at + (_FOLD_GROUP + j) * LANES, mask=live, other=0.0)
            tile_tail = tl.load(at + (2 * _FOLD_GROUP + j) * LANES, mask=live, other=0.0)
            if group * _FOLD_GROUP + j < n_tiles:
                m, n, tail = fold_lanes(m, n, tail, tile_m, tile_n, tile_tail, scale)
    m, n_max, tail, _no_w = merge_lanes(m, n, tail, tl.zeros([LANES], ACC), scale)
    record = split_ptr + row * _SPLIT_RECORD
    tl.store(record, m.to(tl.float64).to(tl.int64, bitcast=True))
    tl.store(record + 1, n_max.to(tl.int64, bitcast=True))
    tl.store(record + 2, tail.to(tl.int64, bitcast=True))
    if not WINDOW:
        _record_list(record, V, t, k, p, valid, inv_t, m, n_max, tail, hist_ptr + row * _BINS, LIST_CAP, WINDOW, ACC)


@triton.jit
def _record_list(record, V, t, k, p, valid, inv_t, m, n_max, tail, hist_ptr, LIST_CAP: tl.constexpr,
                 WINDOW: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """A split row's list (_list_floor, from the row's histogram at hist_ptr:
    zero for a row that lists none) to its record after m, n and t: the float64
    bits of its lowest logit, n_candidates and compacted."""
    bad, greedy, m_safe, s, _, k_on, p_on = _row_state(V, t, k, p, valid, m, n_max, tail, ACC)
    HIST_BINS: tl.constexpr = _WINDOW_BINS if WINDOW else _BINS
    counts = tl.load(hist_ptr + tl.arange(0, HIST_BINS))
    lowest, n_candidates, compacted = _list_floor(V, k, p, inv_t, bad, greedy, k_on, p_on, m_safe, s, counts,
                                                  LIST_CAP, WINDOW, ACC)  # fmt: skip
    tl.store(record + 3, lowest.to(tl.float64).to(tl.int64, bitcast=True))
    tl.store(record + 4, n_candidates.to(tl.int64))
    tl.store(record + 5, compacted.to(tl.int64))


@triton.jit
def _record_stats(record, ACC: tl.constexpr):
    """A split row's (m, n, t) from its record (_split_rows_kernel)."""
    m = tl.load(record).to(tl.float64, bitcast=True).to(ACC)
    return m, tl.load(record + 1).to(tl.float64, bitcast=True), tl.load(record + 2).to(tl.float64, bitcast=True)


@triton.jit
def _split_window_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p, split_ptr, hist_ptr,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    REPS: tl.constexpr, LANES: tl.constexpr, SLICE_LANES: tl.constexpr, VEC: tl.constexpr, ALIGNED: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """With WINDOW, the third launch of a split row, program (row, part) as in
    _split_tiles_kernel, for a row that lists: its slice's window bins
    (_window_bin, from the row's m in its record) added to the row's window
    histogram (zero at launch)."""
    SLICES: tl.constexpr = LANES // SLICE_LANES
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    t, k, p, _, valid = _row_params(
        row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
        PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC,
    )  # fmt: skip
    tl.static_assert(ACC != tl.float64, "float64 rows never list")
    m, n_max, tail = _record_stats(split_ptr + row * _SPLIT_RECORD, ACC)
    bad, greedy, m_safe, _, _, k_on, p_on = _row_state(V, t, k, p, valid, m, n_max, tail, ACC)
    if (~bad) & (k_on | p_on | greedy):
        row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
        if ALIGNED:  # every row starts on a 16-byte boundary (the launcher checked)
            row_ptr = tl.multiple_of(row_ptr, 16)
        lane_offs, rep_offs = slice_offsets(REPS, SLICE_LANES, VEC, (part % SLICES) * SLICE_LANES, LANES)
        offs = ((part // SLICES) * (REPS * LANES * VEC) + lane_offs) + rep_offs
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        SIZE: tl.constexpr = REPS * SLICE_LANES * VEC
        bins = tl.reshape(_window_bin(x, m_safe, _window_scale(_inverse_temperature(t, valid, ACC))), [SIZE])
        counts = tl.histogram(bins, _WINDOW_BINS, mask=tl.reshape(offs < V, [SIZE]))
        tl.atomic_add(hist_ptr + row * _WINDOW_BINS + tl.arange(0, _WINDOW_BINS), counts, mask=counts > 0,
                      sem="relaxed")  # fmt: skip


@triton.jit
def _split_floor_kernel(
    V, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p, hist_ptr, split_ptr,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    LIST_CAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """With WINDOW, the fourth launch of a split row, one program a row: which
    tokens go on its list, from its window histogram (_record_list)."""
    row = tl.program_id(0).to(tl.int64)
    t, k, p, _, valid = _row_params(
        row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
        PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC,
    )  # fmt: skip
    record = split_ptr + row * _SPLIT_RECORD
    m, n_max, tail = _record_stats(record, ACC)
    _record_list(record, V, t, k, p, valid, _inverse_temperature(t, valid, ACC), m, n_max, tail,
                 hist_ptr + row * _WINDOW_BINS, LIST_CAP, True, ACC)  # fmt: skip


@triton.jit
def _split_compact_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V, split_ptr, cand_ptr, counter_ptr,
    REPS: tl.constexpr, LANES: tl.constexpr, SLICE_LANES: tl.constexpr, VEC: tl.constexpr, LIST_CAP: tl.constexpr,
):  # fmt: skip
    """The last launch before the list's of a split row, program (row, part) as
    in _split_tiles_kernel: its slice's candidates onto the row's list (_compact)."""
    SLICES: tl.constexpr = LANES // SLICE_LANES
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    record = split_ptr + row * _SPLIT_RECORD  # (_record_list)
    compacted = tl.load(record + 5)
    if compacted != 0:
        lowest = tl.load(record + 3).to(tl.float64, bitcast=True).to(tl.float32)
        row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
        start = (part // SLICES) * (REPS * LANES * VEC)
        _compact(row_ptr, start, start + 1, V, (part % SLICES) * SLICE_LANES, lowest, cand_ptr + row * LIST_CAP,
                 counter_ptr + row, REPS, SLICE_LANES, VEC, LANES)  # fmt: skip


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


@triton.jit
def _sample_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
    seeds_ptr, seed, offset_ptr, offset,
    tokens_ptr, logprobs_ptr, raw_ptr, cand_ptr, counter_ptr, split_ptr,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    PER_ROW_SEED: tl.constexpr, OFFSET_FROM_PTR: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr,
    REPS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, ALIGNED: tl.constexpr,
    MAX_IN_STORAGE_TYPE: tl.constexpr, LIST_BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
    LIST_CAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    cand_ptr += row * LIST_CAP
    if SPLIT:  # the row's record (_split_rows_kernel)
        split_ptr += row * _SPLIT_RECORD
    bad, greedy, m, arg, n_max, inv_t, log_s, threshold, log_min_p, log_s_kept, compacted, n_list = _select(
        row_ptr, V, *_row_params(
            row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
            PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC,
        ), cand_ptr, counter_ptr + row, split_ptr, SPLIT, WINDOW, REPS, LANES, VEC, ALIGNED, MAX_IN_STORAGE_TYPE,
        LIST_BLOCK, SEARCH_BLOCK, LIST_CAP, ACC,
    )  # fmt: skip

    # The list's entries draw the variates of their own tokens.
    k0, k1, salt, c2, c3 = _race_key(row, seeds_ptr, seed, offset_ptr, offset, PER_ROW_SEED, OFFSET_FROM_PTR)
    best = tl.full([], float("-inf"), ACC)
    winner = arg  # only if every kept draw lost (E = inf, ~2^-25 each)
    if (~bad) & (~greedy):
        for start in range(0, n_list, LIST_BLOCK):
            x, index, live = _list_entries(row_ptr, cand_ptr, compacted, n_list,
                                           start + tl.arange(0, LIST_BLOCK), ACC)  # fmt: skip
            d = (x - m) * inv_t
            kept = live & (_order_key(x) >= threshold) & (d >= log_min_p)
            zeros = tl.zeros([LIST_BLOCK], tl.uint32)
            w0, w1, _, _ = philox4x32_10(index.to(tl.uint32), zeros + salt, zeros + c2, zeros + c3, zeros + k0,
                                         zeros + k1)  # fmt: skip
            race = tl.where(kept, d - tl.log(exponential_variate(w0, w1).to(ACC)), float("-inf"))
            b_best = tl.max(race, axis=0)
            b_arg = tl.min(tl.where(race == b_best, index, V), axis=0).to(tl.int64)
            # ties to the lowest index whatever the list's order (_compact)
            wins = (b_best > best) | ((b_best == best) & (b_best > float("-inf")) & (b_arg < winner))
            winner = tl.where(wins, b_arg, winner)
            best = tl.maximum(best, b_best)
    d_win = (tl.load(row_ptr + winner, mask=~bad, other=0.0).to(ACC) - m) * inv_t  # a bad row's winner may be anything
    logprob = tl.where(greedy, 0.0, d_win - log_s_kept)
    raw = tl.where(greedy, -tl.log(n_max), d_win - log_s)
    tl.store(tokens_ptr + row, tl.where(bad, -1, winner))
    tl.store(logprobs_ptr + row, tl.where(bad, float("nan"), logprob))
    tl.store(raw_ptr + row, tl.where(bad, float("nan"), raw))


@triton.jit
def _truncated_fwd_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V, labels_ptr,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
    out_ptr, stats_ptr, cand_ptr, counter_ptr, split_ptr,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    WITH_STATS: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr, REPS: tl.constexpr, LANES: tl.constexpr,
    VEC: tl.constexpr,
    ALIGNED: tl.constexpr, MAX_IN_STORAGE_TYPE: tl.constexpr,
    LIST_BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, LIST_CAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    cand_ptr += row * LIST_CAP
    if SPLIT:  # the row's record (_split_rows_kernel)
        split_ptr += row * _SPLIT_RECORD
    bad, greedy, m, arg, n_max, inv_t, log_s, threshold, log_min_p, log_s_kept, _, _ = _select(
        row_ptr, V, *_row_params(
            row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
            PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC,
        ), cand_ptr, counter_ptr + row, split_ptr, SPLIT, WINDOW, REPS, LANES, VEC, ALIGNED, MAX_IN_STORAGE_TYPE,
        LIST_BLOCK, SEARCH_BLOCK, LIST_CAP, ACC,
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
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p, label_base, label_kept_ptr,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    LABEL_KEPT_GIVEN: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """As csrc/sampling.h's truncated_logprobs_backward: a vocabulary shard
    passes label_base and (LABEL_KEPT_GIVEN) whether each row's label is kept."""
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
    label = tl.load(labels_ptr + row).to(tl.int64) - label_base
    in_range = (label >= 0) & (label < V)
    if LABEL_KEPT_GIVEN:
        label_kept = (tl.load(label_kept_ptr + row) != 0) & (t > 0)
    else:
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


def _params(temperature, top_k, top_p, min_p) -> tuple[list, dict]:
    """Kernel arguments (pointer-or-None, scalar) per parameter, and the PER_ROW_* flags."""
    args, flags = [], {}
    for value, flag in ((temperature, "PER_ROW_T"), (top_k, "PER_ROW_K"), (top_p, "PER_ROW_P"), (min_p, "PER_ROW_MIN_P")):
        per_row = isinstance(value, torch.Tensor)
        args += [value if per_row else None, 0 if per_row else float_scalar_arg(value)]
        flags[flag] = per_row
    return args, flags


def _split_parts(logits: torch.Tensor, n_rows: int, config: dict) -> tuple[int, int]:
    """(programs a row takes in _split_selection's launches over it, the lanes
    of each), or (0, 0) for one program a row: a row is split when it spans
    several tiles and the batch is small against the GPU: the split reads
    nothing more, but three more launches, a fold and a histogram a program
    cost a few microseconds (sm_90 model, V = 151936 bfloat16 top-k 50: split
    21.9 / 25.6 / 35.7 / 41.3 / 47.4 / 54.4 us against one program a row
    44.9 / 44.9 / 47.3 / 49.0 / 50.9 / 53.1 at B = 1 / 16 / 48 / 64 / 80 / 100;
    the share stays at half the SMs, short of the crossover, for what the
    model leaves out of the split: its global atomics and workspace traffic).
    The slice of a tile a program reads changes no result (each lane's
    statistics are its own)."""
    lanes = config["LANES"]
    tiles = _tiles(logits.shape[-1], config)
    if tiles < 2 or n_rows > _SPLIT_SM_SHARE * _sm_count(logits.device):
        return 0, 0
    slice_lanes = min(lanes, 32 * _SLICE_WARPS)
    return tiles * (lanes // slice_lanes), slice_lanes


def _tiles(vocab: int, config: dict) -> int:
    """Tiles of the statistics pass (reduce.softmax_stats) in a row."""
    return triton.cdiv(vocab, config["REPS"] * config["LANES"] * config["VEC"])


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The device's SMs; for the CPU (the interpreter) and the meta tensors of the
    static model (fastrl.bench.sass), an H100's 132."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def _split_selection(logits, n_rows, params, flags, config, acc_tl, parts, slice_lanes, window, workspace):
    """A row's reads over ``parts`` programs each (_select, SPLIT), of
    ``slice_lanes`` lanes (_split_parts): the tiles' lane statistics and the
    top-digit histogram (_split_tiles_kernel), the row's statistics and its
    list's floor (_split_rows_kernel, one program a row); with ``window``
    (_uses_window) the tiles' statistics alone, the row's statistics, then
    the window histogram (_split_window_kernel) and the floor
    (_split_floor_kernel); last the compaction (_split_compact_kernel), into
    ``workspace`` (_workspace)."""
    vocab = logits.shape[-1]
    tiles = _tiles(vocab, config)
    groups = workspace["lane_stats"].shape[1]
    layout = row_layout(logits)
    tile_meta = {k: config[k] for k in ("REPS", "LANES", "VEC")} | {"SLICE_LANES": slice_lanes}
    warps = max(slice_lanes // 32, 1)
    _split_tiles_kernel[(n_rows, parts)](
        logits, *layout, vocab, *params, workspace["lane_stats"], workspace["hist"], groups, **flags, **tile_meta,
        ALIGNED=config["ALIGNED"], MAX_IN_STORAGE_TYPE=config["MAX_IN_STORAGE_TYPE"], WINDOW=window, ACC=acc_tl,
        num_warps=warps, **_EXACT,
    )  # fmt: skip
    _split_rows_kernel[(n_rows,)](
        vocab, *params, workspace["lane_stats"], tiles, groups, workspace["hist"],
        workspace["records"], **flags, LANES=config["LANES"], LIST_CAP=config["LIST_CAP"], WINDOW=window,
        ACC=acc_tl, num_warps=_WARPS, **_EXACT,
    )  # fmt: skip
    if window:
        if acc_tl != tl.float64:  # (float64 rows never list: _list_floor)
            _split_window_kernel[(n_rows, parts)](
                logits, *layout, vocab, *params, workspace["records"], workspace["hist"], **flags, **tile_meta,
                ALIGNED=config["ALIGNED"], ACC=acc_tl, num_warps=warps, **_EXACT,
            )  # fmt: skip
        _split_floor_kernel[(n_rows,)](
            vocab, *params, workspace["hist"], workspace["records"], **flags, LIST_CAP=config["LIST_CAP"],
            ACC=acc_tl, num_warps=4, **_EXACT,
        )  # fmt: skip
    _split_compact_kernel[(n_rows, parts)](
        logits, *layout, vocab, workspace["records"], workspace["lists"], workspace["counters"], **tile_meta,
        LIST_CAP=config["LIST_CAP"], num_warps=warps, **_EXACT,
    )  # fmt: skip


def _uses_window(device: torch.device) -> bool:
    """Whether the sampler's launches on ``device`` take the window histogram
    (_window_bin: 128 bins from the row's max, a read of the row of its own)
    rather than the top-digit histogram (4096 bins, in the statistics pass)
    when the caller does not choose (``window=None``): where tl.histogram is
    slow, triton < 3.8 on a GPU (and the static model's meta tensors:
    _launch.FAST_HISTOGRAM_TRITON), whose cost grows with the bins (the
    4096-bin one made the sampler 20-270x slower on an H100; with the window
    the sm_90 model puts it within 1.2x of the top digits on triton 3.9). Both
    give the same results: the tests run both on one machine, the static
    model compiles both."""
    return device.type != "cpu" and triton_histogram_is_slow()


def _selection_args(logits, n_rows, params, flags, config, acc_tl, window) -> tuple[list, dict]:
    """The final launch's (_select) candidate lists, counters and split records
    (None for one program a row), and its SPLIT and WINDOW flags; ``window``:
    the row histogram (None: the device's, _uses_window)."""
    window = _uses_window(logits.device) if window is None else window
    parts, slice_lanes = _split_parts(logits, n_rows, config)
    workspace = _workspace(logits, n_rows, config, bool(parts), window, logits.device)
    if parts:
        _split_selection(logits, n_rows, params, flags, config, acc_tl, parts, slice_lanes, window, workspace)
    records = workspace["records"] if parts else None
    return [workspace["lists"], workspace["counters"], records], {"SPLIT": bool(parts), "WINDOW": window}


def sample_forward(logits, *, temperature, top_k, top_p, min_p, seed, offset, window=None):
    """One draw per row of ``logits`` [N, V] or [outer, inner, V] (unit stride in V,
    any leading strides: ``fastrl._rows.row_layout``): (tokens int64
    [N], log-probs under the processed distribution [N], raw log-probs [N]).
    Parameters are scalars or flat per-row tensors (accumulation dtype, int64
    for top_k); ``seed`` an int64 or int64 [N] per-row seeds; ``offset`` an int
    or a one-element int64 tensor read on the device. ``window``: whether the
    rows' histogram is the window's or the top digits' (the same results; None:
    the device's, _uses_window)."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    acc, acc_tl = acc_dtypes(logits)
    tokens = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(n_rows, dtype=acc, device=logits.device)
    raw = torch.empty(n_rows, dtype=acc, device=logits.device)
    args, flags = _params(temperature, top_k, top_p, min_p)
    per_row_seed, offset_from_ptr = isinstance(seed, torch.Tensor), isinstance(offset, torch.Tensor)
    config = _launch_config(logits)
    selection, split = _selection_args(logits, n_rows, args, flags, config, acc_tl, window)
    _sample_kernel[(n_rows,)](
        logits, *row_layout(logits), vocab, *args,
        seed if per_row_seed else None, 0 if per_row_seed else seed,
        offset if offset_from_ptr else None, 0 if offset_from_ptr else offset,
        tokens, logprobs, raw, *selection, **flags, **split, PER_ROW_SEED=per_row_seed,
        OFFSET_FROM_PTR=offset_from_ptr, ACC=acc_tl, **config, **_EXACT, maxnreg=_MAXNREG,
    )  # fmt: skip
    return tokens, logprobs, raw


def truncated_forward(logits, labels, *, temperature, top_k, top_p, min_p, with_stats, window=None):
    """(log-prob of ``labels`` under the processed distribution [N], stats [N, 3]
    = per row (max logit, log kept mass, threshold logit) for the backward, or None);
    ``window`` as sample_forward's."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    acc, acc_tl = acc_dtypes(logits)
    out = torch.empty(n_rows, dtype=acc, device=logits.device)
    stats = torch.empty(n_rows, 3, dtype=acc, device=logits.device) if with_stats else None
    args, flags = _params(temperature, top_k, top_p, min_p)
    config = _launch_config(logits)
    selection, split = _selection_args(logits, n_rows, args, flags, config, acc_tl, window)
    _truncated_fwd_kernel[(n_rows,)](
        logits, *row_layout(logits), vocab, labels, *args, out, stats, *selection, **flags, **split,
        WITH_STATS=with_stats, ACC=acc_tl, **config, **_EXACT, maxnreg=_MAXNREG,
    )  # fmt: skip
    return out, stats


def truncated_backward(logits, labels, stats, grad_logprob, grad_out, *, temperature, top_k, top_p, min_p,
                       label_base=0, label_kept=None):  # fmt: skip
    """Writes dL/dlogits into ``grad_out`` (the logits' rows, in its own layout)
    with the kept set held fixed. A vocabulary shard passes where its columns
    start (``label_base``; labels are global ids) and ``label_kept`` (bool [N]:
    whether each row's label is kept, which another shard may hold)."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    _, acc_tl = acc_dtypes(logits)
    args, flags = _params(temperature, top_k, top_p, min_p)
    block = _row_block(vocab)
    _truncated_bwd_kernel[(n_rows,)](
        logits, *row_layout(logits), vocab, labels, stats, grad_logprob, grad_out, *row_layout(grad_out),
        *args, label_base, label_kept, **flags, LABEL_KEPT_GIVEN=label_kept is not None, ACC=acc_tl,
        BLOCK_V=block, num_warps=8 if block >= 2048 else 4, **CONTRACTED,
    )  # fmt: skip


@triton.jit
def _shard_tile_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V, given_bits_ptr,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p, column_base,
    seeds_ptr, seed, offset_ptr, offset, masses_ptr, marks_ptr, TILES,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    RACE: tl.constexpr, PER_ROW_SEED: tl.constexpr,
    OFFSET_FROM_PTR: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The first launch of csrc/sampling.h's sample_shard_pass: a program a tile of a row (grid
    axis 1) writes the tile's (s, s_kept, best race score) in float64 to ``masses`` and (number of
    maxima, first maximum, race winner) as int32 shard indices to ``marks`` ([N, TILES, 3] each).
    The race's score d - log E rounds as _sample_kernel's (the same functions, compiled without
    fused multiply-adds), so its winner is the unsharded sampler's; Philox runs only in a tile
    that holds a kept token."""
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    t, _k, _p, mp, valid = _row_params(row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
                                       PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC)  # fmt: skip
    # (given's two scalars read as their bits: the static model holds every float load
    # of a loop-free kernel to the row stream's 128 bits)
    m = tl.load(given_bits_ptr + 2 * row).to(ACC, bitcast=True)
    threshold = _order_key(tl.load(given_bits_ptr + 2 * row + 1).to(ACC, bitcast=True))
    inv_t = _inverse_temperature(t, valid, ACC)
    log_min_p = tl.where(mp > 0, tl.log(mp), float("-inf")).to(ACC)
    offs = tile * BLOCK_V + tl.arange(0, BLOCK_V)
    live = offs < V
    x = tl.load(row_ptr + offs, mask=live, other=float("-inf")).to(ACC)
    d = (x - m) * inv_t
    e = tl.where(live, tl.exp(d), 0.0)
    kept = live & (_order_key(x) >= threshold) & (d >= log_min_p)
    at_max = live & (x == m)
    best = tl.full([], float("-inf"), ACC)
    winner = V + tl.zeros([], tl.int32)
    if RACE:
        if tl.max(kept.to(tl.int32), axis=0) > 0:
            k0, k1, salt, c2, c3 = _race_key(row, seeds_ptr, seed, offset_ptr, offset, PER_ROW_SEED,
                                             OFFSET_FROM_PTR)  # fmt: skip
            zeros = tl.zeros([BLOCK_V], tl.uint32)
            w0, w1, _w2, _w3 = philox4x32_10((offs + column_base).to(tl.uint32), zeros + salt, zeros + c2,
                                             zeros + c3, zeros + k0, zeros + k1)  # fmt: skip
            race = tl.where(kept, d - tl.log(exponential_variate(w0, w1).to(ACC)), float("-inf"))
            best = tl.max(race, axis=0)
            winner = tl.min(tl.where((race == best) & kept, offs, V), axis=0)  # ties: the lowest index
    at = (row * TILES + tile) * 3
    tl.store(masses_ptr + at, tl.sum(e.to(tl.float64), axis=0))
    tl.store(masses_ptr + at + 1, tl.sum(tl.where(kept, e, 0.0).to(tl.float64), axis=0))
    tl.store(masses_ptr + at + 2, best.to(tl.float64))
    tl.store(marks_ptr + at, tl.sum(at_max.to(tl.int32), axis=0))
    tl.store(marks_ptr + at + 1, tl.min(tl.where(at_max, offs, V), axis=0))
    tl.store(marks_ptr + at + 2, winner)


@triton.jit
def _shard_fold_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V, given_ptr,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p, column_base,
    labels_ptr, masses_ptr, marks_ptr, sums_ptr, picks_ptr, TILES,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    RACE: tl.constexpr, TILE_BLOCK: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The second launch: one program a row folds its tiles' records in a fixed tree (the same
    for every batch: a row's bits do not depend on the rows beside it) into the row's sums
    [N, 4] and picks [N, 2] (csrc/sampling.h)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    t, _k, _p, mp, valid = _row_params(row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
                                       PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC)  # fmt: skip
    m = tl.load(given_ptr + 2 * row).to(ACC)
    ok = (m > float("-inf")) & (m < float("inf")) & valid
    greedy = t == 0
    tiles = tl.arange(0, TILE_BLOCK)
    on = tiles < TILES
    at = (row * TILES + tiles) * 3
    s = tl.sum(tl.load(masses_ptr + at, mask=on, other=0.0), axis=0)
    s_kept = tl.sum(tl.load(masses_ptr + at + 1, mask=on, other=0.0), axis=0)
    n_max = tl.sum(tl.load(marks_ptr + at, mask=on, other=0), axis=0)
    first = tl.min(tl.load(marks_ptr + at + 1, mask=on, other=V), axis=0).to(tl.int64)
    nan = float("nan")
    if RACE:
        scores = tl.load(masses_ptr + at + 2, mask=on, other=float("-inf"))
        winners = tl.load(marks_ptr + at + 2, mask=on, other=V)
        top = tl.max(scores, axis=0)
        win_at = tl.min(tl.where((scores == top) & (winners < V), winners, V), axis=0).to(tl.int64)  # the lowest
        inv_t = _inverse_temperature(t, valid, ACC)
        d_win = (tl.load(row_ptr + win_at, mask=win_at < V, other=0.0).to(ACC) - m) * inv_t
        third = tl.where(greedy, 0.0, top)
        fourth = tl.where(greedy | (win_at >= V), 0.0, d_win.to(tl.float64))
        win = tl.where(greedy | (win_at >= V), -1, win_at + column_base)
    else:
        threshold = _order_key(tl.load(given_ptr + 2 * row + 1).to(ACC))
        inv_t = _inverse_temperature(t, valid, ACC)
        log_min_p = tl.where(mp > 0, tl.log(mp), float("-inf")).to(ACC)
        label = tl.load(labels_ptr + row).to(tl.int64) - column_base
        here = (label >= 0) & (label < V)
        x_label = tl.load(row_ptr + label, mask=here, other=0.0).to(ACC)
        d_label = (x_label - m) * inv_t
        kept_label = (_order_key(x_label) >= threshold) & (d_label >= log_min_p)
        third = tl.where(greedy, 0.0, tl.where(here, tl.where(kept_label, d_label, float("-inf")), nan).to(tl.float64))
        fourth = tl.zeros([], tl.float64)
        win = tl.full([], -1, tl.int64)
    tl.store(sums_ptr + 4 * row, tl.where(ok, tl.where(greedy, n_max.to(tl.float64), s), nan))
    tl.store(sums_ptr + 4 * row + 1, tl.where(ok, tl.where(greedy, 0.0, s_kept), nan))
    tl.store(sums_ptr + 4 * row + 2, tl.where(ok, third, nan))
    tl.store(sums_ptr + 4 * row + 3, tl.where(ok, fourth, nan))
    tl.store(picks_ptr + 2 * row, tl.where(ok, win, -1))
    tl.store(picks_ptr + 2 * row + 1, tl.where(ok & (first < V), first + column_base, -1))


@triton.jit
def _digit_histogram_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V, prefix_ptr, given_ptr, temps_ptr, temp, unit_scale,
    hist_ptr, SHIFT: tl.constexpr, PER_ROW_T: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """csrc/sampling.h's shard_digit_histogram: a program a tile of a row (grid axis 1: the tiles)
    adds each counted token to its digit's bin with an integer atomic (exact: the same sums in any
    order, so a row's bins do not depend on how its tiles are spread); ``hist`` [N, 1 or 2, 256]
    (counts, then with WEIGHTED mass units) arrives zeroed."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    KEY_BITS: tl.constexpr = 64 if ACC == tl.float64 else 32
    want = tl.load(prefix_ptr + row)
    want = want.to(tl.uint64, bitcast=True) if ACC == tl.float64 else want.to(tl.uint32)
    if WEIGHTED:
        m = tl.load(given_ptr + 2 * row).to(ACC)
        floor = tl.load(given_ptr + 2 * row + 1).to(ACC)
        t = _row_param(temps_ptr, temp, row, PER_ROW_T, ACC)
        inv_t = tl.where(t > 0, 1.0 / t, 1.0).to(ACC)
        scale = float_scalar(unit_scale, tl.float64)
    counts_ptr = hist_ptr + row * (512 if WEIGHTED else 256)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(row_ptr + offs, mask=offs < V, other=0.0).to(ACC)
    key = _order_key(x)
    counted = offs < V
    if SHIFT + 8 < KEY_BITS:
        counted &= ((key ^ want) >> (SHIFT + 8)) == 0
    if WEIGHTED:
        counted &= x >= floor
    digit = ((key >> SHIFT) & 0xFF).to(tl.int32)
    tl.atomic_add(counts_ptr + digit, tl.full([BLOCK_V], 1, tl.int64), mask=counted, sem="relaxed")
    if WEIGHTED:
        # (e <= 1 below the row's max; the minimum keeps a row the caller ignores (bad) from overflowing)
        e = tl.minimum(tl.exp((x - m) * inv_t), 1.0).to(tl.float64)
        units = (e * scale + 0.5).to(tl.int64)
        tl.atomic_add(counts_ptr + 256 + digit, units, mask=counted & (units > 0), sem="relaxed")


def shard_digit_histogram(logits, prefix, shift, given=None, *, temperature=1.0, unit_scale=0.0):
    """hist [N, 1 or (with ``given``) 2, 256] int64 of one round of the tensor-parallel sampler's
    threshold search (csrc/sampling.h, shard_digit_histogram): each row's digit counts, and with
    ``given`` (max, floor) [N, 2] the counted tokens' mass units."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    _, acc_tl = acc_dtypes(logits)
    hist = torch.zeros(n_rows, 1 if given is None else 2, 256, dtype=torch.int64, device=logits.device)
    per_row_t = isinstance(temperature, torch.Tensor)
    block = min(triton.next_power_of_2(vocab), _SHARD_PASS_BLOCK)
    _digit_histogram_kernel[(n_rows, triton.cdiv(vocab, block))](
        logits, *row_layout(logits), vocab, prefix, given, temperature if per_row_t else None,
        0 if per_row_t else float_scalar_arg(temperature), float_scalar_arg(float(unit_scale)), hist,
        SHIFT=shift, PER_ROW_T=per_row_t, WEIGHTED=given is not None, BLOCK_V=block, ACC=acc_tl, num_warps=4,
        **_EXACT,
    )  # fmt: skip
    return hist


def sample_shard_pass(logits, given, *, temperature, min_p, column_base, seed=None, offset=0, labels=None):
    """One vocabulary shard's pass of the tensor-parallel sampler (csrc/sampling.h,
    sample_shard_pass): (sums float64 [N, 4], picks int64 [N, 2]) of ``logits``
    [N, V_r] (or [outer, inner, V_r]) from ``given`` [N, 2] (max, threshold
    logit) in the accumulation dtype; the race with ``seed`` / ``offset`` as
    sample_forward's, or with ``labels`` (global ids) the truncated log-prob's
    terms."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    _, acc_tl = acc_dtypes(logits)
    sums = torch.empty(n_rows, 4, dtype=torch.float64, device=logits.device)
    picks = torch.empty(n_rows, 2, dtype=torch.int64, device=logits.device)
    args, flags = _params(temperature, 0, 1.0, min_p)
    per_row_seed, offset_from_ptr = isinstance(seed, torch.Tensor), isinstance(offset, torch.Tensor)
    block = min(triton.next_power_of_2(vocab), _SHARD_PASS_BLOCK)
    tiles = triton.cdiv(vocab, block)
    masses = torch.empty(n_rows, tiles, 3, dtype=torch.float64, device=logits.device)
    marks = torch.empty(n_rows, tiles, 3, dtype=torch.int32, device=logits.device)
    given_bits = given.view(torch.int64 if acc_tl == tl.float64 else torch.int32)
    _shard_tile_kernel[(n_rows, tiles)](
        logits, *row_layout(logits), vocab, given_bits, *args, column_base,
        seed if per_row_seed else None, 0 if per_row_seed or seed is None else seed,
        offset if offset_from_ptr else None, 0 if offset_from_ptr else offset, masses, marks, tiles,
        **flags, RACE=labels is None, PER_ROW_SEED=per_row_seed, OFFSET_FROM_PTR=offset_from_ptr, BLOCK_V=block,
        ACC=acc_tl, num_warps=4, **_EXACT,
    )  # fmt: skip
    _shard_fold_kernel[(n_rows,)](
        logits, *row_layout(logits), vocab, given, *args, column_base, labels, masses, marks, sums, picks, tiles,
        **flags, RACE=labels is None, TILE_BLOCK=triton.next_power_of_2(tiles), ACC=acc_tl, num_warps=4, **_EXACT,
    )  # fmt: skip
    return sums, picks
