"""Benchmark cases of the policy-loss family, and the peers a trainer would
otherwise call.

Minimum traffic per case (T = B L tokens; V vocabulary; e bytes per logit):
    policy_loss fwd+bwd              T (4 * 4 + 1) + 4 T       log_probs, old, advantages, ref (fp32) and
                                                               the mask read once, d loss / d log_probs written
    policy_loss_from_logits fwd+bwd  3 T V e + T (3 * 4 + 1 + 8)   the logits read by both passes and the
                                                               gradient written; old, advantages, ref, mask, labels
"""

from __future__ import annotations

import torch

import fastrl
from fastrl import reference

from . import Case, Impl, compiled_reference, generator, grad_step, import_peer

# DESIGN.md's canonical policy-loss shape, and the from-logits shape (16384 tokens).
GPU_SHAPES = {"policy": (64, 8192), "from_logits": (16, 1024, 151936)}
CPU_SHAPES = {"policy": (64, 8192), "from_logits": (8, 256, 32000)}
# The quick policy shape is the canonical one: at 16 x 1024 tokens the call's
# fixed Python and autograd cost (~0.6 ms) decided the ratios, and a CI run
# times it in under a second.
QUICK_SHAPES = {"policy": (64, 8192), "from_logits": (2, 64, 32000)}
KL_COEF = 0.001
OPTIONS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "kl_estimator": "low_var_kl"}
PER_TOKEN = ("old_log_probs", "advantages", "response_mask", "ref_log_probs")


def _per_token(shape: tuple[int, int], device: torch.device) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)
    n_rows, length = shape
    logp = -torch.rand(shape, generator=gen) * 4
    lengths = torch.randint(length // 4, length + 1, (n_rows,), generator=gen)
    return {
        "log_probs": logp.to(device),
        "old_log_probs": (logp + 0.1 * torch.randn(shape, generator=gen)).to(device),
        "advantages": torch.randn(n_rows, 1, generator=gen).expand(shape).contiguous().to(device),
        "response_mask": (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).to(device),
        "ref_log_probs": (logp + 0.2 * torch.randn(shape, generator=gen)).to(device),
    }


def _verl_policy_loss():
    """veRL's eager path: compute_policy_loss_vanilla + kl_penalty + agg_loss
    (what its actor runs), as run(log_probs, inputs), or (None, why)."""
    core_algos, why = import_peer("verl.trainer.ppo.core_algos")
    if core_algos is None:
        return None, why
    from verl.workers.config import ActorConfig

    config = ActorConfig(
        strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
        clip_ratio_low=OPTIONS["clip_ratio_low"], clip_ratio_high=OPTIONS["clip_ratio_high"],
        clip_ratio_c=OPTIONS["clip_ratio_c"],
    )  # fmt: skip

    def run(log_probs, inputs):
        old, adv, mask, ref = (inputs[k] for k in PER_TOKEN)
        pg_loss, _ = core_algos.compute_policy_loss_vanilla(old, log_probs, adv, mask, "token-mean", config=config)
        kl = core_algos.agg_loss(core_algos.kl_penalty(log_probs, ref, OPTIONS["kl_estimator"]), mask, "token-mean")
        return pg_loss + KL_COEF * kl

    return run, None


def _policy_with(module):
    """run(log_probs, inputs) -> loss of fastrl or of the reference."""

    def run(log_probs, inputs):
        old, adv, mask, ref = (inputs[k] for k in PER_TOKEN)
        return module.policy_loss(log_probs, old, adv, mask, ref_log_probs=ref, kl_coef=KL_COEF, **OPTIONS)[0]

    return run


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.detach().double() - want.detach()).abs() / (1 + want.detach().abs())).max())


def _check_policy(inputs: dict) -> float:
    as64 = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    got = _policy_with(fastrl)(inputs["log_probs"], inputs)
    return _relative_error(got, _policy_with(reference)(as64["log_probs"], as64))


def _policy_case(shape, quick) -> Case:
    tokens = shape[0] * shape[1]
    step = lambda run: grad_step(run, "log_probs")  # noqa: E731
    impls = [
        Impl("fastrl", step(_policy_with(fastrl))),
        Impl("torch eager (fastrl.reference)", step(_policy_with(reference))),
    ]
    impls.append(compiled_reference(step, _policy_with(reference), quick))
    verl, why = _verl_policy_loss()
    impls.append(Impl("veRL vanilla + kl_penalty + agg_loss", verl and step(verl), why))
    return Case(
        op="policy_loss fwd+bwd", shape=shape, dtype=torch.float32, bytes_formula="T*(4*4+1) + 4T",
        min_bytes=tokens * 17 + 4 * tokens, make_inputs=lambda dev: _per_token(shape, dev), impls=impls,
        check=_check_policy,
    )  # fmt: skip


