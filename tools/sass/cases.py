"""What the static model compiles: every launcher of ``fastrl.kernels`` at the
canonical shapes of DESIGN.md, called with meta tensors (no storage, so
[16384, 151936] bf16 costs nothing), in two lists:

- ``CASES``: the canonical cases, one per benchmark op (names as in
  ``bench``, the benchmark harness: "logprobs fwd", "policy_loss fwd+bwd", ...) and shape,
  each declaring the kernel launches it makes, in order, by role. These are
  modelled, tabled and gated (``tools.sass``).
- ``COVERAGE``: the flag combinations the API uses that no canonical case
  reaches (per-row temperatures and parameters, device-side seeds, every KL
  estimator and aggregation mode, ...), at the same shapes. These are compiled
  (the compiler's rules, which the interpreter that runs the CPU tests does not
  apply) and checked for spills.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from fastrl._rows import segment_length

from .capture import meta, role

BF16, F32, F64, I64, U8 = torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.uint8

# DESIGN.md's canonical shapes.
LOGPROBS_SHAPES = [(16384, 151936, BF16), (8192, 128256, BF16), (4096, 32000, F32)]
# A vocabulary that is not a multiple of 8 (GPT-2's): rows do not start 16-byte
# aligned, and the main loop must still load 128 bits (issue 13).
ODD_SHAPE = (16384, 50257, BF16)
FULL_KL_SHAPE = (8192, 151936, BF16)  # bench.kl's GPU shape
SAMPLING_BATCHES = (1, 64, 256, 1024)
SAMPLING_VOCAB = 151936
SAMPLING_TEMPERATURE = 0.7
TRUNCATED_SHAPE = (16384, 151936, BF16)
SHARD_VOCAB = SAMPLING_VOCAB // 2  # a rank's shard of the vocabulary at tensor-parallel size 2
POLICY_SHAPE = (64, 8192)  # [B, L] tokens, float32


@dataclasses.dataclass(frozen=True)
class Case:
    """A canonical case: ``run()`` calls the launchers; ``roles`` names each
    launch it makes, in order. ``untaken`` lists source fragments of the runtime
    ``if`` s this case does not enter (the sampler's top-p search in a top-k
    case), or "else: " and one for the else of an ``if`` it enters: loops under
    them are not counted."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    roles: tuple[str, ...]
    run: Callable[[], None]
    untaken: tuple[str, ...] = ()
    backend: str = "triton"
    # (guard fragment, constexpr): the loops under that ``if`` compact a row, each
    # of their (predicated) stores writing at most that many entries a row (the
    # sampler's candidate list), not one per element as the model otherwise counts.
    compaction: tuple[str, str] | None = None

    @property
    def id(self) -> str:
        dims = "x".join(map(str, self.shape))
        return f"{self.op} [{dims} {str(self.dtype).replace('torch.', '')}]"


# ---------------------------------------------------------------------------
# Log-probs and entropy


def _logprobs(n: int, v: int, dtype: torch.dtype, entropy: bool, backward: bool) -> Callable[[], None]:
    from fastrl.kernels import logprobs

    def run() -> None:
        logits, labels = meta(n, v, dtype=dtype), meta(n, dtype=I64)
        name = "logprobs+entropy" if entropy else "logprobs"
        with role(f"{name} fwd"):
            _, ent, stats, _ = logprobs.logprobs_forward(
                logits, labels, 1.0, -100, with_entropy=entropy, with_stats=backward
            )
        if backward:
            grad = meta(n)
            with role(f"{name} bwd"):
                logprobs.logprobs_backward(logits, labels, 1.0, -100, stats, ent, grad, grad if entropy else None,
                                           meta(n, v, dtype=dtype))  # fmt: skip

    return run


# A log-prob backward's row no gradient flows into (a padding row: kernels/logprobs.py)
# stores zeros in a loop of its own; the canonical rows all take a gradient.
NO_GRADIENT_ROW = "if (g == 0) & (h == 0)"


