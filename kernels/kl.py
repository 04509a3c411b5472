"""KL between the policy and a reference policy: Triton kernels and launchers.

Sampled-token estimators (``kl_penalty``), elementwise on log-probs, with
d = logp - ref (J. Schulman, "Approximating KL divergence", 2020):

    code 0  "kl" / "k1"          v = d                       dv/dlogp = 1
    code 1  "abs"                v = |d|                     sign(d)
    code 2  "mse" / "k2"         v = d^2 / 2                 d
    code 3  "low_var_kl" / "k3"  v = clamp(e^c - c - 1, +-10),  c = clamp(-d, +-20)
                                 dv/dlogp = (1 - e^c) where neither clamp is active, else 0
                                 (e^c - c - 1 and e^c - 1 by _expm1_parts, accurate near c = 0)

A straight-through variant ("k3+") keeps the value and takes k2's gradient d.
The gradients are the ones autograd gives for fastrl.reference.kl_penalty
(a clamp passes its gradient on the closed interval).

Full-vocabulary KL (``full_kl``), per row of logits x and reference logits y at
inverse temperature inv_t = 1/T, read once each:

    d_v = (x_v - m) inv_t,  d'_v = (y_v - m') inv_t    (m, m' the row maxima)
    s = sum e^{d_v},  s' = sum e^{d'_v},  t = sum e^{d_v} ((x_v - m) - (y_v - m'))
    KL = sum p_v (log p_v - log q_v) = inv_t t / s - log s + log s'

Online over tiles, per lane (reduce.segment_stats' lanes, merged once after the
loop in the same way): when the logits' running max grows from m to M (c = (m - M) inv_t
<= 0, a = e^c) every e^{d_v} is scaled by a and every x_v - m grows by m - M;
when the reference max grows from m' to M' every y_v - m' grows by m' - M'. Hence
    s <- a s,   t <- a (t + (m - M - (m' - M')) s),   s' <- e^{c'} s'.
Taking the differences on the raw logits keeps KL ~ 0 accurate (no cancellation
of two entropies), and a token with e^{d_v} = 0 adds nothing (no 0 * inf).
t is in logit units, inv_t applied at the end: a reference masked with finfo.min
has (y_v - m') inv_t = -inf at T < 1 while the KL (e.g. 5e37 at T = 0.3) is a
float, and e^{d_v} (x_v - m - (y_v - m')) <= 3.4e38 still is.

Backward (reference logits constant), one read of each row and one write:
    dKL/dx_j = inv_t p_j (log p_j - log q_j - KL),   0 where p_j = 0
             = inv_t (inv_t (p_j r_j) - p_j (KL + log s - log s')),  r_j = (x_j - m) - (y_j - m')
in that order, for the same reason. A KL beyond the float range is +inf and
its gradient is not finite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrl._rows import row_count, row_layout

from ._launch import CONTRACTED, acc_dtypes, launch_config, row_inv_temperature, temperature_args, tile_config
from .reduce import lane_max, lane_tile, row_start, tile_offsets

# veRL's clamps of the k3 estimator: its log-ratio and its value.
K3_LOG_RATIO_CLAMP = tl.constexpr(20.0)
K3_VALUE_CLAMP = tl.constexpr(10.0)

_ELEMENTWISE_BLOCK = 1024


@triton.jit
def clamp_nan(x, lo, hi):
    """torch.clamp: x limited to [lo, hi], NaN kept."""
    return tl.where(x < lo, lo, tl.where(x > hi, hi, x))


@triton.jit
def _expm1_parts(c):
    """(e^c - 1, e^c - 1 - c), each to a few ulps for every c (csrc/kl.h, expm1_parts,
    gives the error analysis): for |c| <= 1, e^c - 1 - c = c^2/2 q(c) with the
    nested Taylor series q = 1 + c/3 (1 + c/4 (1 + ... (1 + c/top))), top = 10 in
    float32, 18 in float64, where e^c - c - 1 would cancel (error ~ eps / c^2); the
    direct forms beyond. The divisors are integers, exact in either precision."""
    small = tl.abs(c) <= 1.0
    x = tl.where(small, c, 0.0)
    q = tl.zeros_like(c) + 1.0
    if c.dtype == tl.float64:
        for n in tl.static_range(18, 2, -1):
            q = 1.0 + x * q / n
    else:
        for n in tl.static_range(10, 2, -1):
            q = 1.0 + x * q / n
    k_small = 0.5 * x * x * q
    em1 = tl.exp(c) - 1.0
    return tl.where(small, x + k_small, em1), tl.where(small, k_small, em1 - c)


@triton.jit
def kl_estimate(logp, ref, ESTIMATOR: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr):
    """(value, d value / d logp) of the KL estimator at each token (see the module docstring)."""
    d = logp - ref
    if ESTIMATOR == 0:
        value = d
        grad = tl.zeros_like(d) + 1.0
    elif ESTIMATOR == 1:
        value = tl.abs(d)
        grad = tl.where(d > 0, 1.0, tl.where(d < 0, -1.0, 0.0)).to(d.dtype)
    elif ESTIMATOR == 2:
        value = 0.5 * d * d
        grad = d
    else:
        c = clamp_nan(-d, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        em1, k = _expm1_parts(c)
        value = clamp_nan(k, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)
        active = (-d >= -K3_LOG_RATIO_CLAMP) & (-d <= K3_LOG_RATIO_CLAMP)
        active = active & (k >= -K3_VALUE_CLAMP) & (k <= K3_VALUE_CLAMP)
        grad = tl.where(active, -em1, 0.0).to(d.dtype)
    if STRAIGHT_THROUGH:
        grad = d
    return value, grad


@triton.jit
def _kl_penalty_fwd_kernel(logp_ptr, ref_ptr, out_ptr, N, ESTIMATOR: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    logp = tl.load(logp_ptr + offs, mask=mask, other=0.0)
    ref = tl.load(ref_ptr + offs, mask=mask, other=0.0)
    value, _ = kl_estimate(logp, ref, ESTIMATOR, False)
    tl.store(out_ptr + offs, value, mask=mask)


@triton.jit
def _kl_penalty_bwd_kernel(
    logp_ptr, ref_ptr, grad_ptr, out_ptr, N,
    ESTIMATOR: tl.constexpr, STRAIGHT_THROUGH: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    logp = tl.load(logp_ptr + offs, mask=mask, other=0.0)
    ref = tl.load(ref_ptr + offs, mask=mask, other=0.0)
    _, dvalue = kl_estimate(logp, ref, ESTIMATOR, STRAIGHT_THROUGH)
    tl.store(out_ptr + offs, tl.load(grad_ptr + offs, mask=mask, other=0.0) * dvalue, mask=mask)


def kl_penalty_forward(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, *, estimator: int) -> torch.Tensor:
    """The estimator's value per token of contiguous [N] acc-dtype log-probs."""
    out = torch.empty_like(log_probs)
    n = log_probs.numel()
    _kl_penalty_fwd_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](
        log_probs, ref_log_probs, out, n, ESTIMATOR=estimator, BLOCK=_ELEMENTWISE_BLOCK, **CONTRACTED
    )
    return out


