"""veRL 0.9.1's FSDP engine patched (fastrl.integrations.verl, op ``engine``):
``FSDPEngineWithLMHead.prepare_model_outputs`` run on micro-batches built as veRL
builds them (nested jagged ``input_ids``, per-sample or scalar temperatures,
packed with remove-padding or padded without it, veRL's own
``prepare_model_inputs`` making the model inputs and ``output_args``), patched
against veRL unpatched: the same outputs in the same layout and dtypes, the same
gradients, within the rounding bounds stated at each comparison; no ``[N, V]``
tensor made by any operator but fastrl's during the call, and the gradient
written into the logits' own storage; the options fastrl does not reproduce
falling back, counted and announced; a vocabulary-sharded DTensor (FSDP2 with
tensor parallelism) handed to fastrl's sharded path instead of gathered.

The engine is built without a model (``object.__new__``): the two methods read
only the attributes set in ``_engine``. The model is a bare LM head,
``logits = hidden @ weight.T``, so that the logits are a non-leaf tensor whose
producer does not save them, as a transformer's are.
"""

from __future__ import annotations

import contextlib
import math
import re
from types import SimpleNamespace

import pytest
import torch

from fastrl import integrations, reference

pytest.importorskip("verl")
pytest.importorskip("peft", reason="peft is not installed (veRL's FSDP engine imports it; make setup installs it)")

from verl.utils import tensordict_utils as tu  # noqa: E402

import fastrl.integrations.verl as verl_integration  # noqa: E402
from bench import verl_engine as engine_bench  # noqa: E402

VOCAB, HIDDEN = 301, 16  # an odd vocabulary: two shards of 151 and 150 columns


@pytest.fixture(autouse=True)
def _unpatched():
    integrations.reset_fallbacks()
    verl_integration.unpatch()
    yield
    verl_integration.unpatch()


def _micro_batch(lengths, temperature, **options):
    """bench.verl_engine.micro_batch over this file's vocabulary."""
    return engine_bench.micro_batch(lengths, VOCAB, temperature, **options)


def _step(batch, head, watch=None, mesh=None, padding_logit=None, **engine_options):
    """veRL's forward step on a bare LM head: prepare_model_inputs, the logits,
    prepare_model_outputs (under ``watch``, a context, if given), and the
    backward of a weighted sum of every output. With a device ``mesh``, the head
    is tensor-parallel as FSDP2's is: its weight sharded on the vocabulary, so the
    logits are a DTensor sharded on their last dimension (returned whole). With
    ``padding_logit`` (the padded layout), the head adds it to every logit of the
    padding positions, as a model that masks them does."""
    built = engine_bench.engine(**engine_options)
    model_inputs, output_args = built.prepare_model_inputs(batch)
    shape = tuple(model_inputs["input_ids"].shape)  # [1, tokens (+ static pad)] or [batch, longest]
    weight, hidden = head["weight"].clone(), head["hidden"][: math.prod(shape)].reshape(*shape, HIDDEN)
    whole = lambda t: t  # noqa: E731
    if mesh is not None:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

        weight, hidden = distribute_tensor(weight, mesh, [Shard(0)]), DTensor.from_local(hidden, mesh, [Replicate()])
        whole = lambda t: t.full_tensor()  # noqa: E731
    weight.requires_grad_()
    logits = hidden @ weight.T
    if padding_logit is not None:
        padding = torch.arange(shape[1]) >= batch["input_ids"].offsets().diff().unsqueeze(-1)
        logits = logits + torch.where(padding, padding_logit, 0.0).unsqueeze(-1).to(logits.dtype)
    logits.retain_grad()
    with watch if watch is not None else contextlib.nullcontext():
        output = engine_bench.prepare_outputs(built, SimpleNamespace(logits=logits), output_args, batch)
    weights = {key: head["weights"][key][: out.values().numel()] for key, out in output.items()}
    values = whole(logits.detach()).clone()  # (an in-place backward overwrites the logits with their gradient)
    sum((out.values() * weights[key]).sum() for key, out in output.items()).backward()
    in_place = logits._version > 0 and torch.equal(logits.detach(), logits.grad)  # (retain_grad keeps a copy)
    return SimpleNamespace(output=output, logits=values, logits_grad=whole(logits.grad), weight_grad=whole(weight.grad),
                           hidden=whole(hidden), weights=weights, temperature=_temperatures(batch, shape),
                           in_place=in_place)  # fmt: skip


