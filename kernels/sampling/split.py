"""A row split over many programs, for a batch small against the GPU
(sampling._split_parts).

The launches (sampling._split_selection) split the reads of one program's
selection (sample._select): each program reads a slice of one tile of the
statistics pass and writes its lanes' statistics of that tile alone, and adds
its top digits to the row's histogram (where triton's tl.histogram is slow,
its maximum, and a launch of the same programs then adds the window
histogram); one program a row folds the tiles in order and finds the list's
floor; the slices compact their candidates; the last launch works on the list
as one program's does. The one-program pass
folds its tiles the same way (reduce.segment_stats, FOLD_TILES), and every
launch compiles without fused multiply-adds, so both paths give the same bits
and a row's result does not depend on the batch it comes in. A split row's
statistics and list reach the last launch in its record (_SPLIT_RECORD)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..reduce import (
    exp2_scale,
    fold_lanes,
    fold_segments,
    lane_tile,
    merge_lanes,
    row_start,
    slice_offsets,
    tile_lane_stats,
)
from .compact import _compact
from .keys import _BINS
from .params import _inverse_temperature, _row_params
from .select import (
    _WINDOW_BINS,
    _list_floor,
    _may_list,
    _row_state,
    _tile_top_digits,
    _window_bin,
    _window_counts,
    _window_scale,
)

# A split row's statistics fold 8 tiles a trip (_split_rows_kernel): their loads issued together.
_FOLD_GROUP = tl.constexpr(8)
# A split row's record (_split_rows_kernel, _record_list): 5 int64, padded to 8.
_SPLIT_RECORD = tl.constexpr(8)


@triton.jit
def _split_tiles_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V, SEG,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
    lane_stats_ptr, hist_ptr, n_groups, part_max_ptr,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    REPS: tl.constexpr, LANES: tl.constexpr, SEG_LANES: tl.constexpr, SLICE_LANES: tl.constexpr, VEC: tl.constexpr,
    ALIGNED: tl.constexpr, MAX_IN_STORAGE_TYPE: tl.constexpr, WINDOW: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The first launch of a split row (_split_selection), program (row, part):
    lanes first_lane .. + SLICE_LANES of the row's tile ``part // SLICES`` of
    the statistics pass (reduce.segment_stats: that tile of each segment of
    SEG logits, SEG_LANES lanes a segment). Writes each lane's (m, n, t) over
    that tile alone (reduce.tile_lane_stats) to lane_stats
    (_split_rows_kernel), and adds the slice's top-digit counts to the row's
    histogram (zero at launch) for rows that may list candidates; with WINDOW
    instead the slice's max, the largest of its lanes' m, to part_max [rows,
    parts] (_split_window_kernel)."""
    SLICES: tl.constexpr = LANES // SLICE_LANES
    SEG_TILE: tl.constexpr = REPS * SEG_LANES * VEC
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
    # Element e of lane l's VEC, as segment_stats places it: segment l // SEG_LANES,
    # at (l % SEG_LANES) * VEC + e of the segment's tile, its REPS SEG_LANES * VEC apart.
    element = first_lane * VEC + tl.arange(0, SLICE_LANES * VEC)
    lane = element // VEC
    in_segment = (tile * SEG_TILE + (lane % SEG_LANES) * VEC + element % VEC)[None, :] + (
        tl.arange(0, REPS) * (SEG_LANES * VEC))[:, None]  # fmt: skip
    offs = (lane // SEG_LANES * SEG)[None, :] + in_segment
    # one masked load (128 bits a lane where V is a multiple of 16, which Triton
    # specialises on: the mask is then whole 16-byte runs)
    x = lane_tile(tl.load(row_ptr + offs, mask=in_segment < SEG, other=float("-inf")), SLICE_LANES, VEC)
    m, n, tail = tile_lane_stats(x, exp2_scale(_inverse_temperature(t, valid, ACC)), MAX_IN_STORAGE_TYPE)
    out = (lane_stats_ptr + (row * n_groups + tile // _FOLD_GROUP) * (3 * _FOLD_GROUP * LANES)
           + (tile % _FOLD_GROUP) * LANES + first_lane + tl.arange(0, SLICE_LANES))  # fmt: skip
    tl.store(out, m)
    tl.store(out + _FOLD_GROUP * LANES, n)
    tl.store(out + 2 * _FOLD_GROUP * LANES, tail)
    if WINDOW:
        if ACC != tl.float64:  # (float64 rows never list: _list_floor)
            tl.store(part_max_ptr + row * tl.num_programs(1) + part, tl.max(m, axis=0))
    elif ACC != tl.float64:
        if _may_list(V, t, k, p):
            if (tile + 1) * SEG_TILE <= SEG:  # a whole tile: no mask to count out
                counts = _tile_top_digits(x, None)
            else:
                counts = _tile_top_digits(x, lane_tile(in_segment < SEG, SLICE_LANES, VEC))
            tl.atomic_add(hist_ptr + row * _BINS + tl.arange(0, _BINS), counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _split_rows_kernel(
    V, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
    lane_stats_ptr, n_tiles, n_groups, hist_ptr, split_ptr,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    LANES: tl.constexpr, SEGS: tl.constexpr, SEG_LANES: tl.constexpr, LIST_CAP: tl.constexpr,
    WINDOW: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """The second launch of a split row, one program a row: its statistics, the
    tiles' lane statistics folded in tile order, each segment's lanes merged
    and the segments folded as reduce.segment_stats (FOLD_TILES) and
    sample._select do it (the same bits as one program's read of the row), to
    the row's record of _SPLIT_RECORD int64 at split_ptr: the float64 bits of
    m, n and t; then which tokens go on its list (_record_list, from the
    histogram: with WINDOW the window's, which _split_window_kernel added
    before this launch)."""
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
    none = tl.zeros([SEGS, SEG_LANES], ACC)
    m, n_max, tail, _no_w = merge_lanes(tl.reshape(m, [SEGS, SEG_LANES]), tl.reshape(n, [SEGS, SEG_LANES]),
                                        tl.reshape(tail, [SEGS, SEG_LANES]), none, scale, False, True)  # fmt: skip
    zero = tl.zeros([SEGS], tl.float64)
    m, n_max, tail, _no_w, _no_q = fold_segments(m, n_max, tail, zero, zero, inv_t, False, False)
    record = split_ptr + row * _SPLIT_RECORD
    tl.store(record, m.to(tl.float64).to(tl.int64, bitcast=True))
    tl.store(record + 1, n_max.to(tl.int64, bitcast=True))
    tl.store(record + 2, tail.to(tl.int64, bitcast=True))
    HIST_BINS: tl.constexpr = _WINDOW_BINS if WINDOW else _BINS
    _record_list(record, V, t, k, p, valid, inv_t, m, n_max, tail, hist_ptr + row * HIST_BINS, LIST_CAP, WINDOW, ACC)


@triton.jit
def _record_list(record, V, t, k, p, valid, inv_t, m, n_max, tail, hist_ptr, LIST_CAP: tl.constexpr,
                 WINDOW: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """A split row's list (_list_floor, from the row's histogram at hist_ptr:
    zero for a row that lists none) to its record after m, n and t: the float64
    bits of its lowest logit, and whether it compacts (the list's length is
    the compaction's count: _select)."""
    bad, greedy, m_safe, s, _, k_on, p_on = _row_state(V, t, k, p, valid, m, n_max, tail, ACC)
    HIST_BINS: tl.constexpr = _WINDOW_BINS if WINDOW else _BINS
    counts = tl.load(hist_ptr + tl.arange(0, HIST_BINS))
    lowest, _n_candidates, compacted = _list_floor(V, k, p, inv_t, bad, greedy, k_on, p_on, m_safe, s, counts,
                                                   LIST_CAP, WINDOW, ACC)  # fmt: skip
    tl.store(record + 3, lowest.to(tl.float64).to(tl.int64, bitcast=True))
    tl.store(record + 4, compacted.to(tl.int64))


@triton.jit
def _record_stats(record, ACC: tl.constexpr):
    """A split row's (m, n, t) from its record (_split_rows_kernel)."""
    m = tl.load(record).to(tl.float64, bitcast=True).to(ACC)
    return m, tl.load(record + 1).to(tl.float64, bitcast=True), tl.load(record + 2).to(tl.float64, bitcast=True)


@triton.jit
def _split_window_kernel(
    logits_ptr, inner, outer_stride, inner_stride, V,
    temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p, part_max_ptr, n_parts, hist_ptr,
    PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr, PER_ROW_MIN_P: tl.constexpr,
    REPS: tl.constexpr, LANES: tl.constexpr, SLICE_LANES: tl.constexpr, VEC: tl.constexpr, ALIGNED: tl.constexpr,
    PARTS: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """With WINDOW, the second launch of a split row, program (row, part) as in
    _split_tiles_kernel but over tiles of REPS (which may be fewer than the
    statistics pass's: a count is the same whichever program adds it), for a
    row that may list (_may_list): its slice's window bins (_window_bin) added
    to the row's window histogram (zero at launch). The row's max m is the
    largest of its n_parts tile slices' (part_max, from _split_tiles_kernel;
    PARTS >= n_parts): a max is exact in any order, so it is the m
    _split_rows_kernel folds (the launch after this one, which takes the
    floor from this histogram) wherever the row is not bad, and only a bad
    row (a NaN, a +inf, only -inf: _row_state) has a max that is not finite.
    Such a row, which never lists, is skipped; the bad rows with a finite max
    (a NaN among finite logits) add bins that no launch reads, their NaNs in
    the last bin as -inf."""
    SLICES: tl.constexpr = LANES // SLICE_LANES
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    t, k, p, _, valid = _row_params(
        row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
        PER_ROW_T, PER_ROW_K, PER_ROW_P, PER_ROW_MIN_P, ACC,
    )  # fmt: skip
    tl.static_assert(ACC != tl.float64, "float64 rows never list")
    parts = tl.arange(0, PARTS)
    m = tl.max(tl.load(part_max_ptr + row * n_parts + parts, mask=parts < n_parts, other=float("-inf")), axis=0)
    if valid & _may_list(V, t, k, p) & (m > float("-inf")) & (m < float("inf")):
        row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
        if ALIGNED:  # every row starts on a 16-byte boundary (the launcher checked)
            row_ptr = tl.multiple_of(row_ptr, 16)
        lane_offs, rep_offs = slice_offsets(REPS, SLICE_LANES, VEC, (part % SLICES) * SLICE_LANES, LANES)
        offs = ((part // SLICES) * (REPS * LANES * VEC) + lane_offs) + rep_offs
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        x = tl.where(x == x, x, float("-inf"))  # a NaN's bin: y would be NaN, which bins anywhere
        counts = _window_counts(_window_bin(x, m, _window_scale(_inverse_temperature(t, valid, ACC))), offs < V)
        tl.atomic_add(hist_ptr + row * _WINDOW_BINS + tl.arange(0, _WINDOW_BINS), counts, mask=counts > 0,
                      sem="relaxed")  # fmt: skip


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
    compacted = tl.load(record + 4)
    if compacted != 0:
        lowest = tl.load(record + 3).to(tl.float64, bitcast=True).to(tl.float32)
        row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
        start = (part // SLICES) * (REPS * LANES * VEC)
        _compact(row_ptr, start, start + 1, V, (part % SLICES) * SLICE_LANES, lowest, cand_ptr + row * LIST_CAP,
                 counter_ptr + row, REPS, SLICE_LANES, VEC, LANES, LIST_CAP)  # fmt: skip
