"""A vocabulary shard of the tensor-parallel sampler (fastrl._sharded.sampling):
three kernels, a program a tile of a row each but the fold: the threshold
search's digit histogram (_digit_histogram_kernel, integer atomics: exact in
any order), then the shard pass: each tile's masses, maxima and race winner
(_shard_tile_kernel, the race's score rounding as sample._sample_kernel's,
Philox only in tiles holding a kept token), folded a row at a time in a fixed
tree (_shard_fold_kernel). Their launchers are sampling.shard_digit_histogram
and sampling.sample_shard_pass (csrc/sampling.h has the C++ twins)."""

from __future__ import annotations

import triton
import triton.language as tl

from .._launch import float_scalar
from ..random import exponential_variate, philox4x32_10
from ..reduce import fold_segments, log_sum, row_start, segment_stats
from .compact import _mass_rest, _mass_units, _mass_value, _weight_units
from .keys import _order_key, _race_key
from .params import _inverse_temperature, _row_param, _row_params
from .sample import _FLOAT32_LOWEST


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
    axis 1) writes the tile's (s, s_kept, best race score, u = sum_kept e (-d)) to ``masses``
    ([N, TILES, _tile_record(ACC)] float64; the three masses in _mass_units, in its bits, and for
    float64 rows then their _mass_rest) and (number of maxima, first maximum, race winner) as
    int32 shard indices to ``marks`` ([N, TILES, 3]).
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
    # The race's processed entropy takes the tile's u = sum_kept e (-d), in a tile that holds a
    # kept token; a kept -inf logit, e = 0, adds 0 * finite (d held above -inf).
    spread = tl.zeros([], tl.int64)
    spread_rest = tl.zeros([], tl.int64)  # (float64 rows: _mass_rest)
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
            spread_e = tl.where(kept, e * -tl.maximum(d, _FLOAT32_LOWEST), 0.0)
            spread = tl.sum(_mass_units(spread_e, ACC), axis=0)
            if ACC == tl.float64:
                spread_rest = tl.sum(_mass_rest(spread_e), axis=0)
    # The masses as the unsharded sampler sums them (sample._select), in its fixed point
    # (compact._mass_units, int64: exact, so the tiles' and the ranks' integer sums are the
    # unsharded row's bits; one conversion a token for s and s_kept).
    units = _mass_units(e, ACC)
    mass_at = (row * TILES + tile) * _tile_record(ACC)
    tl.store(masses_ptr + mass_at, tl.sum(units, axis=0).to(tl.float64, bitcast=True))
    tl.store(masses_ptr + mass_at + 1, tl.sum(tl.where(kept, units, 0), axis=0).to(tl.float64, bitcast=True))
    tl.store(masses_ptr + mass_at + 2, best.to(tl.float64))
    tl.store(masses_ptr + mass_at + 3, spread.to(tl.float64, bitcast=True))
    if ACC == tl.float64:
        rest = _mass_rest(e)
        tl.store(masses_ptr + mass_at + 4, tl.sum(rest, axis=0).to(tl.float64, bitcast=True))
        tl.store(masses_ptr + mass_at + 5, tl.sum(tl.where(kept, rest, 0), axis=0).to(tl.float64, bitcast=True))
        tl.store(masses_ptr + mass_at + 6, spread_rest.to(tl.float64, bitcast=True))
    at = (row * TILES + tile) * 3
    tl.store(marks_ptr + at, tl.sum(at_max.to(tl.int32), axis=0))
    tl.store(marks_ptr + at + 1, tl.min(tl.where(at_max, offs, V), axis=0))
    tl.store(marks_ptr + at + 2, winner)


@triton.constexpr_function
def _tile_record(acc):
    """Float64 slots of a tile's record (_shard_tile_kernel): s, s_kept, the race's best score
    and u, then for float64 rows the low limbs (compact._mass_rest) of s, s_kept and u."""
    return 7 if str(acc) == "fp64" else 4


@triton.jit
def _tiles_mass(at_ptr, on):
    """The int64 sum of a row's tile masses (stored as float64 bits)."""
    return tl.sum(tl.load(at_ptr, mask=on, other=0.0).to(tl.int64, bitcast=True), axis=0)


