"""A row's selection (``_select``: one program's reads of the row, or a split
row's record; then the thresholds, the kept mass and the first argmax over its
candidate list) and the one-program-a-row kernels that use it: the draw
(``_sample_kernel``: the exponential race over the list's kept tokens), the
truncated log-prob (``_truncated_fwd_kernel``), and the truncated log-prob's
backward (``_truncated_bwd_kernel``), which reads the row with the kept set
the forward left in its statistics."""

from __future__ import annotations

import triton
import triton.language as tl

from ..random import exponential_variate, philox4x32_10
from ..reduce import fold_segments, row_start, segment_stats
from .compact import (
    _compact,
    _float64_unit_scale,
    _list_entries,
    _mass_rest,
    _mass_units,
    _mass_value,
    _weight_units,
    _weight_value,
)
from .keys import _key_to_value, _order_key, _race_key
from .params import _inverse_temperature, _row_params
from .select import (
    _kth_largest_key32,
    _lane_floor,
    _largest_key_reaching,
    _list_floor,
    _row_state,
    _window_histogram,
    _window_scale,
)
from .split import _SPLIT_RECORD, _record_stats

# The least finite float32: d held above it still has e = exp(d) = 0 wherever it moves.
_FLOAT32_LOWEST = tl.constexpr(-3.4028234663852886e38)