def _head(dtype, tokens=64):
    """The LM head's weight, every token's hidden state and the loss weights."""
    return {
        "weight": torch.randn(VOCAB, HIDDEN, dtype=torch.float64).to(dtype),
        "hidden": (torch.randn(tokens, HIDDEN, dtype=torch.float64) * 0.8).to(dtype),
        "weights": {k: torch.randn(tokens, dtype=torch.float64).to(dtype) for k in ("log_probs", "entropy")},
    }


def _temperatures(micro_batch, shape):
    """The temperature of every logits row as veRL divides by it, float64 [rows]:
    per token over the packed layout (1 on its static padding) or per sample over
    the padded one."""
    temperature = tu.get_non_tensor_data(micro_batch, "temperature", 1.0)
    per_sample = torch.as_tensor(temperature, dtype=torch.float64).expand(micro_batch.batch_size[0])
    if shape[0] == 1 and tu.get_non_tensor_data(micro_batch, "use_remove_padding", True):
        rows = torch.repeat_interleave(per_sample, micro_batch["input_ids"].offsets().diff())
        return torch.cat([rows, torch.ones(shape[1] - len(rows), dtype=torch.float64)])
    return per_sample.repeat_interleave(shape[1])


def _assert_matches_verl(patched, unpatched, u):
    """Patched against veRL's own, both computing in a precision of unit roundoff u.

    Outputs: each side sums a row's V terms within (V + 4) u of the sum of |terms|
    <= max|z| + log V + 1 (z = logits / T; the log-normaliser's size bounds the
    entropy's terms too), so the two differ by at most twice that, plus each
    side's rounding of the result, u |value|.
    The logits' gradient, entry by entry: each side's p_j errs by at most
    4 (V + 4) u p_j relative (exp of a difference of two logits, and the
    normaliser), scaled by what multiplies p_j in the gradient: the loss weights
    over T times at most max|z| + log V + 1 (the log-prob's gradient is
    (1[j = label] - p_j) w / T, the entropy's p_j (log p_j + H) w / T); plus 2 tiny
    for a p_j flushed to 0, and the result's own rounding, 2 u |g|; twice, for two
    sides. The weight's gradient is the logits' gradient through the same
    matmul on each side: that bound carried through (|dG|^T |h|) plus the matmul's
    rounding of each side, (N + 2) u (|G|^T |h|)."""
    assert set(patched.output) == set(unpatched.output), f"{sorted(patched.output)} vs veRL's {sorted(unpatched.output)}"
    z = patched.logits.double().reshape(-1, VOCAB) / patched.temperature.unsqueeze(-1)
    # (rows a model filled with NaN or inf: padding, whose gradient is 0 on both sides)
    finite = torch.isfinite(z).all(-1, keepdim=True)
    z = z.masked_fill(~finite, 0.0)
    max_z = z.abs().max().item()
    for key, expected in unpatched.output.items():
        actual = patched.output[key]
        assert actual.is_nested and torch.equal(actual.offsets(), expected.offsets()), f"{key}: not veRL's layout"
        a, e = actual.values(), expected.values()
        assert a.dtype == e.dtype, f"{key}: dtype {a.dtype} vs veRL's {e.dtype}"
        bound = 2 * (VOCAB + 4) * u * (max_z + math.log(VOCAB) + 1) + 2 * u * e.double().abs()
        error = (a.double() - e.double()).abs()
        assert bool((error <= bound).all()), f"{key}: off veRL's by {error.max():.3g}"
    tiny = torch.finfo(patched.logits.dtype).tiny
    p = torch.softmax(z, dim=-1)
    w = sum(weights.double().abs().max() for weights in patched.weights.values()).item()
    g_u = unpatched.logits_grad.double().reshape(-1, VOCAB)
    g_bound = 2 * ((4 * (VOCAB + 4) * u * p + 2 * tiny) * (max_z + math.log(VOCAB) + 1) * w
                   / patched.temperature.unsqueeze(-1) + 2 * u * g_u.abs())  # fmt: skip
    g_error = (patched.logits_grad.double().reshape(-1, VOCAB) - g_u).abs()
    assert bool((g_error <= g_bound).all()), f"logits' gradient off veRL's by {g_error.max():.3g}"
    h = patched.hidden.double().reshape(-1, HIDDEN).abs()
    w_bound = g_bound.T @ h + 2 * (h.shape[0] + 2) * u * (g_u.abs().T @ h)
    w_error = (patched.weight_grad.double() - unpatched.weight_grad.double()).abs()
    assert bool((w_error <= w_bound).all()), f"the LM head weight's gradient off veRL's by {w_error.max():.3g}"


