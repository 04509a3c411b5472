"""fastrl.integrations: veRL, TRL and OpenRLHF patched with fastrl's ops.

For every function an integration replaces, the framework's own function before
patching and the one its module holds after patching give the same result on the
same random fp32 inputs, to 1e-5 (values, gradients, metrics, dtypes; entropies to
the framework's own float32 rounding, _entropy_tolerance), without falling back; a
short real code path of each framework runs patched; calls fastrl does not
reproduce run the framework's own code (the fallback) and say so; unpatch
restores every reference. Inputs stay where fastrl's semantics and the
frameworks' agree (finite values, at least one valid token: see the integration
modules' docstrings). The shared machinery is also tested on a fake framework, so
that part runs with no framework installed. A framework's tests skip, saying why,
only when that framework is not installed (make setup installs all three).
"""

from __future__ import annotations

import collections
import functools
import importlib
import importlib.metadata
import importlib.util
import itertools
import math
import os
import subprocess
import sys
import types
import warnings
from types import SimpleNamespace

import pytest
import torch
from conftest import backend_params

import fastrl
from fastrl import integrations
from fastrl.integrations import (
    FallbackWarning,
    Framework,
    Target,
    UnsupportedVersionError,
)

os.environ.setdefault("VERL_USE_EXTERNAL_PLUGINS", "none")  # no plugin scan at veRL's import
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

RTOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_fallbacks():
    integrations.reset_fallbacks()
    yield


def _require(module: str, display: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{display} is not installed (make setup installs it)")


# ------------------------------------------------------------------ comparison helpers


def _leaves(out):
    """Tensors and floats of a (nested) result, in order; dict keys are kept apart."""
    if isinstance(out, dict):
        return [(key if k is None else f"{key}{k}", v) for key in sorted(out) for k, v in _leaves(out[key])]
    if isinstance(out, (tuple, list)):
        return [(f"[{i}]" + ("" if k is None else str(k)), v) for i, item in enumerate(out) for k, v in _leaves(item)]
    return [(None, out)]


def _run(fn, call, inputs, grad):
    """``call(fn, **inputs)`` on fresh copies (those named in ``grad`` require grad);
    returns (result, gradients of sum(w * outputs) w.r.t. the ``grad`` inputs)."""
    copies = {k: (v.detach().clone().requires_grad_(k in grad) if isinstance(v, torch.Tensor) else v)
              for k, v in inputs.items()}  # fmt: skip
    out = call(fn, **copies)
    generator = torch.Generator().manual_seed(1234)
    total = 0.0
    for _, leaf in _leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            weights = torch.randn(leaf.shape, generator=generator, dtype=torch.float64).to(leaf.dtype)
            total = total + (leaf * weights).sum()
    targets = [copies[k] for k in grad]
    grads = torch.autograd.grad(total, targets, allow_unused=True) if targets and torch.is_tensor(total) else []
    return out, list(zip(grad, grads))


def _close(actual, expected, what, rtol=RTOL):
    if expected is None or actual is None:
        assert actual is None and expected is None, f"{what}: {actual} vs {expected}"
        return
    if isinstance(expected, float):
        assert type(actual) is float, f"{what}: the framework returns a Python float, got {type(actual).__name__}"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype, (
            f"{what}: dtype {getattr(actual, 'dtype', type(actual))} vs the framework's {expected.dtype}"
        )
        assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    a, e = torch.as_tensor(actual).detach().double(), torch.as_tensor(expected).detach().double()
    assert torch.equal(a.isnan(), e.isnan()), f"{what}: NaN pattern differs"
    ok = a.isnan()
    assert torch.allclose(a[~ok], e[~ok], rtol=rtol, atol=rtol), f"{what}: patched {a} vs original {e}"


def _assert_same(after, before, what, rtol=RTOL):
    (out_a, grads_a), (out_b, grads_b) = after, before
    leaves_a, leaves_b = _leaves(out_a), _leaves(out_b)
    assert [k for k, _ in leaves_a] == [k for k, _ in leaves_b], f"{what}: result structure differs"
    assert len(leaves_a) == len(leaves_b), f"{what}: result structure differs"
    for (key, a), (_, b) in zip(leaves_a, leaves_b):
        _close(a, b, f"{what} {key if key is not None else 'output'}", rtol)
    for (name, a), (_, b) in zip(grads_a, grads_b):
        _close(a, b, f"{what} grad {name}", rtol)


def _parity(integration, get, call, inputs, grad=(), what="", rtol=RTOL):
    """The framework's function before patching vs after, on the same inputs."""
    integration.unpatch()
    original = get()
    assert not hasattr(original, "__fastrl_original__"), f"{what} is patched before the test"
    before = _run(original, call, inputs, grad)
    integration.patch()
    replacement = get()
    assert getattr(replacement, "__fastrl_original__", None) is original, f"{what} was not replaced"
    after = _run(replacement, call, inputs, grad)
    assert not integrations.fallbacks, f"{what}: fell back to the framework's code: {dict(integrations.fallbacks)}"
    _assert_same(after, before, what, rtol)
    return after, before


def _fallback_matches(integration, get, call, inputs, reason_part, grad=()):
    """A call fastrl does not reproduce: the patched function warns, counts the
    fallback and returns exactly the framework's result."""
    integration.unpatch()
    before = _run(get(), call, inputs, grad)
    integration.patch()
    integrations.reset_fallbacks()
    with pytest.warns(FallbackWarning, match=reason_part):
        after = _run(get(), call, inputs, grad)
    assert any(reason_part in key for key in integrations.fallbacks), dict(integrations.fallbacks)
    # The framework's own function may call others that are patched (veRL's vanilla loss calls agg_loss).
    _assert_same(after, before, "fallback")


def _per_token_inputs(shape=(6, 40), spread=(0.01, 0.1, 0.5, 1.0, 3.0, 8.0)):
    n_rows, length = shape
    logp = -torch.rand(shape) * 5
    old = logp + torch.randn(shape) * torch.tensor(spread)[torch.arange(n_rows) % len(spread), None]
    adv = torch.randn(n_rows, 1) + 0.2 * torch.randn(shape)
    adv[:, ::7] = 0.0
    lengths = torch.randint(1, length + 1, (n_rows,))
    mask = torch.arange(length)[None] < lengths[:, None]
    mask[2] = False  # a fully masked sequence
    return {
        "log_probs": logp, "old_log_probs": old, "advantages": adv, "mask": mask,
        "ref_log_probs": logp + 0.3 * torch.randn(shape), "entropy": torch.rand(shape) * 3,
        "weights": torch.rand(shape) * 2, "values": torch.randn(shape),
    }  # fmt: skip


def _logits(shape=(3, 17, 1000), std=3.0):
    return torch.randn(*shape) * std


def _entropy_tolerance(logits: torch.Tensor) -> float:
    """Tolerance of an entropy and its gradient as the frameworks compute them in
    float32 (softmax, a sum over V, autograd): each gradient entry rounds within
    about log2(V) unit roundoffs u = 2^-24 of sum_k p_k |x_k| <= max |x|, times
    _run's weight on its row (|w| <= 5: a standard normal per output row); a
    factor 4 for the few such steps. Bound: 4 log2(V) u max|x| 5, 1.6e-4 at
    std-3 logits, V = 1000 (veRL's entropy_from_logits was seen 1.6e-5 off the
    float64 gradient, fastrl's 1.5e-7); never below RTOL."""
    return max(RTOL, 4 * math.log2(logits.shape[-1]) * 2**-24 * logits.abs().max().item() * 5)


# ------------------------------------------------------------- the shared machinery


class _FakeLoss:
    def forward(self, x, scale=2.0):
        return ("framework", x * scale)


@pytest.fixture
def fake(monkeypatch):
    """A fake framework 'fastrl_fake_fw' 1.2.3: ops.logprob (also in REGISTRY and
    imported by name by fastrl_fake_fw.user, and under an alias), ops.Loss.forward."""

    def logprob(x, y=1):
        return ("framework", x, y)

    package = types.ModuleType("fastrl_fake_fw")
    package.__version__ = "1.2.3"
    ops = types.ModuleType("fastrl_fake_fw.ops")
    ops.logprob = logprob
    ops.Loss = type("Loss", (_FakeLoss,), {"forward": _FakeLoss.forward})
    ops.REGISTRY = {"a": logprob, "other": len}
    user = types.ModuleType("fastrl_fake_fw.user")
    for module in (package, ops, user):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    user.logprob = sys.modules["fastrl_fake_fw.ops"].logprob  # what `from fastrl_fake_fw.ops import logprob` does
    user.alias = logprob

    def make_logprob(original):
        def logprob(x, y=1):
            if x == "reject":
                return integrations.delegate("fake", "logprob", original, (x, y), {}, lambda: int("x"))
            return ("fastrl", x, y)

        return logprob

    def make_forward(original):
        def forward(self, x, scale=2.0):
            return ("fastrl", x * scale)

        return forward

    framework = Framework(
        name="fastrl_fake_fw", display="FakeFW", distribution="fastrl-fake-fw-not-installed",
        supported=((1, 2), (1, 3)), tested="1.2.3",
        targets=(
            Target("lp", "fastrl_fake_fw.ops", "logprob", make_logprob, ("fastrl_fake_fw.ops:REGISTRY",)),
            Target("loss", "fastrl_fake_fw.ops", "Loss.forward", make_forward),
        ),
    )  # fmt: skip
    yield SimpleNamespace(framework=framework, ops=ops, user=user, original=logprob, package=package)
    integrations.unpatch(framework)


def test_patch_replaces_by_name_everywhere_and_unpatch_restores(fake):
    ops, user, original = fake.ops, fake.user, fake.original
    loss = ops.Loss()  # built before the patch: the class's method is replaced
    where = integrations.patch(fake.framework)
    assert ops.logprob(3) == ("fastrl", 3, 1) and user.logprob(3) == ("fastrl", 3, 1)
    assert ops.REGISTRY["a"](3) == ("fastrl", 3, 1) and ops.REGISTRY["other"] is len
    assert loss.forward(2) == ("fastrl", 4.0)
    assert user.alias is original, "only the original name is swapped, not aliases"
    assert ops.logprob.__fastrl_original__ is original and ops.logprob.__wrapped__ is original
    assert ops.logprob.__name__ == "logprob"
    assert set(where) == {"lp", "loss"}
    assert "fastrl_fake_fw.user.logprob" in where["lp"] and "fastrl_fake_fw.ops.REGISTRY['a']" in where["lp"]
    assert integrations.patched(fake.framework) == {"fastrl_fake_fw": ["lp", "loss"]}

    integrations.unpatch(fake.framework)
    assert ops.logprob is original and user.logprob is original and ops.REGISTRY["a"] is original
    assert loss.forward(2) == ("framework", 4.0)
    assert integrations.patched(fake.framework) == {"fastrl_fake_fw": []}
    integrations.unpatch(fake.framework)  # a no-op


def test_patch_is_idempotent_and_late_imports_get_the_replacement(fake, monkeypatch):
    first = integrations.patch(fake.framework)
    replacement = fake.ops.logprob
    assert integrations.patch(fake.framework) == first
    assert fake.ops.logprob is replacement and replacement.__fastrl_original__ is fake.original
    late = types.ModuleType("fastrl_fake_fw.late")
    monkeypatch.setitem(sys.modules, late.__name__, late)
    late.logprob = importlib.import_module("fastrl_fake_fw.ops").logprob  # `from fastrl_fake_fw.ops import logprob`
    assert late.logprob is replacement
    integrations.unpatch(fake.framework)
    assert late.logprob is fake.original, "a module imported after the patch is restored too"


def test_ops_selection(fake):
    assert integrations.patch(fake.framework, ops=["loss"]).keys() == {"loss"}
    assert fake.ops.logprob is fake.original and fake.ops.Loss().forward(1) == ("fastrl", 2.0)
    integrations.patch(fake.framework, ops="lp")
    assert integrations.patched(fake.framework) == {"fastrl_fake_fw": ["loss", "lp"]}
    integrations.unpatch(fake.framework, ops=["loss"])
    assert fake.ops.Loss().forward(1) == ("framework", 2.0) and fake.ops.logprob(1)[0] == "fastrl"
    with pytest.raises(ValueError, match=r"unknown op\(s\) 'logprobs'.*'lp', 'loss'"):
        integrations.patch(fake.framework, ops=["logprobs"])


def test_unsupported_version_names_it_and_patches_nothing(fake):
    fake.package.__version__ = "1.4.0"
    with pytest.raises(UnsupportedVersionError, match=r"supports FakeFW 1\.2\.x .*installed FakeFW is 1\.4\.0"):
        integrations.patch(fake.framework)
    assert fake.ops.logprob is fake.original


def test_layout_mismatch_names_the_version_and_patches_nothing(fake):
    fake.ops.Loss.forward = lambda self, x: x  # another signature
    with pytest.raises(UnsupportedVersionError, match=r"FakeFW 1\.2\.3, fastrl_fake_fw\.ops\.Loss\.forward takes"):
        integrations.patch(fake.framework)
    assert fake.ops.logprob is fake.original, "nothing changes when one target does not fit"
    del fake.ops.Loss
    with pytest.raises(UnsupportedVersionError, match=r"FakeFW 1\.2\.3 has no fastrl_fake_fw\.ops\.Loss\.forward"):
        integrations.patch(fake.framework)


def test_not_installed():
    framework = Framework("fastrl_absent_fw", "AbsentFW", "fastrl-absent-fw", ((1, 0), (2, 0)), "1.0.0")
    with pytest.raises(ModuleNotFoundError, match="AbsentFW is not installed"):
        integrations.patch(framework)


def test_rejected_calls_fall_back_once_announced(fake):
    integrations.patch(fake.framework)
    with pytest.warns(FallbackWarning, match="fastrl's argument checks reject the call.*ValueError"):
        assert fake.ops.logprob("reject") == ("framework", "reject", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fake.ops.logprob("reject") == ("framework", "reject", 1)  # announced once
    assert integrations.fallbacks == {"fake.logprob: fastrl's argument checks reject the call": 2}


# --------------------------------------------------------------------------------- veRL


@pytest.fixture
def verl():
    _require("verl", "veRL")
    env = SimpleNamespace(
        core=importlib.import_module("verl.trainer.ppo.core_algos"),
        F=importlib.import_module("verl.utils.torch_functional"),
        ActorConfig=importlib.import_module("verl.workers.config").ActorConfig,
        integration=importlib.import_module("fastrl.integrations.verl"),
    )
    # Modules of veRL's workers that import the functions by name (their imports need
    # pillow, which the bench extra brings): loaded before the patch, as a trainer's are.
    env.losses = importlib.import_module("verl.workers.utils.losses")  # agg_loss, kl_penalty, get_policy_loss_fn
    env.rollout = importlib.import_module("verl.workers.rollout.naive.naive_rollout")  # logprobs_from_logits
    env.integration.unpatch()
    yield env
    env.integration.unpatch()


def _verl_config(env, global_info=None, **overrides):
    options = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}
    options.update(overrides)
    return env.ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                           global_batch_info=dict(global_info or {}), **options)  # fmt: skip


