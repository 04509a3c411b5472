"""PPO / GRPO / GSPO policy loss, loss aggregation and rollout-correction
weights: Triton kernels and launchers.

Inputs are [B, L] rows of per-token values (a row is a sequence), contiguous,
in the accumulation dtype (fp32, or fp64), and a uint8 mask. A token outside
the mask is never used: its values may be anything, NaN included (loads are
masked by the row's end only, so that they vectorise, and every value a token
contributes passes tl.where on its mask bit).

The split. A row is cut into chunks of CHUNK_L = min(next_pow2(L), 1024)
tokens, a function of L alone (never of B), and the forward kernels write each
chunk's partial sums: stats [B, C * 8], C = ceil(L / CHUNK_L). At token level
(and in the backward, and at sequence level) one program of 2 warps per (row,
chunk), grid (B, C): 512 programs at the canonical [64, 8192]. A program walks its chunk
in blocks of BLOCK_L = 256 tokens (4 a thread: 128-bit loads), each lane adding
its tokens' terms, then reduces once (no block reduction, no barrier, per
block). The sums are fp32 (fp64 for fp64 inputs, and for the rollout
correction's sums of w and w^2, which its std cancels); the finalize kernels merge a
row's chunks in float64 (a fixed tree along the chunks), then the rows. So a
row's sums depend on its own tokens and L only (batch-invariant), combined in
one fixed order (deterministic, no atomics). Error of a chunk's fp32 sum: a
term passes at most d additions, d = CHUNK_L / BLOCK_L (its lane, <= 4) + 4
(a thread's tokens) + 5 (warp shuffles) + log2(warps) <= 16, so |error| <=
16 u sum |x|, u = 2^-24 (tests/test_policy.py holds the kernels to it).

Sequence level (GSPO's ratio, the rollout correction's sequence weight) needs
the row's sum of u = logp - old before any token's value, so a first launch on
the same (B, C) grid writes each chunk's float64 sum of u and count of valid
tokens (diff_sums [B, C, 2]); every program of the second launch adds its row's
C entries in chunk order (the same order in every program of the row, so they
agree bitwise) before its own chunk. Float64: exp() turns the sum's absolute
error into a relative error of every weight, and an fp32 sum's grows with L.

Forward, per token of row b (fastrl.reference.policy_loss is the spec):
    u = logp - old
    token level:     log r = clamp(u, -20, 20)
    sequence level:  log r = min(mean_b(u), 10)      (GSPO)
    l1 = -A r,  l2 = -A clamp(r, 1 - clip_low, 1 + clip_high),  l = max(l1, l2)
    dual clip:  l = min(l, -A clip_c) where A < 0;   l *= w (rollout weights)
and the chunk's partial sums go to stats[b, 8c : 8c + 8] (columns below). The
launcher's caller turns them into the aggregated loss and the metrics: every
aggregation mode is sum_b row_weight_b * sum_t(...) with a per-row weight.

Backward: dL/dlogp_t = g_b (dl/dlogp + kl_coef dkl/dlogp),  dL/dvalues_t = g_b value_coef,
with g_b = dL/dloss * row_weight_b, and
    dl/dlogp = w (dl/dr) r [the clamp of log r passes the gradient],
    dl/dr from max / min with torch's rule (a tie splits the gradient in halves):
        dl1/dr = -A,  dl2/dr = -A [1 - clip_low <= r <= 1 + clip_high].
At sequence level the gradient is GSPO's straight-through one (the token's own
log-prob carries the sequence ratio's gradient).

Triton passes Python floats (clip bounds, coefficients) as float32, as torch
applies a Python scalar to a float32 tensor; with float64 inputs they are the
float32 values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import CONTRACTED, acc_dtypes, float_scalar, float_scalar_arg
from .kl import clamp_nan, kl_estimate

# The statistics of chunk c of row b (stats[b, 8c : 8c + 8]), 8 float64 columns:
#   policy_forward              n, sum l, sum kl, sum values, n clipped, n clipped lower, sum ppo_kl, mean u
#       (mean u: the row's, in every chunk of the row, at sequence level; 0 at token level)
#   rollout_correction_forward  n, sum w, sum w^2, max, min, n high, n low, n masked
#       (token level: max / min of w, tokens with raw weight > clip_max / < low_threshold;
#        sequence level, veRL's metrics of the row's summed log-ratio S, in the row's
#        first chunk (the others hold -inf, inf, 0, 0): e^min(S, 20), e^S, and 0 / 1 for
#        e^S > clip_max / < low_threshold; fastrl/policy.py divides those by the
#        sequences, not the tokens)
N_STATS = 8

# veRL's clamps: the token log-ratio, the GSPO sequence log-ratio (above only),
# the log of a rollout-correction weight.
LOG_RATIO_CLAMP = tl.constexpr(20.0)
SEQ_LOG_RATIO_MAX = tl.constexpr(10.0)
CORRECTION_LOG_CLAMP = tl.constexpr(20.0)

# Tokens per chunk at most (512 programs at [64, 8192], the SMs several times
# over), and per loop iteration of a (row, chunk) program over its chunk; warps
# such that a thread holds 4 fp32 tokens (one 128-bit load per row).
_CHUNK = 1024
_BLOCK = 256
_TOKENS_PER_WARP = 128


def _chunk(length: int) -> int:
    """The chunk size: a function of L alone (never of B), so a row's sums do not depend on the batch."""
    return max(16, min(triton.next_power_of_2(length), _CHUNK))