def _logprobs_cases() -> list[Case]:
    out = []
    for n, v, dtype in [*LOGPROBS_SHAPES, ODD_SHAPE]:
        for entropy in (False, True):
            for backward in (False, True):
                if (n, v, dtype) == ODD_SHAPE and entropy:
                    continue
                name = "logprobs+entropy" if entropy else "logprobs"
                roles = (f"{name} fwd", f"{name} bwd") if backward else (f"{name} fwd",)
                op = f"{name} fwd+bwd" if backward else f"{name} fwd"
                out.append(Case(op, (n, v), dtype, roles, _logprobs(n, v, dtype, entropy, backward),
                                untaken=(NO_GRADIENT_ROW,)))  # fmt: skip
    return out


# ---------------------------------------------------------------------------
# KL


def _full_kl(n: int, v: int, dtype: torch.dtype, backward: bool) -> Callable[[], None]:
    from fastrl.kernels import kl

    def run() -> None:
        x, y = meta(n, v, dtype=dtype), meta(n, v, dtype=dtype)
        with role("full_kl fwd"):
            out, stats = kl.full_kl_forward(x, y, 1.0, with_stats=backward)
        if backward:
            with role("full_kl bwd"):
                kl.full_kl_backward(x, y, 1.0, stats, out, meta(n), meta(n, v, dtype=dtype))

    return run


def _kl_penalty(tokens: int) -> Callable[[], None]:
    from fastrl.kernels import kl

    def run() -> None:
        logp, ref = meta(tokens), meta(tokens)
        with role("kl_penalty fwd"):
            kl.kl_penalty_forward(logp, ref, estimator=3)
        with role("kl_penalty bwd"):
            kl.kl_penalty_backward(logp, ref, meta(tokens), estimator=3, straight_through=False)

    return run


# ---------------------------------------------------------------------------
# Sampling


def _sample(batch: int, v: int, filters: dict) -> Callable[[], None]:
    from fastrl.kernels import sampling

    def run() -> None:
        params = {"temperature": SAMPLING_TEMPERATURE, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **filters}
        with role("sample"):  # one role a launch: the case's roles name them
            sampling.sample_forward(meta(batch, v, dtype=BF16), **params, seed=0, offset=0)

    return run


def _truncated(n: int, v: int, dtype: torch.dtype) -> Callable[[], None]:
    from fastrl.kernels import sampling

    def run() -> None:
        logits, labels = meta(n, v, dtype=dtype), meta(n, dtype=I64)
        params = {"temperature": SAMPLING_TEMPERATURE, "top_k": 50, "top_p": 1.0, "min_p": 0.0}
        with role("truncated_logprobs fwd"):
            _, stats = sampling.truncated_forward(logits, labels, **params, with_stats=True)
        with role("truncated_logprobs bwd"):
            sampling.truncated_backward(logits, labels, stats, meta(n), meta(n, v, dtype=dtype), **params)

    return run


def _shard_pass(batch: int, v: int) -> Callable[[], None]:
    """A tp = 2 rank's sample at top-k 50 (fastrl._sharded.sampling): its segments' statistics (the
    rows' max and float sum, for the raw log-prob) and their fold once gathered, the top-k radix
    select's two rounds over the shard (bf16 keys), then the shard pass (its tiles, then their fold)."""
    from fastrl.kernels import sampling

    def run() -> None:
        logits, prefix = meta(batch, v, dtype=BF16), meta(batch, dtype=I64)
        with role("sample shard segments"):
            sampling.sample_segments(logits, temperature=SAMPLING_TEMPERATURE, vocab=SAMPLING_VOCAB)
        with role("sample shard segments fold"):
            sampling.sample_segments_fold(meta(batch, SAMPLING_VOCAB // segment_length(SAMPLING_VOCAB), 3,
                                               dtype=torch.float64), torch.float32,
                                          temperature=SAMPLING_TEMPERATURE)  # fmt: skip
        for shift in (24, 16):
            with role("sample shard histogram"):
                sampling.shard_digit_histogram(logits, prefix, shift, temperature=SAMPLING_TEMPERATURE)
        with role("sample shard pass"):
            sampling.sample_shard_pass(logits, meta(batch, 2, dtype=F32), temperature=SAMPLING_TEMPERATURE,
                                       min_p=0.0, column_base=v, seed=0, offset=0)  # fmt: skip

    return run