VERL_GLOBAL = [{}, {"dp_size": 2, "batch_num_tokens": 150, "global_batch_size": 9, "loss_scale_factor": 32}]


@pytest.mark.parametrize("inplace", [True, False])
def test_verl_logprobs_from_logits(verl, inplace):
    # A non-leaf copy: with inplace_backward the gradient overwrites the logits passed in.
    call = lambda fn, logits, labels: fn(logits * 1.0, labels, inplace)  # noqa: E731
    inputs = {"logits": _logits(), "labels": torch.randint(1000, (3, 17))}
    _parity(verl.integration, lambda: verl.F.logprobs_from_logits, call, inputs, ["logits"], "logprobs_from_logits")
    assert verl.rollout.logprobs_from_logits.__fastrl_original__ is verl.F.logprobs_from_logits.__wrapped__


def test_verl_entropy(verl):
    inputs = {"logits": _logits()}
    _parity(verl.integration, lambda: verl.F.entropy_from_logits, lambda fn, logits: fn(logits), inputs, ["logits"],
            "entropy_from_logits", rtol=_entropy_tolerance(inputs["logits"]))  # fmt: skip
    chunked = lambda fn, logits: fn(logits, chunk_size=8)  # noqa: E731
    inputs = {"logits": _logits((37, 300))}
    _parity(verl.integration, lambda: verl.F.entropy_from_logits_with_chunking, chunked, inputs, ["logits"],
            "entropy_from_logits_with_chunking", rtol=_entropy_tolerance(inputs["logits"]))  # fmt: skip


def test_verl_sum_pi_squared(verl):
    """calculate_sum_pi_squared_from_logits: veRL's exp(logsumexp(2x) - 2 logsumexp(x))
    in float32 errs by its log-sum-exps' rounding, each within _entropy_tolerance's
    4 log2(V) u max|2x| (times the weights' size, as there): that bound, doubled."""
    inputs = {"logits": _logits()}
    _parity(verl.integration, lambda: verl.F.calculate_sum_pi_squared_from_logits, lambda fn, logits: fn(logits),
            inputs, ["logits"], "calculate_sum_pi_squared_from_logits",
            rtol=4 * _entropy_tolerance(inputs["logits"]))  # fmt: skip


