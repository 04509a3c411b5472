"""Row reductions shared by the Triton kernels.

``segment_stats`` is the one-read online softmax statistic that every
log-prob-like kernel starts from. For a row of V logits x at inverse
temperature inv_t = 1/T (T > 0, so the max of x is the max of x / T):

    m = max_j x_j,   d_j = (x_j - m) * inv_t,   s = sum_j exp(d_j),   w = sum_j exp(d_j) d_j

so that logsumexp(x / T) = m * inv_t + log s, log p_j = d_j - log s and the
entropy is log s - w / s. Differences are taken on the raw logits before
scaling, so large logits (|x| ~ 1e4) with T != 1 lose no absolute accuracy, and
w stays relative to the max so that a small entropy does not come from two
cancelling numbers of size |x|.

The row is read once, a tile at a time, and every thread keeps the statistics
of its own lane of the row (``tile_offsets``): no reduction crosses threads in
the loop (no barrier, no shuffle), and the lanes are merged once after it
(``merge_lanes``). When a tile raises a lane's running max from m to m', its
sums move to the new reference point:

    s' = a s,   w' = a (w + c s),   c = (m - m') * inv_t,   a = exp(c).

The exponentials are taken in base 2, e = 2^((x - m) k) with k = inv_t log2(e)
(one multiply; w is kept in base-2 units, also by segment_stats' result, and
scaled by ln 2 where the entropy is formed); on a
GPU tl.exp is that same exp2 of a rounded product, so a term at depth d is
within about 2 |d| + 3 ulps of float32 whichever is written.

Accuracy on peaked rows, where users watch the entropy collapse: s = n + t,
with n the count of terms at the max (each exactly 1) and t the tail of tiny
terms, and the entropy of such a row is about t (1 + gap). A float32 sum that
holds a 1 drops every term below half an ulp of 1 (6e-8), which at V = 32000,
T = 1 is the whole tail (entropy 1e-7, off by 3%); even in float64, n + t
rounds t away past a gap of about 33 (1e-6 of the entropy, 2% at a gap of 45).
So n and t are kept apart to the end: each lane sums its terms below its max on
their own (in ACC: at most REPS * VEC terms per tile, then one add per tile)
and counts those at the max, the merge adds the lanes in float64, and
log s = log n + log1p(t / n) (``log_sum``).

Guards test the term, not the logit: (x - m) * inv_t overflows to -inf for
finite logits too (finfo.min masking at T < 1, or +-3e38 in one row), so a
term with exp(d) = 0 adds exactly 0 to w (never 0 * -inf), and a rescale with
a = 0 drops the old sums (c may be -inf). -inf logits (masked vocabulary) add
exactly nothing; a row that is all -inf gives s = 0 (log-probs NaN, as
log_softmax gives); NaN propagates into s (a lane of only NaN has no max but
its terms are still summed, from the reference point 0).
"""

import triton
import triton.language as tl