def _n_chunks(length):
    """C, the chunks of a row: for L > 0, ceil(L / _chunk(L)) = ceil(L / _CHUNK) (symbolic L allowed)."""
    return (length + _CHUNK - 1) // _CHUNK


def stats_shape(n_rows, length) -> tuple:
    """Shape of the forward kernels' per-chunk statistics, [B, C * N_STATS]: row b's
    chunks one after the other. Per-row statistics [B, N_STATS] are the case C = 1."""
    return (n_rows, _n_chunks(length) * N_STATS)


@triton.jit
def _chunk_tokens(mask_ptr, base, start, L, BLOCK_L: tl.constexpr):
    """(offsets, in the row, valid) of the block of BLOCK_L tokens from ``start``."""
    offs = start + tl.arange(0, BLOCK_L)
    in_row = offs < L
    valid = in_row & (tl.load(mask_ptr + base + offs, mask=in_row, other=0) != 0)
    return offs, in_row, valid


@triton.jit
def _load(ptr, base, offs, in_row):
    """A block of a row, masked by the row's end only (so the load vectorises); the
    caller passes every value through tl.where on the token mask."""
    return tl.load(ptr + base + offs, mask=in_row, other=0.0)


@triton.jit
def _diff_sum_kernel(a_ptr, b_ptr, mask_ptr, diff_sums_ptr, L, n_chunks, CHUNK_L: tl.constexpr,
                     BLOCK_L: tl.constexpr):  # fmt: skip
    """Program (row, chunk): the chunk's sum over its valid tokens of a - b (the
    difference in the inputs' type, as the reference takes it; the sum in float64,
    each lane's tokens in order, one reduction at the end) and its count, to
    diff_sums[row, chunk, 0:2]."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    base = row * L
    total = tl.zeros([BLOCK_L], tl.float64)
    count = tl.zeros([BLOCK_L], tl.float64)
    for start in range(0, CHUNK_L, BLOCK_L):
        offs, in_row, valid = _chunk_tokens(mask_ptr, base, chunk * CHUNK_L + start, L, BLOCK_L)
        diff = (_load(a_ptr, base, offs, in_row) - _load(b_ptr, base, offs, in_row)).to(tl.float64)
        total += tl.where(valid, diff, 0.0)
        count += valid.to(tl.float64)
    out = diff_sums_ptr + (row * n_chunks + chunk) * 2
    tl.store(out, tl.sum(total, axis=0))
    tl.store(out + 1, tl.sum(count, axis=0))


@triton.jit
def _row_diff_sum(diff_sums_ptr, row, n_chunks, C_BLOCK: tl.constexpr):
    """(sum, count) of the row from its chunks' entries of _diff_sum_kernel: one
    load of all C <= C_BLOCK entries, summed by tl.sum's fixed tree (float64), so
    every program of the row gets the same bits."""
    chunks = tl.arange(0, C_BLOCK)
    entries = diff_sums_ptr + (row * n_chunks + chunks) * 2
    in_row = chunks < n_chunks
    total = tl.sum(tl.load(entries, mask=in_row, other=0.0), axis=0)
    count = tl.sum(tl.load(entries + 1, mask=in_row, other=0.0), axis=0)
    return total, count


@triton.jit
def _store_chunk_stats(stats_ptr, row, chunk, n_chunks, c0, c1, c2, c3, c4, c5, c6, c7):
    """Writes a chunk's 8 statistics to stats[row, 8 chunk : 8 chunk + 8], as float64."""
    out = stats_ptr + (row * n_chunks + chunk) * 8
    tl.store(out + 0, c0.to(tl.float64))
    tl.store(out + 1, c1.to(tl.float64))
    tl.store(out + 2, c2.to(tl.float64))
    tl.store(out + 3, c3.to(tl.float64))
    tl.store(out + 4, c4.to(tl.float64))
    tl.store(out + 5, c5.to(tl.float64))
    tl.store(out + 6, c6.to(tl.float64))
    tl.store(out + 7, c7.to(tl.float64))