def test_verl_bf16_dtypes_kept(verl):
    """veRL's log_softmax path returns the logits' dtype: bf16 in, bf16 out. fastrl's
    values are the exact ones rounded to bf16 (veRL sums the entropy in bf16, which is
    off by more: compared with float64, not with veRL's values)."""
    logits = _logits((4, 9, 300)).bfloat16()
    labels = torch.randint(300, (4, 9))
    exact_logp = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    p = torch.softmax(logits.double(), -1)
    exact_entropy = -(p * torch.log_softmax(logits.double(), -1)).sum(-1)
    before = verl.F.logprobs_from_logits(logits, labels), verl.F.entropy_from_logits(logits)
    verl.integration.patch()
    after = verl.F.logprobs_from_logits(logits, labels), verl.F.entropy_from_logits(logits)
    for got, old, exact, what in zip(after, before, (exact_logp, exact_entropy), ("logprobs", "entropy")):
        assert got.dtype == old.dtype == torch.bfloat16, what
        _close(got.double(), exact, f"bf16 {what}", rtol=8e-3)  # bf16 has 8 bits of mantissa


@pytest.mark.parametrize("estimator", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "abs+", "k3+", "k2+"])
def test_verl_kl_penalty(verl, estimator):
    logp = -torch.rand(6, 40) * 5
    inputs = {"logprob": logp, "ref_logprob": (logp + torch.randn(6, 40) * 10).clamp(max=0)}  # past k3's clamps
    call = lambda fn, logprob, ref_logprob: fn(logprob=logprob, ref_logprob=ref_logprob, kl_penalty=estimator)  # noqa: E731
    _parity(verl.integration, lambda: verl.core.kl_penalty, call, inputs, ["logprob", "ref_logprob"], estimator)
    assert verl.losses.kl_penalty is verl.core.kl_penalty, "the actor's loss module imports it by name"


@pytest.mark.parametrize("global_info", VERL_GLOBAL, ids=["local", "global"])
@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])  # fmt: skip
def test_verl_agg_loss(verl, mode, global_info):
    t = _per_token_inputs()
    inputs = {"loss_mat": t["values"], "loss_mask": t["mask"].float()}  # a 0/1 float mask, as veRL's can be
    call = lambda fn, loss_mat, loss_mask: fn(loss_mat, loss_mask, mode, **global_info)  # noqa: E731
    _parity(verl.integration, lambda: verl.core.agg_loss, call, inputs, ["loss_mat"], f"agg_loss {mode}")


@pytest.mark.parametrize("global_info", VERL_GLOBAL, ids=["local", "global"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("loss", ["vanilla", "gspo"])
def test_verl_policy_loss_through_registry(verl, loss, mode, global_info):
    """veRL's registry (get_policy_loss_fn), as its actor calls it: loss, gradient,
    and the metrics as Python floats."""
    t = _per_token_inputs()
    config = _verl_config(verl, global_info, loss_agg_mode=mode)
    inputs = {"old_log_prob": t["old_log_probs"], "log_prob": t["log_probs"], "advantages": t["advantages"],
              "response_mask": t["mask"], "rollout_is_weights": t["weights"]}  # fmt: skip

    def call(fn, **kw):
        return fn(kw["old_log_prob"], kw["log_prob"], kw["advantages"], kw["response_mask"], mode, config,
                  rollout_is_weights=kw["rollout_is_weights"])  # fmt: skip

    get = lambda: verl.core.get_policy_loss_fn(loss)  # noqa: E731
    (after, _), _ = _parity(verl.integration, get, call, inputs, ["log_prob"], f"{loss} {mode}")
    assert set(after[1]) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    name = f"compute_policy_loss_{loss}"
    assert getattr(verl.core, name) is get(), "the module's function and the registry entry are one replacement"


def _loadable_verl_ops(integration) -> list[str]:
    """veRL's ops that patch() of every op patches here: all but those whose
    module needs a package not installed (megatron-core for the Megatron backend's,
    tested in test_vocab_parallel; peft for the FSDP engine's)."""
    needs = {"vocab_parallel": "megatron", "engine": "peft"}
    return [op for op in integration.OPS if op not in needs or importlib.util.find_spec(needs[op])]


def test_verl_actor_loss_path(verl):
    """The actor loss as veRL's workers/utils/losses.py composes it, from that
    module's namespace: policy loss from the registry, minus the entropy bonus,
    plus the KL loss, each aggregated with agg_loss."""
    t = _per_token_inputs()
    config = _verl_config(verl, VERL_GLOBAL[1], loss_agg_mode="seq-mean-token-mean")
    inputs = {"log_prob": t["log_probs"], "entropy": t["entropy"]}

    def actor_loss(_, log_prob, entropy):
        m = verl.losses
        mask = t["mask"]
        pg_loss, metrics = m.get_policy_loss_fn("vanilla")(
            t["old_log_probs"], log_prob, t["advantages"], mask, config.loss_agg_mode, config, t["weights"]
        )
        entropy_loss = m.agg_loss(entropy, mask, config.loss_agg_mode, **config.global_batch_info)
        kl = m.kl_penalty(logprob=log_prob, ref_logprob=t["ref_log_probs"], kl_penalty="low_var_kl")
        kl_loss = m.agg_loss(loss_mat=kl, loss_mask=mask, loss_agg_mode=config.loss_agg_mode, **config.global_batch_info)
        return pg_loss - 0.01 * entropy_loss + 0.1 * kl_loss, metrics

    _parity(verl.integration, lambda: verl.losses.agg_loss, actor_loss, inputs, ["log_prob", "entropy"], "actor loss")
    assert integrations.patched("verl")["verl"] == _loadable_verl_ops(verl.integration)


def test_verl_patch_is_idempotent_and_reaches_late_imports(verl, monkeypatch):
    where = verl.integration.patch()
    functions = {name: getattr(verl.core, name) for name in ("agg_loss", "kl_penalty", "compute_policy_loss_vanilla")}
    assert verl.integration.patch() == where
    assert all(getattr(verl.core, name) is f for name, f in functions.items()), "patching twice changes nothing"
    assert functions["agg_loss"].__fastrl_original__.__module__ == "verl.trainer.ppo.core_algos"
    late = types.ModuleType("fastrl_test_late_verl_trainer")
    monkeypatch.setitem(sys.modules, late.__name__, late)
    late.agg_loss = verl.core.agg_loss  # `from verl.trainer.ppo.core_algos import agg_loss` after the patch
    verl.integration.unpatch()
    assert late.agg_loss is verl.core.agg_loss is functions["agg_loss"].__wrapped__
    assert verl.core.get_policy_loss_fn("vanilla") is verl.core.compute_policy_loss_vanilla
    assert verl.integration.patched() == []


def _verl_090_gspo(agg_loss, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                   rollout_is_weights=None):  # fmt: skip
    """veRL 0.9.0's compute_policy_loss_gspo (verl/trainer/ppo/core_algos.py), transcribed:
    0.9.1's with the fixed "seq-mean-token-mean" passed to ``agg_loss`` in place of
    ``loss_agg_mode`` (the only change between the two); loss only."""
    clip_ratio_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    clip_ratio_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    seq_importance_ratio = torch.exp(torch.clamp(log_seq_importance_ratio, max=10.0))
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode="seq-mean-token-mean",
                    **config.global_batch_info)  # fmt: skip


@pytest.mark.parametrize("version", ["0.9.0", "0.9.1"])
def test_verl_gspo_aggregates_as_the_installed_version(verl, monkeypatch, version):
    """veRL 0.9.0's GSPO ignores loss_agg_mode (always "seq-mean-token-mean"); 0.9.1
    aggregates with it. The adapter follows the version patch() finds (here
    simulated): 0.9.1's real function, or 0.9.0's transcribed semantics."""
    installed = importlib.metadata.version("verl")
    assert installed == "0.9.1", f"the 0.9.1 case below runs veRL's installed function, which is {installed}"
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: version if dist == "verl" else real_version(dist))
    t = _per_token_inputs()
    inputs = {"old_log_prob": t["old_log_probs"], "log_prob": t["log_probs"], "advantages": t["advantages"],
              "response_mask": t["mask"], "rollout_is_weights": t["weights"]}  # fmt: skip
    agg_loss = verl.core.agg_loss
    for mode in ("token-mean", "seq-mean-token-sum"):
        config = _verl_config(verl, {"global_batch_size": 7}, loss_agg_mode=mode)

        def loss_and_grad(fn):
            def call(fn, **kw):
                out = fn(kw["old_log_prob"], kw["log_prob"], kw["advantages"], kw["response_mask"], mode, config,
                         rollout_is_weights=kw["rollout_is_weights"])  # fmt: skip
                return out[0] if isinstance(out, tuple) else out  # veRL's (loss, metrics); the transcription's loss

            out, [(_, grad)] = _run(fn, call, inputs, ["log_prob"])
            return out, grad

        verl.integration.unpatch()
        verl_091, verl_090 = verl.core.get_policy_loss_fn("gspo"), functools.partial(_verl_090_gspo, agg_loss)
        semantics = (verl_090, verl_091) if version == "0.9.0" else (verl_091, verl_090)
        expected, other = (loss_and_grad(f) for f in semantics)
        verl.integration.patch()
        loss, grad = loss_and_grad(verl.core.get_policy_loss_fn("gspo"))
        assert not integrations.fallbacks, dict(integrations.fallbacks)
        _close(loss, expected[0], f"{version} {mode} loss")
        _close(grad, expected[1], f"{version} {mode} grad")
        assert not torch.allclose(expected[0], other[0]), "the two versions' semantics coincide on these inputs"