@triton.jit
def _select(row_ptr, V, t, k, p, min_p, valid, cand_ptr, counter_ptr, split_ptr, SEG,
            SPLIT: tl.constexpr, REPS: tl.constexpr, LANES: tl.constexpr, SEGS: tl.constexpr,
            SEG_LANES: tl.constexpr, VEC: tl.constexpr,
            ALIGNED: tl.constexpr, MAX_IN_STORAGE_TYPE: tl.constexpr, LIST_BLOCK: tl.constexpr,
            SEARCH_BLOCK: tl.constexpr, LIST_CAP: tl.constexpr, ACC: tl.constexpr,
            WITH_ENTROPY: tl.constexpr = False, WITH_DRAW: tl.constexpr = False, race_key=None):  # fmt: skip
    """Everything about one row's processed distribution: (bad, greedy, m, first
    argmax, number of maxima, 1/T, log s, threshold key, log min_p, log s_kept,
    whether the row's kept tokens are on its candidate list (compacted; else
    the list is the row, _list_entries), the list's length, with
    WITH_ENTROPY its entropy, else 0, and with WITH_DRAW the drawn token, the
    winner of the exponential race over the kept tokens under ``race_key``
    (keys._race_key), else the first argmax) with s = sum_j e_j over the row, e_j =
    exp(d_j), d_j = (x_j - m) / T, and s_kept over the kept tokens (key >=
    threshold and d >= log min_p); bad as _row_state. The entropy of q_j =
    e_j / s_kept is -sum q_j log q_j = log s_kept + u / s_kept with u = sum_kept
    e_j (-d_j) >= 0, summed as s_kept is (in fixed point, so in any order of
    the list and on any split of the row: _mass_units, which hold e (-d) <= 1/e
    too); a greedy row's is 0. The top-p search weighs tokens
    in _weight_units (float64 rows: one limb, in the units of the vocabulary
    shards' search, fastrl._sharded.sampling).

    Two reads of the row on every Triton, with no histogram in either: its
    statistics (reduce.segment_stats, its segments folded: m, s and the number
    of maxima; the bits a vocabulary shard's ranks fold, fastrl._sharded.sampling) with
    its sub-lanes' maxima from the same loads; then, for a row that lists
    (top-k, top-p, greedy), the compaction of the tokens at or above the
    floor those maxima give (_lane_floor; the max itself for a greedy row)
    into this row's list of LIST_CAP entries (_compact). Where the maxima
    give no floor (top-p over a mass spread wider than they hold), the
    window histogram (_window_histogram, _list_floor) is a read between the
    two. With SPLIT, other programs made those reads (_split_selection) and
    left the row's statistics and list at split_ptr (_split_rows_kernel).
    The thresholds, then s_kept, the first argmax and the draw in one more
    pass, read the list only. A row with more candidates than that (top-p
    over a flat row) uses the row itself as its list: the same code, each
    step a read of the row."""
    neg_inf = float("-inf")
    inv_t = _inverse_temperature(t, valid, ACC)
    if SPLIT:
        m, n_max, tail = _record_stats(split_ptr, ACC)
    else:
        # The row's SEGS segments of SEG logits (fastrl._rows.segment_length), folded
        # along fold_segments' tree: the statistics a vocabulary shard's ranks fold
        # from theirs (shard._shard_segments_kernel); float64 rows never list.
        if ACC == tl.float64:
            m, n_max, tail, w, q = segment_stats(row_ptr, V, SEG, inv_t, False, False, REPS, SEGS, SEGS, SEG_LANES, VEC,
                                                 ALIGNED, MAX_IN_STORAGE_TYPE, ACC, FOLD_TILES=True)  # fmt: skip
        else:
            m, n_max, tail, w, q, sub = segment_stats(row_ptr, V, SEG, inv_t, False, False, REPS, SEGS, SEGS, SEG_LANES,
                                                      VEC, ALIGNED, MAX_IN_STORAGE_TYPE, ACC, FOLD_TILES=True,
                                                      SUB_MAX=True)  # fmt: skip
        m, n_max, tail, _no_w, _no_q = fold_segments(m, n_max, tail, w, q, inv_t, False, False)
    bad, greedy, m_safe, s, log_s, k_on, p_on = _row_state(V, t, k, p, valid, m, n_max, tail, ACC)
    # A listed row reads the entries its compaction counted (the counter; past
    # LIST_CAP the row is its own list), never a histogram's count of them: a
    # count off by one made the tokens read depend on the atomics' order.
    if SPLIT:
        compacted = tl.load(split_ptr + 4) != 0
        n_candidates = tl.where(compacted, tl.load(counter_ptr), V)
        compacted = compacted & (n_candidates <= LIST_CAP)
    else:
        # Float64 rows never compact (a list entry holds a float32 logit): their list is the row.
        n_candidates = V + tl.zeros([], tl.int32)
        compacted = n_candidates < 0
        if ACC != tl.float64:
            if (~bad) & (k_on | p_on | greedy):
                lowest = m_safe.to(tl.float32)  # greedy: the maxima (the first argmax)
                found = lowest == lowest
                if k_on | p_on:
                    lowest, found = _lane_floor(sub, k, p, m_safe, inv_t, s, k_on, p_on)
                if found:
                    _compact(row_ptr, 0, V, V, 0, lowest, cand_ptr, counter_ptr, REPS, LANES, VEC, LANES, LIST_CAP)
                    # the tokens >= lowest, counted by the compaction's atomics
                    n_candidates = tl.atomic_add(counter_ptr, 0, sem="relaxed")
                    compacted = (n_candidates <= LIST_CAP) & (n_candidates < V)
                else:
                    counts = _window_histogram(row_ptr, V, m_safe, _window_scale(inv_t), REPS * LANES * VEC)
                    lowest, n_candidates, compacted = _list_floor(V, k, p, inv_t, bad, greedy, k_on, p_on, m_safe, s,
                                                                  counts, LIST_CAP, True, ACC)  # fmt: skip
                    if compacted:
                        _compact(row_ptr, 0, V, V, 0, lowest, cand_ptr, counter_ptr, REPS, LANES, VEC, LANES,
                                 LIST_CAP)  # fmt: skip
                        n_candidates = tl.atomic_add(counter_ptr, 0, sem="relaxed")
                        compacted = n_candidates <= LIST_CAP
    n_list = tl.where(compacted, n_candidates, V)

    threshold = _order_key(tl.full([], neg_inf, ACC))  # keeps every non-NaN logit
    # (the weights' scale and its inverse: float64 rows, _weight_units)
    unit_scale, inverse_scale = _float64_unit_scale(V, 1), _float64_unit_scale(V, -1)
    if k_on:  # k <= n_list: the list holds the digits from the k-th largest's up
        if ACC == tl.float64:
            threshold = _largest_key_reaching(row_ptr, cand_ptr, compacted, n_list, m_safe, inv_t, threshold, k,
                                              unit_scale, inverse_scale, False, SEARCH_BLOCK, ACC)  # fmt: skip
        else:
            threshold = _kth_largest_key32(row_ptr, cand_ptr, compacted, n_list, threshold, k, LIST_BLOCK)
    if p_on:
        top_k_mass = s  # top-k off: the row's mass (float64)
        if k_on:
            units = tl.zeros([], tl.int64)
            for start in range(0, n_list, LIST_BLOCK):
                x, _, live = _list_entries(row_ptr, cand_ptr, compacted, n_list, start + tl.arange(0, LIST_BLOCK), ACC)
                e = _weight_units(tl.exp((x - m_safe) * inv_t), unit_scale, ACC)
                units += tl.sum(tl.where(live & (_order_key(x) >= threshold), e, 0), axis=0)
            top_k_mass = _weight_value(units, inverse_scale, ACC)
        target = p.to(tl.float64) * top_k_mass
        threshold = _largest_key_reaching(row_ptr, cand_ptr, compacted, n_list, m_safe, inv_t, threshold, target,
                                          unit_scale, inverse_scale, True, SEARCH_BLOCK, ACC)  # fmt: skip

    log_min_p = tl.where(min_p > 0, tl.log(min_p.to(ACC)), neg_inf).to(ACC)
    kept_units = tl.zeros([], tl.int64)
    spread_units = tl.zeros([], tl.int64)
    kept_rest = tl.zeros([], tl.int64)  # (float64 rows: the low limbs, _mass_rest)
    spread_rest = tl.zeros([], tl.int64)
    # and the first argmax (the lowest index with x == m), which the list holds
    first = tl.full([LIST_BLOCK], V, tl.int32)
    # With WITH_DRAW, the race in the same pass: the list's entries draw the
    # variates of their own tokens (their index), so the winner is the same in
    # any order of the list or its blocks.
    best = tl.full([], float("-inf"), ACC)
    winner = tl.full([], V, tl.int64)
    for start in range(0, n_list, LIST_BLOCK):
        x, index, live = _list_entries(row_ptr, cand_ptr, compacted, n_list, start + tl.arange(0, LIST_BLOCK), ACC)
        d = (x - m_safe) * inv_t
        kept = live & (_order_key(x) >= threshold) & (d >= log_min_p)
        e = tl.exp(d)
        kept_units += tl.sum(tl.where(kept, _mass_units(e, ACC), 0), axis=0)
        if ACC == tl.float64:
            kept_rest += tl.sum(tl.where(kept, _mass_rest(e), 0), axis=0)
        if WITH_ENTROPY:  # (a kept -inf logit, e = 0, adds 0 * finite: d is held above -inf)
            spread = e * -tl.maximum(d, _FLOAT32_LOWEST)
            spread_units += tl.sum(tl.where(kept, _mass_units(spread, ACC), 0), axis=0)
            if ACC == tl.float64:
                spread_rest += tl.sum(tl.where(kept, _mass_rest(spread), 0), axis=0)
        first = tl.minimum(first, tl.where(live & (x == m_safe), index, V))  # (a bad row's is never used)
        if WITH_DRAW:
            k0, k1, salt, c2, c3 = race_key
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
    s_kept = _mass_value(kept_units, kept_rest, ACC).to(ACC)
    # A greedy row's log s_kept is 0, as the native kernel leaves it (its truncated
    # log-prob is 0 or -inf and its gradient 0, whatever it is): not the mass of its
    # list, which holds the maxima or more, by the route its floor took.
    log_s_kept = tl.where(greedy, 0.0, tl.log(s_kept)).to(ACC)
    entropy = tl.zeros([], ACC)
    if WITH_ENTROPY:
        entropy = tl.where(greedy, 0.0, log_s_kept + _mass_value(spread_units, spread_rest, ACC).to(ACC) / s_kept).to(ACC)
    arg = tl.min(first, axis=0).to(tl.int64)
    if WITH_DRAW:
        # the first argmax for a greedy row, and where every kept draw lost (E = inf, ~2^-25 each)
        arg = tl.where(greedy | (best == float("-inf")), arg, winner)
    return (bad, greedy, m_safe, arg, n_max.to(ACC), inv_t, log_s, threshold, log_min_p, log_s_kept,
            compacted, n_list, entropy)  # fmt: skip


