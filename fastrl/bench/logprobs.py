"""Benchmark cases of the log-prob family, and the peers a user would otherwise call.

Minimum traffic per case (N rows, V vocabulary, e bytes per logit, l per label):
    logprobs fwd               N V e + N l + 4 N            (logits and labels in, fp32 log-probs out)
    logprobs+entropy fwd       N V e + N l + 8 N
    logprobs+entropy fwd+bwd   3 N V e + N l + 16 N         (logits read by both passes, gradient written)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

import fastrl
from fastrl import reference

from . import Case, Impl

# (N, V, dtype). DESIGN.md's canonical GPU shapes; CPU shapes fit a 24 GB host
# with room for the eager peers' fp32 temporaries.
GPU_SHAPES = [(16384, 151936, torch.bfloat16), (8192, 128256, torch.bfloat16), (4096, 32000, torch.float32)]
CPU_SHAPES = [(2048, 32000, torch.float32), (512, 151936, torch.bfloat16)]
QUICK_SHAPES = [(256, 32000, torch.float32), (32, 151936, torch.bfloat16)]

MODES = ("logprobs fwd", "logprobs+entropy fwd", "logprobs+entropy fwd+bwd")


def _import(module: str):
    try:
        return importlib.import_module(module), None
    except Exception as exc:  # noqa: BLE001 - any import failure means the peer is absent here
        return None, f"not installed ({module}: {type(exc).__name__})"


def _fwd_bwd(run: Callable[[torch.Tensor, torch.Tensor], tuple]) -> Callable[[dict], Callable[[], object]]:
    """Times forward + backward of sum(logprob) + sum(entropy) w.r.t. the logits."""

    def make(inputs):
        x = inputs["logits"].detach().requires_grad_(True)
        labels = inputs["labels"]

        def step():
            outs = run(x, labels)
            return torch.autograd.grad(sum(o.sum() for o in outs), x)

        return step

    return make


def _no_grad(run: Callable[[torch.Tensor, torch.Tensor], object]) -> Callable[[dict], Callable[[], object]]:
    def make(inputs):
        x, labels = inputs["logits"], inputs["labels"]

        def step():
            with torch.no_grad():
                return run(x, labels)

        return step

    return make


def _fastrl(mode: str):
    if mode == "logprobs fwd":
        return lambda x, y: fastrl.logprobs_from_logits(x, y)
    return lambda x, y: fastrl.logprobs_and_entropy(x, y)


def _reference(mode: str):
    if mode == "logprobs fwd":
        return lambda x, y: reference.logprobs_from_logits(x, y)
    return lambda x, y: reference.logprobs_and_entropy(x, y)


def _peers(mode: str, device: torch.device, quick: bool) -> list[tuple[str, Callable | None, str | None]]:
    """(name, run(logits, labels) -> outputs, why unavailable) for each peer."""
    peers: list[tuple[str, Callable | None, str | None]] = [("torch eager (fastrl.reference)", _reference(mode), None)]
    if mode == "logprobs fwd":  # the plain chain most trainers run today
        peers.append(("torch eager log_softmax+gather", lambda x, y: torch.log_softmax(x.float(), -1).gather(-1, y[:, None]), None))
    if quick:
        peers.append(("torch.compile(reference)", None, "skipped in --quick (compile time)"))
    else:
        peers.append(("torch.compile(reference)", torch.compile(_reference(mode), dynamic=False), None))

    verl, why = _import("verl.utils.torch_functional")
    if mode == "logprobs fwd":
        peers.append(("veRL logprobs_from_logits", verl and (lambda x, y: verl.logprobs_from_logits(x, y)), why))
    else:
        peers.append((
            "veRL logprobs_from_logits + entropy_from_logits",
            verl and (lambda x, y: (verl.logprobs_from_logits(x, y), verl.entropy_from_logits(x))), why,
        ))  # fmt: skip

    trl, why = _import("trl.trainer.utils")
    if mode == "logprobs fwd":
        peers.append(("TRL selective_log_softmax", trl and (lambda x, y: trl.selective_log_softmax(x, y)), why))
    else:
        peers.append((
            "TRL selective_log_softmax + entropy_from_logits",
            trl and (lambda x, y: (trl.selective_log_softmax(x, y), trl.entropy_from_logits(x))), why,
        ))  # fmt: skip
        trl_kernels, why = _import("trl.kernels")
        fused = getattr(trl_kernels, "selective_log_softmax_and_entropy", None) if trl_kernels else None
        peers.append((
            "TRL kernels.selective_log_softmax_and_entropy",
            fused and (lambda x, y: fused(x, y)), why or (None if fused else "not in this TRL version"),
        ))  # fmt: skip

    if mode != "logprobs+entropy fwd":  # cross-entropy kernels return -logprob, no entropy
        liger, why = _import("liger_kernel.transformers.cross_entropy")
        if liger is not None:
            ce = liger.LigerCrossEntropyLoss(reduction="none")
            peers.append(("Liger cross_entropy (no entropy)", lambda x, y: (ce(x, y),), None))
        else:
            peers.append(("Liger cross_entropy (no entropy)", None, why))
        flash, why = _import("flash_attn.ops.triton.cross_entropy")
        if device.type != "cuda":
            why = "GPU only"
        peers.append((
            "flash-attn cross_entropy (no entropy)",
            None if why else (lambda x, y: flash.cross_entropy_loss(x, y, inplace_backward=False)[:1]), why,
        ))  # fmt: skip
        quack, why = _import("quack.cross_entropy")
        if device.type != "cuda":
            why = "GPU only"
        peers.append(("quack cross_entropy (no entropy)", None if why else (lambda x, y: (quack.cross_entropy(x, y, reduction="none"),)), why))
    return peers


def _min_bytes(mode: str, n: int, v: int, dtype: torch.dtype, label_bytes: int = 8) -> int:
    e = torch.empty((), dtype=dtype).element_size()
    if mode == "logprobs fwd":
        return n * v * e + n * label_bytes + 4 * n
    if mode == "logprobs+entropy fwd":
        return n * v * e + n * label_bytes + 8 * n
    return 3 * n * v * e + n * label_bytes + 16 * n


BYTES_FORMULA = {
    "logprobs fwd": "N*V*e + N*8 + 4N",
    "logprobs+entropy fwd": "N*V*e + N*8 + 8N",
    "logprobs+entropy fwd+bwd": "3*N*V*e + N*8 + 16N",
}


def _make_inputs(n: int, v: int, dtype: torch.dtype):
    def make(device: torch.device) -> dict:
        gen = torch.Generator(device="cpu").manual_seed(0)
        logits = (torch.randn(n, v, generator=gen, dtype=torch.float32) * 2).to(dtype).to(device)
        labels = torch.randint(v, (n,), generator=gen).to(device)
        return {"logits": logits, "labels": labels}

    return make


def _check(inputs: dict) -> float:
    """Largest relative error of fastrl's log-probs and entropy against the
    float64 reference on the first rows of the benchmark input."""
    x, y = inputs["logits"][:8], inputs["labels"][:8]
    lp, ent = fastrl.logprobs_and_entropy(x, y)
    ref_lp, ref_ent = reference.logprobs_and_entropy(x.double(), y)
    err = lambda a, b: float(((a.double() - b).abs() / (1 + b.abs())).max())  # noqa: E731
    return max(err(lp, ref_lp), err(ent, ref_ent))


def _native_cuda_impl(wrap, mode: str) -> Impl:
    from fastrl._backend import native_cuda

    if not native_cuda():
        return Impl("fastrl CUDA C++", None, "fastrl._C built without CUDA")

    def run(x, y):
        with fastrl.use_backend("native"):
            return _fastrl(mode)(x, y)

    return Impl("fastrl CUDA C++", wrap(run))


def cases(device: torch.device, *, quick: bool = False, shapes=None) -> list[Case]:
    if shapes is None:
        shapes = QUICK_SHAPES if quick else GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    out = []
    for n, v, dtype in shapes:
        for mode in MODES:
            wrap = _fwd_bwd if mode.endswith("fwd+bwd") else _no_grad
            impls = [Impl("fastrl", wrap(_fastrl(mode)))]
            if device.type == "cuda":  # the CUDA C++ kernel, against the default Triton one
                impls.append(_native_cuda_impl(wrap, mode))
            for name, run, why in _peers(mode, device, quick):
                impls.append(Impl(name, wrap(run) if run is not None else None, why))
            out.append(
                Case(
                    op=mode, shape=(n, v), dtype=dtype, bytes_formula=BYTES_FORMULA[mode],
                    min_bytes=_min_bytes(mode, n, v, dtype), make_inputs=_make_inputs(n, v, dtype),
                    impls=impls, check=_check if mode == "logprobs+entropy fwd" else None,
                )
            )  # fmt: skip
    return out
