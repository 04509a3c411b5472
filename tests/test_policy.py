"""policy_loss / policy_loss_from_logits / agg_loss / rollout_correction against
the float64 reference, on every backend available (native C++, Triton
interpreted on CPU or compiled on GPU, and the reference itself)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import assert_close_to_reference, backend_params, kernel_backends, make_labels, make_logits

import fastrl
from fastrl import reference

BACKENDS = backend_params()
KERNEL_BACKENDS = backend_params(include_reference=False)

METRICS = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl")


def per_token_inputs(shape, device="cpu", dtype=torch.float32):
    """Realistic per-token inputs [B, L] with the awkward cases mixed in: log-ratios
    from 1e-3 to 30 (both signs, past the +-20 clamp), advantages that are zero,
    negative and positive (per sequence as in GRPO, plus per-token noise), a
    ragged response mask with one fully masked sequence and holes, and NaN in
    the masked-out positions (which must be ignored)."""
    n_rows, length = shape
    logp = -torch.rand(shape, dtype=torch.float64) * 6
    scales = torch.tensor([1e-3, 0.05, 0.3, 1.0, 3.0])[torch.arange(n_rows) % 5].double().unsqueeze(1)
    old = logp + torch.randn(shape, dtype=torch.float64) * scales
    extreme = torch.rand(shape) < 0.05
    old[extreme] = logp[extreme] + 30.0 * torch.sign(torch.randn(int(extreme.sum()))).double()
    adv = torch.randn(n_rows, 1, dtype=torch.float64) + 0.3 * torch.randn(shape, dtype=torch.float64)
    adv[torch.rand(shape) < 0.1] = 0.0
    lengths = torch.randint(1, length + 1, (n_rows,))
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    mask &= torch.rand(shape) > 0.05
    if n_rows > 1:
        mask[1] = False
    ref = logp + torch.randn(shape, dtype=torch.float64) * scales.flip(0)
    entropy = torch.rand(shape, dtype=torch.float64) * 4
    weights = torch.rand(shape, dtype=torch.float64) * 2
    for t in (old, adv, ref):
        t[~mask] = math.nan
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return {
        "log_probs": cast(logp), "old_log_probs": cast(old), "advantages": cast(adv),
        "response_mask": mask.to(device), "ref_log_probs": cast(ref), "entropy": cast(entropy),
        "rollout_is_weights": cast(weights),
    }  # fmt: skip


def _run_policy(fn, inputs, options, with_entropy):
    """(loss, metrics, d loss / d log_probs, d loss / d entropy) of ``fn``."""
    logp = inputs["log_probs"].clone().requires_grad_(True)
    entropy = inputs["entropy"].clone().requires_grad_(True) if with_entropy else None
    loss, metrics = fn(logp, inputs["old_log_probs"], inputs["advantages"], inputs["response_mask"], entropy=entropy, **options)
    loss.backward()
    return loss, metrics, logp.grad, None if entropy is None else entropy.grad


def _float64(inputs):
    return {k: (v.double() if v.is_floating_point() else v) for k, v in inputs.items()}


def _reference_runs(inputs, options, with_entropy):
    """The reference in float64 (the truth) and in float32 (what eager PyTorch gets)."""
    truth = _run_policy(reference.policy_loss, _float64(inputs), options, with_entropy)
    eager = _run_policy(reference.policy_loss, inputs, options, with_entropy)
    return truth, eager


def assert_as_accurate_as_eager(actual, truth, eager, rtol=1e-5, what="value", magnitude=None):
    """|actual - truth| <= rtol |truth| + 4 |eager - truth| + rtol * 1e-2 max |truth|
    (+ one float32 rounding of ``magnitude``, the same sum of the absolute values):
    within 1e-5 relative, or no worse than four times float32 PyTorch where a sum
    cancels (a loss over advantages of both signs). Eager float32 can be lucky on
    one sum; ``magnitude`` bounds what any float32 summation order may lose."""
    a, t, e = (x.detach().double().cpu() for x in (actual, truth, eager))
    assert torch.equal(a.isnan(), t.isnan()), f"{what}: NaN pattern differs"
    finite = ~t.isnan()
    a, t, e = a[finite], t[finite], e[finite]
    bound = rtol * t.abs() + 4 * (e - t).abs() + rtol * 1e-2 * (float(t.abs().max()) if t.numel() else 0.0) + 1e-30
    if magnitude is not None:
        bound = bound + 2.0**-24 * magnitude.detach().double().cpu()[finite]
    err = (a - t).abs()
    if err.numel():
        worst = int((err - bound).argmax())
        assert bool((err <= bound).all()), f"{what}: error {err[worst]:.3g} at {t[worst]:.6g} exceeds {bound[worst]:.3g}"


# The kernels sum a row's tokens per chunk in float32 (fastrl.kernels.policy):
# a token's value passes at most 16 additions there (its lane's share of the
# chunk, then tl.sum's tree), so a chunk's sum is within 16 u sum |x| of the
# exact one, u = 2^-24; chunks and rows are merged in float64 (adds ~1e-16). An
# aggregate (every mode is sum_b w_b sum_t x_bt with w_b >= 0) is then within
# 16 u agg(|x|) + the float32 rounding of the result.
CHUNK_SUM_ROUNDINGS = 16


def _sum_magnitudes(inputs, options, with_entropy):
    """CHUNK_SUM_ROUNDINGS x the aggregate of |x| of each summed term (the loss and
    its summed metrics), from the float64 reference: |l| <= |A| max(r, clip(r)) |w|,
    the PG loss of advantages -|A| without the dual clip."""
    x = _float64(inputs)
    mask = x["response_mask"]
    agg_keys = ("loss_agg_mode", "dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor")
    agg_options = {k: options[k] for k in agg_keys if k in options}
    agg = lambda v: reference.agg_loss(v.abs(), mask, **agg_options)  # noqa: E731
    weights = options.get("rollout_is_weights")
    level = options.get("ratio_level", "token")
    _, pg = reference.policy_loss(
        x["log_probs"], x["old_log_probs"], -x["advantages"].abs(), mask, ratio_level=level,
        clip_ratio_low=options.get("clip_ratio_low", 0.2), clip_ratio_high=options.get("clip_ratio_high", 0.2),
        rollout_is_weights=None if weights is None else weights.double().abs(), **agg_options,
    )  # fmt: skip
    u = torch.where(mask, x["log_probs"] - x["old_log_probs"], 0.0)
    if level == "token":
        u = u.clamp(-reference.LOG_RATIO_CLAMP, reference.LOG_RATIO_CLAMP)
    out = {"pg_loss": pg["pg_loss"].double(), "ppo_kl": u.abs().sum() / max(int(mask.sum()), 1)}
    out["loss"] = out["pg_loss"].clone()
    if options.get("ref_log_probs") is not None:
        estimator = options.get("kl_estimator", "low_var_kl")
        kl = reference.kl_penalty(x["log_probs"], options["ref_log_probs"].double(), estimator)
        out["kl"] = agg(torch.where(mask, kl, 0.0))
        out["loss"] += abs(options.get("kl_coef", 0.0)) * out["kl"]
    if with_entropy:
        out["entropy"] = agg(x["entropy"])
        out["loss"] += abs(options.get("entropy_coef", 0.0)) * out["entropy"]
    return {name: CHUNK_SUM_ROUNDINGS * m for name, m in out.items()}


def _check_against_reference(got, truth, eager, with_entropy, extra_metrics=(), magnitudes=None):
    """``magnitudes``: _sum_magnitudes' bounds of the float32 chunk sums."""
    loss, metrics, grad_logp, grad_entropy = got
    magnitudes = magnitudes or {}
    assert loss.shape == () and loss.dtype == torch.float32
    assert_as_accurate_as_eager(loss, truth[0], eager[0], what="loss", magnitude=magnitudes.get("loss"))
    assert set(metrics) == set(METRICS) | set(extra_metrics)
    for name in metrics:
        assert metrics[name].shape == () and metrics[name].dtype == torch.float32
        assert not metrics[name].requires_grad
        assert_as_accurate_as_eager(metrics[name], truth[1][name], eager[1][name], what=name,
                                    magnitude=magnitudes.get(name))  # fmt: skip
    assert torch.isfinite(grad_logp).all(), "masked-out NaN must not reach the gradient"
    assert_as_accurate_as_eager(grad_logp, truth[2], eager[2], what="grad log_probs")
    if with_entropy:
        assert_as_accurate_as_eager(grad_entropy, truth[3], eager[3], what="grad entropy")