_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, *_DTYPES], ids=str)
def test_verl_dtypes_follow_verl_for_every_dtype_combination(verl, mask_dtype):
    """agg_loss and the vanilla and GSPO losses return the dtype veRL's own functions
    return, for every per-token dtype, mask dtype, second-input dtype (old log-probs
    and rollout weights), aggregation mode and kind of global counts (a float mask
    takes part in veRL's promotion, its seq-mean modes lift bf16 to fp32, a 0-d
    float count tensor takes part too)."""
    t = _per_token_inputs((4, 12))
    mask = t["mask"].to(mask_dtype)
    modes = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    infos = [{}, {"dp_size": 2, "batch_num_tokens": torch.tensor(30.0, dtype=torch.float64), "global_batch_size": 4}]
    for dtype, other, mode, info in itertools.product(_DTYPES, (torch.bfloat16, torch.float32), modes, infos):
        config = _verl_config(verl, info, loss_agg_mode=mode)
        log_prob, advantages = t["log_probs"].to(dtype), t["advantages"].to(dtype)
        old, weights = t["old_log_probs"].to(other), t["weights"].to(other)

        def results():
            out = [verl.core.agg_loss(log_prob, mask, mode, **info)]
            for name in ("vanilla", "gspo"):
                out.append(verl.core.get_policy_loss_fn(name)(old, log_prob, advantages, mask, mode, config,
                                                              rollout_is_weights=weights)[0])  # fmt: skip
            return [r.dtype for r in out]

        verl.integration.unpatch()
        expected = results()
        verl.integration.patch()
        assert results() == expected, (dtype, other, mode, info)
    assert not integrations.fallbacks, dict(integrations.fallbacks)


