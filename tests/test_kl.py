"""kl_penalty and full_kl against the float64 reference, on every backend
available (native C++, Triton interpreted on CPU or compiled on GPU, and the
reference itself)."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from conftest import assert_close_to_reference, backend_params, make_logits, output_tolerance

import fastrl
from fastrl import reference

BACKENDS = backend_params()
ESTIMATORS = reference.KL_ESTIMATORS + tuple(name + "+" for name in reference.KL_ESTIMATORS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_kl_penalty_values_and_gradients(device, backend, estimator, dtype):
    """Log-ratios from 1e-4 to 40, both signs, past the k3 clamps (|d| > 20 and
    e^c - c - 1 > 10); gradients w.r.t. both inputs."""
    shape = (3, 5, 41)
    logp = -torch.rand(shape, dtype=torch.float64) * 8
    scale = torch.tensor([1e-4, 0.1, 1.0, 3.0, 40.0], dtype=torch.float64).view(1, 5, 1)
    ref = logp + torch.randn(shape, dtype=torch.float64) * scale
    logp, ref = logp.to(dtype).to(device), ref.to(dtype).to(device)
    weights = torch.randn(shape, dtype=torch.float64, device=device)

    def run(fn, a, b):
        x, y = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        out = fn(x, y, estimator)
        (out * weights.to(out.dtype)).sum().backward()
        return out.detach(), x.grad, y.grad

    truth = run(reference.kl_penalty, logp.double(), ref.double())
    with fastrl.use_backend(backend):
        out, grad_logp, grad_ref = run(fastrl.kl_penalty, logp, ref)
    assert out.shape == shape and out.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    # The inputs are rounded to ``dtype`` before the reference sees them, so the
    # only error is the fp32 arithmetic; relative to |d| where the value is ~d.
    atol = tol * float(truth[0].abs().max()) * (1e-3 if dtype == torch.float64 else 1e-2)
    assert_close_to_reference(out, truth[0], tol, atol=atol, what="kl")
    grad_tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2.0**-7}[dtype]
    for got, want, what in ((grad_logp, truth[1], "grad log_probs"), (grad_ref, truth[2], "grad ref_log_probs")):
        assert got.dtype == dtype
        assert_close_to_reference(got, want, grad_tol, atol=grad_tol * float(want.abs().max()) + 1e-30, what=what)


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_kl_penalty_matches_the_documented_formulas(device, backend):
    d = torch.tensor([-25.0, -3.0, -1e-3, 0.0, 2e-3, 4.0, 25.0], dtype=torch.float64, device=device)
    ref = torch.full_like(d, -2.0)
    logp = ref + d
    c = (-d).clamp(-20, 20)
    expected = {
        "k1": d, "abs": d.abs(), "k2": 0.5 * d * d, "k3": (c.exp() - c - 1).clamp(-10, 10),
    }  # fmt: skip
    with fastrl.use_backend(backend):
        for name, want in expected.items():
            assert_close_to_reference(fastrl.kl_penalty(logp, ref, name), want, 1e-9, what=name)


def _exact_estimate(d: float, estimator: str) -> tuple[float, float]:
    """(value, d value / d logp) of an estimator at the log-ratio d, in 50-digit
    arithmetic (mpmath), rounded once to float64: the truth for tiny log-ratios,
    independent of the implementations' series."""
    base = estimator.rstrip("+")
    with mpmath.workdps(50):
        x = mpmath.mpf(d)
        if base in ("kl", "k1"):
            value, grad = x, mpmath.mpf(1)
        elif base == "abs":
            value, grad = abs(x), mpmath.sign(x)
        elif base in ("mse", "k2"):
            value, grad = x * x / 2, x
        else:  # |d| <= 1 here: k3's clamps are inactive
            value, grad = mpmath.expm1(-x) + x, -mpmath.expm1(-x)
        if estimator.endswith("+"):
            grad = x
        return float(value), float(grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_kl_estimators_are_accurate_near_zero(device, backend, estimator, dtype):
    """Log-ratios d = logp - ref from 1e-9 to 1 in magnitude, both signs, against a
    50-digit evaluation, relatively. k3 = e^c - c - 1 (c = -d) computed as written
    loses eps / (c^2 / 2) to cancellation (2e-5 in fp32 at c = -0.086, 100% below
    c ~ 3e-4); evaluated without it, the error bound is 24 eps: at most 4.4x
    cancellation (at |c| = 1, the worst of e^c - 1 - c for |c| >= 1) of an exp
    accurate to 2 ulps plus two roundings, and less on the series branch (|c| < 1)."""
    n = 2000
    magnitude = torch.logspace(-9, 0, n, dtype=torch.float64)
    ref64 = -0.5 - 3 * torch.rand(n, dtype=torch.float64)
    logp = (ref64 + magnitude * torch.sign(torch.randn(n, dtype=torch.float64))).to(dtype)
    ref = ref64.to(dtype)
    d = logp.double() - ref.double()  # the kernels' difference exactly (Sterbenz: within a factor 2)
    truth = torch.tensor([_exact_estimate(float(v), estimator) for v in d], dtype=torch.float64)
    x = logp.clone().to(device).requires_grad_(True)
    with fastrl.use_backend(backend):
        out = fastrl.kl_penalty(x, ref.to(device), estimator)
        out.sum().backward()
    bound = 24 * torch.finfo(dtype).eps / 2
    assert_close_to_reference(out, truth[:, 0], bound, atol=0.0, what=f"{estimator} near 0")
    assert_close_to_reference(x.grad, truth[:, 1], bound, atol=0.0, what=f"grad {estimator} near 0")


FULL_KL_LEAD = {1: (4,), 7: (2, 3), 4097: (3,), 32000: (2,)}


@pytest.mark.parametrize("temperature", ["1.0", "0.6", "per-row"])
@pytest.mark.parametrize("vocab", [1, 7, 4097, 32000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_full_kl_values_and_gradients(device, backend, dtype, vocab, temperature):
    lead = FULL_KL_LEAD[vocab]
    logits = make_logits(lead, vocab, dtype, std=3.0, device=device)
    # The reference policy: near the policy on most rows, far on one; the same
    # masked vocabulary (-inf where the logits have it).
    noise = torch.randn(logits.shape, dtype=torch.float64, device=device)
    noise.view(-1, vocab)[-1] *= 20.0
    ref_logits = (logits.double() + 0.3 * noise).to(dtype)
    temp = float(temperature) if temperature != "per-row" else (torch.rand(lead, dtype=torch.float64) + 0.5).to(device)
    weights = torch.randn(lead, dtype=torch.float64, device=device)

    def run(fn, x, y):
        x = x.clone().requires_grad_(True)
        out = fn(x, y, temperature=temp)
        (out * weights.to(out.dtype)).sum().backward()
        return out.detach(), x.grad

    truth = run(reference.full_kl, logits.double(), ref_logits.double())
    with fastrl.use_backend(backend):
        kl, grad = run(fastrl.full_kl, logits, ref_logits)
    assert kl.shape == lead and kl.dtype == torch.float32
    assert bool((kl >= -1e-5).all()), "a KL is never negative beyond rounding"
    assert_close_to_reference(kl, truth[0], output_tolerance(vocab), what="full_kl")
    assert grad.dtype == dtype and torch.isfinite(grad).all()
    rtol = 1e-5 if dtype == torch.float32 else 2.0**-7
    atol = rtol * float(truth[1].abs().max()) + _grad_conditioning(logits, ref_logits, temp, weights)
    assert_close_to_reference(grad, truth[1], rtol, atol=atol, what="grad")


def _grad_conditioning(logits, ref_logits, temperature, weights):
    """What float32 arithmetic can get right in dKL/dx_j = w p_j (log p_j - log q_j - KL) / T:
    log p_j and log q_j carry an error of a few ulps of their size (large where
    the reference gives a likely token a tiny probability), times w p_j / T."""
    x, y = logits.double(), ref_logits.double()
    t = temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    logp, logq = torch.log_softmax(x / t, dim=-1), torch.log_softmax(y / t, dim=-1)
    p = logp.exp()
    kl = torch.where(p > 0, p * (logp - logq), 0.0).sum(dim=-1, keepdim=True)
    size = torch.where(p > 0, logp.abs() + logq.abs() + kl.abs(), 0.0)
    scale = 8 * 2.0**-24 * (weights.abs().unsqueeze(-1) / t) * p * size
    return float(scale.max())


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_full_kl_edge_rows(device, backend):
    vocab = 300
    x = torch.randn(4, vocab, dtype=torch.float64, device=device) * 4
    y = x.clone()
    y[1] += torch.randn(vocab, dtype=torch.float64, device=device)
    x[2, :50] = -math.inf  # p = 0 there: adds nothing, whatever the reference says
    y[2, :80] = -math.inf  # p_ref = 0 where p > 0: KL = +inf
    x[3, 10:] = -math.inf
    y[3, 10:] = -math.inf
    with fastrl.use_backend(backend):
        kl = fastrl.full_kl(x.float(), y.float())
        logits = x.float().clone().requires_grad_(True)
        fastrl.full_kl(logits, y.float())[[0, 1, 3]].sum().backward()
    assert float(kl[0]) == pytest.approx(0.0, abs=1e-6), "identical rows"
    assert_close_to_reference(kl[[1, 3]], reference.full_kl(x, y)[[1, 3]], 1e-5)
    assert kl[2] == math.inf
    assert torch.isfinite(logits.grad[[0, 1, 3]]).all()
    assert bool((logits.grad[3, 10:] == 0).all()), "masked vocabulary gets no gradient"


def _finfo_min_masked_reference_cases():
    """(device, backend, temperature): every backend at T = 1.7; the kernels also
    at T < 1. The reference backend's float32 autograd cannot give a finite
    gradient there: it forms dKL/dp(v) = r_v / T, beyond the float range where
    the reference is masked, on the way to a finite dKL/dx."""
    return [
        pytest.param(*p.values, t, id=f"{p.id}-{t}", marks=p.marks)
        for p in BACKENDS
        for t in (1.7, 0.6, 0.3)
        if t > 1 or p.values[1] != "reference"
    ]


@pytest.mark.parametrize("device,backend,temperature", _finfo_min_masked_reference_cases())
def test_full_kl_with_a_finfo_min_masked_reference(device, backend, temperature):
    """A reference masked with finfo.min where the policy is not: the KL is huge
    but finite in float64 (1e27 to 1e37 here, fp32 numbers), and so are its
    value and gradient on every backend. The terms e (x - m - (y - m')) of 3e38
    must not overflow their sum, and at T < 1 (y - m') / T overflows to -inf
    although the KL is a float: the kernels keep 1/T out of the terms (1e-5
    relative: the terms' rounding, a few ulps, as in any row)."""
    x = torch.randn(4, 3000, dtype=torch.float64, device=device)
    y = torch.randn(4, 3000, dtype=torch.float64, device=device)
    y[:, ::3] = torch.finfo(torch.float32).min
    # Less of the policy's mass on the masked tokens row by row (the KL is about
    # that mass times 3.4e38 / T, an fp32 number for each row at T = 0.3).
    x[:, ::3] -= torch.tensor([[3.0], [4.0], [5.0], [8.0]], dtype=torch.float64, device=device)
    x, y = x.float(), y.float()
    truth = x.double().requires_grad_(True)
    expected = reference.full_kl(truth, y.double(), temperature=temperature)
    expected.sum().backward()
    logits = x.clone().requires_grad_(True)
    with fastrl.use_backend(backend):
        kl = fastrl.full_kl(logits, y, temperature=temperature)
        kl.sum().backward()
    assert_close_to_reference(kl, expected.detach(), 1e-5)
    assert torch.isfinite(logits.grad).all()
    assert_close_to_reference(logits.grad, truth.grad, 1e-5, atol=1e-5 * float(truth.grad.abs().max()), what="grad")


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_full_kl_gradcheck(device, backend):
    x = torch.randn(3, 9, dtype=torch.float64, device=device).requires_grad_(True)
    y = torch.randn(3, 9, dtype=torch.float64, device=device)
    t = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64, device=device)
    with fastrl.use_backend(backend):
        assert torch.autograd.gradcheck(lambda a: fastrl.full_kl(a, y, temperature=t), (x,))


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_bad_input_raises_naming_the_argument(device, backend):
    x = torch.zeros(2, 3, device=device)
    calls = [
        (lambda: fastrl.kl_penalty(x, x, "full"), ValueError, "estimator must be one of 'kl', 'k1'"),
        (lambda: fastrl.kl_penalty(x, x[:1]), ValueError, "ref_log_probs must have the shape"),
        (lambda: fastrl.kl_penalty(x.long(), x), TypeError, "log_probs must have a floating dtype"),
        (lambda: fastrl.kl_penalty(x, None), TypeError, "ref_log_probs must be a torch.Tensor"),
        (lambda: fastrl.full_kl(x, x[:, :2]), ValueError, "ref_logits must have the shape of logits"),
        (lambda: fastrl.full_kl(x, x.double()), TypeError, "ref_logits must have the dtype of logits"),
        (lambda: fastrl.full_kl(x, x, temperature=0.0), ValueError, "temperature must be between"),
        (lambda: fastrl.full_kl(x.int(), x), TypeError, "logits must have a floating dtype"),
    ]
    with fastrl.use_backend(backend):
        for call, error, match in calls:
            with pytest.raises(error, match=match):
                call()
