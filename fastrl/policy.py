"""The PPO-family policy loss, loss aggregation and rollout-correction weights.

    policy_loss              importance ratio, PPO clipping (asymmetric, dual clip),
                             GSPO's sequence-level ratio, rollout weights, KL and
                             entropy terms, aggregation and clip metrics: one kernel
                             forward, one backward, no host sync
    policy_loss_from_logits  the same from the logits: the fused log-prob (and
                             entropy) kernel feeds it, so the logits are read once
                             forward and once backward (plus one gradient write)
    agg_loss                 veRL's loss aggregation modes
    rollout_correction       truncated / masked importance weights for the
                             rollout-engine vs trainer mismatch, with metrics

``fastrl.reference`` is the spec of each (names and defaults follow veRL's
``core_algos``). The kernels (``fastrl.kernels.policy``; ``csrc/policy.cpp``,
its backward in ``csrc/policy_backward.cpp``) reduce each sequence to a few
float64 partial sums; every aggregation mode is then ``sum_b row_weight_b *
partial_b`` with a per-sequence weight (below), so the loss, its gradient and
the metrics come from those sums on the device.
"""

from __future__ import annotations

import math

import torch

from . import _ops, _validation, reference
from ._backend import select_backend
from ._native import N_STATS
from .kl import check_estimator
from .logprobs import _run as _logprobs_run

__all__ = ["agg_loss", "policy_loss", "policy_loss_from_logits", "rollout_correction"]

# The rollout-correction metrics, in the order rollout_finalize writes them.
_CORRECTION_METRICS = (
    "mean", "max", "min", "std", "eff_sample_size", "ratio_fraction_high", "ratio_fraction_low", "masked_fraction",
)  # fmt: skip


def _check_agg(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor, device) -> dict:
    _validation.check_choice(loss_agg_mode, "loss_agg_mode", reference.AGG_MODES)
    dp_size = _validation.check_scalar(dp_size, "dp_size", integer=True, ok=lambda v: v >= 1, accepted=">= 1")
    batch_num_tokens = _validation.check_count(batch_num_tokens, "batch_num_tokens", device)
    global_batch_size = _validation.check_count(global_batch_size, "global_batch_size", device)
    if loss_scale_factor is not None:
        loss_scale_factor = _validation.check_scalar(
            loss_scale_factor, "loss_scale_factor", ok=lambda v: (v > 0) & (v < float("inf")), accepted="positive"
        )
    if dp_size > 1 and loss_agg_mode == "token-mean" and batch_num_tokens is None:
        raise ValueError("batch_num_tokens (the global number of valid tokens) is required when dp_size > 1")
    if dp_size > 1 and loss_agg_mode.startswith("seq-mean") and global_batch_size is None:
        raise ValueError("global_batch_size (the global number of sequences) is required when dp_size > 1")
    return {
        "loss_agg_mode": loss_agg_mode, "dp_size": dp_size, "batch_num_tokens": batch_num_tokens,
        "global_batch_size": global_batch_size, "loss_scale_factor": loss_scale_factor,
    }  # fmt: skip


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """A per-token tensor [..., L] as [B, L], B the product of the leading dims
    (spelled out: ``reshape(-1, 0)`` cannot infer B when L == 0)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _rows(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A per-token tensor as contiguous [B, L] of ``dtype`` (a view when it already is)."""
    return None if t is None else _as_rows(t).to(dtype).contiguous()


def _mask_rows(mask: torch.Tensor) -> torch.Tensor:
    """The mask as contiguous [B, L] uint8 (0/1), as the kernels read it: a view of
    a bool mask's bytes in eager. Inductor in torch 2.11 cannot lower a bool ->
    uint8 view (LoweringException: torch.iinfo of bool), so a compiled graph
    converts instead; it fuses the conversion into its own kernels."""
    rows = _as_rows(mask)
    if rows.dtype != torch.bool:
        rows = rows != 0
    if torch.compiler.is_compiling():
        return rows.to(torch.uint8).contiguous()
    return rows.contiguous().view(torch.uint8)


