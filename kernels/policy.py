"""PPO / GRPO / GSPO policy loss, loss aggregation and rollout-correction
weights: Triton kernels and launchers.

Inputs are [B, L] rows of per-token values (a row is a sequence), contiguous,
in the accumulation dtype (fp32, or fp64), and a uint8 mask. One program per
row, so a row's sums never depend on the batch. A token outside the mask is
never loaded: its values may be anything, NaN included.

Forward, per token of row b (fastrl.reference.policy_loss is the spec):
    u = logp - old
    token level:     log r = clamp(u, -20, 20)
    sequence level:  log r = min(mean_b(u), 10)      (GSPO; a first pass over the row)
    l1 = -A r,  l2 = -A clamp(r, 1 - clip_low, 1 + clip_high),  l = max(l1, l2)
    dual clip:  l = min(l, -A clip_c) where A < 0;   l *= w (rollout weights)
and the row's partial sums, in float64, go to stats[b, :] (columns below). The
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

from .kl import clamp_nan, kl_estimate
from .logprobs import _acc_dtypes

# The per-row statistics, 8 float64 columns:
#   policy_forward              n, sum l, sum kl, sum values, n clipped, n clipped lower, sum ppo_kl, mean u
#   rollout_correction_forward  n, sum w, sum w^2, max, min, n high, n low, n masked
#       (token level: max / min of w, tokens with raw weight > clip_max / < low_threshold;
#        sequence level, veRL's metrics of the row's summed log-ratio S: e^min(S, 20), e^S,
#        and 0 / 1 for e^S > clip_max / < low_threshold; fastrl/policy.py divides those
#        by the sequences, not the tokens)
N_STATS = 8

# veRL's clamps: the token log-ratio, the GSPO sequence log-ratio (above only),
# the log of a rollout-correction weight.
LOG_RATIO_CLAMP = tl.constexpr(20.0)
SEQ_LOG_RATIO_MAX = tl.constexpr(10.0)
CORRECTION_LOG_CLAMP = tl.constexpr(20.0)

_MAX_BLOCK_L = 2048


def _block(length: int) -> int:
    return max(16, min(triton.next_power_of_2(length), _MAX_BLOCK_L))


@triton.jit
def _valid_tokens(mask_ptr, base, offs, L):
    in_row = offs < L
    return in_row & (tl.load(mask_ptr + base + offs, mask=in_row, other=0) != 0)


@triton.jit
def _row_diff_sum(a_ptr, b_ptr, mask_ptr, base, L, BLOCK_L: tl.constexpr):
    """(sum, mean) over the row's valid tokens of a - b, in float64 (mean 0 for an empty row)."""
    total = tl.zeros([], tl.float64)
    count = tl.zeros([], tl.float64)
    for start in range(0, L, BLOCK_L):
        offs = start + tl.arange(0, BLOCK_L)
        valid = _valid_tokens(mask_ptr, base, offs, L)
        a = tl.load(a_ptr + base + offs, mask=valid, other=0.0)
        b = tl.load(b_ptr + base + offs, mask=valid, other=0.0)
        total += tl.sum((a - b).to(tl.float64), axis=0)
        count += tl.sum(valid.to(tl.float64), axis=0)
    return total, tl.where(count > 0, total / tl.maximum(count, 1.0), 0.0)


