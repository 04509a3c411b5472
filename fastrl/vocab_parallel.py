"""Log-probs, entropy and the full KL of vocabulary-sharded logits and LM heads (tensor
parallelism) over torch.distributed.

Megatron-style tensor parallelism shards the LM head by vocabulary: rank r of
the group holds logits ``[..., V_r]`` for the global entries ``[start_r, start_r
+ V_r)``. ``logprobs_from_logits`` / ``logprobs_and_entropy`` /
``entropy_from_logits`` / ``policy_loss_from_logits`` / ``full_kl`` take
``group=`` (and, for shards not laid out in rank order, ``vocab_start=``) and
give every rank the unsharded op's per-token result (``full_kl``: _combine_kl).

Forward, per row, with d = (x - m) / T as in ``reference.scaled_logits``:

    local (the existing kernel on the shard):  m_r = max x,  L_r = log sum exp((x - m_r) / T),
                                               H_r = the shard's own entropy,  x_y when the label is local
    one all-gather of those 4 numbers (16 bytes a row in float32), then on every rank, in rank order:
    M = max_r m_r,   l_r = L_r + (m_r - M) / T,   log S = log sum_r exp(l_r),   w_r = exp(l_r - log S)
    logprob = (x_y - M) / T - log S
    entropy = sum_r w_r (H_r + log S - l_r)

(the entropy: H = log S - sum_j p_j d_j and sum_{j in r} p_j d_j = w_r (l_r - H_r);
the form above sums non-negative terms). The combination runs in float64 on the
gathered numbers, the same on every rank, so every rank gets the same bits
whatever the collective's algorithm. A shard whose row is all -inf (m_r = -inf)
adds nothing; NaN anywhere in a row gives NaN, as unsharded.

Backward: none of the math needs another rank. With the global (M, log S) and
entropy the log-prob backward kernel writes the shard's gradient, told that its
columns start at start_r of V (the fused LM head's vocabulary slabs use the same
arguments): no collective.

The fused LM head (``linear_logprobs_and_entropy`` / ``policy_loss_from_hidden``
with ``group=``) takes the head's rows sharded the same way (Megatron's
column-parallel output layer), the hidden states the same on every rank: each
chunk of tokens gives its shard's four numbers as above, gathered once at the
end. Its backward needs one reduction the logits ops do not: dL/dhidden =
sum_r G_r W_r is a sum over the ranks' shards. ``sum_in_rank_order`` adds the
ranks' float32 partial sums in rank order (an all-to-all and an all-gather:
an all-reduce's traffic, every rank the same bits).

Before the kernels one small all-gather agrees the call across the group: row
counts (the hidden size too for the LM head), shard sizes and starts, dtype,
which outputs, the scalar options (temperature, ignore_index, softcap, ...),
each rank's label range, and whether each rank's arguments passed their
checks, so a bad argument on one rank raises on every rank (a ValueError
naming the rank) instead of leaving the others waiting in a collective.
Per-token temperature tensors are not compared (that would move them).
"""

from __future__ import annotations

import dataclasses

import torch

from . import _ops, _validation, reference
from ._backend import select_backend
from .kl import full_kl_gradient
from .logprobs import can_overwrite, check_arguments, row_view

__all__ = ["full_kl_sharded", "logprobs_and_entropy_sharded"]

# The agreement's fields, one int64 each per rank.
_FIELDS = ("error", "shape", "vocab", "start", "dtype", "outputs", "options", "label_min", "label_max")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
# The agreement's "outputs" code: bits of what the call computes.
LABELED, ENTROPY, FULL_KL = 1, 2, 4