def kl_penalty_backward(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, grad: torch.Tensor, *, estimator: int, straight_through: bool
) -> torch.Tensor:
    """grad * d estimator / d log_probs per token (the reference side's is its negative)."""
    out = torch.empty_like(log_probs)
    n = log_probs.numel()
    _kl_penalty_bwd_kernel[(triton.cdiv(n, _ELEMENTWISE_BLOCK),)](
        log_probs, ref_log_probs, grad, out, n,
        ESTIMATOR=estimator, STRAIGHT_THROUGH=straight_through, BLOCK=_ELEMENTWISE_BLOCK, **CONTRACTED,
    )  # fmt: skip
    return out


@triton.jit
def _full_kl_fwd_kernel(
    x_ptr, x_inner, x_outer_stride, x_inner_stride, y_ptr, y_inner, y_outer_stride, y_inner_stride,
    temps_ptr, temp_scalar, kl_ptr, stats_ptr, V,
    PER_ROW_TEMP: tl.constexpr, WITH_STATS: tl.constexpr, REPS: tl.constexpr, LANES: tl.constexpr,
    VEC: tl.constexpr, ALIGNED: tl.constexpr, MAX_IN_STORAGE_TYPE: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = row_start(x_ptr, row, x_inner, x_outer_stride, x_inner_stride)
    y_row = row_start(y_ptr, row, y_inner, y_outer_stride, y_inner_stride)
    if ALIGNED:  # both rows' tiles load 128 bits (_launch.tile_config)
        x_row = tl.multiple_of(x_row, 16)
        y_row = tl.multiple_of(y_row, 16)
    inv_t = row_inv_temperature(temps_ptr, temp_scalar, row, PER_ROW_TEMP, ACC)
    k = inv_t * 1.4426950408889634
    neg_inf = float("-inf")
    # Per-lane sums (reduce.segment_stats' tiles: no reduction across threads in the
    # loop), merged once after it.
    m = tl.full([LANES], neg_inf, ACC)
    m_ref = tl.full([LANES], neg_inf, ACC)
    s = tl.zeros([LANES], ACC)
    s_ref = tl.zeros([LANES], ACC)
    t = tl.zeros([LANES], tl.float64)
    lane_offs, rep_offs = tile_offsets(REPS, LANES, VEC)
    tile = REPS * LANES * VEC
    whole = V - V % tile
    for start in range(0, whole, tile):
        x = lane_tile(tl.load((x_row + start + lane_offs) + rep_offs), LANES, VEC)
        y = lane_tile(tl.load((y_row + start + lane_offs) + rep_offs), LANES, VEC)
        m, m_ref, s, s_ref, t = _full_kl_tile(x, y, m, m_ref, s, s_ref, t, k, MAX_IN_STORAGE_TYPE)
    if whole < V:
        offs = whole + lane_offs + rep_offs
        x = lane_tile(tl.load(x_row + offs, mask=offs < V, other=neg_inf), LANES, VEC)
        y = lane_tile(tl.load(y_row + offs, mask=offs < V, other=neg_inf), LANES, VEC)
        m, m_ref, s, s_ref, t = _full_kl_tile(x, y, m, m_ref, s, s_ref, t, k, MAX_IN_STORAGE_TYPE)
    # The merge: every lane's sums moved to the row maxima, as a tile moves them.
    row_max = tl.max(m, axis=0)
    row_max_ref = tl.max(m_ref, axis=0)
    _, shift, a = _move_to(m, row_max, k)
    _, shift_ref, a_ref = _move_to(m_ref, row_max_ref, k)
    s64 = s.to(tl.float64)
    a64 = a.to(tl.float64)
    t = tl.where(a == 0, 0.0, a64 * (t + shift.to(tl.float64) * s64))
    s64 = a64 * s64
    t = tl.where(s64 == 0, t, t - shift_ref.to(tl.float64) * s64)
    s_row = tl.sum(s64, axis=0)
    t_row = tl.sum(t, axis=0)
    s_ref_row = tl.sum(a_ref.to(tl.float64) * s_ref.to(tl.float64), axis=0)
    log_s = tl.log(s_row)
    log_s_ref = tl.log(s_ref_row)
    tl.store(kl_ptr + row, (inv_t.to(tl.float64) * t_row / s_row - log_s + log_s_ref).to(ACC))
    if WITH_STATS:
        tl.store(stats_ptr + 4 * row, row_max)
        tl.store(stats_ptr + 4 * row + 1, log_s.to(ACC))
        tl.store(stats_ptr + 4 * row + 2, row_max_ref)
        tl.store(stats_ptr + 4 * row + 3, log_s_ref.to(ACC))


@triton.jit
def _move_to(m, m_new, k):
    """A running max m (per lane) meeting m_new >= m: (ref, shift, a) with ref the
    new reference point (m_new, or 0 while it is -inf, so no -inf - -inf), shift =
    m - ref the old terms' move in logit units and a = 2^(shift k) their scale;
    shift and a are 0 while m is -inf (nothing to move), and a is 0 when the max
    rose beyond the float range (shift -inf)."""
    neg_inf = float("-inf")
    ref = tl.where(m_new == neg_inf, 0.0, m_new)
    shift = tl.where(m == neg_inf, 0.0, m - ref)
    a = tl.where(m == neg_inf, 0.0, tl.exp2(shift * k))
    return ref, shift, a


@triton.jit
def _full_kl_tile(x, y, m, m_ref, s, s_ref, t, k, MAX_IN_STORAGE_TYPE: tl.constexpr):
    """Each lane's sums (module docstring) after its elements of one tile of the
    logits x and the reference y ([REPS, LANES, VEC], their own dtype)."""
    ACC = m.dtype
    m_new = tl.maximum(m, lane_max(x, ACC, MAX_IN_STORAGE_TYPE))
    m_ref_new = tl.maximum(m_ref, lane_max(y, ACC, MAX_IN_STORAGE_TYPE))
    ref, shift, a = _move_to(m, m_new, k)
    ref_y, shift_ref, a_ref = _move_to(m_ref, m_ref_new, k)
    dx = x.to(ACC) - ref[None, :, None]
    dy = y.to(ACC) - ref_y[None, :, None]
    e = tl.exp2(dx * k)
    # A token with e = 0 adds nothing (never 0 * inf). The terms are summed in
    # float64: where the reference masks with finfo.min, they reach 3e38 and a
    # float32 sum of a few of them overflows.
    term = tl.where(e > 0, e * (dx - dy), 0.0).to(tl.float64)
    # t' = a (t + shift s) - shift_ref a s: the x shift first, then the reference's
    # (with no term summed yet, s = 0 adds nothing).
    t = tl.where(a == 0, 0.0, a.to(tl.float64) * (t + shift.to(tl.float64) * s.to(tl.float64)))
    s = a * s
    t = tl.where(s == 0, t, t - shift_ref.to(tl.float64) * s.to(tl.float64))
    t += tl.sum(tl.sum(term, axis=2), axis=0)
    s += tl.sum(tl.sum(e, axis=2), axis=0)
    s_ref = a_ref * s_ref + tl.sum(tl.sum(tl.exp2(dy * k), axis=2), axis=0)
    return m_new, m_ref_new, s, s_ref, t


@triton.jit
def _full_kl_bwd_kernel(
    x_ptr, x_inner, x_outer_stride, x_inner_stride, y_ptr, y_inner, y_outer_stride, y_inner_stride,
    grad_ptr, grad_inner, grad_outer_stride, grad_inner_stride, temps_ptr, temp_scalar,
    stats_ptr, kl_ptr, grad_kl_ptr, V,
    PER_ROW_TEMP: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = row_start(x_ptr, row, x_inner, x_outer_stride, x_inner_stride)
    y_row = row_start(y_ptr, row, y_inner, y_outer_stride, y_inner_stride)
    grad_row = row_start(grad_ptr, row, grad_inner, grad_outer_stride, grad_inner_stride)
    inv_t = row_inv_temperature(temps_ptr, temp_scalar, row, PER_ROW_TEMP, ACC)
    m = tl.load(stats_ptr + 4 * row).to(ACC)
    log_s = tl.load(stats_ptr + 4 * row + 1).to(ACC)
    m_ref = tl.load(stats_ptr + 4 * row + 2).to(ACC)
    log_s_ref = tl.load(stats_ptr + 4 * row + 3).to(ACC)
    kl = tl.load(kl_ptr + row).to(ACC)
    scale = tl.load(grad_kl_ptr + row).to(ACC) * inv_t
    offset = kl + log_s - log_s_ref
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(ACC)
        y = tl.load(y_row + offs, mask=mask, other=0.0).to(ACC)
        dx = x - m
        p = tl.exp(dx * inv_t - log_s)
        r = dx - (y - m_ref)
        grad = tl.where(p > 0, inv_t * (p * r) - p * offset, 0.0) * scale
        tl.store(grad_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def full_kl_forward(
    logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float | torch.Tensor, *, with_stats: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(KL [N], stats [N, 4] or None) of the N rows of ``logits`` and ``ref_logits``
    (same dtype, unit stride in V; each [N, V] or its own [outer, inner, V] view of
    the rows); stats = (m, log s, m', log s') per row."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    acc, acc_tl = acc_dtypes(logits)
    kl = torch.empty(n_rows, dtype=acc, device=logits.device)
    stats = torch.empty(n_rows, 4, dtype=acc, device=logits.device) if with_stats else None
    temps, temp_scalar, per_row = temperature_args(temperature)
    _full_kl_fwd_kernel[(n_rows,)](
        logits, *row_layout(logits), ref_logits, *row_layout(ref_logits), temps, temp_scalar, kl, stats, vocab,
        PER_ROW_TEMP=per_row, WITH_STATS=with_stats, ACC=acc_tl, **tile_config(logits, ref_logits), **CONTRACTED,
    )  # fmt: skip
    return kl, stats


def full_kl_backward(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: float | torch.Tensor,
    stats: torch.Tensor,
    kl: torch.Tensor,
    grad_kl: torch.Tensor,
    grad_out: torch.Tensor,
) -> None:
    """Writes dL/dlogits into ``grad_out`` [N, V] (logits' dtype; may be the logits)."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    _, acc_tl = acc_dtypes(logits)
    temps, temp_scalar, per_row = temperature_args(temperature)
    block, num_warps = launch_config(vocab)
    _full_kl_bwd_kernel[(n_rows,)](
        logits, *row_layout(logits), ref_logits, *row_layout(ref_logits), grad_out, *row_layout(grad_out),
        temps, temp_scalar, stats, kl, grad_kl, vocab,
        PER_ROW_TEMP=per_row, BLOCK_V=block, ACC=acc_tl, num_warps=num_warps, **CONTRACTED,
    )  # fmt: skip