# The sampler's runtime branches (kernels/sampling/sample.py, _select). Its steps after
# the compaction loop over the row's candidate list, whose length the kernel
# computes: the model counts one trip of each (1024 entries), as for an LLM's
# row at top-k 50 (dozens of candidates) or top-p 0.9 (the benchmark's rows:
# 245 to 710 from the sub-lanes' maxima); a row with more candidates than the
# list holds runs them over the whole row, which these cases do not model.
TOP_K_SEARCH = "if k_on"
TOP_P_SEARCH = "if p_on"
# A row whose sub-lanes' maxima give its list a floor (_lane_floor: every
# top-k 50 and top-p 0.9 row of the benchmark's) skips the window histogram,
# the else of that branch, and its compaction there.
WINDOW_FALLBACK = "else: if found"
# Its compaction pass (_compact, under ``if found``) writes at most LIST_CAP
# candidates a row.
COMPACTION = ("if found", "LIST_CAP")


# A batch of at most half the SMs splits each row over several programs
# (kernels/sampling/__init__.py, _split_parts, _split_selection): the tiles' statistics and
# histogram, the rows' statistics, the compaction, then the final launch's work
# on the candidate list; where the installed triton's histogram is slow
# (_uses_window), the window histogram between the tiles' statistics and the rows'.
SPLIT_ROLES = ("sample tiles", "sample rows", "sample compact", "sample list")
WINDOW_SPLIT_ROLES = ("sample tiles", "sample window", "sample rows", "sample compact", "sample list")


def _sampling_cases() -> list[Case]:
    from fastrl.kernels import sampling

    out = []
    for batch in SAMPLING_BATCHES:
        logits = meta(batch, SAMPLING_VOCAB, dtype=BF16)
        split = sampling._split_parts(logits, batch, sampling._launch_config(logits))[0]
        split_roles = WINDOW_SPLIT_ROLES if sampling._uses_window(logits.device) else SPLIT_ROLES
        roles = split_roles if split else ("sample",)
        out.append(Case("sample top-k 50", (batch, SAMPLING_VOCAB), BF16, roles,
                        _sample(batch, SAMPLING_VOCAB, {"top_k": 50}), untaken=(TOP_P_SEARCH, WINDOW_FALLBACK),
                        compaction=COMPACTION))  # fmt: skip
        out.append(Case("sample top-p 0.9", (batch, SAMPLING_VOCAB), BF16, roles,
                        _sample(batch, SAMPLING_VOCAB, {"top_p": 0.9}), untaken=(TOP_K_SEARCH, WINDOW_FALLBACK),
                        compaction=COMPACTION))  # fmt: skip
    for batch in (64, 1024):  # the tensor-parallel sampler's read of a rank's shard (tp = 2)
        out.append(Case("sample shard top-k 50", (batch, SHARD_VOCAB), BF16,
                        ("sample shard segments", "sample shard segments fold", "sample shard histogram",
                         "sample shard histogram", "sample shard tiles", "sample shard fold"),
                        _shard_pass(batch, SHARD_VOCAB)))  # fmt: skip
    n, v, dtype = TRUNCATED_SHAPE
    out.append(Case("truncated_logprobs top-k 50 fwd+bwd", (n, v), dtype,
                    ("truncated_logprobs fwd", "truncated_logprobs bwd"), _truncated(n, v, dtype),
                    untaken=(TOP_P_SEARCH, WINDOW_FALLBACK), compaction=COMPACTION))  # fmt: skip
    return out


# ---------------------------------------------------------------------------
# Policy loss, rollout correction


