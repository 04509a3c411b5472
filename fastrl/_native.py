"""Launchers for the native C++ kernels in ``fastrl._C`` (CPU tensors only).

The extension takes raw pointers, sizes, strides and dtype codes (the codes of
``csrc/common.h``); these functions allocate the outputs and pass them. They
mirror the Triton launchers in ``fastrl.kernels`` argument for argument, so the
API layer picks a backend by picking a module.
"""

from __future__ import annotations

import functools

import torch

from ._backend import native_module
from ._rows import compute_dtype, forward_outputs, row_count, row_layout, segment_length

DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
    torch.int32: 10,
    torch.int64: 11,
}


# Float64 columns of the policy and rollout-correction kernels' per-row statistics
# (csrc/policy.h; kernels/policy.py's N_STATS).
N_STATS = 8


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _row_param(value: float | int | torch.Tensor) -> tuple[int, float | int]:
    """(pointer to per-row values or 0, the scalar value) of a per-row parameter."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr(), 0
    return 0, value


def _optional_count(value: float | torch.Tensor | None) -> tuple[int, float, bool]:
    """(pointer to a 0-d float64 tensor or 0, the scalar value, whether given) of
    an optional count; the kernel reads a tensor itself, so it costs no host sync."""
    if value is None:
        return 0, 0.0, False
    return (*_row_param(value), True)


@functools.cache
def gemm_bf16_supported() -> bool:
    """Whether the extension is built and the CPU has AVX512-BF16 (csrc/gemm.h)."""
    module = native_module()
    return module is not None and module.gemm_bf16_supported()


def gemm_bf16(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
    """out = a @ b (+= with accumulate) for CPU matrices a [M, K], b [K, N], bf16
    (or float32, rounded to bf16), and float32 out [M, N], any strides: float32
    sums of the exact bf16 products (csrc/gemm.h)."""
    for name, t in (("a", a), ("b", b), ("out", out)):
        if t.device.type != "cpu" or t.dim() != 2:
            raise ValueError(f"gemm_bf16: {name} must be a 2-D CPU tensor; got {t.dim()}-D on {t.device}")
    if a.dtype not in (torch.bfloat16, torch.float32) or b.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"gemm_bf16: a and b must be bfloat16 or float32; got {a.dtype} and {b.dtype}")
    if out.dtype != torch.float32 or out.is_neg():
        raise TypeError(f"gemm_bf16: out must be a float32 tensor (not a negative view); got {out.dtype}")
    if a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"gemm_bf16: shapes {tuple(a.shape)} @ {tuple(b.shape)} -> {tuple(out.shape)} do not match")
    a, b = a.resolve_neg(), b.resolve_neg()  # the kernel reads the stored values
    if b.shape[1] > a.shape[0]:
        # The GEMM packs B whole and streams A through in blocks: B is the smaller
        # side (C.T = B.T A.T; the logits' chunk of tokens rather than the head).
        a, b, out = b.T, a.T, out.T
    (m, k), n = a.shape, b.shape[1]
    native_module().gemm_bf16(
        a=a.data_ptr(), a_dtype=DTYPE_CODES[a.dtype], a_row=a.stride(0), a_k=a.stride(1),
        b=b.data_ptr(), b_dtype=DTYPE_CODES[b.dtype], b_row=b.stride(1), b_k=b.stride(0),
        c=out.data_ptr(), c_row=out.stride(0), c_col=out.stride(1), m=m, n=n, k=k, accumulate=accumulate,
    )  # fmt: skip


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
    """The contract of ``fastrl.kernels.logprobs.logprobs_forward``, on the C++
    kernels: (log-prob of the label [N], entropy [N], stats [N, 2], sum of the
    squared probabilities sum_j p_j^2 of softmax(logits / T) [N]), each in the
    accumulation dtype and None when not asked for (sum_pi_squared: NaN for a
    row of only -inf or with a NaN). Per-row temperatures come as a contiguous
    ``[N]`` tensor of the accumulation dtype."""
    n_rows = row_count(logits)
    acc = compute_dtype(logits)
    logprob, entropy, stats, sum_pi_squared = forward_outputs(n_rows, acc, logits.device, labels is not None,
                                                              with_entropy, with_stats, with_sum_pi_squared)
    native_module().logprobs_forward(
        **_logits(logits, labels, ignore_index, temperature), segment=segment_length(logits.shape[-1]),
        out_logprob=_ptr(logprob), out_entropy=_ptr(entropy), out_stats=_ptr(stats),
        out_sum_pi_squared=_ptr(sum_pi_squared),
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
    """The contract of ``fastrl.kernels.logprobs.logprobs_segments`` on the C++
    kernels ([N, G, 5] float64 (m, n, t, w, q), w in natural units: each
    backend's segments are for its own combine). ``vocab`` (the whole row's) is
    the Triton tile's; the C++ reduction does not depend on it."""
    n_segments = logits.shape[-1] // segment if segment else 0
    segments = torch.empty(row_count(logits), n_segments, 5, dtype=torch.float64, device=logits.device)
    args = _logits(logits, None, 0, temperature)
    native_module().logprobs_segments(
        logits=args["logits"], dtype=args["dtype"], n_rows=args["n_rows"], vocab=args["vocab"], rows=args["rows"],
        temps=args["temps"], temp_scalar=args["temp_scalar"], segment=segment, with_entropy=with_entropy,
        with_sum_pi_squared=with_sum_pi_squared, out=segments.data_ptr(),
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
    """The contract of ``fastrl.kernels.logprobs.logprobs_combine`` on the C++ kernels."""
    n_rows = segments.shape[0]
    logprob, entropy, stats, sum_pi_squared = forward_outputs(n_rows, acc, segments.device, labels is not None,
                                                              with_entropy, with_stats, with_sum_pi_squared)
    temps, temp_scalar = _row_param(temperature)
    native_module().logprobs_combine(
        segments=segments.data_ptr(), n_rows=n_rows, n_segments=segments.shape[1], label_logits=_ptr(label_logits),
        acc_dtype=DTYPE_CODES[acc], vocab=vocab, labels=_ptr(labels),
        label_dtype=DTYPE_CODES[labels.dtype] if labels is not None else -1, ignore_index=ignore_index,
        temps=temps, temp_scalar=temp_scalar, out_logprob=_ptr(logprob), out_entropy=_ptr(entropy),
        out_stats=_ptr(stats), out_sum_pi_squared=_ptr(sum_pi_squared),
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
    """The contract of ``fastrl.kernels.logprobs.logprobs_backward``, on the C++ kernels."""
    native_module().logprobs_backward(
        **_logits(logits, labels, ignore_index, temperature),
        stats=stats.data_ptr(), entropy=_ptr(entropy), grad_logprob=_ptr(grad_logprob),
        grad_entropy=_ptr(grad_entropy), grad_out=grad_out.data_ptr(), grad_rows=row_layout(grad_out),
        label_base=label_base, label_vocab=logits.shape[-1] if label_vocab is None else label_vocab,
    )  # fmt: skip


def _logits(logits, labels, ignore_index, temperature) -> dict:
    """The log-prob kernels' arguments of csrc/logprobs.h, by the bindings' names."""
    temps, temp_scalar = _row_param(temperature)
    return dict(
        logits=logits.data_ptr(), dtype=DTYPE_CODES[logits.dtype], n_rows=row_count(logits), vocab=logits.shape[-1],
        rows=row_layout(logits), labels=_ptr(labels), label_dtype=DTYPE_CODES[labels.dtype] if labels is not None else -1,
        ignore_index=ignore_index, temps=temps, temp_scalar=temp_scalar,
    )  # fmt: skip


def _random(seed, offset) -> dict:
    """The sampler's random stream (csrc/sampling.h, RandomArgs), by the bindings' names: an int
    seed or per-row int64 seeds, an int offset or a one-element int64 tensor."""
    per_row_seeds = isinstance(seed, torch.Tensor)
    offset_ptr, offset = _row_param(offset)
    return dict(seeds=seed.data_ptr() if per_row_seeds else 0, seed=0 if per_row_seeds else seed,
                per_row_seeds=per_row_seeds, offset_ptr=offset_ptr, offset=offset)  # fmt: skip


def _truncation(logits, temperature, top_k, top_p, min_p) -> tuple:
    """The processed-distribution arguments of csrc/sampling.h, in binding order."""
    return (
        logits.data_ptr(), DTYPE_CODES[logits.dtype], row_count(logits), logits.shape[-1], row_layout(logits),
        *_row_param(temperature), *_row_param(top_k), *_row_param(top_p), *_row_param(min_p),
    )  # fmt: skip


def sample_forward(logits, *, temperature, top_k, top_p, min_p, seed, offset):
    """The contract of ``fastrl.kernels.sampling.sample_forward``, on the C++ kernels."""
    n_rows = row_count(logits)
    acc = compute_dtype(logits)
    tokens = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(n_rows, dtype=acc, device=logits.device)
    raw = torch.empty(n_rows, dtype=acc, device=logits.device)
    entropy = torch.empty(n_rows, dtype=acc, device=logits.device)
    native_module().sample_forward(
        truncation=_truncation(logits, temperature, top_k, top_p, min_p), **_random(seed, offset),
        tokens=tokens.data_ptr(), logprobs=logprobs.data_ptr(), raw_logprobs=raw.data_ptr(),
        entropy=entropy.data_ptr(),
    )  # fmt: skip
    return tokens, logprobs, raw, entropy


def truncated_forward(logits, labels, *, temperature, top_k, top_p, min_p, with_stats):
    """The contract of ``fastrl.kernels.sampling.truncated_forward``, on the C++ kernels."""
    n_rows = row_count(logits)
    acc = compute_dtype(logits)
    out = torch.empty(n_rows, dtype=acc, device=logits.device)
    stats = torch.empty(n_rows, 3, dtype=acc, device=logits.device) if with_stats else None
    native_module().truncated_logprobs_forward(
        truncation=_truncation(logits, temperature, top_k, top_p, min_p),
        labels=labels.data_ptr(), label_dtype=DTYPE_CODES[labels.dtype], out=out.data_ptr(), stats=_ptr(stats),
    )  # fmt: skip
    return out, stats


def truncated_backward(logits, labels, stats, grad_logprob, grad_out, *, temperature, top_k, top_p, min_p,
                       label_base=0, label_kept=None):  # fmt: skip
    """The contract of ``fastrl.kernels.sampling.truncated_backward``, on the C++ kernels."""
    native_module().truncated_logprobs_backward(
        truncation=_truncation(logits, temperature, top_k, top_p, min_p),
        labels=labels.data_ptr(), label_dtype=DTYPE_CODES[labels.dtype], stats=stats.data_ptr(),
        grad_logprob=grad_logprob.data_ptr(), grad_out=grad_out.data_ptr(), grad_rows=row_layout(grad_out),
        label_base=label_base, label_kept=_ptr(label_kept),
    )  # fmt: skip


def shard_digit_histogram(logits, prefix, shift, given=None, *, temperature=1.0, unit_scale=0.0):
    """The contract of ``fastrl.kernels.sampling.shard_digit_histogram``, on the C++ kernels."""
    hist = torch.empty(row_count(logits), 1 if given is None else 2, 256, dtype=torch.int64, device=logits.device)
    native_module().shard_digit_histogram(
        truncation=_truncation(logits, temperature, 0, 1.0, 0.0), prefix=prefix.data_ptr(), shift=shift,
        given=_ptr(given), unit_scale=unit_scale, hist=hist.data_ptr(),
    )  # fmt: skip
    return hist


def sample_shard_pass(logits, given, *, temperature, min_p, column_base, seed=None, offset=0, labels=None):
    """The contract of ``fastrl.kernels.sampling.sample_shard_pass``, on the C++ kernels."""
    n_rows = row_count(logits)
    scores = torch.empty(n_rows, 2, dtype=torch.float64, device=logits.device)
    masses = torch.empty(n_rows, 6, dtype=torch.int64, device=logits.device)
    picks = torch.empty(n_rows, 2, dtype=torch.int64, device=logits.device)
    native_module().sample_shard_pass(
        truncation=_truncation(logits, temperature, 0, 1.0, min_p), racing=labels is None,
        **_random(0 if seed is None else seed, offset), column_base=column_base, given=given.data_ptr(),
        labels=_ptr(labels), label_dtype=DTYPE_CODES[labels.dtype] if labels is not None else -1,
        scores=scores.data_ptr(), masses=masses.data_ptr(), picks=picks.data_ptr(),
    )  # fmt: skip
    return scores, masses, picks


def sample_mass_logs(masses, float64):
    """The contract of ``fastrl.kernels.sampling.sample_mass_logs``, on the C++ kernels (one
    formula for every dtype: ``float64`` is not read)."""
    logs = torch.empty(masses.shape[0], 3, dtype=torch.float64, device=masses.device)
    native_module().sample_mass_logs(masses=masses.data_ptr(), n_rows=masses.shape[0], logs=logs.data_ptr())
    return logs


def kl_penalty_forward(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, *, estimator: int) -> torch.Tensor:
    """The contract of ``fastrl.kernels.kl.kl_penalty_forward``, on the C++ kernels."""
    kl = torch.empty(log_probs.shape, dtype=log_probs.dtype, device=log_probs.device)
    native_module().kl_penalty_forward(
        log_probs=log_probs.data_ptr(), ref_log_probs=ref_log_probs.data_ptr(), dtype=DTYPE_CODES[log_probs.dtype],
        n=log_probs.numel(), estimator=estimator, out=kl.data_ptr(),
    )  # fmt: skip
    return kl


def kl_penalty_backward(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, grad: torch.Tensor, *, estimator: int, straight_through: bool
) -> torch.Tensor:
    """The contract of ``fastrl.kernels.kl.kl_penalty_backward``, on the C++ kernels."""
    grad_logp = torch.empty(log_probs.shape, dtype=log_probs.dtype, device=log_probs.device)
    native_module().kl_penalty_backward(
        log_probs=log_probs.data_ptr(), ref_log_probs=ref_log_probs.data_ptr(), grad=grad.data_ptr(),
        dtype=DTYPE_CODES[log_probs.dtype], n=log_probs.numel(), estimator=estimator,
        straight_through=straight_through, grad_logp=grad_logp.data_ptr(),
    )  # fmt: skip
    return grad_logp


def _full_kl(logits, ref_logits, temperature) -> dict:
    """The full-KL arguments of csrc/kl.h, by the bindings' names."""
    temps, temp_scalar = _row_param(temperature)
    return dict(
        logits=logits.data_ptr(), ref_logits=ref_logits.data_ptr(), dtype=DTYPE_CODES[logits.dtype],
        n_rows=row_count(logits), vocab=logits.shape[-1], rows=row_layout(logits), ref_rows=row_layout(ref_logits),
        temps=temps, temp_scalar=temp_scalar,
    )  # fmt: skip


def full_kl_forward(
    logits: torch.Tensor, ref_logits: torch.Tensor, temperature: float | torch.Tensor, *, with_stats: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The contract of ``fastrl.kernels.kl.full_kl_forward``, on the C++ kernels."""
    n_rows = row_count(logits)
    acc = compute_dtype(logits)
    kl = torch.empty(n_rows, dtype=acc, device=logits.device)
    stats = torch.empty(n_rows, 4, dtype=acc, device=logits.device) if with_stats else None
    native_module().full_kl_forward(**_full_kl(logits, ref_logits, temperature), out_kl=kl.data_ptr(),
                                    out_stats=_ptr(stats))  # fmt: skip
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
    """The contract of ``fastrl.kernels.kl.full_kl_backward``, on the C++ kernels."""
    native_module().full_kl_backward(
        **_full_kl(logits, ref_logits, temperature), stats=stats.data_ptr(), kl=kl.data_ptr(),
        grad_kl=grad_kl.data_ptr(), grad_out=grad_out.data_ptr(), grad_rows=row_layout(grad_out),
    )  # fmt: skip


def _policy(
    log_probs, old_log_probs, advantages, mask, weights, ref_log_probs,
    estimator, clip_low, clip_high, clip_c, sequence, with_pg,
) -> tuple:  # fmt: skip
    """The policy-loss arguments of csrc/policy.h, in binding order."""
    n_rows, length = log_probs.shape
    return (
        log_probs.data_ptr(), _ptr(old_log_probs), _ptr(advantages), mask.data_ptr(), _ptr(weights),
        _ptr(ref_log_probs), DTYPE_CODES[log_probs.dtype], n_rows, length, estimator, clip_low, clip_high,
        clip_c is not None, 0.0 if clip_c is None else clip_c, sequence, with_pg,
    )  # fmt: skip


def stats_shape(n_rows, length) -> tuple:
    """The contract of ``fastrl.kernels.policy.stats_shape``: the C++ kernels' statistics are per
    row, [B, N_STATS]."""
    return (n_rows, N_STATS)


def policy_forward(
    log_probs, old_log_probs, advantages, mask, weights, ref_log_probs, values,
    *, estimator: int, clip_low: float, clip_high: float, clip_c: float | None, sequence: bool, with_pg: bool,
) -> torch.Tensor:  # fmt: skip
    """The contract of ``fastrl.kernels.policy.policy_forward``, on the C++ kernels."""
    stats = torch.empty(log_probs.shape[0], N_STATS, dtype=torch.float64, device=log_probs.device)
    native_module().policy_forward(
        policy=_policy(log_probs, old_log_probs, advantages, mask, weights, ref_log_probs,
                       estimator, clip_low, clip_high, clip_c, sequence, with_pg),
        values=_ptr(values), stats=stats.data_ptr(),
    )  # fmt: skip
    return stats


def policy_backward(
    log_probs, old_log_probs, advantages, mask, weights, ref_log_probs, stats, row_weights, grad_loss,
    *, estimator: int, straight_through: bool, kl_coef: float, value_coef: float, clip_low: float,
    clip_high: float, clip_c: float | None, sequence: bool, with_pg: bool,
    grad_logp: torch.Tensor | None, grad_values: torch.Tensor | None,
) -> None:  # fmt: skip
    """The contract of ``fastrl.kernels.policy.policy_backward``, on the C++ kernels."""
    native_module().policy_backward(
        policy=_policy(log_probs, old_log_probs, advantages, mask, weights, ref_log_probs,
                       estimator, clip_low, clip_high, clip_c, sequence, with_pg),
        stats=stats.data_ptr(), row_weights=row_weights.data_ptr(), grad_loss=grad_loss.data_ptr(),
        straight_through=straight_through, kl_coef=kl_coef, value_coef=value_coef, grad_logp=_ptr(grad_logp),
        grad_values=_ptr(grad_values),
    )  # fmt: skip


def policy_finalize(
    stats: torch.Tensor,
    *, mode: int, dp_size: float, batch_num_tokens: float | torch.Tensor | None,
    global_batch_size: float | torch.Tensor | None, norm: float, kl_coef: float, value_coef: float,
    loss_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The contract of ``fastrl.kernels.policy.policy_finalize``, on the C++ kernels."""
    n_rows = stats.shape[0]
    loss = torch.empty((), dtype=loss_dtype, device=stats.device)
    metrics = torch.empty(6, dtype=torch.float32, device=stats.device)
    row_weights = torch.empty(n_rows, dtype=torch.float64, device=stats.device)
    tokens_ptr, tokens, tokens_given = _optional_count(batch_num_tokens)
    size_ptr, size, size_given = _optional_count(global_batch_size)
    native_module().policy_finalize(
        stats=stats.data_ptr(), n_rows=n_rows, mode=mode, dp_size=dp_size,
        batch_num_tokens_ptr=tokens_ptr, batch_num_tokens=tokens, batch_num_tokens_given=tokens_given,
        global_batch_size_ptr=size_ptr, global_batch_size=size, global_batch_size_given=size_given,
        norm=norm, kl_coef=kl_coef, value_coef=value_coef, loss_dtype=DTYPE_CODES[loss_dtype], loss=loss.data_ptr(),
        metrics=metrics.data_ptr(), row_weights=row_weights.data_ptr(),
    )  # fmt: skip
    return loss, metrics, row_weights


def rollout_correction_forward(
    old_log_probs, rollout_log_probs, mask,
    *, sequence: bool, truncate: bool, clip_min: float, clip_max: float, low_threshold: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The contract of ``fastrl.kernels.policy.rollout_correction_forward``, on the C++ kernels."""
    n_rows, length = old_log_probs.shape
    weights = torch.empty(n_rows, length, dtype=torch.float32, device=old_log_probs.device)
    stats = torch.empty(n_rows, N_STATS, dtype=torch.float64, device=old_log_probs.device)
    native_module().rollout_correction_forward(
        old_log_probs=old_log_probs.data_ptr(), rollout_log_probs=rollout_log_probs.data_ptr(), mask=mask.data_ptr(),
        dtype=DTYPE_CODES[old_log_probs.dtype], n_rows=n_rows, length=length, sequence=sequence, truncate=truncate,
        clip_min=clip_min, clip_max=clip_max, low_threshold=low_threshold, weights=weights.data_ptr(),
        stats=stats.data_ptr(),
    )  # fmt: skip
    return weights, stats


def rollout_finalize(stats: torch.Tensor, *, sequence: bool) -> torch.Tensor:
    """The contract of ``fastrl.kernels.policy.rollout_finalize``, on the C++ kernels."""
    metrics = torch.empty(8, dtype=torch.float32, device=stats.device)
    native_module().rollout_finalize(stats=stats.data_ptr(), n_rows=stats.shape[0], sequence=sequence,
                                     metrics=metrics.data_ptr())  # fmt: skip
    return metrics
