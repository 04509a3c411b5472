"""fastrl under torch.compile and CUDA graphs.

Every kernel launch is a ``torch.ops.fastrl`` operator (fastrl/_ops.py) whose
schema, fake implementation and aliasing ``torch.library.opcheck`` verifies,
and every public op, forward and backward, compiles with ``fullgraph=True`` (a
graph break is an error) and gives eager's values and gradients; with
``dynamic=True`` too, and without fullgraph with dynamic=True and False, where it
breaks no graph either (one program calls every op, its scalar options symbolic
under dynamic=True). On a GPU the same programs run under CUDA-graph capture and
replay, and through ``mode="reduce-overhead"``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import devices, kernel_backends

import fastrl
from fastrl import _ops

KERNEL_BACKENDS = [
    pytest.param(d, b, id=f"{d}-{b}", marks=[pytest.mark.gpu] if d == "cuda" else [])
    for d in devices()
    for b in kernel_backends(d)
]

B, L, V = 3, 6, 50


# --- programs: each takes tensors only and returns (scalar to differentiate, *outputs) ---------


def logprobs_program(logits, labels, temperatures):
    logprob, entropy = fastrl.logprobs_and_entropy(logits, labels, temperature=temperatures)
    scaled = fastrl.logprobs_from_logits(logits, labels, temperature=0.7)
    plain_entropy = fastrl.entropy_from_logits(logits)
    loss = logprob.sum() + 0.1 * entropy.sum() + scaled.sum() - plain_entropy.mean()
    return loss, logprob, entropy, scaled, plain_entropy


def sampling_program(logits, offset):
    draw = fastrl.sample(logits.detach(), temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=7, offset=offset)
    logprob = fastrl.truncated_logprobs(logits, draw.tokens, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01)
    return logprob.sum(), draw.tokens, draw.logprobs, draw.raw_logprobs, logprob


def policy_program(log_probs, entropy, old, advantages, mask, ref, rollout):
    weights, correction = fastrl.rollout_correction(old, rollout, mask, mode="mask", clip_min=0.5)
    loss, metrics = fastrl.policy_loss(
        log_probs, old, advantages, mask, clip_ratio_c=3.0, loss_agg_mode="seq-mean-token-mean",
        rollout_is_weights=weights, ref_log_probs=ref, kl_coef=0.1, entropy=entropy, entropy_coef=0.01,
    )  # fmt: skip
    gspo, _ = fastrl.policy_loss(log_probs, old, advantages, mask, ratio_level="sequence")
    kl = fastrl.agg_loss(
        fastrl.kl_penalty(log_probs, ref, "k3+"), mask, "token-sum", global_batch_size=torch.ones((), device=mask.device)
    )
    total = loss + gspo + kl
    return total, metrics["pg_clipfrac"], metrics["kl"], metrics["entropy"], weights, correction["rollout_is_mean"]


def full_kl_program(logits, ref_logits, temperatures):
    kl = fastrl.full_kl(logits, ref_logits, temperature=temperatures)
    return kl.sum(), kl


def from_logits_program(logits, labels, old, advantages, mask):
    # logits * 1 stands for the model's output: inplace_backward overwrites it, never the leaf.
    loss, metrics = fastrl.policy_loss_from_logits(
        logits * 1.0, labels, old, advantages, mask, temperature=0.7, inplace_backward=True, entropy_coef=0.01
    )
    return loss, metrics["pg_loss"], metrics["entropy"]


def from_hidden_program(hidden, weight, labels, old, advantages, mask):
    # Chunks of 4 tokens: the chunk loop and the GEMMs trace into the graph.
    logprob, entropy = fastrl.linear_logprobs_and_entropy(hidden, weight, labels, softcap=5.0, chunk_size=4)
    loss, metrics = fastrl.policy_loss_from_hidden(hidden, weight, labels, old, advantages, mask, temperature=0.8,
                                                   entropy_coef=0.01, chunk_size=4)  # fmt: skip
    return loss + logprob.mean() + entropy.mean(), metrics["pg_loss"], logprob, entropy


def _inputs(name: str, device: str, shape=(B, L)):
    """Fresh inputs of program ``name``; the floating leaves require grad."""
    dev = torch.device(device)
    logits = lambda: torch.randn(*shape, V, device=dev) * 2  # noqa: E731
    per_token = lambda: torch.randn(*shape, device=dev)  # noqa: E731
    log_probs = lambda: -torch.rand(*shape, device=dev) * 3  # noqa: E731
    labels = torch.randint(V, shape, device=dev)
    mask = torch.rand(shape, device=dev) > 0.2
    if name == "logprobs":
        labels[0, 0] = -100
        return logits().requires_grad_(), labels, torch.rand(*shape[:-1], 1, device=dev) + 0.5
    if name == "sampling":
        return logits().requires_grad_(), torch.full((1,), 3, dtype=torch.int64, device=dev)
    if name == "policy":
        return (log_probs().requires_grad_(), torch.rand(*shape, device=dev).requires_grad_(), log_probs(),
                per_token(), mask, log_probs(), log_probs())  # fmt: skip
    if name == "full_kl":
        return logits().requires_grad_(), logits(), torch.rand(*shape, device=dev) + 0.5
    if name == "from_hidden":
        hidden, weight = torch.randn(*shape, 16, device=dev), torch.randn(V, 16, device=dev) * 0.5
        return hidden.requires_grad_(), weight.requires_grad_(), labels, log_probs(), per_token(), mask
    return logits().requires_grad_(), labels, log_probs(), per_token(), mask


PROGRAMS = {
    "logprobs": logprobs_program,
    "sampling": sampling_program,
    "policy": policy_program,
    "full_kl": full_kl_program,
    "from_logits": from_logits_program,
    "from_hidden": from_hidden_program,
}


def _run(program, inputs):
    """(outputs, gradients w.r.t. the inputs that require grad)."""
    loss, *outputs = program(*inputs)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return [loss, *outputs], list(torch.autograd.grad(loss, leaves))


def _assert_same(actual, expected, what):
    for i, (a, e) in enumerate(zip(actual, expected)):
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6, equal_nan=True, msg=lambda m: f"{what} {i}: {m}")
        else:
            assert torch.equal(a, e), f"{what} {i}: {a} != {e}"


# --- the operators -------------------------------------------------------------------------------


def _opcheck_cases(device: str, backend: str) -> dict:
    """Arguments for every operator of fastrl._ops, on ``device`` and ``backend`` (a Triton-only
    one, _ops.TRITON_LAUNCHERS, on the Triton backend alone)."""
    dev = torch.device(device)
    logits, labels = torch.randn(4, 33, device=dev), torch.randint(33, (4,), device=dev)
    wide = torch.randn(4, 256, device=dev)
    temps = torch.rand(4, device=dev) + 0.5
    grad = lambda: torch.empty_like(logits)  # noqa: E731
    ones = torch.ones(4, device=dev)
    _, entropy, stats, _ = _ops.logprobs_forward(logits, labels, None, 0.7, -100, True, True, False, backend)
    truncation = (temps, 0.0, None, 10, None, 0.9, torch.full((4,), 0.01, device=dev), 0.0)
    _, truncated_stats = _ops.truncated_forward(logits, labels, *truncation, True, backend)
    kl, kl_stats = _ops.full_kl_forward(logits, logits.flip(1), temps, 0.0, True, backend)
    lp, old, adv = -torch.rand(2, 9, device=dev), -torch.rand(2, 9, device=dev), torch.randn(2, 9, device=dev)
    mask = (torch.rand(2, 9, device=dev) > 0.2).view(torch.uint8)
    policy = (lp, old, adv, mask, None, old)
    options = (0.2, 0.28, 3.0, False, True)
    policy_stats = _ops.policy_forward(*policy, None, 3, *options, backend)
    count = torch.tensor(5.0, dtype=torch.float64, device=dev)
    _, _, row_weights = _ops.policy_finalize(policy_stats, 0, 1.0, count, 0.0, None, None, 9.0, 0.1, 0.0, torch.float32, backend)  # fmt: skip
    _, correction_stats = _ops.rollout_correction_forward(old, lp, mask, False, True, 0.0, 2.0, 0.5, backend)
    triton_only = {}
    if backend == "triton":  # (a shard of two of the eight segments of a 256-entry vocabulary, and the fold of eight)
        triton_only = {
            "sample_segments": (wide[:, 64:128], temps, 0.0, 256, backend),
            "sample_segments_fold": (_ops.sample_segments(wide, temps, 0.0, 256, backend), torch.float32, temps, 0.0,
                                     backend),  # fmt: skip
        }
    return triton_only | {
        "logprobs_forward": (logits, labels, temps, 0.0, -100, True, True, True, backend),
        "logprobs_backward": (logits, labels, None, 0.7, -100, stats, entropy, ones, ones, grad(), 0, -1, backend),
        # (a shard of two of the eight segments of a 256-entry vocabulary, and the fold of eight)
        "logprobs_segments": (wide[:, 64:128], temps, 0.0, True, True, 32, 256, backend),
        "logprobs_combine": (_ops.logprobs_segments(wide, temps, 0.0, True, True, 32, 256, backend), wide[:, 5],
                             labels, temps, 0.0, -100, True, True, True, 256, torch.float32, backend),  # fmt: skip
        "sample_forward": (logits, *truncation, None, 11, torch.zeros(1, dtype=torch.int64, device=dev), 0, backend),
        "truncated_forward": (logits, labels, *truncation, True, backend),
        "truncated_backward": (logits, labels, truncated_stats, ones, grad(), *truncation, 0, None, backend),
        # (a vocabulary shard's: its columns start at 33 of a 66-entry vocabulary)
        "sample_shard_pass": (logits, truncated_stats[:, :2].contiguous(), temps, 0.0, None, 0.01, 33, None, 11,
                              torch.zeros(1, dtype=torch.int64, device=dev), 0, None, backend),  # fmt: skip
        # (four rows' masses, limbs of s, s_kept and u: the first two maxima kept alone)
        "sample_mass_logs": (torch.tensor([[2 << 32, 0, 1 << 32, 0, 0, 0]] + [[5 << 32, -7, 3 << 32, 1 << 31, 1 << 30, 9]] * 3,
                                          device=dev), False, backend),  # fmt: skip
        "shard_digit_histogram": (logits, torch.zeros(4, dtype=torch.int64, device=dev), 16,
                                  truncated_stats[:, :2].contiguous(), temps, 0.0, 2.0**44, backend),  # fmt: skip
        "kl_penalty_forward": (lp.flatten(), old.flatten(), 3, backend),
        "kl_penalty_backward": (lp.flatten(), old.flatten(), torch.ones(18, device=dev), 3, True, backend),
        "full_kl_forward": (logits, logits.flip(1), None, 0.9, True, backend),
        "full_kl_backward": (logits, logits.flip(1), temps, 0.0, kl_stats, kl, ones, grad(), backend),
        "policy_forward": (*policy, None, 3, *options, backend),
        "policy_finalize": (policy_stats, 2, 2.0, None, 7.0, count, None, 9.0, 0.1, 0.0, torch.float32, backend),
        "policy_backward": (*policy, policy_stats, row_weights, torch.ones((), device=dev), 3, True, 0.1, 0.0,
                            *options, True, False, backend),  # fmt: skip
        "rollout_correction_forward": (old, lp, mask, True, False, 0.5, 2.0, 0.5, backend),
        "rollout_finalize": (correction_stats, True, backend),
    }


@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_every_operator_passes_opcheck(device, backend):
    """Schema, fake implementation (shapes, dtypes, devices), aliasing and the
    declared mutations of every torch.ops.fastrl operator, including under AOT dispatch."""
    cases = _opcheck_cases(device, backend)
    registered = {name for name in dir(torch.ops.fastrl) if isinstance(getattr(torch.ops.fastrl, name), torch._ops.OpOverloadPacket)}
    triton_only = {name for names in _ops.TRITON_LAUNCHERS.values() for name in names}
    expected = set(cases) | (triton_only if backend != "triton" else set())
    assert registered == expected, f"operators without an opcheck case: {registered - expected}"
    if backend != "triton":  # another backend is refused by name
        with pytest.raises(ValueError, match="a Triton-only launcher"):
            torch.ops.fastrl.sample_segments(torch.zeros(1, 64, device=device), None, 1.0, 64, backend)
    for name, args in cases.items():
        torch.library.opcheck(getattr(torch.ops.fastrl, name).default, args)


# --- torch.compile -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.parametrize("device,backend", KERNEL_BACKENDS)
def test_compiles_without_graph_breaks_and_matches_eager(device, backend, name):
    """fullgraph=True: any graph break fails. A second call on fresh values of the
    same shapes must reuse the compiled graph (no recompilation)."""
    torch._dynamo.reset()
    program = PROGRAMS[name]
    compiled = torch.compile(program, fullgraph=True)
    with fastrl.use_backend(backend):
        for call in range(2):
            inputs = _inputs(name, device)
            with torch._dynamo.config.patch(error_on_recompile=call > 0):
                actual, actual_grads = _run(compiled, inputs)
            expected, expected_grads = _run(program, inputs)
            _assert_same(actual, expected, f"{name} output")
            _assert_same(actual_grads, expected_grads, f"{name} gradient")


@pytest.mark.parametrize("name", ["logprobs", "policy"])
def test_compiles_with_dynamic_shapes(name):
    """The fake implementations take symbolic sizes: one graph serves several batch shapes."""
    torch._dynamo.reset()
    program = PROGRAMS[name]
    compiled = torch.compile(program, fullgraph=True, dynamic=True)
    for shape in ((2, 5), (4, 9)):
        inputs = _inputs(name, "cpu", shape)
        actual, actual_grads = _run(compiled, inputs)
        expected, expected_grads = _run(program, inputs)
        _assert_same(actual, expected, f"{name} {shape} output")
        _assert_same(actual_grads, expected_grads, f"{name} {shape} gradient")


def every_op_program(logits, labels, hidden, weight, old, advantages, mask, temperature, ignore_index, top_k, top_p,
                     offset, softcap, chunk_size):  # fmt: skip
    """Every op of fastrl.__all__ in one program, its scalar options passed in: under dynamic=True
    they are symbolic (SymFloat, SymInt), as the locals of a frame resumed after a graph break are."""
    logprob, entropy = fastrl.logprobs_and_entropy(logits, labels, temperature=temperature, ignore_index=ignore_index)
    # logits * 1 stands for the model's output: inplace_backward's overlap test reads its (symbolic) strides.
    scaled = fastrl.logprobs_from_logits(logits * 1.0, labels, True, temperature=temperature, ignore_index=ignore_index)
    plain_entropy = fastrl.entropy_from_logits(logits, temperature=temperature)
    truncation = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": 0.01}
    draw = fastrl.sample(logits.detach(), **truncation, seed=7, offset=offset)
    truncated = fastrl.truncated_logprobs(logits, draw.tokens, **truncation)
    kl = fastrl.full_kl(logits, logits.detach().flip(-1), temperature=temperature)
    weights, correction = fastrl.rollout_correction(old, old + 0.1 * advantages, mask, mode="mask", clip_min=0.5)
    loss, metrics = fastrl.policy_loss(logprob, old, advantages, mask, clip_ratio_c=3.0, rollout_is_weights=weights,
                                       entropy=entropy, entropy_coef=0.01, global_batch_size=top_k)  # fmt: skip
    kl_loss = fastrl.agg_loss(fastrl.kl_penalty(scaled, old, "k3+"), mask, "seq-mean-token-sum", dp_size=2,
                              global_batch_size=top_k)  # fmt: skip
    from_logits, _ = fastrl.policy_loss_from_logits(logits * 1.0, labels, old, advantages, mask,
                                                    temperature=temperature, ignore_index=ignore_index)  # fmt: skip
    head = {"temperature": temperature, "ignore_index": ignore_index, "softcap": softcap, "chunk_size": chunk_size}
    head_logprob, head_entropy = fastrl.linear_logprobs_and_entropy(hidden, weight, labels, **head)
    from_hidden, _ = fastrl.policy_loss_from_hidden(hidden, weight, labels, old, advantages, mask, **head)
    total = (loss + kl_loss + from_logits + from_hidden - plain_entropy.mean() + truncated.sum() + kl.sum()
             + head_logprob.sum() + head_entropy.sum())  # fmt: skip
    return (total, logprob, entropy, scaled, draw.tokens, draw.logprobs, truncated, kl, weights,
            correction["rollout_is_mean"], metrics["pg_clipfrac"], head_logprob, head_entropy)  # fmt: skip


def _every_op_inputs(shape=(2, 3)):
    logits, labels, _ = _inputs("logprobs", "cpu", shape)
    hidden, weight, _, old, advantages, mask = _inputs("from_hidden", "cpu", shape)
    # temperature, ignore_index, top_k, top_p, offset, softcap, chunk_size (3: two chunks of the 6 tokens)
    return logits, labels, hidden, weight, old, advantages, mask, 0.8, -100, 20, 0.9, 5, 5.0, 3


@pytest.mark.parametrize("dynamic,backend", [(True, "eager"), (False, "aot_eager")], ids=["dynamic", "static"])
def test_every_op_compiles_without_fullgraph(dynamic, backend):
    """The rest of the matrix, the tests above having fullgraph=True: without fullgraph, with
    dynamic=True (veRL wraps its entropy so) and dynamic=False, every op gives eager's values
    and gradients and breaks no graph. A graph break would split the program, and the frame
    resumed after it takes its int and float locals as symbolic ones (InternalTorchDynamoError
    in a check written for Python numbers). No graph break is also what fullgraph=True demands,
    so this covers dynamic=True with fullgraph=True too (it only turns a break into an error).

    Backends: aot_eager traces as inductor does (Dynamo, then AOTAutograd) without inductor's C++
    build, seconds a graph on a CPU. Under dynamic shapes AOTAutograd costs three times Dynamo
    here (the fused head's chunk loops, symbolic), and what dynamic shapes change is Dynamo's
    part, fastrl's Python meeting symbolic sizes and scalars (Dynamo runs the fake
    implementations too): Dynamo alone there, AOTAutograd's dynamic shapes being
    test_compiles_with_dynamic_shapes' (inductor)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(every_op_program, dynamic=dynamic, backend=backend)
    inputs = _every_op_inputs()
    actual, actual_grads = _run(compiled, inputs)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    expected, expected_grads = _run(every_op_program, inputs)
    _assert_same(actual, expected, "output")
    _assert_same(actual_grads, expected_grads, "gradient")