def _policy(b: int, length: int, sequence: bool) -> Callable[[], None]:
    """bench.policy's case: PPO dual-clip with the k3 KL penalty, token-mean
    (GSPO's sequence-level ratio with ``sequence``)."""
    from fastrl.kernels import policy

    def run() -> None:
        logp, old, adv, ref = (meta(b, length) for _ in range(4))
        mask = meta(b, length, dtype=U8)
        with role("policy fwd"):
            stats = policy.policy_forward(logp, old, adv, mask, None, ref, None, estimator=3, clip_low=0.2,
                                          clip_high=0.28, clip_c=3.0, sequence=sequence, with_pg=True)  # fmt: skip
        with role("policy finalize"):
            _, _, row_weights = policy.policy_finalize(
                stats, mode=0, dp_size=1, batch_num_tokens=None, global_batch_size=None, norm=float(length),
                kl_coef=0.001, value_coef=0.0, loss_dtype=torch.float32,
            )  # fmt: skip
        with role("policy bwd"):
            policy.policy_backward(
                logp, old, adv, mask, None, ref, stats, row_weights, meta(), estimator=3, straight_through=False,
                kl_coef=0.001, value_coef=0.0, clip_low=0.2, clip_high=0.28, clip_c=3.0, sequence=sequence,
                with_pg=True, grad_logp=meta(b, length), grad_values=None,
            )  # fmt: skip

    return run


def _rollout(b: int, length: int) -> Callable[[], None]:
    from fastrl.kernels import policy

    def run() -> None:
        old, rollout, mask = meta(b, length), meta(b, length), meta(b, length, dtype=U8)
        with role("rollout_correction fwd"):
            _, stats = policy.rollout_correction_forward(old, rollout, mask, sequence=False, truncate=True,
                                                         clip_min=0.0, clip_max=2.0, low_threshold=0.5)  # fmt: skip
        with role("rollout finalize"):
            policy.rollout_finalize(stats, sequence=False)

    return run


def _policy_cases() -> list[Case]:
    b, length = POLICY_SHAPE
    return [
        Case("policy_loss fwd+bwd", (b, length), F32, ("policy fwd", "policy finalize", "policy bwd"),
             _policy(b, length, False)),
        Case("policy_loss GSPO fwd+bwd", (b, length), F32,
             ("policy u sums", "policy fwd", "policy finalize", "policy bwd"), _policy(b, length, True)),
        Case("rollout_correction fwd", (b, length), F32, ("rollout_correction fwd", "rollout finalize"),
             _rollout(b, length)),
        Case("kl_penalty k3 fwd+bwd", (b * length,), F32, ("kl_penalty fwd", "kl_penalty bwd"),
             _kl_penalty(b * length)),
    ]  # fmt: skip


def cases() -> list[Case]:
    """Every canonical case of the Triton kernels."""
    n, v, dtype = FULL_KL_SHAPE
    kl_cases = [
        Case("full_kl fwd", (n, v), dtype, ("full_kl fwd",), _full_kl(n, v, dtype, False)),
        Case("full_kl fwd+bwd", (n, v), dtype, ("full_kl fwd", "full_kl bwd"), _full_kl(n, v, dtype, True)),
    ]
    return [*_logprobs_cases(), *kl_cases, *_sampling_cases(), *_policy_cases()]


# ---------------------------------------------------------------------------
# Coverage: the remaining flag combinations (compiled and checked for spills)


