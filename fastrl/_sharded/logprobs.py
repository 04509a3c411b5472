"""Log-probs and entropy of vocabulary-sharded logits and LM heads (tensor parallelism)
over torch.distributed: the combine math (the ranks' agreement and collectives: fastrl._distributed).

Megatron-style tensor parallelism shards the LM head by vocabulary: rank r of
the group holds logits ``[..., V_r]`` for the global entries ``[start_r, start_r
+ V_r)``. ``logprobs_from_logits`` / ``logprobs_and_entropy`` /
``entropy_from_logits`` / ``policy_loss_from_logits`` / ``full_kl`` take
``group=`` (and, for shards not laid out in rank order, ``vocab_start=``) and
give every rank the unsharded op's per-token result (``full_kl``: fastrl._sharded.kl).

Forward, on a kernel backend (native, Triton): the kernels reduce every row as
segments (fastrl._rows.segment_length: V / 8 when V is a multiple of 64) and
fold their statistics (m, n, t, w, q: kernels/reduce.py, csrc/softmax_stats.h)
in vocabulary order. Each rank gives its shard's segments' statistics
(_ops.logprobs_segments; an even split of such a V over 1, 2, 4 or 8 ranks
holds whole segments) and its label logits; one all-gather (float64: 40 bytes
a segment and 8 a row); then every rank folds the gathered segments in
vocabulary order and finishes the rows with the unsharded forward's own code
(_ops.logprobs_combine): bitwise the unsharded log-probs, entropy, Σπ² and
(M, log S), whatever the tensor-parallel degree, and the same bits on every
rank whatever the collective's algorithm. Another split (uneven, or V not a
multiple of 64) makes each shard one segment: the same math, exact to rounding.

The reference backend combines per-rank numbers instead, per row, with
d = (x - m) / T as in ``reference.scaled_logits``:

    local:  m_r = max x,  L_r = log sum exp((x - m_r) / T),  H_r = the shard's own entropy,
            x_y when the label is local
    gathered, then on every rank, in rank order:
    M = max_r m_r,   l_r = L_r + (m_r - M) / T,   log S = log sum_r exp(l_r),   w_r = exp(l_r - log S)
    logprob = (x_y - M) / T - log S
    entropy = sum_r w_r (H_r + log S - l_r)

(the entropy: H = log S - sum_j p_j d_j and sum_{j in r} p_j d_j = w_r (l_r - H_r);
the form above sums non-negative terms), in float64. A shard whose row is all
-inf (m_r = -inf) adds nothing; NaN anywhere in a row gives NaN, as unsharded.

Backward: none of the math needs another rank. With the global (M, log S) and
entropy the log-prob backward kernel writes the shard's gradient, told that its
columns start at start_r of V (the fused LM head's vocabulary slabs use the same
arguments): no collective.

The fused LM head (``linear_logprobs_and_entropy`` / ``policy_loss_from_hidden``
with ``group=``) takes the head's rows sharded the same way (Megatron's
column-parallel output layer), the hidden states the same on every rank: each
chunk of tokens gives its shard's per-rank numbers (m_r, L_r, H_r, x_y above,
on any backend), gathered and combined once at the end: exact to rounding, not
bitwise across degrees (its logits are made in slabs). Its backward needs one reduction the logits ops do not: dL/dhidden =
sum_r G_r W_r is a sum over the ranks' shards. ``_distributed.sum_in_rank_order`` adds the
ranks' float32 partial sums in rank order (an all-to-all and an all-gather:
an all-reduce's traffic, every rank the same bits).
"""

from __future__ import annotations

import torch

from .. import _ops, _validation, reference
from .._backend import select_backend
from .._distributed import ENTROPY, LABELED, Shard, agree, gather_ranks, label_range, logits_layout
from .._rows import can_overwrite, row_view, segment_length


