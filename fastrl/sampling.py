"""Temperature / top-k / top-p / min-p sampling that returns the sampled token's
log-probs, and the training-side log-probs of the same processed distribution.

The processed distribution of a row (``fastrl.reference.truncated_log_distribution``
is the spec):
    1. z = logits / T; T == 0 is greedy (the lowest-index argmax, log-prob 0);
    2. top-k keeps the tokens whose logit is >= the k-th largest (ties kept);
    3. top-p keeps a token if the mass strictly above it, under softmax(z)
       renormalised over the top-k set, is < p (tied tokens share their fate);
    4. min-p keeps the tokens with prob >= min_p * max prob;
    5. the kept tokens' softmax(z) is renormalised and sampled.
Off: top_k None or 0, top_p None or 1, min_p None or 0. Every step keeps the
tokens at or above a threshold logit; the kernels find the thresholds by radix /
pivot search, never sorting the vocabulary or writing a [B, V] temporary.

Parameters are checked as the kernels hold them: float32 for bf16 / fp16 / fp32
logits, float64 for float64 logits, int64 for top_k and offset
(``_validation.held_within``). A row with NaN or +inf (softmax of +inf is NaN:
inf - inf), or of only -inf, has nothing to sample: ValueError on CPU, token -1
and NaN log-probs where rows are not rejected (CUDA, torch.compile), on every
backend alike.

Randomness is counter-based (Philox4x32-10): key = the row's seed, counter =
(vocab index, salt, offset), with salt = the row's index for a batch-wide seed
and 0 for per-row seeds, so a row with its own seed draws the same token alone
or in any batch. The same inputs, seeds and offset give bitwise the same tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import _ops, _validation, reference
from ._backend import select_backend
from ._distributed import LABELED, agree, label_range, logits_layout, owned_entries_on_every_rank
from ._rows import row_view
from ._sharded.sampling import sample_sharded, truncated_logprobs_sharded

__all__ = ["SampleOutput", "sample", "truncated_logprobs"]


class SampleOutput(NamedTuple):
    """One draw per row: the token, its log-prob under the processed
    distribution (the PPO "old" log-prob) and under the full softmax(logits / T),
    and the entropy of the processed distribution it was drawn from."""

    tokens: torch.Tensor  # int64 [...]; -1 marks a bad row on CUDA
    logprobs: torch.Tensor  # fp32 [...]
    raw_logprobs: torch.Tensor  # fp32 [...]
    # fp32 [...]: -sum q log q over the kept tokens (after temperature, top-k, top-p
    # and min-p); 0 for a greedy row, NaN for a bad one
    entropy: torch.Tensor


def _truncation(logits, temperature, top_k, top_p, min_p) -> dict:
    """Checked processed-distribution parameters: Python scalars, or flat
    contiguous per-row tensors (accumulation dtype; int64 for top_k). Each value
    is checked as the kernel will hold it (``_validation.held_within``, and for
    the temperature ``_validation.check_temperature``): top_p = 1e-50 is 0 in
    float32, and T = 1e-40 is positive there but its 1/T is not finite."""
    rows, dev = logits.shape[:-1], logits.device
    acc = reference.compute_dtype(logits)
    in_acc = f" in {str(acc).replace('torch.', '')}"
    finfo = torch.finfo(acc)

    def row(value, name, integer, low, high, accepted):
        dtype = torch.int64 if integer else acc
        value = _validation.check_row_param(
            value, name, rows, dev, integer=integer, accepted=accepted if integer else accepted + in_acc,
            ok=lambda v: _validation.held_within(v, dtype, low, high),
        )  # fmt: skip
        return _validation.flat_per_row(value, rows, dtype)

    temperature = _validation.check_temperature(temperature, rows, dev, acc, greedy_ok=True)
    return {
        "temperature": _validation.flat_per_row(temperature, rows, acc),
        "top_k": row(0 if top_k is None else top_k, "top_k", True, 0, _validation.INT64_MAX,
                     "an int in [0, 2**63) (0 is off)"),
        # (finfo.tiny * finfo.eps: the least positive value, a subnormal one)
        "top_p": row(1.0 if top_p is None else top_p, "top_p", False, finfo.tiny * finfo.eps, 1.0,
                     "in (0, 1] (1 is off)"),
        "min_p": row(0.0 if min_p is None else min_p, "min_p", False, 0.0, 1.0, "in [0, 1] (0 is off)"),
    }  # fmt: skip


def _seed_and_offset(seed, offset, rows: torch.Size, device: torch.device):
    """seed: an int64 (Python ints wrap to 64 bits) or a flat int64 tensor of
    per-row seeds; offset: an int in [0, 2**63) or a one-element int64 tensor on
    the device, whose value (as int64) is checked where that needs no host sync."""
    if seed is None and torch.compiler.is_compiling():  # a graph cannot read a drawn number back: per-row seeds
        seed = torch.randint(-(2**63), 2**63 - 1, (math.prod(rows),), dtype=torch.int64, device=device)
    elif seed is None:  # one draw from torch's default (CPU) generator: no device sync
        seed = int(torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64).item())
    if isinstance(seed, torch.Tensor):
        seed = _validation.check_row_param(seed, "seed", rows, device, integer=True)
        seed = _validation.flat_per_row(seed, rows, torch.int64)
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, an int64 tensor of per-row seeds, or None; got {type(seed).__name__}")
    else:
        seed = (seed + 2**63) % 2**64 - 2**63
    if isinstance(offset, torch.Tensor):
        if offset.is_floating_point() or offset.dtype == torch.bool or offset.numel() != 1:
            raise TypeError(f"offset must be an int or a one-element integer tensor; got {offset.dtype} of shape {tuple(offset.shape)}")
        if offset.device != device:
            raise ValueError(f"offset is on {offset.device} but logits is on {device}; they must share a device")
        offset = offset.to(torch.int64).reshape(1).contiguous()
        if _validation.host_checks(device) and int(offset) < 0:
            raise ValueError(f"offset must be in [0, 2**63) as an int64; got a tensor holding {int(offset)}")
    else:
        _validation.check_scalar(offset, "offset", integer=True,
                                 ok=lambda o: _validation.held_within(o, torch.int64, 0, _validation.INT64_MAX),
                                 accepted="an int in [0, 2**63)", also="or a one-element integer tensor")  # fmt: skip
    return seed, offset


def _rejects_bad_rows(device: torch.device) -> bool:
    """Unsampleable rows raise on CPU (outside torch.compile); elsewhere they are
    marked in the output (token -1, NaN) so that no call syncs with the host."""
    return device.type == "cpu" and _validation.host_checks(device)


def _reject_bad_rows(bad: torch.Tensor, rows: torch.Size, message: str | None = None) -> None:
    """A row that is all -inf or has NaN or +inf (or, for per-row tensors without
    host checks, an invalid parameter) cannot be sampled: every backend marks it
    (token -1, NaN log-probs), and on CPU that raises here. ``message``: the error's
    text after the rows, where it is not the sampler's."""
    if bool(bad.any()):
        where = torch.nonzero(bad.reshape(rows)).tolist()[:5]
        if message is not None:
            raise ValueError(f"rows {where}: {message}")
        raise ValueError(f"logits rows {where} are all -inf or contain NaN or +inf: there is nothing to sample from")