@pytest.mark.parametrize("extras", ["plain", "kl+entropy+weights"])
@pytest.mark.parametrize("dual_clip", [None, 3.0], ids=["no-dual-clip", "dual-clip"])
@pytest.mark.parametrize("loss_agg_mode", reference.AGG_MODES)
@pytest.mark.parametrize("ratio_level", reference.RATIO_LEVELS)
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_policy_loss_matches_reference(device, backend, ratio_level, loss_agg_mode, dual_clip, extras):
    inputs = per_token_inputs((6, 67), device)
    options = {
        "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": dual_clip, "ratio_level": ratio_level,
        "loss_agg_mode": loss_agg_mode,
    }  # fmt: skip
    with_entropy = extras != "plain"
    if with_entropy:
        options.update(
            ref_log_probs=inputs["ref_log_probs"], kl_coef=0.05, kl_estimator="low_var_kl", entropy_coef=0.01,
            rollout_is_weights=inputs["rollout_is_weights"],
        )  # fmt: skip
    truth, eager = _reference_runs(inputs, options, with_entropy)
    with fastrl.use_backend(backend):
        got = _run_policy(fastrl.policy_loss, inputs, options, with_entropy)
    _check_against_reference(got, truth, eager, with_entropy, ("kl", "entropy") if with_entropy else (),
                             _sum_magnitudes(inputs, options, with_entropy))  # fmt: skip


