"""Benchmark cases of the KL family, and the peers a trainer would otherwise call.

Minimum traffic (N tokens, V vocabulary, e bytes per logit):
    full_kl fwd       2 N V e + 4 N        both logits tensors read once, the KL written
    full_kl fwd+bwd   3 N V e + 8 N        both read once, the gradient written (the kernels
                                           read both twice: 5 N V e)
"""

from __future__ import annotations

import torch

import fastrl
from fastrl import reference

from . import Case, Impl, compiled_reference, generator, grad_step, no_grad_step

GPU_SHAPES = [(8192, 151936, torch.bfloat16)]
CPU_SHAPES = [(512, 32000, torch.bfloat16)]
QUICK_SHAPES = [(64, 32000, torch.bfloat16)]


def _make_inputs(n: int, v: int, dtype: torch.dtype):
    def make(device: torch.device) -> dict:
        gen = generator(device, 2)
        logits = torch.randn(n, v, generator=gen, device=device) * 2
        ref = logits + 0.3 * torch.randn(n, v, generator=gen, device=device)
        return {"logits": logits.to(dtype), "ref_logits": ref.to(dtype)}

    return make


def _kl_div(x, y):
    """The usual eager formulation: F.kl_div on log-softmaxes (fp32 copies)."""
    logp = torch.log_softmax(x.float(), dim=-1)
    logq = torch.log_softmax(y.float(), dim=-1)
    return torch.nn.functional.kl_div(logq, logp, reduction="none", log_target=True).sum(-1)


def _check(inputs: dict) -> float:
    """Largest error of fastrl's KL against the float64 reference on the first
    rows (relative to 1 + |KL|)."""
    x, y = inputs["logits"][:8], inputs["ref_logits"][:8]
    got, want = fastrl.full_kl(x, y), reference.full_kl(x.double(), y.double())
    return float(((got.double() - want).abs() / (1 + want.abs())).max())


def cases(device: torch.device, *, quick: bool = False, shapes=None) -> list[Case]:
    if shapes is None:
        shapes = QUICK_SHAPES if quick else GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    out = []
    for n, v, dtype in shapes:
        e = torch.empty((), dtype=dtype).element_size()
        for mode in ("full_kl fwd", "full_kl fwd+bwd"):
            if mode == "full_kl fwd":
                wrap = lambda run: no_grad_step(lambda inputs: run(inputs["logits"], inputs["ref_logits"]))  # noqa: E731
                formula, min_bytes = "2*N*V*e + 4N", 2 * n * v * e + 4 * n
            else:
                wrap = lambda run: grad_step(lambda x, inputs: run(x, inputs["ref_logits"]), "logits")  # noqa: E731
                # The forward reads both rows, the backward reads both again and writes
                # the gradient: a separate backward's minimum, as logprobs fwd+bwd counts
                # its 3*N*V*e.
                formula, min_bytes = "5*N*V*e + 8N", 5 * n * v * e + 8 * n
            impls = [
                Impl("fastrl", wrap(fastrl.full_kl)),
                Impl("torch eager (fastrl.reference)", wrap(reference.full_kl)),
                Impl("torch eager F.kl_div(log_softmax)", wrap(_kl_div)),
            ]
            impls.append(compiled_reference(wrap, reference.full_kl, quick))
            out.append(
                Case(
                    op=mode, shape=(n, v), dtype=dtype, bytes_formula=formula, min_bytes=min_bytes,
                    make_inputs=_make_inputs(n, v, dtype), impls=impls, check=_check,
                )
            )  # fmt: skip
    return out