def test_verl_autopatch_through_verl_external_modules(verl):
    """VERL_USE_EXTERNAL_MODULES: a fresh process (as a Ray worker is) that imports
    verl comes up patched, with only the ops FASTRL_VERL_OPS names."""
    code = (
        "import verl, fastrl.integrations.verl as v; from verl.trainer.ppo import core_algos as c; "
        "print(sorted(v.patched()), hasattr(c.get_policy_loss_fn('vanilla'), '__fastrl_original__'))"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none",
           "VERL_USE_EXTERNAL_MODULES": "fastrl.integrations.verl_autopatch"}  # fmt: skip
    every = sorted(_loadable_verl_ops(verl.integration))
    for ops, expected in (("", f"{every} True"), ("kl,agg_loss", "['agg_loss', 'kl'] False")):
        run = subprocess.run([sys.executable, "-c", code], env={**env, "FASTRL_VERL_OPS": ops},
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.strip().splitlines()[-1] == expected


def test_verl_ops_selection(verl):
    where = verl.integration.patch(ops=["kl"])
    assert list(where) == ["kl"] and "verl.workers.utils.losses.kl_penalty" in where["kl"]
    assert hasattr(verl.core.kl_penalty, "__fastrl_original__")
    assert not hasattr(verl.core.agg_loss, "__fastrl_original__")
    assert not hasattr(verl.core.get_policy_loss_fn("vanilla"), "__fastrl_original__")


def test_verl_fallbacks(verl):
    t = _per_token_inputs()
    config = _verl_config(verl)

    def vanilla(fn, old_log_prob, log_prob, advantages, response_mask):
        return fn(old_log_prob, log_prob, advantages, response_mask, "token-mean", config)

    get = lambda: verl.core.get_policy_loss_fn("vanilla")  # noqa: E731
    base = {"old_log_prob": t["old_log_probs"], "log_prob": t["log_probs"], "advantages": t["advantages"],
            "response_mask": t["mask"]}  # fmt: skip
    _fallback_matches(verl.integration, get, vanilla, base, "advantages requires grad", ["log_prob", "advantages"])
    per_sequence = {**base, "advantages": t["advantages"][:, :1].contiguous()}  # veRL broadcasts [B, 1]
    _fallback_matches(verl.integration, get, vanilla, per_sequence, "broadcasting", ["log_prob"])
    weighted = {**base, "response_mask": t["mask"] * torch.rand(6, 40)}  # veRL multiplies by a weighted mask
    _fallback_matches(verl.integration, get, vanilla, weighted, "weighted mask", ["log_prob"])

    agg = lambda fn, loss_mat, loss_mask: fn(loss_mat, loss_mask, "seq-mean-token-mean")  # noqa: E731
    _fallback_matches(verl.integration, lambda: verl.core.agg_loss, agg,
                      {"loss_mat": t["values"], "loss_mask": t["mask"] * 0.5}, "weighted mask", ["loss_mat"])  # fmt: skip

    verl.integration.patch()
    with pytest.warns(FallbackWarning, match="config is None"), pytest.raises(AssertionError):  # veRL asserts
        verl.core.compute_policy_loss_vanilla(t["old_log_probs"], t["log_probs"], t["advantages"], t["mask"])
    odd = _verl_config(verl)
    odd.global_batch_info["unknown"] = 1
    with pytest.warns(FallbackWarning, match="keys agg_loss does not take"), pytest.raises(TypeError):
        verl.core.compute_policy_loss_vanilla(t["old_log_probs"], t["log_probs"], t["advantages"], t["mask"],
                                              config=odd)  # fmt: skip
    with pytest.warns(FallbackWarning, match="argument checks"), pytest.raises(ValueError, match="Invalid loss_agg"):
        verl.core.agg_loss(t["values"], t["mask"], "token-median")  # fastrl rejects it, veRL raises its own error
    with pytest.raises(NotImplementedError, match="fastrl.full_kl"):
        verl.core.kl_penalty(t["log_probs"], t["ref_log_probs"], "full")
    # veRL's chunked entropy takes [N, V] only, and fails here itself.
    with pytest.warns(FallbackWarning, match="not 2-D"), pytest.raises(RuntimeError):
        verl.F.entropy_from_logits_with_chunking(_logits((2, 3, 50)), 4)


@pytest.mark.parametrize("lead", [(2, 9), (13,)], ids=["3-D", "2-D"])
def test_verl_fused_linear_for_ppo(verl, lead):
    """veRL's torch fused LM head (use_fused_kernels): float32 log-probs, the
    entropy in the hidden states' dtype, gradients of hidden states and weight."""
    module = importlib.import_module("verl.utils.experimental.torch_functional")
    inputs = {"hidden": torch.randn(*lead, 32), "weight": torch.randn(300, 32) * 0.4}
    ids = torch.randint(300, lead)

    def call(fn, hidden, weight):
        return fn(module.FusedLinearForPPO(chunk_size=5), hidden, weight, ids, 0.7)

    logits = (inputs["hidden"] @ inputs["weight"].T) / 0.7
    _parity(verl.integration, lambda: module.FusedLinearForPPO.forward, call, inputs, ["hidden", "weight"],
            "FusedLinearForPPO", rtol=_entropy_tolerance(logits))  # fmt: skip


def test_verl_linear_cross_entropy(verl):
    """veRL's Triton fused head (use_fused_kernels, GPU only in veRL): per-token
    float32 log-probs and entropy, flattened, against fastrl's reference; a summed
    reduction runs veRL's own."""
    module = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    hidden, weight, ids = torch.randn(2, 7, 16), torch.randn(100, 16) * 0.5, torch.randint(100, (2, 7))
    verl.integration.patch()
    logp, entropy = module.linear_cross_entropy(hidden, weight, ids, 0.8, "none")
    ref_logp, ref_entropy = fastrl.reference.linear_logprobs_and_entropy(hidden.double(), weight.double(), ids,
                                                                         temperature=0.8)  # fmt: skip
    assert logp.shape == entropy.shape == (14,) and logp.dtype == entropy.dtype == torch.float32
    _close(logp.double(), ref_logp.reshape(-1), "linear_cross_entropy log-probs")
    _close(entropy.double(), ref_entropy.reshape(-1), "linear_cross_entropy entropy")
    assert not integrations.fallbacks
    # (veRL's own needs CUDA: on a CPU build its NVTX range raises.)
    with pytest.warns(FallbackWarning, match="reduction 'sum'"), pytest.raises(RuntimeError, match="CUDA|cuda|NVTX"):
        module.linear_cross_entropy(hidden, weight, ids, 0.8, "sum")


# ---------------------------------------------------------------------------------- TRL


@pytest.fixture
def trl():
    _require("trl", "TRL")
    env = SimpleNamespace(
        utils=importlib.import_module("trl.trainer.utils"),
        cpo=importlib.import_module("trl.experimental.cpo.cpo_trainer"),  # imports selective_log_softmax by name
        sdpo=importlib.import_module("trl.experimental.sdpo.loss_utils"),
        integration=importlib.import_module("fastrl.integrations.trl"),
    )
    env.integration.unpatch()
    yield env
    env.integration.unpatch()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("index_shape", ["(...)", "(..., K)"])
@pytest.mark.parametrize("with_row_mask", [False, True], ids=["no-row-mask", "row-mask"])
def test_trl_selective_log_softmax(trl, temperature, index_shape, with_row_mask):
    logits = _logits()
    shape = (3, 17) if index_shape == "(...)" else (3, 17, 5)
    inputs = {"logits": logits, "index": torch.randint(1000, shape)}
    if with_row_mask:
        inputs["row_mask"] = torch.rand(shape) > 0.3
    call = lambda fn, logits, index, row_mask=None: fn(logits, index, temperature, row_mask=row_mask)  # noqa: E731
    _parity(trl.integration, lambda: trl.utils.selective_log_softmax, call, inputs, ["logits"], "selective_log_softmax")


def test_trl_entropy(trl):
    call = lambda fn, logits: fn(logits, chunk_size=7)  # noqa: E731
    inputs = {"logits": _logits()}
    _parity(trl.integration, lambda: trl.utils.entropy_from_logits, call, inputs, ["logits"], "entropy",
            rtol=_entropy_tolerance(inputs["logits"]))  # fmt: skip


@pytest.mark.parametrize("entropy_requires_grad", [True, False])
@pytest.mark.parametrize("with_row_mask", [False, True], ids=["no-row-mask", "row-mask"])
def test_trl_selective_log_softmax_and_entropy(trl, entropy_requires_grad, with_row_mask):
    inputs = {"logits": _logits(), "index": torch.randint(1000, (3, 17))}
    if with_row_mask:
        inputs["row_mask"] = (torch.rand(3, 17) > 0.3).long()

    def call(fn, logits, index, row_mask=None):
        return fn(logits, index, entropy_requires_grad, temperature=0.8, row_mask=row_mask)

    (after, _), _ = _parity(trl.integration, lambda: trl.utils.selective_log_softmax_and_entropy, call, inputs,
                            ["logits"], "selective_log_softmax_and_entropy",
                            rtol=_entropy_tolerance(inputs["logits"]))  # fmt: skip
    assert after[1].requires_grad == entropy_requires_grad


def test_trl_trainer_paths(trl):
    """CPOTrainer.get_batch_logps and SDPO's sampled-token distillation loss, which
    call selective_log_softmax from their modules' namespaces."""
    logits = _logits((4, 12, 500))
    labels = torch.randint(500, (4, 12))
    labels[:, :3] = -100  # the prompt

    def cpo(fn, logits):
        return fn(logits, labels.clone(), average_log_prob=True), fn(logits, labels.clone())

    get = lambda: trl.cpo.CPOTrainer.get_batch_logps  # noqa: E731
    trl.integration.unpatch()
    before = _run(get(), cpo, {"logits": logits}, ["logits"])
    trl.integration.patch()
    assert trl.cpo.selective_log_softmax.__fastrl_original__ is trl.utils.selective_log_softmax.__wrapped__
    assert trl.sdpo.selective_log_softmax is trl.utils.selective_log_softmax
    _assert_same(_run(get(), cpo, {"logits": logits}, ["logits"]), before, "CPOTrainer.get_batch_logps")

    def sdpo(_, student, teacher):
        ids = labels.clamp(min=0)
        return trl.sdpo.compute_sampled_token_self_distillation_loss(student, teacher, ids, distillation_alpha=1.0)

    # (student - teacher log-prob) * student log-prob: the difference of two ~-8 values
    # carries their fp32 rounding (~1e-6) into products up to ~30, hence 1e-4 here.
    inputs = {"student": logits, "teacher": logits + torch.randn(logits.shape)}
    _parity(trl.integration, lambda: trl.sdpo.selective_log_softmax, sdpo, inputs, ["student"], "SDPO loss", rtol=1e-4)
    assert not integrations.fallbacks


def test_trl_bf16_dtype_kept(trl):
    """TRL's log_softmax path (no Triton kernel on CPU) returns the logits' dtype;
    fastrl's values are the exact ones rounded to bf16."""
    logits, index = _logits((3, 9, 200)).bfloat16(), torch.randint(200, (3, 9))
    exact_logp = torch.log_softmax(logits.double(), -1).gather(-1, index[..., None]).squeeze(-1)
    exact_entropy = -(torch.softmax(logits.double(), -1) * torch.log_softmax(logits.double(), -1)).sum(-1)
    before = trl.utils.selective_log_softmax(logits, index), trl.utils.entropy_from_logits(logits)
    trl.integration.patch()
    after = trl.utils.selective_log_softmax(logits, index), trl.utils.entropy_from_logits(logits)
    for got, old, exact, what in zip(after, before, (exact_logp, exact_entropy), ("logprobs", "entropy")):
        assert got.dtype == old.dtype == torch.bfloat16, what
        _close(got.double(), exact, f"bf16 {what}", rtol=8e-3)


@pytest.mark.parametrize("device,backend", backend_params())
def test_trl_grpo_delta_is_fastrl_dual_clip(trl, device, backend):
    """README's TRL mapping: TRL's two-sided clipping ``delta`` is fastrl's
    ``clip_ratio_c = delta`` when delta > 1 + epsilon_high. TRL caps the unclipped
    ratio, min(r, delta), inside -min(r' A, clip(r) A): for A >= 0 the cap is below
    the clip and changes nothing; for A < 0 and r > delta it gives -A delta with no
    gradient, which is the dual clip. Checked on TRL 1.16's own GRPOTrainer._compute_loss
    (loss_type "grpo"), run on a stand-in trainer that hands it the log-probs."""
    grpo = importlib.import_module("trl.trainer.grpo_trainer")
    n_rows, length = 6, 30
    t = _per_token_inputs((n_rows, length), spread=(0.05, 0.2, 0.5, 1.0, 1.5, 2.0))  # ratios past delta
    mask = t["mask"].clone()
    mask[:, 0] = True  # TRL averages over every sequence, fastrl over those with a valid token
    mask[5] = True  # a whole sequence of spread 2 with A < 0: about 40% of its ratios pass delta = 1.5
    advantages = torch.rand(n_rows) * torch.tensor([1.0, -1.0]).repeat(n_rows // 2)  # both signs
    ids = torch.zeros(n_rows, length, dtype=torch.long)
    inputs = {"prompt_ids": ids[:, :2], "prompt_mask": torch.ones(n_rows, 2), "completion_ids": ids,
              "completion_mask": mask.float(), "advantages": advantages,
              "old_per_token_logps": t["old_log_probs"]}  # fmt: skip
    for delta in (None, 1.5):
        x = t["log_probs"].clone().requires_grad_(True)
        accelerator = SimpleNamespace(gather=lambda v: v, reduce=lambda v, reduction: v)
        trainer = SimpleNamespace(
            _get_per_token_logps_and_entropies=lambda *a, **k: (x, torch.zeros_like(x), None),
            top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
            beta=0.0, loss_type="grpo", epsilon_low=0.2, epsilon_high=0.28, use_vllm=False,
            args=SimpleNamespace(delta=delta), model=SimpleNamespace(training=False), _entropy_bonus_enabled=False,
            aux_loss_enabled=False, accelerator=accelerator, _metrics={"eval": collections.defaultdict(list)},
        )  # fmt: skip
        trl_loss = grpo.GRPOTrainer._compute_loss(trainer, None, inputs)
        trl_grad = torch.autograd.grad(trl_loss, x)[0]
        y = t["log_probs"].to(device).requires_grad_(True)
        with fastrl.use_backend(backend):
            loss, _ = fastrl.policy_loss(
                y, t["old_log_probs"].to(device), advantages[:, None].expand(n_rows, length).to(device),
                mask.to(device), clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=delta,
                loss_agg_mode="seq-mean-token-mean",
            )  # fmt: skip
        _close(loss.cpu(), trl_loss, f"loss, delta={delta}")
        _close(torch.autograd.grad(loss, y)[0].cpu(), trl_grad, f"grad, delta={delta}")
        capped = (advantages[:, None] < 0) & ((x - t["old_log_probs"]).exp() > 1.5) & mask
        assert delta is None or bool(capped.any()), "no token reaches the cap: the test would prove nothing"


def _tiny_causal_lm(kind: str):
    """A two-layer model built from a config (no download): Llama, or Gemma-2
    with a final-logit softcap small enough to bend most logits."""
    transformers = importlib.import_module("transformers")
    sizes = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, tie_word_embeddings=False)  # fmt: skip
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    config = transformers.Gemma2Config(**sizes, final_logit_softcapping=2.0, attn_implementation="eager")
    return transformers.Gemma2ForCausalLM(config)


@pytest.mark.parametrize("kind", ["llama", "gemma2-softcap"])
def test_trl_fused_lm_head(trl, kind):
    """TRL's add_fused_lm_head, as GRPOTrainer installs it (temperature, log-probs
    and entropy), on a tiny model: the per-token log-probs, entropy, loss and the
    gradients of the LM head and the first layer, patched and unpatched."""
    model = _tiny_causal_lm(kind)
    trl.utils.add_fused_lm_head(model, temperature=0.7, outputs=("log_probs", "entropy"))
    ids = torch.randint(300, (3, 11))
    labels = ids.clone()
    labels[:, :4] = -100  # the prompt
    entropy_weight = torch.randn(3, 10)
    params = [model.lm_head.weight, model.model.layers[0].mlp.up_proj.weight]

    def step():
        model.zero_grad()
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
        (out.loss + (out.entropy * entropy_weight).sum()).backward()
        return out.log_probs.detach(), out.entropy.detach(), out.loss.detach(), [p.grad.clone() for p in params]

    trl.integration.unpatch()
    before = step()
    trl.integration.patch()
    assert hasattr(trl.utils._ChunkedLogProbFunction, "__fastrl_apply__")
    after = step()
    assert not integrations.fallbacks, dict(integrations.fallbacks)
    for what, a, b in zip(("log-probs", "entropy", "loss"), after, before):
        _close(a, b, f"{kind} {what}")
    for a, b in zip(after[3], before[3]):
        _close(a, b, f"{kind} gradient")


def _word_tokenizer(size: int):
    """A word-level tokenizer built in memory (no download): "w0".."w{size-4}", pad, eos, unk."""
    transformers = importlib.import_module("transformers")
    tokenizers = importlib.import_module("tokenizers")
    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2} | {f"w{i}": i + 3 for i in range(size - 3)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                eos_token="[EOS]")  # fmt: skip