def check_current_policy(current: torch.Tensor, current_name: str, old_log_probs: torch.Tensor) -> None:
    """Refuses the fingerprint of the current and old log-probs passed in each
    other's place (veRL's ``compute_policy_loss_vanilla(old_log_prob, log_prob, ...)``
    takes the old ones first): with grad enabled, ``old_log_probs`` requires grad
    but the current policy's input does not, so the loss would have no gradient
    and torch would only say "element 0 of tensors does not require grad" at
    backward. Reads ``requires_grad`` alone: no host sync, static under
    torch.compile. (Under ``torch.no_grad`` a swap cannot be told from a correct
    call; passing the tensors by name rules it out.)"""
    if not (torch.is_grad_enabled() and old_log_probs.requires_grad and not current.requires_grad):
        return
    if current_name == "log_probs":
        fix = (
            "the two look swapped: fastrl.policy_loss(log_probs, old_log_probs, advantages, response_mask, ...) takes "
            "the current policy's log-probs first, where veRL's compute_policy_loss_vanilla(old_log_prob, log_prob, "
            "...) takes the old ones first. Call it in fastrl's order or by name (log_probs=..., old_log_probs=...)"
        )
    else:
        fix = (
            f"the loss differentiates through the current policy's {current_name} only: pass {current_name} that "
            "require grad"
        )
    raise ValueError(
        f"old_log_probs requires grad but {current_name} does not, so the loss would have no gradient; {fix}. "
        "If old_log_probs really are the old policy's, compute them under torch.no_grad() or pass "
        "old_log_probs.detach()"
    )


class _PolicyLoss(torch.autograd.Function):
    """The aggregated loss of [B, L] rows and its metrics: one kernel for the
    per-row sums, one for the aggregation; outputs (loss, metrics [6])."""

    @staticmethod
    def forward(ctx, log_probs, values, constants, options, agg, backend):
        old, adv, mask, weights, ref = constants
        n_rows, length = log_probs.shape
        if log_probs.numel():
            stats = _ops.policy_forward(
                log_probs, old, adv, mask, weights, ref, values, options["estimator"], options["clip_low"],
                options["clip_high"], options["clip_c"], options["sequence"], options["with_pg"], backend,
            )  # fmt: skip
        else:
            stats = torch.zeros(n_rows, N_STATS, dtype=torch.float64, device=log_probs.device)
        factor = agg["loss_scale_factor"]
        # (tensor, number) pairs of the global counts; None stays (None, None): not given.
        counts = (*_ops.split_row_param(agg["batch_num_tokens"]), *_ops.split_row_param(agg["global_batch_size"]))
        loss, metrics, row_weights = _ops.policy_finalize(
            stats, reference.AGG_MODES.index(agg["loss_agg_mode"]), agg["dp_size"], *counts,
            length if factor is None else factor, options["kl_coef"], options["value_coef"], log_probs.dtype, backend,
        )  # fmt: skip
        ctx.save_for_backward(log_probs, old, adv, mask, weights, ref, stats, row_weights)
        ctx.options, ctx.backend = options, backend
        ctx.mark_non_differentiable(metrics)
        return loss, metrics

    @staticmethod
    def backward(ctx, grad_loss, _grad_metrics):
        _ops.refuse_double_backward()
        log_probs, old, adv, mask, weights, ref, stats, row_weights = ctx.saved_tensors
        opts = ctx.options
        need_logp, need_values = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not log_probs.numel() or not (need_logp or need_values):
            empty = lambda wanted: torch.zeros_like(log_probs) if wanted else None  # noqa: E731
            return empty(need_logp), empty(need_values), None, None, None, None
        grad_logp, grad_values = _ops.policy_backward(
            log_probs, old, adv, mask, weights, ref, stats, row_weights, grad_loss.to(log_probs.dtype),
            opts["estimator"], opts["straight_through"], opts["kl_coef"], opts["value_coef"], opts["clip_low"],
            opts["clip_high"], opts["clip_c"], opts["sequence"], opts["with_pg"], need_logp, need_values, ctx.backend,
        )  # fmt: skip
        return grad_logp if need_logp else None, grad_values if need_values else None, None, None, None, None