def _patched_and_not(micro_batch, head, padding_logit=None, **engine_options):
    """The step under veRL's own engine, then patched (the engine built after
    patch(), as veRL's workers build it); the patched one fell back nowhere."""
    unpatched = _step(micro_batch, head, padding_logit=padding_logit, **engine_options)
    verl_integration.patch()
    patched = _step(micro_batch, head, padding_logit=padding_logit, **engine_options)
    assert not integrations.fallbacks, f"fell back to veRL's code: {dict(integrations.fallbacks)}"
    return patched, unpatched


_UNIT = {torch.float64: 2.0**-53, torch.float32: 2.0**-24}
_TEMPERATURES = {
    "per-sample": lambda: torch.tensor([0.6, 1.0, 1.3, 0.9]),
    "one": lambda: 1.0,
    "scalar": lambda: 0.7,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("temperature", list(_TEMPERATURES))
@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "logprobs"])
@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad", "padded"])
def test_engine_outputs_match_verl(remove_padding, entropy, temperature, dtype):
    """Log-probs (and entropy) of a micro-batch of 4 samples of ragged lengths,
    one of length 1: veRL's layout, dtypes, values and gradients."""
    micro_batch = _micro_batch([5, 11, 1, 8], _TEMPERATURES[temperature](), use_remove_padding=remove_padding,
                               calculate_entropy=entropy)  # fmt: skip
    patched, unpatched = _patched_and_not(micro_batch, _head(dtype))
    _assert_matches_verl(patched, unpatched, _UNIT[dtype])
    assert patched.in_place, "the patched engine writes the logits' gradient into their storage"


@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "logprobs"])
@pytest.mark.parametrize("padding_logit", [float("nan"), float("-inf"), float("inf")], ids=["nan", "-inf", "inf"])
def test_engine_padding_rows_give_no_gradient(padding_logit, entropy):
    """Without remove-padding the patched engine reads the padded [batch, longest,
    V] logits in place, padding rows included: padding rows that a model filled
    with NaN or +-inf still give veRL's outputs and gradients, +0 on the padding
    rows and finite in the LM head's weight (a row no gradient flows into gets 0:
    their 0 * NaN reached every weight before, issue 40). veRL's own entropy
    reads the padding rows too, and its gradient is NaN there; it is compared
    without that NaN."""
    micro_batch = _micro_batch([5, 11, 1, 8], torch.tensor([0.6, 1.0, 1.3, 0.9]), use_remove_padding=False,
                               calculate_entropy=entropy)  # fmt: skip
    patched, unpatched = _patched_and_not(micro_batch, _head(torch.float32), padding_logit=padding_logit)
    padding = ~torch.isfinite(patched.logits.reshape(-1, VOCAB)).all(-1)
    assert int(padding.sum()) == 4 * 11 - (5 + 11 + 1 + 8)
    grad = patched.logits_grad.reshape(-1, VOCAB)
    assert torch.equal(grad[padding], torch.zeros_like(grad[padding])) and torch.isfinite(patched.weight_grad).all()
    if entropy:
        assert not torch.isfinite(unpatched.weight_grad).all(), "veRL's entropy gradient: NaN on padding rows"
        unpatched.logits_grad = unpatched.logits_grad.reshape(-1, VOCAB).masked_fill(padding.unsqueeze(-1), 0.0)
        unpatched.weight_grad = unpatched.logits_grad.T @ unpatched.hidden.reshape(-1, HIDDEN)
    _assert_matches_verl(patched, unpatched, _UNIT[torch.float32])


