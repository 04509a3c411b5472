"""KL between the policy and a reference policy.

    kl_penalty(log_probs, ref_log_probs, estimator)   per-token estimate from the
        sampled tokens' log-probs (k1 / abs / k2 / k3, and straight-through "+"
        variants), as veRL's ``core_algos.kl_penalty``;
    full_kl(logits, ref_logits, temperature)          the exact
        sum_v p(v) (log p(v) - log p_ref(v)) per token over the whole vocabulary
        (veRL's "full" mode, which veRL leaves unimplemented).

``fastrl.reference.kl_penalty`` / ``full_kl`` are the spec; the kernels are in
``fastrl.kernels.kl`` (Triton) and ``csrc/kl.cpp`` (CPU). ``full_kl`` reads each
logits tensor once forward, and once each (plus one write of the gradient)
backward; the reference logits are a constant.
"""

from __future__ import annotations

import torch

from . import _ops, _validation, reference
from ._backend import select_backend
from ._rows import row_view
from ._sharded.kl import full_kl_sharded

__all__ = ["full_kl", "kl_penalty"]

# The estimator codes both kernel backends take (kernels/kl.py, csrc/kl.h).
ESTIMATOR_CODES = {"kl": 0, "k1": 0, "abs": 1, "mse": 2, "k2": 2, "low_var_kl": 3, "k3": 3}


def check_estimator(estimator: object, name: str = "estimator") -> tuple[int, bool]:
    """(kernel code, straight_through) of a KL estimator name such as "k3" or "k3+"."""
    names = reference.KL_ESTIMATORS + tuple(n + "+" for n in reference.KL_ESTIMATORS)
    _validation.check_choice(estimator, name, names)
    straight_through = estimator.endswith("+")
    base = estimator[:-1] if straight_through else estimator
    # k2's own gradient is what "+" would substitute: no straight-through needed.
    return ESTIMATOR_CODES[base], straight_through and base not in ("k2", "mse")


class _KLPenalty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, log_probs, ref_log_probs, code, straight_through, backend):
        ctx.save_for_backward(log_probs, ref_log_probs)
        ctx.code, ctx.straight_through, ctx.backend = code, straight_through, backend
        return _ops.kl_penalty_forward(log_probs, ref_log_probs, code, backend)

    @staticmethod
    def backward(ctx, grad):
        _ops.refuse_double_backward()
        log_probs, ref_log_probs = ctx.saved_tensors
        grad_logp = _ops.kl_penalty_backward(
            log_probs, ref_log_probs, grad.contiguous(), ctx.code, ctx.straight_through, ctx.backend
        )
        # Every estimator depends on logp - ref only.
        grad_ref = -grad_logp if ctx.needs_input_grad[1] else None
        return grad_logp, grad_ref, None, None, None


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate from sampled tokens' log-probs, d = log_probs - ref_log_probs:

        "kl" / "k1": d     "abs": |d|     "mse" / "k2": d^2 / 2
        "low_var_kl" / "k3": clamp(e^c - c - 1, -10, 10) with c = clamp(-d, -20, 20)

    and "<name>+": the named estimator's value with k2's gradient (straight-through,
    unbiased KL gradient). Same values as veRL's ``kl_penalty``. fp32 out (fp64 for
    fp64 input), shaped like ``log_probs``; differentiable w.r.t. both inputs."""
    _validation.check_per_token(log_probs, "log_probs")
    _validation.check_per_token(ref_log_probs, "ref_log_probs", like=log_probs)
    code, straight_through = check_estimator(estimator)
    backend = select_backend(log_probs.device)
    if backend == "reference" or log_probs.numel() == 0:
        return reference.kl_penalty(log_probs, ref_log_probs, estimator)
    acc = reference.compute_dtype(log_probs)
    flat = lambda t: t.reshape(-1).to(acc).contiguous()  # noqa: E731
    out = _KLPenalty.apply(flat(log_probs), flat(ref_log_probs), code, straight_through, backend)
    return out.view(log_probs.shape)


class _FullKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ref_rows, temperature, backend):
        rows = row_view(logits)
        temps, temp_scalar = _ops.split_row_param(temperature)
        kl, stats = _ops.full_kl_forward(rows, ref_rows, temps, temp_scalar, True, backend)
        # The logits, not the rows view made here, so that a later in-place write to
        # them is caught by torch's version check with its usual message.
        ctx.save_for_backward(logits, ref_rows, temps, stats, kl)
        ctx.temp_scalar, ctx.backend = temp_scalar, backend
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        _ops.refuse_double_backward()
        logits, ref_rows, temps, stats, kl = ctx.saved_tensors
        return _ops.full_kl_gradient(logits, ref_rows, temps, ctx.temp_scalar, stats, kl, grad_kl, ctx.backend), None, None, None


@_validation.keyword_only_options
def full_kl(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    group: object = None,
    vocab_start: int | None = None,
) -> torch.Tensor:
    """Exact KL(p || p_ref) = sum_v p(v) (log p(v) - log p_ref(v)) per token,
    p = softmax(logits / T), p_ref = softmax(ref_logits / T) with the same T.

    Args:
        logits: ``[..., V]`` bf16 / fp16 / fp32 (fp64 accepted, computed in fp64).
        ref_logits: the reference policy's logits, same shape, dtype and device;
            treated as a constant (no gradient).
        temperature: positive float, or per-row tensor broadcastable to ``logits.shape[:-1]``.
        group, vocab_start: vocabulary-sharded logits (both tensors this rank's
            columns), as :func:`fastrl.logprobs_from_logits` takes them: every
            rank gets the whole vocabulary's KL (one all-gather of 5 numbers a
            row forward, none backward; ``fastrl._sharded.kl``).

    Returns fp32 ``[...]`` (fp64 for fp64 logits), differentiable w.r.t. ``logits``.
    -inf logits are a masked vocabulary: where p(v) = 0 the token adds nothing;
    where p(v) > 0 but p_ref(v) = 0 the KL is +inf."""

    def check_arguments():
        _validation.check_logits(logits)
        _validation.check_logits(ref_logits, "ref_logits")
        if ref_logits.shape != logits.shape:
            raise ValueError(f"ref_logits must have the shape of logits {tuple(logits.shape)}; got {tuple(ref_logits.shape)}")
        if ref_logits.dtype != logits.dtype:
            raise TypeError(f"ref_logits must have the dtype of logits ({logits.dtype}); got {ref_logits.dtype}")
        if ref_logits.device != logits.device:
            raise ValueError(f"ref_logits is on {ref_logits.device} but logits is on {logits.device}; they must share a device")
        return _validation.check_temperature(temperature, logits.shape[:-1], logits.device, reference.compute_dtype(logits))

    if group is not None or vocab_start is not None:
        if group is None:
            raise ValueError("vocab_start is for vocabulary-sharded logits: pass the group= they are sharded over")
        return full_kl_sharded(logits, ref_logits, temperature, group, vocab_start, check_arguments)
    temperature = check_arguments()
    token_shape = logits.shape[:-1]
    acc = reference.compute_dtype(logits)
    backend = select_backend(logits.device)
    if backend == "reference" or logits.numel() == 0:
        return reference.full_kl(logits, ref_logits, temperature=temperature)
    temperature = _validation.flat_per_row(temperature, token_shape, acc)
    ref_rows = row_view(ref_logits.detach())
    if torch.is_grad_enabled() and logits.requires_grad:
        kl = _FullKL.apply(logits, ref_rows, temperature, backend)
    else:
        kl, _ = _ops.full_kl_forward(row_view(logits), ref_rows, *_ops.split_row_param(temperature), False, backend)
    return kl.view(token_shape)