# Rows longer than a chunk (fastrl.kernels.policy: 1024 tokens): three chunks, the
# last one partial, and L not a multiple of the 16-byte vector.
LONG_SHAPE = (3, 2500)


@pytest.mark.parametrize("ratio_level", reference.RATIO_LEVELS)
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_policy_loss_of_rows_longer_than_a_chunk(device, backend, ratio_level):
    """Rows split across programs: the chunks' partial sums merged into the loss,
    metrics and per-row weights, GSPO's row mean of u reaching every chunk's gradient."""
    inputs = per_token_inputs(LONG_SHAPE, device)
    options = {
        "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "ratio_level": ratio_level,
        "loss_agg_mode": "seq-mean-token-mean", "ref_log_probs": inputs["ref_log_probs"], "kl_coef": 0.05,
        "entropy_coef": 0.01, "rollout_is_weights": inputs["rollout_is_weights"],
    }  # fmt: skip
    truth, eager = _reference_runs(inputs, options, True)
    with fastrl.use_backend(backend):
        got = _run_policy(fastrl.policy_loss, inputs, options, True)
    _check_against_reference(got, truth, eager, True, ("kl", "entropy"), _sum_magnitudes(inputs, options, True))


@pytest.mark.parametrize("level", reference.RATIO_LEVELS)
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_rollout_correction_of_rows_longer_than_a_chunk(device, backend, level):
    """Sequence level: one weight e^S per row, S summed over all its chunks. Token-level
    rows of small log-ratios (|S| stays well inside the clamp at sequence level)."""
    inputs = per_token_inputs(LONG_SHAPE, device)
    old, mask = inputs["log_probs"], inputs["response_mask"]
    rollout = old + 0.002 * torch.randn(LONG_SHAPE, device=device)
    rollout[~mask] = math.nan
    truth_w, truth_m = reference.rollout_correction(old.double(), rollout.double(), mask, level=level, mode="mask")
    with fastrl.use_backend(backend):
        weights, metrics = fastrl.rollout_correction(old, rollout, mask, level=level, mode="mask")
    assert_close_to_reference(weights, truth_w, 1e-5, what="weights")
    for name, value in metrics.items():
        assert_close_to_reference(value, truth_m[name], 1e-5, what=name)


@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_rows_do_not_depend_on_the_batch(device, backend):
    """Batch invariance, bitwise: a row's statistics, gradient and correction weights
    are the same alone as in a batch (its chunks are summed and merged the same way),
    for one chunk and for several."""
    for shape in ((5, 67), LONG_SHAPE):
        x = per_token_inputs(shape, device)
        options = {"clip_ratio_c": 3.0, "ref_log_probs": x["ref_log_probs"], "kl_coef": 0.1,
                   "rollout_is_weights": x["rollout_is_weights"], "loss_agg_mode": "token-sum"}  # fmt: skip
        for level in reference.RATIO_LEVELS:
            options["ratio_level"] = level
            with fastrl.use_backend(backend):
                _, _, batch_grad, _ = _run_policy(fastrl.policy_loss, x, options, False)
                batch_w, _ = fastrl.rollout_correction(
                    x["log_probs"], x["old_log_probs"], x["response_mask"], level=level
                )
                for row in (0, shape[0] - 1):
                    one = {k: v[row : row + 1] for k, v in x.items()}
                    alone = {**options, "ref_log_probs": one["ref_log_probs"],
                             "rollout_is_weights": one["rollout_is_weights"]}  # fmt: skip
                    _, _, grad, _ = _run_policy(fastrl.policy_loss, one, alone, False)
                    w, _ = fastrl.rollout_correction(one["log_probs"], one["old_log_probs"], one["response_mask"],
                                                     level=level)  # fmt: skip
                    # token-sum: every row's weight is 1, so the gradient is the row's own
                    assert torch.equal(grad[0], batch_grad[row]), (shape, level, row)
                    assert torch.equal(w[0], batch_w[row]), (shape, level, row)