@triton.jit
def _store_row_stats(stats_ptr, row, c0, c1, c2, c3, c4, c5, c6, c7):
    """Writes a row's 8 statistics, in column order, as float64."""
    out = stats_ptr + row * 8
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
def _policy_fwd_kernel(
    logp_ptr, old_ptr, adv_ptr, mask_ptr, w_ptr, ref_ptr, values_ptr, stats_ptr, L,
    clip_low, clip_high, clip_c,
    ESTIMATOR: tl.constexpr, WITH_PG: tl.constexpr, HAS_W: tl.constexpr, HAS_VALUES: tl.constexpr,
    DUAL_CLIP: tl.constexpr, SEQUENCE: tl.constexpr, BLOCK_L: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = row * L
    mean_u = tl.zeros([], ACC)
    if WITH_PG and SEQUENCE:
        sum_u, mean_u64 = _row_diff_sum(logp_ptr, old_ptr, mask_ptr, base, L, BLOCK_L)
        mean_u = mean_u64.to(ACC)
    f64 = tl.float64
    count = tl.zeros([], f64)
    pg_sum = tl.zeros([], f64)
    kl_sum = tl.zeros([], f64)
    values_sum = tl.zeros([], f64)
    clipped = tl.zeros([], f64)
    clipped_lower = tl.zeros([], f64)
    ppo_kl_sum = tl.zeros([], f64)
    for start in range(0, L, BLOCK_L):
        offs = start + tl.arange(0, BLOCK_L)
        valid = _valid_tokens(mask_ptr, base, offs, L)
        count += tl.sum(valid.to(f64), axis=0)
        if WITH_PG or ESTIMATOR >= 0:  # agg_loss needs only the values
            logp = tl.load(logp_ptr + base + offs, mask=valid, other=0.0)
        if WITH_PG:
            old = tl.load(old_ptr + base + offs, mask=valid, other=0.0)
            adv = tl.load(adv_ptr + base + offs, mask=valid, other=0.0)
            _, r, _, ppo_kl = _ratio(logp, old, mean_u, SEQUENCE)
            loss, clip, clip_lower, _ = _ppo_loss(adv, r, clip_low, clip_high, clip_c, DUAL_CLIP)
            clipped += tl.sum((valid & clip).to(f64), axis=0)
            clipped_lower += tl.sum((valid & clip_lower).to(f64), axis=0)
            if HAS_W:
                loss *= tl.load(w_ptr + base + offs, mask=valid, other=0.0)
            pg_sum += tl.sum(tl.where(valid, loss, 0.0).to(f64), axis=0)
            ppo_kl_sum += tl.sum(tl.where(valid, ppo_kl, 0.0).to(f64), axis=0)
        if ESTIMATOR >= 0:
            ref = tl.load(ref_ptr + base + offs, mask=valid, other=0.0)
            kl, _ = kl_estimate(logp, ref, ESTIMATOR, False)
            kl_sum += tl.sum(tl.where(valid, kl, 0.0).to(f64), axis=0)
        if HAS_VALUES:
            values_sum += tl.sum(tl.load(values_ptr + base + offs, mask=valid, other=0.0).to(f64), axis=0)
    _store_row_stats(stats_ptr, row, count, pg_sum, kl_sum, values_sum, clipped, clipped_lower, ppo_kl_sum, mean_u)


@triton.jit
def _policy_bwd_kernel(
    logp_ptr, old_ptr, adv_ptr, mask_ptr, w_ptr, ref_ptr, stats_ptr, row_weights_ptr, grad_loss_ptr,
    grad_logp_ptr, grad_values_ptr, L, clip_low, clip_high, clip_c, kl_coef, value_coef,
    ESTIMATOR: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr, WITH_PG: tl.constexpr,
    HAS_W: tl.constexpr, DUAL_CLIP: tl.constexpr, SEQUENCE: tl.constexpr,
    GRAD_LOGP: tl.constexpr, GRAD_VALUES: tl.constexpr, BLOCK_L: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = row * L
    g = (tl.load(grad_loss_ptr).to(tl.float64) * tl.load(row_weights_ptr + row)).to(ACC)
    mean_u = tl.load(stats_ptr + row * 8 + 7).to(ACC)
    for start in range(0, L, BLOCK_L):
        offs = start + tl.arange(0, BLOCK_L)
        in_row = offs < L
        valid = _valid_tokens(mask_ptr, base, offs, L)
        if GRAD_LOGP:
            logp = tl.load(logp_ptr + base + offs, mask=valid, other=0.0)
            grad = tl.zeros([BLOCK_L], ACC)
            if WITH_PG:
                old = tl.load(old_ptr + base + offs, mask=valid, other=0.0)
                adv = tl.load(adv_ptr + base + offs, mask=valid, other=0.0)
                _, r, gate, _ = _ratio(logp, old, mean_u, SEQUENCE)
                _, _, _, dloss = _ppo_loss(adv, r, clip_low, clip_high, clip_c, DUAL_CLIP)
                if HAS_W:
                    dloss *= tl.load(w_ptr + base + offs, mask=valid, other=0.0)
                grad += dloss * r * gate
            if ESTIMATOR >= 0:
                ref = tl.load(ref_ptr + base + offs, mask=valid, other=0.0)
                _, dkl = kl_estimate(logp, ref, ESTIMATOR, STRAIGHT_THROUGH)
                grad += kl_coef * dkl
            tl.store(grad_logp_ptr + base + offs, tl.where(valid, g * grad, 0.0), mask=in_row)
        if GRAD_VALUES:
            tl.store(grad_values_ptr + base + offs, tl.where(valid, g * value_coef, 0.0), mask=in_row)


@triton.jit
def _rollout_correction_kernel(
    old_ptr, rollout_ptr, mask_ptr, weights_ptr, stats_ptr, L, clip_min, clip_max, low_threshold,
    SEQUENCE: tl.constexpr, TRUNCATE: tl.constexpr, BLOCK_L: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = row * L
    log_w_row = tl.zeros([], ACC)
    if SEQUENCE:
        sum_u, mean_u = _row_diff_sum(old_ptr, rollout_ptr, mask_ptr, base, L, BLOCK_L)
        log_w_row = sum_u.to(ACC)
    f64 = tl.float64
    count = tl.zeros([], f64)
    w_sum = tl.zeros([], f64)
    w_sq_sum = tl.zeros([], f64)
    w_max = tl.full([], float("-inf"), f64)
    w_min = tl.full([], float("inf"), f64)
    high = tl.zeros([], f64)
    low = tl.zeros([], f64)
    zeroed = tl.zeros([], f64)
    for start in range(0, L, BLOCK_L):
        offs = start + tl.arange(0, BLOCK_L)
        in_row = offs < L
        valid = _valid_tokens(mask_ptr, base, offs, L)
        if SEQUENCE:
            log_w = tl.zeros([BLOCK_L], ACC) + log_w_row
        else:
            old = tl.load(old_ptr + base + offs, mask=valid, other=0.0)
            log_w = old - tl.load(rollout_ptr + base + offs, mask=valid, other=0.0)
        raw = tl.exp(clamp_nan(log_w, -CORRECTION_LOG_CLAMP, CORRECTION_LOG_CLAMP))
        if TRUNCATE:
            w = clamp_nan(raw, clip_min, clip_max)
        else:
            kept = (raw >= clip_min) & (raw <= clip_max)
            w = tl.where(kept, raw, 0.0)
            zeroed += tl.sum((valid & ~kept).to(f64), axis=0)
        w = tl.where(valid, w, 0.0)
        tl.store(weights_ptr + base + offs, w.to(tl.float32), mask=in_row)
        w64 = w.to(f64)
        count += tl.sum(valid.to(f64), axis=0)
        w_sum += tl.sum(w64, axis=0)
        w_sq_sum += tl.sum(w64 * w64, axis=0)
        if not SEQUENCE:
            w_max = tl.maximum(w_max, tl.max(tl.where(valid, w64, float("-inf")), axis=0))
            w_min = tl.minimum(w_min, tl.min(tl.where(valid, w64, float("inf")), axis=0))
            high += tl.sum((valid & (raw > clip_max)).to(f64), axis=0)
            low += tl.sum((valid & (raw < low_threshold)).to(f64), axis=0)
    if SEQUENCE:
        # veRL's sequence-level extremes and fractions are of the raw sequence weight
        # e^S, once per sequence with a valid token: max e^min(S, 20), min e^S.
        e = tl.exp(log_w_row)
        has_token = count > 0
        capped = tl.where(log_w_row > CORRECTION_LOG_CLAMP, CORRECTION_LOG_CLAMP, log_w_row)  # NaN kept
        w_max = tl.where(has_token, tl.exp(capped).to(f64), w_max)
        w_min = tl.where(has_token, e.to(f64), w_min)
        high = (has_token & (e > clip_max)).to(f64)
        low = (has_token & (e < low_threshold)).to(f64)
    _store_row_stats(stats_ptr, row, count, w_sum, w_sq_sum, w_max, w_min, high, low, zeroed)


@triton.jit
def _count(ptr, scalar, default, GIVEN: tl.constexpr):
    """A global count: GIVEN 0 -> the local ``default``, 1 -> the scalar, 2 -> a 0-d device tensor."""
    if GIVEN == 2:
        return tl.load(ptr).to(tl.float64)
    elif GIVEN == 1:
        return tl.full([], scalar, tl.float64)
    else:
        return default


@triton.jit
def _safe_div(num, den):
    """num / den with x / 0 := 0."""
    return tl.where(den == 0, 0.0, num / tl.where(den == 0, 1.0, den))


@triton.jit
def _column_sum(stats_ptr, B, column, BLOCK_B: tl.constexpr):
    total = tl.zeros([], tl.float64)
    for start in range(0, B, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B)
        total += tl.sum(tl.load(stats_ptr + rows * 8 + column, mask=rows < B, other=0.0), axis=0)
    return total


@triton.jit
def _policy_finalize_kernel(
    stats_ptr, B, loss_ptr, metrics_ptr, row_weights_ptr, dp, n_scalar, n_ptr, g_scalar, g_ptr, norm,
    kl_coef, value_coef, MODE: tl.constexpr, N_GIVEN: tl.constexpr, G_GIVEN: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """One program: the per-row weights w_b of the aggregation mode, the loss and
    the metrics from the per-row sums (see policy_finalize)."""
    f64 = tl.float64
    tokens = tl.zeros([], f64)
    sequences = tl.zeros([], f64)
    for start in range(0, B, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B)
        n = tl.load(stats_ptr + rows * 8, mask=rows < B, other=0.0)
        tokens += tl.sum(n, axis=0)
        sequences += tl.sum((n > 0).to(f64), axis=0)
    dp64 = tl.full([], dp, f64)
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
    for start in range(0, B, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B)
        in_batch = rows < B
        w = tl.zeros([BLOCK_B], f64) + base_weight
        if MODE == 3:  # seq-mean-token-mean: each sequence's token mean
            w = _safe_div(w, tl.load(stats_ptr + rows * 8, mask=in_batch, other=0.0))
        tl.store(row_weights_ptr + rows, w, mask=in_batch)
        pg += tl.sum(w * tl.load(stats_ptr + rows * 8 + 1, mask=in_batch, other=0.0), axis=0)
        kl += tl.sum(w * tl.load(stats_ptr + rows * 8 + 2, mask=in_batch, other=0.0), axis=0)
        values += tl.sum(w * tl.load(stats_ptr + rows * 8 + 3, mask=in_batch, other=0.0), axis=0)
    tl.store(loss_ptr, (pg + kl_coef * kl + value_coef * values).to(loss_ptr.dtype.element_ty))
    tl.store(metrics_ptr + 0, pg.to(tl.float32))
    tl.store(metrics_ptr + 1, kl.to(tl.float32))
    tl.store(metrics_ptr + 2, values.to(tl.float32))
    for k in tl.static_range(3):  # clipped, clipped_lower, ppo_kl: means over the valid tokens
        mean = _safe_div(_column_sum(stats_ptr, B, 4 + k, BLOCK_B), tokens)
        tl.store(metrics_ptr + 3 + k, mean.to(tl.float32))


@triton.jit
def _rollout_finalize_kernel(stats_ptr, B, metrics_ptr, SEQUENCE: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program: the rollout-correction metrics (see rollout_finalize)."""
    f64 = tl.float64
    tokens = tl.zeros([], f64)
    sequences = tl.zeros([], f64)  # rows with a valid token
    w_max = tl.full([], float("-inf"), f64)
    w_min = tl.full([], float("inf"), f64)
    for start in range(0, B, BLOCK_B):
        rows = start + tl.arange(0, BLOCK_B)
        n = tl.load(stats_ptr + rows * 8, mask=rows < B, other=0.0)
        tokens += tl.sum(n, axis=0)
        sequences += tl.sum((n > 0).to(f64), axis=0)
        w_max = tl.maximum(w_max, tl.max(tl.load(stats_ptr + rows * 8 + 3, mask=rows < B, other=float("-inf")), axis=0))
        w_min = tl.minimum(w_min, tl.min(tl.load(stats_ptr + rows * 8 + 4, mask=rows < B, other=float("inf")), axis=0))
    # veRL's sequence-level high / low fractions count sequences, not tokens.
    high_low_count = sequences if SEQUENCE else tokens
    mean = _safe_div(_column_sum(stats_ptr, B, 1, BLOCK_B), tokens)
    mean_sq = _safe_div(_column_sum(stats_ptr, B, 2, BLOCK_B), tokens)
    tl.store(metrics_ptr + 0, mean.to(tl.float32))
    tl.store(metrics_ptr + 1, tl.where(tokens > 0, w_max, 0.0).to(tl.float32))
    tl.store(metrics_ptr + 2, tl.where(tokens > 0, w_min, 0.0).to(tl.float32))
    tl.store(metrics_ptr + 3, tl.sqrt(tl.maximum(mean_sq - mean * mean, 0.0)).to(tl.float32))
    tl.store(metrics_ptr + 4, _safe_div(mean * mean, mean_sq).to(tl.float32))
    for k in tl.static_range(2):  # fractions high, low
        fraction = _safe_div(_column_sum(stats_ptr, B, 5 + k, BLOCK_B), high_low_count)
        tl.store(metrics_ptr + 5 + k, fraction.to(tl.float32))
    tl.store(metrics_ptr + 7, _safe_div(_column_sum(stats_ptr, B, 7, BLOCK_B), tokens).to(tl.float32))


_FINALIZE_BLOCK = 1024


def _count_args(value) -> tuple[torch.Tensor | None, float, int]:
    """(tensor, scalar, GIVEN) of a global count: None, a number or a 0-d float64 device tensor."""
    if value is None:
        return None, 0.0, 0
    if isinstance(value, torch.Tensor):
        return value, 0.0, 2
    return None, float(value), 1


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
    _policy_finalize_kernel[(1,)](
        stats, n_rows, loss, metrics, row_weights, float(dp_size), n_scalar, n_ptr, g_scalar, g_ptr, float(norm),
        kl_coef, value_coef, MODE=mode, N_GIVEN=n_given, G_GIVEN=g_given, BLOCK_B=_FINALIZE_BLOCK,
    )  # fmt: skip
    return loss, metrics, row_weights


def rollout_finalize(stats: torch.Tensor, *, sequence: bool) -> torch.Tensor:
    """Metrics float32 [8] = (mean, max, min, std, effective sample size, fraction
    high, fraction low, fraction masked) from rollout_correction_forward's stats.
    The high / low fractions are of the valid tokens, or with ``sequence`` of the
    rows with a valid token (each wrote 0 or 1 in those columns)."""
    metrics = torch.empty(8, dtype=torch.float32, device=stats.device)
    _rollout_finalize_kernel[(1,)](stats, stats.shape[0], metrics, SEQUENCE=sequence, BLOCK_B=_FINALIZE_BLOCK)
    return metrics


def _num_warps(block: int) -> int:
    return 8 if block >= 2048 else 4


def policy_forward(
    log_probs, old_log_probs, advantages, mask, weights, ref_log_probs, values,
    *, estimator: int, clip_low: float, clip_high: float, clip_c: float | None, sequence: bool, with_pg: bool,
) -> torch.Tensor:  # fmt: skip
    """Per-row float64 statistics [B, 8] (columns above) of [B, L] per-token inputs.
    ``estimator`` -1 skips the KL; None tensors skip their terms."""
    n_rows, length = log_probs.shape
    _, acc_tl = _acc_dtypes(log_probs)
    stats = torch.empty(n_rows, N_STATS, dtype=torch.float64, device=log_probs.device)
    block = _block(length)
    _policy_fwd_kernel[(n_rows,)](
        log_probs, old_log_probs, advantages, mask, weights, ref_log_probs, values, stats, length,
        clip_low, clip_high, 0.0 if clip_c is None else clip_c,
        ESTIMATOR=estimator, WITH_PG=with_pg, HAS_W=weights is not None, HAS_VALUES=values is not None,
        DUAL_CLIP=clip_c is not None, SEQUENCE=sequence, BLOCK_L=block, ACC=acc_tl, num_warps=_num_warps(block),
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
    _, acc_tl = _acc_dtypes(log_probs)
    block = _block(length)
    _policy_bwd_kernel[(n_rows,)](
        log_probs, old_log_probs, advantages, mask, weights, ref_log_probs, stats, row_weights, grad_loss,
        grad_logp, grad_values, length, clip_low, clip_high, 0.0 if clip_c is None else clip_c,
        kl_coef, value_coef,
        ESTIMATOR=estimator, STRAIGHT_THROUGH=straight_through, WITH_PG=with_pg, HAS_W=weights is not None,
        DUAL_CLIP=clip_c is not None, SEQUENCE=sequence, GRAD_LOGP=grad_logp is not None,
        GRAD_VALUES=grad_values is not None, BLOCK_L=block, ACC=acc_tl, num_warps=_num_warps(block),
    )  # fmt: skip


def rollout_correction_forward(
    old_log_probs, rollout_log_probs, mask,
    *, sequence: bool, truncate: bool, clip_min: float, clip_max: float, low_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(weights float32 [B, L], per-row float64 statistics [B, 8] (columns above))."""
    n_rows, length = old_log_probs.shape
    _, acc_tl = _acc_dtypes(old_log_probs)
    weights = torch.empty(n_rows, length, dtype=torch.float32, device=old_log_probs.device)
    stats = torch.empty(n_rows, N_STATS, dtype=torch.float64, device=old_log_probs.device)
    block = _block(length)
    _rollout_correction_kernel[(n_rows,)](
        old_log_probs, rollout_log_probs, mask, weights, stats, length, clip_min, clip_max, low_threshold,
        SEQUENCE=sequence, TRUNCATE=truncate, BLOCK_L=block, ACC=acc_tl, num_warps=_num_warps(block),
    )  # fmt: skip
    return weights, stats