def test_compiled_sample_reads_its_offset_on_the_device():
    """A device-tensor offset is an input of the graph: new steps draw anew with no recompilation."""
    torch._dynamo.reset()
    logits = torch.randn(16, V)
    compiled = torch.compile(lambda x, offset: fastrl.sample(x, top_k=20, seed=3, offset=offset).tokens, fullgraph=True)
    for step in range(3):
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            tokens = compiled(logits, torch.tensor([step]))
        assert torch.equal(tokens, fastrl.sample(logits, top_k=20, seed=3, offset=step).tokens)


def test_compiled_sample_without_seed_draws_per_row_seeds():
    """seed=None cannot read a drawn number back inside a graph: rows get their own random seeds."""
    torch._dynamo.reset()
    logits = torch.zeros(256, 1000)  # uniform rows: any repetition pattern would show
    tokens = torch.compile(lambda x: fastrl.sample(x).tokens, fullgraph=True)(logits)
    assert tokens.unique().numel() > 100  # about 226 expected; equal seeds would give 1


# --- CUDA graphs ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", PROGRAMS)
@pytest.mark.parametrize("backend", ["triton", "native"])
def test_cuda_graph_capture_and_replay(name, backend):
    """Forward and backward of every op captured in one CUDA graph, replayed on new
    input values copied into the captured tensors: the same results as eager."""
    if backend not in kernel_backends("cuda"):
        pytest.skip(f"backend {backend} cannot run on CUDA here")
    program = PROGRAMS[name]
    static = _inputs(name, "cuda")
    with fastrl.use_backend(backend):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up (compiles the kernels) outside the capture
            _run(program, static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, captured_grads = _run(program, static)
        for _ in range(2):
            fresh = _inputs(name, "cuda")
            with torch.no_grad():
                for s, f in zip(static, fresh):
                    s.copy_(f)
            graph.replay()
            expected, expected_grads = _run(program, fresh)
            _assert_same(captured, expected, f"{name} output")
            _assert_same(captured_grads, expected_grads, f"{name} gradient")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", PROGRAMS)
def test_compiled_with_cuda_graphs(name):
    """torch.compile(mode="reduce-overhead"): inductor's CUDA-graph trees around fastrl's ops."""
    torch._dynamo.reset()
    program = PROGRAMS[name]
    compiled = torch.compile(program, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        inputs = _inputs(name, "cuda")
        actual, actual_grads = _run(compiled, inputs)
        actual = [t.clone() for t in actual]  # graph outputs are overwritten by the next replay
        actual_grads = [t.clone() for t in actual_grads]
        expected, expected_grads = _run(program, inputs)
        _assert_same(actual, expected, f"{name} output")
        _assert_same(actual_grads, expected_grads, f"{name} gradient")