def coverage() -> None:
    """Calls every launcher with the flag combinations the API uses (the cases
    above add the canonical ones), at canonical shapes."""
    from fastrl.kernels import kl, logprobs, policy, sampling

    for n, v, dtype in (LOGPROBS_SHAPES[0], LOGPROBS_SHAPES[2]):
        x = meta(n, v, dtype=dtype)
        labels = meta(n, dtype=I64)
        temps = meta(n, dtype=F32)
        for temperature, with_entropy in ((1.0, True), (temps, False), (temps, True)):
            _, entropy, stats, _ = logprobs.logprobs_forward(
                x, labels, temperature, -100, with_entropy=with_entropy, with_stats=True
            )
            grad = meta(n)
            logprobs.logprobs_backward(
                x,
                labels,
                temperature,
                -100,
                stats,
                entropy,
                grad,
                grad if with_entropy else None,
                meta(n, v, dtype=dtype),
            )
            if with_entropy:  # entropy's gradient alone (entropy_from_logits)
                logprobs.logprobs_backward(
                    x, None, temperature, -100, stats, entropy, None, grad, meta(n, v, dtype=dtype)
                )
        logprobs.logprobs_forward(x, None, 1.0, -100, with_entropy=True, with_stats=False)
        logprobs.logprobs_forward(x, None, 1.0, -100, with_entropy=True, with_stats=True)
        logprobs.logprobs_forward(x, labels, temps, -100, with_entropy=True, with_stats=True, with_sum_pi_squared=True)
        # A vocabulary shard's part (2 and 8 ranks of the row's segments) and the fold of the gathered segments.
        segment = segment_length(v)
        for ranks in (2, 8):
            shard = meta(n, v // ranks, dtype=dtype)
            for with_entropy, with_sum_pi_squared in ((True, False), (False, False), (True, True)):
                logprobs.logprobs_segments(shard, temps, with_entropy=with_entropy,
                                           with_sum_pi_squared=with_sum_pi_squared, segment=segment, vocab=v)  # fmt: skip
        for with_entropy, with_sum_pi_squared in ((True, False), (False, False), (True, True)):
            logprobs.logprobs_combine(meta(n, v // segment, 5, dtype=torch.float64), meta(n), labels, temps, -100,
                                      with_entropy=with_entropy, with_stats=True,
                                      with_sum_pi_squared=with_sum_pi_squared, vocab=v, acc=torch.float32)  # fmt: skip
        for params in (
            {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.0},
            {"temperature": temps, "top_k": meta(n, dtype=I64), "top_p": temps, "min_p": temps},
        ):
            sampling.sample_forward(x, **params, seed=0, offset=0)
            sampling.sample_forward(x, **params, seed=meta(n, dtype=I64), offset=meta(1, dtype=I64))
            _, trunc_stats = sampling.truncated_forward(x, labels, **params, with_stats=True)
            sampling.truncated_backward(x, labels, trunc_stats, meta(n), meta(n, v, dtype=dtype), **params)
            # a vocabulary shard's (fastrl._sharded.sampling): the truncated log-probs' pass and backward
            given = meta(n, 2, dtype=F32)
            sampling.sample_shard_pass(x, given, temperature=params["temperature"], min_p=params["min_p"],
                                       column_base=v, labels=labels)  # fmt: skip
            sampling.sample_shard_pass(x, given, temperature=params["temperature"], min_p=params["min_p"],
                                       column_base=v, seed=meta(n, dtype=I64), offset=meta(1, dtype=I64))  # fmt: skip
            sampling.truncated_backward(x, labels, trunc_stats, meta(n), meta(n, v, dtype=dtype), **params,
                                        label_base=v, label_kept=meta(n, dtype=torch.bool))  # fmt: skip
            # top-p's weighted rounds of the threshold search
            sampling.shard_digit_histogram(x, meta(n, dtype=I64), 24, given, temperature=params["temperature"],
                                           unit_scale=2.0**44)  # fmt: skip
            sampling.shard_digit_histogram(x, meta(n, dtype=I64), 16, given, temperature=params["temperature"],
                                           unit_scale=2.0**44)  # fmt: skip
            # the masses summed over the ranks, finished as the unsharded sampler finishes its own
            sampling.sample_mass_logs(meta(n, 6, dtype=I64), False)
            if isinstance(params["temperature"], torch.Tensor):
                # the row sums of an even split and their fold, with per-row temperatures (the shard case
                # compiles 2 ranks' with a scalar one): 8 ranks, a segment each
                sampling.sample_segments(meta(n, v // 8, dtype=dtype), temperature=params["temperature"], vocab=v)
                sampling.sample_segments_fold(meta(n, v // segment_length(v), 3, dtype=torch.float64), torch.float32,
                                              temperature=params["temperature"])  # fmt: skip
        # one row: split over many programs (kernels/sampling/__init__.py, _split_selection)
        one, one_temp = meta(1, v, dtype=dtype), meta(1, dtype=F32)
        split_params = {"temperature": one_temp, "top_k": meta(1, dtype=I64), "top_p": one_temp, "min_p": one_temp}
        sampling.sample_forward(one, **split_params, seed=meta(1, dtype=I64), offset=meta(1, dtype=I64))
        sampling.truncated_forward(one, meta(1, dtype=I64), **split_params, with_stats=True)
        # the other histogram (sampling._uses_window: the window where triton's
        # tl.histogram is slow, else the top digits), one program a row and split
        other = not sampling._uses_window(x.device)
        sampling.sample_forward(x, **params, seed=meta(n, dtype=I64), offset=meta(1, dtype=I64), window=other)
        sampling.truncated_forward(x, labels, **params, with_stats=True, window=other)
        sampling.sample_forward(one, **split_params, seed=meta(1, dtype=I64), offset=meta(1, dtype=I64), window=other)
        # rows of whole 16-byte lines in a view that starts 6 bytes off a boundary: the
        # aligned rows' partition, loaded in narrower pieces (kernels._launch.tile_config)
        shifted = meta(n, v + 8, dtype=dtype)[:, 3 : 3 + v]
        logprobs.logprobs_forward(shifted, labels, 1.0, -100, with_entropy=True, with_stats=True)
        kl.full_kl_forward(shifted, x, 1.0, with_stats=True)
        sampling.sample_forward(shifted, temperature=0.7, top_k=50, top_p=1.0, min_p=0.0, seed=0, offset=0)
        for temperature in (1.0, temps):
            full, full_stats = kl.full_kl_forward(x, x, temperature, with_stats=True)
            kl.full_kl_backward(x, x, temperature, full_stats, full, meta(n), meta(n, v, dtype=dtype))

    b, length = POLICY_SHAPE
    tokens = meta(b * length)
    for estimator in range(4):
        kl.kl_penalty_forward(tokens, tokens, estimator=estimator)
        kl.kl_penalty_backward(tokens, tokens, tokens, estimator=estimator, straight_through=estimator == 3)

    rows, mask = meta(b, length), meta(b, length, dtype=U8)
    for sequence, clip_c, estimator, extras in ((False, None, -1, False), (True, 3.0, 3, True), (False, 3.0, 0, True)):
        weights, ref, values = (rows, rows, rows) if extras else (None, None, None)
        stats = policy.policy_forward(
            rows, rows, rows, mask, weights, ref, values, estimator=estimator, clip_low=0.2, clip_high=0.2,
            clip_c=clip_c, sequence=sequence, with_pg=True,
        )  # fmt: skip
        _, _, row_weights = policy.policy_finalize(
            stats, mode=3, dp_size=1, batch_num_tokens=None, global_batch_size=None, norm=float(length), kl_coef=0.1,
            value_coef=-0.1, loss_dtype=torch.float32,
        )  # fmt: skip
        policy.policy_backward(
            rows, rows, rows, mask, weights, ref, stats, row_weights, meta(), estimator=estimator,
            straight_through=False, kl_coef=0.1, value_coef=-0.1, clip_low=0.2, clip_high=0.2, clip_c=clip_c,
            sequence=sequence, with_pg=True, grad_logp=meta(b, length), grad_values=rows if extras else None,
        )  # fmt: skip
    # agg_loss: the values alone, no PG and no KL.
    policy.policy_forward(rows, None, None, mask, None, None, rows, estimator=-1, clip_low=0.0, clip_high=0.0,
                          clip_c=None, sequence=False, with_pg=False)  # fmt: skip
    for mode, count in enumerate((None, 10.0, meta(dtype=F64), None, 2.0)):
        policy.policy_finalize(
            stats, mode=mode, dp_size=2, batch_num_tokens=count, global_batch_size=count, norm=float(length),
            kl_coef=0.0, value_coef=1.0, loss_dtype=torch.float32,
        )  # fmt: skip
    for sequence, truncate in ((False, True), (True, False)):
        _, rc_stats = policy.rollout_correction_forward(
            rows, rows, mask, sequence=sequence, truncate=truncate, clip_min=0.0, clip_max=2.0, low_threshold=0.5
        )
        policy.rollout_finalize(rc_stats, sequence=sequence)
