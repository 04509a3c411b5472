"""Log-probs and entropy of chosen tokens: Triton kernels and their launchers.

One program per row of logits (so a row's result never depends on the batch),
in fp32 (fp64 for float64 logits), never on a scaled copy of the logits.

Forward, one read of the row (``reduce.segment_stats`` gives m, s = n + t and w;
log s is ``reduce.log_sum(n, t)``):
    logprob = (x[label] - m) / T - log s    (0 for ignore_index, NaN for a label outside [0, V))
    entropy = log s - w / s
    sum_pi_squared = sum_j p_j^2 = (n + q) / s^2    (q: segment_stats' WITH_Q, when asked for)
and, when a gradient will be needed, the row's (m, log s) are saved. The row is
reduced as segments (fastrl._rows.segment_length: V / 8 when V is a multiple of
64), each by segment_stats from its own first element, their statistics folded
left to right (reduce.fold_segment). A rank holding a vocabulary shard of such
rows (1, 2, 4 or 8 ranks) holds whole segments: it reduces them with the same
tile (_logprobs_segments_kernel), the ranks gather every segment's
statistics, and _logprobs_combine_kernel folds them in vocabulary order and
finishes the row with the same code (_finish_row), so the sharded results are
bitwise the unsharded ones (fastrl._sharded.logprobs).

Backward, one read and one write, with g = dL/dlogprob and h = dL/dentropy:
    dL/dx_j = (1/T) (g ([j == label] - p_j) - h p_j (log p_j + entropy)),
    log p_j = (x_j - m) / T - log s,
where a term with p_j = 0 (a -inf logit, or (x_j - m) / T beyond the float
range) contributes 0, and a row with g = h = 0 (a padding row) gets +0 whatever
its logits (NaN, +-inf: 0 * NaN would reach every weight the gradient does).
The entropy term is compiled out
when entropy's gradient is not needed. The gradient may be written over the
logits (inplace_backward): each block is loaded before it is stored.

The backward is elementwise given the row's (m, log s, entropy), so it also runs
on a block of columns of the rows (the fused LM head's vocabulary slabs): the
columns are [label_base, label_base + V) of rows of label_vocab entries; a label
is valid in [0, label_vocab) and its [j == label] term lands on column
label - label_base when that lies in the block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fastrl._rows import forward_outputs, row_count, row_layout

from ._launch import (
    CONTRACTED,
    acc_dtypes,
    backward_launch_config,
    row_inv_temperature,
    rows_aligned,
    same_row_alignment,
    segment_config,
    temperature_args,
    triton_acc,
)
from .reduce import aligned_body, fold_segments, log_sum, row_start, segment_stats

# A register cap (maxnreg) that keeps the long rows' backward at the occupancy
# it was tuned for under every Triton our users run: a row kernel is
# memory-bound only while enough CTAs share an SM to cover its loads'
# latency, and the registers a Triton's schedule takes decide how many fit.
# 16 warps a CTA: 64 registers fit 2 CTAs; under triton 3.7.1 the entropy
# variant took 87, so 1 (sm_90 model, H100, logprobs+entropy bwd
# 16384x151936 bf16: 79% -> 94% of copy bandwidth). The cap is for 16-bit
# logits, what trainers hand over; float64's accumulators take two registers
# each. (The forward's entropy variant takes 59-61 registers under triton
# 3.8 / 3.9, 4 CTAs of 8 warps where 48 would fit 5: capped at 48 it predicted
# 94% against 91-92% on an H100, but its SASS per element rose under 3.9 past
# the compile gate's issue / memory budget at 8192x128256, and the log-prob
# forward's fell below what the sampler's budget is measured against: left
# uncapped until that trade is measured on a GPU.)
_BACKWARD_MAXNREG = {16: 64}


def _register_cap(caps: dict[int, int], num_warps: int, logits: torch.Tensor) -> int | None:
    """The launch's maxnreg: the cap for its CTA's warps, for 16-bit logits."""
    return caps.get(num_warps) if logits.element_size() == 2 else None


@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr, inner, outer_stride, inner_stride, labels_ptr, temps_ptr, temp_scalar, ignore_index,
    logprob_ptr, entropy_ptr, stats_ptr, sum_pi_squared_ptr, V, SEG,
    HAS_LABELS: tl.constexpr, PER_ROW_TEMP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    WITH_STATS: tl.constexpr, WITH_SUM_PI_SQUARED: tl.constexpr, REPS: tl.constexpr, SEGS: tl.constexpr,
    REAL: tl.constexpr, SEG_LANES: tl.constexpr, VEC: tl.constexpr, ALIGNED: tl.constexpr,
    MAX_IN_STORAGE_TYPE: tl.constexpr, ACC: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    inv_t = row_inv_temperature(temps_ptr, temp_scalar, row, PER_ROW_TEMP, ACC)
    # The row's SEGS segments of SEG logits (fastrl._rows.segment_length), folded left to right.
    tl.static_assert(SEGS == REAL, "the whole row fills its slots")
    m, n, t, w, q = fold_segments(*segment_stats(row_ptr, V, SEG, inv_t, WITH_ENTROPY, WITH_SUM_PI_SQUARED, REPS,
                                                 SEGS, REAL, SEG_LANES, VEC, ALIGNED, MAX_IN_STORAGE_TYPE, ACC, TILES),
                                  inv_t, WITH_ENTROPY, WITH_SUM_PI_SQUARED)  # fmt: skip
    label, in_range = _row_label(labels_ptr, row, V, HAS_LABELS)
    x_label = tl.load(row_ptr + label, mask=in_range, other=0.0).to(ACC)
    _finish_row(row, m, n, t, w, q, inv_t, x_label, label, in_range, ignore_index, logprob_ptr, entropy_ptr,
                stats_ptr, sum_pi_squared_ptr, HAS_LABELS, WITH_ENTROPY, WITH_STATS, WITH_SUM_PI_SQUARED, ACC)  # fmt: skip


@triton.jit
def _row_label(labels_ptr, row, V, HAS_LABELS: tl.constexpr):
    """(label, whether it is in [0, V)) of a row; (0, False) without labels."""
    label = tl.zeros([], tl.int64)
    in_range = label != 0
    if HAS_LABELS:
        label = tl.load(labels_ptr + row).to(tl.int64)
        in_range = (label >= 0) & (label < V)
    return label, in_range


@triton.jit
def _finish_row(row, m, n, t, w, q, inv_t, x_label, label, in_range, ignore_index, logprob_ptr, entropy_ptr,
                stats_ptr, sum_pi_squared_ptr, HAS_LABELS: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                WITH_STATS: tl.constexpr, WITH_SUM_PI_SQUARED: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """Stores a row's outputs (module docstring) from its folded statistics (w in
    base-2 units) and its label's logit x_label: one code for the whole row and
    for the ranks' gathered segments (_logprobs_combine_kernel)."""
    log_s_exact = log_sum(n, t)  # float64, as n, t and w are (reduce.py)
    log_s = log_s_exact.to(ACC)
    if WITH_SUM_PI_SQUARED:
        s = n + t
        tl.store(sum_pi_squared_ptr + row, ((n + q) / (s * s)).to(ACC))
    if WITH_STATS:
        tl.store(stats_ptr + 2 * row, m)
        tl.store(stats_ptr + 2 * row + 1, log_s)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, (log_s_exact - (w * 0.6931471805599453) / (n + t)).to(ACC))
    if HAS_LABELS:
        logprob = (x_label - m) * inv_t - log_s
        logprob = tl.where(in_range, logprob, float("nan"))
        logprob = tl.where(label == ignore_index, 0.0, logprob)
        tl.store(logprob_ptr + row, logprob)