def _reference_args(logits: torch.Tensor, params: dict) -> dict:
    """The reference backend's view of the checked parameters: per-row tensors
    back in the row shape."""
    rows = logits.shape[:-1]
    return {k: v.view(rows) if isinstance(v, torch.Tensor) else v for k, v in params.items()}


@_validation.keyword_only_options
def sample(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    seed: int | torch.Tensor | None = None,
    offset: int | torch.Tensor = 0,
    group: object = None,
    vocab_start: int | None = None,
) -> SampleOutput:
    """Draw one token per row of ``logits [..., V]`` from the processed
    distribution (module docstring), returning it with its processed and raw
    log-probs and the processed distribution's entropy (float32; float64 for
    float64 logits), all from the same reads of the row.

    ``temperature``, ``top_k``, ``top_p``, ``min_p``: Python scalars or per-row
    tensors broadcastable to ``logits.shape[:-1]``. ``seed``: an int, an int64
    tensor of per-row seeds, or None (one seed drawn from torch's default
    generator). ``offset``: the decoding step, an int or a one-element tensor
    (device tensors keep the call capturable in a CUDA graph). No host sync on
    CUDA; there a bad row gets token -1 and NaN log-probs, on CPU a ValueError.

    ``group``: a ``torch.distributed`` process group over whose ranks the
    vocabulary is sharded (tensor parallelism): ``logits`` is this rank's
    ``[..., V_r]`` slice, starting at ``vocab_start`` (default: the ranks'
    shards in rank order), and every rank gets the unsharded op's result
    (fastrl._sharded.sampling): the same tokens for the same seed, since the
    Philox counter is the global vocabulary index. Pass the same ``seed`` on
    every rank (a seed drawn from each rank's own generator must agree, or
    the call raises).
    """
    rows = logits.shape[:-1] if isinstance(logits, torch.Tensor) else None
    if group is not None:
        def check():
            _validation.check_logits(logits)
            params = _truncation(logits, temperature, top_k, top_p, min_p)
            return (params, *_seed_and_offset(seed, offset, rows, logits.device))

        out = sample_sharded(logits, check, group, vocab_start)
        if _rejects_bad_rows(logits.device):
            _reject_bad_rows(out[0] < 0, rows)
        return SampleOutput(*(t.view(rows) for t in out))
    _no_vocab_start(vocab_start)
    _validation.check_logits(logits)
    params = _truncation(logits, temperature, top_k, top_p, min_p)
    seed, offset = _seed_and_offset(seed, offset, rows, logits.device)
    backend = select_backend(logits.device)
    _validation.check_sampler_vocab(logits.shape[-1], backend)
    if logits.numel() == 0:
        acc = reference.compute_dtype(logits)
        empty = lambda dt: torch.empty(rows, dtype=dt, device=logits.device)  # noqa: E731
        return SampleOutput(empty(torch.int64), empty(acc), empty(acc), empty(acc))
    if backend == "reference":
        args = _reference_args(logits, {**params, "seed": seed})
        out = reference.sample(logits, **args, offset=offset)
    else:
        out = _ops.sample_forward(
            row_view(logits), *_truncation_args(params), *_ops.split_row_param(seed), *_ops.split_row_param(offset),
            backend,
        )  # fmt: skip
    if _rejects_bad_rows(logits.device):
        _reject_bad_rows(out[0] < 0, rows)
    return SampleOutput(*(t.view(rows) for t in out))


