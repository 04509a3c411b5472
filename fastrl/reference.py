"""Plain PyTorch references: the specification of every fastrl op.

Each function is written for clarity, not speed, and is correct in any floating
dtype: float64 inputs are computed in float64 (this is what the tests compare the
kernels against), every other dtype is computed in float32, as the kernels do.
They are differentiable with ordinary autograd and are also the ``reference``
backend. They assume validated arguments (the public API checks them).
"""

from __future__ import annotations

import torch


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float64 stays float64; bf16 / fp16 / fp32 are computed in float32."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def scaled_logits(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """z = logits / T in the compute dtype. A tensor temperature holds one value
    per row (shape broadcastable to ``logits.shape[:-1]``)."""
    z = logits.to(compute_dtype(logits))
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(z.dtype).expand(logits.shape[:-1]).unsqueeze(-1)
        return z / t
    return z / temperature


def entropy_from_logits(logits: torch.Tensor, *, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """H = -sum_v p(v) log p(v) with p = softmax(logits / T); -inf logits
    (masked vocabulary) have p = 0 and add nothing."""
    z = scaled_logits(logits, temperature)
    logp = torch.log_softmax(z, dim=-1)
    # masked_fill (not where) so that p * logp has a finite gradient at p = 0.
    logp_finite = logp.masked_fill(torch.isneginf(z), 0.0)
    return -(logp.exp() * logp_finite).sum(dim=-1)


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """log_softmax(logits / T)[label] per token; 0 where label == ignore_index."""
    z = scaled_logits(logits, temperature)
    logp = torch.log_softmax(z, dim=-1)
    keep = labels != ignore_index
    index = torch.where(keep, labels, 0).long().unsqueeze(-1)
    chosen = torch.gather(logp, -1, index).squeeze(-1)
    return torch.where(keep, chosen, torch.zeros_like(chosen))


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_from_logits, entropy_from_logits) of the same distribution."""
    return (
        logprobs_from_logits(logits, labels, temperature=temperature, ignore_index=ignore_index),
        entropy_from_logits(logits, temperature=temperature),
    )
