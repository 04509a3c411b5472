"""Benchmark cases of the fused LM head (``linear_logprobs_and_entropy``), and the
peers a trainer would otherwise call.

The op is GEMM-bound: a forward is one [N, H] x [H, V] GEMM (2 N H V flops), a
forward + backward four (the logits formed again, dL/dhidden, dL/dweight), where
the unfused path (logits held) needs three. The bytes it must move, stated as for
every case (N tokens, H hidden, V vocabulary, e bytes per element), are

    fwd       (N H + V H) e + 8 N + 8 N           hidden and weight in, labels in, log-probs and entropy out
    fwd+bwd   2 (N H + V H) e + 8 N + 16 N        and both gradients out (hidden and weight read once more)

so the "% copy BW" column says little here: the comparison that matters is the time
against the peers and the "extra MiB" column (peak memory above the inputs): the
unfused path holds the [N, V] logits and their gradient, the fused ones a chunk.
"""

from __future__ import annotations

import torch

import fastrl
from fastrl import reference

from . import Case, Impl, compiled_reference, generator, import_peer

# (N, V, dtype) with the hidden size of the device. The CPU target is
# [4096, 2048, 151936]: about a minute a fwd+bwd on a 2-core machine, so `make bench`
# on a CPU times N = 256 (python -m bench --op linear --shape
# 4096,151936,bfloat16 for the full one).
GPU_SHAPES = [(16384, 151936, torch.bfloat16)]
CPU_SHAPES = [(256, 151936, torch.bfloat16), (256, 151936, torch.float32)]
QUICK_SHAPES = [(128, 32000, torch.float32)]
HIDDEN = {"cuda": 4096, "cpu": 2048, "quick": 256}

MODES = ("linear logprobs+entropy fwd", "linear logprobs+entropy fwd+bwd")


def _make_inputs(n: int, hidden_size: int, vocab: int, dtype: torch.dtype):
    def make(device: torch.device) -> dict:
        gen = generator(device, 3)
        hidden = torch.randn(n, hidden_size, generator=gen, device=device)
        # logits of std ~3, as a trained LM head gives
        weight = torch.randn(vocab, hidden_size, generator=gen, device=device) * (3.0 / hidden_size**0.5)
        labels = torch.randint(vocab, (n,), generator=gen, device=device)
        return {"hidden": hidden.to(dtype), "weight": weight.to(dtype), "labels": labels}

    return make


def _step(run, backward: bool):
    """An Impl.make timing run(hidden, weight, labels) -> (log-probs, entropy): the
    forward under no_grad, or forward + backward of sum(log-probs + entropy)
    w.r.t. the hidden states and the weight."""

    def make(inputs):
        hidden, weight, labels = inputs["hidden"], inputs["weight"], inputs["labels"]
        if not backward:

            def forward():
                with torch.no_grad():
                    return run(hidden, weight, labels)

            return forward
        h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)

        def step():
            logp, entropy = run(h, w, labels)
            return torch.autograd.grad(logp.sum() + entropy.sum(), (h, w))

        return step

    return make


def _fastrl(h, w, y):
    return fastrl.linear_logprobs_and_entropy(h, w, y)


def _reference(h, w, y):
    return reference.linear_logprobs_and_entropy(h, w, y)


def _unfused(h, w, y):
    """The logits held: hidden @ weight.T in the inputs' dtype, then fastrl's log-prob kernel."""
    return fastrl.logprobs_and_entropy(h @ w.T, y)


def _peers(device: torch.device, backward: bool, quick: bool) -> list[Impl]:
    peers = [
        Impl("torch eager (fastrl.reference)", _step(_reference, backward)),
        Impl("hidden @ weight.T + fastrl.logprobs_and_entropy", _step(_unfused, backward)),
    ]
    trl, why = import_peer("trl.kernels.chunked_logprob")
    if trl is None:
        peers.append(Impl("TRL ChunkedLogProbFunction", None, why))
    else:
        # As add_fused_lm_head calls it (its vocabulary tile, trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE).
        def trl_run(h, w, y):
            out = trl.ChunkedLogProbFunction.apply(h, w, None, y, 1.0, 32768, None, 1.0, ("log_probs", "entropy"))
            return out[0], out[1]

        peers.append(Impl("TRL ChunkedLogProbFunction", _step(trl_run, backward)))
    verl, why = import_peer("verl.utils.experimental.torch_functional")
    if verl is None:
        peers.append(Impl("veRL FusedLinearForPPO", None, why))
    else:
        head = verl.FusedLinearForPPO()
        peers.append(Impl("veRL FusedLinearForPPO", _step(lambda h, w, y: head(h, w, y, 1.0), backward)))
    peers.append(compiled_reference(lambda fn: _step(fn, backward), _reference, quick))
    return peers


def _check(inputs: dict) -> float:
    """Largest error of fastrl's log-probs and entropy against the float64
    reference on the first tokens (relative to 1 + |value|)."""
    h, w, y = inputs["hidden"][:8], inputs["weight"], inputs["labels"][:8]
    got = fastrl.linear_logprobs_and_entropy(h, w, y)
    want = reference.linear_logprobs_and_entropy(h.double(), w.double(), y)
    return max(float(((g.double() - r).abs() / (1 + r.abs())).max()) for g, r in zip(got, want))


def cases(device: torch.device, *, quick: bool = False, shapes=None) -> list[Case]:
    if shapes is None:
        shapes = QUICK_SHAPES if quick else GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    hidden_size = HIDDEN["quick" if quick else device.type]
    out = []
    for n, v, dtype in shapes:
        e = torch.empty((), dtype=dtype).element_size()
        operands = (n * hidden_size + v * hidden_size) * e
        for mode in MODES:
            backward = mode.endswith("fwd+bwd")
            formula = "2*(N*H + V*H)*e + 24N" if backward else "(N*H + V*H)*e + 16N"
            min_bytes = 2 * operands + 24 * n if backward else operands + 16 * n
            impls = [Impl("fastrl", _step(_fastrl, backward)), *_peers(device, backward, quick)]
            out.append(
                Case(
                    op=mode, shape=(n, hidden_size, v), dtype=dtype, bytes_formula=formula, min_bytes=min_bytes,
                    make_inputs=_make_inputs(n, hidden_size, v, dtype), impls=impls, check=_check,
                    compiled_gate=False,
                )
            )  # fmt: skip
    return out