def local_stats(rows, labels, temps, temp_scalar, shard: Shard, with_entropy, backend, with_sum_pi_squared=False):
    """[N, 4] in the compute dtype: (m_r, L_r, H_r or 0, x_y or NaN) of this
    shard (module docstring); x_y is the raw label logit where the label is local.
    With ``with_sum_pi_squared``, [N, 5]: Q_r = log sum exp(2 (x - m_r) / T) last."""
    acc = reference.compute_dtype(rows)
    outer, inner, _ = rows.shape
    stats = torch.empty(outer * inner, 5 if with_sum_pi_squared else 4, dtype=acc, device=rows.device)
    if backend == "reference":
        x = rows.reshape(outer * inner, rows.shape[-1]).to(acc)
        m = x.amax(dim=-1)
        d = (x - m.unsqueeze(-1)) / (temps.unsqueeze(-1) if temps is not None else temp_scalar)
        # An all -inf row: L = -inf, as the kernels give it (combine_across_ranks tells it from a NaN row so).
        stats[:, 0] = m
        stats[:, 1] = torch.where(torch.isneginf(m), -torch.inf, reference._log_sum_exp_of_scaled(d)[0])
        stats[:, 2] = reference._entropy_of_scaled(d) if with_entropy else 0.0
        if with_sum_pi_squared:
            stats[:, 4] = reference._log_sum_exp_of_scaled(2 * d)[0]
    else:
        _, entropy, local, sum_pi_squared = _ops.logprobs_forward(rows, None, temps, temp_scalar, -100, with_entropy,
                                                                  True, with_sum_pi_squared, backend)  # fmt: skip
        stats[:, :2] = local
        stats[:, 2] = entropy if with_entropy else 0.0
        if with_sum_pi_squared:
            stats[:, 4] = torch.log(sum_pi_squared) + 2 * local[:, 1]  # Σπ²_r s_r² = sum exp(2 (x - m_r) / T)
    stats[:, 3] = label_logits(rows, labels, shard, acc)
    return stats


def combine_across_ranks(local, labels, temps, temp_scalar, ignore_index, shard: Shard):
    """(logprob or None, entropy, (M, log S) [N, 2], sum_pi_squared or None) in the
    compute dtype of ``local`` (this rank's [N, 4] or [N, 5] ``local_stats``), from
    every rank's, gathered and combined in float64 in rank order: the same on every
    rank (module docstring)."""
    acc = local.dtype
    g = gather_ranks(local, shard).double()
    m, big_l, h, label_logit = g[..., :4].unbind(-1)  # each [world, N]
    t = temps.double() if temps is not None else temp_scalar
    top = m.amax(dim=0)
    # A shard whose row is all -inf adds nothing: its kernel gives m = L = -inf (one with NaN among its
    # -inf gives m = -inf, L = NaN: a NaN row, as unsharded).
    empty = torch.isneginf(m) & torch.isneginf(big_l)
    shift = torch.where(empty, 0.0, (m - top) / t)
    l_r = torch.where(empty, -torch.inf, big_l + shift)
    # log S = l_top + log n + log1p(rest / n), n shards at the largest l_r (l_top), rest the others' masses
    # relative to it; then log S - l_r = (l_top - l_r) + (log S - l_top) is never the difference of two close
    # numbers: a peaked row's entropy is about its shard's tiny log S - l_r (reference._log_sum_exp_of_scaled
    # keeps it so within a row).
    l_top = l_r.amax(dim=0)
    at_top = l_r == l_top
    n_top = at_top.sum(dim=0)
    rest = torch.where(at_top | empty, 0.0, torch.exp(l_r - torch.where(torch.isfinite(l_top), l_top, 0.0)))
    above_top = torch.log(n_top) + torch.log1p(rest.sum(dim=0) / n_top)
    log_s = l_top + above_top
    gap = l_top - l_r  # log S - l_r = gap + above_top >= 0
    weight = torch.where(empty, 0.0, torch.exp(-(gap + above_top)))
    entropy = torch.where(empty, 0.0, weight * (h + gap + above_top)).sum(dim=0)
    nan_row = torch.isnan(m).any(dim=0) | torch.isnan(big_l).any(dim=0) | torch.isneginf(top)
    entropy = torch.where(nan_row, torch.nan, entropy)
    log_s = torch.where(nan_row, torch.nan, log_s)
    logprob = None
    if labels is not None:
        keep = labels != ignore_index
        x_y = label_logit.gather(0, label_owner(labels, shard).unsqueeze(0)).squeeze(0)
        logprob = torch.where(keep, (x_y - top) / t - log_s, 0.0).to(acc)
    sum_pi_squared = None
    if local.shape[-1] == 5:
        # sum_j p_j^2 = sum_r exp(Q_r + 2 (m_r - M) / T) / S^2, the ranks' sums moved to M as l_r is
        log_q = torch.logsumexp(torch.where(empty, -torch.inf, g[..., 4] + 2 * shift), dim=0)
        sum_pi_squared = torch.where(nan_row, torch.nan, torch.exp(log_q - 2 * log_s)).to(acc)
    stats = torch.stack([top, log_s], dim=-1).to(acc)
    return logprob, entropy.to(acc), stats, sum_pi_squared