@triton.jit
def _count_mass(n, ACC: tl.constexpr):
    """A greedy row's s, its number of maxima n, in _mass_units."""
    return n.to(tl.int64) << (32 if ACC == tl.float64 else 42)


@triton.jit
def _shard_fold_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V, given_ptr,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p, column_base,
    labels_ptr, masses_ptr, marks_ptr, scores_ptr, row_masses_ptr, picks_ptr, TILES,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    RACE: tl.constexpr, TILE_BLOCK: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The second launch: one program a row folds its tiles' records in a fixed tree (the same
    for every batch: a row's bits do not depend on the rows beside it) into the row's scores
    [N, 2] float64 (the race's best and the winner's d, or the label's d), its masses [N, 6]
    int64 (s, s_kept, u, each as (_mass_units, _mass_rest) sums, the rest 0 for float32 rows;
    0 for a row left to the caller) and picks [N, 2] (csrc/sampling.h)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    t, _k, _p, mp, valid = _row_params(row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
                                       PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC)  # fmt: skip
    m = tl.load(given_ptr + 2 * row).to(ACC)
    ok = (m > float("-inf")) & (m < float("inf")) & valid
    greedy = t == 0
    tiles = tl.arange(0, TILE_BLOCK)
    on = tiles < TILES
    mass_at = (row * TILES + tiles) * _tile_record(ACC)
    at = (row * TILES + tiles) * 3
    s = _tiles_mass(masses_ptr + mass_at, on)
    s_kept = _tiles_mass(masses_ptr + mass_at + 1, on)
    spread = _tiles_mass(masses_ptr + mass_at + 3, on)
    s_rest = tl.zeros([], tl.int64)
    s_kept_rest = tl.zeros([], tl.int64)
    spread_rest = tl.zeros([], tl.int64)
    if ACC == tl.float64:
        s_rest = _tiles_mass(masses_ptr + mass_at + 4, on)
        s_kept_rest = _tiles_mass(masses_ptr + mass_at + 5, on)
        spread_rest = _tiles_mass(masses_ptr + mass_at + 6, on)
    n_max = tl.sum(tl.load(marks_ptr + at, mask=on, other=0), axis=0)
    first = tl.min(tl.load(marks_ptr + at + 1, mask=on, other=V), axis=0).to(tl.int64)
    nan = float("nan")
    if RACE:
        scores = tl.load(masses_ptr + mass_at + 2, mask=on, other=float("-inf"))
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
    tl.store(scores_ptr + 2 * row, tl.where(ok, third, nan))
    tl.store(scores_ptr + 2 * row + 1, tl.where(ok, fourth, nan))
    # (a greedy row's s: its number of maxima, in the same units)
    masses_at = row_masses_ptr + 6 * row
    tl.store(masses_at, tl.where(ok, tl.where(greedy, _count_mass(n_max, ACC), s), 0))
    tl.store(masses_at + 1, tl.where(ok & ~greedy, s_rest, 0))
    tl.store(masses_at + 2, tl.where(ok & ~greedy, s_kept, 0))
    tl.store(masses_at + 3, tl.where(ok & ~greedy, s_kept_rest, 0))
    tl.store(masses_at + 4, tl.where(ok & ~greedy, spread, 0))
    tl.store(masses_at + 5, tl.where(ok & ~greedy, spread_rest, 0))
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
        scale = float_scalar(unit_scale, tl.float64)  # (float64 rows)
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
        # (the unsharded sampler's own weights: its top-p threshold, bit for bit)
        units = _weight_units(tl.minimum(tl.exp((x - m) * inv_t), 1.0), scale, ACC)
        tl.atomic_add(counts_ptr + 256 + digit, units, mask=counted & (units > 0), sem="relaxed")


@triton.jit
def _mass_logs_kernel(masses_ptr, logs_ptr, n_rows, BLOCK: tl.constexpr, ACC: tl.constexpr):
    """(log s, log s_kept, entropy) [N, 3] float64 of masses [N, 6] (_shard_fold_kernel's, summed
    over the ranks: (_mass_units, _mass_rest) sums of s, s_kept and u) by sample._select's own
    formula in ACC: the unsharded Triton sampler's log s_kept and entropy, bit for bit."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = rows < n_rows
    at = masses_ptr + 6 * rows
    s = _mass_value(tl.load(at, mask=live, other=0), tl.load(at + 1, mask=live, other=0), ACC).to(ACC)
    s_kept = _mass_value(tl.load(at + 2, mask=live, other=0), tl.load(at + 3, mask=live, other=0), ACC).to(ACC)
    spread = _mass_value(tl.load(at + 4, mask=live, other=0), tl.load(at + 5, mask=live, other=0), ACC).to(ACC)
    log_s_kept = tl.log(s_kept)
    tl.store(logs_ptr + 3 * rows, tl.log(s).to(tl.float64), mask=live)
    tl.store(logs_ptr + 3 * rows + 1, log_s_kept.to(tl.float64), mask=live)
    tl.store(logs_ptr + 3 * rows + 2, (log_s_kept + spread / s_kept).to(tl.float64), mask=live)


@triton.jit
def _shard_segments_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V, SEG, temps_ptr, temp, segments_ptr,
    PER_ROW_T: tl.constexpr, REPS: tl.constexpr, SEGS: tl.constexpr, REAL: tl.constexpr, SEG_LANES: tl.constexpr,
    VEC: tl.constexpr, ALIGNED: tl.constexpr, MAX_IN_STORAGE_TYPE: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Each of a shard's rows' REAL segments' (m, n, t) ([N, REAL, 3] float64, m
    in ACC's value), a program a row, in sample._select's statistics pass
    (reduce.segment_stats, FOLD_TILES, with the whole row's REPS, SEG_LANES and
    VEC; SEGS slots, REAL of them read), so the same bits as the unsharded
    sampler's segments. 1/T as _select takes it (1 for a greedy row; a row
    with a bad temperature is bad whatever its statistics)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    t = _row_param(temps_ptr, temp, row, PER_ROW_T, ACC)
    inv_t = _inverse_temperature(t, (t >= 0) & (t < float("inf")), ACC)
    m, n, tail, _no_w, _no_q = segment_stats(row_ptr, V, SEG, inv_t, False, False, REPS, SEGS, REAL, SEG_LANES, VEC,
                                             ALIGNED, MAX_IN_STORAGE_TYPE, ACC, FOLD_TILES=True)  # fmt: skip
    slot = tl.arange(0, SEGS)
    out = segments_ptr + (row * REAL + slot) * 3
    tl.store(out, m.to(tl.float64), mask=slot < REAL)
    tl.store(out + 1, n, mask=slot < REAL)
    tl.store(out + 2, tail, mask=slot < REAL)


@triton.jit
def _segments_fold_kernel(segments_ptr, temps_ptr, temp, stats_ptr, PER_ROW_T: tl.constexpr, SEGS: tl.constexpr,
                          ACC: tl.constexpr):  # fmt: skip
    """A row's (m, s, log s) [N, 3] float64 from its SEGS segments' (m, n, t)
    gathered from the ranks in vocabulary order (_shard_segments_kernel's): the
    fold of sample._select (reduce.fold_segments) and sample._row_state's
    s = n + t and log s, so the unsharded sampler's bits."""
    row = tl.program_id(0).to(tl.int64)
    t = _row_param(temps_ptr, temp, row, PER_ROW_T, ACC)
    inv_t = _inverse_temperature(t, (t >= 0) & (t < float("inf")), ACC)
    at = segments_ptr + (row * SEGS + tl.arange(0, SEGS)) * 3
    zero = tl.zeros([SEGS], tl.float64)
    m, n, tail, _no_w, _no_q = fold_segments(tl.load(at).to(ACC), tl.load(at + 1), tl.load(at + 2), zero, zero, inv_t,
                                             False, False)  # fmt: skip
    tl.store(stats_ptr + 3 * row, m.to(tl.float64))
    tl.store(stats_ptr + 3 * row + 1, n + tail)
    tl.store(stats_ptr + 3 * row + 2, log_sum(n, tail).to(ACC).to(tl.float64))