ESTIMATORS = reference.KL_ESTIMATORS + tuple(name + "+" for name in reference.KL_ESTIMATORS)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("ratio_level", reference.RATIO_LEVELS)
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_policy_loss_in_float64_is_exact_for_every_estimator(device, backend, ratio_level, estimator):
    """In float64 the kernels must agree with the reference to rounding: every
    branch (clamps, clip sides, dual clip, tie rules) taken the same way. The
    coefficients are exact in float32, which is how Triton passes Python floats."""
    inputs = _float64(per_token_inputs((5, 33), device))
    options = {
        "clip_ratio_low": 0.25, "clip_ratio_high": 0.375, "clip_ratio_c": 2.5, "ratio_level": ratio_level,
        "loss_agg_mode": "seq-mean-token-mean", "ref_log_probs": inputs["ref_log_probs"], "kl_coef": 0.75,
        "kl_estimator": estimator, "entropy_coef": -0.125, "rollout_is_weights": inputs["rollout_is_weights"],
    }  # fmt: skip
    truth = _run_policy(reference.policy_loss, inputs, options, True)
    with fastrl.use_backend(backend):
        loss, metrics, grad_logp, grad_entropy = _run_policy(fastrl.policy_loss, inputs, options, True)
    assert loss.dtype == torch.float64
    assert_close_to_reference(loss, truth[0], 1e-10, what="loss")
    for name, value in metrics.items():
        assert_close_to_reference(value, truth[1][name], 1e-6, what=name)
    assert_close_to_reference(grad_logp, truth[2], 1e-10, what="grad log_probs")
    assert_close_to_reference(grad_entropy, truth[3], 1e-10, what="grad entropy")


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_policy_loss_gradcheck(device, backend):
    """The kernels' own backward against finite differences (float64), away from
    the clip boundaries where the loss has kinks. Token level only: GSPO's
    sequence-level gradient is straight-through by design, not the derivative
    of its forward value (the float64 test above covers it against the reference)."""
    torch.manual_seed(0)
    shape = (3, 9)
    old = -torch.rand(shape, dtype=torch.float64, device=device) * 3
    logp = (old + 0.01 * torch.randn(shape, dtype=torch.float64, device=device)).requires_grad_(True)
    adv = torch.randn(shape, dtype=torch.float64, device=device)
    mask = torch.rand(shape, device=device) > 0.2
    ref = old + torch.randn(shape, dtype=torch.float64, device=device)
    entropy = torch.rand(shape, dtype=torch.float64, device=device).requires_grad_(True)
    with fastrl.use_backend(backend):
        for mode in ("token-mean", "seq-mean-token-mean"):
            fn = lambda x, e: fastrl.policy_loss(  # noqa: E731
                x, old, adv, mask, ref_log_probs=ref, kl_coef=0.3, entropy=e, entropy_coef=0.2, loss_agg_mode=mode
            )[0]  # fmt: skip
            assert torch.autograd.gradcheck(fn, (logp, entropy))


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_all_zero_mask_gives_zero_loss_metrics_and_gradient(device, backend):
    inputs = per_token_inputs((4, 16), device)
    inputs["response_mask"] = torch.zeros(4, 16, dtype=torch.bool, device=device)
    with fastrl.use_backend(backend):
        for mode in reference.AGG_MODES:
            got = _run_policy(
                fastrl.policy_loss, inputs,
                {"loss_agg_mode": mode, "ref_log_probs": inputs["ref_log_probs"], "kl_coef": 0.1, "entropy_coef": 0.1,
                 "clip_ratio_c": 3.0},
                True,
            )  # fmt: skip
            loss, metrics, grad_logp, grad_entropy = got
            assert float(loss.detach()) == 0.0
            assert all(float(v) == 0.0 for v in metrics.values()), metrics
            assert torch.equal(grad_logp, torch.zeros_like(grad_logp))
            assert torch.equal(grad_entropy, torch.zeros_like(grad_entropy))
            assert float(fastrl.agg_loss(inputs["entropy"], inputs["response_mask"], mode)) == 0.0


@pytest.mark.parametrize("shape", [(3, 0), (0, 5), (2, 0, 4)], ids=["no-tokens", "no-sequences", "3-d"])
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_empty_inputs_give_zero_loss_metrics_and_empty_gradients(device, backend, shape):
    """What the reference's math gives on no tokens (x / 0 := 0, L = 0 included):
    loss 0 and metrics 0 (never NaN), gradients of the inputs' (empty) shape, empty weights."""
    empty = torch.zeros(shape, device=device)
    mask = empty.bool()
    with fastrl.use_backend(backend):
        for level, mode in itertools.product(reference.RATIO_LEVELS, reference.AGG_MODES):
            logp, entropy = empty.clone().requires_grad_(True), empty.clone().requires_grad_(True)
            loss, metrics = fastrl.policy_loss(
                logp, empty, empty, mask, ratio_level=level, loss_agg_mode=mode, clip_ratio_c=3.0,
                rollout_is_weights=empty, ref_log_probs=empty, kl_coef=0.1, entropy=entropy, entropy_coef=0.01,
            )  # fmt: skip
            loss.backward()
            assert loss.shape == () and float(loss.detach()) == 0.0, (level, mode)
            assert set(metrics) == set(METRICS) | {"kl", "entropy"}
            assert all(float(v) == 0.0 for v in metrics.values()), (level, mode, metrics)
            assert logp.grad.shape == shape and entropy.grad.shape == shape
            values = empty.clone().requires_grad_(True)
            agg = fastrl.agg_loss(values, mask.float(), mode)
            agg.backward()
            assert agg.shape == () and float(agg.detach()) == 0.0 and values.grad.shape == shape, mode
        for level, mode in itertools.product(reference.RATIO_LEVELS, reference.CORRECTION_MODES):
            weights, metrics = fastrl.rollout_correction(empty, empty, mask, level=level, mode=mode)
            assert weights.shape == shape and weights.dtype == torch.float32
            assert metrics and all(float(v) == 0.0 for v in metrics.values()), (level, mode, metrics)


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_one_dimensional_inputs(device, backend):
    with fastrl.use_backend(backend):
        inputs = per_token_inputs((1, 40), device)
        flat = {k: v[0] for k, v in inputs.items()}
        options = {"loss_agg_mode": "seq-mean-token-mean", "ratio_level": "sequence"}
        got = _run_policy(fastrl.policy_loss, flat, options, False)
    truth, eager = _reference_runs(inputs, options, False)
    assert_as_accurate_as_eager(got[0], truth[0], eager[0], what="loss of a 1-D sequence",
                                magnitude=_sum_magnitudes(inputs, options, False)["loss"])  # fmt: skip


