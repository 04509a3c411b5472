"""Benchmark cases of the log-prob family, and the peers a user would otherwise call.

Minimum traffic per case (N rows, V vocabulary, e bytes per logit, l per label):
    logprobs fwd               N V e + N l + 4 N            (logits and labels in, fp32 log-probs out)
    logprobs fwd+bwd           3 N V e + N l + 8 N          (logits read by both passes, gradient written)
    logprobs+entropy fwd       N V e + N l + 8 N
    logprobs+entropy fwd+bwd   3 N V e + N l + 16 N         (logits read by both passes, gradient written)
"""

from __future__ import annotations

import torch

import fastrl
from fastrl import reference

from . import Case, Impl, compiled_reference, generator, grad_step, import_peer, no_grad_step

# (N, V, dtype). DESIGN.md's canonical GPU shapes; CPU shapes fit a 24 GB host
# with room for the eager peers' fp32 temporaries.
GPU_SHAPES = [(16384, 151936, torch.bfloat16), (8192, 128256, torch.bfloat16), (4096, 32000, torch.float32)]
CPU_SHAPES = [(2048, 32000, torch.float32), (512, 151936, torch.bfloat16)]
QUICK_SHAPES = [(256, 32000, torch.float32), (32, 151936, torch.bfloat16)]

MODES = ("logprobs fwd", "logprobs fwd+bwd", "logprobs+entropy fwd", "logprobs+entropy fwd+bwd")

# Sweeps (bf16): the vocabulary at n rows, and the rows at vocabulary v.
GPU_SWEEP = {"n": 4096, "vocab": (32000, 65536, 128256, 151936, 262144), "v": 151936, "rows": (1, 64, 1024, 4096, 16384)}
CPU_SWEEP = {"n": 256, "vocab": (32000, 65536, 151936, 262144), "v": 151936, "rows": (1, 16, 128, 512)}
QUICK_SWEEP = {"n": 32, "vocab": (8192, 32000, 151936), "v": 32000, "rows": (1, 16, 128)}


def _wrap(mode: str):
    """How a case of ``mode`` times run(logits, labels): forward + backward of
    sum(outputs) w.r.t. the logits, or the forward under no_grad."""
    if mode.endswith("fwd+bwd"):
        return lambda run: grad_step(lambda x, inputs: run(x, inputs["labels"]), "logits")
    return lambda run: no_grad_step(lambda inputs: run(inputs["logits"], inputs["labels"]))


def _with_entropy(mode: str) -> bool:
    return mode.startswith("logprobs+entropy")


def _fastrl(mode: str):
    if not _with_entropy(mode):
        return lambda x, y: fastrl.logprobs_from_logits(x, y)
    return lambda x, y: fastrl.logprobs_and_entropy(x, y)


def _reference(mode: str):
    if not _with_entropy(mode):
        return lambda x, y: reference.logprobs_from_logits(x, y)
    return lambda x, y: reference.logprobs_and_entropy(x, y)


def _framework_peer(framework: str, module: str, logprobs_name: str, mode: str) -> tuple:
    """A framework's own log-prob function (and its entropy_from_logits, when the
    mode computes the entropy) as a peer: (name, run(logits, labels), why unavailable)."""
    mod, why = import_peer(module)
    if mod is None:
        run = None
    elif not _with_entropy(mode):
        run = lambda x, y: getattr(mod, logprobs_name)(x, y)  # noqa: E731
    else:
        run = lambda x, y: (getattr(mod, logprobs_name)(x, y), mod.entropy_from_logits(x))  # noqa: E731
    suffix = " + entropy_from_logits" if _with_entropy(mode) else ""
    return f"{framework} {logprobs_name}{suffix}", run, why


def _log_softmax_gather(x, y):
    """The plain eager chain most trainers run today (a float32 [N, V] copy)."""
    return torch.log_softmax(x.float(), -1).gather(-1, y[:, None])


def _peers(mode: str, device: torch.device, quick: bool, wrap) -> list[Impl]:
    """Every peer of ``mode``, timed the way ``wrap`` times run(logits, labels);
    a peer that cannot run here carries the reason."""
    peers = [Impl("torch eager (fastrl.reference)", wrap(_reference(mode)))]

    def add(name: str, run, why: str | None) -> None:
        peers.append(Impl(name, wrap(run) if why is None else None, why))

    gpu_only = None if device.type == "cuda" else "GPU only (Triton)"
    if not _with_entropy(mode):
        add("torch eager log_softmax+gather", _log_softmax_gather, None)
    peers.append(compiled_reference(wrap, _reference(mode), quick))
    add(*_framework_peer("veRL", "verl.utils.torch_functional", "logprobs_from_logits", mode))
    add(*_framework_peer("TRL", "trl.trainer.utils", "selective_log_softmax", mode))
    if _with_entropy(mode):
        trl_kernels, why = import_peer("trl.kernels")
        fused = getattr(trl_kernels, "selective_log_softmax_and_entropy", None) if trl_kernels else None
        add("TRL kernels.selective_log_softmax_and_entropy", fused,
            gpu_only or why or (None if fused else "not in this TRL version"))  # fmt: skip

    if mode != "logprobs+entropy fwd":  # cross-entropy kernels return -logprob, no entropy
        liger, why = import_peer("liger_kernel.transformers.cross_entropy")
        ce = liger.LigerCrossEntropyLoss(reduction="none") if liger is not None else None
        add("Liger cross_entropy (no entropy)", lambda x, y: (ce(x, y),), why)
        flash, why = import_peer("flash_attn.ops.triton.cross_entropy")
        add("flash-attn cross_entropy (no entropy)",
            lambda x, y: flash.cross_entropy_loss(x, y, inplace_backward=False)[:1], gpu_only or why)  # fmt: skip
        quack, why = import_peer("quack.cross_entropy")
        add("quack cross_entropy (no entropy)",
            lambda x, y: (quack.cross_entropy(x, y, reduction="none"),), gpu_only or why)  # fmt: skip
    return peers


