"""A row's candidate list: the tokens at or above its floor (select._list_floor),
at most list_capacity(V) of them, compacted into int64 entries (``_compact``);
the entries as every later pass reads them, from the list or, for a row that
is its own list, from the row (``_list_entries``); and the masses summed over
them, in fixed point so that a sum does not depend on the list's order
(``_mass_units``; the top-p search's weights, ``_weight_units``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..reduce import lane_tile, slice_offsets

# Entries of a row's candidate list (_select): a top-k 50 row of an LLM holds a
# few dozen to a few hundred tokens in the digits from its 50th largest up; a
# top-p 0.9 row whole digits above _top_p_floor (randn * 3 at T = 0.7: 205 to
# 1538 tokens, top-p 0.99 2322 to 10261). 32 KB a row at most.
_CANDIDATES = 4096


def list_capacity(vocab: int) -> int:
    """Entries of a row's candidate list: _CANDIDATES, and at most V / 8 (the list
    never outweighs the row: 8 bytes an entry, half a bfloat16 row at most)."""
    return max(1, min(_CANDIDATES, vocab // 8))


@triton.jit
def _compact(row_ptr, begin, end, V, first_lane, lowest, cand_ptr, counter_ptr, REPS: tl.constexpr,
             LANES: tl.constexpr, VEC: tl.constexpr, TILE_LANES: tl.constexpr, LIST_CAP: tl.constexpr):  # fmt: skip
    """Writes the row's tokens x >= lowest (a float32 logit above -inf) to the
    candidate list at cand_ptr, one int64 per token: the bits of its logit as a
    float32 (exact for the 16- and 32-bit types) above its index (_list_entries
    reads them), the first LIST_CAP of them; the row's counter ends at the
    number of such tokens, so a count above LIST_CAP says the list overflowed
    (a floor from _lane_floor, which does not know the count: the row is then
    its own list). The tokens are those of the tiles from ``begin``
    (a tile's first element) to ``end`` in lanes first_lane .. first_lane + LANES
    - 1 of a tile of TILE_LANES lanes: the whole row (0, V, 0, LANES), or one
    program's slice of a tile (_split_compact_kernel).

    One read, in the row's tile (a thread's REPS x VEC elements,
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
                tl.store(cand_ptr + at, (bits_here.to(tl.int64) << 32) | index.to(tl.int64),
                         mask=take_here & (at < LIST_CAP))
                at += take_here.to(tl.int32)
    tl.debug_barrier()  # the list is written before any thread reads it


@triton.jit
def _mass_units(e, ACC: tl.constexpr):
    """Probability mass e = exp(d) in [0, 1] as the kernels sum it, in fixed
    point, so that a sum is exact and the same in any order (the candidate
    list's order is not fixed, _compact; a vocabulary shard's ranks add theirs:
    fastrl._sharded.sampling). Float32 rows: round-down(e * 2^42) in int64. The
    units drop e < 2^-42 and round each term down by < 2^-42: on a sum >= 1
    (every kept set holds its max, e = 1) at most V * 2^-42 <= 4e-8 relative at
    V = 2^18, under float32's own rounding of the sum. Float64 rows: the high
    limb of two, round-down(e * 2^32), with _mass_rest the low one: e to
    2^-64, V * 2^-64 <= 2e-14 relative at V = 2^18; each limb's sum stays
    below 2^63 for V < 2^31."""
    if ACC == tl.float64:
        return (e * 4294967296.0).to(tl.int64)
    else:
        return (e * 4398046511104.0).to(tl.int64)


@triton.jit
def _mass_rest(e):
    """A float64 mass's low limb (_mass_units): round-down of what the high limb
    leaves of e * 2^32 (its fraction, exact), times 2^32."""
    scaled = e * 4294967296.0
    return ((scaled - scaled.to(tl.int64).to(tl.float64)) * 4294967296.0).to(tl.int64)


@triton.jit
def _mass_value(units, rest, ACC: tl.constexpr):
    """The float64 mass of a sum of _mass_units (float64 rows: and of the sum
    ``rest`` of their _mass_rest; float32 rows take 0), rounded once."""
    if ACC == tl.float64:
        return units.to(tl.float64) * 2.3283064365386963e-10 + rest.to(tl.float64) * 5.421010862427522e-20
    else:
        return units.to(tl.float64) * 2.2737367544323206e-13


@triton.jit
def _float64_unit_scale(V, POWER: tl.constexpr):
    """2^(POWER * (62 - bits of V)) as a float64, from V's float64 exponent (exact
    for any V > 0): the weight units of a float64 row's top-p search (_weight_units)."""
    floor_log2 = ((V + tl.zeros([], tl.int64)).to(tl.float64).to(tl.int64, bitcast=True) >> 52) - 1023
    return ((1023 + POWER * (61 - floor_log2)) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _weight_units(e, scale, ACC: tl.constexpr):
    """A token's weight in the top-p search (select._largest_key_reaching, the
    shard's shard._digit_histogram_kernel), in int64 so that sums are exact in
    any order: float32 rows in _mass_units; float64 rows in one limb,
    round(e * scale) (e in [0, 1]) with ``scale`` = 2^(62 - bits of V) of the whole row's V
    (_float64_unit_scale; fastrl._sharded.sampling._weight_scale, as the native
    kernels): V weights sum below 2^63."""
    if ACC == tl.float64:
        return (e * scale + 0.5).to(tl.int64)
    else:
        return _mass_units(e, ACC)


@triton.jit
def _weight_value(units, inverse_scale, ACC: tl.constexpr):
    """The float64 mass of a sum of _weight_units (``inverse_scale``: 1 / scale,
    exact, a power of 2)."""
    if ACC == tl.float64:
        return units.to(tl.float64) * inverse_scale
    else:
        return _mass_value(units, 0, ACC)


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