AGG_OPTIONS = [
    {},
    {"dp_size": 4, "batch_num_tokens": 777, "global_batch_size": 31},
    {"batch_num_tokens": torch.tensor(123.0), "global_batch_size": torch.tensor(9), "loss_scale_factor": 64},
]


@pytest.mark.parametrize("options", AGG_OPTIONS, ids=["local", "global-counts", "tensor-counts"])
@pytest.mark.parametrize("loss_agg_mode", reference.AGG_MODES)
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_agg_loss_matches_reference(device, backend, loss_agg_mode, options):
    inputs = per_token_inputs((7, 45), device)
    values = torch.randn(7, 45, dtype=torch.float64).to(device)
    values[~inputs["response_mask"]] = math.nan
    mask = inputs["response_mask"].to(torch.float32)  # a 0/1 float mask, as veRL passes

    def run(fn, v):
        x = v.clone().requires_grad_(True)
        out = fn(x, mask, loss_agg_mode, **options)
        out.backward()
        return out, x.grad

    truth = run(reference.agg_loss, values)
    eager = run(reference.agg_loss, values.float())
    with fastrl.use_backend(backend):
        got = run(fastrl.agg_loss, values.float())
    assert got[0].shape == () and got[0].dtype == torch.float32
    magnitude = CHUNK_SUM_ROUNDINGS * reference.agg_loss(values.abs(), mask, loss_agg_mode, **options)
    assert_as_accurate_as_eager(got[0], truth[0], eager[0], what="agg_loss", magnitude=magnitude)
    assert_as_accurate_as_eager(got[1], truth[1], eager[1], what="grad")


@pytest.mark.parametrize("clip_min", [None, 0.6])
@pytest.mark.parametrize("mode", reference.CORRECTION_MODES)
@pytest.mark.parametrize("level", reference.RATIO_LEVELS)
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_rollout_correction_matches_reference(device, backend, level, mode, clip_min):
    inputs = per_token_inputs((6, 50), device)
    old = inputs["log_probs"]
    # Rollout log-probs near the trainer's (a few per cent off per token), a few far off.
    rollout = inputs["log_probs"] + 0.05 * torch.randn(6, 50, device=device)
    rollout[:, ::17] -= 3.0
    mask = inputs["response_mask"]
    rollout[~mask] = math.nan
    truth_w, truth_m = reference.rollout_correction(
        old.double(), rollout.double(), mask, level=level, mode=mode, clip_min=clip_min
    )
    with fastrl.use_backend(backend):
        weights, metrics = fastrl.rollout_correction(old, rollout, mask, level=level, mode=mode, clip_min=clip_min)
    assert weights.dtype == torch.float32 and weights.shape == old.shape and not weights.requires_grad
    assert bool((weights[~mask] == 0).all())
    assert_close_to_reference(weights, truth_w, 1e-5, what="weights")
    assert set(metrics) == set(truth_m)
    for name, value in metrics.items():
        assert value.shape == () and value.dtype == torch.float32
        assert_close_to_reference(value, truth_m[name], 1e-5, what=name)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_policy_loss_from_logits_matches_reference(device, backend, with_entropy):
    shape, vocab = (3, 11), 4097
    inputs = per_token_inputs(shape, device)
    logits = make_logits(shape, vocab, torch.bfloat16, std=2.0, device=device)
    labels = make_labels(logits, ignore_frac=0.0)
    options = {
        "temperature": 0.7, "ref_log_probs": inputs["ref_log_probs"], "kl_coef": 0.1, "clip_ratio_c": 3.0,
        "loss_agg_mode": "seq-mean-token-sum-norm", "entropy_coef": 0.02 if with_entropy else 0.0,
    }  # fmt: skip
    args = (labels, inputs["old_log_probs"], inputs["advantages"], inputs["response_mask"])

    def run(fn, x):
        x = x.clone().requires_grad_(True)
        loss, metrics = fn(x, *args, **options)
        loss.backward()
        return loss, metrics, x.grad

    truth = run(reference.policy_loss_from_logits, logits.double())
    with fastrl.use_backend(backend):
        loss, metrics, grad = run(fastrl.policy_loss_from_logits, logits)
        in_place = logits.clone().requires_grad_(True)
        loss_ip, _ = fastrl.policy_loss_from_logits(in_place, *args, inplace_backward=True, **options)
        loss_ip.backward()
    assert ("entropy" in metrics) == with_entropy
    assert_close_to_reference(loss, truth[0], 1e-4, what="loss")
    for name, value in metrics.items():
        assert_close_to_reference(value, truth[1][name], 1e-4, what=name)
    assert grad.dtype == torch.bfloat16
    scale = float(truth[2].abs().max())
    assert_close_to_reference(grad, truth[2], 2.0**-7, atol=2.0**-7 * scale, what="grad logits")
    assert torch.equal(in_place.grad, grad), "inplace_backward must give the same gradient"