def _min_bytes(mode: str, n: int, v: int, dtype: torch.dtype, label_bytes: int = 8) -> int:
    e = torch.empty((), dtype=dtype).element_size()
    if mode == "logprobs fwd":
        return n * v * e + n * label_bytes + 4 * n
    if mode == "logprobs fwd+bwd":
        return 3 * n * v * e + n * label_bytes + 8 * n
    if mode == "logprobs+entropy fwd":
        return n * v * e + n * label_bytes + 8 * n
    return 3 * n * v * e + n * label_bytes + 16 * n


BYTES_FORMULA = {
    "logprobs fwd": "N*V*e + N*8 + 4N",
    "logprobs fwd+bwd": "3*N*V*e + N*8 + 8N",
    "logprobs+entropy fwd": "N*V*e + N*8 + 8N",
    "logprobs+entropy fwd+bwd": "3*N*V*e + N*8 + 16N",
}


def _make_inputs(n: int, v: int, dtype: torch.dtype):
    def make(device: torch.device) -> dict:
        gen = generator(device, 0)
        logits = (torch.randn(n, v, generator=gen, device=device) * 2).to(dtype)
        labels = torch.randint(v, (n,), generator=gen, device=device)
        return {"logits": logits, "labels": labels}

    return make


def _check(inputs: dict) -> float:
    """Largest error of fastrl's log-probs and entropy (relative to 1 + |value|)
    and of their gradient (relative to its largest element) against the float64
    reference on the first rows of the benchmark input. The gradient is checked
    on a float32 copy: in bf16 / fp16 its own rounding (2^-8) would hide any error."""
    x, y = inputs["logits"][:8], inputs["labels"][:8]
    err = lambda a, b: float(((a.double() - b).abs() / (1 + b.abs())).max())  # noqa: E731
    lp, ent = fastrl.logprobs_and_entropy(x, y)
    ref_lp, ref_ent = reference.logprobs_and_entropy(x.double(), y)
    weights = torch.linspace(-1.0, 1.0, x.shape[0], device=x.device)
    grads = []
    for module, logits in ((fastrl, x.float()), (reference, x.double())):
        logits = logits.requires_grad_(True)
        out_lp, out_ent = module.logprobs_and_entropy(logits, y)
        ((out_lp + out_ent) * weights.to(out_lp.dtype)).sum().backward()
        grads.append(logits.grad.double())
    grad_err = float((grads[0] - grads[1]).abs().max() / grads[1].abs().max().clamp(min=1e-30))
    return max(err(lp, ref_lp), err(ent, ref_ent), grad_err)


def cases(device: torch.device, *, quick: bool = False, shapes=None) -> list[Case]:
    """The canonical shapes (or ``shapes``) in every mode, and with the canonical
    shapes the sweeps of V and N."""
    sweep = None
    if shapes is None:
        shapes = QUICK_SHAPES if quick else GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
        sweep = QUICK_SWEEP if quick else GPU_SWEEP if device.type == "cuda" else CPU_SWEEP
    out = []
    for n, v, dtype in shapes:
        for mode in MODES:
            wrap = _wrap(mode)
            impls = [Impl("fastrl", wrap(_fastrl(mode)))]
            impls += _peers(mode, device, quick, wrap)
            out.append(
                Case(
                    op=mode, shape=(n, v), dtype=dtype, bytes_formula=BYTES_FORMULA[mode],
                    min_bytes=_min_bytes(mode, n, v, dtype), make_inputs=_make_inputs(n, v, dtype),
                    impls=impls, check=_check,
                )
            )  # fmt: skip
    return out + ([] if sweep is None else _sweep_cases(sweep))


def _sweep_cases(sweep: dict) -> list[Case]:
    """How the forward's time grows with the work: V at fixed N, then N at fixed
    V, fastrl against the plain log_softmax + gather."""
    wrap = _wrap("logprobs fwd")
    sizes = [("logprobs fwd, sweep V", sweep["n"], v) for v in sweep["vocab"]]
    sizes += [("logprobs fwd, sweep N", n, sweep["v"]) for n in sweep["rows"]]
    return [
        Case(
            op=op, shape=(n, v), dtype=torch.bfloat16, bytes_formula=BYTES_FORMULA["logprobs fwd"],
            min_bytes=_min_bytes("logprobs fwd", n, v, torch.bfloat16), make_inputs=_make_inputs(n, v, torch.bfloat16),
            impls=[
                Impl("fastrl", wrap(_fastrl("logprobs fwd"))),
                Impl("torch eager log_softmax+gather", wrap(_log_softmax_gather)),
            ],
            check=_check, sweep=True,
        )
        for op, n, v in sizes
    ]  # fmt: skip