@triton.jit
def row_start(base_ptr, row, inner, outer_stride, inner_stride):
    """Pointer to row ``row`` (int64) of an [outer, inner, V] strided view: rows
    are numbered row-major over the two leading dims (csrc/rows.h), so a sliced
    layout such as ``logits[:, :-1]`` is read in place."""
    return base_ptr + (row // inner) * outer_stride + (row % inner) * inner_stride


@triton.jit
def segment_stats(row_ptr, V, SEG, inv_t, WITH_W: tl.constexpr, WITH_Q: tl.constexpr, REPS: tl.constexpr,
                  SEGS: tl.constexpr, REAL: tl.constexpr, SEG_LANES: tl.constexpr, VEC: tl.constexpr,
                  ALIGNED: tl.constexpr, MAX_IN_STORAGE_TYPE: tl.constexpr, ACC: tl.constexpr,
                  TILES: tl.constexpr = 1, FOLD_TILES: tl.constexpr = False, SUB_MAX: tl.constexpr = False):  # fmt: skip
    """[SEGS] (m, n, t, w, q) of the REAL segments of SEG logits that make a
    row of V = REAL * SEG (fastrl._rows.segment_length), the module
    docstring's statistics of each (w in base-2 units; q, WITH_Q's tail of
    squares, sum e_j^2 over the terms below the max, so that sum_j p_j^2 =
    (n + q) / (n + t)^2; else 0), all segments at once: slot g is lanes
    g * SEG_LANES .. (g + 1) * SEG_LANES - 1, which read segment g % REAL a
    tile of REPS * SEG_LANES * VEC at a time from its own first element
    (tiles count from a segment's first element, never from an address, so a
    row's statistics do not depend on where it sits in the batch), and are
    merged apart from the other slots. So a segment's statistics are a
    function of its logits and (REPS, SEG_LANES, VEC) alone, the same in a
    program that holds the whole row and in one that holds a vocabulary shard
    of whole segments. SEGS slots fill whole warps (each thread a lane, as the
    layouts that sum a lane's elements inside its thread need): a shard of
    fewer segments reads them again in the slots past REAL, in the same load
    instructions (no more memory traffic), and leaves those slots' results.

    The loop keeps a lane's partial statistics in its own thread: a thread's
    REPS x VEC elements of a tile are VEC contiguous ones (one 128-bit load
    when ALIGNED; VEC = 1 otherwise, _launch.tile_config) at REPS places
    SEG_LANES * VEC apart, summed in float32 (at most REPS * VEC terms a tile,
    then one add a tile into the lane's sums), with no reduction across
    threads in the loop (no barrier, no shuffle); the lanes are merged once
    after it, in float64 (merge_lanes).

    TILES (1 or 2, dividing a segment's whole tiles: _launch.segment_config):
    tiles an iteration, all loaded before any is summed, so that a warp has
    TILES times the bytes in flight while an SM holds few programs (a grid's
    last wave, a small batch). They are summed one after the other, in the
    order a tile at a time sums them: the same bits.

    FOLD_TILES (not with WITH_W or WITH_Q; the sampler's): each lane sums each
    tile from scratch (tile_lane_stats) and folds it into its running
    statistics (fold_lanes), and a segment's lanes merge along a fixed tree of
    pairs (merge_lanes' PAIRS), so that a row split over several programs, a
    tile (or part of one) each, gets the same bits by folding their lanes'
    results in tile order (kernels/sampling/split.py), and so does a shard's
    kernel of another shape (kernels/sampling/shard.py).

    SUB_MAX (with FOLD_TILES): also the max of each of the LANES x VEC
    sub-lanes (the elements at one place of a lane's VEC in every tile of
    its segment), [LANES, VEC] in ACC, -inf for a sub-lane with no element
    (the sampler's list floor, kernels/sampling/select.py, _lane_floor)."""
    tl.static_assert(not (FOLD_TILES and (WITH_W or WITH_Q)), "FOLD_TILES folds m, n and t only")
    tl.static_assert(FOLD_TILES or not SUB_MAX, "SUB_MAX: with FOLD_TILES")
    neg_inf = float("-inf")
    LANES: tl.constexpr = SEGS * SEG_LANES
    k = exp2_scale(inv_t)
    m = tl.full([LANES], neg_inf, ACC)
    n = tl.zeros([LANES], ACC)
    t = tl.zeros([LANES], ACC)
    w = tl.zeros([LANES], ACC)
    q = tl.zeros([LANES], ACC)
    # Element e of lane l's VEC: segment l // SEG_LANES, at (l % SEG_LANES) * VEC + e of the tile.
    element = tl.arange(0, LANES * VEC)
    lane = element // VEC
    within = ((lane % SEG_LANES) * VEC + element % VEC)[None, :]
    seg_start = ((lane // SEG_LANES % REAL) * SEG)[None, :]
    rep = (tl.arange(0, REPS) * (SEG_LANES * VEC))[:, None]
    if ALIGNED:  # every row, so every segment (SEG * element size a multiple of 16), on a 16-byte boundary
        row_ptr = tl.multiple_of(row_ptr, 16)
    lane_ptr = row_ptr + seg_start
    if FOLD_TILES:  # (a pointer a thread to its elements of a tile: no offset live across the loop, where
        # the 64-register sampler kernels kept it in local memory)
        loop_ptr = lane_ptr + within
        loop_offset = 0
    else:
        loop_ptr = lane_ptr
        loop_offset = within
    # A tile of every segment at once: ROW_TILE of the row. V - V % ROW_TILE is REAL times the
    # whole tiles of a segment (V = REAL * SEG), so the loop runs a segment's whole tiles.
    ROW_TILE: tl.constexpr = REAL * REPS * SEG_LANES * VEC
    whole = V - V % ROW_TILE
    tl.static_assert((TILES == 1) or (TILES == 2), "segment_stats: one or two tiles an iteration")
    sub = tl.full([LANES, VEC], neg_inf, ACC)
    for start in range(0, whole, TILES * ROW_TILE):
        x = lane_tile(tl.load((loop_ptr + (start // REAL + loop_offset)) + rep), LANES, VEC)
        if TILES == 2:
            x2 = lane_tile(tl.load((loop_ptr + ((start + ROW_TILE) // REAL + loop_offset)) + rep), LANES, VEC)
        if FOLD_TILES:
            m, n, t = fold_lanes(m, n, t, *tile_lane_stats(x, k, MAX_IN_STORAGE_TYPE), k)
            if SUB_MAX:
                sub = tl.maximum(sub, tl.max(x.to(ACC), axis=0))
            if TILES == 2:
                m, n, t = fold_lanes(m, n, t, *tile_lane_stats(x2, k, MAX_IN_STORAGE_TYPE), k)
                if SUB_MAX:
                    sub = tl.maximum(sub, tl.max(x2.to(ACC), axis=0))
        elif WITH_Q:
            m, n, t, w, q = accumulate_tile(x, m, n, t, w, k, WITH_W, MAX_IN_STORAGE_TYPE, q, True)
            if TILES == 2:
                m, n, t, w, q = accumulate_tile(x2, m, n, t, w, k, WITH_W, MAX_IN_STORAGE_TYPE, q, True)
        else:
            m, n, t, w = accumulate_tile(x, m, n, t, w, k, WITH_W, MAX_IN_STORAGE_TYPE)
            if TILES == 2:
                m, n, t, w = accumulate_tile(x2, m, n, t, w, k, WITH_W, MAX_IN_STORAGE_TYPE)
    if whole < V:  # each segment's partial tile, masked
        offs = whole // REAL + within + rep
        x = lane_tile(tl.load(lane_ptr + offs, mask=offs < SEG, other=neg_inf), LANES, VEC)
        if FOLD_TILES:
            m, n, t = fold_lanes(m, n, t, *tile_lane_stats(x, k, MAX_IN_STORAGE_TYPE), k)
            if SUB_MAX:
                sub = tl.maximum(sub, tl.max(x.to(ACC), axis=0))
        elif WITH_Q:
            m, n, t, w, q = accumulate_tile(x, m, n, t, w, k, WITH_W, MAX_IN_STORAGE_TYPE, q, True)
        else:
            m, n, t, w = accumulate_tile(x, m, n, t, w, k, WITH_W, MAX_IN_STORAGE_TYPE)
    m = tl.reshape(m, [SEGS, SEG_LANES])
    n = tl.reshape(n, [SEGS, SEG_LANES])
    q_seg = tl.zeros([SEGS], tl.float64)
    if WITH_Q:
        q_seg = merge_square_lanes(m, n, tl.reshape(q, [SEGS, SEG_LANES]), k)
    m, n, t, w = merge_lanes(m, n, tl.reshape(t, [SEGS, SEG_LANES]), tl.reshape(w, [SEGS, SEG_LANES]), k, WITH_W,
                             FOLD_TILES)  # fmt: skip
    if SUB_MAX:
        return m, n, t, w, q_seg, sub
    else:
        return m, n, t, w, q_seg


@triton.jit
def fold_segments(m, n, t, w, q, inv_t, WITH_W: tl.constexpr, WITH_Q: tl.constexpr):
    """The row's (m, n, t, w, q) from its segments' [SEGS] (segment_stats'; SEGS
    a power of 2), folded by fold_segment along a fixed tree of pairs:
    ((0 1) (2 3)) ((4 5) (6 7)) for eight. fold_segment is symmetric, bit for
    bit (each span's terms depend on it and the common max alone, then one
    commutative add), so a fold of two is one value whichever lane or warp
    holds which: the tree, and so the bits, do not depend on how the compiler
    lays the vectors out, in this kernel or in the one that folds segments
    gathered from the ranks (kernels/logprobs.py). w and q take part only
    WITH_W / WITH_Q (else 0): each is a value more that the segments' warps
    exchange at each level."""
    SEGS: tl.constexpr = m.shape[0]
    tl.static_assert(SEGS <= 8, "fold_segments: at most eight segments (fastrl._rows.TP_SEGMENTS)")
    k = tl.zeros_like(m) + exp2_scale(inv_t)
    zero = tl.zeros([], tl.float64)
    if SEGS == 1:  # (the one segment: a max and sums of one element are that element)
        return tl.max(m, axis=0), tl.sum(n, axis=0), tl.sum(t, axis=0), tl.sum(w, axis=0), tl.sum(q, axis=0)
    elif WITH_Q:
        m, n, t, w, q, k = _fold_tree_wq(m, n, t, w, q, k)
        return m, n, t, w, q
    elif WITH_W:
        m, n, t, w, k = _fold_tree_w(m, n, t, w, k)
        return m, n, t, w, zero
    else:
        m, n, t, k = _fold_tree(m, n, t, k)
        return m, n, t, zero, zero


@triton.jit
def _pairs(v, HALF: tl.constexpr):
    """[2 HALF] as [HALF, 2]: elements 2i and 2i + 1 side by side."""
    return tl.reshape(v, [HALF, 2])


@triton.jit
def _fold_tree(m, n, t, k):
    """(m, n, t) [SEGS] (2, 4 or 8) folded along fold_segments' tree: pairs
    (2i, 2i + 1), then pairs of those, each pair by one reduction over an
    axis of two (_fold_tree_w, _fold_tree_wq: with w, and with w and q). (A
    reduction of all SEGS at once would pair them as the layout has it.)"""
    SEGS: tl.constexpr = m.shape[0]
    if SEGS == 8:
        m, n, t, k = tl.reduce((_pairs(m, 4), _pairs(n, 4), _pairs(t, 4), _pairs(k, 4)), 1, _fold_pair)
    if SEGS >= 4:
        m, n, t, k = tl.reduce((_pairs(m, 2), _pairs(n, 2), _pairs(t, 2), _pairs(k, 2)), 1, _fold_pair)
    return tl.reduce((m, n, t, k), 0, _fold_pair)


@triton.jit
def _fold_tree_w(m, n, t, w, k):
    SEGS: tl.constexpr = m.shape[0]
    if SEGS == 8:
        m, n, t, w, k = tl.reduce((_pairs(m, 4), _pairs(n, 4), _pairs(t, 4), _pairs(w, 4), _pairs(k, 4)), 1,
                                  _fold_pair_w)  # fmt: skip
    if SEGS >= 4:
        m, n, t, w, k = tl.reduce((_pairs(m, 2), _pairs(n, 2), _pairs(t, 2), _pairs(w, 2), _pairs(k, 2)), 1,
                                  _fold_pair_w)  # fmt: skip
    return tl.reduce((m, n, t, w, k), 0, _fold_pair_w)


@triton.jit
def _fold_tree_wq(m, n, t, w, q, k):
    SEGS: tl.constexpr = m.shape[0]
    if SEGS == 8:
        m, n, t, w, q, k = tl.reduce((_pairs(m, 4), _pairs(n, 4), _pairs(t, 4), _pairs(w, 4), _pairs(q, 4),
                                      _pairs(k, 4)), 1, _fold_pair_wq)  # fmt: skip
    if SEGS >= 4:
        m, n, t, w, q, k = tl.reduce((_pairs(m, 2), _pairs(n, 2), _pairs(t, 2), _pairs(w, 2), _pairs(q, 2),
                                      _pairs(k, 2)), 1, _fold_pair_wq)  # fmt: skip
    return tl.reduce((m, n, t, w, q, k), 0, _fold_pair_wq)


@triton.jit
def _fold_pair(m, n, t, k, m2, n2, t2, k2):
    """fold_segment of (m, n, t) as a reduction's combine (k travels along: the same in every element)."""
    zero = tl.zeros_like(n)
    m, n, t, _, _ = fold_segment(m, n, t, zero, zero, m2, n2, t2, zero, zero, k)
    return m, n, t, k


@triton.jit
def _fold_pair_w(m, n, t, w, k, m2, n2, t2, w2, k2):
    """fold_segment of (m, n, t, w) as a reduction's combine."""
    zero = tl.zeros_like(n)
    m, n, t, w, _ = fold_segment(m, n, t, w, zero, m2, n2, t2, w2, zero, k)
    return m, n, t, w, k


@triton.jit
def _fold_pair_wq(m, n, t, w, q, k, m2, n2, t2, w2, q2, k2):
    """fold_segment of (m, n, t, w, q) as a reduction's combine."""
    m, n, t, w, q = fold_segment(m, n, t, w, q, m2, n2, t2, w2, q2, k)
    return m, n, t, w, q, k


@triton.jit
def exp2_scale(inv_t):
    """k = inv_t log2(e): segment_stats' exponentials are 2^((x - m) k)."""
    return inv_t * 1.4426950408889634


@triton.jit
def tile_lane_stats(x, k, MAX_IN_STORAGE_TYPE: tl.constexpr):
    """Each lane's (m, n, t) over its elements of one tile x [REPS, LANES, VEC]
    alone (accumulate_tile from no elements); -inf where the tile is masked off."""
    ACC: tl.constexpr = k.dtype
    LANES: tl.constexpr = x.shape[1]
    none = tl.full([LANES], float("-inf"), ACC)
    zero = tl.zeros([LANES], ACC)
    m, n, t, _ = accumulate_tile(x, none, zero, zero, zero, k, False, MAX_IN_STORAGE_TYPE)
    return m, n, t


@triton.jit
def fold_lanes(m, n, t, m2, n2, t2, k):
    """Each lane's (m, n, t) over two spans of its elements, from each span's own:
    the span whose max is below the max of both joins the tail, its n + t scaled
    by a = 2^((m_span - m') k), as accumulate_tile moves its old terms when a
    tile raises the max (a = 0 for a span with nothing finite; NaN stays NaN).
    Lane by lane: the same bits whichever programs summed the spans."""
    neg_inf = float("-inf")
    ACC = m.dtype
    m_new = tl.maximum(m, m2)
    ref = tl.where(m_new == neg_inf, 0.0, m_new).to(ACC)
    a = tl.exp2(((m - ref) * k).to(ACC)).to(ACC)
    a2 = tl.exp2(((m2 - ref) * k).to(ACC)).to(ACC)
    t = tl.where(m_new > m, a * (n + t), t) + tl.where(m_new > m2, a2 * (n2 + t2), t2)
    n = tl.where(m_new > m, 0.0, n) + tl.where(m_new > m2, 0.0, n2)
    return m_new, n, t


@triton.jit
def accumulate_tile(x, m, n, t, w, k, WITH_W: tl.constexpr, MAX_IN_STORAGE_TYPE: tl.constexpr, q=None,
                    WITH_Q: tl.constexpr = False):  # fmt: skip
    """Each lane's (m, n, t, w) after its elements of one tile x [REPS, LANES, VEC]
    (segment_stats), all inside the lane's thread; and q, the tail of the squared
    terms, with WITH_Q (it moves by a^2 where t moves by a)."""
    neg_inf = float("-inf")
    ACC = m.dtype
    tile_max = lane_max(x, ACC, MAX_IN_STORAGE_TYPE)
    m_new = tl.maximum(m, tile_max)
    # The reference point: m', or 0 while the lane is all -inf so far (no -inf - -inf).
    ref = tl.where(m_new == neg_inf, 0.0, m_new).to(ACC)
    # The old terms' shift in base-2 units and their scale: 0 and 1 when the max
    # did not rise, -inf and 0 while m is -inf (nothing to rescale: n = t = w = 0)
    # or when it rose beyond the float range; w's update below takes a = 0 to 0,
    # never to c2 * 0 = NaN.
    c2 = ((m - ref) * k).to(ACC)
    a = tl.exp2(c2).to(ACC)
    at_max = x == ref.to(x.dtype)[None, :, None]
    ref3 = ref[None, :, None]
    x = x.to(ACC)
    d2 = (x - ref3) * k
    e = tl.exp2(d2)
    # Terms at the max are exactly 1 and counted apart (n), so that a peaked
    # row's tail (t) is never summed into a 1 that drops it; the count is the
    # sum of all terms less the tail, rounded (its float32 error is far below 1/2).
    tail = tl.where(at_max, -0.0, e)
    tile_tail = tl.sum(tl.sum(tail, axis=2), axis=0)
    tile_count = round_small(tl.sum(tl.sum(e, axis=2), axis=0) - tile_tail)
    if WITH_W:
        # w moves by c2 s with the reference (the docstring's w'), before n joins t;
        # d2 is clamped to the lowest finite value so that e = 0 gives 0, never 0 * -inf.
        w = tl.where(a == 0, 0.0, a * (w + c2 * (n + t)))
        w += tl.sum(tl.sum(e * tl.maximum(d2, -3.4028234663852886e38), axis=2), axis=0)
    # When the max rose, the terms at the old max join the tail.
    grew = m_new > m
    if WITH_Q:
        q = tl.where(grew, (a * a) * (n + q), q) + tl.sum(tl.sum(tail * tail, axis=2), axis=0)
    t = tl.where(grew, a * (n + t), t) + tile_tail
    n = tl.where(grew, 0.0, n) + tile_count
    if WITH_Q:
        return m_new, n, t, w, q
    else:
        return m_new, n, t, w


@triton.jit
def _maximum(a, b):
    # .to: Triton 3.6 returns float32 for two bfloat16 (3.9 keeps the type); the max
    # of two values is one of them, so the cast back is exact
    return tl.maximum(a, b).to(a.dtype)


@triton.jit
def lane_max(x, ACC: tl.constexpr, IN_STORAGE_TYPE: tl.constexpr):
    """Each lane's max of a tile x [REPS, LANES, VEC], in ACC. The max is exact in
    any type, so on a GPU it is taken in x's own type (tl.max would reduce 16-bit
    floats in float32), over the REPS axis first: two bfloat16 or float16 per
    instruction. Triton's interpreter keeps bfloat16 as its uint16 bits and
    compares those, so there (IN_STORAGE_TYPE False) it is taken in ACC."""
    if IN_STORAGE_TYPE:
        return tl.reduce(tl.reduce(x, 0, _maximum), 1, _maximum).to(ACC)
    else:
        return tl.max(tl.max(x.to(ACC), axis=0), axis=1)


@triton.jit
def round_small(v):
    """v rounded to the nearest integer, for |v| < 2^22 (float32) or 2^51 (float64):
    adding and taking away 1.5 * 2^23 (2^52) leaves only the integer part, with
    no conversion (NaN stays NaN)."""
    if v.dtype == tl.float64:
        magic = 6755399441055744.0
    else:
        magic = 12582912.0
    return (v + magic) - magic


@triton.jit
def aligned_body(row_ptr, V):
    """(head, body_ptr, rest): a row's first ``head`` elements (fewer than 16 bytes)
    come before the first 16-byte boundary, where its ``rest`` = V - head elements
    start (``body_ptr``), so that whole tiles from there load 128 bits at a time
    whatever V and the row's alignment (a GPT-2 row of 50257 bf16 logits starts
    at any even byte). For loops whose every element's result is its own (the
    log-prob backward): a reduction must count its tiles from the row's first
    element instead (segment_stats), or a row's result would depend on its address."""
    es: tl.constexpr = row_ptr.dtype.element_ty.primitive_bitwidth // 8
    head = ((16 - row_ptr.to(tl.int64) % 16) % 16 // es).to(tl.int32)
    head = tl.minimum(head, V)
    return head, tl.multiple_of(row_ptr + head, 16), V - head


@triton.jit
def tile_offsets(REPS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr):
    """Offsets of one tile of a row: lane l's elements are the VEC contiguous
    ones at r * LANES * VEC + l * VEC, r < REPS. Returned in two parts whose
    sum is the tile as a [REPS, LANES * VEC] block (lane part [1, LANES * VEC],
    rep part [REPS, 1]): a pointer built as (row + lane part) + rep part takes
    each rep as a constant offset of its load, with no 64-bit address
    arithmetic per load. A load of the block goes through ``lane_tile`` to
    [REPS, LANES, VEC]; with LANES the threads of the program, each thread
    then holds one lane (VEC elements in one load, the REPS in registers), so
    reductions over axes 2 and 0 stay inside a thread. Loaded as a 3-D block
    instead, the REPS and LANES axes are equally contiguous and triton < 3.7
    broke the tie the other way: a lane's REPS on 2 to 8 threads, and every
    such reduction a shuffle (logprobs forward, sm_90: 84 shuffles and
    barriers against 45)."""
    return slice_offsets(REPS, LANES, VEC, 0, LANES)


@triton.jit
def slice_offsets(REPS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr, first_lane, TILE_LANES: tl.constexpr):
    """tile_offsets of lanes first_lane .. first_lane + LANES - 1 of a tile of
    TILE_LANES lanes: a program with fewer threads than the tile's lanes reads
    their elements, each thread the same ones as that lane's thread would."""
    r = tl.arange(0, REPS)[:, None]
    element = first_lane * VEC + tl.arange(0, LANES * VEC)[None, :]
    return element, r * (TILE_LANES * VEC)


@triton.jit
def lane_tile(block, LANES: tl.constexpr, VEC: tl.constexpr):
    """A [REPS, LANES * VEC] block loaded at tile_offsets (or a mask of it) as
    the tile [REPS, LANES, VEC]: each thread's own elements, nothing moved."""
    return tl.reshape(block, [block.shape[0], LANES, VEC])


@triton.jit
def merge_lanes(m, n, t, w, k, WITH_W: tl.constexpr = True, PAIRS: tl.constexpr = False):
    """The row's (m, n, t, w) from per-lane ones (w in base-2 units of k, in and
    out), once, in float64, over the last axis (lanes [LANES], or each
    segment's [SEGS, SEG_LANES]: segment_stats): a lane at the row max M keeps its count and tail
    apart; any other lane's terms, scaled by a = 2^((m_l - M) k), join the
    tail, and its w moves by c s (the module docstring's w'). A lane with
    nothing finite (m_l = -inf) adds its sums times 0 (NaN stays NaN). w is 0
    unless WITH_W. PAIRS: the lanes' float64 sums run along a fixed tree of
    pairs (pair_sum), whose bits do not depend on how a kernel lays the lanes
    out over its threads and warps (tl.sum's order does); the maxima and the
    counts are exact in any order."""
    neg_inf = float("-inf")
    row_max = tl.max(m, axis=-1, keep_dims=True)
    ref = tl.where(row_max == neg_inf, 0.0, row_max)
    c2 = tl.where(m == neg_inf, 0.0, (m - ref) * k)
    a = tl.where(m == neg_inf, 0.0, tl.exp2(c2)).to(tl.float64)
    at_max = m == row_max
    n64 = n.to(tl.float64)
    t64 = t.to(tl.float64)
    s64 = n64 + t64
    n_row = tl.sum(tl.where(at_max, n64, 0.0), axis=-1)
    if PAIRS:
        tl.static_assert(not WITH_W, "merge_lanes: PAIRS sums n and t only")
        t_row = pair_sum(tl.where(at_max, t64, a * s64))
    else:
        t_row = tl.sum(tl.where(at_max, t64, a * s64), axis=-1)
    if WITH_W:
        w_lane = tl.where(a == 0, 0.0, a * (w.to(tl.float64) + c2.to(tl.float64) * s64))
        w_row = tl.sum(w_lane, axis=-1)
    else:
        w_row = tl.zeros_like(t_row)
    return tl.max(m, axis=-1), n_row, t_row, w_row


@triton.jit
def _pair_halve(v):
    """[S, L] -> [S, L / 2]: elements 2i and 2i + 1 of each row added (an add of
    two, commutative: the same bits whichever thread holds which)."""
    return tl.sum(tl.reshape(v, [v.shape[0], v.shape[1] // 2, 2]), axis=2)


@triton.jit
def pair_sum(v):
    """The sums of the rows of v [S, L] (L a power of 2, at most 1024) along a
    fixed tree of pairs: (0 1) (2 3) ..., then pairs of those."""
    L: tl.constexpr = v.shape[1]
    tl.static_assert(L <= 1024, "pair_sum: at most 1024 lanes")
    if L >= 1024:
        v = _pair_halve(v)
    if L >= 512:
        v = _pair_halve(v)
    if L >= 256:
        v = _pair_halve(v)
    if L >= 128:
        v = _pair_halve(v)
    if L >= 64:
        v = _pair_halve(v)
    if L >= 32:
        v = _pair_halve(v)
    if L >= 16:
        v = _pair_halve(v)
    if L >= 8:
        v = _pair_halve(v)
    if L >= 4:
        v = _pair_halve(v)
    if L >= 2:
        v = _pair_halve(v)
    return tl.reshape(v, [v.shape[0]])


@triton.jit
def fold_segment(m, n, t, w, q, m2, n2, t2, w2, q2, k):
    """The statistics (m, n, t, w, q) of two spans of a row, from each span's own
    (segment_stats': m in ACC; n, t, w, q in float64, w in base-2 units; k =
    log2(e) / T in ACC), as merge_lanes merges lanes: a span at the max M of
    both keeps its count and tails apart; the other's terms, scaled by
    a = 2^c, c = (m_span - M) k (in ACC, as merge_lanes' a), join the tail
    (t' = a (n + t), q' = a^2 (n + q)) and its w moves by c s. A span with
    nothing finite (m = -inf) adds its sums times 0 (NaN stays NaN).

    Symmetric, bit for bit: each span's terms depend on it and M alone, and
    they meet in one commutative add (fold_segments rests on it). Every
    input is a max, a sum or a load, never a product, so a compiler that
    contracts a product and a sum into one rounding (CONTRACTED) finds
    nothing here to contract with the code that made the inputs: the fold
    rounds alike in every kernel that runs it."""
    neg_inf = float("-inf")
    top = tl.maximum(m, m2)
    ref = tl.where(top == neg_inf, 0.0, top).to(m.dtype)
    c = tl.where(m == neg_inf, 0.0, (m - ref) * k).to(m.dtype)
    c2 = tl.where(m2 == neg_inf, 0.0, (m2 - ref) * k).to(m.dtype)
    a = tl.where(m == neg_inf, 0.0, tl.exp2(c)).to(tl.float64)
    a2 = tl.where(m2 == neg_inf, 0.0, tl.exp2(c2)).to(tl.float64)
    at_top = m == top
    at_top2 = m2 == top
    s = n + t
    s2 = n2 + t2
    n_new = tl.where(at_top, n, 0.0) + tl.where(at_top2, n2, 0.0)
    t_new = tl.where(at_top, t, a * s) + tl.where(at_top2, t2, a2 * s2)
    w_new = (tl.where(at_top, w, tl.where(a == 0, 0.0, a * (w + c.to(tl.float64) * s)))
             + tl.where(at_top2, w2, tl.where(a2 == 0, 0.0, a2 * (w2 + c2.to(tl.float64) * s2))))  # fmt: skip
    q_new = tl.where(at_top, q, (a * a) * (n + q)) + tl.where(at_top2, q2, (a2 * a2) * (n2 + q2))
    return top, n_new, t_new, w_new, q_new


@triton.jit
def merge_square_lanes(m, n, q, k):
    """The row's q (segment_stats' WITH_Q) from the per-lane m, n and q, as
    merge_lanes merges t: a lane at the row max keeps its tail of squares apart
    from its count; any other lane's squared terms, scaled by a^2 = 2^(2 (m_l - M) k),
    join the tail (0 for a lane with nothing finite; NaN stays NaN)."""
    neg_inf = float("-inf")
    row_max = tl.max(m, axis=-1, keep_dims=True)
    ref = tl.where(row_max == neg_inf, 0.0, row_max)
    c2 = tl.where(m == neg_inf, 0.0, (m - ref) * k).to(tl.float64)
    a2 = tl.where(m == neg_inf, 0.0, tl.exp2(2.0 * c2))
    q64 = q.to(tl.float64)
    return tl.sum(tl.where(m == row_max, q64, a2 * (n.to(tl.float64) + q64)), axis=-1)


@triton.jit
def log_sum(n, t):
    """log(n + t) for segment_stats' float64 n and t, without rounding t away:
    log n + log1p(t / n), log1p by Goldberg's identity log1p(q) = log(u) q / (u - 1)
    with u = 1 + q (a few ulps; q where u rounds to 1). n = 0 (a row of only
    -inf, or NaN) gives log t."""
    q = t / n
    u = 1.0 + q
    log1p_q = tl.where(u == 1.0, q, tl.log(u) * (q / (u - 1.0)))
    return tl.where(n > 0, tl.log(n) + log1p_q, tl.log(t))