def _no_vocab_start(vocab_start) -> None:
    if vocab_start is not None:
        raise ValueError("vocab_start is for vocabulary-sharded logits: pass the group= they are sharded over")


def _truncation_args(params: dict) -> tuple:
    """The checked truncation parameters as the ops' schemas take them (fastrl._ops)."""
    return tuple(x for name in ("temperature", "top_k", "top_p", "min_p") for x in _ops.split_row_param(params[name]))


# Replaying a kept set (truncated_logprobs(kept=...)): the softmax over exactly
# the tokens the rollout's sampler kept. Their ids are sorted (descending, so the
# -1 padding comes last) and each is taken once; their logits are gathered into
# a row of their own, padded with -inf after the last id to a width that is a
# multiple of _KEPT_ROW_STEP, and the log-prob op (log-probs and gradient) runs
# on that row.
# Its bits are a function of the kept set alone, not of the ids' order, of the
# padding, or of the other rows: the Triton forward tiles every row of a width
# that is a multiple of 2048, up to 65536, alike (2048-element tiles of 128
# lanes in every dtype, kernels/_launch.tile_config), the CPU kernel reads a row
# in 2048-element chunks from its start (csrc/softmax_stats.h), and an -inf
# logit adds exactly nothing to either's sums. Only the gathered values are
# padded ([..., W], W the batch's largest K rounded up): the ids, the masks and
# the sharded path's exchange stay [..., K]. No [..., V] temporary; the gradient
# scatters back into the logits' shape (torch.gather's backward).
_KEPT_ROW_STEP = 2048
KEPT_MAX = 65536


