"""linear_logprobs_and_entropy (the fused LM head) against the float64 reference
``reference.linear_logprobs_and_entropy``, on every backend available."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close_to_reference, backend_params

import fastrl
from fastrl import _ops, linear, reference
from fastrl.linear import linear_logprobs_and_entropy

BACKENDS = backend_params()
KERNEL_BACKENDS = backend_params(include_reference=False)

# Unit roundoff of the float32 arithmetic, and the rounding of a gradient returned
# in each dtype (half an ulp at 1.0, times two).
U32 = 2.0**-24
# torch's float32 tanh (the cap) is within 2 ulp (CUDA's tanhf, glibc's; ATen's CPU
# kernel calls Sleef's 1-ulp tanhf), and an ulp of t is at most 2 u |t|.
TANH_ULPS = 2
TANH_U = 2 * TANH_ULPS
OUT_RTOL = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float64: 1e-14}


def _inputs(lead, hidden_size, vocab, dtype, device, bias=True):
    """Hidden states and an LM head of realistic scale: logits of std ~3, one
    token with a peaked row (a dominant logit), 10% ignored labels."""
    hidden = torch.randn(*lead, hidden_size, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, dtype=torch.float64) * (3.0 / hidden_size**0.5)
    flat = hidden.view(-1, hidden_size)
    if flat.shape[0]:
        flat[0] = weight[vocab // 2] * (10.0 * hidden_size**0.5 / weight[vocab // 2].norm())
    b = torch.randn(vocab, dtype=torch.float64) if bias else None
    labels = torch.randint(vocab, lead)
    labels[torch.rand(lead) < 0.1] = -100
    cast = lambda t: None if t is None else t.to(dtype).to(device)  # noqa: E731
    return cast(hidden), cast(weight), cast(b), labels.to(device)


def _reference(hidden, weight, bias, labels, temperature, logit_scale, softcap, g_lp, g_ent):
    """Float64 outputs, gradients, and what the error bounds need: dL/dx at the
    pre-cap logits x, the probabilities, |h| @ |w|.T + |b|, and with a cap its
    tanh and dL/dlogits at the capped logits."""
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b = None if bias is None else bias.detach().double().requires_grad_()
    t = temperature.double() if isinstance(temperature, torch.Tensor) else temperature
    x = h @ w.T + (0 if b is None else b)
    x.retain_grad()
    logits = x * logit_scale
    cap_tanh = None
    if softcap is not None:
        cap_tanh = torch.tanh(logits / softcap)
        logits = softcap * cap_tanh
        logits.retain_grad()
    lp, ent = reference.logprobs_and_entropy(logits, labels, temperature=t)
    ((lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    with torch.no_grad():
        temps = t if isinstance(t, torch.Tensor) else torch.full(lp.shape, t, dtype=torch.float64)
        p = torch.softmax(logits / temps.unsqueeze(-1), dim=-1)
        magnitude = h.abs() @ w.abs().T + (0 if b is None else b.abs())
    # With a cap, "cap" holds what its terms of the bounds need: its size, tanh(x s / c) and dL/dlogits.
    cap = None if softcap is None else {"c": softcap, "tanh": cap_tanh.detach(), "gz": logits.grad}
    return {"lp": lp.detach(), "ent": ent.detach(), "h": h.grad, "w": w.grad, "b": None if b is None else b.grad,
            "gx": x.grad, "p": p, "temps": temps, "magnitude": magnitude, "cap": cap}  # fmt: skip


def _bounds(ref, hidden, weight, logit_scale, g_lp, g_ent, operand_u):
    """Error bounds of the fused op (float32 arithmetic) against the float64 truth,
    to first order in u; mag = |h| @ |w|.T + |b|, s = logit_scale, c = softcap.

    Logits: a float32 GEMM of H terms, the bias and the scale:
        |dz| <= (H + 4) u mag s
    With a cap, z = c t, t = tanh(q), q = x s / c: the GEMM, the bias, the scale and
    the division by c leave |dq| <= (H + 3) u mag s / c; tanh is 1-Lipschitz and is
    returned within TANH_ULPS ulp <= TANH_U u |t|, and c t rounds once more, so
        |dz| <= (H + 3 + TANH_U + 1) u mag s                      (|z| <= |x s| <= mag s)
    log-prob and entropy move at most 2 max|dz| / T and 2 (1 + H_ent + max|log p|) max|dz| / T,
    plus the log-prob kernel's own 1e-5 (DESIGN.md).
    G = dL/dx = G_z slope, G_z = dL/dz, slope = dz/dx = s (1 - t^2) (= s without a cap):
    p moves by at most p 2 max|dz| / T, so
        |dG| <= 2 max|dz| / T p (|g_lp| + |g_ent| (|log p| + H_ent + 2)) s / T + 8 u |G|
    and with a cap the slope's own error. The op computes it from its rounded tanh
    t' = t + dt, |dt| <= (1 - t^2) |dq| + TANH_U u |t|, as fl(fl(1 - fl(t'^2)) s):
        |slope' - slope| <= s (2 |t| |dt| + u t^2 + 2 u (1 - t^2))
                         <= (2 TANH_U + 1) u s t^2  +  (2 |t| |dq| + 2 u) slope
    The first term is absolute, not relative to the slope: where the cap saturates
    (|t| -> 1, the peaked row's logits) 1 - t'^2 cancels, as in torch's own tanh
    backward (1 - y^2), and G = fl(G_z' slope') is off by (2 TANH_U + 1) u s |G_z|
    however small the slope. So the cap adds to |dG|, with |dq| <= |dz| / c and the
    product's rounding,
        (2 TANH_U + 1) u s t^2 |G_z|  +  (2 |t| |dz| / c + 3 u) |G|
    Each gradient GEMM adds its length times u (operand_u for G rounded to the
    operand dtype) of the sum of |terms|."""
    hidden_size = hidden.shape[-1]
    cap = ref["cap"]
    dz = (hidden_size + 4 + (0 if cap is None else TANH_U)) * U32 * ref["magnitude"] * logit_scale
    dz_row = dz.amax(dim=-1) / ref["temps"]
    log_p = torch.where(ref["p"] > 0, ref["p"].log(), 0.0)
    lp_tol = 2 * dz_row + 1e-5 * (1 + ref["lp"].abs())
    ent_tol = 2 * dz_row * (1 + ref["ent"] + log_p.abs().amax(dim=-1)) + 1e-5 * (1 + ref["ent"])
    weight_g = g_lp.double().abs().unsqueeze(-1) + g_ent.double().abs().unsqueeze(-1) * (
        log_p.abs() + ref["ent"].unsqueeze(-1) + 2
    )
    dg = (2 * dz_row / ref["temps"]).unsqueeze(-1) * ref["p"] * weight_g * logit_scale + 8 * U32 * ref["gx"].abs()
    if cap is not None:
        t = cap["tanh"].abs()
        dg = dg + (2 * TANH_U + 1) * U32 * logit_scale * t**2 * cap["gz"].abs()
        dg = dg + (2 * t * dz / cap["c"] + 3 * U32) * ref["gx"].abs()
    gx = ref["gx"].abs()
    n_tokens, vocab = gx.reshape(-1, gx.shape[-1]).shape
    h_abs = hidden.double().abs().reshape(n_tokens, hidden_size)
    dg, gx = dg.reshape(n_tokens, vocab), gx.reshape(n_tokens, vocab)
    w_abs = weight.double().abs()
    grad_h = dg @ w_abs + (vocab * U32 + operand_u) * (gx @ w_abs)
    grad_w = dg.T @ h_abs + (n_tokens * U32 + operand_u) * (gx.T @ h_abs)
    grad_b = dg.sum(0) + n_tokens * U32 * gx.sum(0)
    return lp_tol, ent_tol, grad_h.reshape(hidden.shape), grad_w, grad_b


def _check(actual, expected, tol, rtol, what):
    """|a - e| <= tol + rtol |e| elementwise (tol a tensor of per-element bounds)."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{what}: not finite"
    err, bound = (a - e).abs(), tol.cpu() + rtol * e.abs() + 1e-300
    worst = int((err - bound).flatten().argmax())
    assert bool((err <= bound).all()), (
        f"{what}: error {err.flatten()[worst]:.3g} at {e.flatten()[worst]:.5g} exceeds its bound {bound.flatten()[worst]:.3g}"
    )


@pytest.mark.parametrize("chunk_size", [7, None], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize("softcap", [None, 20.0], ids=["nocap", "softcap"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_values_and_gradients_match_float64_reference(device, backend, dtype, softcap, chunk_size, monkeypatch):
    """A [3, 6] batch in three chunks of 7 tokens (the last one short; the backward
    forms the logits again), or in one (the backward reads the forward's), per-row
    temperatures, a bias, a logit scale: outputs and the three gradients. The
    backward's vocabulary slabs are 256 wide (the last one short), so labels land
    in every slab."""
    monkeypatch.setattr(linear, "_BACKWARD_COLS", 256)
    lead, hidden_size, vocab = (3, 6), 48, 1031
    hidden, weight, bias, labels = _inputs(lead, hidden_size, vocab, dtype, device)
    temperature = (torch.rand(lead, dtype=torch.float64) * 1.5 + 0.4).to(device)
    logit_scale = 1.25
    g_lp, g_ent = torch.randn(lead, device=device), torch.randn(lead, device=device)
    ref = _reference(hidden, weight, bias, labels, temperature, logit_scale, softcap, g_lp, g_ent)

    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    with fastrl.use_backend(backend):
        lp, ent = linear_logprobs_and_entropy(*leaves[:2], labels, bias=leaves[2], temperature=temperature,
                                              logit_scale=logit_scale, softcap=softcap, chunk_size=chunk_size)  # fmt: skip
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == lead
    # G rounded to bf16 / fp16 where the gradient GEMMs take the head's dtype (CUDA; bf16 on an AVX512-BF16 CPU).
    operand_u = 2.0**-8 if linear._operand_dtype(weight, torch.float32) != torch.float32 else 0.0
    lp_tol, ent_tol, h_tol, w_tol, b_tol = _bounds(ref, hidden, weight, logit_scale, g_lp, g_ent, operand_u)
    _check(lp, ref["lp"], lp_tol, 0.0, "logprob")
    _check(ent, ref["ent"], ent_tol, 0.0, "entropy")
    # Returned in the inputs' dtype: rounded relative to each element, or in fp16's
    # subnormal range by half its spacing (the smallest subnormal bounds that).
    rtol, subnormal = OUT_RTOL[dtype], torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    for leaf, tol, name in zip(leaves, (h_tol, w_tol, b_tol), ("h", "w", "b")):
        assert leaf.grad.dtype == dtype and leaf.grad.shape == leaf.shape
        _check(leaf.grad, ref[name], tol + subnormal, rtol, f"grad {name}")


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_gradcheck_float64(device, backend, monkeypatch):
    """Finite differences in float64 through every input: the cap, the scale,
    per-row temperatures, an ignored label, chunks of 2 tokens, vocabulary slabs of 4."""
    monkeypatch.setattr(linear, "_BACKWARD_COLS", 4)
    hidden, weight, bias, labels = _inputs((5,), 4, 9, torch.float64, device)
    labels[1] = -100
    temperature = (torch.rand(5, dtype=torch.float64) + 0.5).to(device)

    def f(h, w, b):
        lp, ent = linear_logprobs_and_entropy(h, w, labels, bias=b, temperature=temperature, logit_scale=0.8,
                                              softcap=5.0, chunk_size=2)  # fmt: skip
        return lp, ent

    leaves = tuple(t.clone().requires_grad_() for t in (hidden, weight, bias))
    with fastrl.use_backend(backend):
        assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_chunks_hold_the_memory_bound_and_cover_every_token(device, backend, monkeypatch):
    """No launch sees more rows than a chunk; chunk_bytes picks the chunk; the
    outputs do not depend on it (each token's logits are its own GEMM row)."""
    hidden, weight, _, labels = _inputs((23,), 16, 300, torch.float32, device, bias=False)
    seen = []
    forward = _ops.logprobs_forward

    def spy(logits, *args):
        seen.append(logits.shape[0] * logits.shape[1])
        return forward(logits, *args)

    monkeypatch.setattr(_ops, "logprobs_forward", spy)
    with fastrl.use_backend(backend):
        whole = linear_logprobs_and_entropy(hidden, weight, labels)
        assert seen == [23]
        seen.clear()
        by_bytes = linear_logprobs_and_entropy(hidden, weight, labels, chunk_bytes=300 * 4 * 5)
        assert seen == [5, 5, 5, 5, 3]
        seen.clear()
        by_size = linear_logprobs_and_entropy(hidden, weight, labels, chunk_size=4, with_entropy=False)
        assert seen == [4] * 5 + [3] and by_size[1] is None
    for a, b in zip(whole, by_bytes):
        assert_close_to_reference(a, b.double(), 1e-6)
    assert_close_to_reference(by_size[0], whole[0].double(), 1e-6)

    # The backward: blocks of tokens x vocabulary slabs within the same budget, covering every logit once.
    blocks = []
    backward = _ops.logprobs_backward

    def spy_backward(logits, *args):
        blocks.append((logits.shape[1], logits.shape[2]))
        return backward(logits, *args)

    monkeypatch.setattr(_ops, "logprobs_backward", spy_backward)
    monkeypatch.setattr(linear, "_BACKWARD_COLS", 128)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with fastrl.use_backend(backend):
        logp, _ = linear_logprobs_and_entropy(h, w, labels, chunk_bytes=300 * 4 * 5)
        logp.sum().backward()
    assert max(rows * cols * 4 for rows, cols in blocks) <= 300 * 4 * 5
    assert sum(rows * cols for rows, cols in blocks) == 23 * 300 and {cols for _, cols in blocks} == {128, 44}


@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_a_second_backward_gives_the_same_gradients(device, backend):
    """retain_graph: the backward never writes over what it saved (one chunk keeps
    the forward's logits, several form them again)."""
    hidden, weight, bias, labels = _inputs((9,), 8, 40, torch.float32, device)
    for chunk_size in (None, 4):
        h = hidden.clone().requires_grad_()
        with fastrl.use_backend(backend):
            lp, ent = linear_logprobs_and_entropy(h, weight, labels, bias=bias, softcap=3.0, chunk_size=chunk_size)
            total = lp.sum() + ent.sum()
            first = torch.autograd.grad(total, h, retain_graph=True)[0]
            second = torch.autograd.grad(total, h)[0]
        assert torch.equal(first, second), chunk_size


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_only_the_inputs_that_need_it_get_a_gradient(device, backend):
    hidden, weight, bias, labels = _inputs((6,), 8, 50, torch.float32, device)
    h = hidden.clone().requires_grad_()
    with fastrl.use_backend(backend):
        lp, ent = linear_logprobs_and_entropy(h, weight, labels, bias=bias)
        lp.sum().backward()
        ref_lp, _ = reference.linear_logprobs_and_entropy(h.detach().double(), weight.double(), labels,
                                                          bias=bias.double())  # fmt: skip
        assert_close_to_reference(lp, ref_lp, 1e-4)
        with torch.no_grad():
            lp2, _ = linear_logprobs_and_entropy(h, weight, labels, bias=bias)
    assert h.grad is not None and not lp2.requires_grad
    assert torch.equal(lp.detach(), lp2)


@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_autocast_runs_the_head_in_the_autocast_dtype(device, backend):
    """An fp32 weight under bf16 autocast: computed from the bf16 casts (as
    F.linear would), the weight's gradient back in float32."""
    hidden, weight, _, labels = _inputs((4, 3), 16, 200, torch.float32, device, bias=False)
    w = weight.clone().requires_grad_()
    with fastrl.use_backend(backend), torch.autocast(device, dtype=torch.bfloat16):
        lp, _ = linear_logprobs_and_entropy(hidden, w, labels)
    lp.sum().backward()
    ref_lp, _ = reference.linear_logprobs_and_entropy(hidden.bfloat16().double(), weight.bfloat16().double(), labels)
    assert_close_to_reference(lp, ref_lp, 1e-4)
    assert w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()


@pytest.mark.skipif(not fastrl._native.gemm_bf16_supported(), reason="no AVX512-BF16 on this CPU")
@pytest.mark.parametrize("layout", ["rows", "transposed"])
def test_native_bf16_gemm_matches_float64(layout):
    """csrc/gemm.h on shapes that leave every block short: M over two thread
    blocks of 96 rows and not a multiple of the 12-row micro-tile, N not a multiple
    of the 32-column panel, K odd over three 256-element k blocks; operands and
    output in row-major and transposed layouts (C with strided columns goes
    through the scratch block); overwrite and accumulate; a float32 operand
    rounded to bf16 to nearest even as it is packed (bitwise the same as rounding
    it first). Bound: K float32 additions of exact products (and one for the
    accumulate), |err| <= (K + 1) u (|A| @ |B|) + u |C|."""
    m, n, k = 203, 45, 517
    a = torch.randn(m, k).bfloat16() if layout == "rows" else torch.randn(k, m).bfloat16().T
    b = torch.randn(k, n).bfloat16() if layout == "rows" else torch.randn(n, k).bfloat16().T
    expected = a.double() @ b.double()
    bound = (k + 1) * U32 * (a.double().abs() @ b.double().abs())
    out = torch.empty(m, n) if layout == "rows" else torch.empty(n, m).T
    fastrl._native.gemm_bf16(a, b, out, False)
    _check(out, expected, bound, 0.0, "C = A B")
    start = torch.randn(m, n)
    out.copy_(start)
    fastrl._native.gemm_bf16(a, b, out, True)
    _check(out, start.double() + expected, bound, U32, "C += A B")
    a32 = torch.randn(a.shape) * 3.0
    a32[0, :5] = torch.tensor([float("nan"), float("inf"), 3.4e38, -0.0, 1e-30])  # NaN, inf, a bf16 overflow
    from_float, from_rounded = torch.empty(m, n), torch.empty(m, n)
    fastrl._native.gemm_bf16(a32, b, from_float, False)
    fastrl._native.gemm_bf16(a32.bfloat16(), b, from_rounded, False)
    assert torch.equal(from_float[1:], from_rounded[1:]) and bool(from_float[0].isnan().all())
    # K = 0 writes zeros (accumulate leaves C), K = 1 is one product.
    out = torch.full((3, 5), 7.0)
    fastrl._native.gemm_bf16(a[:3, :0], b[:0, :5], out, True)
    assert bool((out == 7.0).all())
    fastrl._native.gemm_bf16(a[:3, :0], b[:0, :5], out, False)
    assert bool((out == 0.0).all())
    fastrl._native.gemm_bf16(a[:3, :1], b[:1, :5], out, False)
    assert torch.equal(out, (a[:3, :1].float() @ b[:1, :5].float()))


@pytest.mark.skipif(not fastrl._native.gemm_bf16_supported(), reason="no AVX512-BF16 on this CPU")
def test_native_bf16_gemm_sums_in_one_order_and_checks_its_arguments():
    """The output's layout picks the path (straight to C, or through a scratch
    block), not the order of the sums: bitwise equal results, accumulating too.
    A negative view is read with its sign; misuse raises instead of reading out
    of bounds."""
    a, b = torch.randn(40, 600).bfloat16(), torch.randn(600, 50).bfloat16()
    start = torch.randn(40, 50) * 100
    for accumulate in (False, True):
        rows, transposed = start.clone(), start.T.contiguous().T
        fastrl._native.gemm_bf16(a, b, rows, accumulate)
        fastrl._native.gemm_bf16(a, b, transposed, accumulate)
        assert torch.equal(rows, transposed)
    negated = torch.empty(40, 50)
    fastrl._native.gemm_bf16(a._neg_view(), b, negated, False)
    assert torch.equal(negated, _native_product(-a, b))
    out = torch.empty(40, 50)
    with pytest.raises(ValueError, match="shapes"):
        fastrl._native.gemm_bf16(a, b[:300], out, False)
    with pytest.raises(ValueError, match="shapes"):
        fastrl._native.gemm_bf16(a, b, out[:4], False)
    with pytest.raises(TypeError, match="out must be a float32"):
        fastrl._native.gemm_bf16(a, b, out.bfloat16(), False)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        fastrl._native.gemm_bf16(a.half(), b, out, False)
    with pytest.raises(ValueError, match="2-D CPU"):
        fastrl._native.gemm_bf16(a[None], b, out, False)


def _native_product(a, b):
    out = torch.empty(a.shape[0], b.shape[1])
    fastrl._native.gemm_bf16(a, b, out, False)
    return out


def test_edge_inputs():
    """Empty batches, one token, NaN hidden states (NaN rows, the others exact)."""
    hidden, weight, bias, labels = _inputs((0, 3), 8, 11, torch.float32, "cpu")
    lp, ent = linear_logprobs_and_entropy(hidden, weight, labels, bias=bias)
    assert lp.shape == ent.shape == (0, 3)
    hidden, weight, bias, labels = _inputs((4,), 8, 11, torch.float32, "cpu")
    hidden[2, 0] = float("nan")
    labels[2] = 3
    lp, ent = linear_logprobs_and_entropy(hidden, weight, labels, bias=bias)
    assert lp[2].isnan() and ent[2].isnan() and torch.isfinite(lp[[0, 1, 3]]).all()


def test_bad_arguments_raise_naming_them():
    hidden, weight, bias, labels = _inputs((4,), 8, 11, torch.float32, "cpu")
    cases = [
        (dict(hidden=hidden.long()), TypeError, "hidden"),
        (dict(weight=weight[:, :5]), ValueError, "weight"),
        (dict(weight=weight[0]), ValueError, "weight"),
        (dict(weight=weight[:0], bias=None), ValueError, "weight"),
        (dict(hidden=hidden[:, :0], weight=weight[:, :0]), ValueError, "hidden"),
        (dict(weight=weight.double()), TypeError, "weight"),
        (dict(bias=bias[:5]), ValueError, "bias"),
        (dict(labels=labels[:3]), ValueError, "labels"),
        (dict(labels=labels.float()), TypeError, "labels"),
        (dict(labels=labels + 11), ValueError, "labels"),
        (dict(softcap=0.0), ValueError, "softcap"),
        (dict(softcap=float("inf")), ValueError, "softcap"),
        (dict(logit_scale=float("nan")), ValueError, "logit_scale"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(chunk_bytes=0), ValueError, "chunk_bytes"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(with_entropy=1), TypeError, "with_entropy"),
    ]
    for change, error, name in cases:
        args = dict(hidden=hidden, weight=weight, labels=labels, bias=bias) | change
        with pytest.raises(error, match=name):
            linear_logprobs_and_entropy(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)
    with pytest.raises(TypeError, match="keyword"):
        linear_logprobs_and_entropy(hidden, weight, labels, bias)


def _policy_inputs(device, dtype):
    """[2, 9] tokens of hidden states, the head, and the per-token policy inputs
    (old log-probs near the current ones, so that the clip binds on some tokens)."""
    hidden, weight, bias, labels = _inputs((2, 9), 12, 70, dtype, device)
    with torch.no_grad():
        current, _ = reference.linear_logprobs_and_entropy(hidden.double(), weight.double(), labels, bias=bias.double())
    old = (current + 0.3 * torch.randn(2, 9, dtype=torch.float64, device=device)).float()
    advantages = torch.randn(2, 9, device=device)
    mask = torch.rand(2, 9, device=device) > 0.2
    return hidden, weight, bias, labels, old, advantages, mask


@pytest.mark.parametrize("options", [
    dict(),
    dict(loss_agg_mode="seq-mean-token-sum", clip_ratio_c=3.0, entropy_coef=0.01),
    dict(ratio_level="sequence", loss_agg_mode="seq-mean-token-mean"),
], ids=["ppo", "dual-clip-entropy", "gspo"])  # fmt: skip
@pytest.mark.parametrize("device,backend", BACKENDS)
def test_policy_loss_from_hidden_matches_reference_in_float64(device, backend, options):
    """The loss, its metrics and the three gradients of policy_loss_from_hidden
    against reference.policy_loss_from_hidden, float64 throughout (the kernels
    compute float64 in float64): the composition is exact up to float64 rounding."""
    hidden, weight, bias, labels, old, advantages, mask = _policy_inputs(device, torch.float64)
    labels[0, 2] = -100
    common = dict(bias=None, temperature=0.9, softcap=4.0, **options)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    truth = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    with fastrl.use_backend(backend):
        loss, metrics = fastrl.policy_loss_from_hidden(*leaves[:2], labels, old.double(), advantages.double(), mask,
                                                       **common | {"bias": leaves[2]}, chunk_size=4)  # fmt: skip
        loss.backward()
    ref_loss, ref_metrics = reference.policy_loss_from_hidden(*truth[:2], labels, old.double(), advantages.double(),
                                                              mask, **common | {"bias": truth[2]})  # fmt: skip
    ref_loss.backward()
    assert_close_to_reference(loss, ref_loss.detach(), 1e-10)
    for name, value in ref_metrics.items():
        assert_close_to_reference(metrics[name], value.detach(), 1e-10, what=name)
    for leaf, ref in zip(leaves, truth):
        assert_close_to_reference(leaf.grad, ref.grad, 1e-9, what="grad")


@pytest.mark.parametrize("options", [
    dict(loss_agg_mode="seq-mean-token-mean", kl_coef=0.1, kl_estimator="k3", entropy_coef=-0.02),
    dict(loss_agg_mode="token-mean", dp_size=2, batch_num_tokens=40, clip_ratio_low=0.1, clip_ratio_high=0.28),
    dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=7.0, with_entropy=True),
], ids=["kl-entropy", "dp", "sum-norm"])  # fmt: skip
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_policy_loss_gradients_formed_in_the_forward(device, backend, options, monkeypatch):
    """Token-level losses form their gradients in the forward, chunk by chunk
    (the log-probs' own backward, which forms the logits again, never runs):
    float64 against the reference with several chunks, per-token temperatures,
    a logit scale and rollout weights; an upstream gradient of 2.5 scales them;
    a second backward (retain_graph) gives them again. Float64 throughout, so
    the bounds are those of test_policy_loss_from_hidden_matches_reference_in_float64."""
    hidden, weight, bias, labels, old, advantages, mask = _policy_inputs(device, torch.float64)
    extra = dict(rollout_is_weights=torch.rand(2, 9, dtype=torch.float64, device=device) + 0.5,
                 ref_log_probs=old.double() - 0.1) if "kl_coef" in options else {}  # fmt: skip
    common = dict(temperature=torch.rand(2, 9, dtype=torch.float64, device=device) + 0.5, logit_scale=0.7,
                  **options, **extra)  # fmt: skip
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    truth = [t.clone().requires_grad_() for t in (hidden, weight, bias)]

    def refuse(*args):
        raise AssertionError("the per-token outputs' backward ran: gradients were not formed in the forward")

    monkeypatch.setattr(linear._LinearLogprobs, "apply", refuse)
    with fastrl.use_backend(backend):
        loss, metrics = fastrl.policy_loss_from_hidden(*leaves[:2], labels, old.double(), advantages.double(), mask,
                                                       bias=leaves[2], chunk_size=4, **common)  # fmt: skip
    ref_loss, ref_metrics = reference.policy_loss_from_hidden(*truth[:2], labels, old.double(), advantages.double(),
                                                              mask, bias=truth[2], **common)  # fmt: skip
    (loss * 2.5).backward(retain_graph=True)
    (ref_loss * 2.5).backward()
    assert_close_to_reference(loss, ref_loss.detach(), 1e-10)
    for name, value in ref_metrics.items():
        assert_close_to_reference(metrics[name], value.detach(), 1e-10, what=name)
    first = [leaf.grad.clone() for leaf in leaves]
    for leaf, ref in zip(leaves, truth):
        assert_close_to_reference(leaf.grad, ref.grad, 1e-9, what="grad")
        leaf.grad = None
    (loss * 2.5).backward()
    for leaf, grad in zip(leaves, first):
        assert torch.equal(leaf.grad, grad)


def test_policy_loss_gradients_formed_in_the_forward_match_the_composition_in_bf16(monkeypatch):
    """bf16 head, several chunks: the gradients formed in the forward (weight's
    summed in float32 over the chunks, rounded once) against the composition's
    backward (summed in float32 over token blocks, rounded once): the same
    float32 sums in another order, so within one bf16 rounding of each other
    (2^-8 relative, and 2^-8 of the largest entry for entries near zero). On a
    CPU without the native bf16 GEMM a bf16 head takes the composition (it is
    widened a slab at a time); one slab of all rows lets the test reach the
    gradients-in-forward path there too."""
    monkeypatch.setattr(linear, "_slab_rows", lambda weight, acc: weight.shape[0])
    hidden, weight, bias, labels, old, advantages, mask = _policy_inputs("cpu", torch.bfloat16)
    results = []
    for ratio_level in ("token", "sequence"):  # the sequence level takes the composition
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        # GSPO with one token a sequence is the token-level loss: L = 1 here.
        loss, _ = fastrl.policy_loss_from_hidden(
            leaves[0][:, :1].reshape(2, 1, -1), leaves[1], labels[:, :1], old[:, :1], advantages[:, :1],
            mask[:, :1] | True, bias=leaves[2], ratio_level=ratio_level, loss_agg_mode="seq-mean-token-mean",
            chunk_size=1, entropy_coef=0.05,
        )  # fmt: skip
        loss.backward()
        results.append((loss.detach(), [leaf.grad.float() for leaf in leaves]))
    (loss_token, grads_token), (loss_seq, grads_seq) = results
    torch.testing.assert_close(loss_token, loss_seq, rtol=1e-6, atol=1e-7)
    for a, b in zip(grads_token, grads_seq):
        torch.testing.assert_close(a, b, rtol=2.0**-8, atol=2.0**-8 * float(b.abs().max()))


def test_policy_loss_from_hidden_float32_and_misuse():
    """float32: within 1e-4 of the float64 loss (its log-probs are within the
    bounds of test_values_and_gradients_match_float64_reference, ~1e-5 here,
    and the loss is a weighted mean of exp(logp - old) A); the entropy argument
    and swapped old log-probs are refused, naming the fix."""
    hidden, weight, bias, labels, old, advantages, mask = _policy_inputs("cpu", torch.float32)
    loss, _ = fastrl.policy_loss_from_hidden(hidden, weight, labels, old, advantages, mask, bias=bias)
    ref, _ = reference.policy_loss_from_hidden(hidden.double(), weight.double(), labels, old.double(),
                                               advantages.double(), mask, bias=bias.double())  # fmt: skip
    assert_close_to_reference(loss, ref, 1e-4)
    with pytest.raises(TypeError, match="with_entropy"):
        fastrl.policy_loss_from_hidden(hidden, weight, labels, old, advantages, mask, entropy=old)
    with pytest.raises(ValueError, match="hidden states and LM head"):
        fastrl.policy_loss_from_hidden(hidden, weight, labels, old.requires_grad_(), advantages, mask)


def _sharded_head_worker(rank: int, world_size: int, init_file: str, seed: int) -> None:
    """One rank of test_fsdp2_sharded_head_is_gathered (module level: spawn imports it)."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(seed)  # every rank draws the same full tensors
        hidden, weight, bias, labels = _inputs((7,), 16, 37, torch.float32, "cpu")  # 37 rows: uneven shards
        g_lp, g_ent = torch.randn(7), torch.randn(7)

        def run(h, w, b):
            lp, ent = linear_logprobs_and_entropy(h, w, labels, bias=b, temperature=0.8)
            ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
            return lp, ent

        full = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        sharded = [distribute_tensor(t.clone(), mesh, [Shard(0)]).requires_grad_() for t in (hidden, weight, bias)]
        lp, ent = run(*full)
        lp_s, ent_s = run(*sharded)
        # The gathered tensors are the full ones bit for bit, so is everything computed from them.
        assert type(lp_s) is torch.Tensor and torch.equal(lp_s, lp) and torch.equal(ent_s, ent)
        for name, f, s in zip(("hidden", "weight", "bias"), full, sharded, strict=True):
            local = s.grad.to_local()
            start = 0 if rank == 0 else f.shape[0] - local.shape[0]  # rank 0 holds the first, larger half
            assert torch.equal(local, f.grad[start : start + local.shape[0]]), name
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_fsdp2_sharded_head_is_gathered(tmp_path):
    """FSDP2 leaves lm_head.weight a DTensor sharded over its rows outside the
    module's forward: two gloo ranks with the hidden states, weight and bias
    sharded (unevenly) get the unsharded op's outputs bitwise, and each shard
    the slice of the gradient it holds."""
    import torch.multiprocessing as mp

    seed = int(torch.randint(2**31, ()))
    mp.spawn(_sharded_head_worker, args=(2, str(tmp_path / "store"), seed), nprocs=2)