def shard_segments(shard: Shard) -> tuple[int, tuple[int, ...], int]:
    """(this rank's segment length, every rank's segment count, the row length
    whose tile reduces them) of a vocabulary split: the whole row's segments
    (fastrl._rows.segment_length), with the whole row's tile, where every shard
    is whole segments of them (an even split of a multiple of 64 over 1, 2, 4
    or 8 ranks), so that the results are bitwise the unsharded ones; otherwise
    each shard is one segment read with its own row's tile, all its warps on it
    (exact to rounding, not bitwise)."""
    whole = whole_segments(shard)
    if whole is not None:
        return *whole, shard.vocab
    return shard.local, tuple(int(size > 0) for size in shard.sizes), shard.local


def whole_segments(shard: Shard) -> tuple[int, tuple[int, ...]] | None:
    """(the whole row's segment length, every rank's count of them) where every shard is whole
    segments of the row (fastrl._rows.segment_length: an even split of a multiple of 64 over 1, 2,
    4 or 8 ranks), else None."""
    segment = segment_length(shard.vocab)
    if all(start % segment == 0 and size % segment == 0 for start, size in zip(shard.starts, shard.sizes)):
        return segment, tuple(size // segment for size in shard.sizes)
    return None


def in_vocabulary_order(gathered: torch.Tensor, counts, values: int, shard: Shard) -> torch.Tensor:
    """[N, G, values]: every rank's real segments, ``counts[rank]`` of ``values`` numbers each at the
    start of its row of ``gathered`` [world, N, ...] (gather_ranks'), in vocabulary order (a shard
    may hold fewer segments than the widest)."""
    ranks = sorted(range(len(shard.starts)), key=lambda rank: shard.starts[rank])
    in_order = torch.cat([gathered[rank, :, : counts[rank] * values] for rank in ranks], dim=1)
    return in_order.reshape(gathered.shape[1], -1, values).contiguous()


def label_logits(rows, labels, shard: Shard, acc) -> torch.Tensor:
    """[N] in ``acc``: each row's raw label logit where this shard holds the label, NaN elsewhere."""
    outer, inner, _ = rows.shape
    picked = torch.full((outer * inner,), torch.nan, dtype=acc, device=rows.device)
    if labels is not None:
        offset = labels.long() - shard.start
        here = (offset >= 0) & (offset < shard.local)
        token = torch.arange(outer * inner, device=rows.device)
        picked = torch.where(here, rows[token // inner, token % inner, torch.where(here, offset, 0)].to(acc), picked)
    return picked


def label_owner(labels, shard: Shard) -> torch.Tensor:
    """The rank whose shard holds each label (0 for one no shard holds: ignore_index),
    from the shards' bounds as Python ints: a tensor made of them would be a
    host-to-device copy, which a CUDA graph's capture refuses."""
    owner = torch.zeros_like(labels, dtype=torch.long)
    for rank, (start, size) in enumerate(zip(shard.starts, shard.sizes, strict=True)):
        owner = torch.where((labels >= start) & (labels < start + size), rank, owner)
    return owner


def _segments_across_ranks(rows, labels, temps, temp_scalar, ignore_index, with_entropy, with_sum_pi_squared,
                           shard: Shard, backend):  # fmt: skip
    """(logprob or None, entropy, (M, log S) [N, 2], sum_pi_squared or None) of the
    whole rows from this rank's shard ``rows`` [outer, inner, V_r], on a kernel
    backend: each rank's segments' statistics (_ops.logprobs_segments) and label
    logits, in one all-gather (float64, 40 bytes a segment and 8 a row), folded
    in vocabulary order by _ops.logprobs_combine, the unsharded forward's own
    fold and finish: bitwise the unsharded results where shard_segments says so,
    and the same bits on every rank whatever the collective's algorithm."""
    acc = reference.compute_dtype(rows)
    n_rows = rows.shape[0] * rows.shape[1]
    segment, counts, tile_vocab = shard_segments(shard)
    mine = shard.local // segment if segment else 0
    width = max(counts)
    segments = _ops.logprobs_segments(rows, temps, temp_scalar, with_entropy, with_sum_pi_squared, segment,
                                      tile_vocab, backend)  # fmt: skip
    local = torch.zeros(n_rows, width * 5 + 1, dtype=torch.float64, device=rows.device)
    local[:, : mine * 5] = segments.reshape(n_rows, mine * 5)
    local[:, -1] = label_logits(rows, labels, shard, acc).double()
    gathered = gather_ranks(local, shard)  # [world, N, width * 5 + 1]
    x_y = None
    if labels is not None:
        x_y = gathered[:, :, -1].gather(0, label_owner(labels, shard).unsqueeze(0)).squeeze(0).to(acc).contiguous()
    logprob, entropy, stats, sum_pi_squared = _ops.logprobs_combine(
        in_vocabulary_order(gathered, counts, 5, shard), x_y, labels, temps, temp_scalar, ignore_index, with_entropy,
        True, with_sum_pi_squared, shard.vocab, acc, backend,
    )  # fmt: skip
    # (an output not asked for comes back empty: None here, as combine_across_ranks gives it)
    return (logprob if labels is not None else None, entropy if with_entropy else None, stats,
            sum_pi_squared if with_sum_pi_squared else None)  # fmt: skip


class _ShardedLogprobs(torch.autograd.Function):
    """Outputs: logprob [N] (empty without labels), entropy [N] (empty unless asked
    for), sum_pi_squared [N] (empty unless asked for)."""

    @staticmethod
    def forward(ctx, logits, labels, temps, temp_scalar, ignore_index, with_entropy, shard, backend, inplace_backward,
                with_sum_pi_squared):  # fmt: skip
        rows = row_view(logits)
        if backend == "reference":
            local = local_stats(rows, labels, temps, temp_scalar, shard, with_entropy, backend, with_sum_pi_squared)
            logprob, entropy, stats, sum_pi_squared = combine_across_ranks(local, labels, temps, temp_scalar,
                                                                           ignore_index, shard)  # fmt: skip
        else:
            logprob, entropy, stats, sum_pi_squared = _segments_across_ranks(
                rows, labels, temps, temp_scalar, ignore_index, with_entropy, with_sum_pi_squared, shard, backend
            )
        ctx.save_for_backward(logits, labels, temps, stats, entropy if with_entropy else None, sum_pi_squared)
        ctx.temp_scalar, ctx.ignore_index, ctx.shard, ctx.backend = temp_scalar, ignore_index, shard, backend
        ctx.with_entropy = with_entropy
        # (as logprobs._LogprobsEntropy; the reference backend's gradient is always a fresh tensor)
        ctx.inplace_backward = inplace_backward and backend != "reference" and can_overwrite(logits, rows)
        ctx.set_materialize_grads(False)
        empty = logits.new_empty(0, dtype=stats.dtype)
        return ((empty if logprob is None else logprob), (entropy if with_entropy else empty),
                (empty if sum_pi_squared is None else sum_pi_squared))  # fmt: skip

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_sum_pi_squared):
        """This shard's dL/dlogits from the global statistics: no collective."""
        _ops.refuse_double_backward()
        logits, labels, temps, stats, entropy, sum_pi_squared = ctx.saved_tensors
        if labels is None:
            grad_logprob = None
        if not ctx.with_entropy:
            grad_entropy = None
        if sum_pi_squared is None:
            grad_sum_pi_squared = None
        if grad_logprob is None and grad_entropy is None and grad_sum_pi_squared is None:
            return (None,) * 10
        acc = stats.dtype
        grad_logprob = None if grad_logprob is None else grad_logprob.to(acc).contiguous()
        grad_entropy = None if grad_entropy is None else grad_entropy.to(acc).contiguous()
        rows = row_view(logits)
        # (as logprobs._LogprobsEntropy: computed before the kernel may write over the logits)
        extra = None
        if grad_sum_pi_squared is not None:
            extra = sum_pi_squared_grad(rows, temps, ctx.temp_scalar, stats, sum_pi_squared, grad_sum_pi_squared)
        if grad_logprob is None and grad_entropy is None:
            grad = extra.to(rows.dtype)
        elif ctx.backend == "reference":
            grad = _reference_backward(rows.reshape(-1, rows.shape[-1]), labels, temps, ctx.temp_scalar,
                                       ctx.ignore_index, stats, entropy, grad_logprob, grad_entropy, ctx.shard)  # fmt: skip
            if extra is not None:
                grad = (grad.to(acc) + extra.reshape(grad.shape)).to(rows.dtype)
        else:
            grad = rows if ctx.inplace_backward else torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
            _ops.logprobs_backward(
                rows, labels, temps, ctx.temp_scalar, ctx.ignore_index, stats, entropy, grad_logprob, grad_entropy,
                grad, ctx.shard.start, ctx.shard.vocab, ctx.backend,
            )  # fmt: skip
            if extra is not None:
                grad.copy_(grad.to(acc) + extra)
            if ctx.inplace_backward and not torch.compiler.is_compiling():
                torch.autograd.graph.increment_version(rows)  # (as logprobs._LogprobsEntropy)
        return grad.reshape(logits.shape), *(None,) * 9


def logprobs_of_shard(logits, labels, temps, temp_scalar, ignore_index, with_entropy, shard: Shard, backend,
                      inplace_backward=False, with_sum_pi_squared=False):  # fmt: skip
    """(logprob [N] or empty, entropy [N] or empty, sum_pi_squared [N] or empty)
    of this rank's [N, V_r] ``logits`` on checked, agreed arguments;
    differentiable (no collective backward; the gradient written over the logits
    with ``inplace_backward`` where logprobs_from_logits would)."""
    return _ShardedLogprobs.apply(logits, labels, temps, temp_scalar, ignore_index, with_entropy, shard, backend,
                                  inplace_backward, with_sum_pi_squared)  # fmt: skip


def sum_pi_squared_grad(rows, temps, temp_scalar, stats, sum_pi_squared, grad):
    """d(sum_j p_j^2)/dx times the incoming ``grad``, 2 p_j (p_j - Σπ²) / T, for the
    rows ``rows`` ([outer, inner, V] or [N, V]; a shard's columns too: p from the
    rows' global (m, log s) ``stats``), in the stats' dtype, shaped like ``rows``
    (an [N, V] temporary: plain torch). p = 0 (a -inf logit) adds nothing; a row
    whose ``grad`` is 0 gets +0, whatever its logits (csrc/logprobs.cpp's rule)."""
    acc = stats.dtype
    x = rows.reshape(-1, rows.shape[-1]).to(acc)
    t = temps.unsqueeze(-1) if temps is not None else temp_scalar
    p = torch.exp((x - stats[:, :1]) / t - stats[:, 1:])
    g = grad.to(acc).reshape(-1, 1)
    term = (2 * g * p * (p - sum_pi_squared.reshape(-1, 1).to(acc)) / t).masked_fill(g == 0, 0.0)
    return term.reshape(rows.shape)


def _reference_backward(rows, labels, temps, temp_scalar, ignore_index, stats, entropy, grad_logprob, grad_entropy,
                        shard: Shard):  # fmt: skip
    """dL/dx of the shard in plain torch (the reference backend), from the global
    log p = (x - M) / T - log S: d log p_y / dx = (onehot_y - p) / T and
    dH / dx = -p (log p + H) / T; +0 on a row both incoming gradients leave at
    zero, whatever its logits (the kernels' rule, csrc/logprobs.cpp)."""
    acc = stats.dtype
    t = temps.unsqueeze(-1) if temps is not None else temp_scalar
    log_p = (rows.to(acc) - stats[:, :1]) / t - stats[:, 1:]
    p = log_p.exp()
    grad = torch.zeros_like(p)
    quiet = torch.ones(p.shape[0], dtype=torch.bool, device=p.device)
    if grad_logprob is not None and labels is not None:
        keep = torch.where(labels != ignore_index, grad_logprob, 0.0)  # (an ignored token's NaN upstream: 0)
        grad -= keep.unsqueeze(-1) * p
        offset = labels.long() - shard.start
        here = (offset >= 0) & (offset < shard.local) & (labels != ignore_index)
        grad[here, offset[here]] += keep[here]
        quiet &= keep == 0
    if grad_entropy is not None:
        grad -= grad_entropy.unsqueeze(-1) * p * (torch.where(p > 0, log_p, 0.0) + entropy.unsqueeze(-1))
        quiet &= grad_entropy == 0
    return (grad / t).masked_fill(quiet.unsqueeze(-1), 0.0).to(rows.dtype)


def logprobs_and_entropy_sharded(logits, labels, temperature, ignore_index, with_entropy, group, vocab_start,
                                 agree_options, inplace_backward, with_sum_pi_squared=False):  # fmt: skip
    """The sharded form of ``logprobs._run``: (logprob or None, entropy or None,
    sum_pi_squared or None), shaped like ``logits.shape[:-1]``; ``agree_options``:
    the caller's options (a dict) the ranks must agree on too."""
    checked = {}

    def check():
        # (The labels' values: checked against the whole vocabulary by the agreement.)
        temperature_ = _validation.check_logprobs_arguments(logits, labels, temperature, ignore_index, sharded=True)
        checked["temperature"] = temperature_
        return logits_layout(logits, temperature=temperature_, ignore_index=ignore_index,
                             sum_pi_squared=with_sum_pi_squared, **agree_options)  # fmt: skip

    outputs = (LABELED if labels is not None else 0) | (ENTROPY if with_entropy else 0)
    shard = agree(group, check, vocab_start, outputs, label_range(labels, ignore_index),
                  lambda: (labels, checked["temperature"]))
    token_shape = logits.shape[:-1]
    acc = reference.compute_dtype(logits)
    temps, temp_scalar = _ops.split_row_param(_validation.flat_per_row(checked["temperature"], token_shape, acc))
    flat_labels = labels.reshape(-1).contiguous() if labels is not None else None
    backend = select_backend(logits.device)
    if token_shape.numel() == 0:
        backend = "reference"
    logprob, entropy, sum_pi_squared = logprobs_of_shard(logits, flat_labels, temps, temp_scalar, ignore_index,
                                                         with_entropy, shard, backend, inplace_backward,
                                                         with_sum_pi_squared)  # fmt: skip
    reshape = lambda t, wanted: t.view(token_shape) if wanted else None  # noqa: E731
    return reshape(logprob, labels is not None), reshape(entropy, with_entropy), reshape(sum_pi_squared,
                                                                                         with_sum_pi_squared)
