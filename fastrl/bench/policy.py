"""Benchmark cases of the policy-loss and KL family, and the peers a trainer
would otherwise call.

Minimum traffic per case (T = B L tokens; V vocabulary; e bytes per logit):
    policy_loss fwd+bwd            T (4 * 4 + 1) + 4 T       log_probs, old, advantages, ref (fp32) and
                                                             the mask read once, d loss / d log_probs written
    policy_loss_from_logits fwd+bwd  3 T V e + T (3 * 4 + 1 + 8)   the logits read by both passes and the
                                                             gradient written; old, advantages, ref, mask, labels
    full_kl fwd                    2 T V e + 4 T             both logits tensors read once, the KL written
"""

from __future__ import annotations

import importlib

import torch

import fastrl
from fastrl import reference

from . import Case, Impl

# DESIGN.md's canonical policy-loss shape, the from-logits and full_kl shapes.
GPU_SHAPES = {"policy": (64, 8192), "from_logits": (16, 1024, 151936), "full_kl": (8192, 151936)}
CPU_SHAPES = {"policy": (64, 8192), "from_logits": (8, 256, 32000), "full_kl": (512, 32000)}
QUICK_SHAPES = {"policy": (16, 1024), "from_logits": (2, 64, 32000), "full_kl": (64, 32000)}
KL_COEF = 0.001
OPTIONS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "kl_estimator": "low_var_kl"}


