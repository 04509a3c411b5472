"""Log-probs and entropy of vocabulary-sharded logits (fastrl._sharded) on
gloo process groups of 2 and 4 CPU ranks, spawned by the test: values and
gradients against the float64 reference of the unsharded logits, bitwise the
same on every rank and from run to run, uneven and out-of-order shards,
and bad input raising on every rank instead of hanging."""

from __future__ import annotations

import contextlib
import os
import sys

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
from fastrl import reference

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")

# As test_logprobs: a gradient in each dtype within its rounding of each element,
# plus that much of the largest element for the float32 arithmetic.
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}


def _all_equal_across_ranks(t: torch.Tensor, group) -> bool:
    import torch.distributed as dist

    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t.contiguous(), group=group)
    return all(torch.equal(g.nan_to_num(0.5), gathered[0].nan_to_num(0.5)) for g in gathered)


def _uneven_bounds(vocab: int, world: int) -> list[int]:
    """Random shard boundaries [0, ..., vocab] (uneven, none empty), the same on
    every rank when the ranks seed alike."""
    return [0, *sorted((torch.randperm(vocab - 1)[: world - 1] + 1).tolist()), vocab]


@contextlib.contextmanager
def _every_call_agreed():
    """FASTRL_CHECKS=1 while it runs (fastrl._distributed agrees every call), then as before."""
    before = os.environ.get("FASTRL_CHECKS")
    os.environ["FASTRL_CHECKS"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["FASTRL_CHECKS"]
        else:
            os.environ["FASTRL_CHECKS"] = before


def _expect_error_everywhere(match: str, call, error=ValueError) -> None:
    """``call`` raises on every rank. Under FASTRL_CHECKS=1, which agrees every call: a rank that
    alone changes an argument of a configuration the group agreed before (as these cases do, one
    after the other) is seen by that agreement alone (fastrl._distributed; _check_agreed_once
    tests a first call's error without it)."""
    with _every_call_agreed(), pytest.raises(error, match=match):
        call()


def _rank_main(rank: int, check, world: int, init_file: str, seed: int, backend: str = "gloo") -> None:
    """One spawned rank: ``check(rank, world, group, seed)`` in a ``backend`` group
    of ``world`` ranks (a module-level function: spawn pickles it by name)."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        check(rank, world, dist.group.WORLD, seed)
    finally:
        dist.destroy_process_group()
    # Every check passed: leave without the interpreter's teardown. A process that ran the
    # Triton interpreter (triton 3.9) aborts at exit in about one run in five ("terminate
    # called without an active exception", no Python frame left; measured 2 of 10 runs with
    # the triton backend alone, 0 of 12 with native and reference), which mp.spawn reports
    # as a failure of this test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(check, world: int, tmp_path, backend: str = "gloo") -> None:
    """``check`` on ``world`` spawned ranks, every rank drawing from one fresh seed."""
    import torch.multiprocessing as mp

    seed = int(torch.randint(2**31, ()))
    mp.spawn(_rank_main, args=(check, world, str(tmp_path / "store"), seed, backend), nprocs=world)


def _check_logits_ops(rank: int, world: int, group, seed: int) -> None:
    """One rank of test_sharded_logprobs_and_entropy_match_the_unsharded_reference."""
    torch.manual_seed(seed)  # every rank draws the same full tensors
    n_rows, vocab = 7, 1031
    bounds = _uneven_bounds(vocab, world)
    start, stop = bounds[rank], bounds[rank + 1]
    temperature = torch.rand(n_rows, dtype=torch.float64) * 1.5 + 0.4
    w_lp, w_ent = torch.randn(n_rows), torch.randn(n_rows)
    backends = kernel_backends("cpu") + ["reference"]
    for dtype in (torch.float32, torch.bfloat16):
        logits = make_logits((n_rows,), vocab, dtype, std=3.0)
        logits[1, : bounds[1]] = float("-inf")  # rank 0's part of row 1 is all -inf
        logits[1, -1] = 5.0  # (the row's max elsewhere)
        labels = make_labels(logits)
        labels[2] = bounds[1] - 1  # the last entry of rank 0, and the first of the next non-empty shard
        labels[3] = bounds[2] if bounds[2] < vocab else 0
        x64 = logits.double().requires_grad_()
        ref_lp, ref_ent = reference.logprobs_and_entropy(x64, labels, temperature=temperature)
        ((ref_lp * w_lp.double()).sum() + (ref_ent * w_ent.double()).sum()).backward()
        ref_grad = x64.grad[:, start:stop]
        x64 = logits.double().requires_grad_()
        ref_sq = reference.sum_pi_squared(x64, temperature=temperature)
        (ref_sq * w_lp.double()).sum().backward()
        ref_sq_grad = x64.grad[:, start:stop]
        for backend in backends:
            results = []
            for _ in range(2):  # run to run
                x = logits[:, start:stop].clone().requires_grad_()
                with fastrl.use_backend(backend):
                    lp, ent = fastrl.logprobs_and_entropy(x, labels, temperature=temperature.float(), group=group)
                    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
                results.append((lp, ent, x.grad))
            (lp, ent, grad), again = results
            what = f"{dtype} {backend} rank {rank}/{world}"
            assert all(torch.equal(a, b) for a, b in zip(results[0], again, strict=True)), what
            assert _all_equal_across_ranks(lp, group) and _all_equal_across_ranks(ent, group), what
            tol = output_tolerance(vocab)
            assert_close_to_reference(lp, ref_lp, tol, what=f"logprob {what}")
            assert_close_to_reference(ent, ref_ent, tol, what=f"entropy {what}")
            rtol = GRAD_RTOL[dtype] * (4 if backend == "reference" else 1)  # as test_logprobs
            atol = rtol * float(ref_grad.abs().max()) + 1e-30
            assert grad.dtype == dtype and torch.isfinite(grad).all(), what
            assert_close_to_reference(grad, ref_grad, rtol, atol, what=f"grad {what}")
            if backend != "reference":  # inplace_backward: the same gradient, written over the (non-leaf) shard
                leaf = logits[:, start:stop].clone().requires_grad_()
                shard_x = leaf * 1.0
                with fastrl.use_backend(backend):
                    lp_i, ent_i = fastrl.logprobs_and_entropy(shard_x, labels, temperature=temperature.float(),
                                                              group=group, inplace_backward=True)  # fmt: skip
                    ((lp_i * w_lp).sum() + (ent_i * w_ent).sum()).backward()
                assert torch.equal(leaf.grad, grad) and torch.equal(shard_x.detach(), grad), f"inplace {what}"
            with fastrl.use_backend(backend):
                only_lp = fastrl.logprobs_from_logits(logits[:, start:stop], labels, temperature=temperature.float(),
                                                      group=group)  # fmt: skip
                only_ent = fastrl.entropy_from_logits(logits[:, start:stop], temperature=temperature.float(),
                                                      group=group)  # fmt: skip
            assert_close_to_reference(only_lp, ref_lp, tol, what=f"logprobs_from_logits {what}")
            assert_close_to_reference(only_ent, ref_ent, tol, what=f"entropy_from_logits {what}")
            # Σπ²: the ranks' sums of squares combined (the sharded combine), and its gradient (as above)
            x = logits[:, start:stop].clone().requires_grad_()
            with fastrl.use_backend(backend):
                sq = fastrl.sum_pi_squared(x, temperature=temperature.float(), group=group)
                (sq * w_lp).sum().backward()
            assert _all_equal_across_ranks(sq.detach(), group), what
            assert_close_to_reference(sq, ref_sq.detach(), tol, what=f"sum_pi_squared {what}")
            atol = rtol * float(ref_sq_grad.abs().max()) + 1e-30
            assert_close_to_reference(x.grad, ref_sq_grad, rtol, atol, what=f"sum_pi_squared grad {what}")

    # full_kl on the shards: the whole vocabulary's KL and each shard's slice of its gradient (as test_kl).
    logits = make_logits((5,), vocab, torch.float32, std=3.0)
    ref_logits = (logits.double() + 0.3 * torch.randn(logits.shape, dtype=torch.float64)).float()
    ref_logits[-1, : bounds[1]] = float("-inf")  # p_ref = 0 < p on rank 0's shard: the KL is inf
    temp = torch.rand(5, dtype=torch.float64) + 0.5
    x64 = logits.double().requires_grad_()
    truth = reference.full_kl(x64, ref_logits.double(), temperature=temp)
    (truth[:-1] * w_lp[:4].double()).sum().backward()
    for backend in backends:
        x = logits[:, start:stop].clone().requires_grad_()
        with fastrl.use_backend(backend):
            kl = fastrl.full_kl(x, ref_logits[:, start:stop], temperature=temp.float(), group=group)
            (kl[:-1] * w_lp[:4]).sum().backward()
        assert _all_equal_across_ranks(kl.detach(), group), backend
        assert_close_to_reference(kl, truth.detach(), 1e-5, what=f"full_kl {backend}")
        grad_truth = x64.grad[:-1, start:stop]
        atol = 4e-5 * float(grad_truth.abs().max())  # test_kl's 1e-5, x4 for the reference backend as above
        assert_close_to_reference(x.grad[:-1], grad_truth, 4e-5, atol=atol, what=f"full_kl grad {backend}")

    # policy_loss_from_logits on the shards: the unsharded loss, and each shard its slice of the gradient.
    logits = make_logits((2, 5), vocab, torch.float32)
    labels = make_labels(logits)
    old, advantages = torch.randn(2, 5) - 7.0, torch.randn(2, 5)
    mask = torch.rand(2, 5) < 0.8
    full = logits.clone().requires_grad_()
    loss, _ = fastrl.policy_loss_from_logits(full, labels, old, advantages, mask, entropy_coef=0.01)
    loss.backward()
    part = logits[..., start:stop].clone().requires_grad_()
    loss_s, _ = fastrl.policy_loss_from_logits(part, labels, old, advantages, mask, entropy_coef=0.01, group=group)
    loss_s.backward()
    assert _all_equal_across_ranks(loss_s.detach(), group)
    # Each within 1e-5 (relative, and of the largest gradient entry) of the float64 truth, so 2e-5 of each other.
    torch.testing.assert_close(loss_s, loss, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(part.grad, full.grad[..., start:stop], rtol=2e-5,
                               atol=2e-5 * float(full.grad.abs().max()))  # fmt: skip

    # A NaN in one shard's part of a row, a row all -inf, and a NaN among a shard's -inf (whose max is
    # -inf, as an empty shard's: still a NaN row): NaN, as unsharded; the full KL too.
    logits = make_logits((5,), vocab, torch.float32)
    logits[4] = torch.randn(vocab)
    logits[4, 3] = 48.0  # a peaked row on rank 0's shard: entropy ~ V e^-46 ~ 1e-17
    logits[0, vocab - 1] = float("nan")
    logits[1] = float("-inf")
    logits[2, : bounds[1]] = float("-inf")
    logits[2, 0] = float("nan")
    labels = torch.tensor([0, 1, 2, 3, 4])
    ref_lp, ref_ent = reference.logprobs_and_entropy(logits.double(), labels)
    ref_kl = reference.full_kl(logits.double(), torch.zeros(5, vocab, dtype=torch.float64))
    for backend in backends:
        with fastrl.use_backend(backend):
            lp, ent, sq = fastrl.logprobs_and_entropy(logits[:, start:stop], labels, group=group, sum_pi_squared=True)
            kl = fastrl.full_kl(logits[:, start:stop], torch.zeros(5, stop - start), group=group)
        assert_close_to_reference(sq, reference.sum_pi_squared(logits.double()), 1e-5,
                                  what=f"special rows sum_pi_squared {backend}")  # fmt: skip
        assert_close_to_reference(lp, ref_lp, 1e-5, what=f"special rows logprob {backend}")
        assert_close_to_reference(ent, ref_ent, 1e-5, what=f"special rows entropy {backend}")
        assert_close_to_reference(kl, ref_kl, 1e-5, what=f"special rows full_kl {backend}")
        for tensor, name in ((kl, "kl"), (lp, "logprob")):
            assert tensor[[0, 2]].isnan().all(), f"{name} {backend}"
        # The peaked row's tiny entropy to its own precision, as unsharded (the kernels' 1e-5 relative; the
        # combination must not take it as the difference of two log-sum-exps ~ 48).
        assert abs(float(ent[4]) / float(ref_ent[4]) - 1) < 1e-4, f"peaked entropy {backend}"

    # Shards out of rank order, placed by vocab_start: rank r holds the (world-1-r)-th block.
    block = -(-vocab // world)
    mine = world - 1 - rank
    lo, hi = min(mine * block, vocab), min((mine + 1) * block, vocab)
    logits = make_logits((4,), vocab, torch.float32)
    labels = make_labels(logits)
    ref_lp, ref_ent = reference.logprobs_and_entropy(logits.double(), labels)
    lp, ent = fastrl.logprobs_and_entropy(logits[:, lo:hi], labels, group=group, vocab_start=lo)
    assert_close_to_reference(lp, ref_lp, 1e-5, what="out of order")
    assert_close_to_reference(ent, ref_ent, 1e-5, what="out of order")

    # Bad input raises on every rank (a ValueError here, naming the rank for others).
    shard = logits[:, lo:hi]
    _expect_error_everywhere("disagree on their token shapes",
                             lambda: fastrl.logprobs_from_logits(shard[: 4 - (rank == 0)], labels[: 4 - (rank == 0)],
                                                                 group=group, vocab_start=lo))  # fmt: skip
    too_big = labels.clone()
    too_big[0] = vocab + rank
    _expect_error_everywhere(
        r"labels must lie in \[0, 1031\)",
        lambda: fastrl.logprobs_from_logits(shard, too_big, group=group, vocab_start=lo),
    )
    _expect_error_everywhere("on every rank of the group or on none",
                             lambda: fastrl.logprobs_from_logits(shard, labels, group=group,
                                                                 vocab_start=lo if rank == 0 else None))  # fmt: skip
    _expect_error_everywhere(
        "do not tile the vocabulary", lambda: fastrl.logprobs_from_logits(shard, labels, group=group, vocab_start=0)
    )
    _expect_error_everywhere("disagree on their options",
                             lambda: fastrl.logprobs_from_logits(shard, labels, group=group, vocab_start=lo,
                                                                 temperature=1.0 + rank))  # fmt: skip
    _expect_error_everywhere("disagree on their options",  # (Python's hash(0.5) == hash(2.0**60): not compared so)
                             lambda: fastrl.logprobs_from_logits(shard, labels, group=group, vocab_start=lo,
                                                                 temperature=0.5 if rank == 0 else 2.0**60))  # fmt: skip
    mask4 = torch.ones(4, dtype=torch.bool)
    _expect_error_everywhere("disagree on their options",
                             lambda: fastrl.policy_loss_from_logits(shard, labels, torch.zeros(4), torch.ones(4), mask4,
                                                                    group=group, vocab_start=lo,
                                                                    loss_agg_mode="token-mean" if rank else "token-sum"))  # fmt: skip
    bad_temperature = 0.0 if rank == world - 1 else 1.0
    _expect_error_everywhere("temperature" if rank == world - 1 else rf"rank\(s\) \[{world - 1}\]",
                             lambda: fastrl.logprobs_from_logits(shard, labels, group=group, vocab_start=lo,
                                                                 temperature=bad_temperature))  # fmt: skip
    _expect_error_everywhere(r"ref_logits must have the shape" if rank == 0 else r"rank\(s\) \[0\]",
                             lambda: fastrl.full_kl(shard, shard[: 3 if rank == 0 else 4], group=group,
                                                    vocab_start=lo))  # fmt: skip
    # The group is still in step after the errors.
    lp = fastrl.logprobs_from_logits(shard, labels.int(), group=group, vocab_start=lo)
    assert_close_to_reference(lp, ref_lp, 1e-5, what="after the errors, int32 labels")
    # No tokens (any leading shape): empty results.
    empty = shard[:0].unsqueeze(1).expand(0, 3, shard.shape[-1])
    lp, ent = fastrl.logprobs_and_entropy(empty, labels[:0, None].expand(0, 3), group=group, vocab_start=lo)
    kl = fastrl.full_kl(empty, empty, group=group, vocab_start=lo)
    assert lp.shape == ent.shape == kl.shape == (0, 3)
    _check_agreed_once(rank, world, group, logits, labels, lo, hi)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts what reads a tensor's values back to the host: item / bool / int of a tensor
    (aten._local_scalar_dense) and tolist (which reads memory without dispatching), and the
    all-gathers of torch.distributed, while active."""

    def __init__(self):
        super().__init__()
        self.reads, self.gathers = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        import torch.distributed as dist

        self._tolist, self._all_gather = torch.Tensor.tolist, dist.all_gather

        def tolist(t):
            self.reads += 1
            return self._tolist(t)

        def all_gather(*args, **kwargs):
            self.gathers += 1
            return self._all_gather(*args, **kwargs)

        torch.Tensor.tolist, dist.all_gather = tolist, all_gather
        return super().__enter__()

    def __exit__(self, *exc):
        import torch.distributed as dist

        torch.Tensor.tolist, dist.all_gather = self._tolist, self._all_gather
        return super().__exit__(*exc)


def _counted(call):
    with _HostReads() as counts:
        call()
    return counts


def _check_agreed_once(rank, world, group, logits, labels, lo, hi) -> None:
    """A configuration is agreed across the group once (fastrl._distributed): a repeated call
    makes no host read beyond the unsharded op's on the same tensors, and one all-gather fewer
    than its first; FASTRL_CHECKS=1 agrees every call, catching what only the agreement sees."""
    shard = logits[:, lo:hi]
    wide = logits.repeat(1, 2)  # (sampling: a new configuration, first agreed below)
    wide_shard = wide[:, 2 * lo : 2 * hi]
    kept = labels.clamp(min=0)  # (truncated_logprobs ignores no label)
    calls = {
        "logprobs": (lambda: fastrl.logprobs_and_entropy(shard, labels, temperature=t, group=group, vocab_start=lo),
                     lambda: fastrl.logprobs_and_entropy(logits, labels, temperature=t)),
        "full_kl": (lambda: fastrl.full_kl(shard, shard.flip(0), temperature=t, group=group, vocab_start=lo),
                    lambda: fastrl.full_kl(logits, logits.flip(0), temperature=t)),
        # (a seed drawn per call, as sample(seed=None) does: not part of the configuration)
        "sample": (lambda: fastrl.sample(wide_shard, temperature=t, top_k=5, top_p=0.9,
                                         seed=int(torch.randint(1 << 30, ())), group=group, vocab_start=2 * lo),
                   lambda: fastrl.sample(wide, temperature=t, top_k=5, top_p=0.9, seed=int(torch.randint(1 << 30, ())))),
        "truncated": (lambda: fastrl.truncated_logprobs(wide_shard, kept, temperature=t, top_k=5, group=group,
                                                        vocab_start=2 * lo),
                      lambda: fastrl.truncated_logprobs(wide, kept, temperature=t, top_k=5)),
    }  # fmt: skip
    t = 0.7  # (a configuration no call above has agreed)
    first_gathers = {}
    for name, (sharded, unsharded) in calls.items():
        first = _counted(sharded)
        again = _counted(sharded)
        alone = _counted(unsharded)
        assert again.reads <= alone.reads, f"{name}: {again.reads} host reads agreed, {alone.reads} unsharded"
        assert again.gathers == first.gathers - 1, f"{name}: {first.gathers} all-gathers, then {again.gathers}"
        first_gathers[name] = first.gathers
    # A first call's rank-dependent argument raises on every rank; under FASTRL_CHECKS=1 every call is
    # agreed: labels out of the vocabulary on one rank alone, in a configuration agreed above, raise.
    with pytest.raises(ValueError, match="disagree on their options"):
        fastrl.logprobs_and_entropy(shard, labels, temperature=0.3 + rank, group=group, vocab_start=lo)
    too_big = labels.clone()
    too_big[1] = logits.shape[-1] + 5 if rank == world - 1 else too_big[1]
    with _every_call_agreed():
        assert _counted(calls["logprobs"][0]).gathers == first_gathers["logprobs"]
    _expect_error_everywhere(r"labels must lie in \[0, 1031\)",
                             lambda: fastrl.logprobs_and_entropy(shard, too_big, temperature=t, group=group,
                                                                 vocab_start=lo))  # fmt: skip
    if world == 2:  # (once: each rank compiles for itself, and 4 ranks share 2 cores on CI)
        _check_compiled_after_agreement(group, shard, labels, kept, lo, hi, wide_shard, t)


def _check_compiled_after_agreement(group, shard, labels, kept, lo, hi, wide_shard, t) -> None:
    """An agreed configuration traces whole (torch.compile(fullgraph=True): no host read, no graph
    break), forward and backward, to the eager results' bits. aot_eager: the tracing and the
    functional collectives are what is tested here, inductor's code generation in test_compile."""
    hidden = torch.randn(shard.shape[0], 8)
    weight = torch.randn(2 * shard.shape[-1], 8)[: hi - lo]
    calls = {
        "logprobs": lambda x: fastrl.logprobs_and_entropy(x, labels, temperature=t, group=group, vocab_start=lo),
        "full_kl": lambda x: fastrl.full_kl(x, x.flip(0).detach(), temperature=t, group=group, vocab_start=lo),
        "sample": lambda x: fastrl.sample(wide_shard, temperature=t, top_k=5, top_p=0.9, seed=7, group=group,
                                          vocab_start=2 * lo),
        "truncated": lambda x: fastrl.truncated_logprobs(wide_shard, kept, temperature=t, top_k=5, group=group,
                                                         vocab_start=2 * lo),
        "lm_head": lambda x: fastrl.linear_logprobs_and_entropy(hidden, weight, labels, group=group)[0],
    }  # fmt: skip
    for name, call in calls.items():
        results = []
        for run in (call, torch.compile(call, fullgraph=True, backend="aot_eager")):
            x = shard.clone().requires_grad_(name in ("logprobs", "full_kl"))
            out = run(x)
            outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
            if x.requires_grad:
                sum(o.float().nan_to_num().sum() for o in outs).backward()
                outs.append(x.grad)
            results.append(outs)
        for eager, compiled in zip(*results, strict=True):
            assert torch.equal(eager.nan_to_num(0.5), compiled.nan_to_num(0.5)), f"{name} compiled"


def _check_lm_head(rank: int, world: int, group, seed: int) -> None:
    """One rank of test_sharded_lm_head_matches_the_unsharded_reference."""
    from test_linear import OUT_RTOL, _bounds, _check, _inputs
    from test_linear import _reference as head_reference

    from fastrl import linear
    from fastrl._distributed import sum_in_rank_order

    linear._BACKWARD_COLS = 64  # several backward slabs a shard, the last one short
    torch.manual_seed(seed)  # every rank draws the same full tensors
    lead, hidden_size, vocab = (2, 5), 24, 389
    bounds = _uneven_bounds(vocab, world)
    start, stop = bounds[rank], bounds[rank + 1]
    temperature = torch.rand(lead, dtype=torch.float64) * 1.5 + 0.4
    g_lp, g_ent = torch.randn(lead), torch.randn(lead)
    backends = kernel_backends("cpu") + ["reference"]
    cases = [(torch.float32, None, 3, 1.0), (torch.bfloat16, 20.0, None, 1.25)]  # (dtype, softcap, chunk, scale)
    for dtype, softcap, chunk_size, logit_scale in cases:
        hidden, weight, bias, labels = _inputs(lead, hidden_size, vocab, dtype, "cpu")
        labels[0, 1] = bounds[1] - 1  # the last entry of rank 0's shard
        ref = head_reference(hidden, weight, bias, labels, temperature.float(), logit_scale, softcap, g_lp, g_ent)
        # As test_linear: the fused op's bounds hold for a shard, whose dL/dhidden sums at most V_r terms a
        # rank and then world - 1 partial sums (V_r + world - 1 <= V terms of float32 rounding in all).
        operand_u = 2.0**-8 if linear._operand_dtype(weight, torch.float32) != torch.float32 else 0.0
        lp_tol, ent_tol, h_tol, w_tol, b_tol = _bounds(ref, hidden, weight, logit_scale, g_lp, g_ent, operand_u)
        rtol, subnormal = OUT_RTOL[dtype], torch.finfo(dtype).tiny * torch.finfo(dtype).eps
        for backend in backends:
            results = []
            for _ in range(2):  # run to run
                leaves = [hidden.clone(), weight[start:stop].clone(), bias[start:stop].clone()]
                leaves = [t.requires_grad_() for t in leaves]
                with fastrl.use_backend(backend):
                    lp, ent = fastrl.linear_logprobs_and_entropy(
                        *leaves[:2], labels, bias=leaves[2], temperature=temperature.float(), softcap=softcap,
                        logit_scale=logit_scale, chunk_size=chunk_size, group=group,
                    )  # fmt: skip
                    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
                results.append((lp.detach(), ent.detach(), *(t.grad for t in leaves)))
            (lp, ent, grad_h, grad_w, grad_b), again = results
            what = f"{dtype} {backend} rank {rank}/{world}"
            assert all(torch.equal(a, b) for a, b in zip(results[0], again, strict=True)), what
            for t in (lp, ent, grad_h):
                assert _all_equal_across_ranks(t, group), what
            _check(lp, ref["lp"], lp_tol, 0.0, f"logprob {what}")
            _check(ent, ref["ent"], ent_tol, 0.0, f"entropy {what}")
            for grad, truth, tol, name in ((grad_h, ref["h"], h_tol, "h"), (grad_w, ref["w"][start:stop],
                                           w_tol[start:stop], "w"), (grad_b, ref["b"][start:stop], b_tol[start:stop], "b")):  # fmt: skip
                assert grad.dtype == dtype, what
                _check(grad, truth, tol + subnormal, rtol, f"grad {name} {what}")

    # A NaN upstream gradient on an ignored token reaches no gradient (its log-prob is the constant 0).
    ignored = labels.clone()
    ignored[0, 0] = -100
    for backend in backends:
        leaves = [hidden.clone().requires_grad_(), weight[start:stop].clone().requires_grad_()]
        with fastrl.use_backend(backend):
            lp, _ = fastrl.linear_logprobs_and_entropy(*leaves, ignored, group=group, with_entropy=False)
        upstream = torch.ones_like(lp)
        upstream[0, 0] = float("nan")
        lp.backward(upstream)
        assert all(torch.isfinite(t.grad).all() for t in leaves), f"NaN upstream on an ignored token, {backend}"

    # policy_loss_from_hidden on the shards: the unsharded loss, every rank the same.
    hidden, weight, _, labels = _inputs(lead, hidden_size, vocab, torch.float32, "cpu", bias=False)
    old, advantages, mask = torch.randn(lead) - 6.0, torch.randn(lead), torch.rand(lead) < 0.8
    full = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss, _ = fastrl.policy_loss_from_hidden(*full, labels, old, advantages, mask, entropy_coef=0.01)
    loss.backward()
    part = [hidden.clone().requires_grad_(), weight[start:stop].clone().requires_grad_()]
    loss_s, _ = fastrl.policy_loss_from_hidden(*part, labels, old, advantages, mask, entropy_coef=0.01,
                                               group=group)  # fmt: skip
    loss_s.backward()
    assert _all_equal_across_ranks(loss_s.detach(), group) and _all_equal_across_ranks(part[0].grad, group)
    # Both within ~1e-5 of the float64 truth (test_linear's policy-loss bounds at these scales).
    torch.testing.assert_close(loss_s, loss, rtol=2e-5, atol=2e-5)
    for g_s, g in ((part[0].grad, full[0].grad), (part[1].grad, full[1].grad[start:stop])):
        torch.testing.assert_close(g_s, g, rtol=2e-5, atol=2e-5 * float(g.abs().max()))

    # The rank-order sum: exact on integers, any row count (padded blocks), the same bits on every rank.
    for rows in (0, 1, 7, 4 * world):
        mine = torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) * (rank + 1)
        total = sum_in_rank_order(mine, group)
        assert torch.equal(total, torch.arange(rows * 3, dtype=torch.float32).view(rows, 3) * (world * (world + 1) // 2))

    # Bad input raises on every rank, the group still in step after it.
    h, w = hidden, weight[start:stop]
    _expect_error_everywhere("disagree on their hidden shapes",
                             lambda: fastrl.linear_logprobs_and_entropy(h[..., : hidden_size - (rank == 0)],
                                                                        w[:, : hidden_size - (rank == 0)], labels,
                                                                        group=group))  # fmt: skip
    _expect_error_everywhere("disagree on their options",
                             lambda: fastrl.linear_logprobs_and_entropy(h, w, labels, group=group,
                                                                        softcap=30.0 if rank == 0 else None))  # fmt: skip
    _expect_error_everywhere("disagree on their options",  # (only rank 0 would wait in the backward's sum)
                             lambda: fastrl.linear_logprobs_and_entropy(h.clone().requires_grad_(rank == 0), w,
                                                                        labels, group=group))  # fmt: skip
    _expect_error_everywhere(r"vocab_start must be in \[0, 2\*\*62\)" if rank == 0 else r"rank\(s\) \[0\]",
                             lambda: fastrl.linear_logprobs_and_entropy(h, w, labels, group=group,
                                                                        vocab_start=2**64 if rank == 0 else 0))  # fmt: skip
    _expect_error_everywhere("disagree on their options",  # (Python's hash(-1.0) == hash(-2.0): not compared so)
                             lambda: fastrl.linear_logprobs_and_entropy(h, w, labels, group=group,
                                                                        logit_scale=-1.0 - rank))  # fmt: skip
    _expect_error_everywhere("disagree on their options",
                             lambda: fastrl.policy_loss_from_hidden(h, w, labels, old, advantages, mask, group=group,
                                                                    entropy_coef=0.01 * (rank + 1)))  # fmt: skip
    # A policy-loss argument refused on one rank alone (a TypeError, and a misshapen old_log_probs) raises
    # on every rank before any collective, never leaving the others waiting.
    _expect_error_everywhere("with_entropy=True" if rank == 0 else r"rank\(s\) \[0\]",
                             lambda: fastrl.policy_loss_from_hidden(h, w, labels, old, advantages, mask, group=group,
                                                                    **({"entropy": old} if rank == 0 else {})),
                             TypeError if rank == 0 else ValueError)  # fmt: skip
    _expect_error_everywhere("old_log_probs must have the token shape" if rank == 0 else r"rank\(s\) \[0\]",
                             lambda: fastrl.policy_loss_from_hidden(h, w, labels, old[:, 1:] if rank == 0 else old,
                                                                    advantages, mask, group=group))  # fmt: skip
    too_big = labels.clone()
    too_big[0, 0] = vocab + rank
    _expect_error_everywhere(rf"labels must lie in \[0, {vocab}\)",
                             lambda: fastrl.linear_logprobs_and_entropy(h, w, too_big, group=group))  # fmt: skip
    bad_mode = "no-such-mode" if rank == world - 1 else "token-mean"
    _expect_error_everywhere("loss_agg_mode" if rank == world - 1 else rf"rank\(s\) \[{world - 1}\]",
                             lambda: fastrl.policy_loss_from_hidden(h, w, labels, old, advantages, mask,
                                                                    loss_agg_mode=bad_mode, group=group))  # fmt: skip
    lp, _ = fastrl.linear_logprobs_and_entropy(h, w, labels.int(), group=group, with_entropy=False)
    assert_close_to_reference(lp, reference.linear_logprobs_and_entropy(hidden.double(), weight.double(), labels)[0],
                              1e-5, what="after the errors, int32 labels")  # fmt: skip
    # No tokens: empty results (the reference path on every backend), a zero gradient for the head.
    w_leaf = w.clone().requires_grad_()
    lp, ent = fastrl.linear_logprobs_and_entropy(h[:0], w_leaf, labels[:0], group=group)
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == ent.shape == (0, 5) and torch.equal(w_leaf.grad, torch.zeros_like(w))


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_lm_head_matches_the_unsharded_reference(world, tmp_path):
    """linear_logprobs_and_entropy / policy_loss_from_hidden with the LM head's
    rows sharded (unevenly) over gloo ranks: outputs and the three gradients
    within test_linear's float64 bounds, every rank and run the same bits;
    the rank-order sum of dL/dhidden; bad input raising on every rank."""
    _spawn(_check_lm_head, world, tmp_path)


def _check_verl(rank: int, world: int, group, seed: int) -> None:
    """One rank of test_verl_vocab_parallel_entropy_parity."""
    from bench import verl_vocab_parallel_entropy

    torch._dynamo.config.disable = True  # veRL compiles a helper inside its forward: run it eagerly (same math)
    verl_entropy = verl_vocab_parallel_entropy(group)
    torch.manual_seed(seed)  # every rank draws the same full tensors
    n_rows, vocab = 6, 1031
    bounds = [vocab * r // world for r in range(world + 1)]
    start, stop = bounds[rank], bounds[rank + 1]
    logits = make_logits((n_rows,), vocab, torch.float32, std=3.0, masked=False)  # (veRL: NaN at -inf logits)
    weights = torch.randn(n_rows)
    x64 = logits.double().requires_grad_()
    truth = reference.entropy_from_logits(x64)
    (truth * weights.double()).sum().backward()
    results = {}
    for name, op in (("fastrl", lambda x: fastrl.entropy_from_logits(x, group=group)), ("veRL", verl_entropy)):
        x = logits[:, start:stop].clone().requires_grad_()
        entropy = op(x)
        (entropy * weights).sum().backward()
        results[name] = (entropy.detach(), x.grad)
    # Both against the float64 truth. Each sums p_j x_j (or its terms) over the row in float32: within
    # (V + 4) u of the sum of |terms| <= max |x| (the p_j sum to 1), plus the entropy's own rounding.
    # A gradient w p_j (sum p x - x_j) (T = 1) then errs by at most w p_j times that and (V + 4) u of
    # |sum p x - x_j| <= 2 max |x| (p_j's own relative error): 3 (V + 4) u max |x| w p_j; bounded here
    # by 4 (V + 4) u (max |x| + 1) w p_j; where p_j is below float32's normal range (tiny), the kernel
    # may flush it to 0: an error of at most the gradient itself, 2 w tiny max |x|.
    u, tiny = 2.0**-24, torch.finfo(torch.float32).tiny
    max_x = logits.abs().amax(dim=-1, keepdim=True).double()
    bound = (vocab + 4) * u * max_x.squeeze(-1) + 1e-6 * (1 + truth.detach())
    grad_truth = x64.grad[:, start:stop]
    p = torch.softmax(logits.double(), dim=-1)[:, start:stop]
    grad_bound = (4 * (vocab + 4) * u * p + 2 * tiny) * (max_x + 1) * weights.abs().unsqueeze(-1).double()
    for name, (entropy, grad) in results.items():
        assert bool(((entropy.double() - truth.detach()).abs() <= bound).all()), name
        assert bool(((grad.double() - grad_truth).abs() <= grad_bound).all()), f"{name} grad"

    # fastrl.integrations.verl's vocab_parallel op: veRL's Megatron-backend functions run fastrl's on the group.
    from verl.utils.megatron import tensor_parallel as verl_tp

    import fastrl.integrations.verl as verl_integration

    labels = make_labels(logits)
    labels[labels < 0] = 0  # (Megatron's cross-entropy has no ignored label)
    shard = logits[:, start:stop]
    verl_integration.patch(["vocab_parallel"])
    try:
        entropy = verl_tp.vocab_parallel_entropy(shard)
        log_probs = verl_tp.vocab_parallel_log_probs_from_logits(shard, labels)
    finally:
        verl_integration.unpatch(["vocab_parallel"])
    assert verl_tp.vocab_parallel_entropy is verl_entropy
    assert torch.equal(entropy, fastrl.entropy_from_logits(shard, group=group))
    assert log_probs.dtype == torch.float32
    assert torch.equal(log_probs, fastrl.logprobs_from_logits(shard, labels, group=group))
    assert_close_to_reference(log_probs, reference.logprobs_from_logits(logits.double(), labels), 1e-5,
                              what="patched vocab_parallel_log_probs_from_logits")  # fmt: skip


def _check_megatron(rank: int, world: int, group, seed: int) -> None:
    """One rank of test_megatron_vocab_parallel_parity: Megatron's tensor-parallel groups of
    the whole world, then of 2 ranks each (two groups side by side, as with data parallelism)."""
    from megatron.core import parallel_state

    torch._dynamo.config.disable = True  # veRL compiles a helper inside its forward: run it eagerly (same math)
    for tp_size in dict.fromkeys((world, 2)):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
        try:
            _check_megatron_group(parallel_state, seed)
        finally:
            parallel_state.destroy_model_parallel()


def _check_megatron_group(parallel_state, seed: int) -> None:
    from megatron.core import tensor_parallel
    from verl.utils.megatron import tensor_parallel as verl_tp

    import fastrl.integrations.verl as verl_integration

    tp = parallel_state.get_tensor_model_parallel_group()
    rank, world = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    torch.manual_seed(seed)  # every rank draws the same full tensors
    vocab = 1032  # Megatron's shards are equal: V / world each, in rank order
    start, stop = vocab * rank // world, vocab * (rank + 1) // world
    logits = make_logits((3, 5), vocab, torch.float32, std=3.0, masked=False)  # (veRL: NaN at -inf logits)
    labels = torch.randint(vocab, (3, 5))  # (Megatron's cross-entropy has no ignored label)
    weights = torch.randn(3, 5)
    x64 = logits.double().requires_grad_()
    truths = {"logprobs": reference.logprobs_from_logits(x64, labels), "entropy": reference.entropy_from_logits(x64)}
    grad_truths = {k: torch.autograd.grad((v * weights.double()).sum(), x64)[0][..., start:stop]
                   for k, v in truths.items()}  # fmt: skip
    ops = {
        ("logprobs", "fastrl"): lambda s: fastrl.logprobs_from_logits(s, labels, group=tp),
        ("logprobs", "megatron"): lambda s: -tensor_parallel.vocab_parallel_cross_entropy(s, labels),
        ("logprobs", "veRL"): lambda s: verl_tp.vocab_parallel_log_probs_from_logits(s, labels),
        ("entropy", "fastrl"): lambda s: fastrl.entropy_from_logits(s, group=tp),
        ("entropy", "veRL"): lambda s: verl_tp.vocab_parallel_entropy(s),
    }
    # Float32 bounds against the float64 truth, as _check_verl's: each op sums V terms of a row in
    # float32, within (V + 4) u of the sum of |terms| <= max |x| (the softmax sums to 1); a gradient's
    # p_j errs by (2 max |x| + 1) u relative (exp of a difference of two logits' size), and the
    # entropy's by its terms' sum besides; tiny: a p_j flushed to 0; and the float32 gradient's own rounding.
    u, tiny = 2.0**-24, torch.finfo(torch.float32).tiny
    max_x = logits.abs().amax(dim=-1).double()
    p = torch.softmax(logits.double(), dim=-1)[..., start:stop]
    w = weights.abs().double().unsqueeze(-1)
    for (what, who), op in ops.items():
        shard = logits[..., start:stop].clone().requires_grad_()
        out = op(shard)  # (Megatron's cross-entropy overwrites its input: each op its own copy)
        (out * weights).sum().backward()
        name = f"{who} {what} rank {rank}/{world}"
        assert out.dtype == torch.float32, name
        error = (out.double() - truths[what].detach()).abs()
        assert bool((error <= (vocab + 4) * u * max_x + 1e-6 * (1 + truths[what].detach().abs())).all()), (
            f"{name}: off by {error.max():.3g}")  # fmt: skip
        grad_error = (shard.grad.double() - grad_truths[what]).abs()
        scale = 4 * (vocab + 4) if what == "entropy" else 4 * 2
        grad_bound = (scale * u * p + 2 * tiny) * (max_x.unsqueeze(-1) + 1) * w + 2 * u * grad_truths[what].abs()
        assert bool((grad_error <= grad_bound).all()), f"{name} gradient: off by {grad_error.max():.3g}"

    # The patch routes veRL's Megatron-backend functions to fastrl on Megatron's tensor-parallel group.
    shard = logits[..., start:stop]
    verl_integration.patch(["vocab_parallel"])
    try:
        patched = verl_tp.vocab_parallel_entropy(shard), verl_tp.vocab_parallel_log_probs_from_logits(shard, labels)
    finally:
        verl_integration.unpatch(["vocab_parallel"])
    assert torch.equal(patched[0], fastrl.entropy_from_logits(shard, group=tp))
    assert torch.equal(patched[1], fastrl.logprobs_from_logits(shard, labels, group=tp))
    assert _all_equal_across_ranks(patched[1], tp)


def test_megatron_vocab_parallel_parity(tmp_path):
    """fastrl's sharded log-probs and entropy beside Megatron-core's own
    vocab_parallel_cross_entropy and veRL's Megatron helpers, on Megatron's
    tensor-parallel groups of 4 gloo ranks and of 2 (two groups of 2 among 4
    ranks: one spawn, as megatron-core takes seconds to import in each rank):
    values and gradients all within float32 bounds of the float64 truth; the veRL
    patch's vocab_parallel op runs fastrl's there. (Megatron has no
    full-vocabulary KL to compare full_kl with:
    test_sharded_logprobs_and_entropy_match_the_unsharded_reference holds it to
    the float64 spec.)"""
    pytest.importorskip("verl")
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (make setup installs it on Python 3.11)")
    _spawn(_check_megatron, 4, tmp_path)


def test_verl_vocab_parallel_entropy_parity(tmp_path):
    """veRL's own vocab_parallel_entropy (its Megatron group lookup answered with
    the gloo group) and fastrl's entropy_from_logits(group=) on the same two
    shards: values and gradients both within float32 bounds of the float64
    truth; fastrl.integrations.verl's vocab_parallel op running fastrl's in
    veRL's Megatron-backend functions."""
    pytest.importorskip("verl")
    _spawn(_check_verl, 2, tmp_path)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_logprobs_and_entropy_match_the_unsharded_reference(world, tmp_path):
    _spawn(_check_logits_ops, world, tmp_path)


def _extreme_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` [7, V] (V a multiple of 64) with the rows the tensor-parallel
    fold must get bitwise too: whole segments and whole shards of -inf (the max
    in the last segment), of finfo.min, a row of one finite logit, a NaN row."""
    vocab = logits.shape[-1]
    segment = vocab // 8
    low = torch.finfo(logits.dtype).min
    logits[1, : 7 * segment] = float("-inf")
    logits[2, segment : 5 * segment] = low
    logits[3, :] = float("-inf")
    logits[3, 3 * segment + 1] = 2.0
    logits[4, vocab // 2 + 3] = float("nan")
    return logits


def _check_tp_degrees(rank: int, world: int, group, seed: int) -> None:
    """One rank of test_the_tensor_parallel_degree_changes_no_bit: the same logits
    whole (degree 1), over 2 ranks (two groups of 2) and over 4 (vocab_start
    out of rank order), on each kernel backend, dtype and output."""
    import torch.distributed as dist

    torch.manual_seed(seed)  # every rank draws the same full tensors
    n_rows, vocab = 7, 64 * 40  # segments of 320: whole tiles and a partial one
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # (every rank makes every group)
    shuffled = [2, 0, 3, 1]  # rank r holds shard shuffled[r] of the 4
    temperature = torch.rand(n_rows, dtype=torch.float64) * 1.5 + 0.4
    w_lp, w_ent, w_sq = torch.randn(n_rows), torch.randn(n_rows), torch.randn(n_rows)

    def run(x, labels, temps, **sharding):
        """(logprob, entropy, their gradient, Σπ², its gradient, entropy alone) of x."""
        x = x.clone().requires_grad_()
        lp, ent = fastrl.logprobs_and_entropy(x, labels, temperature=temps, **sharding)
        ((lp * w_lp).nan_to_num().sum() + (ent * w_ent).nan_to_num().sum()).backward()
        grad, x.grad = x.grad, None
        sq = fastrl.sum_pi_squared(x, temperature=temps, **sharding)
        (sq * w_sq).nan_to_num().sum().backward()
        return lp, ent, grad, sq, x.grad, fastrl.entropy_from_logits(x.detach(), temperature=temps, **sharding)

    for dtype in (torch.float32, torch.bfloat16):  # (float64: test_segments_fold_to_the_whole_row)
        logits = _extreme_rows(make_logits((n_rows,), vocab, dtype, std=3.0))
        labels = make_labels(logits)
        labels[5] = vocab // 2  # the first logit of the second half
        temps = temperature.to(reference.compute_dtype(logits))
        for backend in kernel_backends("cpu"):
            with fastrl.use_backend(backend):
                whole = run(logits, labels, temps)
                half = vocab // 2
                mine = slice(rank % 2 * half, (rank % 2 + 1) * half)
                two = run(logits[:, mine], labels, temps, group=pairs[rank // 2])
                quarter = vocab // 4
                start = shuffled[rank] * quarter
                four = run(logits[:, start : start + quarter], labels, temps, group=group, vocab_start=start)
            for degree, outputs, columns in ((2, two, mine), (4, four, slice(start, start + quarter))):
                for name, got, want in zip(("logprob", "entropy", "grad", "sum_pi_squared", "its grad", "entropy alone"),
                                           outputs, whole, strict=True):  # fmt: skip
                    if name in ("grad", "its grad"):
                        want = want[:, columns]
                    assert torch.equal(got.nan_to_num(0.5), want.nan_to_num(0.5)), (
                        f"{name}: degree {degree} != 1, {dtype} {backend} rank {rank}")
                    assert torch.isnan(got).equal(torch.isnan(want)), f"{name} NaNs {dtype} {backend}"
            assert not torch.isnan(whole[0][[0, 1, 2, 3, 5, 6]]).any(), f"finite rows {dtype} {backend}"


def test_the_tensor_parallel_degree_changes_no_bit(tmp_path):
    """Issue 39: a vocabulary that is a multiple of 64 gives bitwise the same
    log-probs, entropy, Σπ² and gradients whole and over 2 or 4 ranks
    (fastrl._rows.segment_length); test_segments_fold_to_the_whole_row covers 8."""
    _spawn(_check_tp_degrees, 4, tmp_path)


@pytest.mark.parametrize("device,backend", backend_params(include_reference=False))
@pytest.mark.parametrize("vocab", [64 * 40, 64 * 1025])  # the short and the long rows' tiles (kernels/_launch.py)
def test_segments_fold_to_the_whole_row(device, backend, vocab):
    """The kernels' contract behind the sharded forward, without a process group
    (on a GPU too, compiled): each of 1, 2, 4 or 8 shards' segment statistics
    (_ops.logprobs_segments), laid side by side in vocabulary order and folded
    (_ops.logprobs_combine), give bitwise the whole row's outputs
    (_ops.logprobs_forward)."""
    from fastrl import _ops
    from fastrl._rows import segment_length

    n_rows = 5
    segment = segment_length(vocab)
    long_row = vocab > 10000  # (its tile in the two 16-bit and 32-bit widths; the fold's variants on the short row)
    for dtype in (torch.float32, torch.bfloat16) if long_row else (torch.float32, torch.bfloat16, torch.float64):
        acc = reference.compute_dtype(torch.empty(0, dtype=dtype))
        logits = _extreme_rows(make_logits((n_rows,), vocab, dtype, std=2.0)).to(device)
        labels = make_labels(logits)
        temps = (torch.rand(n_rows, dtype=torch.float64) + 0.5).to(acc).to(device)
        # (each of the fold's three variants in float32; all outputs in the other dtypes: interpreted
        # launches are what this test spends)
        flags = ((True, True), (False, False), (True, False)) if dtype == torch.float32 and not long_row else ((True, True),)
        for with_entropy, with_sum_pi_squared in flags:
            whole = _ops.logprobs_forward(logits, labels, temps, 0.0, -100, with_entropy, True, with_sum_pi_squared,
                                          backend)  # fmt: skip
            label_logits = logits.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1).to(acc)
            for degree in (1, 2, 4, 8):
                local = vocab // degree
                parts = [_ops.logprobs_segments(logits[:, r * local : (r + 1) * local], temps, 0.0, with_entropy,
                                                with_sum_pi_squared, segment, vocab, backend) for r in range(degree)]  # fmt: skip
                assert all(p.shape == (n_rows, 8 // degree, 5) for p in parts)
                folded = _ops.logprobs_combine(torch.cat(parts, dim=1), label_logits, labels, temps, 0.0, -100,
                                               with_entropy, True, with_sum_pi_squared, vocab, acc, backend)  # fmt: skip
                for name, got, want in zip(("logprob", "entropy", "stats", "sum_pi_squared"), folded, whole,
                                           strict=True):  # fmt: skip
                    assert torch.equal(got.nan_to_num(0.5), want.nan_to_num(0.5)), (
                        f"{name}: {degree} shards, {dtype} {backend} V={vocab}")


def _exact_sampler_rows(backend: str, kw: dict, n_rows: int) -> torch.Tensor:
    """[N] bool: the rows whose sharded sampler outputs (but the raw log-prob on Triton) are the
    unsharded ones bit for bit on _check_sampling's uneven split (fastrl._sharded.sampling): every
    row on native; on Triton every row but those with top-p and no top-k, whose target weighs the
    unsharded kernel's float row sum, which only whole segments give the ranks
    (test_top_p_at_a_mass_edge_keeps_the_sharded_set)."""
    if backend == "native":
        return torch.ones(n_rows, dtype=torch.bool)
    if backend != "triton":
        return torch.zeros(n_rows, dtype=torch.bool)
    top_k, top_p = kw.get("top_k", 0), kw.get("top_p", 1.0)
    return ~((torch.as_tensor(top_p) < 1) & (torch.as_tensor(top_k) == 0)).expand(n_rows)


def _check_sampling(rank: int, world: int, group, seed: int) -> None:
    """One rank of test_sharded_sampling_matches_the_unsharded_sampler."""
    torch.manual_seed(seed)  # every rank draws the same full tensors
    n_rows, vocab = 10, 1031
    bounds = _uneven_bounds(vocab, world)
    start, stop = bounds[rank], bounds[rank + 1]
    logits = make_logits((n_rows,), vocab, torch.float64, std=3.0)
    logits[1, : bounds[1]] = float("-inf")  # rank 0's part of row 1 is all -inf
    logits[1, -1] = 5.0
    top = float(logits[2].max()) + 1.0
    logits[2, bounds[1] - 1 : bounds[1] + 1] = top  # the max tied across two shards: greedy takes the first
    logits[3, bounds[-2] - 3 : bounds[-2] + 3] = float(logits[3].max()) + 0.5  # six tied at the top-k threshold
    temperature = torch.rand(n_rows, dtype=torch.float64) * 1.2 + 0.3
    temperature[2] = 0.0
    per_row = dict(temperature=temperature, top_k=torch.randint(0, 80, (n_rows,)), top_p=torch.rand(n_rows) * 0.5 + 0.5,
                   min_p=torch.rand(n_rows) * 0.05)  # fmt: skip
    configs = [dict(temperature=0.8, top_k=50), dict(temperature=1.1, top_p=0.9), dict(temperature=0.7, min_p=0.02),
               dict(temperature=0.9, top_k=40, top_p=0.85, min_p=0.01), dict(temperature=0.0), dict(top_k=6),
               per_row]  # fmt: skip
    weights = torch.randn(n_rows, dtype=torch.float64)
    # Every configuration in float32; bfloat16 and float64 (8 radix rounds) on the combined filters and
    # per-row parameters; the Triton interpreter (~40 ms a row) float32 on three and, at 2 ranks, float64 on
    # the per-row parameters (each sharded call is a dozen collectives: 4 ranks on 2 cores take ~10 ms each; its top-p
    # alone at a mass's edge: test_top_p_at_a_mass_edge_keeps_the_sharded_set).
    cases = [(torch.float32, configs), (torch.bfloat16, configs[3:4] + configs[6:]), (torch.float64, configs[1:2] + configs[6:])]
    triton_cases = [(torch.float32, configs[4:])] + [(torch.float64, configs[6:])] * (world == 2)
    for backend in kernel_backends("cpu") + ["reference"]:
        for dtype, chosen in triton_cases if backend == "triton" else cases:
            x = logits.to(dtype)
            acc = reference.compute_dtype(x)
            for kw in chosen:
                kw = {k: v.to(acc) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}
                what = f"{backend} {dtype} {sorted(kw)} rank {rank}/{world}"
                with fastrl.use_backend(backend):
                    expected = fastrl.sample(x, **kw, seed=seed, offset=3)
                    out = fastrl.sample(x[:, start:stop], **kw, seed=seed, offset=3, group=group)
                    again = fastrl.sample(x[:, start:stop], **kw, seed=seed, offset=3, group=group)
                # The same race over the same kept set (top-p's masses are exact sums: module comment;
                # Triton's top-p rows without top-k weigh a float sum, agreed to rounding on this split).
                exact = _exact_sampler_rows(backend, kw, n_rows)
                same = exact if backend == "triton" else torch.ones(n_rows, dtype=torch.bool)
                assert torch.equal(out.tokens[same], expected.tokens[same]), (what, out.tokens, expected.tokens)
                assert all(torch.equal(a, b) for a, b in zip(out, again, strict=True)), what
                # The unsharded bits (issue 39): exact mass sums on any split. Native: every output. Triton
                # (float32 and float64): the log-prob and entropy; not its raw log-prob, whose log s is the unsharded
                # kernel's float sum over the row, its segments' statistics folded (on an even split the
                # ranks fold the same: test_top_p_at_a_mass_edge_keeps_the_sharded_set).
                for name in ("logprobs", "entropy") if backend == "triton" else out._fields:
                    got, want = getattr(out, name)[exact], getattr(expected, name)[exact]
                    assert torch.equal(got.nan_to_num(0.5), want.nan_to_num(0.5)), f"{name} {what}"
                assert all(_all_equal_across_ranks(t, group) for t in out), what
                kw64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                        for k, v in kw.items()}  # fmt: skip
                truth = reference.truncated_logprobs(x.double(), out.tokens, **kw64)
                raw_truth = reference.raw_logprobs(x.double(), out.tokens, kw64.get("temperature", 1.0))
                assert_close_to_reference(out.logprobs, truth, 1e-5, what=f"logprobs {what}")
                assert_close_to_reference(out.raw_logprobs, raw_truth, 1e-5, what=f"raw {what}")
                # the processed distribution's entropy, -sum q log q over the kept set (test_sampling's bound)
                entropy_truth = reference.distribution_entropy(reference.truncated_log_distribution(x.double(), **kw64))
                assert_close_to_reference(out.entropy, entropy_truth, 1e-5, what=f"entropy {what}")
                # truncated_logprobs: the sampled tokens' log-probs (the same kept set, so the rollout's), others'
                # -inf outside it, and the gradient within the float64 autograd's of the unsharded spec.
                labels = torch.where(torch.rand(n_rows) < 0.5, out.tokens, torch.randint(vocab, (n_rows,)))
                part, whole = x[:, start:stop].clone().requires_grad_(), x.clone().requires_grad_()
                with fastrl.use_backend(backend):
                    lp = fastrl.truncated_logprobs(part, labels, **kw, group=group)
                    (lp.nan_to_num(0.0, 0.0, 0.0) * weights.to(lp.dtype)).sum().backward()
                    if exact.any():
                        whole_lp = fastrl.truncated_logprobs(whole, labels, **kw)
                        (whole_lp.nan_to_num(0.0, 0.0, 0.0) * weights.to(lp.dtype)).sum().backward()
                        got, want = lp.detach()[exact], whole_lp.detach()[exact]
                        assert torch.equal(got.nan_to_num(0.5), want.nan_to_num(0.5)), what
                        assert torch.equal(part.grad[exact], whole.grad[exact, start:stop]), f"grad {what}"
                x64 = x.to(torch.float64, copy=True).requires_grad_()
                lp_truth = reference.truncated_logprobs(x64, labels, **kw64)
                (lp_truth.nan_to_num(0.0, 0.0, 0.0) * weights).sum().backward()
                assert _all_equal_across_ranks(lp.detach(), group), what
                assert_close_to_reference(lp, lp_truth, 1e-5, what=f"truncated {what}")
                kept_label = labels == out.tokens
                assert torch.equal(lp[kept_label], out.logprobs[kept_label]), f"trainer and rollout agree: {what}"
                grad_truth = x64.grad[:, start:stop]
                rtol = GRAD_RTOL.get(dtype, 1e-12) * (4 if backend == "reference" else 1)  # as test_logprobs
                assert part.grad is not None, what
                assert_close_to_reference(part.grad, grad_truth, rtol, rtol * float(grad_truth.abs().max()) + 1e-30,
                                          what=f"truncated grad {what}")  # fmt: skip

    # Per-row seeds and a tensor offset: each row's own stream, as unsharded.
    x = logits.float()
    seeds, offset = torch.randint(-(2**62), 2**62, (n_rows,)), torch.tensor([7])
    expected = fastrl.sample(x, top_k=20, seed=seeds, offset=offset)
    out = fastrl.sample(x[:, start:stop], top_k=20, seed=seeds, offset=offset, group=group)
    assert torch.equal(out.tokens, expected.tokens)
    # Shards out of rank order, placed by vocab_start: rank r holds the (world-1-r)-th block.
    block = -(-vocab // world)
    mine = world - 1 - rank
    lo, hi = min(mine * block, vocab), min((mine + 1) * block, vocab)
    out = fastrl.sample(x[:, lo:hi], top_p=0.8, seed=5, group=group, vocab_start=lo)
    assert torch.equal(out.tokens, fastrl.sample(x, top_p=0.8, seed=5).tokens)

    # A kept set replayed (truncated_logprobs(kept=...)): the unsharded bits on every rank, its gradient's too
    # (each kept logit reaches every rank exactly, module fastrl.sampling); the reference backend's dense spec
    # to rounding.
    kept = torch.randint(-1, vocab, (n_rows, 40))
    kept[:, 0] = vocab - 1  # (row 1 is -inf on rank 0's part: one kept logit is finite)
    kept[3, 1:3] = torch.tensor([bounds[1] - 1, bounds[1]])  # both sides of a shard boundary
    kept_labels = torch.where(torch.rand(n_rows) < 0.7, kept[:, 1].clamp(min=0), torch.randint(vocab, (n_rows,)))
    for backend in kernel_backends("cpu") + ["reference"]:
        for dtype, t in ((torch.float32, 0.8), (torch.bfloat16, temperature.float().clamp(min=0.3))):
            whole, part = logits.to(dtype), logits.to(dtype)[:, start:stop].clone()
            whole.requires_grad_(), part.requires_grad_()
            with fastrl.use_backend(backend):
                whole_lp = fastrl.truncated_logprobs(whole, kept_labels, temperature=t, kept=kept)
                sharded_lp = fastrl.truncated_logprobs(part, kept_labels, temperature=t, kept=kept.flip(-1), group=group)
            (whole_lp.nan_to_num(0.0, 0.0, 0.0) * weights.float()).sum().backward()
            (sharded_lp.nan_to_num(0.0, 0.0, 0.0) * weights.float()).sum().backward()
            what = f"kept {backend} {dtype} rank {rank}/{world}"
            assert _all_equal_across_ranks(sharded_lp.detach(), group), what
            if backend == "reference":
                assert_close_to_reference(sharded_lp, whole_lp, 1e-5, what=what)
                assert_close_to_reference(part.grad, whole.grad[:, start:stop], 1e-2, 1e-5, what=what)
            else:
                assert torch.equal(sharded_lp, whole_lp), what
                assert torch.equal(part.grad, whole.grad[:, start:stop]), what

    # Bad input raises on every rank; rows with nothing to sample raise on CPU as unsharded.
    shard = x[:, start:stop]
    _expect_error_everywhere("disagree on their options",
                             lambda: fastrl.sample(shard, seed=rank, group=group))  # fmt: skip
    torch.manual_seed(seed + rank)  # each rank's own default generator: seed=None draws differ
    _expect_error_everywhere("disagree on their options", lambda: fastrl.sample(shard, group=group))
    _expect_error_everywhere("disagree on their options",
                             lambda: fastrl.truncated_logprobs(shard, out.tokens, top_k=5 + rank, group=group))  # fmt: skip
    too_big = out.tokens.clone()
    too_big[0] = vocab + rank
    _expect_error_everywhere(r"labels must lie in \[0, 1031\)",
                             lambda: fastrl.truncated_logprobs(shard, too_big, group=group))  # fmt: skip
    # Per-row tensors and labels that differ across ranks (in range, so no rank's own checks see it): the
    # fingerprint in the agreement catches them, on the logits ops too.
    per_rank = dict(temperature=torch.full((n_rows,), 0.5 + rank), top_k=torch.full((n_rows,), 5 + rank),
                    seed=torch.full((n_rows,), rank), offset=torch.tensor([rank]))  # fmt: skip
    for name, value in per_rank.items():
        kw = {"seed": 1, name: value}
        _expect_error_everywhere("pass different values", lambda kw=kw: fastrl.sample(shard, **kw, group=group))
    _expect_error_everywhere("pass different values",
                             lambda: fastrl.truncated_logprobs(shard, out.tokens.roll(rank), group=group))  # fmt: skip
    _expect_error_everywhere("pass different values",
                             lambda: fastrl.truncated_logprobs(shard, kept_labels, kept=kept.roll(rank), group=group))  # fmt: skip
    too_far = kept.clone()
    too_far[2, 5] = vocab
    _expect_error_everywhere(r"kept ids must lie in \[0, 1031\)",
                             lambda: fastrl.truncated_logprobs(shard, kept_labels, kept=too_far, group=group))  # fmt: skip
    _expect_error_everywhere("pass different values",
                             lambda: fastrl.logprobs_from_logits(shard, out.tokens.roll(rank), group=group))  # fmt: skip
    nan_row = shard.clone()
    if rank == world - 1:
        nan_row[4, 0] = float("nan")
    _expect_error_everywhere(r"logits rows \[\[4\]\]", lambda: fastrl.sample(nan_row, seed=1, group=group))
    _expect_error_everywhere(r"logits rows \[\[4\]\]",
                             lambda: fastrl.truncated_logprobs(nan_row, out.tokens, group=group))  # fmt: skip
    # No tokens: empty results, the truncated log-probs still differentiable (a zero gradient).
    empty = shard[:0].unsqueeze(1).expand(0, 3, shard.shape[-1]).clone().requires_grad_()
    tokens, logprobs, raw, entropy = fastrl.sample(empty, seed=1, group=group)
    lp = fastrl.truncated_logprobs(empty, torch.zeros(0, 3, dtype=torch.int64), top_k=3, group=group)
    lp.sum().backward()
    assert tokens.shape == logprobs.shape == raw.shape == entropy.shape == lp.shape == (0, 3)
    assert empty.grad.shape == empty.shape

    # A vocabulary of 3 * 2^20 (the masses' fixed point scales with V: at a fixed 2^-42 their sum overflowed
    # int64 past 2^21 tokens, and top-p kept the wrong set): every token is kept at top-p 0.9.
    wide = torch.zeros(1, 3 * 2**20)
    wide[0, 1::2] = -1e-3
    lo, hi = wide.shape[-1] * rank // world, wide.shape[-1] * (rank + 1) // world
    lp = fastrl.truncated_logprobs(wide[:, lo:hi], torch.tensor([1]), top_p=0.9, group=group)
    assert_close_to_reference(lp, reference.truncated_logprobs(wide.double(), torch.tensor([1]), top_p=0.9), 1e-5)
    if "triton" in kernel_backends("cpu"):  # (whose 2^-42 units would overflow: refused on every rank)
        with fastrl.use_backend("triton"):
            _expect_error_everywhere(r"fewer than 2\^21",
                                     lambda: fastrl.sample(wide[:, lo:hi], top_p=0.9, seed=1, group=group))  # fmt: skip


def _check_top_p_edge(rank: int, world: int, group, seed: int) -> None:
    """One rank of test_top_p_at_a_mass_edge_keeps_the_sharded_set."""
    import numpy as np
    from fastrl.kernels import sampling as kernels

    torch.manual_seed(seed)  # every rank draws the same full tensors
    n_rows, vocab = 4, 8192  # two of the sampler's float32 tiles: a split row too
    x = make_logits((n_rows,), vocab, torch.float32, std=2.0)
    top_p, labels = [], []
    for row in x.numpy():
        d = row - row.max()  # (x - m) * 1/T at T = 1, in float32 as the kernels compute it
        units = np.floor(np.exp(d).astype(np.float64) * 2.0**42).astype(np.int64)  # compact._mass_units
        order = np.argsort(-row, kind="stable")
        reached, total = np.cumsum(units[order]), int(units.sum())
        # the j whose float32 p leaves the least mass between p * total and the top j's
        best = None
        for j in range(5, 400):
            p = np.float32(reached[j - 1] / total)
            while float(p) * total > reached[j - 1]:
                p = np.nextafter(p, np.float32(0))
            gap = reached[j - 1] - float(p) * total
            if best is None or gap < best[0]:
                best = (gap, float(p), int(order[j]))
        top_p.append(best[1])
        labels.append(best[2])  # the (j + 1)-th largest: kept iff the target passed the top j's mass
    # and rows the segments' fold must carry: the first half -inf (whole segments and shards of nothing),
    # finfo.min every third logit, the max tied across the middle shard boundary
    extreme = make_logits((3,), vocab, torch.float32, std=2.0)
    extreme[0, : vocab // 2] = float("-inf")
    extreme[1, ::3] = torch.finfo(torch.float32).min
    extreme[2, vocab // 2 - 1 : vocab // 2 + 1] = float(extreme[2].max()) + 1.0
    x = torch.cat([x, extreme])
    top_p, labels = torch.tensor([*top_p, 0.9, 0.95, 0.5]), torch.tensor([*labels, vocab - 1, 1, vocab // 2])
    if world > 2:  # (CI's time: one edge row and the extreme ones, unsplit)
        x, top_p, labels = x[n_rows - 1 :], top_p[n_rows - 1 :], labels[n_rows - 1 :]
    local = vocab // world  # an even split: whole segments of the row (fastrl._rows.segment_length)
    part = x[:, rank * local : (rank + 1) * local]
    for split in (False, True) if world == 2 else (False,):  # (the split's bits: at 2 ranks, and test_sampling)
        kernels._sm_count = lambda device, split=split: 10**6 if split else 0
        with fastrl.use_backend("triton"):
            whole = fastrl.sample(x, top_p=top_p, seed=seed, offset=1)
            sharded = fastrl.sample(part, top_p=top_p, seed=seed, offset=1, group=group)
            whole_lp = fastrl.truncated_logprobs(x, labels, top_p=top_p)
            sharded_lp = fastrl.truncated_logprobs(part, labels, top_p=top_p, group=group)
        for name in sharded._fields:
            assert torch.equal(getattr(sharded, name), getattr(whole, name)), (name, split)
        assert torch.equal(sharded_lp, whole_lp), split
    if world == 2:
        # Float64 rows (masses in two int64 limbs, top-p weights in the shards' units: kernels/sampling/
        # compact.py): random rows and extreme ones, each with filters of its own (top-p alone on two). 4096 tokens: each
        # shard two of the list's 1024-token blocks, whose float sums the ranks added in another order before
        # the limbs (every config then differed in the last bit). One program a row: a float64 row never
        # compacts, so each of the 16 steps of its threshold search reads the row (the split's statistics
        # are every dtype's, tested above).
        short = 4096
        x64 = make_logits((7,), short, torch.float64, std=3.0)  # (four random rows: most configs differed in one)
        x64[4, : short // 2] = float("-inf")
        x64[5, ::3] = torch.finfo(torch.float64).min
        x64[6, short // 2 - 1 : short // 2 + 1] = float(x64[6].max()) + 1.0
        part64 = x64[:, rank * short // 2 : (rank + 1) * short // 2]
        per_row = dict(temperature=torch.tensor([0.7, 1.3, 1.0, 0.9, 0.8, 1.1, 0.6], dtype=torch.float64),
                       top_k=torch.tensor([0, 50, 7, 0, 40, 0, 3]),
                       top_p=torch.tensor([0.8, 0.95, 0.5, 1.0, 0.9, 0.85, 1.0], dtype=torch.float64),
                       min_p=torch.tensor([0.0, 0.01, 0.0, 0.05, 0.0, 0.02, 0.0], dtype=torch.float64))  # fmt: skip
        kernels._sm_count = lambda device: 0
        # (sample's outputs alone: truncated_logprobs takes the same selection and shard pass, and
        # _check_sampling runs it on float64 rows at 2 ranks)
        with fastrl.use_backend("triton"):
            whole = fastrl.sample(x64, **per_row, seed=seed, offset=1)
            sharded = fastrl.sample(part64, **per_row, seed=seed, offset=1, group=group)
        for name in sharded._fields:
            got, want = getattr(sharded, name), getattr(whole, name)
            assert torch.equal(got.nan_to_num(0.5), want.nan_to_num(0.5)), (name, "float64")


@pytest.mark.skipif("triton" not in kernel_backends("cpu"), reason="the Triton interpreter's exp")
@pytest.mark.parametrize("world", [2, 4])
def test_top_p_at_a_mass_edge_keeps_the_sharded_set(world, tmp_path):
    """Top-p without top-k on Triton weighs its target against the row's float sum s, its
    segments' statistics folded (kernels/sampling/sample.py, _select), and an even split's ranks
    fold the same segments (fastrl._sharded.sampling, _row_sums): rows whose p puts the target
    within 1e-10 below the exact mass of their top j tokens (where s, ~5e-8 above that mass under
    the interpreter, keeps j + 1) keep the same set whole and sharded over 2 and 4 ranks (split over
    programs or not at 2), and give the same raw log-prob (log s); so do rows with -inf segments, finfo.min
    logits and a max tied across a shard boundary. (Weighed against the exact mass on the
    ranks, as before this fold, every such row kept one token fewer sharded.) The edge is computed
    with numpy's float32 exp, the interpreter's; on a GPU the rows are merely random. At 2 ranks,
    float64 rows too, with every filter: each output bit for bit."""
    _spawn(_check_top_p_edge, world, tmp_path)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_sampling_matches_the_unsharded_sampler(world, tmp_path):
    """sample / truncated_logprobs on vocabulary shards (uneven, out of
    order): the unsharded sampler's tokens for the same seed and offset (every
    filter, per-row parameters and seeds, greedy ties across shards, ties at the
    top-k threshold), and on the native backend its log-probs, entropy and
    truncated log-probs with their gradient bit for bit (exact mass sums);
    log-probs and gradients within the float64 spec's bounds, every rank and run
    the same bits; bad input raising on every rank."""
    _spawn(_check_sampling, world, tmp_path)


def _check_cuda_graph(rank: int, world: int, group, seed: int) -> None:
    """A sharded op whose configuration is agreed is captured in a CUDA graph (no host sync),
    and the replay gives the eager bits."""
    torch.manual_seed(seed)
    torch.cuda.set_device(0)
    logits = make_logits((16,), 4096, torch.bfloat16, device="cuda")
    labels = make_labels(logits)
    calls = {
        "logprobs": lambda: fastrl.logprobs_and_entropy(logits, labels, temperature=0.7, group=group),
        "full_kl": lambda: (fastrl.full_kl(logits, logits.flip(0), group=group),),
        "sample": lambda: fastrl.sample(logits, top_k=50, top_p=0.9, seed=11, group=group),
    }
    for name, call in calls.items():
        eager = call()  # (agrees the configuration)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            call()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = call()
        graph.replay()
        torch.cuda.synchronize()
        for e, c in zip(eager, captured, strict=True):
            assert torch.equal(e.nan_to_num(0.5), c.nan_to_num(0.5)), f"{name}: the replay differs from eager"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                    reason="needs a CUDA device and NCCL")  # fmt: skip
def test_sharded_ops_are_captured_in_a_cuda_graph(tmp_path):
    """One NCCL rank (the whole vocabulary its shard): the collectives and the agreement's path
    of a repeated call, as every tensor-parallel degree runs them."""
    _spawn(_check_cuda_graph, 1, tmp_path, backend="nccl")


def test_vocab_start_without_a_group_and_bad_groups():
    logits, labels = torch.randn(3, 5), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="pass the group="):
        fastrl.logprobs_from_logits(logits, labels, vocab_start=0)
    with pytest.raises((TypeError, ValueError), match="group"):
        fastrl.logprobs_and_entropy(logits, labels, group="tp")
    with pytest.raises(ValueError, match="pass the group="):
        fastrl.sample(logits, vocab_start=0)
    with pytest.raises(ValueError, match="pass the group="):
        fastrl.truncated_logprobs(logits, labels, vocab_start=0)
    with pytest.raises((TypeError, ValueError), match="group"):
        fastrl.sample(logits, group="tp")


def test_the_torchrun_example_runs():
    """examples/tensor_parallel.py, the README's tensor-parallel example, as the README runs it."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(root / "examples" / "tensor_parallel.py")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "2 ranks: log-probs, entropy and samples match the unsharded ops" in done.stdout