def test_trl_grpo_trainer_step(trl, tmp_path, monkeypatch):
    """A real GRPOTrainer step (generation, rewards, the fused LM head's log-probs
    and entropy, the loss, backward, an optimizer step at lr 0.1) on a tiny Llama,
    unpatched and patched from the same seed: the same metrics (grad norm,
    entropy) and the same updated LM head, to float32 rounding, with fastrl
    scoring every token."""
    datasets, grpo = importlib.import_module("datasets"), importlib.import_module("trl.trainer.grpo_trainer")
    calls = collections.Counter()
    fused = fastrl.linear_logprobs_and_entropy
    counted = lambda *a, **k: calls.update(["fastrl"]) or fused(*a, **k)  # noqa: E731
    monkeypatch.setattr(fastrl, "linear_logprobs_and_entropy", counted)

    def train():
        torch.manual_seed(0)
        model = _tiny_causal_lm("llama")
        model.config.pad_token_id, model.config.eos_token_id = 0, 1
        args = grpo.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2,
                               max_completion_length=6, max_steps=1, learning_rate=0.1, optim="sgd", report_to=[],
                               logging_steps=1,
                               use_cpu=True, bf16=False, seed=0, save_strategy="no", beta=0.0)  # fmt: skip
        data = datasets.Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10"]})
        trainer = grpo.GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                                   args=args, train_dataset=data, processing_class=_word_tokenizer(300))  # fmt: skip
        trainer.train()
        return trainer.state.log_history[0], model.lm_head.weight.detach().clone()

    trl.integration.unpatch()
    before = train()
    assert not calls
    trl.integration.patch()
    after = train()
    assert calls["fastrl"] >= 1 and not integrations.fallbacks, (calls, dict(integrations.fallbacks))
    for key in ("grad_norm", "entropy", "loss", "reward"):
        _close(torch.tensor(after[0][key]), torch.tensor(before[0][key]), f"GRPOTrainer {key}")
    _close(after[1], before[1], "GRPOTrainer's updated LM head")


def test_trl_fallbacks(trl):
    get = lambda: trl.utils.selective_log_softmax  # noqa: E731
    broadcast = {"logits": _logits((3, 17, 100)), "index": torch.randint(100, (1, 17))}  # TRL broadcasts the index
    _fallback_matches(trl.integration, get, lambda fn, logits, index: fn(logits, index), broadcast, "broadcasts",
                      ["logits"])  # fmt: skip
    trl.integration.patch()
    with pytest.warns(FallbackWarning, match="temperature"), pytest.raises(ValueError, match="must be positive"):
        trl.utils.selective_log_softmax(_logits(), torch.randint(1000, (3, 17)), temperature=0.0)  # TRL's own error
    # The fused head's outputs fastrl does not compute run TRL's own function, whole.
    hidden, weight, targets = torch.randn(9, 16), torch.randn(50, 16), torch.randint(50, (9,))
    outputs = ("log_probs", "is_top1")
    before = trl.utils._ChunkedLogProbFunction.__fastrl_original__.apply(hidden, weight, None, targets, 1.0, 16, None,
                                                                         1.0, outputs)  # fmt: skip
    with pytest.warns(FallbackWarning, match="is_top1"):
        after = trl.utils._ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 16, None, 1.0, outputs)
    assert torch.equal(after[0], before[0]) and torch.equal(after[4], before[4])


# ----------------------------------------------------------------------------- OpenRLHF


def _import_openrlhf_loss_modules():
    """openrlhf.models.utils and .loss as fastrl.integrations.openrlhf.patch() imports
    them: through openrlhf.models, or, where its __init__ cannot import (the Actor
    needs flash-attn, a CUDA build, and peft), the two installed files themselves.
    Either way OpenRLHF's own code with its own imports (torch, deepspeed): no stub."""
    utils, loss = importlib.import_module("fastrl.integrations.openrlhf").load_loss_modules()
    package = os.path.dirname(importlib.util.find_spec("openrlhf").origin)
    for module, name in ((utils, "utils.py"), (loss, "loss.py")):
        assert module.__file__ == os.path.join(package, "models", name), module.__file__
    return utils, loss


@pytest.fixture
def openrlhf():
    _require("openrlhf", "OpenRLHF")
    utils, loss = _import_openrlhf_loss_modules()
    env = SimpleNamespace(utils=utils, loss=loss, integration=importlib.import_module("fastrl.integrations.openrlhf"))
    env.integration.unpatch()
    yield env
    env.integration.unpatch()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_openrlhf_log_probs_from_logits(openrlhf, temperature):
    def call(fn, logits, labels):
        scaled = logits * 1.0
        return fn(scaled, labels, temperature), scaled  # OpenRLHF divides the logits in place

    inputs = {"logits": _logits(), "labels": torch.randint(1000, (3, 17))}
    _parity(openrlhf.integration, lambda: openrlhf.utils.log_probs_from_logits, call, inputs, ["logits"], "log_probs")


def test_openrlhf_compute_entropy(openrlhf):
    with torch.compiler.set_stance("force_eager"):  # OpenRLHF's torch.compile, run eagerly (no C++ build on CPU)
        inputs = {"logits": _logits()}
        _parity(openrlhf.integration, lambda: openrlhf.utils.compute_entropy, lambda fn, logits: fn(logits), inputs,
                ["logits"], "compute_entropy", rtol=_entropy_tolerance(inputs["logits"]))  # fmt: skip


@pytest.mark.parametrize("estimator,unbiased", [("k1", False), ("k2", False), ("k3", False), ("k3", True)])
def test_openrlhf_compute_approx_kl(openrlhf, estimator, unbiased):
    logp = -torch.rand(6, 40) * 5
    inputs = {"log_probs": logp, "base": (logp + torch.randn(6, 40) * 8).clamp(max=0)}  # past the +-10 clamps

    def call(fn, log_probs, base):
        return fn(log_probs, base, kl_estimator=estimator, unbiased_gradient=unbiased)

    _parity(openrlhf.integration, lambda: openrlhf.utils.compute_approx_kl, call, inputs, ["log_probs", "base"],
            f"compute_approx_kl {estimator}")  # fmt: skip


AGG_INFO = [{}, {"dp_size": 2, "batch_num_tokens": 150.0, "global_batch_size": 9.0}]


@pytest.mark.parametrize("info", AGG_INFO, ids=["local", "global"])
@pytest.mark.parametrize("token_level", [True, False])
def test_openrlhf_aggregate_loss(openrlhf, token_level, info):
    t = _per_token_inputs()
    call = lambda fn, loss, mask: fn(loss, mask, token_level_loss=token_level, **info)  # noqa: E731
    _parity(openrlhf.integration, lambda: openrlhf.loss.aggregate_loss, call, {"loss": t["values"], "mask": t["mask"]},
            ["loss"], "aggregate_loss")  # fmt: skip