def _import(module: str):
    try:
        return importlib.import_module(module), None
    except Exception as exc:  # noqa: BLE001 - any import failure means the peer is absent here
        return None, f"not installed ({module}: {type(exc).__name__})"


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
    (what its actor runs), or (None, why)."""
    core_algos, why = _import("verl.trainer.ppo.core_algos")
    if core_algos is None:
        return None, why
    from verl.workers.config import ActorConfig

    config = ActorConfig(
        strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
        clip_ratio_low=OPTIONS["clip_ratio_low"], clip_ratio_high=OPTIONS["clip_ratio_high"],
        clip_ratio_c=OPTIONS["clip_ratio_c"], use_dynamic_bsz=False, rollout_n=1,
    )  # fmt: skip

    def run(log_probs, old, adv, mask, ref):
        pg_loss, _ = core_algos.compute_policy_loss_vanilla(old, log_probs, adv, mask, "token-mean", config=config)
        kl = core_algos.agg_loss(core_algos.kl_penalty(log_probs, ref, OPTIONS["kl_estimator"]), mask, "token-mean")
        return pg_loss + KL_COEF * kl

    return run, None


def _fastrl_policy(log_probs, old, adv, mask, ref):
    return fastrl.policy_loss(log_probs, old, adv, mask, ref_log_probs=ref, kl_coef=KL_COEF, **OPTIONS)[0]


def _reference_policy(log_probs, old, adv, mask, ref):
    return reference.policy_loss(log_probs, old, adv, mask, ref_log_probs=ref, kl_coef=KL_COEF, **OPTIONS)[0]


def _policy_step(run):
    """Times forward + backward of the loss w.r.t. the log-probs."""

    def make(inputs):
        x = inputs["log_probs"].detach().requires_grad_(True)
        rest = (inputs["old_log_probs"], inputs["advantages"], inputs["response_mask"], inputs["ref_log_probs"])
        return lambda: torch.autograd.grad(run(x, *rest), x)

    return make


def _check_policy(inputs: dict) -> float:
    args = [inputs[k] for k in ("log_probs", "old_log_probs", "advantages", "response_mask", "ref_log_probs")]
    got = _fastrl_policy(*args)
    want = _reference_policy(*[a.double() if a.is_floating_point() else a for a in args])
    return float((got.double() - want).abs() / (1 + want.abs()))


def _policy_case(shape, device, quick) -> Case:
    tokens = shape[0] * shape[1]
    impls = [
        Impl("fastrl", _policy_step(_fastrl_policy)),
        Impl("torch eager (fastrl.reference)", _policy_step(_reference_policy)),
    ]
    if quick:
        impls.append(Impl("torch.compile(reference)", None, "skipped in --quick (compile time)"))
    else:
        impls.append(Impl("torch.compile(reference)", _policy_step(torch.compile(_reference_policy, dynamic=False))))
    verl, why = _verl_policy_loss()
    impls.append(Impl("veRL vanilla + kl_penalty + agg_loss", verl and _policy_step(verl), why))
    return Case(
        op="policy_loss fwd+bwd", shape=shape, dtype=torch.float32, bytes_formula="T*(4*4+1) + 4T",
        min_bytes=tokens * 17 + 4 * tokens, make_inputs=lambda dev: _per_token(shape, dev), impls=impls,
        check=_check_policy,
    )  # fmt: skip


def _from_logits_inputs(shape, dtype):
    def make(device):
        n_rows, length, vocab = shape
        inputs = _per_token((n_rows, length), device)
        gen = torch.Generator(device="cpu").manual_seed(1)
        logits = (torch.randn(n_rows, length, vocab, generator=gen) * 2).to(dtype).to(device)
        inputs.update(logits=logits, labels=torch.randint(vocab, (n_rows, length), generator=gen).to(device))
        return inputs

    return make


def _logits_step(loss_of):
    """Times forward + backward of a loss of the logits w.r.t. the logits."""

    def make(inputs):
        x = inputs["logits"].detach().requires_grad_(True)
        return lambda: torch.autograd.grad(loss_of(x, inputs), x)

    return make


def _per_token_args(inputs):
    return inputs["old_log_probs"], inputs["advantages"], inputs["response_mask"]


def _fastrl_from_logits(x, inputs):
    return fastrl.policy_loss_from_logits(
        x, inputs["labels"], *_per_token_args(inputs), ref_log_probs=inputs["ref_log_probs"], kl_coef=KL_COEF, **OPTIONS
    )[0]


def _reference_from_logits(x, inputs):
    return reference.policy_loss_from_logits(
        x, inputs["labels"], *_per_token_args(inputs), ref_log_probs=inputs["ref_log_probs"], kl_coef=KL_COEF, **OPTIONS
    )[0]


def _logprobs_only(x, inputs):
    """The floor this op is held to: the fused log-prob kernel alone, fwd + bwd."""
    return fastrl.logprobs_from_logits(x, inputs["labels"]).sum()


def _verl_from_logits():
    verl_f, why = _import("verl.utils.torch_functional")
    policy, why_policy = _verl_policy_loss()
    if verl_f is None or policy is None:
        return None, why or why_policy

    def run(x, inputs):
        log_probs = verl_f.logprobs_from_logits(x, inputs["labels"])
        return policy(log_probs, *_per_token_args(inputs), inputs["ref_log_probs"])

    return run, None


def _from_logits_case(shape, dtype, device) -> Case:
    n_rows, length, vocab = shape
    tokens, e = n_rows * length, torch.empty((), dtype=dtype).element_size()
    verl, why = _verl_from_logits()
    impls = [
        Impl("fastrl", _logits_step(_fastrl_from_logits)),
        Impl("fastrl logprobs_from_logits alone", _logits_step(_logprobs_only)),
        Impl("torch eager (fastrl.reference)", _logits_step(_reference_from_logits)),
        Impl("veRL logprobs_from_logits + vanilla + kl_penalty + agg_loss", verl and _logits_step(verl), why),
    ]
    return Case(
        op="policy_loss_from_logits fwd+bwd", shape=shape, dtype=dtype, bytes_formula="3*T*V*e + T*(3*4+1+8)",
        min_bytes=3 * tokens * vocab * e + tokens * 21, make_inputs=_from_logits_inputs(shape, dtype), impls=impls,
    )  # fmt: skip


def _full_kl_inputs(shape, dtype):
    def make(device):
        gen = torch.Generator(device="cpu").manual_seed(2)
        logits = torch.randn(shape, generator=gen) * 2
        ref = logits + 0.3 * torch.randn(shape, generator=gen)
        return {"logits": logits.to(dtype).to(device), "ref_logits": ref.to(dtype).to(device)}

    return make


def _no_grad(run):
    def make(inputs):
        x, y = inputs["logits"], inputs["ref_logits"]

        def step():
            with torch.no_grad():
                return run(x, y)

        return step

    return make


def _kl_div(x, y):
    """The usual eager formulation: F.kl_div on log-softmaxes (fp32 copies)."""
    logp = torch.log_softmax(x.float(), dim=-1)
    logq = torch.log_softmax(y.float(), dim=-1)
    return torch.nn.functional.kl_div(logq, logp, reduction="none", log_target=True).sum(-1)


def _check_full_kl(inputs: dict) -> float:
    x, y = inputs["logits"][:8], inputs["ref_logits"][:8]
    got, want = fastrl.full_kl(x, y), reference.full_kl(x.double(), y.double())
    return float(((got.double() - want).abs() / (1 + want.abs())).max())


def _full_kl_case(shape, dtype, quick) -> Case:
    n, v = shape
    e = torch.empty((), dtype=dtype).element_size()
    impls = [
        Impl("fastrl", _no_grad(fastrl.full_kl)),
        Impl("torch eager (fastrl.reference)", _no_grad(reference.full_kl)),
        Impl("torch eager F.kl_div(log_softmax)", _no_grad(_kl_div)),
    ]
    if quick:
        impls.append(Impl("torch.compile(reference)", None, "skipped in --quick (compile time)"))
    else:
        impls.append(Impl("torch.compile(reference)", _no_grad(torch.compile(reference.full_kl, dynamic=False))))
    return Case(
        op="full_kl fwd", shape=shape, dtype=dtype, bytes_formula="2*N*V*e + 4N", min_bytes=2 * n * v * e + 4 * n,
        make_inputs=_full_kl_inputs(shape, dtype), impls=impls, check=_check_full_kl,
    )  # fmt: skip


def cases(device: torch.device, *, quick: bool = False, shapes=None) -> list[Case]:
    """``shapes`` (from ``--shape``) are not used by this family: its cases have
    their own canonical shapes."""
    table = QUICK_SHAPES if quick else GPU_SHAPES if device.type == "cuda" else CPU_SHAPES
    logits_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return [
        _policy_case(table["policy"], device, quick),
        _from_logits_case(table["from_logits"], logits_dtype, device),
        _full_kl_case(table["full_kl"], torch.bfloat16, quick),
    ]
