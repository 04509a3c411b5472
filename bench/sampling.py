"""Benchmark cases of sampling, and the peers a rollout would otherwise call.

Minimum traffic (B rows, V vocabulary, e bytes per logit): the logits read once,
the token and two log-probs written:  B V e + 16 B.
"""

from __future__ import annotations

import importlib

import torch

import fastrl
from fastrl import reference

from . import Case, Impl

GPU_BATCHES = (1, 64, 256, 1024)
CPU_BATCHES = (1, 64)
QUICK_BATCHES = (1, 16)
VOCAB = 151936
QUICK_VOCAB = 32000
TEMPERATURE = 0.7
MODES = {"sample top-k 50": dict(top_k=50), "sample top-p 0.9": dict(top_p=0.9)}


def _torch_path(filters: dict):
    """What veRL's NaiveRollout does: scale, top-k (or sort for top-p), softmax,
    multinomial, then log_softmax + gather for the log-prob."""

    def run(x):
        z = x.float() / TEMPERATURE
        if "top_k" in filters:
            values, index = torch.topk(z, filters["top_k"], dim=-1)
            probs = torch.softmax(values, dim=-1)
            choice = torch.multinomial(probs, 1)
            token = index.gather(-1, choice)
            logprob = probs.gather(-1, choice).log()
        else:
            probs = torch.softmax(z, dim=-1)
            sorted_p, index = torch.sort(probs, dim=-1, descending=True)
            drop = torch.cumsum(sorted_p, dim=-1) - sorted_p >= filters["top_p"]
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)
            choice = torch.multinomial(sorted_p, 1)
            token = index.gather(-1, choice)
            logprob = sorted_p.gather(-1, choice).log()
        raw = torch.log_softmax(z, dim=-1).gather(-1, token)
        return token, logprob, raw

    return run


# FlashInfer's entry points for each filter, best first: from logits (as fastrl
# takes them), then from probabilities (the softmax timed with it). Releases
# differ in which they have: 0.2-0.6 have no top_k_sampling_from_logits.
_FLASHINFER_ENTRY_POINTS = {
    "top_k": ("top_k_sampling_from_logits", "top_k_top_p_sampling_from_logits", "top_k_sampling_from_probs"),
    "top_p": ("top_p_sampling_from_logits", "top_k_top_p_sampling_from_logits", "top_p_sampling_from_probs"),
}


def _flashinfer(filters: dict, device: torch.device):
    """(run, None) with the first of FlashInfer's entry points this install has for
    the filter, or (None, why not)."""
    if device.type != "cuda":
        return None, "GPU only"
    try:
        sampling = importlib.import_module("flashinfer.sampling")
    except Exception as exc:  # noqa: BLE001 - any import failure means the peer is absent here
        return None, f"not installed (flashinfer: {type(exc).__name__})"
    kind = "top_k" if "top_k" in filters else "top_p"
    names = _FLASHINFER_ENTRY_POINTS[kind]
    name = next((n for n in names if hasattr(sampling, n)), None)
    if name is None:
        return None, f"flashinfer.sampling has none of {', '.join(names)}"
    fn, value = getattr(sampling, name), filters[kind]
    if name == "top_k_top_p_sampling_from_logits":  # the other filter off: top-p 1, top-k V
        if kind == "top_k":
            return (lambda x: fn(x / TEMPERATURE, value, 1.0)), None
        return (lambda x: fn(x / TEMPERATURE, x.shape[-1], value)), None
    if name.endswith("_from_logits"):
        return (lambda x: fn(x / TEMPERATURE, value)), None
    return (lambda x: fn(torch.softmax(x.float() / TEMPERATURE, dim=-1), value)), None


def _make_inputs(batch: int, vocab: int, dtype: torch.dtype):
    def make(device: torch.device) -> dict:
        gen = torch.Generator(device="cpu").manual_seed(0)
        return {"logits": (torch.randn(batch, vocab, generator=gen) * 3).to(dtype).to(device)}

    return make


def _check(filters: dict):
    """Largest error of fastrl's returned log-probs against the float64 spec on
    the drawn tokens (inf if a draw left the kept set)."""

    def check(inputs: dict) -> float:
        x = inputs["logits"][:4]
        out = fastrl.sample(x, temperature=TEMPERATURE, seed=0, **filters)
        expected = reference.truncated_logprobs(x.double(), out.tokens, temperature=TEMPERATURE, **filters)
        if not bool(torch.isfinite(expected).all()):
            return float("inf")
        # and the processed distribution's entropy, -sum q log q over the kept set
        entropy = reference.distribution_entropy(
            reference.truncated_log_distribution(x.double(), temperature=TEMPERATURE, **filters)
        )
        return max(float(((out.logprobs.double() - expected).abs() / (1 + expected.abs())).max()),
                   float(((out.entropy.double() - entropy).abs() / (1 + entropy)).max()))  # fmt: skip

    return check


def cases(device: torch.device, *, quick: bool = False, shapes=None) -> list[Case]:
    if shapes is not None:
        sizes = [(n, v, dtype) for n, v, dtype in shapes]
    else:
        batches = QUICK_BATCHES if quick else GPU_BATCHES if device.type == "cuda" else CPU_BATCHES
        sizes = [(b, QUICK_VOCAB if quick else VOCAB, torch.bfloat16) for b in batches]
    out = []
    for mode, filters in MODES.items():
        for batch, vocab, dtype in sizes:
            e = torch.empty((), dtype=dtype).element_size()
            wrap = lambda run: (lambda inputs: (lambda: run(inputs["logits"])))  # noqa: E731
            impls = [
                Impl("fastrl", wrap(lambda x, f=filters: fastrl.sample(x, temperature=TEMPERATURE, seed=0, **f))),
                Impl("torch path (topk/sort, softmax, multinomial, log_softmax)", wrap(_torch_path(filters))),
                Impl("torch eager (fastrl.reference)",
                     wrap(lambda x, f=filters: reference.sample(x, temperature=TEMPERATURE, seed=0, **f))),
            ]  # fmt: skip
            run, why = _flashinfer(filters, device)
            impls.append(Impl("FlashInfer (no log-probs)", wrap(run) if run else None, why))
            out.append(
                Case(
                    op=mode, shape=(batch, vocab), dtype=dtype, bytes_formula="B*V*e + 16B",
                    min_bytes=batch * vocab * e + 16 * batch, make_inputs=_make_inputs(batch, vocab, dtype),
                    impls=impls, check=_check(filters),
                )
            )  # fmt: skip
    return out