@triton.jit
def _sample_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
    seeds_ptr, seed, offset_ptr, offset,
    tokens_ptr, logprobs_ptr, raw_ptr, entropy_ptr, cand_ptr, counter_ptr, split_ptr, SEG,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    PER_ROW_SEED: tl.constexpr, OFFSET_FROM_PTR: tl.constexpr, SPLIT: tl.constexpr,
    REPS: tl.constexpr, LANES: tl.constexpr, SEGS: tl.constexpr, SEG_LANES: tl.constexpr, VEC: tl.constexpr,
    ALIGNED: tl.constexpr,
    MAX_IN_STORAGE_TYPE: tl.constexpr, LIST_BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr,
    LIST_CAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    cand_ptr += row * LIST_CAP
    if SPLIT:  # the row's record (_split_rows_kernel)
        split_ptr += row * _SPLIT_RECORD
    race_key = _race_key(row, seeds_ptr, seed, offset_ptr, offset, PER_ROW_SEED, OFFSET_FROM_PTR)
    bad, greedy, m, winner, n_max, inv_t, log_s, threshold, log_min_p, log_s_kept, compacted, n_list, entropy = _select(
        row_ptr, V, *_row_params(
            row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
            PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC,
        ), cand_ptr, counter_ptr + row, split_ptr, SEG, SPLIT, REPS, LANES, SEGS, SEG_LANES, VEC, ALIGNED,
        MAX_IN_STORAGE_TYPE, LIST_BLOCK, SEARCH_BLOCK, LIST_CAP, ACC, True, True, race_key,
    )  # fmt: skip
    d_win = (tl.load(row_ptr + winner, mask=~bad, other=0.0).to(ACC) - m) * inv_t  # a bad row's winner may be anything
    logprob = tl.where(greedy, 0.0, d_win - log_s_kept)
    raw = tl.where(greedy, -tl.log(n_max), d_win - log_s)
    tl.store(tokens_ptr + row, tl.where(bad, -1, winner))
    tl.store(logprobs_ptr + row, tl.where(bad, float("nan"), logprob))
    tl.store(raw_ptr + row, tl.where(bad, float("nan"), raw))
    tl.store(entropy_ptr + row, tl.where(bad, float("nan"), entropy))