@triton.jit
def _logprobs_segments_kernel(
    logits_ptr, inner, outer_stride, inner_stride, temps_ptr, temp_scalar, segments_ptr, V, SEG,
    PER_ROW_TEMP: tl.constexpr, WITH_ENTROPY: tl.constexpr, WITH_SUM_PI_SQUARED: tl.constexpr, REPS: tl.constexpr,
    SEGS: tl.constexpr, REAL: tl.constexpr, SEG_LANES: tl.constexpr, VEC: tl.constexpr, ALIGNED: tl.constexpr,
    MAX_IN_STORAGE_TYPE: tl.constexpr, ACC: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """Each of a shard's rows' REAL segments' (m, n, t, w, q), in float64, unfolded."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    inv_t = row_inv_temperature(temps_ptr, temp_scalar, row, PER_ROW_TEMP, ACC)
    m, n, t, w, q = segment_stats(row_ptr, V, SEG, inv_t, WITH_ENTROPY, WITH_SUM_PI_SQUARED, REPS, SEGS, REAL,
                                  SEG_LANES, VEC, ALIGNED, MAX_IN_STORAGE_TYPE, ACC, TILES)  # fmt: skip
    slot = tl.arange(0, SEGS)
    real = slot < REAL
    out = segments_ptr + (row * REAL + slot) * 5
    tl.store(out, m.to(tl.float64), mask=real)
    tl.store(out + 1, n, mask=real)
    tl.store(out + 2, t, mask=real)
    tl.store(out + 3, w, mask=real)
    tl.store(out + 4, q, mask=real)


@triton.jit
def _logprobs_combine_kernel(
    segments_ptr, NSEG, label_logits_ptr, labels_ptr, temps_ptr, temp_scalar, ignore_index,
    logprob_ptr, entropy_ptr, stats_ptr, sum_pi_squared_ptr, V,
    HAS_LABELS: tl.constexpr, PER_ROW_TEMP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    WITH_STATS: tl.constexpr, WITH_SUM_PI_SQUARED: tl.constexpr, SEGS: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """A row's outputs from its NSEG (at most SEGS, a power of 2) segments'
    statistics in vocabulary order (_logprobs_segments_kernel's, gathered from
    the ranks) and its label's logit: the fold (reduce.fold_segments) and the
    finish of _logprobs_fwd_kernel, so the same bits. Missing segments are
    empty ones (m = -inf, sums 0)."""
    row = tl.program_id(0).to(tl.int64)
    inv_t = row_inv_temperature(temps_ptr, temp_scalar, row, PER_ROW_TEMP, ACC)
    index = tl.arange(0, SEGS)
    here = index < NSEG
    seg = segments_ptr + (row * NSEG + index) * 5
    m, n, t, w, q = fold_segments(tl.load(seg, mask=here, other=float("-inf")).to(ACC),
                                  tl.load(seg + 1, mask=here, other=0.0), tl.load(seg + 2, mask=here, other=0.0),
                                  tl.load(seg + 3, mask=here, other=0.0), tl.load(seg + 4, mask=here, other=0.0),
                                  inv_t, WITH_ENTROPY, WITH_SUM_PI_SQUARED)  # fmt: skip
    label, in_range = _row_label(labels_ptr, row, V, HAS_LABELS)
    x_label = tl.zeros([], ACC)
    if HAS_LABELS:
        x_label = tl.load(label_logits_ptr + row, mask=in_range, other=0.0)
    _finish_row(row, m, n, t, w, q, inv_t, x_label, label, in_range, ignore_index, logprob_ptr, entropy_ptr,
                stats_ptr, sum_pi_squared_ptr, HAS_LABELS, WITH_ENTROPY, WITH_STATS, WITH_SUM_PI_SQUARED, ACC)  # fmt: skip


@triton.jit
def _logprobs_bwd_kernel(
    logits_ptr, inner, outer_stride, inner_stride, grad_ptr, grad_inner, grad_outer_stride, grad_inner_stride,
    labels_ptr, temps_ptr, temp_scalar,
    ignore_index, stats_ptr, entropy_ptr, grad_logprob_ptr, grad_entropy_ptr, V, label_base, label_vocab,
    HAS_GRAD_LOGPROB: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr, PER_ROW_TEMP: tl.constexpr,
    ALIGN_BODY: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    grad_row_ptr = row_start(grad_ptr, row, grad_inner, grad_outer_stride, grad_inner_stride)
    inv_t = row_inv_temperature(temps_ptr, temp_scalar, row, PER_ROW_TEMP, ACC)
    m = tl.load(stats_ptr + 2 * row).to(ACC)
    log_s = tl.load(stats_ptr + 2 * row + 1).to(ACC)
    g = tl.zeros([], ACC)
    label = tl.full([], -1, tl.int64)
    if HAS_GRAD_LOGPROB:
        label = tl.load(labels_ptr + row).to(tl.int64)
        ignored = label == ignore_index
        in_range = (label >= 0) & (label < label_vocab)
        # A label outside [0, label_vocab) made the forward NaN; its gradient is NaN too.
        g = tl.where(in_range, tl.load(grad_logprob_ptr + row).to(ACC), float("nan"))
        g = tl.where(ignored, 0.0, g).to(ACC)
        label = tl.where(in_range & ~ignored, label - label_base, -1)  # -1: no column of the block
    h = tl.zeros([], ACC)
    entropy = tl.zeros([], ACC)
    if HAS_GRAD_ENTROPY:
        h = tl.load(grad_entropy_ptr + row).to(ACC)
        entropy = tl.load(entropy_ptr + row).to(ACC)
    offs = tl.arange(0, BLOCK_V)
    if (g == 0) & (h == 0):
        # A row no gradient flows into (a padding row) gets +0 whatever its logits,
        # NaN or only -inf among them, which it does not read (csrc/logprobs.cpp).
        zeros = tl.zeros([BLOCK_V], grad_ptr.dtype.element_ty)
        for start in range(0, V, BLOCK_V):
            tl.store(grad_row_ptr + start + offs, zeros, mask=start + offs < V)
    else:
        _logprobs_grad_row(row_ptr, grad_row_ptr, V, m, log_s, inv_t, g, h, entropy, label, offs, ALIGN_BODY,
                           HAS_GRAD_ENTROPY, BLOCK_V, ACC)  # fmt: skip


@triton.jit
def _logprobs_grad_row(row_ptr, grad_row_ptr, V, m, log_s, inv_t, g, h, entropy, label, offs, ALIGN_BODY: tl.constexpr,
                       HAS_GRAD_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr):  # fmt: skip
    """The gradient of a row a gradient flows into (_logprobs_bwd_kernel): one read
    of the row and one write."""
    # Whole blocks unmasked, from the rows' first 16-byte boundary when they start
    # off it at the same place in the logits and the gradient (reduce.aligned_body),
    # then the partial block (masked, still 128-bit) and the head before it.
    if ALIGN_BODY:
        head, x_body, rest = aligned_body(row_ptr, V)
        grad_body = tl.multiple_of(grad_row_ptr + head, 16)
    else:
        head, x_body, grad_body, rest = 0, row_ptr, grad_row_ptr, V
    whole = rest - rest % BLOCK_V
    for start in range(0, whole, BLOCK_V):
        x = tl.load(x_body + start + offs).to(ACC)
        grad = _logprobs_grad(x, head + start + offs, m, log_s, inv_t, g, h, entropy, label, HAS_GRAD_ENTROPY)
        tl.store(grad_body + start + offs, grad.to(grad_row_ptr.dtype.element_ty))
    if whole < rest:
        in_row = whole + offs < rest
        x = tl.load(x_body + whole + offs, mask=in_row, other=0.0).to(ACC)
        grad = _logprobs_grad(x, head + whole + offs, m, log_s, inv_t, g, h, entropy, label, HAS_GRAD_ENTROPY)
        tl.store(grad_body + whole + offs, grad.to(grad_row_ptr.dtype.element_ty), mask=in_row)
    if ALIGN_BODY and head > 0:  # under 16 bytes
        first = tl.arange(0, 16)
        x = tl.load(row_ptr + first, mask=first < head, other=0.0).to(ACC)
        grad = _logprobs_grad(x, first, m, log_s, inv_t, g, h, entropy, label, HAS_GRAD_ENTROPY)
        tl.store(grad_row_ptr + first, grad.to(grad_row_ptr.dtype.element_ty), mask=first < head)


@triton.jit
def _logprobs_grad(x, index, m, log_s, inv_t, g, h, entropy, label, HAS_GRAD_ENTROPY: tl.constexpr):
    """dL/dx at the elements ``index`` of a row whose logits are x (module docstring)."""
    logp = (x - m) * inv_t - log_s
    p = tl.exp(logp)
    grad = -g * p
    if HAS_GRAD_ENTROPY:
        # p = 0 adds nothing; logp may be -inf there, also for a finite logit whose
        # (x - m) / T overflowed, so the term is tested, not the logit (no 0 * -inf).
        logp_finite = tl.where(p == 0, 0.0, logp)
        grad -= h * p * (logp_finite + entropy)
    grad = tl.where(index == label, grad + g, grad)
    return grad * inv_t


def logprobs_forward(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: float | torch.Tensor,
    ignore_index: int,
    *,
    with_entropy: bool,
    with_stats: bool,
    with_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(log-prob of the label [N], entropy [N], stats [N, 2], sum of the squared
    probabilities [N]) of the N rows of ``logits`` [N, V] or [outer, inner, V]
    (unit stride in V, any leading strides: ``row_layout``), stats being each
    row's (max logit, log s) that the backward needs; an output not asked for is None."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    acc, acc_tl = acc_dtypes(logits)
    logprob, entropy, stats, sum_pi_squared = forward_outputs(n_rows, acc, logits.device, labels is not None,
                                                              with_entropy, with_stats, with_sum_pi_squared)
    temps, temp_scalar, per_row = temperature_args(temperature)
    segment, config = segment_config(logits, vocab)
    _logprobs_fwd_kernel[(n_rows,)](
        logits, *row_layout(logits), labels, temps, temp_scalar, ignore_index,
        logprob, entropy, stats, sum_pi_squared, vocab, segment,
        HAS_LABELS=labels is not None, PER_ROW_TEMP=per_row, WITH_ENTROPY=with_entropy,
        WITH_STATS=with_stats, WITH_SUM_PI_SQUARED=with_sum_pi_squared, ACC=acc_tl, **config, **CONTRACTED,
    )  # fmt: skip
    return logprob, entropy, stats, sum_pi_squared


def logprobs_segments(
    logits: torch.Tensor,
    temperature: float | torch.Tensor,
    *,
    with_entropy: bool,
    with_sum_pi_squared: bool,
    segment: int,
    vocab: int,
) -> torch.Tensor:
    """[N, G, 5] float64: the (m, n, t, w, q) of each of the G = V_r / ``segment``
    segments of the N rows of ``logits`` [N, V_r] or [outer, inner, V_r] (a
    shard of rows of ``vocab`` logits; ``segment`` divides V_r), reduced as
    logprobs_forward reduces a row of ``vocab`` (its tile): w in base-2 units,
    0 unless ``with_entropy``; q 0 unless ``with_sum_pi_squared``."""
    n_rows, local = row_count(logits), logits.shape[-1]
    _, acc_tl = acc_dtypes(logits)
    segment, config = segment_config(logits, vocab, segment)
    segments = torch.empty(n_rows, config["REAL"], 5, dtype=torch.float64, device=logits.device)
    temps, temp_scalar, per_row = temperature_args(temperature)
    _logprobs_segments_kernel[(n_rows,)](
        logits, *row_layout(logits), temps, temp_scalar, segments, local, segment,
        PER_ROW_TEMP=per_row, WITH_ENTROPY=with_entropy, WITH_SUM_PI_SQUARED=with_sum_pi_squared, ACC=acc_tl,
        **config, **CONTRACTED,
    )  # fmt: skip
    return segments


def logprobs_combine(
    segments: torch.Tensor,
    label_logits: torch.Tensor | None,
    labels: torch.Tensor | None,
    temperature: float | torch.Tensor,
    ignore_index: int,
    *,
    with_entropy: bool,
    with_stats: bool,
    with_sum_pi_squared: bool,
    vocab: int,
    acc: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """logprobs_forward's outputs (in ``acc``) from the rows' segments [N, G, 5]
    (logprobs_segments', gathered from the ranks, in vocabulary order) and each
    row's label logit [N] (``acc``; labels in [0, ``vocab``))."""
    n_rows = segments.shape[0]
    logprob, entropy, stats, sum_pi_squared = forward_outputs(n_rows, acc, segments.device, labels is not None,
                                                              with_entropy, with_stats, with_sum_pi_squared)
    temps, temp_scalar, per_row = temperature_args(temperature)
    _logprobs_combine_kernel[(n_rows,)](
        segments, segments.shape[1], label_logits, labels, temps, temp_scalar, ignore_index,
        logprob, entropy, stats, sum_pi_squared, vocab,
        HAS_LABELS=labels is not None, PER_ROW_TEMP=per_row, WITH_ENTROPY=with_entropy,
        WITH_STATS=with_stats, WITH_SUM_PI_SQUARED=with_sum_pi_squared, SEGS=triton.next_power_of_2(max(segments.shape[1], 1)),
        ACC=triton_acc(acc), num_warps=1,
        **CONTRACTED,
    )  # fmt: skip
    return logprob, entropy, stats, sum_pi_squared


def logprobs_backward(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: float | torch.Tensor,
    ignore_index: int,
    stats: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    grad_out: torch.Tensor,
    label_base: int = 0,
    label_vocab: int | None = None,
) -> None:
    """Writes dL/dlogits into ``grad_out`` (logits' dtype, its own [outer', inner', V]
    layout of the same rows; it may be the logits themselves). A None
    incoming gradient counts as zero and skips its term. ``label_base`` /
    ``label_vocab`` (default 0 / V): the rows are columns [label_base,
    label_base + V) of rows of label_vocab entries (module docstring)."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    label_vocab = vocab if label_vocab is None else label_vocab
    _, acc_tl = acc_dtypes(logits)
    temps, temp_scalar, per_row = temperature_args(temperature)
    block, num_warps = backward_launch_config(vocab)
    _logprobs_bwd_kernel[(n_rows,)](
        logits, *row_layout(logits), grad_out, *row_layout(grad_out), labels, temps, temp_scalar,
        ignore_index, stats, entropy, grad_logprob, grad_entropy, vocab, label_base, label_vocab,
        HAS_GRAD_LOGPROB=grad_logprob is not None, HAS_GRAD_ENTROPY=grad_entropy is not None,
        PER_ROW_TEMP=per_row, ALIGN_BODY=not rows_aligned(logits) and same_row_alignment(logits, grad_out),
        BLOCK_V=block, ACC=acc_tl, num_warps=num_warps, **CONTRACTED,
        maxnreg=_register_cap(_BACKWARD_MAXNREG, num_warps, logits),
    )  # fmt: skip
