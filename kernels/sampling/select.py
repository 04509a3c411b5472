"""Which tokens a row keeps, and which go on its candidate list. A row's state
from its statistics (``_row_state``); the list's floor: from its sub-lanes'
maxima (``_lane_floor``, one program a row, on every Triton), or from a
histogram, of its keys' top digits (``_tile_top_digits``, in a split row's
statistics pass; for top-p alone a floor from mass bounds, ``_top_p_floor``)
or of the window below its max (``_window_histogram``: one program's
fallback, and a split row's histogram where triton's tl.histogram is slow,
< 3.8, sampling._uses_window, the list's floor as a logit, _window_edge);
and the thresholds over the list: a radix selection for top-k
(``_kth_largest_key32``), a 16-way descent for top-p and for float64 keys
(``_largest_key_reaching``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..reduce import log_sum
from .compact import _list_entries, _weight_units, _weight_value
from .keys import _BINS, _digit_edge, _key_to_value, _order_key, _top_digit_of

# The bins of the window histogram (_window_bin), the statistics pass's
# histogram where triton's tl.histogram is slow (_uses_window).
_WINDOW_BINS = tl.constexpr(128)
# A window bin's y (_window_bin) keeps the float32 bits from this one up: 16
# bins a doubling (8 made the sampler's top-p lists 1.4x as long, the window
# pass 14% cheaper on triton 3.6).
_WINDOW_SHIFT = tl.constexpr(19)
_WINDOW_ONE = tl.constexpr(0x3F800000 >> _WINDOW_SHIFT.value)  # 1.0's bin


@triton.jit
def _largest_key_reaching(row_ptr, cand_ptr, compacted, n, m, inv_t, floor_key, target, unit_scale, inverse_scale,
                          WEIGHTED: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """The largest key u with F(u) >= target, where F(u) counts (or, WEIGHTED,
    sums e_j = exp((x_j - m) / T) over, in _weight_units of ``unit_scale``, whose
    inverse is ``inverse_scale`` (float64 rows); the target a float64 mass)
    the list's tokens (_list_entries) with key >= max(u, floor_key).
    F is non-increasing, so a descent digit by digit (16 pivots per pass, most
    significant first) keeps the largest pivot that still reaches the target.
    The answer is the key of a list entry (F steps only there), so the bits its
    row type leaves out of every key (_low_key_bits) are not searched but
    filled in."""
    KEY_BITS: tl.constexpr = 64 if ACC == tl.float64 else 32
    KEY: tl.constexpr = tl.uint64 if ACC == tl.float64 else tl.uint32  # _order_key's type
    LOW: tl.constexpr = _low_key_bits(row_ptr.dtype.element_ty, 4)
    digits = tl.arange(0, 16).to(KEY)
    prefix = tl.zeros([], KEY)
    for level in tl.static_range((KEY_BITS - LOW) // 4):
        shift = KEY_BITS - 4 * (level + 1)  # a constexpr: level is one in static_range
        pivots = prefix + (digits << shift)
        reach = tl.zeros([16], tl.int64)
        for start in range(0, n, BLOCK):
            x, _, live = _list_entries(row_ptr, cand_ptr, compacted, n, start + tl.arange(0, BLOCK), ACC)
            key = _order_key(x)
            live = live & (key >= floor_key)
            above = (key[:, None] >= pivots[None, :]) & live[:, None]
            if WEIGHTED:
                e = _weight_units(tl.exp((x - m) * inv_t), unit_scale, ACC)
                reach += tl.sum(tl.where(above, e[:, None], 0), axis=0)
            else:
                reach += tl.sum(above.to(tl.int64), axis=0)
        if WEIGHTED:
            best = tl.max(tl.where(_weight_value(reach, inverse_scale, ACC) >= target, digits, 0), axis=0)
        else:
            best = tl.max(tl.where(reach >= target, digits, 0), axis=0)
        prefix = prefix + (best << shift)
    return _fill_low_bits(prefix, LOW)


@triton.constexpr_function
def _low_key_bits(row_type, digit_bits):
    """Of a 32-bit key (_order_key) of a logit of ``row_type`` widened to float32,
    the low bits that are the same for every key of its sign, rounded down to
    whole digits of ``digit_bits``: a bfloat16's 16 (its float32 has 16 more
    mantissa bits, all zero), a float16's 13 (12 in 4-bit digits, 8 in 8-bit
    ones), none for float32 and float64."""
    spare = {"bf16": 16, "fp16": 13}.get(str(row_type), 0)
    return spare - spare % digit_bits


@triton.jit
def _fill_low_bits(prefix, LOW: tl.constexpr):
    """The key of a logit whose key's bits above LOW are ``prefix``'s, when every
    such logit's float32 bits below LOW are zero (_low_key_bits): a positive
    logit's key keeps its bits (zero), a negative one's has them flipped (all
    ones: _order_key flips a negative logit's bits); -0.0 keys as +0.0."""
    if LOW > 0:
        ones: tl.constexpr = (1 << LOW) - 1
        prefix = tl.where((prefix >> (prefix.dtype.primitive_bitwidth - 1)) == 1, prefix, prefix | ones)
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
    LOW: tl.constexpr = _low_key_bits(row_ptr.dtype.element_ty, 8)
    prefix = tl.zeros([], tl.uint32)
    counts = _digit_histogram(row_ptr, cand_ptr, compacted, n, floor_key, prefix, 32, 24, BLOCK)
    d, k = _top_digit(counts, k, 256)
    prefix = d
    for level in tl.static_range(1, (32 - LOW) // 8):
        shift = 24 - 8 * level  # a constexpr: level is one in static_range
        counts = _digit_histogram(row_ptr, cand_ptr, compacted, n, floor_key, prefix, shift + 8, shift, BLOCK)
        d, k = _top_digit(counts, k, 256)
        prefix = (prefix << 8) | d
    # the bytes a bfloat16 or float16 key leaves alike (_low_key_bits): its own, as the
    # full selection would find them in the one key the answer is
    return _fill_low_bits(prefix << LOW, LOW)


@triton.jit
def _tile_top_digits(x, mask):
    """The counts [_BINS] of the top digits (_top_digit_of) of a tile's 32-bit
    keys: x of any shape, mask None (every element) or of x's shape. One
    histogram of the whole tile. A masked-off
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
def _lane_floor(sub, k, p, m, inv_t, s, k_on, p_on):
    """(lowest, found): a floor for the row's candidate list from its sub-lanes'
    maxima (reduce.segment_stats' SUB_MAX, [LANES, VEC] float32), with no
    histogram: the tokens >= lowest hold every kept token when ``found``.

    The floor is the lowest max of a set S of sub-lanes, so each of S's
    sub-lanes holds a token >= lowest:
    - top-k: |S| >= k, so at least k tokens are >= lowest, and so is the k-th
      largest (top-p only narrows the top-k set);
    - top-p alone: the maxima of S have a mass sum_S exp((M_i - m) / T) >=
      p * s (1 + 2^-8), so every token below lowest has at least p * s of mass
      strictly above it, and top-p drops it. 2^-8 is far above the float32
      rounding of the terms and their sum (4096 terms: < 2^-11 relative), as
      for _window_floor's bounds.
    S is the sub-lanes whose gap d = (m - M_i) / T is at most a pivot, the
    lowest pivot that reaches k (or p * s): 16 doubling pivots 2^-3 .. 2^12,
    then 16 steps across the one found, so that the floor sits within 1/16 of
    the pivot's span below where S first reaches. Sub-lanes of -inf (d =
    inf) are never in S. Not ``found`` when no pivot reaches (k above the
    sub-lanes, a top-p mass spread over more tokens than the sub-lanes'
    maxima hold): the caller takes the window histogram (_window_floor).
    On the benchmark's rows (randn * 3 at T = 0.7, V = 151936 bfloat16, 4096
    sub-lanes) top-k 50 lists 52 to 58 tokens and top-p 0.9 245 to 710."""
    SIZE: tl.constexpr = sub.numel
    x = tl.reshape(sub, [SIZE]).to(tl.float32)
    d = (m.to(tl.float32) - x) * inv_t.to(tl.float32)  # inf for a sub-lane of -inf
    weight = tl.where(k_on, 1.0, tl.exp(-d))  # a count is exact in float32 (<= 2^24)
    target = tl.where(k_on, k.to(tl.float64), p.to(tl.float64) * s * 1.00390625)
    steps = tl.arange(0, 16)
    coarse = tl.exp2((steps - 3).to(tl.float32))
    reach = tl.sum(tl.where(d[:, None] <= coarse[None, :], weight[:, None], 0.0), axis=0)
    first = tl.minimum(tl.min(tl.where(reach.to(tl.float64) >= target, steps, 16), axis=0), 15)
    high = tl.sum(tl.where(steps == first, coarse, 0.0), axis=0)
    low = tl.where(first == 0, 0.0, high * 0.5)
    fine = tl.where(steps == 15, high, low + (high - low) * ((steps + 1).to(tl.float32) * 0.0625))
    reach = tl.sum(tl.where(d[:, None] <= fine[None, :], weight[:, None], 0.0), axis=0)
    chosen = tl.min(tl.where(reach.to(tl.float64) >= target, steps, 15), axis=0)
    pivot = tl.sum(tl.where(steps == chosen, fine, 0.0), axis=0)
    # S, and whether it reaches: summed once more over exactly the set the floor is
    # taken from (another reduction order of the same terms could round across the target)
    in_s = d <= pivot
    found = tl.sum(tl.where(in_s, weight, 0.0), axis=0).to(tl.float64) >= target
    lowest = tl.min(tl.where(in_s, x, float("inf")), axis=0)
    return lowest, found


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
def _window_counts(bins, live):
    """The counts [_WINDOW_BINS] of window bins ``bins`` (_window_bin) of any
    shape whose elements ``live`` (of their shape) are tokens: the others were
    loaded as -inf, so they lie in the last bin, and are taken back out of it.
    tl.histogram gets no mask: under triton 3.6 a histogram's values and its
    mask, reshaped from tiles of different layouts, are each reordered on their
    own (tt.reshape allow_reorder), and a value was counted under another's
    mask: a split row lost 1 to 3 of its tokens from the bins its list holds
    (an H200, 2026-11-27), its list overflowed the count, and the tokens its
    last launch read varied from call to call."""
    SIZE: tl.constexpr = bins.numel
    counts = tl.histogram(tl.reshape(bins, [SIZE]), _WINDOW_BINS)
    dead = SIZE - tl.sum(tl.reshape(live.to(tl.int32), [SIZE]), axis=0)
    return counts - tl.where(tl.arange(0, _WINDOW_BINS) == _WINDOW_BINS - 1, dead, 0)


@triton.jit
def _window_histogram(row_ptr, V, m, c, TILE: tl.constexpr):
    """The row's window histogram [_WINDOW_BINS] (_window_bin of every token), a
    read of the row in tiles of TILE."""
    counts = tl.zeros([_WINDOW_BINS], tl.int32)
    for start in range(0, V, TILE):
        offs = start + tl.arange(0, TILE)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        counts += _window_counts(_window_bin(x, m, c), offs < V)
    return counts


@triton.jit
def _row_state(V, t, k, p, valid, m, n_max, tail, ACC: tl.constexpr):
    """From the row's statistics (m, n_max, tail: reduce.segment_stats, folded): (bad,
    greedy, m_safe, s, log s, k_on, p_on). A row is bad (nothing to sample) with
    a NaN (s is NaN: reduce.segment_stats), a +inf (m = inf: softmax is NaN),
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
    # compact (a list entry holds a float32 logit): their list is the row.
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