@triton.jit
def _truncated_fwd_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V, labels_ptr,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
    out_ptr, stats_ptr, cand_ptr, counter_ptr, split_ptr, SEG,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    WITH_STATS: tl.constexpr, SPLIT: tl.constexpr, REPS: tl.constexpr, LANES: tl.constexpr,
    SEGS: tl.constexpr, SEG_LANES: tl.constexpr, VEC: tl.constexpr,
    ALIGNED: tl.constexpr, MAX_IN_STORAGE_TYPE: tl.constexpr,
    LIST_BLOCK: tl.constexpr, SEARCH_BLOCK: tl.constexpr, LIST_CAP: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    cand_ptr += row * LIST_CAP
    if SPLIT:  # the row's record (_split_rows_kernel)
        split_ptr += row * _SPLIT_RECORD
    bad, greedy, m, arg, n_max, inv_t, log_s, threshold, log_min_p, log_s_kept, _, _, _ = _select(
        row_ptr, V, *_row_params(
            row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
            PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC,
        ), cand_ptr, counter_ptr + row, split_ptr, SEG, SPLIT, REPS, LANES, SEGS, SEG_LANES, VEC, ALIGNED,
        MAX_IN_STORAGE_TYPE, LIST_BLOCK, SEARCH_BLOCK, LIST_CAP, ACC,
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