def _from_logits_inputs(shape, dtype):
    def make(device):
        n_rows, length, vocab = shape
        inputs = _per_token((n_rows, length), device)
        gen = generator(device, 1)
        logits = (torch.randn(n_rows, length, vocab, generator=gen, device=device) * 2).to(dtype)
        inputs.update(logits=logits, labels=torch.randint(vocab, (n_rows, length), generator=gen, device=device))
        if device.type == "cuda":  # Liger's GRPO loss reads the model's [B, L + 1, V] logits
            inputs["logits_with_next"] = torch.cat([logits, logits[:, -1:]], dim=1)
        return inputs

    return make


def _liger_grpo(device: torch.device):
    """Liger-Kernel's Triton GRPO loss (per-token loss, KL as k3 with beta),
    token-mean over the mask, or (None, why)."""
    liger, why = import_peer("liger_kernel.transformers.grpo_loss")
    if liger is None:
        return None, why
    if device.type != "cuda":
        return None, "GPU only (Triton)"

    def run(logits_with_next, inputs):
        old, adv, mask, ref = (inputs[k] for k in PER_TOKEN)
        out = liger.triton_grpo_loss(
            logits_with_next, old, ref, inputs["labels"], adv[:, 0].contiguous(), mask.int(), temperature=1.0,
            beta=KL_COEF, eps_low=OPTIONS["clip_ratio_low"], eps_high=OPTIONS["clip_ratio_high"], inplace=False,
        )  # fmt: skip
        per_token = out[0] if isinstance(out, tuple) else out
        return (per_token * mask).sum() / mask.sum()

    return run, None


def _from_logits_with(module):
    """run(logits, inputs) -> loss of fastrl or of the reference, from the logits."""

    def run(logits, inputs):
        old, adv, mask, ref = (inputs[k] for k in PER_TOKEN)
        return module.policy_loss_from_logits(
            logits, inputs["labels"], old, adv, mask, ref_log_probs=ref, kl_coef=KL_COEF, **OPTIONS
        )[0]

    return run


def _check_from_logits(inputs: dict) -> float:
    first = {k: v[:1] for k, v in inputs.items()}  # one sequence
    as64 = {k: v.double() if v.is_floating_point() else v for k, v in first.items()}
    got = _from_logits_with(fastrl)(first["logits"], first)
    return _relative_error(got, _from_logits_with(reference)(as64["logits"], as64))


def _verl_from_logits():
    verl_f, why = import_peer("verl.utils.torch_functional")
    policy, why_policy = _verl_policy_loss()
    if verl_f is None or policy is None:
        return None, why or why_policy
    return (lambda logits, inputs: policy(verl_f.logprobs_from_logits(logits, inputs["labels"]), inputs)), None


def _from_logits_case(shape, dtype, device) -> Case:
    n_rows, length, vocab = shape
    tokens, e = n_rows * length, torch.empty((), dtype=dtype).element_size()
    step = lambda run: grad_step(run, "logits")  # noqa: E731
    verl, why = _verl_from_logits()
    impls = [
        Impl("fastrl", step(_from_logits_with(fastrl))),
        # The floor this op is held to: the fused log-prob kernel alone, fwd + bwd.
        Impl("fastrl logprobs_from_logits alone", step(lambda x, inp: fastrl.logprobs_from_logits(x, inp["labels"]))),
        Impl("torch eager (fastrl.reference)", step(_from_logits_with(reference))),
        Impl("veRL logprobs_from_logits + vanilla + kl_penalty + agg_loss", verl and step(verl), why),
    ]
    liger, why = _liger_grpo(device)
    impls.append(Impl("Liger triton_grpo_loss (no dual clip)", liger and grad_step(liger, "logits_with_next"), why))
    return Case(
        op="policy_loss_from_logits fwd+bwd", shape=shape, dtype=dtype, bytes_formula="3*T*V*e + T*(3*4+1+8)",
        min_bytes=3 * tokens * vocab * e + tokens * 21, make_inputs=_from_logits_inputs(shape, dtype), impls=impls,
        check=_check_from_logits,
    )  # fmt: skip


def cases(device: torch.device, *, quick: bool = False, shapes=None) -> list[Case]:
    """``shapes`` (from ``--shape``) are not used by this family: its cases have
    their own canonical shapes."""
    table = QUICK_SHAPES if quick else GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    logits_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return [_policy_case(table["policy"], quick), _from_logits_case(table["from_logits"], logits_dtype, device)]