_AUTOMODEL = pytest.mark.skipif(
    not engine_bench.automodel_importable(), reason="nemo_automodel is not installed (make setup installs it)"
)


@_AUTOMODEL
@pytest.mark.parametrize("temperature", ["per-sample", "one"])
@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "logprobs"])
@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad", "padded"])
def test_automodel_engine_outputs_match_verl(remove_padding, entropy, temperature):
    """veRL's Automodel engine (``AutomodelEngineWithLMHead.prepare_model_outputs``,
    the FSDP engine's semantics without Σπ², distillation or sequence parallelism)
    patched against its own: veRL's layout, dtypes, values and gradients, the
    gradient in the logits' storage; a Σπ² request, which that engine ignores,
    adds no output."""
    micro_batch = _micro_batch([5, 11, 1, 8], _TEMPERATURES[temperature](), use_remove_padding=remove_padding,
                               calculate_entropy=entropy, calculate_sum_pi_squared=True)  # fmt: skip
    patched, unpatched = _patched_and_not(micro_batch, _head(torch.float32), automodel=True)
    _assert_matches_verl(patched, unpatched, _UNIT[torch.float32])
    assert patched.in_place, "the patched engine writes the logits' gradient into their storage"


@_AUTOMODEL
def test_automodel_engine_fused_kernels_fall_back():
    """use_fused_kernels on the Automodel engine: veRL's own code, counted."""
    micro_batch = _micro_batch([4, 6], 1.0, use_fused_kernels=True, calculate_entropy=True)
    built = engine_bench.engine(automodel=True)
    verl_integration.patch()
    fused = SimpleNamespace(log_probs=torch.randn(1, 10), entropy=torch.rand(1, 10))
    with pytest.warns(integrations.FallbackWarning, match="fused_kernels"):
        output = built.prepare_model_outputs(fused, {"input_ids_rmpad_rolled": None, "temperature_rmpad": None},
                                             micro_batch)  # fmt: skip
    assert torch.equal(output["log_probs"].values(), fused.log_probs[0])
    assert len(integrations.fallbacks) == 1, dict(integrations.fallbacks)


@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no-entropy"])
@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad", "padded"])
def test_engine_sum_pi_squared_in_the_same_pass(remove_padding, entropy):
    """calculate_sum_pi_squared (veRL's optimal-token baseline): Σπ² from the same
    read of the logits, veRL's layout and dtype, within _assert_matches_verl's
    output bound of veRL's own pass (whose terms are at most 1: the bound there
    covers it); and the gradient of the outputs veRL differentiates."""
    micro_batch = _micro_batch([5, 11, 1, 8], torch.tensor([0.6, 1.0, 1.3, 0.9]), use_remove_padding=remove_padding,
                               calculate_entropy=entropy, calculate_sum_pi_squared=True)  # fmt: skip
    head = _head(torch.float32)
    head["weights"]["sum_pi_squared"] = torch.zeros(64)  # (veRL uses it without a gradient)
    patched, unpatched = _patched_and_not(micro_batch, head)
    assert "sum_pi_squared" in patched.output
    _assert_matches_verl(patched, unpatched, _UNIT[torch.float32])