def _kept_support(kept: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [..., K] int64: the kept ids sorted descending, then -1; valid [..., K]:
    the slots holding an id, each id once; bad [...]: rows with an id outside
    [-1, vocab), whose log-probs are NaN) of a checked ``kept`` [..., K]."""
    ids = torch.sort(kept.to(torch.int64), dim=-1, descending=True).values
    bad = (ids[..., 0] >= vocab) | (ids[..., -1] < -1)
    # A repeated id counts once: its repeats become padding, and a second sort moves them
    # after the last id, so that every id keeps the slot it has without repeats (a slot
    # decides the order its term is summed in).
    repeat = torch.zeros_like(ids, dtype=torch.bool)
    repeat[..., 1:] = ids[..., 1:] == ids[..., :-1]
    ids = torch.sort(ids.masked_fill(repeat, -1), dim=-1, descending=True).values
    valid = (ids >= 0) & (ids < vocab)
    return ids, valid, bad


def _kept_logprobs(values: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor, bad: torch.Tensor,
                   labels: torch.Tensor, temperature) -> torch.Tensor:
    """The log-prob of ``labels`` under softmax(values / T) over the ``valid`` slots (values
    [..., K]: the kept tokens' logits, ``_kept_support``'s order); -inf for a label not among
    them, NaN for a ``bad`` row. Differentiable w.r.t. ``values``."""
    from .logprobs import logprobs_from_logits

    width = max(_KEPT_ROW_STEP, -(-values.shape[-1] // _KEPT_ROW_STEP) * _KEPT_ROW_STEP)
    values = torch.where(valid, values, float("-inf"))
    values = torch.nn.functional.pad(values, (0, width - values.shape[-1]), value=float("-inf"))
    hit = valid & (ids == labels.unsqueeze(-1).to(torch.int64))
    found = hit.any(-1)
    # The label's slot (argmax: the first holding it), or slot 0 for a label not kept: its
    # log-prob is NaN exactly when the row has nothing to renormalise (NaN or +inf kept, or
    # every kept logit -inf, or no id), which must show whether or not the label is kept;
    # the where() below gives that row's kernel a zero incoming gradient.
    slot = torch.where(found, hit.to(torch.int8).argmax(-1), 0)
    out = logprobs_from_logits(values, slot, temperature=temperature)
    out = torch.where(found | out.isnan(), out, float("-inf"))
    return torch.where(bad, float("nan"), out)


def _check_kept(kept: object, logits: torch.Tensor, top_k, top_p, min_p) -> torch.Tensor:
    """``kept``: an integer [..., K] tensor of the logits' rows (K in [1, KEPT_MAX]) on
    their device, holding token ids in [0, V) or -1 (padding; on CPU and under
    FASTRL_CHECKS=1, checked there), with no top_k / top_p / min_p beside it."""
    if any(x is not None for x in (top_k, top_p, min_p)):
        raise ValueError("kept replaces top_k, top_p and min_p (the kept set is the truncation): pass one or the other")
    if not isinstance(kept, torch.Tensor):
        raise TypeError(f"kept must be a torch.Tensor of token ids; got {type(kept).__name__}")
    if kept.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"kept must have an integer dtype (int64, int32); got {kept.dtype}")
    rows = tuple(logits.shape[:-1])
    if kept.dim() != len(rows) + 1 or tuple(kept.shape[:-1]) != rows:
        raise ValueError(f"kept must have shape logits.shape[:-1] + (K,) = {rows + ('K',)}; got {tuple(kept.shape)}")
    if not 1 <= kept.shape[-1] <= KEPT_MAX:
        raise ValueError(f"kept must hold between 1 and {KEPT_MAX} ids a row (K); got K = {kept.shape[-1]}")
    if kept.device != logits.device:
        raise ValueError(f"kept is on {kept.device} but logits is on {logits.device}; they must share a device")
    return kept


def _check_kept_values(kept: torch.Tensor, vocab: int) -> None:
    """The ids' values, where checks read tensors (``_validation.host_checks``): in [0, vocab) or -1."""
    if kept.numel() and _validation.host_checks(kept.device):
        bad = (kept < -1) | (kept >= vocab)
        if bool(bad.any()):
            raise ValueError(f"kept ids must lie in [0, {vocab}) or be -1 (padding); found "
                             f"{kept[bad].flatten()[0].item()} ({int(bad.sum())} such ids)")  # fmt: skip