@pytest.mark.parametrize("info", AGG_INFO, ids=["local", "global"])
@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_openrlhf_policy_loss(openrlhf, dual_clip, token_level, info):
    """PolicyLoss built before the patch: the class's forward is replaced."""
    t = _per_token_inputs(spread=(0.01, 0.1, 0.5, 1.0, 2.0, 3.0))
    module = openrlhf.loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip,
                                      token_level_loss=token_level)  # fmt: skip
    inputs = {"log_probs": t["log_probs"], "old": t["old_log_probs"], "adv": t["advantages"], "mask": t["mask"]}
    call = lambda _, log_probs, old, adv, mask: module(log_probs, old, adv, action_mask=mask, **info)  # noqa: E731
    _parity(openrlhf.integration, lambda: vars(openrlhf.loss.PolicyLoss)["forward"], call, inputs, ["log_probs"],
            "PolicyLoss")  # fmt: skip


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_openrlhf_policy_loss_ppo_kl_is_not_clamped(openrlhf, dual_clip):
    """OpenRLHF clamps the log-ratio to +-20 for the ratio only: its ppo_kl (as its
    own test_policy_kl_metric_is_not_clamped asserts) is the mean of the raw
    old_log_probs - log_probs. Log-ratios past +-20 on valid tokens, where fastrl's
    own (veRL's) ppo_kl, of the clamped log-ratio, is far off: the patched
    PolicyLoss still returns OpenRLHF's loss, clip_ratio, ppo_kl and gradient. With
    NaN outside the mask, or no valid token, ppo_kl keeps fastrl's mask semantics."""
    t = _per_token_inputs()
    log_probs, mask = t["log_probs"], t["mask"]
    old = t["old_log_probs"].clone()  # log-ratios of 25 to 35 on every third token, -22 to -28 on every sixth
    old[:, ::3] = log_probs[:, ::3] + 25 + 10 * torch.rand(old[:, ::3].shape)
    old[:, 1::6] = log_probs[:, 1::6] - 22 - 6 * torch.rand(old[:, 1::6].shape)
    module = openrlhf.loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip)
    inputs = {"log_probs": log_probs, "old": old, "adv": t["advantages"], "mask": mask}
    call = lambda _, log_probs, old, adv, mask: module(log_probs, old, adv, action_mask=mask)  # noqa: E731
    (after, _), (before, _) = _parity(openrlhf.integration, lambda: vars(openrlhf.loss.PolicyLoss)["forward"], call,
                                      inputs, ["log_probs"], "PolicyLoss ppo_kl")  # fmt: skip
    expected = (old - log_probs)[mask].mean()
    assert torch.allclose(before[2], expected, rtol=RTOL) and torch.allclose(after[2], expected, rtol=RTOL)
    _, clamped = fastrl.policy_loss(log_probs, old, t["advantages"], mask)
    assert (clamped["ppo_kl"] - expected).abs() > 1.0, "the inputs must be ones where the clamp matters"

    openrlhf.integration.patch()
    with_nan = log_probs.masked_fill(~mask, float("nan"))
    ppo_kl = module(with_nan, old, t["advantages"], action_mask=mask)[2]
    assert torch.allclose(ppo_kl, expected, rtol=RTOL), "a token outside the mask is ignored"
    none_valid = torch.zeros_like(mask)
    assert torch.equal(module(with_nan, old, t["advantages"], action_mask=none_valid)[2], torch.tensor(0.0))
    assert not integrations.fallbacks, dict(integrations.fallbacks)


def test_openrlhf_value_and_sft_losses_aggregate_patched(openrlhf):
    """OpenRLHF's own ValueLoss and SFTLoss call aggregate_loss from the loss module."""
    t = _per_token_inputs()
    value_loss, sft_loss = openrlhf.loss.ValueLoss(clip_eps=0.2), openrlhf.loss.SFTLoss(token_level_loss=False)

    def call(_, values, old):
        return value_loss(values, old, t["values"], action_mask=t["mask"]), sft_loss(values, t["mask"])

    inputs = {"values": t["entropy"], "old": t["entropy"] + 0.3 * torch.randn(6, 40)}
    _parity(openrlhf.integration, lambda: openrlhf.loss.aggregate_loss, call, inputs, ["values"], "ValueLoss/SFTLoss")


@pytest.mark.parametrize("mask_dtype", [torch.bool, *_DTYPES], ids=str)
def test_openrlhf_dtypes_follow_openrlhf_for_every_dtype_combination(openrlhf, mask_dtype):
    """aggregate_loss and PolicyLoss's (loss, clip_ratio, ppo_kl) have OpenRLHF's own
    dtypes for every per-token and mask dtype, both aggregations, with and without
    the global counts (a 0-d float64 tensor among them) and dual clip."""
    t = _per_token_inputs((4, 12))
    mask = t["mask"].to(mask_dtype)
    infos = [{}, {"dp_size": 2, "batch_num_tokens": 150.0, "global_batch_size": torch.tensor(9.0, dtype=torch.float64)}]
    for dtype, other, token_level, dual_clip, info in itertools.product(
        _DTYPES, (torch.bfloat16, torch.float32), (True, False), (None, 3.0), infos
    ):
        module = openrlhf.loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=dual_clip,
                                          token_level_loss=token_level)  # fmt: skip
        log_probs, old, adv = t["log_probs"].to(dtype), t["old_log_probs"].to(other), t["advantages"].to(dtype)

        def results():
            out = [openrlhf.loss.aggregate_loss(log_probs, mask, token_level, **info)]
            return [r.dtype for r in out + list(module(log_probs, old, adv, action_mask=mask, **info)[:3])]

        openrlhf.integration.unpatch()
        expected = results()
        openrlhf.integration.patch()
        assert results() == expected, (dtype, other, token_level, dual_clip, info)
    assert not integrations.fallbacks, dict(integrations.fallbacks)


def test_openrlhf_fallbacks(openrlhf):
    t = _per_token_inputs()
    rollout = t["old_log_probs"] + 0.1 * torch.randn(6, 40)
    get = lambda: vars(openrlhf.loss.PolicyLoss)["forward"]  # noqa: E731
    inputs = {"log_probs": t["log_probs"], "old": t["old_log_probs"], "adv": t["advantages"], "mask": t["mask"]}
    for options, reason in [({"policy_loss_type": "gspo"}, "GSPO"), ({"is_correction_level": "token"}, "correction")]:
        module = openrlhf.loss.PolicyLoss(**options)

        def call(_, log_probs, old, adv, mask, module=module):
            return module(log_probs, old, adv, mask, rollout_log_probs=rollout)

        _fallback_matches(openrlhf.integration, get, call, inputs, reason, ["log_probs"])
    kl_inputs = {"log_probs": t["log_probs"], "base": t["ref_log_probs"]}
    kl = lambda fn, log_probs, base: fn(log_probs, base, t["old_log_probs"], "k3", True)  # noqa: E731
    _fallback_matches(openrlhf.integration, lambda: openrlhf.utils.compute_approx_kl, kl, kl_inputs,
                      "importance-weighted", ["log_probs"])  # fmt: skip
    agg = lambda fn, loss: fn(loss, None)  # noqa: E731
    _fallback_matches(openrlhf.integration, lambda: openrlhf.loss.aggregate_loss, agg, {"loss": t["values"]},
                      "loss_mask is None", ["loss"])  # fmt: skip


# ---------------------------------------------------------------- every framework


FRAMEWORKS = [
    ("verl", "veRL", "verl", "0.9.x", "verl.utils.torch_functional", "logprobs_from_logits"),
    ("trl", "TRL", "trl", "1.16.x", "trl.trainer.utils", "selective_log_softmax"),
    ("openrlhf", "OpenRLHF", "openrlhf", "0.11.x", "openrlhf.models.utils", "log_probs_from_logits"),
]


