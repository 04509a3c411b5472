"""logprobs_from_logits / logprobs_and_entropy / entropy_from_logits against the
float64 reference, on every backend available (native C++, Triton interpreted on
CPU or compiled on GPU, and the reference itself)."""

from __future__ import annotations

import inspect
import math
import re
import warnings

import pytest
import torch
from conftest import (
    assert_close_to_reference,
    backend_params,
    kernel_backends,
    make_labels,
    make_logits,
    output_tolerance,
)

import fastrl
from fastrl import _validation, reference

BACKENDS = backend_params()
KERNEL_BACKENDS = backend_params(include_reference=False)

# Leading shapes cycle with the vocabulary so that 1-D, 2-D and 3-D inputs all
# meet every dtype and temperature.
LEAD_SHAPES = {1: (5,), 7: (3, 4), 4097: (2, 3, 2), 32000: (6,)}

# Rounding of a gradient stored in the logits' dtype (half an ulp at 1.0, times two).
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float64: 1e-12}


def _temperature(kind, lead_shape, device):
    if kind == "per-row":
        return (torch.rand(lead_shape, dtype=torch.float64) * 1.5 + 0.3).to(device)
    return float(kind)


def _reference_with_grads(logits, labels, temperature, weights_lp, weights_ent):
    """Float64 reference outputs and d(sum(w_lp lp) + sum(w_ent ent))/dlogits."""
    x = logits.detach().double().requires_grad_(True)
    t = temperature.double() if isinstance(temperature, torch.Tensor) else temperature
    lp, ent = reference.logprobs_and_entropy(x, labels, temperature=t)
    ((lp * weights_lp.double()).sum() + (ent * weights_ent.double()).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


def _grad_bound(expected_grad, dtype):
    """(rtol, atol) for a gradient in ``dtype``: the dtype's rounding relative to
    each element, plus that much of the largest element for the fp32 arithmetic."""
    rtol = GRAD_RTOL[dtype]
    return rtol, rtol * float(expected_grad.abs().max()) + 1e-30


@pytest.mark.parametrize("temperature", ["0.3", "1.0", "1.7", "per-row"])
@pytest.mark.parametrize("vocab", [1, 7, 4097, 32000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_values_and_gradients_match_float64_reference(device, backend, dtype, vocab, temperature):
    lead = LEAD_SHAPES[vocab]
    std = 10.0 if temperature in ("0.3", "per-row") else 1.0
    logits = make_logits(lead, vocab, dtype, std=std, device=device)
    labels = make_labels(logits)
    temp = _temperature(temperature, lead, device)
    w_lp = torch.randn(lead, device=device)
    w_ent = torch.randn(lead, device=device)
    ref_lp, ref_ent, ref_grad = _reference_with_grads(logits, labels, temp, w_lp, w_ent)

    x = logits.clone().requires_grad_(True)
    with fastrl.use_backend(backend):
        lp, ent = fastrl.logprobs_and_entropy(x, labels, temperature=temp)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    assert lp.dtype == ent.dtype == torch.float32
    assert lp.shape == ent.shape == lead
    tol = output_tolerance(vocab)
    assert_close_to_reference(lp, ref_lp, tol, what="logprob")
    assert_close_to_reference(ent, ref_ent, tol, what="entropy")
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    assert torch.isfinite(x.grad).all(), "gradient must be finite, -inf logits included"
    rtol, atol = _grad_bound(ref_grad, dtype)
    if backend == "reference":
        # The reference backend is the spec run by torch's own fp32 autograd (log_softmax's
        # backward subtracts exp(out) * sum(grad) over the row): it reaches 1e-5 relative
        # only most of the time (seed 631897978: 2.4e-5). The fused kernels are held to 1e-5.
        rtol, atol = 4 * rtol, 4 * atol
    assert_close_to_reference(x.grad, ref_grad, rtol, atol, what="grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_qwen_vocabulary(device, backend, dtype):
    """V = 151936 (Qwen2.5), a few rows, both outputs and the gradient."""
    logits = make_logits((3,), 151936, dtype, std=2.0, device=device)
    labels = make_labels(logits, ignore_frac=0.0)
    w = torch.randn(3, device=device)
    ref_lp, ref_ent, ref_grad = _reference_with_grads(logits, labels, 0.7, w, w)
    x = logits.clone().requires_grad_(True)
    with fastrl.use_backend(backend):
        lp, ent = fastrl.logprobs_and_entropy(x, labels, temperature=0.7)
        ((lp * w).sum() + (ent * w).sum()).backward()
    assert_close_to_reference(lp, ref_lp, output_tolerance(151936), what="logprob")
    assert_close_to_reference(ent, ref_ent, output_tolerance(151936), what="entropy")
    assert_close_to_reference(x.grad, ref_grad, *_grad_bound(ref_grad, dtype), what="grad")


@pytest.mark.parametrize("temperature", [0.3, 1.0])
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_large_magnitudes_and_peaked_rows(device, backend, temperature):
    """Logits up to 1e4 in fp32: nearly one-hot rows (entropy ~ 0, log-prob of
    the top token ~ 0) must keep their accuracy, not lose it to cancellation."""
    logits = (torch.rand(8, 1000, dtype=torch.float64) * 2e4 - 1e4).float()
    logits[:4, :] *= 1e-3  # four rows of moderate logits next to four extreme ones
    logits[4, 17] = 1e4
    labels = logits.argmax(dim=-1)
    labels[5] = 3
    logits, labels = logits.to(device), labels.to(device)
    ref_lp, ref_ent = reference.logprobs_and_entropy(logits.double(), labels, temperature=temperature)
    with fastrl.use_backend(backend):
        lp, ent = fastrl.logprobs_and_entropy(logits, labels, temperature=temperature)
    assert_close_to_reference(lp, ref_lp, 1e-5, what="logprob")
    assert_close_to_reference(ent, ref_ent, 1e-5, what="entropy")


@pytest.mark.parametrize("which", ["logprob", "entropy", "both"])
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_gradcheck_float64(device, backend, which):
    """Finite differences in float64 against each backend's own backward (the
    kernels compute float64 input in float64), with per-row temperatures,
    ignore_index rows and -inf logits."""
    logits = make_logits((3, 2), 6, torch.float64, std=2.0, device=device)
    labels = logits.argmax(dim=-1)  # on a finite logit: a -inf log-prob has no finite difference
    labels[1, 0] = -100
    temp = _temperature("per-row", (3, 2), device)

    def f(x):
        lp, ent = fastrl.logprobs_and_entropy(x, labels, temperature=temp)
        return {"logprob": (lp,), "entropy": (ent,), "both": (lp, ent)}[which]

    with fastrl.use_backend(backend):
        assert torch.autograd.gradcheck(f, (logits.clone().requires_grad_(True),), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_single_output_functions(device, backend):
    logits = make_logits((4, 3), 517, torch.bfloat16, std=3.0, device=device)
    labels = make_labels(logits)
    ref_lp, ref_ent = reference.logprobs_and_entropy(logits.double(), labels, temperature=1.3)
    x_lp = logits.clone().requires_grad_(True)
    x_ent = logits.clone().requires_grad_(True)
    with fastrl.use_backend(backend):
        lp = fastrl.logprobs_from_logits(x_lp, labels, temperature=1.3)
        ent = fastrl.entropy_from_logits(x_ent, temperature=1.3)
        lp.sum().backward()
        ent.sum().backward()
    assert_close_to_reference(lp, ref_lp, 1e-5, what="logprob")
    assert_close_to_reference(ent, ref_ent, 1e-5, what="entropy")
    for x, op in ((x_lp, lambda z: reference.logprobs_from_logits(z, labels, temperature=1.3)),
                  (x_ent, lambda z: reference.entropy_from_logits(z, temperature=1.3))):
        expected = torch.func.grad(lambda z: op(z).sum())(logits.double())
        assert_close_to_reference(x.grad, expected, *_grad_bound(expected, torch.bfloat16), what="grad")


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_verl_positional_signature_and_trl_formula(device, backend):
    """veRL calls logprobs_from_logits(logits, labels, inplace_backward); TRL's
    selective_log_softmax on fp32 is gather(logits) - logsumexp(logits)."""
    logits = torch.randn(2, 5, 300, device=device)
    labels = torch.randint(300, (2, 5), device=device)
    trl_style = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    with fastrl.use_backend(backend):
        out = fastrl.logprobs_from_logits(logits, labels, False)
    assert out.dtype == torch.float32 and out.shape == labels.shape
    torch.testing.assert_close(out, trl_style, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_per_row_temperature_broadcasts(device, backend):
    """A temperature of shape [B, 1] (one per sequence) against [B, S] tokens."""
    logits = make_logits((3, 4), 50, device=device)
    labels = make_labels(logits, ignore_frac=0.0)
    temp = torch.tensor([[0.5], [1.0], [2.0]], device=device)
    expected = reference.logprobs_from_logits(logits.double(), labels, temperature=temp.double())
    with fastrl.use_backend(backend):
        out = fastrl.logprobs_from_logits(logits, labels, temperature=temp)
    assert_close_to_reference(out, expected, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_finfo_min_masking_and_extreme_rows(device, backend, dtype):
    """``logits.masked_fill(~allowed, finfo.min)`` at T < 1, and a row holding
    both +-finfo.max: (x - m) / T overflows to -inf for finite logits, which must
    give p = 0 there (entropy and gradients finite, as in float64), never 0 * -inf."""
    finfo = torch.finfo(dtype)
    logits = torch.randn(4, 50, dtype=torch.float64)
    logits[:2, 10:] = finfo.min  # a masked vocabulary, the common idiom
    logits[2, 3], logits[2, 4] = finfo.max, finfo.min  # both extremes in one row
    logits[3, 7] = finfo.min
    logits = logits.to(dtype).to(device)
    labels = torch.tensor([1, 2, 3, 0], device=device)  # row 2: its argmax (finite log-prob 0)
    w_lp, w_ent = torch.randn(4, device=device), torch.randn(4, device=device)
    ref_lp, ref_ent, ref_grad = _reference_with_grads(logits, labels, 0.7, w_lp, w_ent)
    x = logits.clone().requires_grad_(True)
    with fastrl.use_backend(backend):
        lp, ent = fastrl.logprobs_and_entropy(x, labels, temperature=0.7)
        ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
        loss, _ = fastrl.policy_loss_from_logits(
            logits.clone().unsqueeze(0).requires_grad_(True), labels.view(1, 4), torch.zeros(1, 4, device=device),
            torch.randn(1, 4, device=device), torch.ones(1, 4, device=device), temperature=0.7,
            entropy_coef=0.01,
        )  # fmt: skip
    assert_close_to_reference(lp, ref_lp, 1e-5, what="logprob")
    assert_close_to_reference(ent, ref_ent, 1e-5, what="entropy")
    assert torch.isfinite(x.grad).all(), "no NaN gradient from a finite, masked logit"
    assert_close_to_reference(x.grad, ref_grad, *_grad_bound(ref_grad, dtype), what="grad")
    assert torch.isfinite(loss), "the policy loss with an entropy term stays finite"


@pytest.mark.parametrize("temperature", ["0.3", "1.0", "per-row"])
@pytest.mark.parametrize("vocab", [1, 7, 4097, 32000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_sum_pi_squared_matches_float64_reference(device, backend, dtype, vocab, temperature):
    """sum_pi_squared alone and as logprobs_and_entropy's third output (the same
    bits, and the log-probs and entropy the bits they have without it), against
    the float64 reference within DESIGN.md's output tolerance; its gradient with
    the other two outputs' (float32 logits: the Σπ² term is added in float32 to
    the kernel's gradient, within _grad_bound of the float64 one)."""
    lead = LEAD_SHAPES[vocab]
    std = 10.0 if temperature in ("0.3", "per-row") else 1.0
    logits = make_logits(lead, vocab, dtype, std=std, device=device)
    labels = make_labels(logits)
    temp = _temperature(temperature, lead, device)
    weights = [torch.randn(lead, device=device) for _ in range(3)]
    x64 = logits.detach().double().requires_grad_(True)
    t64 = temp.double() if isinstance(temp, torch.Tensor) else temp
    truths = (*reference.logprobs_and_entropy(x64, labels, temperature=t64), reference.sum_pi_squared(x64, temperature=t64))
    sum(((t * w.double()).sum() for t, w in zip(truths, weights, strict=True))).backward()

    x = logits.clone().requires_grad_(True)
    with fastrl.use_backend(backend):
        outputs = fastrl.logprobs_and_entropy(x, labels, temperature=temp, sum_pi_squared=True)
        sum(((t * w).sum() for t, w in zip(outputs, weights, strict=True))).backward()
        alone = fastrl.sum_pi_squared(logits, temperature=temp)
        without = fastrl.logprobs_and_entropy(logits, labels, temperature=temp)
    lp, ent, sq = outputs
    assert sq.dtype == torch.float32 and sq.shape == lead
    assert torch.equal(alone, sq.detach()), "sum_pi_squared alone and as the third output: the same bits"
    assert torch.equal(without[0], lp.detach()) and torch.equal(without[1], ent.detach()), "bits of the others kept"
    assert_close_to_reference(sq, truths[2].detach(), output_tolerance(vocab), what="sum_pi_squared")
    if dtype == torch.float32:
        rtol, atol = _grad_bound(x64.grad, dtype)
        if backend == "reference":
            rtol, atol = 4 * rtol, 4 * atol  # (as test_values_and_gradients_match_float64_reference)
        assert_close_to_reference(x.grad, x64.grad, rtol, atol, what="grad")


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_sum_pi_squared_of_extreme_rows(device, backend):
    """A peaked row (Σπ² rounds to 1 in float32), a row masked with finfo.min and
    -inf, logits of size 1e4, a row of only -inf and a row with a NaN (both NaN,
    as their log-probs); a gradient through Σπ² alone stays finite on the rest."""
    logits = torch.randn(6, 3000, device=device)
    logits[0, 17] += 60.0
    logits[1, ::2] = torch.finfo(torch.float32).min
    logits[1, 1::4] = float("-inf")
    logits[2] *= 1e4
    logits[3] = float("-inf")
    logits[4, 2999] = float("nan")
    truth = reference.sum_pi_squared(logits.double(), temperature=0.6)
    x = logits.clone().requires_grad_(True)
    with fastrl.use_backend(backend):
        sq = fastrl.sum_pi_squared(x, temperature=0.6)
        sq[[0, 1, 2, 5]].sum().backward()
    assert sq[3].isnan() and sq[4].isnan()
    keep = [0, 1, 2, 5]
    assert_close_to_reference(sq[keep], truth[keep], 1e-5, what="sum_pi_squared")
    assert torch.isfinite(x.grad[keep]).all()


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_rows_no_gradient_reaches_get_zero_whatever_their_logits(device, backend, dtype, inplace):
    """A row whose outputs all get a zero incoming gradient (an ignore_index label,
    an entropy and a Σπ² the loss leaves out: veRL's padding rows, issue 40) gets +0
    everywhere, even where its logits are NaN, +inf or only -inf: 0 * NaN would
    reach every weight the gradient does. The other rows get the gradient they get
    alone, bitwise."""
    vocab = 300
    logits = make_logits((7,), vocab, dtype=dtype, device=device)
    logits[1, 17] = float("nan")
    logits[2] = float("-inf")
    logits[3, 5] = float("inf")
    logits[4] = float("nan")
    logits[5] = torch.finfo(dtype).min
    labels = make_labels(logits, ignore_frac=0.0)
    labels[1:6] = -100
    used = [0, 6]
    x = logits.clone().requires_grad_(True)
    alone = logits[used].clone().requires_grad_(True)
    with fastrl.use_backend(backend):
        for rows, pick in ((x, used), (alone, [0, 1])):
            lp, ent, sq = fastrl.logprobs_and_entropy(rows.clone() if inplace else rows, labels[used] if rows is alone
                                                      else labels, inplace_backward=inplace, sum_pi_squared=True)
            (lp.sum() + ent[pick].sum() + 0.5 * sq[pick].sum()).backward()
    assert torch.equal(x.grad[1:6].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       torch.zeros_like(x.grad[1:6].view(torch.int16 if dtype == torch.bfloat16 else torch.int32)))
    if backend == "reference":  # (plain torch: batch invariance is the kernels' promise)
        torch.testing.assert_close(x.grad[used], alone.grad, rtol=0, atol=0)
    else:
        assert torch.equal(x.grad[used], alone.grad), "the other rows' gradient is theirs alone"
    assert torch.isfinite(alone.grad).all() and torch.count_nonzero(alone.grad) > 0


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_nan_anywhere_in_a_row_gives_nan(device, backend):
    """A NaN logit makes its row's log-prob, entropy and gradient NaN wherever it
    sits: a whole leading chunk of NaN (which has no max), one NaN at the end, a
    row of only NaN; the other rows stay exact."""
    logits = torch.randn(4, 3000, device=device)
    logits[0, :2048] = float("nan")
    logits[1, -1] = float("nan")
    logits[2] = float("nan")
    labels = torch.tensor([2500, 5, 7, 9], device=device)
    x = logits.clone().requires_grad_(True)
    with fastrl.use_backend(backend):
        lp, ent = fastrl.logprobs_and_entropy(x, labels)
        (lp.sum() + ent.sum()).backward()
    assert lp[:3].isnan().all() and ent[:3].isnan().all()
    assert x.grad[:3].isnan().all(dim=1).all(), "NaN in, NaN out for the row's gradient"
    assert torch.isfinite(lp[3]) and torch.isfinite(ent[3]) and torch.isfinite(x.grad[3]).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("vocab", [32000, 151936])
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_entropy_of_peaked_rows_is_accurate(device, backend, vocab, temperature):
    """One logit 30 above the rest (entropy 1e-18 to 0.04): the entropy, about
    sum_tail e^d (1 - d), to (2 D + 60) ulps of float32 relative (about 1e-5 at
    T = 0.5), D the mean |d| of the tail weighted by e^d (1 + |d|), from the
    float64 reference. Error bound: on a GPU each e^d is 2^(d log2 e) with
    d log2 e rounded to float32 (2 ulps of it, the scale's rounding and the
    product's: 2 |d| ulps of e^d) and exp2's own 3 ulps, d itself within an ulp;
    the sums add at most 16 terms per tile in float32 plus one add per tile (at
    most 38 tiles of 4096), then float64: 2 |d| + 5 + 16 + 38 + a few, per term. They are
    summed without a float32 1 in the sum (the old kernels lost the tail to it:
    2e-3 off at V = 32000, T = 1.7)."""
    logits = torch.randn(3, vocab, dtype=torch.float64)
    logits[:, 5] += 30.0
    logits[1, vocab // 2] += 30.0  # two tied peaks
    logits = logits.float().to(device)
    ref = reference.entropy_from_logits(logits.double(), temperature=temperature)
    with fastrl.use_backend(backend):
        ent = fastrl.entropy_from_logits(logits, temperature=temperature)
    d = (logits.double().cpu() - logits.double().cpu().max(-1, keepdim=True).values) / temperature
    weight = torch.where(d < 0, d.exp() * (1 - d), 0.0)
    mean_abs_d = (weight * -d).sum(-1) / weight.sum(-1)
    rtol = (2 * mean_abs_d + 60) * 2.0**-24
    err = (ent.double().cpu() - ref.cpu()).abs() / ref.cpu().abs()
    assert bool((err <= rtol).all()), f"entropy: relative errors {err.tolist()} over bounds {rtol.tolist()}"


@pytest.mark.parametrize("temperature", [0.5, 1.0])
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_entropy_and_logprobs_of_extremely_peaked_rows(device, backend, temperature):
    """Rows [g, 0, ..., 0] (and [g, g, 0, ..., 0]: two peaks), where the tail's
    share t = (V - n) e^{-g/T} of s = n + t is far below a float64 ulp of n past
    g/T of about 45 at this V, and the entropy log(n + t) + (g/T) t / (n + t),
    about t (1 + g/T), lives in it: log(n + t) loses it (2% off at g/T = 45).
    Against the closed form, to (2 g/T + 40) ulps of float32 relative (5e-6 at
    g/T = 45). Error bound: T is a power of 2, so every x - m is exact, and the
    GPU kernels (Triton's exp2) take e^d as 2^(d log2 e)
    with d log2 e rounded to float32, off by up to 2 ulps of itself (the scale's
    rounding and the product's): (2 g/T) ulps of e^d, one systematic error since
    the terms are equal, plus 3 for exp2; the tail is summed in float32 chains of
    at most 16 terms per tile and one add per tile (at most 20 tiles here) before
    float64: 40 ulps in all. The native kernels' accurate exp stays far inside."""
    vocab = 20000
    gaps = torch.tensor([20.0, 33.0, 45.0, 60.0], dtype=torch.float64)
    logits = torch.zeros(2 * len(gaps), vocab, dtype=torch.float64)
    logits[:, 0] = gaps.repeat(2) * temperature
    logits[len(gaps) :, 7] = logits[len(gaps) :, 0]  # the second peak
    n = torch.tensor([1.0] * len(gaps) + [2.0] * len(gaps), dtype=torch.float64)
    g = gaps.repeat(2)
    t = (vocab - n) * torch.exp(-g)
    expected_entropy = torch.log(n) + torch.log1p(t / n) + g * t / (n + t)
    expected_max_logprob = -torch.log(n) - torch.log1p(t / n)
    labels = torch.zeros(len(n), dtype=torch.long, device=device)
    with fastrl.use_backend(backend):
        lp, ent = fastrl.logprobs_and_entropy(logits.float().to(device), labels, temperature=temperature)
    ulps = (2 * g + 40) * 2.0**-24
    ent_err = (ent.double().cpu() - expected_entropy).abs() / expected_entropy.abs()
    lp_err = (lp.double().cpu() - expected_max_logprob).abs() / expected_max_logprob.abs()
    assert bool((ent_err <= ulps).all()), f"entropy: relative errors {ent_err.tolist()} over bounds {ulps.tolist()}"
    assert bool((lp_err <= ulps).all()), f"logprob: relative errors {lp_err.tolist()} over bounds {ulps.tolist()}"


@pytest.mark.parametrize("vocab", [8193, 16387, 50257])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_rows_at_any_alignment(device, backend, dtype, vocab):
    """Rows that start anywhere in a 16-byte line (an odd V; a row offset by one
    element): the Triton forward reads them one element a lane, the backward
    loads whole blocks from each row's first 16-byte boundary and the few
    elements before it apart (V = 8193, 16387: whole 4096-element tiles and 1 or
    3 more). Tolerance: DESIGN.md's output bound."""
    base = torch.randn(6, vocab + 1, dtype=torch.float64, device=device) * 3
    sliced = base.to(dtype)[:, 1:]  # every row one element past its allocation's alignment
    labels = torch.randint(vocab, (6,), device=device)
    weights = torch.randn(2, 6, dtype=torch.float64, device=device)
    truth = sliced.double().requires_grad_(True)
    ref_lp, ref_ent = reference.logprobs_and_entropy(truth, labels)
    (weights[0] * ref_lp + weights[1] * ref_ent).sum().backward()
    tol = output_tolerance(vocab)
    for logits in (sliced, sliced.contiguous()):  # the backward's rows: as the gradient's, or not
        leaf = logits.detach().requires_grad_(True)  # keeps the layout (a view of the same storage)
        with fastrl.use_backend(backend):
            lp, ent = fastrl.logprobs_and_entropy(leaf, labels)
            (weights[0].to(lp.dtype) * lp + weights[1].to(ent.dtype) * ent).sum().backward()
        assert_close_to_reference(lp, ref_lp, tol, what="logprob")
        assert_close_to_reference(ent, ref_ent, tol, what="entropy")
        assert_close_to_reference(leaf.grad, truth.grad, *_grad_bound(truth.grad, dtype), what="grad")


@pytest.mark.parametrize("vocab,distinct", [(131, 15), (4099, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_row_result_does_not_depend_on_its_address(device, backend, dtype, vocab, distinct):
    """Batch invariance where it is hardest: with an odd V the rows of a
    contiguous batch start at every place in a 16-byte line (8 for bf16, 2 for
    float64). Eight copies of a few distinct rows, each copy at another place,
    give bitwise the same log-prob, entropy and full KL: the forwards count
    their tiles from a row's first element, never from an address. V = 131: the
    partial tile only; 4099: a whole tile of 4096 and a partial one. A float32
    output hides a different order of float32 sums in all but a few rows in a
    hundred, a float64 one in few: hence float64, and 15 rows."""
    logits = torch.randn(distinct, vocab, dtype=torch.float64, device=device).mul(3).to(dtype)
    ref_logits = torch.randn(distinct, vocab, dtype=torch.float64, device=device).mul(3).to(dtype)
    labels = torch.randint(vocab, (distinct,), device=device)
    copies = 8  # copy c of row d is row c * distinct + d: with distinct odd, at 8 places in a line
    with fastrl.use_backend(backend):
        lp, ent = fastrl.logprobs_and_entropy(logits.repeat(copies, 1), labels.repeat(copies))
        kl = fastrl.full_kl(logits.repeat(copies, 1), ref_logits.repeat(copies, 1))
    for name, out in (("logprob", lp), ("entropy", ent), ("full_kl", kl)):
        out = out.view(copies, distinct)
        differ = (out != out[0]).any(dim=1).nonzero().flatten().tolist()
        assert not differ, f"{name}: copies {differ} of the rows differ from the first"


@pytest.mark.parametrize("layout", ["transposed", "sliced-vocab", "strided-rows"])
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_non_contiguous_logits(device, backend, layout):
    base = make_logits((6, 64), 80, device=device, masked=False)
    logits = {
        "transposed": base.transpose(0, 1),  # [64, 6, 80], rows not evenly strided
        "sliced-vocab": base[:, :, :71],  # unit stride, row stride 80
        "strided-rows": base[::2, ::3],  # unit stride, gaps between rows
    }[layout]
    labels = make_labels(logits)
    ref_lp, ref_ent, ref_grad = _reference_with_grads(
        logits, labels, 1.0, torch.ones(labels.shape, device=device), torch.ones(labels.shape, device=device)
    )
    x = logits.detach().requires_grad_(True)
    with fastrl.use_backend(backend):
        lp, ent = fastrl.logprobs_and_entropy(x, labels)
        (lp.sum() + ent.sum()).backward()
    assert_close_to_reference(lp, ref_lp, 1e-5, what="logprob")
    assert_close_to_reference(ent, ref_ent, 1e-5, what="entropy")
    assert_close_to_reference(x.grad, ref_grad, *_grad_bound(ref_grad, torch.float32), what="grad")


def _largest_allocation(fn):
    """(bytes of the largest CPU allocation made while ``fn()`` runs, its result),
    from the torch profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0), result


SLICED_LAYOUTS = {
    # veRL's actor: the response's logits, logits[:, -response_length - 1:-1]
    "response-slice": lambda full: full[:, -5:-1],
    "transposed": lambda full: full.transpose(0, 1),  # [S, B, V]: two strides that do not merge
    "strided-rows": lambda full: full[:, ::2],
    "vocab-slice": lambda full: full[..., :-5],  # a padded vocabulary cut to size
    # rows of whole 16-byte lines (V = 504 bf16) that start 6 bytes past a boundary
    "off-boundary": lambda full: full[..., 3:-5],
}


@pytest.mark.parametrize("layout", list(SLICED_LAYOUTS))
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_sliced_logits_are_read_in_place(device, backend, layout):
    """A layout with unit stride in V and two leading strides is never copied by
    any logits op (log-probs, full KL, sampling, truncated log-probs): the
    forward allocates nothing near the size of the logits (per-row outputs
    only), and with inplace_backward the gradient that reaches the slice lives
    in the logits' own storage. Values as the float64 reference."""
    from fastrl.kernels.sampling import workspace_bytes

    full = make_logits((2, 7), 512, torch.bfloat16, std=2.0, device=device, masked=False)
    leaf = full.detach().clone().requires_grad_(True)
    full = leaf * 1  # a model's output
    logits = SLICED_LAYOUTS[layout](full)
    labels = make_labels(logits)
    budget = logits.numel() * logits.element_size() // 8
    with fastrl.use_backend(backend):
        with torch.no_grad():
            ref_logits = SLICED_LAYOUTS[layout](full * 2)
            tokens = labels.clamp(min=0)  # truncated_logprobs has no ignore_index
            calls = {
                "logprobs_and_entropy": lambda x: fastrl.logprobs_and_entropy(x, labels),
                "full_kl": lambda x: fastrl.full_kl(x, ref_logits),
                "sample": lambda x: fastrl.sample(x, temperature=0.7, top_k=20, seed=7),
                "truncated_logprobs": lambda x: fastrl.truncated_logprobs(x, tokens, temperature=0.7, top_k=20),
            }
            for name, call in calls.items():
                peak, out = _largest_allocation(lambda: call(logits))
                if name in ("sample", "truncated_logprobs") and backend == "triton":
                    # the sampler's per-row workspace (candidate lists of at most V / 8 entries)
                    peak -= workspace_bytes(logits)
                assert peak < budget, f"{name} allocated {peak} bytes on {layout} logits"
                # The same rows in the same order: bitwise the results of a contiguous
                # copy, whatever the view's strides and wherever its rows start in a
                # 16-byte line (a row's partition is a function of V, the dtype and
                # the launch: kernels._launch.tile_config).
                copy = logits.contiguous()
                copy_out = call(copy)
                pairs = list(zip(out, copy_out)) if isinstance(out, tuple) else [(out, copy_out)]
                for a, b in pairs:
                    assert torch.equal(a, b), f"{name} differs from a contiguous copy"
        captured = {}
        logits.register_hook(lambda g: captured.setdefault("grad", g))
        lp, ent = fastrl.logprobs_and_entropy(logits, labels, inplace_backward=True)
        lp_values = lp.detach().clone()
        (lp.sum() + ent.sum()).backward()
    grad = captured["grad"]
    storage = full.untyped_storage()
    assert grad.untyped_storage().data_ptr() == storage.data_ptr(), "the gradient is written into the logits"
    ref_lp, _, ref_grad = _reference_with_grads(
        SLICED_LAYOUTS[layout](leaf.detach()), labels, 1.0, torch.ones(labels.shape, device=device),
        torch.ones(labels.shape, device=device),
    )  # fmt: skip
    assert_close_to_reference(lp_values, ref_lp, 1e-5, what="logprob")
    assert_close_to_reference(grad, ref_grad, *_grad_bound(ref_grad, torch.bfloat16), what="grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_inplace_backward_writes_into_logits_storage(device, backend, dtype):
    logits = make_logits((4, 3), 1000, dtype, std=2.0, device=device)
    labels = make_labels(logits)
    w = torch.randn(4, 3, device=device)
    with fastrl.use_backend(backend):
        x = logits.clone().requires_grad_(True)
        lp, ent = fastrl.logprobs_and_entropy(x, labels)
        ((lp * w).sum() + ent.sum()).backward()
        expected = x.grad

        leaf = logits.clone().requires_grad_(True)
        h = leaf * 1  # a non-leaf activation, as logits are in a model
        captured = {}
        h.register_hook(lambda g: captured.setdefault("grad", g))
        lp, ent = fastrl.logprobs_and_entropy(h, labels, inplace_backward=True)
        ((lp * w).sum() + ent.sum()).backward()
    grad = captured["grad"]
    assert grad.data_ptr() == h.data_ptr(), "the gradient must live in the logits' own storage"
    assert torch.equal(h, grad), "the logits buffer now holds the gradient"
    torch.testing.assert_close(grad, expected, rtol=0, atol=0)
    torch.testing.assert_close(leaf.grad, expected, rtol=0, atol=0)


def _inplace_misuse(case, logits, labels):
    """Runs one misuse of inplace_backward=True on ``h = logits * 2`` (a model's
    activation) and returns (the input tensor, d loss / d input)."""
    x = logits.clone().requires_grad_(True)
    h = x * 2
    if case == "other-op-saved-logits":  # created first, so its backward runs after fastrl's
        other = fastrl.entropy_from_logits(h).sum()
    elif case == "elementwise-op-saved-logits":
        other = (h**2).sum()
    elif case == "full-kl-saved-logits":
        other = fastrl.full_kl(h, torch.zeros_like(logits)).sum()
    else:
        other = 0.0
    if case == "leaf":
        h = x
    elif case == "view-of-leaf":
        h = x[:, :]
    elif case == "expanded-rows":
        x = logits[:1].clone().requires_grad_(True)
        h = (x * 2).expand(logits.shape)
    loss = fastrl.logprobs_from_logits(h, labels, True).sum() + other
    loss.backward(retain_graph=case == "retain-graph")
    if case == "retain-graph":
        loss.backward()
    return x, x.grad


@pytest.mark.parametrize(
    "case, loud",
    [
        ("other-op-saved-logits", True), ("elementwise-op-saved-logits", True), ("full-kl-saved-logits", True),
        ("retain-graph", True), ("leaf", False), ("view-of-leaf", False), ("expanded-rows", False),
    ],
)  # fmt: skip
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_inplace_backward_misuse_is_loud_or_safe(device, backend, case, loud):
    """inplace_backward=True never corrupts a gradient silently: where another
    node still needs the logits, torch's version check raises; where writing over
    them cannot be right (a leaf, overlapping rows), a fresh buffer is used and
    the gradient equals the out-of-place one."""
    logits = torch.randn(4, 100, device=device)
    labels = torch.randint(100, (4,), device=device)
    with fastrl.use_backend(backend):
        if loud:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                _inplace_misuse(case, logits, labels)
            return
        leaf, grad = _inplace_misuse(case, logits, labels)
        x = (logits[:1] if case == "expanded-rows" else logits).clone().requires_grad_(True)
        h = x if case in ("leaf", "view-of-leaf") else (x * 2).expand(logits.shape)
        fastrl.logprobs_from_logits(h, labels).sum().backward()
    torch.testing.assert_close(grad, x.grad, rtol=0, atol=0)
    assert torch.equal(leaf.detach(), x.detach()), "the input keeps its values"


@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_double_backward_raises(device, backend):
    """The backward is a kernel: create_graph=True would silently drop the
    second-order term (the gradient would not depend on the logits in autograd's
    eyes), so it raises, naming the reference backend as the way out."""
    x = torch.randn(2, 8, device=device, requires_grad=True)
    with fastrl.use_backend(backend), pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(fastrl.entropy_from_logits(x).sum(), x, create_graph=True)
    with fastrl.use_backend("reference"):
        (g,) = torch.autograd.grad(fastrl.entropy_from_logits(x).sum(), x, create_graph=True)
    assert g.requires_grad


@pytest.mark.parametrize("vocab", [5000, 4099])
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_deterministic_and_batch_invariant(device, backend, vocab):
    """Bitwise the same on repeat, and a row's result does not depend on the
    rows around it (alone, or anywhere in batches of other sizes). V = 4099
    bf16 rows are not whole 16-byte lines: in the batch most start off a
    boundary, alone rows 0, 16 and 32 start on one (the Triton kernels then
    took another partition of the row: issue 39); and the same rows sliced out
    of a padded buffer (rows on boundaries) give the same bits too, as do the
    rows of a view that starts 6 bytes past a boundary (V = 5000 bf16 rows are
    whole lines: there every row of the view starts off one)."""
    logits = make_logits((33,), vocab, torch.bfloat16, std=3.0, device=device)
    labels = make_labels(logits)
    padded = torch.zeros(33, -(-(vocab + 1) // 64) * 64, dtype=logits.dtype, device=device)  # rows on boundaries
    padded[:, :vocab] = logits
    shifted = torch.zeros(logits.numel() + 8, dtype=logits.dtype, device=device)[3 : 3 + logits.numel()]
    shifted = shifted.view(logits.shape).copy_(logits)
    with fastrl.use_backend(backend):
        lp1, ent1 = fastrl.logprobs_and_entropy(logits, labels)
        lp2, ent2 = fastrl.logprobs_and_entropy(logits, labels)
        assert torch.equal(lp1, lp2) and torch.equal(ent1, ent2)
        lp_pad, ent_pad = fastrl.logprobs_and_entropy(padded[:, :vocab], labels)
        assert torch.equal(lp_pad, lp1) and torch.equal(ent_pad, ent1)
        lp_shift, ent_shift = fastrl.logprobs_and_entropy(shifted, labels)
        assert torch.equal(lp_shift, lp1) and torch.equal(ent_shift, ent1)
        for rows in (slice(7, 8), slice(5, 20), slice(0, 2), slice(0, 1), slice(16, 17), slice(32, 33)):
            lp_sub, ent_sub = fastrl.logprobs_and_entropy(logits[rows].clone(), labels[rows].clone())
            assert torch.equal(lp_sub, lp1[rows]) and torch.equal(ent_sub, ent1[rows])
            lp_view, ent_view = fastrl.logprobs_and_entropy(logits[rows], labels[rows])
            assert torch.equal(lp_view, lp1[rows]) and torch.equal(ent_view, ent1[rows])
        x = logits.clone().requires_grad_(True)
        fastrl.logprobs_and_entropy(x, labels)[0].sum().backward()
        x_one = logits[7:8].clone().requires_grad_(True)
        fastrl.logprobs_and_entropy(x_one, labels[7:8])[0].sum().backward()
    assert torch.equal(x.grad[7:8], x_one.grad)


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_ignore_index_rows(device, backend):
    logits = make_logits((6,), 40, device=device)
    labels = make_labels(logits, ignore_frac=0.0)
    labels[labels == 7] = 8
    labels[[1, 4]] = 7  # a custom ignore_index that is also a valid token id
    x = logits.clone().requires_grad_(True)
    with fastrl.use_backend(backend):
        lp, ent = fastrl.logprobs_and_entropy(x, labels, ignore_index=7)
        lp.sum().backward()
    assert lp[1] == 0 and lp[4] == 0
    assert torch.isfinite(ent).all() and (ent[[1, 4]] > 0).all(), "entropy stays defined on ignored rows"
    assert torch.count_nonzero(x.grad[[1, 4]]) == 0, "ignored rows get zero gradient"
    assert torch.count_nonzero(x.grad[0]) > 0


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_label_on_masked_logit(device, backend):
    """A label on a -inf logit gives -inf with a finite gradient; an all -inf
    row gives NaN (as log_softmax does) without touching other rows."""
    logits = torch.randn(3, 10, device=device)
    logits[0, 4] = float("-inf")
    logits[2] = float("-inf")
    labels = torch.tensor([4, 2, 1], device=device)
    x = logits.clone().requires_grad_(True)
    with fastrl.use_backend(backend):
        lp, ent = fastrl.logprobs_and_entropy(x, labels)
        lp[:2].sum().backward()
    assert lp[0] == float("-inf")
    assert torch.isfinite(lp[1]) and torch.isfinite(ent[:2]).all()
    assert lp[2].isnan() and ent[2].isnan()
    assert torch.isfinite(x.grad[:2]).all()
    assert x.grad[0, 4] == 1.0, "d logprob / d logit of the label is 1 - p = 1"


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_nan_row_stays_in_its_row(device, backend):
    logits = torch.randn(4, 100, device=device)
    logits[1, 30] = float("nan")
    labels = torch.randint(100, (4,), device=device)
    with fastrl.use_backend(backend):
        lp, ent = fastrl.logprobs_and_entropy(logits, labels)
    assert lp[1].isnan() and ent[1].isnan()
    assert torch.isfinite(lp[[0, 2, 3]]).all() and torch.isfinite(ent[[0, 2, 3]]).all()


@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_kernel_marks_out_of_range_labels_nan(device, backend):
    """What the CUDA path relies on without FASTRL_CHECKS: the kernels never read
    outside the row for a bad label and mark that row NaN (called directly,
    below the argument checks)."""
    from fastrl._ops import launchers

    kernels = launchers(backend, "logprobs")
    logits = torch.randn(4, 64, device=device)
    labels = torch.tensor([3, 64, -5, -100], device=device)
    lp, ent, stats, _ = kernels.logprobs_forward(logits, labels, 1.0, -100, with_entropy=True, with_stats=True)
    assert torch.isfinite(lp[0]) and lp[1].isnan() and lp[2].isnan() and lp[3] == 0
    assert torch.isfinite(ent).all()
    grad = torch.empty_like(logits)
    kernels.logprobs_backward(logits, labels, 1.0, -100, stats, None, torch.ones(4, device=device), None, grad)
    assert torch.isfinite(grad[[0, 3]]).all() and grad[[1, 2]].isnan().all()


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_empty_inputs(device, backend):
    logits = torch.randn(0, 7, 11, device=device, requires_grad=True)
    labels = torch.zeros(0, 7, dtype=torch.long, device=device)
    with fastrl.use_backend(backend):
        lp, ent = fastrl.logprobs_and_entropy(logits, labels)
        (lp.sum() + ent.sum()).backward()
    assert lp.shape == ent.shape == (0, 7) and lp.dtype == torch.float32
    assert logits.grad.shape == logits.shape


@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_no_grad_saves_nothing_and_unused_entropy_skips_its_term(device, backend, monkeypatch):
    from fastrl._ops import launchers

    kernels = launchers(backend, "logprobs")
    calls = []
    forward, backward = kernels.logprobs_forward, kernels.logprobs_backward

    def spy_forward(*args, **kwargs):
        calls.append(("forward", kwargs["with_stats"]))
        return forward(*args, **kwargs)

    def spy_backward(*args):
        calls.append(("backward", args[7] is not None))  # grad_entropy
        return backward(*args)

    monkeypatch.setattr(kernels, "logprobs_forward", spy_forward)
    monkeypatch.setattr(kernels, "logprobs_backward", spy_backward)
    logits = torch.randn(4, 50, device=device, requires_grad=True)
    labels = torch.randint(50, (4,), device=device)
    with fastrl.use_backend(backend):
        with torch.no_grad():
            lp, ent = fastrl.logprobs_and_entropy(logits, labels)
        assert lp.grad_fn is None and ent.grad_fn is None
        lp, ent = fastrl.logprobs_and_entropy(logits, labels)
        lp.sum().backward()  # entropy unused
    assert calls == [("forward", False), ("forward", True), ("backward", False)]
    expected = torch.func.grad(lambda x: reference.logprobs_from_logits(x, labels).sum())(logits.detach())
    torch.testing.assert_close(logits.grad, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("label_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_int32_and_int64_labels(device, backend, label_dtype):
    logits = make_logits((5,), 33, device=device)
    labels = make_labels(logits, dtype=label_dtype)
    expected = reference.logprobs_from_logits(logits.double(), labels)
    with fastrl.use_backend(backend):
        assert_close_to_reference(fastrl.logprobs_from_logits(logits, labels), expected, 1e-5)


# ---- bad input -------------------------------------------------------------------------------


def _ok():
    return torch.randn(2, 3, 5), torch.randint(5, (2, 3))


@pytest.mark.parametrize(
    "make_args,error,match",
    [
        (lambda: (_ok()[0], torch.randint(5, (2, 4))), ValueError, "labels must have shape"),
        (lambda: (torch.randn(2, 3, 0), torch.zeros(2, 3, dtype=torch.long)), ValueError, "logits must have a non-empty"),
        (lambda: (torch.randint(5, (2, 3, 5)), _ok()[1]), TypeError, "logits must have a floating dtype"),
        (lambda: ("not a tensor", _ok()[1]), TypeError, "logits must be a torch.Tensor"),
        (lambda: (torch.tensor(1.0), torch.tensor(0)), ValueError, "logits must have shape"),
        (lambda: (_ok()[0], _ok()[1].float()), TypeError, "labels must have an integer dtype"),
        (lambda: (_ok()[0], _ok()[1].to(torch.int16)), TypeError, "labels must have an integer dtype"),
        (lambda: (_ok()[0], torch.full((2, 3), 5)), ValueError, r"labels must lie in \[0, 5\)"),
        (lambda: (_ok()[0], torch.full((2, 3), -1)), ValueError, r"labels must lie in \[0, 5\)"),
        (lambda: (_ok()[0], _ok()[1].to("meta")), ValueError, "labels is on meta"),
    ],
    ids=["shape", "V=0", "int-logits", "not-tensor", "0-d", "float-labels", "int16-labels", "label>=V", "label<0", "devices"],
)
@pytest.mark.parametrize("backend", ["native", "triton", "reference"])
def test_bad_tensors_raise_before_any_kernel(make_args, error, match, backend):
    logits, labels = make_args()
    with fastrl.use_backend(backend), pytest.raises(error, match=match):
        fastrl.logprobs_and_entropy(logits, labels)


@pytest.mark.parametrize(
    "temperature,error,match",
    [
        (0.0, ValueError, "temperature must be between 1.18e-38 and 3.4e[+]38 in float32"),
        (-1.0, ValueError, "temperature must be between"),
        (float("nan"), ValueError, "temperature must be between"),
        (float("inf"), ValueError, "temperature must be between"),
        (1e-40, ValueError, "temperature must be between"),  # positive, but 1 / T overflows float32
        (1e300, ValueError, "temperature must be between"),  # finite in float64, inf in float32
        (True, TypeError, "temperature must be a float"),
        ("0.7", TypeError, "temperature must be a float"),
        (torch.tensor([1.0, 0.0]).view(2, 1), ValueError, "temperature must be between .* in every row"),
        (torch.tensor([[1.0, float("nan"), 1.0]] * 2), ValueError, "temperature must be between .* in every row"),
        (torch.tensor([[1.0, 1e-40, 1.0]] * 2, dtype=torch.float64), ValueError, "in every row; found 1e-40"),
        (torch.ones(3, 2), ValueError, "temperature must broadcast"),
        (torch.ones(2, 3, dtype=torch.long), TypeError, "temperature must be a float or a floating tensor"),
        (torch.ones(2, 3, device="meta"), ValueError, "temperature is on meta"),
    ],
    ids=[
        "zero", "negative", "nan", "inf", "1/T-overflows", "rounds-to-inf", "bool", "str", "tensor-zero", "tensor-nan",
        "tensor-tiny", "shape", "int-tensor", "device",
    ],
)  # fmt: skip
def test_bad_temperature(temperature, error, match):
    logits, labels = _ok()
    with pytest.raises(error, match=match):
        fastrl.logprobs_from_logits(logits, labels, temperature=temperature)
    with pytest.raises(error, match=match):
        fastrl.entropy_from_logits(logits, temperature=temperature)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_python_numbers_are_checked_as_the_kernels_hold_them(dtype):
    """held_within compares a Python number with bounds (no tensor: under torch.compile
    it may be symbolic) and a tensor exactly; both give the verdict of the value
    rounded to the compute dtype as the kernels round it, next to every bound (the
    ties there included), for the ranges the checks use."""
    finfo = torch.finfo(dtype)
    ranges = [(finfo.tiny, finfo.max), (finfo.tiny * finfo.eps, 1.0), (0.0, 1.0), (-finfo.max, finfo.max)]
    for low, high in ranges:
        points = [math.inf, -math.inf, math.nan]
        for edge in (low, high, *_validation.held_bounds(dtype, low, high)):
            points += [edge, math.nextafter(edge, -math.inf), math.nextafter(edge, math.inf)]
        for x in points:
            held = torch.tensor(x, dtype=torch.float64).to(dtype)
            expected = bool((held >= low) & (held <= high))
            assert _validation.held_within(x, dtype, low, high) is expected, (low, high, x)
            assert bool(_validation.held_within(torch.tensor(x, dtype=torch.float64), dtype, low, high)) is expected
    assert not _validation.held_within(2**63, torch.int64, 0, _validation.INT64_MAX)
    assert _validation.held_within(2**63 - 1, torch.int64, 0, _validation.INT64_MAX)


def _temperature_ops(temperature):
    """Every op that takes a temperature, each called with it on its device: (name, call)."""
    device = temperature.device
    logits, labels = (t.to(device) for t in _ok())
    logits.requires_grad_()
    hidden = torch.randn(2, 3, 4, device=device, requires_grad=True)
    weight = torch.randn(5, 4, device=device, requires_grad=True)
    # old log-probs equal to the current ones (ratio 1): no token is clipped, so the
    # loss depends on T (random old log-probs clipped every token in 1 seed of 40)
    t = temperature.detach()
    with torch.no_grad(), fastrl.use_backend("reference"):
        old_from_logits = fastrl.logprobs_from_logits(logits, labels, temperature=t)
        old_from_hidden = fastrl.linear_logprobs_and_entropy(hidden, weight, labels, temperature=t)[0]
    advantages, mask = torch.randn(2, 3, device=device), torch.ones(2, 3, dtype=torch.bool, device=device)
    return [
        ("logprobs_from_logits", lambda: fastrl.logprobs_from_logits(logits, labels, temperature=temperature)),
        ("logprobs_and_entropy", lambda: sum(fastrl.logprobs_and_entropy(logits, labels, temperature=temperature))),
        ("entropy_from_logits", lambda: fastrl.entropy_from_logits(logits, temperature=temperature)),
        ("full_kl", lambda: fastrl.full_kl(logits, logits.detach().flip(-1), temperature=temperature)),
        ("sample", lambda: fastrl.sample(logits, temperature=temperature, top_k=3, seed=1).logprobs),
        ("truncated_logprobs", lambda: fastrl.truncated_logprobs(logits, labels, temperature=temperature, top_k=3)),
        ("policy_loss_from_logits",
         lambda: fastrl.policy_loss_from_logits(logits, labels, old_from_logits, advantages, mask,
                                               temperature=temperature)[0]),
        ("linear_logprobs_and_entropy",
         lambda: sum(fastrl.linear_logprobs_and_entropy(hidden, weight, labels, temperature=temperature))),
        ("policy_loss_from_hidden",
         lambda: fastrl.policy_loss_from_hidden(hidden, weight, labels, old_from_hidden, advantages, mask,
                                               temperature=temperature)[0]),
    ]  # fmt: skip


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_temperature_that_requires_grad(device, backend):
    """A temperature tensor that requires grad: the kernels hold T constant (as the
    frameworks do) and would give it no gradient, silently, so every op that takes
    one refuses it there, naming it, unless no gradient is being recorded; the
    reference differentiates through logits / T, so there T gets its gradient."""
    temperature = (torch.rand(2, 1, device=device) + 0.5).requires_grad_()
    for name, call in _temperature_ops(temperature):
        with fastrl.use_backend(backend):
            if backend != "reference":
                with pytest.raises(TypeError, match=f"temperature must not require grad on the {backend} backend"):
                    call()
                if backend == "native":  # (the kernels run: once is enough, and cheap there)
                    with torch.no_grad():
                        call()
                continue
            (grad,) = torch.autograd.grad(call().sum(), temperature)
        assert grad is not None and bool(grad.isfinite().all()) and bool(grad.ne(0).any()), name


def test_fused_head_scale_and_cap_are_checked_in_the_compute_dtype():
    """(The fused LM head, fastrl.linear, shares these checks; tests/test_linear.py
    holds its numerics.) logit_scale and softcap are held in the compute dtype as
    the temperature is: 1e39 is finite in float64 but inf in float32, where every
    output would be NaN; a softcap must be positive and normal there."""
    hidden, weight, labels = torch.randn(2, 3, 4), torch.randn(5, 4), torch.randint(5, (2, 3))
    bad = [("logit_scale", 1e39), ("logit_scale", -1e39), ("logit_scale", math.nan), ("softcap", 1e39),
           ("softcap", 1e-40), ("softcap", 0.0), ("softcap", -2.0)]  # fmt: skip
    for name, value in bad:
        message = rf"{name} must be .* in float32, the compute dtype; got {re.escape(str(value))}"
        with pytest.raises(ValueError, match=message):
            fastrl.linear_logprobs_and_entropy(hidden, weight, labels, **{name: value})
        with pytest.raises(ValueError, match=f"{name} must be"):
            fastrl.policy_loss_from_hidden(hidden, weight, labels, -torch.rand(2, 3), torch.randn(2, 3),
                                           torch.ones(2, 3, dtype=torch.bool), **{name: value})  # fmt: skip
    for name, value in (("logit_scale", True), ("softcap", "30")):
        with pytest.raises(TypeError, match=f"{name} must be a float"):
            fastrl.linear_logprobs_and_entropy(hidden, weight, labels, **{name: value})
    # float64 hidden states compute in float64, where 1e39 is finite
    logprob, entropy = fastrl.linear_logprobs_and_entropy(hidden.double(), weight.double(), labels, softcap=1e39)
    assert bool(logprob.isfinite().all()) and bool(entropy.isfinite().all())


def test_fused_head_on_meta_tensors():
    """Meta tensors (shapes only) go through the reference, as every other op's do,
    where the fused head raised autocast's RuntimeError."""
    meta = lambda *shape, dtype=torch.float32: torch.empty(shape, dtype=dtype, device="meta")  # noqa: E731
    hidden, weight, labels = meta(2, 3, 4), meta(5, 4), meta(2, 3, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the reference fallback's warning (issued once per device type)
        logprob, entropy = fastrl.linear_logprobs_and_entropy(hidden, weight, labels)
        loss, _ = fastrl.policy_loss_from_hidden(hidden, weight, labels, meta(2, 3), meta(2, 3),
                                                 meta(2, 3, dtype=torch.bool))  # fmt: skip
        like = fastrl.logprobs_and_entropy(meta(2, 3, 5), labels)
    for out, expected in ((logprob, like[0]), (entropy, like[1]), (loss, meta())):
        assert out.device.type == "meta" and out.shape == expected.shape and out.dtype == expected.dtype


def test_bad_flags():
    logits, labels = _ok()
    with pytest.raises(TypeError, match="inplace_backward must be a bool"):
        fastrl.logprobs_from_logits(logits, labels, "yes")
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        fastrl.logprobs_from_logits(logits, labels, ignore_index=1.5)
    with pytest.raises(TypeError, match="ignore_index must be an int; got NoneType"):
        fastrl.logprobs_from_logits(logits, labels, ignore_index=None)
    with pytest.raises(ValueError, match=r"ignore_index must be an int64"):
        fastrl.logprobs_and_entropy(logits, labels, ignore_index=2**70)
    # int32 labels: torch would wrap 2**32 - 100 to -100 in a comparison, the kernels would not
    with pytest.raises(ValueError, match=r"ignore_index must fit the labels' dtype torch.int32"):
        fastrl.logprobs_from_logits(logits, labels.int(), ignore_index=2**32 - 100)


@pytest.mark.parametrize(
    "temperature,shown",
    [(0.7, "temperature=0.7"), (2, "temperature=2"), (torch.tensor([[0.7], [1.0]]), r"temperature=\.\.\.")],
    ids=["float", "int", "tensor"],
)
def test_trl_positional_temperature_names_the_keyword(temperature, shown):
    """TRL's selective_log_softmax(logits, index, temperature) takes the temperature
    third, where logprobs_from_logits has veRL's inplace_backward: the error says
    that temperature is keyword-only and how to pass it, before any kernel runs."""
    logits, labels = _ok()
    with pytest.raises(TypeError, match=rf"inplace_backward must be a bool.*temperature is keyword-only, pass {shown}"):
        fastrl.logprobs_from_logits(logits, labels, temperature)
    # TRL's fourth positional (row_mask) and the temperature after a veRL flag: Python's binding error, named
    with pytest.raises(TypeError, match=r"takes 3 positional arguments .* but 4 were given; temperature, ignore_index, "
                                        r"group, vocab_start are keyword-only: pass them by name.*temperature=\.\.\."):  # fmt: skip
        fastrl.logprobs_from_logits(logits, labels, True, 0.7)


def test_keyword_only_options_passed_positionally_name_the_keywords():
    """Every op whose options are keyword-only says which names to use when one
    is passed positionally (TRL's helpers take them positionally), instead of
    Python's bare "takes 2 positional arguments but 3 were given"."""
    logits, labels = _ok()
    per_token, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    calls = [
        (lambda: fastrl.logprobs_and_entropy(logits, labels, True, 0.7),  # TRL's (..., entropy_requires_grad, T)
         r"logprobs_and_entropy\(\) takes 2 positional arguments \(logits, labels\) but 4 were given; temperature, "
         r"inplace_backward, ignore_index, group, vocab_start, sum_pi_squared are keyword-only.*selective_log_softmax_and_entropy"),
        (lambda: fastrl.entropy_from_logits(logits, 128),  # TRL's (logits, chunk_size)
         r"temperature, group, vocab_start are keyword-only: pass them by name.*chunk size"),
        (lambda: fastrl.sample(logits, 0.7), r"sample\(\) takes 1 positional argument \(logits\) but 2 were given; "
                                             r"temperature, top_k, top_p, min_p, seed, offset, group, vocab_start are "
                                             r"keyword-only"),
        (lambda: fastrl.truncated_logprobs(logits, labels, 0.7),
         r"temperature, top_k, top_p, min_p, kept, group, vocab_start are keyword-only"),
        (lambda: fastrl.full_kl(logits, logits, 0.7), r"full_kl\(\) .* temperature, group, vocab_start are keyword-only"),
        (lambda: fastrl.agg_loss(per_token, mask, "token-mean", 2), r"dp_size, batch_num_tokens, .* keyword-only"),
        (lambda: fastrl.rollout_correction(per_token, per_token, mask, "sequence"), r"level, mode, .* keyword-only"),
        (lambda: fastrl.policy_loss_from_logits(logits, labels, per_token, per_token, mask, 0.7),
         r"temperature, inplace_backward, ignore_index, with_entropy, group, vocab_start are keyword-only"),
    ]  # fmt: skip
    for call, match in calls:
        with pytest.raises(TypeError, match=match):
            call()


@pytest.mark.parametrize("backend", [b for b in kernel_backends("cpu") if b == "native"] + ["reference"])
def test_verl_inplace_backward_default_stays_false(backend):
    """veRL's logprobs_from_logits defaults to inplace_backward=True; ours stays
    False on purpose (README, drop-in): by default the logits are never
    overwritten, and veRL's positional flag is still taken. The wrapper naming
    keyword-only options keeps the op's own signature for inspect / help."""
    params = inspect.signature(fastrl.logprobs_from_logits).parameters
    assert list(params)[:3] == ["logits", "labels", "inplace_backward"]
    assert params["inplace_backward"].default is False
    assert params["temperature"].kind is inspect.Parameter.KEYWORD_ONLY
    logits, labels = _ok()
    with fastrl.use_backend(backend):
        h = logits.clone().requires_grad_(True) * 1.0  # a non-leaf activation, which in-place could overwrite
        fastrl.logprobs_from_logits(h, labels).sum().backward()
        assert torch.equal(h.detach(), logits), "the default backward must leave the logits as they were"
        h = logits.clone().requires_grad_(True) * 1.0
        fastrl.logprobs_from_logits(h, labels, True).sum().backward()  # veRL's positional flag
    # The kernel honours it (the logits' storage now holds the gradient); the reference ignores it.
    assert torch.equal(h.detach(), logits) == (backend == "reference")


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_extreme_temperatures_within_the_compute_dtype(device, backend):
    """The accepted extremes (finfo.tiny and finfo.max of the compute dtype) give
    what float64 gives, on every backend; float64 logits accept float64's range."""
    logits = torch.randn(3, 40, device=device)
    labels = torch.tensor([0, 1, 2], device=device)
    for temperature in (torch.finfo(torch.float32).tiny, 1e-30, 1e30, torch.finfo(torch.float32).max):
        ref_lp, ref_ent = reference.logprobs_and_entropy(logits.double(), labels, temperature=temperature)
        with fastrl.use_backend(backend):
            lp, ent = fastrl.logprobs_and_entropy(logits, labels, temperature=temperature)
        # log-probs of tokens below the max are -inf at tiny T (beyond float32), finite at huge T
        assert_close_to_reference(lp, ref_lp.float().double(), 1e-5, what=f"logprob at T={temperature}")
        assert_close_to_reference(ent, ref_ent, 1e-5, what=f"entropy at T={temperature}")
    with fastrl.use_backend(backend):
        lp = fastrl.logprobs_from_logits(logits.double(), labels, temperature=1e-300)
    assert torch.isfinite(lp[lp != float("-inf")]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_out_of_range_labels_nan_without_checks_error_with(monkeypatch):
    logits = torch.randn(3, 100, device="cuda")
    labels = torch.tensor([1, 100, -100], device="cuda")
    lp = fastrl.logprobs_from_logits(logits, labels)
    assert torch.isfinite(lp[0]) and lp[1].isnan() and lp[2] == 0
    monkeypatch.setenv("FASTRL_CHECKS", "1")
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 100\)"):
        fastrl.logprobs_from_logits(logits, labels)


def test_cpu_default_backend_is_native_when_built():
    assert kernel_backends("cpu")[0] == "native", "the native extension must be built for the tests"
    from fastrl._backend import select_backend

    assert select_backend(torch.device("cpu")) == "native"