class _TruncatedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, truncation, backend):
        out, stats = _ops.truncated_forward(row_view(logits), labels, *truncation, True, backend)
        # The truncation arguments alternate (per-row tensor or None, scalar). The
        # logits themselves are saved, not the row view made here, so that torch's
        # version check reports a later in-place write to them in its usual words.
        ctx.save_for_backward(logits, labels, stats, *truncation[0::2])
        ctx.scalars, ctx.backend, ctx.logits_shape = truncation[1::2], backend, logits.shape
        return out

    @staticmethod
    def backward(ctx, grad_out):
        _ops.refuse_double_backward()
        logits, labels, stats, *tensors = ctx.saved_tensors
        rows = row_view(logits)
        truncation = [x for pair in zip(tensors, ctx.scalars) for x in pair]
        grad_rows = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        _ops.truncated_backward(
            rows, labels, stats, grad_out.to(stats.dtype).contiguous(), grad_rows, *truncation, 0, None, ctx.backend
        )
        return grad_rows.reshape(ctx.logits_shape), None, None, None


@_validation.keyword_only_options
def truncated_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
    group: object = None,
    vocab_start: int | None = None,
) -> torch.Tensor:
    """Log-prob of ``labels`` under the processed distribution that
    :func:`sample` draws from (the same kept set on the same logits, so trainer
    and rollout agree exactly); -inf for a label outside the kept set.

    ``kept``: the kept set itself, replayed instead of found: an integer
    ``[..., K]`` tensor (K <= 65536) of the token ids each row's sampler kept
    (another engine's, e.g. vLLM's top-k / top-p), padded with -1; a repeated
    id counts once. The log-prob is then softmax(logits / T) renormalised over
    exactly those tokens (T > 0; no top_k / top_p / min_p beside it), and its
    bits depend on the set alone: not on the ids' order, the padding, or the
    other rows. A row whose kept logits are all -inf or hold NaN or +inf (or
    that keeps no id) is NaN, a ValueError on CPU; ids outside [0, V) raise on
    CPU (and under FASTRL_CHECKS=1) and give NaN elsewhere.

    Differentiable w.r.t. ``logits`` with the kept set held fixed:
    d/dlogit_j = (1/T) ([j == label] - q_j) over the kept tokens (zero for a
    label outside the kept set and for greedy rows). Float32 output (float64 for
    float64 logits).

    ``group`` / ``vocab_start``: vocabulary-sharded logits, as :func:`sample`;
    ``labels`` (and ``kept``) are then global ids. The backward needs no
    collective; with ``kept`` every rank gets bitwise the unsharded result."""
    if kept is not None:
        return _replay_kept(logits, labels, kept, temperature, top_k, top_p, min_p, group, vocab_start)
    if group is not None:
        def check():
            _validation.check_logits(logits)
            # (The labels' values: checked against the whole vocabulary by the agreement.)
            _validation.check_token_labels(labels, logits.shape[:-1], None, logits.device, ignore_index=None)
            return _truncation(logits, temperature, top_k, top_p, min_p)

        out = truncated_logprobs_sharded(logits, labels, check, group, vocab_start)
        if _rejects_bad_rows(logits.device):
            _reject_bad_rows(out.isnan(), logits.shape[:-1])
        return out.view(logits.shape[:-1])
    _no_vocab_start(vocab_start)
    _validation.check_logits(logits)
    _validation.check_labels(labels, logits, ignore_index=None)
    params = _truncation(logits, temperature, top_k, top_p, min_p)
    rows = logits.shape[:-1]
    backend = select_backend(logits.device)
    _validation.check_sampler_vocab(logits.shape[-1], backend)
    if backend == "reference" or logits.numel() == 0:
        out = reference.truncated_logprobs(logits, labels, **_reference_args(logits, params))
    elif torch.is_grad_enabled() and logits.requires_grad:
        out = _TruncatedLogprobs.apply(logits, labels.reshape(-1).contiguous(), _truncation_args(params), backend)
    else:
        out, _ = _ops.truncated_forward(
            row_view(logits), labels.reshape(-1).contiguous(), *_truncation_args(params), False, backend
        )
    if _rejects_bad_rows(logits.device):
        _reject_bad_rows(out.isnan(), rows)
    return out.view(rows)