@_validation.keyword_only_options(
    hint="veRL's agg_loss takes dp_size and the global counts positionally after loss_agg_mode"
)
def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> torch.Tensor:
    """Aggregates a per-token loss ``[..., L]`` over the valid tokens (``loss_mask``:
    bool or 0/1) into a 0-d fp32 tensor, exactly as veRL's ``agg_loss``:

        "token-mean"               masked sum / N * dp_size
        "token-sum"                masked sum * dp_size
        "seq-mean-token-sum"       sum over sequences of their masked sums / G * dp_size
        "seq-mean-token-mean"      sum over sequences of their masked means / G * dp_size
        "seq-mean-token-sum-norm"  seq-mean-token-sum / loss_scale_factor (default L)

    N = ``batch_num_tokens`` (default: the valid tokens here), G =
    ``global_batch_size`` (default: the sequences here with a valid token); with
    ``dp_size > 1`` they must be the global counts. Sequences with no valid token
    add nothing, and a zero N or G gives 0, never NaN. Differentiable w.r.t. ``loss_mat``."""
    _validation.check_per_token(loss_mat, "loss_mat")
    _validation.check_mask(loss_mask, "loss_mask", loss_mat)
    agg = _check_agg(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor, loss_mat.device)
    backend = select_backend(loss_mat.device)
    if backend == "reference":
        return reference.agg_loss(loss_mat, loss_mask, **agg)
    acc = reference.compute_dtype(loss_mat)
    values = _rows(loss_mat, acc)
    mask = _mask_rows(loss_mask)
    options = {
        "estimator": -1, "straight_through": False, "clip_low": 0.0, "clip_high": 0.0, "clip_c": None,
        "sequence": False, "with_pg": False, "kl_coef": 0.0, "value_coef": 1.0,
    }  # fmt: skip
    # The log-prob slot carries the values too: without the PG and KL terms the kernels only count its tokens.
    loss, _ = _PolicyLoss.apply(values.detach(), values, (None, None, mask, None, None), options, agg, backend)
    return loss


