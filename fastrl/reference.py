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
    """d = (logits - max(logits)) / T per row, in the compute dtype.

    log_softmax and the entropy do not change when a row is shifted, so every
    op here works on d instead of logits / T: taking the difference on the raw
    logits before dividing keeps it exact in float32 even for |logits| ~ 1e4.
    A tensor temperature holds one value per row (broadcastable to
    ``logits.shape[:-1]``). A row that is all -inf gives NaN."""
    x = logits.to(compute_dtype(logits))
    d = x - x.amax(dim=-1, keepdim=True).detach()  # the shift has zero gradient anyway
    if isinstance(temperature, torch.Tensor):
        return d / temperature.to(d.dtype).expand(logits.shape[:-1]).unsqueeze(-1)
    return d / temperature


def _entropy_of_scaled(d: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p(v) log p(v) with p = softmax(d), written as
    H = log s - sum_v e_v d_v / s with e = exp(d), s = sum e (the same quantity):
    with max(d) = 0 this keeps a peaked row's small entropy accurate in float32,
    where -sum p log p loses it. -inf entries (p = 0) add nothing."""
    e = d.exp()
    s = e.sum(dim=-1)
    # masked_fill (not where) so that e * d has a finite gradient where e = 0.
    d_finite = d.masked_fill(torch.isneginf(d), 0.0)
    return s.log() - (e * d_finite).sum(dim=-1) / s


def _logprobs_of_scaled(d: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """log_softmax(d)[label], 0 where label == ignore_index."""
    logp = torch.log_softmax(d, dim=-1)
    keep = labels != ignore_index
    index = torch.where(keep, labels, 0).long().unsqueeze(-1)
    chosen = torch.gather(logp, -1, index).squeeze(-1)
    return torch.where(keep, chosen, torch.zeros_like(chosen))


def entropy_from_logits(logits: torch.Tensor, *, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) per row; -inf logits (masked vocabulary)
    have p = 0 and add nothing."""
    return _entropy_of_scaled(scaled_logits(logits, temperature))


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """log_softmax(logits / T)[label] per token; 0 where label == ignore_index."""
    return _logprobs_of_scaled(scaled_logits(logits, temperature), labels, ignore_index)


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_from_logits, entropy_from_logits) of the same distribution. z is
    computed once, so a low-precision input gets one rounded gradient, not two."""
    z = scaled_logits(logits, temperature)
    return _logprobs_of_scaled(z, labels, ignore_index), _entropy_of_scaled(z)