def _replay_kept(logits, labels, kept, temperature, top_k, top_p, min_p, group, vocab_start) -> torch.Tensor:
    """truncated_logprobs(kept=...): the log-prob of each label under softmax(logits / T) over
    its row's kept ids (the helpers above), unsharded or, with ``group``, sharded: each rank
    gathers the kept logits its shard holds, and one exact sum over the ranks (every id is one
    rank's) gives every rank the unsharded gathered row, so the unsharded bits."""
    rows = logits.shape[:-1] if isinstance(logits, torch.Tensor) else None

    def check():
        _validation.check_logits(logits)
        _check_kept(kept, logits, top_k, top_p, min_p)
        return _validation.check_temperature(temperature, rows, logits.device, reference.compute_dtype(logits))

    def rejecting_bad_rows(out):
        if _rejects_bad_rows(logits.device):
            _reject_bad_rows(out.isnan(), rows, "the logits of the kept ids are all -inf (or the row keeps no id) or "
                                                "contain NaN or +inf: there is no distribution to renormalise")  # fmt: skip
        return out

    if group is None:
        _no_vocab_start(vocab_start)
        temperature = check()
        _validation.check_labels(labels, logits, ignore_index=None)
        _check_kept_values(kept, logits.shape[-1])
        if select_backend(logits.device) == "reference":
            return rejecting_bad_rows(reference.truncated_logprobs(logits, labels, temperature=temperature, kept=kept))
        ids, valid, bad = _kept_support(kept, logits.shape[-1])
        values = logits.gather(-1, ids.clamp(0, logits.shape[-1] - 1))
    else:
        checked = {}

        def layout():
            checked["temperature"] = check()
            _validation.check_token_labels(labels, rows, None, logits.device, ignore_index=None)
            return logits_layout(logits, temperature=checked["temperature"], kept=kept.shape[-1])

        shard = agree(group, layout, vocab_start, LABELED, label_range(labels, None),
                      lambda: (labels, kept, checked["temperature"]))  # fmt: skip
        temperature = checked["temperature"]
        _check_kept_values(kept, shard.vocab)  # (the ranks agreed on kept: all raise alike)
        ids, valid, bad = _kept_support(kept, shard.vocab)
        local = ids - shard.start
        owned = valid & (local >= 0) & (local < shard.local)
        part = torch.where(owned, logits.gather(-1, local.clamp(0, shard.local - 1)), 0.0)
        values = owned_entries_on_every_rank(part, group)
    return rejecting_bad_rows(_kept_logprobs(values, ids, valid, bad, labels, temperature))