@_validation.keyword_only_options(
    hint="veRL's compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config) "
    "takes the options positionally and the old log-probs first; fastrl takes the current log_probs first"
)
def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    ratio_level: str = "token",
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "low_var_kl",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    dp_size: int = 1,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO / GRPO / DAPO / GSPO policy loss with KL and entropy terms, from
    per-token log-probs ``[..., L]`` (the last dimension is a sequence's tokens).

    ``ratio_level="token"`` equals veRL's ``compute_policy_loss_vanilla`` followed
    by ``agg_loss``; ``"sequence"`` is GSPO (veRL's ``compute_policy_loss_gspo``,
    which in veRL 0.9.0 always aggregates with "seq-mean-token-mean", so pass that
    mode to match it, and from 0.9.1 on with the loss_agg_mode it is given):

        u = log_probs - old_log_probs;  r = exp(clamp(u, -20, 20))   (token)
                                        r = exp(min(mean of u over the sequence, 10)), straight-through (sequence)
        l = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        l = min(l, -A clip_ratio_c) where A < 0     (dual clip, when clip_ratio_c is given; it must be > 1)
        l = l * rollout_is_weights                  (when given)
        loss = agg(l) + kl_coef agg(kl_penalty(log_probs, ref_log_probs, kl_estimator)) - entropy_coef agg(entropy)

    with ``agg`` = :func:`agg_loss` in ``loss_agg_mode`` (and its dp_size /
    batch_num_tokens / global_batch_size / loss_scale_factor). Tokens outside
    ``response_mask`` (bool or 0/1) are ignored, whatever they hold.

    Returns ``(loss, metrics)``: a 0-d fp32 loss differentiable w.r.t.
    ``log_probs`` and ``entropy`` (the other tensors are constants), and a dict of
    detached 0-d fp32 tensors (no host sync): ``pg_loss``, ``pg_clipfrac``,
    ``pg_clipfrac_lower``, ``ppo_kl``, plus ``kl`` and ``entropy`` (their
    aggregated values) when those inputs are given.

    Argument order: the current log-probs first, as OpenRLHF's ``PolicyLoss``;
    veRL's ``compute_policy_loss_vanilla`` takes the old ones first. With grad
    enabled, ``old_log_probs`` requiring grad while ``log_probs`` does not (veRL's
    order kept) raises a ValueError saying so, instead of a loss with no
    gradient. Under ``torch.no_grad`` a swap cannot be detected: pass the two by
    name when porting veRL code.
    """
    _validation.check_per_token(log_probs, "log_probs")
    for name, t in (("old_log_probs", old_log_probs), ("advantages", advantages)):
        _validation.check_per_token(t, name, like=log_probs)
    check_current_policy(log_probs, "log_probs", old_log_probs)
    _validation.check_mask(response_mask, "response_mask", log_probs)
    for name, t in (("rollout_is_weights", rollout_is_weights), ("ref_log_probs", ref_log_probs), ("entropy", entropy)):
        if t is not None:
            _validation.check_per_token(t, name, like=log_probs)
    non_negative = {"ok": lambda v: (v >= 0) & (v < float("inf")), "accepted": "non-negative and finite"}
    clip_low = _validation.check_scalar(clip_ratio_low, "clip_ratio_low", **non_negative)
    clip_high = _validation.check_scalar(clip_ratio_high, "clip_ratio_high", **non_negative)
    if clip_ratio_c is not None:
        clip_ratio_c = _validation.check_scalar(
            clip_ratio_c, "clip_ratio_c", ok=lambda v: (v > 1) & (v < float("inf")), accepted="> 1 (or None: no dual clip)"
        )
    _validation.check_choice(ratio_level, "ratio_level", reference.RATIO_LEVELS)
    code, straight_through = check_estimator(kl_estimator, "kl_estimator")
    finite = {"ok": lambda v: abs(v) < float("inf"), "accepted": "finite"}
    kl_coef = _validation.check_scalar(kl_coef, "kl_coef", **finite)
    entropy_coef = _validation.check_scalar(entropy_coef, "entropy_coef", **finite)
    if kl_coef != 0 and ref_log_probs is None:
        raise ValueError("kl_coef is nonzero but ref_log_probs is None; pass the reference policy's log-probs")
    if entropy_coef != 0 and entropy is None:
        raise ValueError("entropy_coef is nonzero but entropy is None; pass the per-token entropy")
    agg = _check_agg(loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor, log_probs.device)

    backend = select_backend(log_probs.device)
    if backend == "reference":
        return reference.policy_loss(
            log_probs, old_log_probs, advantages, response_mask, clip_ratio_low=clip_low, clip_ratio_high=clip_high,
            clip_ratio_c=clip_ratio_c, ratio_level=ratio_level, rollout_is_weights=rollout_is_weights,
            ref_log_probs=ref_log_probs, kl_coef=kl_coef, kl_estimator=kl_estimator, entropy=entropy,
            entropy_coef=entropy_coef, **agg,
        )  # fmt: skip
    acc = reference.compute_dtype(log_probs)
    constants = (
        _rows(old_log_probs.detach(), acc), _rows(advantages.detach(), acc), _mask_rows(response_mask),
        _rows(None if rollout_is_weights is None else rollout_is_weights.detach(), acc),
        _rows(None if ref_log_probs is None else ref_log_probs.detach(), acc),
    )  # fmt: skip
    options = {
        "estimator": code if ref_log_probs is not None else -1, "straight_through": straight_through,
        "clip_low": clip_low, "clip_high": clip_high, "clip_c": clip_ratio_c,
        "sequence": ratio_level == "sequence", "with_pg": True, "kl_coef": kl_coef, "value_coef": -entropy_coef,
    }  # fmt: skip
    loss, values = _PolicyLoss.apply(
        _rows(log_probs, acc), _rows(entropy, acc), constants, options, agg, backend
    )
    pg_loss, kl, entropy_agg, clipfrac, clipfrac_lower, ppo_kl = values.unbind()
    metrics = {"pg_loss": pg_loss, "pg_clipfrac": clipfrac, "pg_clipfrac_lower": clipfrac_lower, "ppo_kl": ppo_kl}
    if ref_log_probs is not None:
        metrics["kl"] = kl
    if entropy is not None:
        metrics["entropy"] = entropy_agg
    return loss, metrics


def options_to_agree(options: dict) -> dict:
    """:func:`policy_loss`'s keyword arguments as options the ranks of a
    vocabulary-sharded call must agree on (fastrl._distributed.agree)."""
    return {f"policy_loss {name}": value for name, value in options.items()}


@_validation.keyword_only_options
def policy_loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    inplace_backward: bool = False,
    ignore_index: int = -100,
    with_entropy: bool | None = None,
    group: object = None,
    vocab_start: int | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`policy_loss` straight from ``logits [..., L, V]`` and the sampled
    ``labels [..., L]``: the log-probs ``log_softmax(logits / T)[label]`` (and the
    entropy, when ``entropy_coef != 0`` or ``with_entropy=True``) come from the fused
    log-prob kernel, which reads the logits once; the backward reads them once
    and writes the gradient once (into the logits' storage with
    ``inplace_backward=True``). Between the two, only per-token fp32 values
    (4 bytes a token, against 2V for bf16 logits) are written and read.
    ``options`` are :func:`policy_loss`'s keyword arguments (not ``entropy``).
    ``group`` / ``vocab_start``: vocabulary-sharded logits, as
    :func:`fastrl.logprobs_from_logits` takes them, the loss's options agreed
    across the ranks with the rest; every rank computes the same loss, and each
    shard gets its slice of the gradient.
    Returns ``(loss, metrics)`` as :func:`policy_loss`."""
    if "entropy" in options:
        raise TypeError("policy_loss_from_logits computes the entropy from the logits; pass with_entropy=True instead")
    if with_entropy is None:
        with_entropy = options.get("entropy_coef", 0.0) != 0
    _validation.check_bool(with_entropy, "with_entropy")
    if group is None:  # (a sharded call checks the logits on every rank together, before its collectives)
        _validation.check_logits(logits)
    log_probs, entropy, _ = _logprobs_run(logits, labels, temperature, ignore_index, inplace_backward, with_entropy,
                                          group, vocab_start, options_to_agree(options))  # fmt: skip
    _validation.check_per_token(old_log_probs, "old_log_probs")
    check_current_policy(logits, "logits", old_log_probs)
    return policy_loss(log_probs, old_log_probs, advantages, response_mask, entropy=entropy, **options)


@_validation.keyword_only_options
def rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    clip_max: float = 2.0,
    clip_min: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights pi_old / pi_rollout correcting for the mismatch between
    the rollout engine and the trainer (veRL's rollout correction):

        level "token":     w = exp(clamp(old - rollout, -20, 20)) per token
        level "sequence":  w = exp(clamp(sum over the sequence of (old - rollout), -20, 20))
        mode "truncate":   w = clamp(w, clip_min, clip_max)        (TIS)
        mode "mask":       w = 0 where w is outside [clip_min, clip_max]   (IcePop)

    (clip_min None: no lower bound), and w = 0 outside ``response_mask``.
    Returns ``(weights, metrics)``: fp32 weights shaped like the inputs, detached
    (pass them as ``policy_loss(rollout_is_weights=...)``), and 0-d fp32 metrics
    defined as veRL's (``compute_is_metrics``): ``rollout_is_mean``, ``_std``,
    ``rollout_is_eff_sample_size`` (mean(w)^2 / mean(w^2)) of the applied weights
    over the valid tokens; ``rollout_is_max`` / ``_min`` and
    ``rollout_is_ratio_fraction_high`` / ``_low`` (raw weight above clip_max /
    below clip_min, or 1 / clip_max without one) over the valid tokens at token
    level (the extremes of the applied weights), over the sequences at sequence
    level (the extremes of the raw weight e^S, the max clamped at e^20; a sequence
    with no valid token is left out); and in mode "mask"
    ``rollout_is_masked_fraction``. ``fastrl.reference.rollout_correction`` is the spec."""
    _validation.check_per_token(old_log_probs, "old_log_probs")
    _validation.check_per_token(rollout_log_probs, "rollout_log_probs", like=old_log_probs)
    _validation.check_mask(response_mask, "response_mask", old_log_probs)
    _validation.check_choice(level, "level", reference.RATIO_LEVELS)
    _validation.check_choice(mode, "mode", reference.CORRECTION_MODES)
    clip_max = _validation.check_scalar(
        clip_max, "clip_max", ok=lambda v: (v > 0) & (v < float("inf")), accepted="positive and finite"
    )
    if clip_min is not None:
        clip_min = _validation.check_scalar(
            clip_min, "clip_min", ok=lambda v: (v >= 0) & (v <= clip_max), accepted=f"in [0, clip_max={clip_max}]"
        )
    backend = select_backend(old_log_probs.device)
    if backend == "reference" or old_log_probs.numel() == 0:
        return reference.rollout_correction(
            old_log_probs, rollout_log_probs, response_mask, level=level, mode=mode, clip_max=clip_max, clip_min=clip_min
        )
    acc = reference.compute_dtype(old_log_probs)
    weights, stats = _ops.rollout_correction_forward(
        _rows(old_log_probs.detach(), acc), _rows(rollout_log_probs.detach(), acc), _mask_rows(response_mask),
        level == "sequence", mode == "truncate", 0.0 if clip_min is None else clip_min, clip_max,
        1.0 / clip_max if clip_min is None else clip_min, backend,
    )  # fmt: skip
    names = [f"rollout_is_{name}" for name in _CORRECTION_METRICS]
    metrics = dict(zip(names, _ops.rollout_finalize(stats, level == "sequence", backend).unbind()))
    if mode != "mask":
        del metrics["rollout_is_masked_fraction"]
    return weights.view(old_log_probs.shape), metrics