def test_engine_dtypes_under_cuda_autocast(monkeypatch):
    """veRL's engines run prepare_model_outputs inside torch.autocast, and on CUDA
    autocast runs its softmax, log_softmax and logsumexp in float32: veRL's
    log-probs, entropy and Σπ² of bf16 logits are float32 there (on CPU they stay
    bf16). The patched engine follows, here with CPU autocast standing in for
    CUDA's (_AUTOCAST_FLOAT32), and gives bf16 outside autocast."""
    batch = _micro_batch([5, 3], torch.tensor([0.7, 1.0]), calculate_entropy=True, calculate_sum_pi_squared=True)
    head = _head(torch.bfloat16)
    head["weights"]["sum_pi_squared"] = torch.zeros(64, dtype=torch.bfloat16)
    verl_integration.patch()
    plain = _step(batch, head)
    monkeypatch.setattr(verl_integration, "_AUTOCAST_FLOAT32", ("cuda", "cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = _step(batch, head)
    assert not integrations.fallbacks, dict(integrations.fallbacks)
    keys = ("log_probs", "entropy", "sum_pi_squared")
    assert [plain.output[k].values().dtype for k in keys] == [torch.bfloat16] * 3
    assert [autocast.output[k].values().dtype for k in keys] == [torch.float32] * 3


def test_engine_short_padded_logits_fall_back():
    """Padded logits with fewer positions than the longest sample: veRL's own
    method reads other rows for the missing ones or, as here, raises; the patch
    runs veRL's (said so), not a guess of its own."""
    batch = _micro_batch([5, 9], torch.tensor([0.7, 1.0]), use_remove_padding=False, calculate_entropy=True)
    built = engine_bench.engine()
    _, output_args = built.prepare_model_inputs(batch)
    logits = SimpleNamespace(logits=torch.randn(2, 8, VOCAB))
    with pytest.raises(RuntimeError) as verl_error:
        built.prepare_model_outputs(logits, output_args, batch, None)
    verl_integration.patch()
    with pytest.warns(integrations.FallbackWarning, match="do not cover every sample"):
        with pytest.raises(RuntimeError, match=re.escape(str(verl_error.value))):
            engine_bench.engine().prepare_model_outputs(logits, output_args, batch, None)


@pytest.mark.parametrize("options", [{"chunked": True}, {"pad_bucket": 16}], ids=["chunked-entropy", "static-pad"])
def test_engine_options_match_verl(options):
    """The chunked entropy (veRL returns it in the default dtype) and the static
    padding of the packed sequence to a bucket (stripped from the outputs)."""
    micro_batch = _micro_batch([7, 3, 9], torch.tensor([0.8, 1.2, 1.0]), calculate_entropy=True)
    patched, unpatched = _patched_and_not(micro_batch, _head(torch.float32), **options)
    _assert_matches_verl(patched, unpatched, _UNIT[torch.float32])


@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad", "padded"])
def test_engine_bf16_follows_verl_dtypes(remove_padding):
    """bf16 logits: veRL's dtypes (the logits' for both on its log_softmax path),
    and values within bf16 rounding of the float64 truth. veRL itself divides
    bf16 logits by the temperature rounded to bf16 and rounds the quotient; fastrl
    divides by the float32 temperature inside the kernel, as vLLM's sampler does,
    so the comparison is with the truth: the float32 kernel's error is below
    (V + 4) 2^-24 (max|z| + log V + 1), and the bf16 result's rounding 2^-8 |value|."""
    micro_batch = _micro_batch([6, 2, 9, 4], torch.tensor([0.7, 1.0, 1.3, 0.6]), use_remove_padding=remove_padding,
                               calculate_entropy=True)  # fmt: skip
    verl_integration.patch()
    step = _step(micro_batch, _head(torch.bfloat16))
    assert not integrations.fallbacks, dict(integrations.fallbacks)
    z = step.logits.double().reshape(-1, VOCAB) / step.temperature.unsqueeze(-1)
    lengths = micro_batch["input_ids"].offsets().diff()
    rows = (torch.arange(z.shape[0]) if remove_padding else
            (torch.arange(step.logits.shape[1]) < lengths.unsqueeze(1)).reshape(-1).nonzero().squeeze(1))  # fmt: skip
    rows = rows[: int(lengths.sum())]
    labels = torch.roll(micro_batch["input_ids"].values(), -1)
    truth_lp, truth_h = reference.logprobs_and_entropy(z[rows], labels)
    for key, truth in (("log_probs", truth_lp), ("entropy", truth_h)):
        values = step.output[key].values()
        assert values.dtype == torch.bfloat16, f"{key}: veRL returns the logits' dtype"
        bound = (VOCAB + 4) * 2.0**-24 * (z.abs().max() + math.log(VOCAB) + 1) + 2.0**-8 * truth.abs()
        assert bool(((values.double() - truth).abs() <= bound).all()), f"{key}: off the truth"


@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad", "padded"])
def test_engine_reads_the_logits_once_a_pass(remove_padding):
    """Per-sample temperatures, entropy on: the patched call and its backward move
    the logits as one fused op does, counted from every operator that runs
    (bench.verl_engine.LogitsTraffic; fastrl's own included): the forward reads
    them once, the backward reads them once and writes the gradient once, into
    their own storage; no other operator reads or makes a tensor their size (no
    scaled copy, softmax or concatenation of the padded layout). veRL's own, under
    the same count, moves them many times: the count sees such traffic."""
    lengths = [9, 4, 12]
    batch = _micro_batch(lengths, torch.tensor([0.7, 1.0, 1.3]), use_remove_padding=remove_padding,
                         calculate_entropy=True)  # fmt: skip
    built = engine_bench.engine()
    inputs, output_args = built.prepare_model_inputs(batch)
    logits = torch.randn(*inputs["input_ids"].shape, VOCAB, requires_grad=True)
    size = logits.numel() * logits.element_size()
    verl_count = engine_bench.LogitsTraffic(sum(lengths) * VOCAB)
    engine_bench.run_step(built, batch, output_args, logits, True, verl_count)
    assert verl_count.read >= 4 * size and verl_count.written >= 3 * size, vars(verl_count)
    verl_integration.patch()
    built = engine_bench.engine()
    count = engine_bench.LogitsTraffic(sum(lengths) * VOCAB)
    engine_bench.run_step(built, batch, output_args, logits, True, count)
    assert not integrations.fallbacks, dict(integrations.fallbacks)
    assert (count.read, count.written) == (2 * size, size), f"logits-sized traffic {vars(count)}, the logits {size} B"
    with torch.no_grad():
        forward = engine_bench.LogitsTraffic(sum(lengths) * VOCAB)
        engine_bench.run_step(built, batch, output_args, logits, False, forward)
    assert (forward.read, forward.written) == (size, 0), vars(forward)


def _fused_output(micro_batch):
    """What the model returns with use_fused_kernels and remove-padding: per-token
    log-probs and entropy, [1, tokens], no logits."""
    tokens = int(micro_batch["input_ids"].offsets()[-1])
    return SimpleNamespace(log_probs=-torch.rand(1, tokens), entropy=torch.rand(1, tokens), logits=None)


@pytest.mark.parametrize("option", ["use_fused_kernels", "distillation_use_topk"])
def test_engine_options_fastrl_does_not_take_fall_back(option):
    """The options fastrl does not reproduce run veRL's own method, counted and
    announced once: the same outputs as veRL's (its method then calls the patched
    log-prob and entropy functions, so to the rounding of _assert_matches_verl's
    outputs)."""
    micro_batch = _micro_batch([6, 3], 0.8 if option == "use_fused_kernels" else torch.tensor([0.8, 1.1]),
                               calculate_entropy=True, **{option: True})  # fmt: skip
    built = engine_bench.engine()
    _, output_args = built.prepare_model_inputs(micro_batch)
    head = _head(torch.float32)
    logits = head["hidden"][:9].reshape(1, 9, HIDDEN) @ head["weight"].T
    output = _fused_output(micro_batch) if option == "use_fused_kernels" else SimpleNamespace(logits=logits)
    processor = lambda student_logits, data: {"distillation_losses": student_logits.sum(-1)}  # noqa: E731
    expected = built.prepare_model_outputs(output, output_args, micro_batch, processor)
    verl_integration.patch()
    with pytest.warns(integrations.FallbackWarning, match="fused_kernels" if option == "use_fused_kernels"
                      else "distillation"):  # fmt: skip
        actual = engine_bench.engine().prepare_model_outputs(output, output_args, micro_batch, processor)
    assert len(integrations.fallbacks) == 1, dict(integrations.fallbacks)
    assert set(actual) == set(expected)
    bound = 2 * (VOCAB + 4) * 2.0**-24 * (logits.abs().max().item() / 0.8 + math.log(VOCAB) + 1)
    for key in expected:
        assert torch.equal(actual[key].offsets(), expected[key].offsets()), key
        assert (actual[key].values() - expected[key].values()).abs().max().item() <= bound, key


@contextlib.contextmanager
def _gathers(shapes: list):
    """Records the shape of every DTensor gathered whole (full_tensor) while it runs."""
    from unittest import mock

    from torch.distributed.tensor import DTensor

    full_tensor = DTensor.full_tensor

    def recorded(self, *args, **kwargs):
        shapes.append(tuple(self.shape))
        return full_tensor(self, *args, **kwargs)

    with mock.patch.object(DTensor, "full_tensor", recorded):
        yield


def _check_sharded_logits(rank: int, world: int, group, seed: int) -> None:
    """One rank of test_engine_takes_vocabulary_sharded_logits."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(seed)  # every rank draws the same micro-batches and head
    mesh = init_device_mesh("cpu", (world,))
    head = _head(torch.float32)
    for remove_padding, whole_logits in ((True, (17, VOCAB)), (False, (3, 9, VOCAB))):
        micro_batch = _micro_batch([6, 9, 2], torch.tensor([0.7, 1.0, 1.3]), calculate_entropy=True,
                                   use_remove_padding=remove_padding)  # fmt: skip
        verl_gathers, fastrl_gathers = [], []
        unpatched = _step(micro_batch, head, watch=_gathers(verl_gathers), mesh=mesh)
        assert verl_gathers == [whole_logits], f"rank {rank}: veRL gathers the logits: {verl_gathers}"
        verl_integration.patch()
        try:
            patched = _step(micro_batch, head, watch=_gathers(fastrl_gathers), mesh=mesh)
        finally:
            verl_integration.unpatch()
        assert not integrations.fallbacks, f"rank {rank}: fell back: {dict(integrations.fallbacks)}"
        assert fastrl_gathers == [], f"rank {rank}: the patched engine gathered the logits: {fastrl_gathers}"
        _assert_matches_verl(patched, unpatched, _UNIT[torch.float32])


def test_engine_takes_vocabulary_sharded_logits(tmp_path):
    """FSDP2 with tensor parallelism: the logits are a DTensor sharded on the
    vocabulary (301 columns over 2 gloo ranks: 151 and 150, torch.chunk's split),
    packed (remove-padding) and padded.
    veRL gathers them whole (full_tensor) before its passes; patched, each rank
    hands its shard to fastrl's sharded log-probs and entropy (group= the mesh's,
    vocab_start from the mesh coordinate) and nothing is gathered: the outputs
    and the LM head's gradient (gathered after the fact, to compare) match
    veRL's within _assert_matches_verl's bounds, on every rank."""
    from test_vocab_parallel import _spawn

    _spawn(_check_sharded_logits, 2, tmp_path)