def _bad_policy_calls(device):
    x = torch.zeros(2, 3, device=device)
    mask = torch.ones(2, 3, dtype=torch.bool, device=device)

    def call(**kw):
        args = {"log_probs": x, "old_log_probs": x, "advantages": x, "response_mask": mask}
        args.update(kw)
        return lambda: fastrl.policy_loss(**args)

    return [
        (call(log_probs=x.long()), TypeError, "log_probs must have a floating dtype"),
        (call(old_log_probs=x[:, :2]), ValueError, "old_log_probs must have the shape"),
        (call(advantages=[0.0]), TypeError, "advantages must be a torch.Tensor"),
        (call(response_mask=torch.full((2, 3), 2.0, device=device)), ValueError, "response_mask must be bool or hold"),
        (call(response_mask=mask[:1]), ValueError, "response_mask must have the shape"),
        (call(clip_ratio_low=-0.1), ValueError, "clip_ratio_low must be non-negative"),
        (call(clip_ratio_high=-1), ValueError, "clip_ratio_high must be non-negative"),
        (call(clip_ratio_c=1.0), ValueError, "clip_ratio_c must be > 1"),
        (call(clip_ratio_c="3"), TypeError, "clip_ratio_c must be a float"),
        (call(ratio_level="seq"), ValueError, "ratio_level must be one of 'token', 'sequence'"),
        (call(loss_agg_mode="mean"), ValueError, "loss_agg_mode must be one of 'token-mean'"),
        (call(ref_log_probs=x, kl_estimator="k4"), ValueError, "kl_estimator must be one of 'kl'"),
        (call(kl_coef=0.1), ValueError, "kl_coef is nonzero but ref_log_probs is None"),
        (call(entropy_coef=0.1), ValueError, "entropy_coef is nonzero but entropy is None"),
        (call(dp_size=0), ValueError, "dp_size must be >= 1"),
        (call(dp_size=2), ValueError, "batch_num_tokens .* is required when dp_size > 1"),
        (call(dp_size=2, loss_agg_mode="seq-mean-token-mean"), ValueError, "global_batch_size .* is required"),
        (call(batch_num_tokens=-1), ValueError, "batch_num_tokens must be non-negative"),
        # Tensor counts (on the CPU, so checked whatever the op's device): a negative one flips the loss.
        (call(batch_num_tokens=torch.tensor(-5.0)), ValueError, "batch_num_tokens must be non-negative and finite"),
        (call(batch_num_tokens=torch.tensor([-3])), ValueError, "batch_num_tokens must be non-negative and finite"),
        (call(loss_agg_mode="seq-mean-token-sum", global_batch_size=torch.tensor(float("nan"))), ValueError,
         "global_batch_size must be non-negative and finite"),
        (lambda: fastrl.agg_loss(x, mask, "seq-mean-token-mean", global_batch_size=torch.tensor([math.inf])),
         ValueError, "global_batch_size must be non-negative and finite"),
        (call(loss_scale_factor=0), ValueError, "loss_scale_factor must be positive"),
        (lambda: fastrl.agg_loss(x, mask, "seq-mean"), ValueError, "loss_agg_mode must be one of"),
        (lambda: fastrl.rollout_correction(x, x, mask, level="tok"), ValueError, "level must be one of"),
        (lambda: fastrl.rollout_correction(x, x, mask, mode="clip"), ValueError, "mode must be one of 'truncate', 'mask'"),
        (lambda: fastrl.rollout_correction(x, x, mask, clip_max=0.0), ValueError, "clip_max must be positive"),
        (lambda: fastrl.rollout_correction(x, x, mask, clip_min=3.0), ValueError, r"clip_min must be in \[0, clip_max"),
        (lambda: fastrl.policy_loss_from_logits(x.unsqueeze(-1), x.long(), x, x, mask, entropy=x), TypeError,
         "computes the entropy from the logits"),
    ]  # fmt: skip


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_bad_input_raises_naming_the_argument(device, backend, monkeypatch):
    # The checks that read a tensor's values (a mask holding 2) would sync a GPU
    # with the host, so there they run only with FASTRL_CHECKS=1 (fastrl._validation).
    monkeypatch.setenv("FASTRL_CHECKS", "1")
    with fastrl.use_backend(backend):
        for call, error, match in _bad_policy_calls(device):
            with pytest.raises(error, match=match):
                call()