@triton.jit
def _ratio(logp, old, mean_u, SEQUENCE: tl.constexpr):
    """(u, r, gate, ppo_kl term): r the importance ratio, gate whether its log's
    clamp passes the gradient."""
    u = logp - old
    if SEQUENCE:
        log_r = tl.zeros_like(u) + tl.minimum(mean_u, SEQ_LOG_RATIO_MAX)
        gate = tl.zeros_like(u) + (mean_u <= SEQ_LOG_RATIO_MAX).to(u.dtype)
        ppo_kl = -u
    else:
        log_r = clamp_nan(u, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        gate = ((u >= -LOG_RATIO_CLAMP) & (u <= LOG_RATIO_CLAMP)).to(u.dtype)
        ppo_kl = -log_r
    return u, tl.exp(log_r), gate, ppo_kl


@triton.jit
def _ppo_loss(adv, r, clip_low, clip_high, clip_c, DUAL_CLIP: tl.constexpr):
    """(loss, clipped, clipped_lower, d loss / d r) of each token, before the
    rollout weight; the derivative follows torch's tie rule for max / min."""
    l1 = -adv * r
    l2 = -adv * clamp_nan(r, 1.0 - clip_low, 1.0 + clip_high)
    loss = tl.maximum(l1, l2)
    dl1 = -adv
    dl2 = tl.where((r >= 1.0 - clip_low) & (r <= 1.0 + clip_high), -adv, 0.0)
    dloss = tl.where(l1 > l2, dl1, tl.where(l2 > l1, dl2, 0.5 * (dl1 + dl2)))
    clipped_lower = tl.zeros_like(r) != 0
    if DUAL_CLIP:
        l3 = -adv * clip_c
        dual = adv < 0
        clipped_lower = dual & (loss > l3)
        through = tl.where(loss < l3, 1.0, tl.where(loss == l3, 0.5, 0.0))
        dloss = tl.where(dual, dloss * through, dloss)
        loss = tl.where(dual, tl.minimum(loss, l3), loss)
    return loss, l2 > l1, clipped_lower, dloss


@triton.jit
def _policy_chunk(
    logp_ptr, old_ptr, adv_ptr, mask_ptr, w_ptr, ref_ptr, values_ptr, stats_ptr, row, chunk, n_chunks, L, mean_u,
    clip_low, clip_high, clip_c,
    ESTIMATOR: tl.constexpr, WITH_PG: tl.constexpr, HAS_W: tl.constexpr, HAS_VALUES: tl.constexpr,
    DUAL_CLIP: tl.constexpr, SEQUENCE: tl.constexpr, CHUNK_L: tl.constexpr, BLOCK_L: tl.constexpr,
    ACC: tl.constexpr,
):  # fmt: skip
    """One chunk of the policy forward: its partial sums (in ACC) to stats[row,
    8 chunk : 8 chunk + 8]. Each lane accumulates its tokens of every block; one reduction at the end."""
    base = row * L
    count = tl.zeros([BLOCK_L], ACC)
    pg_sum = tl.zeros([BLOCK_L], ACC)
    kl_sum = tl.zeros([BLOCK_L], ACC)
    values_sum = tl.zeros([BLOCK_L], ACC)
    clipped = tl.zeros([BLOCK_L], ACC)
    clipped_lower = tl.zeros([BLOCK_L], ACC)
    ppo_kl_sum = tl.zeros([BLOCK_L], ACC)
    for start in range(0, CHUNK_L, BLOCK_L):
        offs, in_row, valid = _chunk_tokens(mask_ptr, base, chunk * CHUNK_L + start, L, BLOCK_L)
        count += valid.to(ACC)
        if WITH_PG or ESTIMATOR >= 0:  # agg_loss needs only the values
            logp = _load(logp_ptr, base, offs, in_row)
        if WITH_PG:
            old = _load(old_ptr, base, offs, in_row)
            adv = _load(adv_ptr, base, offs, in_row)
            _, r, _, ppo_kl = _ratio(logp, old, mean_u, SEQUENCE)
            loss, clip, clip_lower, _ = _ppo_loss(adv, r, clip_low, clip_high, clip_c, DUAL_CLIP)
            clipped += (valid & clip).to(ACC)
            clipped_lower += (valid & clip_lower).to(ACC)
            if HAS_W:
                loss *= _load(w_ptr, base, offs, in_row)
            pg_sum += tl.where(valid, loss, 0.0)
            ppo_kl_sum += tl.where(valid, ppo_kl, 0.0)
        if ESTIMATOR >= 0:
            kl, _ = kl_estimate(logp, _load(ref_ptr, base, offs, in_row), ESTIMATOR, False)
            kl_sum += tl.where(valid, kl, 0.0)
        if HAS_VALUES:
            values_sum += tl.where(valid, _load(values_ptr, base, offs, in_row), 0.0)
    _store_chunk_stats(
        stats_ptr, row, chunk, n_chunks, tl.sum(count, axis=0), tl.sum(pg_sum, axis=0), tl.sum(kl_sum, axis=0),
        tl.sum(values_sum, axis=0), tl.sum(clipped, axis=0), tl.sum(clipped_lower, axis=0),
        tl.sum(ppo_kl_sum, axis=0), mean_u,
    )  # fmt: skip


@triton.jit
def _policy_fwd_kernel(
    logp_ptr, old_ptr, adv_ptr, mask_ptr, w_ptr, ref_ptr, values_ptr, diff_sums_ptr, stats_ptr, L, n_chunks,
    clip_low, clip_high, clip_c,
    ESTIMATOR: tl.constexpr, WITH_PG: tl.constexpr, HAS_W: tl.constexpr, HAS_VALUES: tl.constexpr,
    DUAL_CLIP: tl.constexpr, SEQUENCE: tl.constexpr, CHUNK_L: tl.constexpr, BLOCK_L: tl.constexpr,
    C_BLOCK: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk) writes its chunk; at sequence level, from the row's
    mean of u (diff_sums: _diff_sum_kernel's launch before this one). The clip
    ratios arrive as float64 bits (_launch.float_scalar_arg)."""
    row = tl.program_id(0).to(tl.int64)
    clip_low, clip_high, clip_c = float_scalar(clip_low, ACC), float_scalar(clip_high, ACC), float_scalar(clip_c, ACC)
    mean_u = tl.zeros([], ACC)
    if WITH_PG and SEQUENCE:
        sum_u, count = _row_diff_sum(diff_sums_ptr, row, n_chunks, C_BLOCK)
        mean_u = tl.where(count > 0, sum_u / tl.maximum(count, 1.0), 0.0).to(ACC)
    _policy_chunk(
        logp_ptr, old_ptr, adv_ptr, mask_ptr, w_ptr, ref_ptr, values_ptr, stats_ptr, row, tl.program_id(1),
        n_chunks, L, mean_u, clip_low, clip_high, clip_c, ESTIMATOR, WITH_PG, HAS_W, HAS_VALUES,
        DUAL_CLIP, SEQUENCE, CHUNK_L, BLOCK_L, ACC,
    )  # fmt: skip


@triton.jit
def _policy_bwd_kernel(
    logp_ptr, old_ptr, adv_ptr, mask_ptr, w_ptr, ref_ptr, stats_ptr, row_weights_ptr, grad_loss_ptr,
    grad_logp_ptr, grad_values_ptr, L, n_chunks, clip_low, clip_high, clip_c, kl_coef, value_coef,
    ESTIMATOR: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr, WITH_PG: tl.constexpr,
    HAS_W: tl.constexpr, DUAL_CLIP: tl.constexpr, SEQUENCE: tl.constexpr, GRAD_LOGP: tl.constexpr,
    GRAD_VALUES: tl.constexpr, CHUNK_L: tl.constexpr, BLOCK_L: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk): the gradients of the chunk's tokens. The float
    parameters arrive as float64 bits (_launch.float_scalar_arg)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    clip_low, clip_high, clip_c = float_scalar(clip_low, ACC), float_scalar(clip_high, ACC), float_scalar(clip_c, ACC)
    kl_coef, value_coef = float_scalar(kl_coef, ACC), float_scalar(value_coef, ACC)
    base = row * L
    g = (tl.load(grad_loss_ptr).to(tl.float64) * tl.load(row_weights_ptr + row)).to(ACC)
    mean_u = tl.zeros([], ACC)
    if WITH_PG and SEQUENCE:  # the row's mean of u, as the forward wrote it into each chunk
        mean_u = tl.load(stats_ptr + (row * n_chunks + chunk) * 8 + 7).to(ACC)
    for start in range(0, CHUNK_L, BLOCK_L):
        offs, in_row, valid = _chunk_tokens(mask_ptr, base, chunk * CHUNK_L + start, L, BLOCK_L)
        if GRAD_LOGP:
            logp = _load(logp_ptr, base, offs, in_row)
            grad = tl.zeros([BLOCK_L], ACC)
            if WITH_PG:
                old = _load(old_ptr, base, offs, in_row)
                adv = _load(adv_ptr, base, offs, in_row)
                _, r, gate, _ = _ratio(logp, old, mean_u, SEQUENCE)
                _, _, _, dloss = _ppo_loss(adv, r, clip_low, clip_high, clip_c, DUAL_CLIP)
                if HAS_W:
                    dloss *= _load(w_ptr, base, offs, in_row)
                grad += dloss * r * gate
            if ESTIMATOR >= 0:
                _, dkl = kl_estimate(logp, _load(ref_ptr, base, offs, in_row), ESTIMATOR, STRAIGHT_THROUGH)
                grad += kl_coef * dkl
            tl.store(grad_logp_ptr + base + offs, tl.where(valid, g * grad, 0.0), mask=in_row)
        if GRAD_VALUES:
            tl.store(grad_values_ptr + base + offs, tl.where(valid, g * value_coef, 0.0), mask=in_row)


@triton.jit
def _correction_weights(raw, valid, clip_min, clip_max, TRUNCATE: tl.constexpr):
    """(applied weight w, 0 outside the mask; valid tokens zeroed by the mask mode)."""
    if TRUNCATE:
        w = clamp_nan(raw, clip_min, clip_max)
        zeroed = tl.zeros_like(raw) != 0
    else:
        kept = (raw >= clip_min) & (raw <= clip_max)
        w = tl.where(kept, raw, 0.0)
        zeroed = valid & ~kept
    return tl.where(valid, w, 0.0), zeroed


@triton.jit
def _correction_chunk(
    old_ptr, rollout_ptr, mask_ptr, weights_ptr, stats_ptr, row, chunk, n_chunks, L, log_w_row, row_count,
    clip_min, clip_max, low_threshold,
    SEQUENCE: tl.constexpr, TRUNCATE: tl.constexpr, CHUNK_L: tl.constexpr, BLOCK_L: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """One chunk of the rollout correction: its weights, and its statistics to
    stats[row, 8 chunk : 8 chunk + 8] (at sequence level, from the row's log-weight
    ``log_w_row`` and valid-token count ``row_count``). Each lane accumulates its
    tokens of every block; one reduction at the end. The sums of w and w^2 are
    float64: the std sqrt(E[w^2] - E[w]^2) cancels when the weights cluster at 1
    (the usual case), so an fp32 partial's 16 u relative error of sum w^2 would
    be a large error of the std (w^2 of a float32 w is exact in float64)."""
    base = row * L
    count = tl.zeros([BLOCK_L], ACC)
    w_sum = tl.zeros([BLOCK_L], tl.float64)
    w_sq_sum = tl.zeros([BLOCK_L], tl.float64)
    n_zeroed = tl.zeros([BLOCK_L], ACC)
    w_max = tl.full([BLOCK_L], float("-inf"), ACC)
    w_min = tl.full([BLOCK_L], float("inf"), ACC)
    high = tl.zeros([BLOCK_L], ACC)
    low = tl.zeros([BLOCK_L], ACC)
    for start in range(0, CHUNK_L, BLOCK_L):
        offs, in_row, valid = _chunk_tokens(mask_ptr, base, chunk * CHUNK_L + start, L, BLOCK_L)
        if SEQUENCE:
            log_w = tl.zeros([BLOCK_L], ACC) + log_w_row
        else:
            log_w = _load(old_ptr, base, offs, in_row) - _load(rollout_ptr, base, offs, in_row)
        raw = tl.exp(clamp_nan(log_w, -CORRECTION_LOG_CLAMP, CORRECTION_LOG_CLAMP))
        w, zeroed = _correction_weights(raw, valid, clip_min, clip_max, TRUNCATE)
        tl.store(weights_ptr + base + offs, w.to(tl.float32), mask=in_row)
        count += valid.to(ACC)
        w64 = w.to(tl.float64)
        w_sum += w64
        w_sq_sum += w64 * w64
        n_zeroed += zeroed.to(ACC)
        if not SEQUENCE:
            w_max = tl.maximum(w_max, tl.where(valid, w, float("-inf")))
            w_min = tl.minimum(w_min, tl.where(valid, w, float("inf")))
            high += (valid & (raw > clip_max)).to(ACC)
            low += (valid & (raw < low_threshold)).to(ACC)
    if SEQUENCE:
        # veRL's sequence-level extremes and fractions are of the raw sequence weight
        # e^S, once per sequence with a valid token (in its first chunk): max e^min(S, 20), min e^S.
        e = tl.exp(log_w_row)
        once = (row_count > 0) & (chunk == 0)
        capped = tl.where(log_w_row > CORRECTION_LOG_CLAMP, CORRECTION_LOG_CLAMP, log_w_row)  # NaN kept
        chunk_max = tl.where(once, tl.exp(capped), float("-inf"))
        chunk_min = tl.where(once, e, float("inf"))
        chunk_high = (once & (e > clip_max)).to(ACC)
        chunk_low = (once & (e < low_threshold)).to(ACC)
    else:
        chunk_max = tl.max(w_max, axis=0)
        chunk_min = tl.min(w_min, axis=0)
        chunk_high = tl.sum(high, axis=0)
        chunk_low = tl.sum(low, axis=0)
    _store_chunk_stats(
        stats_ptr, row, chunk, n_chunks, tl.sum(count, axis=0), tl.sum(w_sum, axis=0), tl.sum(w_sq_sum, axis=0),
        chunk_max, chunk_min, chunk_high, chunk_low, tl.sum(n_zeroed, axis=0),
    )  # fmt: skip


@triton.jit
def _rollout_correction_kernel(
    old_ptr, rollout_ptr, mask_ptr, weights_ptr, diff_sums_ptr, stats_ptr, L, n_chunks, clip_min, clip_max,
    low_threshold,
    SEQUENCE: tl.constexpr, TRUNCATE: tl.constexpr, CHUNK_L: tl.constexpr, BLOCK_L: tl.constexpr,
    C_BLOCK: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Program (row, chunk) does its chunk; at sequence level, from the row's
    log-weight S (diff_sums: _diff_sum_kernel's launch before this one). The
    bounds arrive as float64 bits (_launch.float_scalar_arg)."""
    row = tl.program_id(0).to(tl.int64)
    clip_min, clip_max = float_scalar(clip_min, ACC), float_scalar(clip_max, ACC)
    low_threshold = float_scalar(low_threshold, ACC)
    sum_u = tl.zeros([], tl.float64)
    count = tl.zeros([], tl.float64)
    if SEQUENCE:
        sum_u, count = _row_diff_sum(diff_sums_ptr, row, n_chunks, C_BLOCK)
    _correction_chunk(
        old_ptr, rollout_ptr, mask_ptr, weights_ptr, stats_ptr, row, tl.program_id(1), n_chunks, L, sum_u.to(ACC),
        count, clip_min, clip_max, low_threshold, SEQUENCE, TRUNCATE, CHUNK_L, BLOCK_L, ACC,
    )  # fmt: skip


@triton.jit
def _count(ptr, scalar, default, GIVEN: tl.constexpr):
    """A global count: GIVEN 0 -> the local ``default``, 1 -> the scalar, 2 -> a 0-d device tensor."""
    if GIVEN == 2:
        return tl.load(ptr).to(tl.float64)
    elif GIVEN == 1:
        return float_scalar(scalar, tl.float64)
    else:
        return default


@triton.jit
def _safe_div(num, den):
    """num / den with x / 0 := 0."""
    return tl.where(den == 0, 0.0, num / tl.where(den == 0, 1.0, den))


@triton.jit
def _row_stats(stats_ptr, rows, in_batch, n_chunks, BLOCK_B: tl.constexpr, C_BLOCK: tl.constexpr):
    """[BLOCK_B, 8]: each row's 8 statistics summed over its chunks, in float64: a
    [rows, C_BLOCK, 8] tile of chunks at a time, summed along the chunks (a fixed
    tree), tiles in chunk order. A row's sums depend on its own chunks only."""
    columns = tl.arange(0, 8)
    total = tl.zeros([BLOCK_B, 8], tl.float64)
    for first in range(0, n_chunks, C_BLOCK):
        chunks = first + tl.arange(0, C_BLOCK)
        entries = rows[:, None] * n_chunks + chunks[None, :]
        ok = in_batch[:, None] & (chunks[None, :] < n_chunks)
        tile = tl.load(stats_ptr + entries[:, :, None] * 8 + columns[None, None, :],
                       mask=ok[:, :, None] & (columns[None, None, :] < 8), other=0.0)  # fmt: skip
        total += tl.sum(tile, axis=1)
    return total


@triton.jit
def _column(row_stats, k: tl.constexpr):
    """Column k of [rows, 8] statistics."""
    return tl.sum(tl.where(tl.arange(0, 8)[None, :] == k, row_stats, 0.0), axis=1)


@triton.jit
def _column_extreme(stats_ptr, n, column, LARGEST: tl.constexpr, BLOCK: tl.constexpr):
    """max (LARGEST) or min of a column over the batch's ``n`` = B * C chunks (exact
    in any order); -inf / inf when n = 0."""
    fill = float("-inf") if LARGEST else float("inf")
    extreme = tl.full([], fill, tl.float64)
    for start in range(0, n, BLOCK):
        entries = start + tl.arange(0, BLOCK)
        x = tl.load(stats_ptr + entries * 8 + column, mask=entries < n, other=fill)
        if LARGEST:
            extreme = tl.maximum(extreme, tl.max(x, axis=0))
        else:
            extreme = tl.minimum(extreme, tl.min(x, axis=0))
    return extreme


@triton.jit
def _policy_finalize_kernel(
    stats_ptr, B, n_chunks, loss_ptr, metrics_ptr, row_weights_ptr, dp, n_scalar, n_ptr, g_scalar, g_ptr, norm,
    kl_coef, value_coef, MODE: tl.constexpr, N_GIVEN: tl.constexpr, G_GIVEN: tl.constexpr, BLOCK_B: tl.constexpr,
    C_BLOCK: tl.constexpr,
):  # fmt: skip
    """One program: the per-row weights w_b of the aggregation mode, the loss and
    the metrics from the per-chunk sums (see policy_finalize). Two passes over the
    rows: the counts, then the weighted sums. The float parameters arrive as
    float64 bits (_launch.float_scalar_arg): a count above 2^24 stays exact."""
    f64 = tl.float64
    norm, kl_coef, value_coef = float_scalar(norm, f64), float_scalar(kl_coef, f64), float_scalar(value_coef, f64)
    tokens = tl.zeros([], f64)
    sequences = tl.zeros([], f64)
    for start in range(0, B, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B)
        n = _column(_row_stats(stats_ptr, rows, rows < B, n_chunks, BLOCK_B, C_BLOCK), 0)
        tokens += tl.sum(n, axis=0)
        sequences += tl.sum((n > 0).to(f64), axis=0)
    dp64 = float_scalar(dp, f64)
    if MODE == 0:  # token-mean
        base_weight = _safe_div(dp64, _count(n_ptr, n_scalar, tokens, N_GIVEN))
    elif MODE == 1:  # token-sum
        base_weight = dp64
    else:  # seq-mean-*
        base_weight = _safe_div(dp64, _count(g_ptr, g_scalar, sequences, G_GIVEN))
        if MODE == 4:  # seq-mean-token-sum-norm
            base_weight = _safe_div(base_weight, norm)  # norm = L may be 0
    pg = tl.zeros([], f64)
    kl = tl.zeros([], f64)
    values = tl.zeros([], f64)
    clipped = tl.zeros([], f64)
    clipped_lower = tl.zeros([], f64)
    ppo_kl = tl.zeros([], f64)
    for start in range(0, B, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B)
        in_batch = rows < B
        s = _row_stats(stats_ptr, rows, in_batch, n_chunks, BLOCK_B, C_BLOCK)
        w = tl.zeros([BLOCK_B], f64) + base_weight
        if MODE == 3:  # seq-mean-token-mean: each sequence's token mean
            w = _safe_div(w, _column(s, 0))
        tl.store(row_weights_ptr + rows, w, mask=in_batch)
        pg += tl.sum(w * _column(s, 1), axis=0)
        kl += tl.sum(w * _column(s, 2), axis=0)
        values += tl.sum(w * _column(s, 3), axis=0)
        clipped += tl.sum(_column(s, 4), axis=0)
        clipped_lower += tl.sum(_column(s, 5), axis=0)
        ppo_kl += tl.sum(_column(s, 6), axis=0)
    tl.store(loss_ptr, (pg + kl_coef * kl + value_coef * values).to(loss_ptr.dtype.element_ty))
    tl.store(metrics_ptr + 0, pg.to(tl.float32))
    tl.store(metrics_ptr + 1, kl.to(tl.float32))
    tl.store(metrics_ptr + 2, values.to(tl.float32))
    tl.store(metrics_ptr + 3, _safe_div(clipped, tokens).to(tl.float32))  # means over the valid tokens
    tl.store(metrics_ptr + 4, _safe_div(clipped_lower, tokens).to(tl.float32))
    tl.store(metrics_ptr + 5, _safe_div(ppo_kl, tokens).to(tl.float32))


@triton.jit
def _rollout_finalize_kernel(
    stats_ptr, B, n_chunks, metrics_ptr, SEQUENCE: tl.constexpr, BLOCK_B: tl.constexpr, C_BLOCK: tl.constexpr
):
    """One program: the rollout-correction metrics (see rollout_finalize)."""
    f64 = tl.float64
    tokens = tl.zeros([], f64)
    sequences = tl.zeros([], f64)  # rows with a valid token
    w_sum = tl.zeros([], f64)
    w_sq_sum = tl.zeros([], f64)
    high = tl.zeros([], f64)
    low = tl.zeros([], f64)
    masked = tl.zeros([], f64)
    for start in range(0, B, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B)
        s = _row_stats(stats_ptr, rows, rows < B, n_chunks, BLOCK_B, C_BLOCK)
        n = _column(s, 0)
        tokens += tl.sum(n, axis=0)
        sequences += tl.sum((n > 0).to(f64), axis=0)
        w_sum += tl.sum(_column(s, 1), axis=0)
        w_sq_sum += tl.sum(_column(s, 2), axis=0)
        high += tl.sum(_column(s, 5), axis=0)
        low += tl.sum(_column(s, 6), axis=0)
        masked += tl.sum(_column(s, 7), axis=0)
    w_max = _column_extreme(stats_ptr, B * n_chunks, 3, True, BLOCK_B * C_BLOCK)
    w_min = _column_extreme(stats_ptr, B * n_chunks, 4, False, BLOCK_B * C_BLOCK)
    # veRL's sequence-level high / low fractions count sequences, not tokens.
    high_low_count = sequences if SEQUENCE else tokens
    mean = _safe_div(w_sum, tokens)
    mean_sq = _safe_div(w_sq_sum, tokens)
    tl.store(metrics_ptr + 0, mean.to(tl.float32))
    tl.store(metrics_ptr + 1, tl.where(tokens > 0, w_max, 0.0).to(tl.float32))
    tl.store(metrics_ptr + 2, tl.where(tokens > 0, w_min, 0.0).to(tl.float32))
    tl.store(metrics_ptr + 3, tl.sqrt(tl.maximum(mean_sq - mean * mean, 0.0)).to(tl.float32))
    tl.store(metrics_ptr + 4, _safe_div(mean * mean, mean_sq).to(tl.float32))
    tl.store(metrics_ptr + 5, _safe_div(high, high_low_count).to(tl.float32))
    tl.store(metrics_ptr + 6, _safe_div(low, high_low_count).to(tl.float32))
    tl.store(metrics_ptr + 7, _safe_div(masked, tokens).to(tl.float32))


# A finalize kernel reads [rows, chunks, 8] tiles of _FINALIZE_TILE chunks (8
# warps: 16 float64 a thread), at most _FINALIZE_CHUNKS chunks wide (L <= 64K:
# a row's merge in one step).
_FINALIZE_TILE = 512
_FINALIZE_CHUNKS = 64


def _float_args(*values: float) -> list[int]:
    """Float parameters as the kernels take them (_launch.float_scalar_arg): float64 bits."""
    return [float_scalar_arg(float(v)) for v in values]


def _count_args(value) -> tuple[torch.Tensor | None, int, int]:
    """(tensor, scalar (float_scalar_arg), GIVEN) of a global count: None, a number
    or a 0-d float64 device tensor."""
    if value is None:
        return None, 0, 0
    if isinstance(value, torch.Tensor):
        return value, 0, 2
    return None, *_float_args(value), 1


def _finalize_sizes(stats: torch.Tensor) -> tuple[int, dict]:
    """(C, tile meta-parameters and launch flags) of per-chunk statistics [B, C * 8] (C = 1: per-row
    ones, what the API passes for rows of no tokens)."""
    n_chunks = stats.shape[1] // N_STATS
    c_block = min(triton.next_power_of_2(max(n_chunks, 1)), _FINALIZE_CHUNKS)
    return n_chunks, {"BLOCK_B": _FINALIZE_TILE // c_block, "C_BLOCK": c_block, "num_warps": 8} | CONTRACTED


def policy_finalize(
    stats, *, mode: int, dp_size: float, batch_num_tokens, global_batch_size, norm: float, kl_coef: float,
    value_coef: float, loss_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(loss 0-d of ``loss_dtype``, metrics float32 [6] = (pg, kl, values, clipfrac,
    clipfrac_lower, ppo_kl), row weights float64 [B]) from policy_forward's stats.
    ``mode`` indexes reference.AGG_MODES; every aggregation is sum_b w_b (row sum)."""
    n_rows = stats.shape[0]
    loss = torch.empty((), dtype=loss_dtype, device=stats.device)
    metrics = torch.empty(6, dtype=torch.float32, device=stats.device)
    row_weights = torch.empty(n_rows, dtype=torch.float64, device=stats.device)
    n_ptr, n_scalar, n_given = _count_args(batch_num_tokens)
    g_ptr, g_scalar, g_given = _count_args(global_batch_size)
    n_chunks, tiles = _finalize_sizes(stats)
    _policy_finalize_kernel[(1,)](
        stats, n_rows, n_chunks, loss, metrics, row_weights, *_float_args(dp_size), n_scalar, n_ptr, g_scalar, g_ptr,
        *_float_args(norm, kl_coef, value_coef), MODE=mode, N_GIVEN=n_given, G_GIVEN=g_given, **tiles,
    )  # fmt: skip
    return loss, metrics, row_weights


def rollout_finalize(stats: torch.Tensor, *, sequence: bool) -> torch.Tensor:
    """Metrics float32 [8] = (mean, max, min, std, effective sample size, fraction
    high, fraction low, fraction masked) from rollout_correction_forward's stats.
    The high / low fractions are of the valid tokens, or with ``sequence`` of the
    rows with a valid token (each wrote 0 or 1 in those columns)."""
    metrics = torch.empty(8, dtype=torch.float32, device=stats.device)
    n_chunks, tiles = _finalize_sizes(stats)
    _rollout_finalize_kernel[(1,)](stats, stats.shape[0], n_chunks, metrics, SEQUENCE=sequence, **tiles)
    return metrics


def _launch(n_rows: int, length: int) -> tuple[dict, tuple[int, int]]:
    """(the sizes' meta-parameters and launch flags, grid) of a [B, L] kernel: programs (row, chunk) of 2 warps."""
    chunk = _chunk(length)
    block = min(chunk, _BLOCK)
    meta = {"CHUNK_L": chunk, "BLOCK_L": block, "num_warps": max(1, block // _TOKENS_PER_WARP)} | CONTRACTED
    return meta, (n_rows, _n_chunks(length))


def _row_diff_sums(a, b, mask, sizes: dict, grid: tuple) -> torch.Tensor:
    """[B, C, 2] float64: each chunk's sum of a - b over its valid tokens and their
    count (_diff_sum_kernel), the first launch of a sequence-level forward."""
    diff_sums = torch.empty(*grid, 2, dtype=torch.float64, device=a.device)
    _diff_sum_kernel[grid](a, b, mask, diff_sums, a.shape[1], grid[1], **sizes)
    return diff_sums


def policy_forward(
    log_probs, old_log_probs, advantages, mask, weights, ref_log_probs, values,
    *, estimator: int, clip_low: float, clip_high: float, clip_c: float | None, sequence: bool, with_pg: bool,
) -> torch.Tensor:  # fmt: skip
    """Per-chunk float64 statistics [B, C * 8] (columns above) of [B, L] per-token
    inputs. ``estimator`` -1 skips the KL; None tensors skip their terms."""
    n_rows, length = log_probs.shape
    _, acc_tl = acc_dtypes(log_probs)
    stats = torch.empty(stats_shape(n_rows, length), dtype=torch.float64, device=log_probs.device)
    sizes, grid = _launch(n_rows, length)
    if stats.numel():
        diff_sums = _row_diff_sums(log_probs, old_log_probs, mask, sizes, grid) if sequence and with_pg else None
        _policy_fwd_kernel[grid](
            log_probs, old_log_probs, advantages, mask, weights, ref_log_probs, values, diff_sums, stats, length,
            stats.shape[1] // N_STATS, *_float_args(clip_low, clip_high, 0.0 if clip_c is None else clip_c),
            ESTIMATOR=estimator, WITH_PG=with_pg, HAS_W=weights is not None, HAS_VALUES=values is not None,
            DUAL_CLIP=clip_c is not None, SEQUENCE=sequence, C_BLOCK=triton.next_power_of_2(grid[1]), ACC=acc_tl,
            **sizes,
        )  # fmt: skip
    return stats


def policy_backward(
    log_probs, old_log_probs, advantages, mask, weights, ref_log_probs, stats, row_weights, grad_loss,
    *, estimator: int, straight_through: bool, kl_coef: float, value_coef: float, clip_low: float,
    clip_high: float, clip_c: float | None, sequence: bool, with_pg: bool,
    grad_logp: torch.Tensor | None, grad_values: torch.Tensor | None,
) -> None:  # fmt: skip
    """Writes dL/dlog_probs into ``grad_logp`` and dL/dvalues into ``grad_values``
    ([B, L], either None to skip), from the per-row weights of policy_finalize and
    the loss's incoming gradient ``grad_loss`` (0-d)."""
    n_rows, length = log_probs.shape
    _, acc_tl = acc_dtypes(log_probs)
    sizes, grid = _launch(n_rows, length)
    if log_probs.numel():
        _policy_bwd_kernel[grid](
            log_probs, old_log_probs, advantages, mask, weights, ref_log_probs, stats, row_weights, grad_loss,
            grad_logp, grad_values, length, stats.shape[1] // N_STATS,
            *_float_args(clip_low, clip_high, 0.0 if clip_c is None else clip_c, kl_coef, value_coef),
            ESTIMATOR=estimator, STRAIGHT_THROUGH=straight_through, WITH_PG=with_pg, HAS_W=weights is not None,
            DUAL_CLIP=clip_c is not None, SEQUENCE=sequence, GRAD_LOGP=grad_logp is not None,
            GRAD_VALUES=grad_values is not None, ACC=acc_tl, **sizes,
        )  # fmt: skip


def rollout_correction_forward(
    old_log_probs, rollout_log_probs, mask,
    *, sequence: bool, truncate: bool, clip_min: float, clip_max: float, low_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(weights float32 [B, L], per-chunk float64 statistics [B, C * 8] (columns above))."""
    n_rows, length = old_log_probs.shape
    _, acc_tl = acc_dtypes(old_log_probs)
    weights = torch.empty(n_rows, length, dtype=torch.float32, device=old_log_probs.device)
    stats = torch.empty(stats_shape(n_rows, length), dtype=torch.float64, device=old_log_probs.device)
    sizes, grid = _launch(n_rows, length)
    if stats.numel():
        diff_sums = _row_diff_sums(old_log_probs, rollout_log_probs, mask, sizes, grid) if sequence else None
        _rollout_correction_kernel[grid](
            old_log_probs, rollout_log_probs, mask, weights, diff_sums, stats, length, stats.shape[1] // N_STATS,
            *_float_args(clip_min, clip_max, low_threshold), SEQUENCE=sequence, TRUNCATE=truncate,
            C_BLOCK=triton.next_power_of_2(grid[1]), ACC=acc_tl, **sizes,
        )  # fmt: skip
    return weights, stats
