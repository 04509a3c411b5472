"""Log-probs and entropy of chosen tokens: Triton kernels and their launchers.

One program per row of logits (so a row's result never depends on the batch),
in fp32 (fp64 for float64 logits), never on a scaled copy of the logits.

Forward, one read of the row (``reduce.softmax_stats`` gives m, s = n + t and w;
log s is ``reduce.log_sum(n, t)``):
    logprob = (x[label] - m) / T - log s    (0 for ignore_index, NaN for a label outside [0, V))
    entropy = log s - w / s
and, when a gradient will be needed, the row's (m, log s) are saved.

Backward, one read and one write, with g = dL/dlogprob and h = dL/dentropy:
    dL/dx_j = (1/T) (g ([j == label] - p_j) - h p_j (log p_j + entropy)),
    log p_j = (x_j - m) / T - log s,
where a term with p_j = 0 (a -inf logit, or (x_j - m) / T beyond the float
range) contributes 0. The entropy term is compiled out
when entropy's gradient is not needed. The gradient may be written over the
logits (inplace_backward): each block is loaded before it is stored.

The backward is elementwise given the row's (m, log s, entropy), so it also runs
on a block of columns of the rows (the fused LM head's vocabulary slabs): the
columns are [label_base, label_base + V) of rows of label_vocab entries; a label
is valid in [0, label_vocab) and its [j == label] term lands on column
label - label_base when that lies in the block.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from fastrl._rows import row_count, row_layout

from .reduce import aligned_body, log_sum, row_start, softmax_stats

# Elements of a row handled per loop iteration. It depends on V only, never on
# the number of rows, which keeps results batch invariant.
_MAX_BLOCK_V = 8192
# Rows of at most this many elements (Llama-2's 32000, GPT-2's 50257) are short:
# at most 8 iterations of the largest block, so what a program spends outside
# its loop (the lanes' merge, the partial tile, its start) weighs on the row.
# Their programs take half the block and half the warps, so that twice as many
# share an SM and one's epilogue overlaps another's stream (sm_90 model, H100:
# logprobs fwd bf16 V = 50257 88% -> 94% of copy bandwidth, fwd+bwd 85% -> 93%;
# logprobs+entropy fwd fp32 V = 32000 91% -> 94%).
_SHORT_ROW = 65536
# Elements each thread of the forward handles per iteration (REPS x VEC: REPS
# 128-bit loads on aligned rows, 16 one-element loads on others).
_THREAD_ELEMS = 16
# Warps per row of the forward: with no reduction across threads in its loop, a
# CTA's warps need not be many; at 8 a CTA's merge and partial tile after the
# loop cost the SM less than at 16 (sm_90 model: logprobs+entropy fwd, bf16
# V = 151936, 89% -> 93% of copy bandwidth; 4 warps would predict 97% but leave
# a small batch of long rows with a quarter of the threads per row).
_FORWARD_MAX_WARPS = 8
# Every launch names its floating-point contraction (triton 3.9 warns when it is
# left to the default, which triton 3.10 turns off). These kernels contract
# a * b + c into one rounding (FFMA), as they were benchmarked; their tests bound
# the error either way. The sampler's forward compiles without (sampling._EXACT).
CONTRACTED = {"enable_fp_fusion": True}


def _launch_config(vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of ``vocab`` logits."""
    block = min(triton.next_power_of_2(vocab), _MAX_BLOCK_V if vocab > _SHORT_ROW else _MAX_BLOCK_V // 2)
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


def tile_config(*rows: torch.Tensor, num_warps: int | None = None) -> dict:
    """The forward's tile (reduce.tile_offsets) over the rows of one or more
    [.., V] tensors read together (same dtype), and its num_warps.

    When every row of every tensor starts on a 16-byte boundary (ALIGNED), a lane
    holds VEC contiguous elements (one 128-bit load), REPS times a tile. Otherwise
    (V = 50257 bf16: the rows of a contiguous batch start at every even byte) a
    lane holds one element, REPS = 16 times a tile, LANES apart: its loads are
    scalar but coalesced across a warp, and its sums stay inside its thread.
    Tiles count from each row's first element and the partition is a function of
    the launch (V, dtype, whether the rows are aligned), never of one row's
    address, so that a row's result does not depend on its place in the batch.
    Short rows get fewer lanes. ``num_warps`` overrides the warps (and so the
    lanes) of a kernel that does more than the forward. MAX_IN_STORAGE_TYPE:
    reduce.lane_max may take the max in the logits' own type (compiled, not
    interpreted: a CPU tensor runs in Triton's interpreter)."""
    first = rows[0]
    vocab = first.shape[-1]
    block, warps = _launch_config(vocab)
    if num_warps is None:
        num_warps = min(warps, _FORWARD_MAX_WARPS if vocab > _SHORT_ROW else _FORWARD_MAX_WARPS // 2)
    aligned = all(rows_aligned(t) for t in rows)
    vec = 16 // first.element_size() if aligned else 1
    lanes = max(1, min(32 * num_warps, block // vec))
    reps = max(1, min(_THREAD_ELEMS // vec, triton.next_power_of_2(vocab) // (lanes * vec)))
    return {"REPS": reps, "LANES": lanes, "VEC": vec, "ALIGNED": aligned,
            "MAX_IN_STORAGE_TYPE": first.device.type != "cpu", "num_warps": num_warps}  # fmt: skip


def _row_offsets_mod_16(t: torch.Tensor) -> tuple[int, int, int]:
    """(start, outer step, inner step) in bytes, modulo 16, of the rows of ``t`` (row_layout)."""
    _, outer_stride, inner_stride = row_layout(t)
    e = t.element_size()
    return t.data_ptr() % 16, (outer_stride * e) % 16, (inner_stride * e) % 16


def rows_aligned(logits: torch.Tensor) -> bool:
    """Whether every row of ``logits`` (row_layout) starts on a 16-byte boundary."""
    return _row_offsets_mod_16(logits) == (0, 0, 0)


def same_row_alignment(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether row r of ``a`` and row r of ``b`` (same element size) start at the same
    place in a 16-byte line, for every r."""
    return _row_offsets_mod_16(a) == _row_offsets_mod_16(b)


def _acc_dtypes(logits: torch.Tensor) -> tuple[torch.dtype, tl.dtype]:
    if logits.dtype == torch.float64:
        return torch.float64, tl.float64
    return torch.float32, tl.float32


def float_scalar_arg(value: int | float) -> int:
    """A float scalar as the kernels take it: the int64 bits of its float64 value
    (``float_scalar``). Triton passes a Python float as float32, which would round
    a float64 kernel's T (1e-300 to 0: seen on an H100), top-p or min-p; an int
    passes as it is."""
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return value


@triton.jit
def float_scalar(bits, DTYPE: tl.constexpr):
    """The float64 whose bits ``float_scalar_arg`` passed, rounded once to DTYPE
    (as the C++ kernels' cast does)."""
    return tl.full([], bits, tl.int64).to(tl.float64, bitcast=True).to(DTYPE)


@triton.jit
def _row_inv_temperature(temps_ptr, temp_scalar, row, PER_ROW_TEMP: tl.constexpr, ACC: tl.constexpr):
    """1/T of this row; NaN (poisoning the row) if T is not positive and finite."""
    if PER_ROW_TEMP:
        t = tl.load(temps_ptr + row).to(ACC)
    else:
        t = float_scalar(temp_scalar, ACC)
    usable = (t > 0) & (t < float("inf"))
    return tl.where(usable, 1.0 / t, float("nan")).to(ACC)


@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr, inner, outer_stride, inner_stride, labels_ptr, temps_ptr, temp_scalar, ignore_index,
    logprob_ptr, entropy_ptr, stats_ptr, V,
    HAS_LABELS: tl.constexpr, PER_ROW_TEMP: tl.constexpr, WITH_ENTROPY: tl.constexpr,
    WITH_STATS: tl.constexpr, REPS: tl.constexpr, LANES: tl.constexpr, VEC: tl.constexpr,
    ALIGNED: tl.constexpr, MAX_IN_STORAGE_TYPE: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    row_ptr = row_start(logits_ptr, row, inner, outer_stride, inner_stride)
    inv_t = _row_inv_temperature(temps_ptr, temp_scalar, row, PER_ROW_TEMP, ACC)
    m, n, t, w = softmax_stats(row_ptr, V, inv_t, WITH_ENTROPY, REPS, LANES, VEC, ALIGNED, MAX_IN_STORAGE_TYPE, ACC)
    log_s_exact = log_sum(n, t)  # float64, as n, t and w are (reduce.py)
    log_s = log_s_exact.to(ACC)
    if WITH_STATS:
        tl.store(stats_ptr + 2 * row, m)
        tl.store(stats_ptr + 2 * row + 1, log_s)
    if WITH_ENTROPY:
        tl.store(entropy_ptr + row, (log_s_exact - w / (n + t)).to(ACC))
    if HAS_LABELS:
        label = tl.load(labels_ptr + row).to(tl.int64)
        in_range = (label >= 0) & (label < V)
        x_label = tl.load(row_ptr + label, mask=in_range, other=0.0).to(ACC)
        logprob = (x_label - m) * inv_t - log_s
        logprob = tl.where(in_range, logprob, float("nan"))
        logprob = tl.where(label == ignore_index, 0.0, logprob)
        tl.store(logprob_ptr + row, logprob)


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
    inv_t = _row_inv_temperature(temps_ptr, temp_scalar, row, PER_ROW_TEMP, ACC)
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
    # Whole blocks unmasked, from the rows' first 16-byte boundary when they start
    # off it at the same place in the logits and the gradient (reduce.aligned_body),
    # then the partial block (masked, still 128-bit) and the head before it.
    offs = tl.arange(0, BLOCK_V)
    if ALIGN_BODY:
        head, x_body, rest = aligned_body(row_ptr, V)
        grad_body = tl.multiple_of(grad_row_ptr + head, 16)
    else:
        head, x_body, grad_body, rest = 0, row_ptr, grad_row_ptr, V
    whole = rest - rest % BLOCK_V
    for start in range(0, whole, BLOCK_V):
        x = tl.load(x_body + start + offs).to(ACC)
        grad = _logprobs_grad(x, head + start + offs, m, log_s, inv_t, g, h, entropy, label, HAS_GRAD_ENTROPY)
        tl.store(grad_body + start + offs, grad.to(grad_ptr.dtype.element_ty))
    if whole < rest:
        in_row = whole + offs < rest
        x = tl.load(x_body + whole + offs, mask=in_row, other=0.0).to(ACC)
        grad = _logprobs_grad(x, head + whole + offs, m, log_s, inv_t, g, h, entropy, label, HAS_GRAD_ENTROPY)
        tl.store(grad_body + whole + offs, grad.to(grad_ptr.dtype.element_ty), mask=in_row)
    if ALIGN_BODY and head > 0:  # under 16 bytes
        first = tl.arange(0, 16)
        x = tl.load(row_ptr + first, mask=first < head, other=0.0).to(ACC)
        grad = _logprobs_grad(x, first, m, log_s, inv_t, g, h, entropy, label, HAS_GRAD_ENTROPY)
        tl.store(grad_row_ptr + first, grad.to(grad_ptr.dtype.element_ty), mask=first < head)


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


def _temperature_args(temperature: float | torch.Tensor) -> tuple[torch.Tensor | None, int, bool]:
    """(per-row temperature tensor or None, scalar temperature (float_scalar_arg), PER_ROW_TEMP)."""
    if isinstance(temperature, torch.Tensor):
        return temperature, 0, True
    return None, float_scalar_arg(float(temperature)), False


def logprobs_forward(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: float | torch.Tensor,
    ignore_index: int,
    *,
    with_entropy: bool,
    with_stats: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(log-prob of the label [N], entropy [N], stats [N, 2]) of the N rows of
    ``logits`` [N, V] or [outer, inner, V] (unit stride in V, any leading
    strides: ``row_layout``), stats being each row's (max logit, log s) that the
    backward needs; an output not asked for is None."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    acc, acc_tl = _acc_dtypes(logits)
    new = lambda: torch.empty(n_rows, dtype=acc, device=logits.device)  # noqa: E731
    logprob = new() if labels is not None else None
    entropy = new() if with_entropy else None
    stats = torch.empty(n_rows, 2, dtype=acc, device=logits.device) if with_stats else None
    temps, temp_scalar, per_row = _temperature_args(temperature)
    _logprobs_fwd_kernel[(n_rows,)](
        logits, *row_layout(logits), labels, temps, temp_scalar, ignore_index,
        logprob, entropy, stats, vocab,
        HAS_LABELS=labels is not None, PER_ROW_TEMP=per_row, WITH_ENTROPY=with_entropy,
        WITH_STATS=with_stats, ACC=acc_tl, **tile_config(logits), **CONTRACTED,
    )  # fmt: skip
    return logprob, entropy, stats


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
    _, acc_tl = _acc_dtypes(logits)
    temps, temp_scalar, per_row = _temperature_args(temperature)
    block, num_warps = _launch_config(vocab)
    _logprobs_bwd_kernel[(n_rows,)](
        logits, *row_layout(logits), grad_out, *row_layout(grad_out), labels, temps, temp_scalar,
        ignore_index, stats, entropy, grad_logprob, grad_entropy, vocab, label_base, label_vocab,
        HAS_GRAD_LOGPROB=grad_logprob is not None, HAS_GRAD_ENTROPY=grad_entropy is not None,
        PER_ROW_TEMP=per_row, ALIGN_BODY=not rows_aligned(logits) and same_row_alignment(logits, grad_out),
        BLOCK_V=block, ACC=acc_tl, num_warps=num_warps, **CONTRACTED,
    )  # fmt: skip