@dataclasses.dataclass(frozen=True)
class Shard:
    """This rank's place in the vocabulary: its columns are [start, start +
    local) of ``vocab`` entries."""

    group: object
    start: int
    local: int
    vocab: int
    starts: tuple[int, ...]  # every rank's start, in rank order
    sizes: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the ranks of a call must agree on, from this rank's checked
    arguments: ``shape`` (what ``shape_name`` says), this shard's ``vocab``
    entries, the dtype, and the call's scalar ``options`` by name (numbers,
    None, or a tensor, whose values are not compared)."""

    shape: tuple[int, ...]
    vocab: int
    dtype: torch.dtype
    device: torch.device
    options: dict = dataclasses.field(default_factory=dict)
    shape_name: str = "token shapes"

    def options_key(self) -> int:
        """The options as one int64, the same in every process: a 64-bit
        BLAKE2 digest of their exact text (floats in hex, so no two values
        share it as they may share Python's hash: hash(-1.0) == hash(-2.0));
        tensors by a code, their values not compared."""
        import hashlib

        def exact(value) -> str:
            if isinstance(value, torch.Tensor):
                return "<tensor>"
            if isinstance(value, float):
                return value.hex()
            return repr(value)

        text = ";".join(f"{name}={exact(value)}" for name, value in self.options.items())
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)

    def options_text(self) -> str:
        shown = lambda v: "a per-token tensor" if isinstance(v, torch.Tensor) else repr(v)  # noqa: E731
        return ", ".join(f"{name}={shown(v)}" for name, v in self.options.items())


def _check_group(group: object) -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group= needs torch.distributed initialised (init_process_group)")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None; got {type(group).__name__}")
    if dist.get_rank(group) < 0:
        raise ValueError("group does not contain this rank")
    return dist.get_world_size(group)


def label_range(labels: torch.Tensor | None, ignore_index: int):
    """For ``agree``: a callable giving (min, max) of the labels that are not
    ignored as an int64 [2] tensor on their device (0 in place of ignored ones),
    or None without labels."""

    def on_device():
        if labels is None:
            return None
        if labels.numel() == 0:
            return torch.zeros(2, dtype=torch.int64, device=labels.device)
        return torch.stack(torch.aminmax(labels.masked_fill(labels == ignore_index, 0).long()))

    return on_device


def agree(group, check, vocab_start: object, outputs: int, labels=lambda: None) -> Shard:
    """Runs ``check()`` (this rank's argument checks, returning its
    :class:`Layout`), then the one all-gather that agrees the call across
    ``group``; raises on every rank alike when any rank's checks failed or the
    ranks disagree. ``outputs``: a code of what the caller computes;
    ``labels()``: ``label_range``'s callable, whose range is checked against
    the whole vocabulary."""
    import torch.distributed as dist

    world = _check_group(group)
    rank = dist.get_rank(group)
    error: Exception | None = None
    layout: Layout | None = None
    try:
        layout = check()
        if vocab_start is not None and (isinstance(vocab_start, bool) or not isinstance(vocab_start, int)):
            raise TypeError(f"vocab_start must be an int or None; got {type(vocab_start).__name__}")
        if vocab_start is not None and not 0 <= vocab_start < 2**62:
            raise ValueError(f"vocab_start must be in [0, 2**62); got {vocab_start}")
    except Exception as exc:  # noqa: BLE001 - any failure here must reach the other ranks, then is raised as it was
        error = exc
    mine = dict.fromkeys(_FIELDS, 0)
    device = torch.device("cpu")
    if error is None:
        device = layout.device
        # The shape as one number (a tuple of ints hashes the same in every process).
        mine.update(shape=hash(layout.shape), vocab=layout.vocab, start=-1 if vocab_start is None else vocab_start,
                    dtype=_DTYPES[layout.dtype], outputs=outputs, options=layout.options_key())  # fmt: skip
    else:
        mine["error"] = 1
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    local = torch.tensor([mine[f] for f in _FIELDS], dtype=torch.int64, device=device)
    label_min_max = labels() if error is None else None
    if label_min_max is not None:  # written on the device: the gathered table below is the call's one host sync
        local[_FIELDS.index("label_min") :] = label_min_max.to(device)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    table = [dict(zip(_FIELDS, row, strict=True)) for row in torch.stack(gathered).tolist()]
    if error is not None:
        raise error
    failed = [r for r, t in enumerate(table) if t["error"]]
    if failed:
        raise ValueError(f"rank(s) {failed} of the group rejected their arguments (see their errors)")
    disagreements = (("shape", layout.shape_name, layout.shape), ("dtype", "dtypes", layout.dtype),
                     ("outputs", "requested outputs", outputs), ("options", "options", layout.options_text()))  # fmt: skip
    for field, what, mine_now in disagreements:
        if len({t[field] for t in table}) > 1:
            raise ValueError(f"the ranks of the group disagree on their {what} (this rank, {rank}: {mine_now})")
    sizes = tuple(t["vocab"] for t in table)
    given = [t["start"] >= 0 for t in table]
    if any(given) and not all(given):
        raise ValueError("vocab_start must be given on every rank of the group or on none")
    if all(given):
        starts = tuple(t["start"] for t in table)
        covered = 0
        for start, size in sorted(zip(starts, sizes, strict=True)):
            if start != covered:
                raise ValueError(
                    f"the shards (vocab_start, size) {list(zip(starts, sizes, strict=True))} in rank order do "
                    f"not tile the vocabulary: entry {covered} is {'covered twice' if start < covered else 'missing'}"
                )
            covered += size
    else:
        starts = tuple(sum(sizes[:r]) for r in range(world))
    vocab = sum(sizes)
    for r, t in enumerate(table):
        if outputs & LABELED and (t["label_min"] < 0 or t["label_max"] >= vocab):
            bad = t["label_min"] if t["label_min"] < 0 else t["label_max"]
            raise ValueError(f"labels must lie in [0, {vocab}) (the sharded vocabulary) or equal ignore_index; "
                             f"rank {r} has {bad}")  # fmt: skip
    return Shard(group, starts[rank], sizes[rank], vocab, starts, sizes)


def logits_layout(logits: torch.Tensor, **options) -> Layout:
    """The Layout of a logits op: token shape, shard size, dtype, options."""
    return Layout(tuple(logits.shape[:-1]), logits.shape[-1], logits.dtype, logits.device, options)


def local_stats(rows, labels, temps, temp_scalar, shard: Shard, with_entropy, backend):
    """[N, 4] in the compute dtype: (m_r, L_r, H_r or 0, x_y or NaN) of this
    shard (module docstring); x_y is the raw label logit where the label is local."""
    acc = reference.compute_dtype(rows)
    outer, inner, _ = rows.shape
    stats = torch.empty(outer * inner, 4, dtype=acc, device=rows.device)
    if backend == "reference":
        x = rows.reshape(outer * inner, rows.shape[-1]).to(acc)
        m = x.amax(dim=-1)
        d = (x - m.unsqueeze(-1)) / (temps.unsqueeze(-1) if temps is not None else temp_scalar)
        # An all -inf row: L = -inf, as the kernels give it (combine_across_ranks tells it from a NaN row so).
        stats[:, 0] = m
        stats[:, 1] = torch.where(torch.isneginf(m), -torch.inf, reference._log_sum_exp_of_scaled(d)[0])
        stats[:, 2] = reference._entropy_of_scaled(d) if with_entropy else 0.0
    else:
        _, entropy, local = _ops.logprobs_forward(rows, None, temps, temp_scalar, -100, with_entropy, True, backend)
        stats[:, :2] = local
        stats[:, 2] = entropy if with_entropy else 0.0
    stats[:, 3] = torch.nan
    if labels is not None:
        offset = labels.long() - shard.start
        here = (offset >= 0) & (offset < shard.local)
        token = torch.arange(outer * inner, device=rows.device)
        picked = rows[token // inner, token % inner, torch.where(here, offset, 0)].to(acc)
        stats[:, 3] = torch.where(here, picked, stats[:, 3])
    return stats


def _all_gather(local: torch.Tensor, shard: Shard) -> torch.Tensor:
    """[world, ...]: every rank's ``local``, in rank order."""
    import torch.distributed as dist

    gathered = [torch.empty_like(local) for _ in shard.starts]
    dist.all_gather(gathered, local, group=shard.group)
    return torch.stack(gathered)


def sum_in_rank_order(partial: torch.Tensor, group) -> torch.Tensor:
    """sum_r partial_r over the ranks of ``group`` ([N, ...] on each), added in
    rank order, so every rank gets the same bits whatever the collectives'
    algorithms. An all-reduce's traffic (each rank sends and receives
    2 (world - 1) / world of the tensor) in two steps: an all-to-all gives rank
    r block r of the rows from every rank, which it sums in rank order; an
    all-gather returns the summed blocks to every rank. Memory: two more
    tensors of ``partial``'s size (what the all-to-all receives, the result),
    and a padded copy of ``partial`` when world does not divide its rows."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1 or partial.numel() == 0:
        return partial
    rows = partial.shape[0]
    block = -(-rows // world)
    padded = partial.new_zeros((block * world, *partial.shape[1:])) if rows % world else partial.contiguous()
    if rows % world:
        padded[:rows] = partial
    received = torch.empty_like(padded)
    dist.all_to_all_single(received, padded, group=group)
    received = received.view(world, block, *partial.shape[1:])
    total = received[0].clone()
    for r in range(1, world):
        total += received[r]
    del received
    out = torch.empty_like(padded)
    dist.all_gather(list(out.view(world, block, *partial.shape[1:]).unbind(0)), total, group=group)
    return out[:rows]


class _GradientSummedOverRanks(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the group's ranks
    (sum_in_rank_order): what a tensor-parallel layer's replicated input needs
    (Megatron's copy to the tensor-parallel region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return sum_in_rank_order(grad, ctx.group), None


def summed_gradient_over_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """``x``, whose gradient is summed over the ranks of ``group``."""
    return _GradientSummedOverRanks.apply(x, group)


def combine_across_ranks(local, labels, temps, temp_scalar, ignore_index, shard: Shard):
    """(logprob or None, entropy, (M, log S) [N, 2]) in the compute dtype of
    ``local`` (this rank's [N, 4] ``local_stats``), from every rank's, gathered
    and combined in float64 in rank order: the same on every rank (module
    docstring)."""
    acc = local.dtype
    g = _all_gather(local, shard).double()
    m, big_l, h, label_logit = g.unbind(-1)  # each [world, N]
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
        starts = torch.tensor(shard.starts, device=labels.device)
        sizes = torch.tensor(shard.sizes, device=labels.device)
        owner = (labels.long().unsqueeze(0) >= starts.unsqueeze(1)) & (
            labels.long().unsqueeze(0) < (starts + sizes).unsqueeze(1)
        )
        owner = owner.long().argmax(dim=0)
        x_y = label_logit.gather(0, owner.unsqueeze(0)).squeeze(0)
        logprob = torch.where(keep, (x_y - top) / t - log_s, 0.0).to(acc)
    stats = torch.stack([top, log_s], dim=-1).to(acc)
    return logprob, entropy.to(acc), stats


class _ShardedLogprobs(torch.autograd.Function):
    """Outputs: logprob [N] (empty without labels), entropy [N] (empty unless asked for)."""

    @staticmethod
    def forward(ctx, logits, labels, temps, temp_scalar, ignore_index, with_entropy, shard, backend, inplace_backward):
        rows = row_view(logits)
        local = local_stats(rows, labels, temps, temp_scalar, shard, with_entropy, backend)
        logprob, entropy, stats = combine_across_ranks(local, labels, temps, temp_scalar, ignore_index, shard)
        ctx.save_for_backward(logits, labels, temps, stats, entropy if with_entropy else None)
        ctx.temp_scalar, ctx.ignore_index, ctx.shard, ctx.backend = temp_scalar, ignore_index, shard, backend
        ctx.with_entropy = with_entropy
        # (as logprobs._LogprobsEntropy; the reference backend's gradient is always a fresh tensor)
        ctx.inplace_backward = inplace_backward and backend != "reference" and can_overwrite(logits, rows)
        ctx.set_materialize_grads(False)
        empty = logits.new_empty(0, dtype=stats.dtype)
        return (empty if logprob is None else logprob), (entropy if with_entropy else empty)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        """This shard's dL/dlogits from the global statistics: no collective."""
        _ops.refuse_double_backward()
        logits, labels, temps, stats, entropy = ctx.saved_tensors
        if labels is None:
            grad_logprob = None
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logprob is None and grad_entropy is None:
            return (None,) * 9
        acc = stats.dtype
        grad_logprob = None if grad_logprob is None else grad_logprob.to(acc).contiguous()
        grad_entropy = None if grad_entropy is None else grad_entropy.to(acc).contiguous()
        rows = row_view(logits)
        if ctx.backend == "reference":
            grad = _reference_backward(rows.reshape(-1, rows.shape[-1]), labels, temps, ctx.temp_scalar,
                                       ctx.ignore_index, stats, entropy, grad_logprob, grad_entropy, ctx.shard)  # fmt: skip
        else:
            grad = rows if ctx.inplace_backward else torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
            _ops.logprobs_backward(
                rows, labels, temps, ctx.temp_scalar, ctx.ignore_index, stats, entropy, grad_logprob, grad_entropy,
                grad, ctx.shard.start, ctx.shard.vocab, ctx.backend,
            )  # fmt: skip
            if ctx.inplace_backward and not torch.compiler.is_compiling():
                torch.autograd.graph.increment_version(rows)  # (as logprobs._LogprobsEntropy)
        return grad.reshape(logits.shape), *(None,) * 8


def logprobs_of_shard(logits, labels, temps, temp_scalar, ignore_index, with_entropy, shard: Shard, backend,
                      inplace_backward=False):  # fmt: skip
    """(logprob [N] or empty, entropy [N] or empty) of this rank's [N, V_r]
    ``logits`` on checked, agreed arguments; differentiable (no collective
    backward; the gradient written over the logits with ``inplace_backward``
    where logprobs_from_logits would)."""
    return _ShardedLogprobs.apply(logits, labels, temps, temp_scalar, ignore_index, with_entropy, shard, backend,
                                  inplace_backward)  # fmt: skip


def _reference_backward(rows, labels, temps, temp_scalar, ignore_index, stats, entropy, grad_logprob, grad_entropy,
                        shard: Shard):  # fmt: skip
    """dL/dx of the shard in plain torch (the reference backend), from the global
    log p = (x - M) / T - log S: d log p_y / dx = (onehot_y - p) / T and
    dH / dx = -p (log p + H) / T."""
    acc = stats.dtype
    t = temps.unsqueeze(-1) if temps is not None else temp_scalar
    log_p = (rows.to(acc) - stats[:, :1]) / t - stats[:, 1:]
    p = log_p.exp()
    grad = torch.zeros_like(p)
    if grad_logprob is not None and labels is not None:
        keep = torch.where(labels != ignore_index, grad_logprob, 0.0)  # (an ignored token's NaN upstream: 0)
        grad -= keep.unsqueeze(-1) * p
        offset = labels.long() - shard.start
        here = (offset >= 0) & (offset < shard.local) & (labels != ignore_index)
        grad[here, offset[here]] += keep[here]
    if grad_entropy is not None:
        grad -= grad_entropy.unsqueeze(-1) * p * (torch.where(p > 0, log_p, 0.0) + entropy.unsqueeze(-1))
    return (grad / t).to(rows.dtype)


def logprobs_and_entropy_sharded(logits, labels, temperature, ignore_index, with_entropy, group, vocab_start,
                                 agree_options, inplace_backward):  # fmt: skip
    """The sharded form of ``logprobs._run``: (logprob or None, entropy or None),
    shaped like ``logits.shape[:-1]``; ``agree_options``: the caller's options
    (a dict) the ranks must agree on too."""
    checked = {}

    def check():
        # Labels only >= 0 here: their range is checked against the whole vocabulary once the ranks have agreed.
        temperature_ = check_arguments(logits, labels, temperature, ignore_index, torch.iinfo(torch.int64).max)
        checked["temperature"] = temperature_
        return logits_layout(logits, temperature=temperature_, ignore_index=ignore_index, **agree_options)

    outputs = (LABELED if labels is not None else 0) | (ENTROPY if with_entropy else 0)
    shard = agree(group, check, vocab_start, outputs, label_range(labels, ignore_index))
    token_shape = logits.shape[:-1]
    acc = reference.compute_dtype(logits)
    temps, temp_scalar = _ops.split_row_param(_validation.flat_per_row(checked["temperature"], token_shape, acc))
    flat_labels = labels.reshape(-1).contiguous() if labels is not None else None
    backend = select_backend(logits.device)
    if token_shape.numel() == 0:
        backend = "reference"
    logprob, entropy = logprobs_of_shard(logits, flat_labels, temps, temp_scalar, ignore_index, with_entropy, shard,
                                         backend, inplace_backward)  # fmt: skip
    reshape = lambda t: t.view(token_shape)  # noqa: E731
    return (reshape(logprob) if labels is not None else None), (reshape(entropy) if with_entropy else None)


def _combine_kl(gathered, temps, temp_scalar, acc):
    """(KL [N], (M, log S, M', log S') [N, 4]) from the ranks' [world, N, 5]
    (m, log s, m', log s', KL_r), in float64, the same on every rank. With w_r
    and w'_r the shard masses under p and p_ref (module docstring's l_r - log S),
    the chain rule of the KL: KL = sum_r w_r KL_r + sum_r w_r log(w_r / w'_r)."""
    g = gathered.double()
    m, log_s, m_ref, log_s_ref, kl_r = g.unbind(-1)
    t = temps.double() if temps is not None else temp_scalar
    top, top_ref = m.amax(dim=0), m_ref.amax(dim=0)
    empty = torch.isneginf(m) & torch.isneginf(log_s)  # (as in combine_across_ranks)
    empty_ref = torch.isneginf(m_ref) & torch.isneginf(log_s_ref)
    mass = torch.where(empty, -torch.inf, log_s + torch.where(empty, 0.0, (m - top) / t))
    mass_ref = torch.where(empty_ref, -torch.inf, log_s_ref + torch.where(empty_ref, 0.0, (m_ref - top_ref) / t))
    total, total_ref = torch.logsumexp(mass, dim=0), torch.logsumexp(mass_ref, dim=0)
    log_w, log_w_ref = mass - total, mass_ref - total_ref
    term = torch.exp(log_w) * (kl_r + log_w - log_w_ref)
    term = torch.where(empty, 0.0, torch.where(empty_ref, torch.inf, term))  # p > 0 where p_ref = 0: +inf
    kl = term.sum(dim=0)
    nan_row = (
        torch.isnan(m).any(dim=0) | torch.isnan(m_ref).any(dim=0) | torch.isneginf(top) | torch.isneginf(top_ref)
        | torch.isnan(log_s).any(dim=0) | torch.isnan(log_s_ref).any(dim=0)
    )  # fmt: skip
    kl = torch.where(nan_row, torch.nan, kl)
    stats = torch.stack([top, torch.where(nan_row, torch.nan, total), top_ref, total_ref], dim=-1)
    return kl.to(acc), stats.to(acc)


class _ShardedFullKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ref_rows, temps, temp_scalar, shard, backend):
        rows = row_view(logits)
        acc = reference.compute_dtype(logits)
        n_rows = rows.shape[0] * rows.shape[1]
        local = torch.empty(n_rows, 5, dtype=acc, device=rows.device)
        if backend == "reference":
            x, y = rows.reshape(n_rows, rows.shape[-1]).to(acc), ref_rows.reshape(n_rows, rows.shape[-1]).to(acc)
            t = temps.unsqueeze(-1) if temps is not None else temp_scalar
            for column, z in ((0, x), (2, y)):
                top = z.amax(dim=-1)
                lse = torch.logsumexp((z - top.unsqueeze(-1)) / t, dim=-1)
                local[:, column], local[:, column + 1] = top, torch.where(torch.isneginf(top), -torch.inf, lse)
            local[:, 4] = reference.full_kl(x, y, temperature=temps if temps is not None else temp_scalar)
        else:
            kl_r, stats_r = _ops.full_kl_forward(rows, ref_rows, temps, temp_scalar, True, backend)
            local[:, :4], local[:, 4] = stats_r, kl_r
        kl, stats = _combine_kl(_all_gather(local, shard), temps, temp_scalar, acc)
        ctx.save_for_backward(logits, ref_rows, temps, stats, kl)
        ctx.temp_scalar, ctx.backend = temp_scalar, backend
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        """dKL/dx = p (log p - log p_ref - KL) / T from the global statistics: no collective."""
        _ops.refuse_double_backward()
        logits, ref_rows, temps, stats, kl = ctx.saved_tensors
        if ctx.backend != "reference":
            return full_kl_gradient(logits, ref_rows, temps, ctx.temp_scalar, stats, kl, grad_kl, ctx.backend), *(None,) * 5
        rows = row_view(logits)
        grad_kl = grad_kl.to(kl.dtype).contiguous()
        n_rows = rows.shape[0] * rows.shape[1]
        x, y = rows.reshape(n_rows, rows.shape[-1]).to(kl.dtype), ref_rows.reshape(n_rows, rows.shape[-1]).to(kl.dtype)
        t = temps.unsqueeze(-1) if temps is not None else ctx.temp_scalar
        log_p = (x - stats[:, :1]) / t - stats[:, 1:2]
        log_ref = (y - stats[:, 2:3]) / t - stats[:, 3:4]
        p = log_p.exp()
        gap = torch.where(p > 0, log_p - log_ref - kl.unsqueeze(-1), 0.0)
        grad = (grad_kl.unsqueeze(-1) * p * gap / t).to(rows.dtype)
        return grad.reshape(logits.shape), *(None,) * 5


def full_kl_sharded(logits, ref_logits, temperature, group, vocab_start, check_kl_arguments):
    """The sharded form of ``kl.full_kl``: KL [...] of every row over the whole
    vocabulary; ``check_kl_arguments()`` returns the checked temperature."""
    checked = {}

    def check():
        checked["temperature"] = check_kl_arguments()
        return logits_layout(logits, temperature=checked["temperature"])

    shard = agree(group, check, vocab_start, FULL_KL)
    token_shape = logits.shape[:-1]
    acc = reference.compute_dtype(logits)
    temps, temp_scalar = _ops.split_row_param(_validation.flat_per_row(checked["temperature"], token_shape, acc))
    backend = "reference" if token_shape.numel() == 0 else select_backend(logits.device)
    kl = _ShardedFullKL.apply(logits, row_view(ref_logits.detach()), temps, temp_scalar, shard, backend)
    return kl.view(token_shape)