SWAPPED = (
    r"old_log_probs requires grad but log_probs does not, so the loss would have no gradient; the two look swapped"
)


@pytest.mark.parametrize("backend", [b for b in kernel_backends("cpu") if b == "native"] + ["reference"])
def test_verl_argument_order_raises_naming_the_fix(backend):
    """veRL's compute_policy_loss_vanilla(old_log_prob, log_prob, ...) takes the old
    log-probs first; kept with fastrl.policy_loss, the loss would have no gradient
    and torch would only say "element 0 of tensors does not require grad" at
    backward. The swap is refused at call time, naming fastrl's order and the
    keywords, on every backend (before any kernel); fastrl's order, positional or
    by name, runs and differentiates."""
    # old = current (ratio 1, inside every clip range), advantages in [0.5, 1.5) and
    # every token valid, so that fastrl's order has the gradient -A / n on each token
    # whatever the seed.
    logp = -torch.rand(2, 5, requires_grad=True)  # the current policy, as a model gives it
    old, adv = logp.detach().clone(), torch.rand(2, 5) + 0.5
    mask = torch.ones(2, 5, dtype=torch.bool)
    entropy = (torch.rand(2, 5) * 4).requires_grad_(True)
    with fastrl.use_backend(backend):
        with pytest.raises(ValueError, match=SWAPPED + r": fastrl\.policy_loss\(log_probs, old_log_probs, advantages, "
                           r"response_mask, \.\.\.\) takes the current policy's log-probs first, where veRL's "
                           r"compute_policy_loss_vanilla\(old_log_prob, log_prob, \.\.\.\) takes the old ones first\. "
                           r"Call it in fastrl's order or by name \(log_probs=\.\.\., old_log_probs=\.\.\.\)"):
            fastrl.policy_loss(old, logp, adv, mask)  # veRL's order
        with pytest.raises(ValueError, match=SWAPPED):  # an entropy term with a gradient does not hide it
            fastrl.policy_loss(old, logp, adv, mask, entropy=entropy, entropy_coef=0.01)
        # veRL's fifth positional argument, loss_agg_mode: the keyword-only options are named, with veRL's order
        positional = r"policy_loss\(\) takes 4 positional arguments .* but 5 were given; "
        with pytest.raises(TypeError, match=positional + r"clip_ratio_low, .*loss_agg_mode.* are keyword-only.*old "
                                                         r"log-probs first"):  # fmt: skip
            fastrl.policy_loss(old, logp, adv, mask, "token-mean")
        for loss, _ in (fastrl.policy_loss(logp, old, adv, mask),
                        fastrl.policy_loss(old_log_probs=old, log_probs=logp, advantages=adv, response_mask=mask)):
            (grad,) = torch.autograd.grad(loss, logp)
            assert grad[mask].abs().sum() > 0
        with torch.no_grad():  # no gradient to lose: a metrics-only call is not refused
            fastrl.policy_loss(logp, old.clone().requires_grad_(True), adv, mask)
        # old log-probs that require grad beside current ones that do too: a constant, as documented
        fastrl.policy_loss(logp, logp * 1.0, adv, mask)[0].backward()


def test_policy_loss_from_logits_refuses_a_loss_without_gradient():
    """From the logits: old_log_probs requiring grad while the logits do not is
    the same no-gradient loss; the error names the logits, not log_probs."""
    logits = torch.randn(2, 3, 7)
    labels = torch.randint(7, (2, 3))
    old = -torch.rand(2, 3, requires_grad=True)
    adv, mask = torch.randn(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"old_log_probs requires grad but logits does not, so the loss would have no "
                                         r"gradient; .* pass logits that require grad\..* torch\.no_grad\(\) or pass "
                                         r"old_log_probs\.detach\(\)"):  # fmt: skip
        fastrl.policy_loss_from_logits(logits, labels, old, adv, mask)
    loss, _ = fastrl.policy_loss_from_logits(logits.requires_grad_(True), labels, old.detach(), adv, mask)
    loss.backward()
    assert logits.grad is not None


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_float_parameters_reach_the_kernels_in_float64(device, backend):
    """A global token count above 2^24, the clip ratios and the coefficients reach
    the kernels as float64 (kernels/_launch.py float_scalar_arg): Triton passes a
    Python float as float32, which rounds 2^24 + 1 to 2^24, a float64 loss off by
    6e-8. Bound: float64 sums of 32 tokens, a few ulps (1e-13 relative)."""
    inputs = per_token_inputs((4, 8), device, dtype=torch.float64)
    args = [inputs[k] for k in ("log_probs", "old_log_probs", "advantages", "response_mask")]
    kwargs = {"ref_log_probs": inputs["ref_log_probs"], "batch_num_tokens": 2**24 + 1, "clip_ratio_low": 0.1,
              "clip_ratio_high": 0.3, "kl_coef": 0.3}  # fmt: skip
    expected, _ = reference.policy_loss(*(a.double() for a in args[:3]), args[3], **kwargs)
    with fastrl.use_backend(backend):
        loss, _ = fastrl.policy_loss(*args, **kwargs)
    assert loss.dtype == torch.float64
    assert_close_to_reference(loss, expected, 1e-13, atol=0.0, what="loss")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_tensor_counts_are_checked_only_under_fastrl_checks(monkeypatch):
    """A count on the GPU is read only under FASTRL_CHECKS=1 (no host sync otherwise)."""
    x = torch.zeros(2, 3, device="cuda")
    count = torch.tensor(-4.0, device="cuda")
    fastrl.agg_loss(x, x.bool(), batch_num_tokens=count)
    monkeypatch.setenv("FASTRL_CHECKS", "1")
    with pytest.raises(ValueError, match="batch_num_tokens must be non-negative and finite"):
        fastrl.agg_loss(x, x.bool(), batch_num_tokens=count)