def test_patch_in_a_fresh_process():
    """What a user's script does, in a process with nothing imported before: each
    installed framework's patch() succeeds and its module then holds fastrl's
    function (OpenRLHF's among them on a machine without flash-attn, where
    openrlhf.models cannot import)."""
    installed = [f for f in FRAMEWORKS if importlib.util.find_spec(f[0]) is not None]
    if not installed:
        pytest.skip("no framework is installed (make setup installs them)")
    code = "; ".join(
        f"import fastrl.integrations.{name}; fastrl.integrations.{name}.patch(); from {module} import {function}; "
        f"print({name!r}, hasattr({function}, '__fastrl_original__'))"
        for name, _, _, _, module, function in installed
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none", "TRL_EXPERIMENTAL_SILENCE": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd="/")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.endswith(("True", "False"))]
    assert lines == [f"{f[0]} True" for f in installed], run.stdout[-3000:]


@pytest.mark.parametrize("name,display,distribution,supported,module,function", FRAMEWORKS, ids=[f[0] for f in FRAMEWORKS])
def test_unsupported_version_or_layout_names_the_version(monkeypatch, name, display, distribution, supported, module,
                                                         function):  # fmt: skip
    _require(name, display)
    if name == "openrlhf":
        _import_openrlhf_loss_modules()
    integration = importlib.import_module(f"fastrl.integrations.{name}")
    installed = importlib.metadata.version(distribution)
    target = importlib.import_module(module)
    original = getattr(target, function)
    try:
        monkeypatch.setattr(target, function, lambda logits, labels: None)  # another signature
        with pytest.raises(UnsupportedVersionError, match=rf"{display} {installed}, {module}\.{function} takes"):
            integration.patch()
        monkeypatch.setattr(target, function, original)
        real_version = importlib.metadata.version
        monkeypatch.setattr(
            importlib.metadata, "version", lambda dist: "0.0.1" if dist == distribution else real_version(dist)
        )
        with pytest.raises(UnsupportedVersionError, match=rf"supports {display} {supported}.* is 0\.0\.1"):
            integration.patch()
        assert integration.patched() == []
    finally:
        integration.unpatch()


# -------------------------------------------------------------------------- torch.compile


def _count_native_kernels(monkeypatch) -> collections.Counter:
    """Counts, by name, the native kernels that fastrl's operators launch when they
    run: from an eager call or from a compiled graph alike (a launcher is looked up
    when the operator runs, and torch.compile traces the operator, not into it)."""
    native, launches = importlib.import_module("fastrl._native"), collections.Counter()

    def counted(name, launcher):
        return lambda *args, **kwargs: launches.update([name]) or launcher(*args, **kwargs)

    for name in dir(torch.ops.fastrl):
        if callable(getattr(native, name, None)):
            monkeypatch.setattr(native, name, counted(name, getattr(native, name)))
    return launches


def _compile_inputs():
    log_prob = -torch.rand(2, 5) * 3
    return {"logits": _logits((2, 5, 50)), "labels": torch.randint(50, (2, 5)), "log_prob": log_prob,
            "old_log_prob": log_prob + 0.2 * torch.randn(2, 5), "advantages": torch.randn(2, 5),
            "mask": torch.rand(2, 5) > 0.2, "hidden": torch.randn(2, 5, 16),
            "weight": torch.randn(50, 16) * 0.5}  # fmt: skip


def _verl_program(verl):
    lce = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    head = importlib.import_module("verl.utils.experimental.torch_functional").FusedLinearForPPO(chunk_size=4)
    config = _verl_config(verl)

    def program(logits, labels, log_prob, old_log_prob, advantages, mask, hidden, weight):
        core, F = verl.core, verl.F
        return (
            F.logprobs_from_logits(logits * 1.0, labels, True), F.entropy_from_logits(logits),
            F.entropy_from_logits_with_chunking(logits.flatten(0, 1), 8), F.calculate_sum_pi_squared_from_logits(logits),
            core.kl_penalty(log_prob, old_log_prob, "low_var_kl"), core.agg_loss(log_prob, mask, "seq-mean-token-mean"),
            core.get_policy_loss_fn("vanilla")(old_log_prob, log_prob, advantages, mask, "token-mean", config),
            core.get_policy_loss_fn("gspo")(old_log_prob, log_prob, advantages, mask, "seq-mean-token-mean", config),
            head.forward(hidden, weight, labels, 0.7), lce.linear_cross_entropy(hidden, weight, labels, 0.8, "none"),
        )  # fmt: skip

    return program


def _trl_program(trl):
    def program(logits, labels, log_prob, old_log_prob, advantages, mask, hidden, weight):
        u, top2 = trl.utils, torch.stack([labels, labels.flip(-1)], dim=-1)
        return (
            u.selective_log_softmax(logits, labels, 0.7), u.selective_log_softmax(logits, top2, 1.0),
            u.entropy_from_logits(logits, 7), u.selective_log_softmax_and_entropy(logits, labels, True, 0.8, mask),
            u._ChunkedLogProbFunction.apply(hidden.flatten(0, 1), weight, None, labels.flatten(), 0.9, 4, None, 1.0,
                                            ("log_probs", "entropy"))[:2],
        )  # fmt: skip

    return program


def _openrlhf_program(openrlhf):
    policy_loss = openrlhf.loss.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=3.0)

    def program(logits, labels, log_prob, old_log_prob, advantages, mask, hidden, weight):
        u = openrlhf.utils
        return (
            u.log_probs_from_logits(logits * 1.0, labels, 0.7), u.compute_entropy(logits),
            u.compute_approx_kl(log_prob, old_log_prob, kl_estimator="k3"),
            openrlhf.loss.aggregate_loss(log_prob, mask, False),
            policy_loss(log_prob, old_log_prob, advantages, action_mask=mask),
        )  # fmt: skip

    return program


@pytest.mark.parametrize("dynamic,fullgraph", [(True, False), (False, True)], ids=["dynamic", "fullgraph"])
@pytest.mark.parametrize("name", ["verl", "trl", "openrlhf"])
def test_patched_functions_compile(request, monkeypatch, name, dynamic, fullgraph):
    """Every function a framework's patch replaces (veRL's FSDP engine method aside:
    veRL never compiles it), called once in one program under torch.compile: dynamic=True without fullgraph (veRL's own wrapping; veRL's policy
    losses then break the graph at their float metrics, as veRL's own do, and the
    frames resumed after a break hold symbolic ints and floats), and fullgraph=True
    (no graph break; TRL's own functions break there, asking transformers whether
    Triton imports, which logs). The same values, dtypes, metrics and gradients as
    the patched functions run eagerly, no fallback, and the same fastrl kernels run
    (TRL's fused head is a class: a subclass of its autograd.Function would run
    TRL's forward, which torch.compile traces whatever apply says). Backend "eager":
    Dynamo traces, the graphs run as they are (AOTAutograd and inductor on fastrl's
    ops are tests/test_compile.py's)."""
    env = request.getfixturevalue(name)
    program = {"verl": _verl_program, "trl": _trl_program, "openrlhf": _openrlhf_program}[name](env)
    env.integration.patch()
    inputs, grad = _compile_inputs(), ["logits", "log_prob", "hidden", "weight"]
    call = lambda fn, **kw: fn(**kw)  # noqa: E731
    launches = _count_native_kernels(monkeypatch)
    torch._dynamo.reset()
    compiled = torch.compile(program, dynamic=dynamic, fullgraph=fullgraph, backend="eager")
    after = _run(compiled, call, inputs, grad)
    kernels = dict(launches)
    launches.clear()
    _assert_same(after, _run(program, call, inputs, grad), f"{name} compiled")
    assert not integrations.fallbacks, dict(integrations.fallbacks)
    assert kernels == dict(launches), f"the compiled program launched {kernels}, eagerly {dict(launches)}"


def test_verl_entropy_compiled_as_verl_engines_compile_it(verl):
    """veRL's engines keep ``torch.compile(verl_F.entropy_from_logits, dynamic=True)``
    when ``use_torch_compile`` is on, its default (the FSDP engine's __init__,
    verl/workers/engine/fsdp/transformer_impl.py), and call it on the micro-batch's
    [total_nnz, V] logits. That wrapping of the patched function, inductor included,
    compiles (it raised InternalTorchDynamoError), gives veRL's own entropy and
    gradient, and serves micro-batches of other token counts with the same graph."""
    engine = os.path.join(os.path.dirname(importlib.util.find_spec("verl").origin), "workers", "engine", "fsdp")
    with open(os.path.join(engine, "transformer_impl.py")) as f:  # (importing it needs peft)
        assert "torch.compile(entropy_from_logits, dynamic=True)" in f.read(), "veRL's wrapping changed: follow it"
    call = lambda fn, logits: fn(logits)  # noqa: E731
    own = _run(verl.F.entropy_from_logits, call, {"logits": _logits((37, 300))}, ["logits"])
    verl.integration.patch()
    compute_entropy_from_logits = torch.compile(verl.F.entropy_from_logits, dynamic=True)
    for tokens in (37, 52):
        inputs = {"logits": _logits((tokens, 300))}
        with torch._dynamo.config.patch(error_on_recompile=tokens != 37):
            after = _run(compute_entropy_from_logits, call, inputs, ["logits"])
        verl.integration.unpatch()
        before = _run(verl.F.entropy_from_logits, call, inputs, ["logits"])
        verl.integration.patch()
        _assert_same(after, before, f"compiled entropy, {tokens} tokens", rtol=_entropy_tolerance(inputs["logits"]))
    assert own is not None and not integrations.fallbacks, dict(integrations.fallbacks)