@pytest.mark.parametrize("estimator", ["low_var_kl", "k3+"])
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_kl_term_is_accurate_for_tiny_log_ratios(device, backend, estimator):
    """The policy kernels' k3 term near d = logp - ref = 0 (|d| from 1e-7 to 1e-2),
    against float64 expm1(c) - c, c = -d (relative error <= 2^-52 / |c|, below 1e-9
    here). Bound, 48 eps relative: 24 eps per token (tests/test_kl.py derives it)
    for values of one sign, so their sum keeps it, plus the float32 summation of the
    reference backend (<= log2(256) = 8 eps) or of the kernels' 64-token chunk (<= 7:
    2 tokens a thread, 5 shuffles) and the final rounding; the gradient is
    kl_coef / N (1 - e^c) per token, within the same bound."""
    shape = (4, 64)
    logp = -0.5 - 3 * torch.rand(shape, dtype=torch.float64)
    d = torch.logspace(-7, -2, logp.numel(), dtype=torch.float64).view(shape) * torch.sign(torch.randn(shape))
    logp, ref = logp.float(), (logp + d).float()
    c = -(logp.double() - ref.double())  # the kernels' difference exactly (Sterbenz)
    k3 = torch.special.expm1(c) - c
    mask = torch.ones(shape, dtype=torch.bool)
    zeros = torch.zeros(shape)
    x = logp.clone().to(device).requires_grad_(True)
    with fastrl.use_backend(backend):
        loss, metrics = fastrl.policy_loss(x, x.detach(), zeros.to(device), mask.to(device),
                                           ref_log_probs=ref.to(device), kl_coef=1.0, kl_estimator=estimator)  # fmt: skip
        loss.backward()
    bound = 48 * torch.finfo(torch.float32).eps / 2
    assert_close_to_reference(metrics["kl"], k3.mean(), bound, atol=0.0, what="kl")
    grad = -torch.special.expm1(c) if estimator == "low_var_kl" else -c
    assert_close_to_reference(x.grad, grad / k3.numel(), bound, atol=0.0, what="grad log_probs")


def test_metrics_and_loss_need_no_host_sync_on_the_cpu_path_either():
    """Every output is a tensor on the inputs' device (no .item() inside)."""
    inputs = per_token_inputs((3, 8))
    loss, metrics = fastrl.policy_loss(
        inputs["log_probs"], inputs["old_log_probs"], inputs["advantages"], inputs["response_mask"],
        ref_log_probs=inputs["ref_log_probs"],
    )  # fmt: skip
    assert all(isinstance(v, torch.Tensor) and v.device == loss.device for v in metrics.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_policy_loss_under_cuda_graph_capture():
    inputs = per_token_inputs((8, 256), "cuda")
    args = (inputs["old_log_probs"], inputs["advantages"], inputs["response_mask"])
    kwargs = {"ref_log_probs": inputs["ref_log_probs"], "kl_coef": 0.1, "clip_ratio_c": 3.0}
    eager = inputs["log_probs"].clone().requires_grad_(True)
    expected, _ = fastrl.policy_loss(eager, *args, **kwargs)
    expected.backward()
    # The captured leaf is another tensor: a leaf whose gradient was accumulated on
    # the default stream keeps that stream in its AccumulateGrad node, and the
    # captured backward would then make the legacy stream wait on the capture
    # (cudaErrorStreamCaptureImplicit, seen on an H100; PyTorch's rule: warm up
    # on a side stream).
    logp = inputs["log_probs"].clone().requires_grad_(True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
        for _ in itertools.repeat(None, 2):
            logp.grad = None
            fastrl.policy_loss(logp, *args, **kwargs)[0].backward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    logp.grad = None
    with torch.cuda.graph(graph):
        loss, metrics = fastrl.policy_loss(logp, *args, **kwargs)
        loss.backward()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(loss, expected)
    assert torch.equal(logp.grad, eager.grad)
