"""Log-probs, entropy, the full KL, sampling and truncated log-probs of vocabulary-sharded
logits and LM heads (tensor parallelism) over torch.distributed.

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
Per-token tensors (labels, per-row temperatures and sampling parameters,
seeds) are compared by a 64-bit fingerprint computed on their device; the LM
head's hidden states and the policy loss's per-token inputs are not.
"""

from __future__ import annotations

import dataclasses

import torch

from . import _ops, _validation, reference
from ._backend import select_backend
from .kl import full_kl_gradient
from .logprobs import can_overwrite, check_arguments, row_view

__all__ = ["full_kl_sharded", "logprobs_and_entropy_sharded", "sample_sharded", "truncated_logprobs_sharded"]

# The agreement's fields, one int64 each per rank.
_FIELDS = ("error", "shape", "vocab", "start", "dtype", "outputs", "options", "values", "label_min", "label_max")
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
    None, or a tensor, whose values ``agree`` fingerprints instead)."""

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
        tensors by a code (``agree`` compares their values by fingerprint)."""
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
        kept = labels if ignore_index is None else labels.masked_fill(labels == ignore_index, 0)
        return torch.stack(torch.aminmax(kept.long()))

    return on_device


def _fingerprint(tensors) -> torch.Tensor:
    """A 64-bit fingerprint (int64 [1], on the tensors' device: no host sync) of the values and
    order of ``tensors`` (anything not a tensor skipped: the options digest compares scalars); a sum over elements of a mix of each one's bits, its
    position and its tensor's place, so that a different value, a permutation or a swap
    between tensors changes it (but for a 2^-64 chance). Integer products wrap, as intended."""
    total = None
    for place, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            continue
        flat = t.reshape(-1)
        if flat.dtype == torch.float64:
            bits = flat.view(torch.int64)
        elif flat.dtype == torch.float32:
            bits = flat.view(torch.int32).to(torch.int64)
        elif flat.dtype in (torch.bfloat16, torch.float16):
            bits = flat.view(torch.int16).to(torch.int64)
        else:
            bits = flat.to(torch.int64)
        position = torch.arange(flat.numel(), dtype=torch.int64, device=flat.device)
        mixed = (bits + position * 0x632BE59BD9B4E019 + place) * -0x61C8864680B583EB  # 2^64 / golden ratio
        mixed = (mixed ^ (mixed >> 31)) * 0x5851F42D4C957F2D
        part = mixed.sum().reshape(1)
        total = part if total is None else total + part
    return total


def agree(group, check, vocab_start: object, outputs: int, labels=lambda: None, values=lambda: ()) -> Shard:
    """Runs ``check()`` (this rank's argument checks, returning its
    :class:`Layout`), then the one all-gather that agrees the call across
    ``group``; raises on every rank alike when any rank's checks failed or the
    ranks disagree. ``outputs``: a code of what the caller computes;
    ``labels()``: ``label_range``'s callable, whose range is checked against
    the whole vocabulary; ``values()``: the per-token tensors (labels, per-row
    parameters and seeds) whose values every rank must pass alike, compared by
    ``_fingerprint``."""
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
    fingerprint = _fingerprint(values()) if error is None else None
    if fingerprint is not None:
        local[_FIELDS.index("values")] = fingerprint.to(device)[0]
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
    if len({t["values"] for t in table}) > 1:
        raise ValueError("the ranks of the group pass different values in their labels or per-token tensors (per-row "
                         "temperatures, top_k / top_p / min_p, seeds, offset): every rank must pass the same")  # fmt: skip
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
    shard = agree(group, check, vocab_start, outputs, label_range(labels, ignore_index),
                  lambda: (labels, checked["temperature"]))
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

    shard = agree(group, check, vocab_start, FULL_KL, values=lambda: (checked["temperature"],))
    token_shape = logits.shape[:-1]
    acc = reference.compute_dtype(logits)
    temps, temp_scalar = _ops.split_row_param(_validation.flat_per_row(checked["temperature"], token_shape, acc))
    backend = "reference" if token_shape.numel() == 0 else select_backend(logits.device)
    kl = _ShardedFullKL.apply(logits, row_view(ref_logits.detach()), temps, temp_scalar, shard, backend)
    return kl.view(token_shape)


# ---- sampling and truncated log-probs ------------------------------------------------------------
#
# The processed distribution's kept set is {x >= tau} (with min-p's per-token test; sampling.py),
# so the ranks agree on the row's max M and on tau, then each reads its shard once:
#
#   1. one all-gather of the shards' maxima: M, and the rows with nothing to sample (NaN, +inf, all -inf);
#   2. top-k: a radix select of the k-th largest order key (the kernels' keys) over the whole row,
#      8 bits a round, over the bits the logits' dtype sets (2 rounds for bf16, 3 fp16, 4 fp32, 8
#      fp64): each rank counts its tokens of each digit under the prefix found so far (the kernel
#      shard_digit_histogram, or plain torch), one all-reduce (int64, exact in any order) sums the
#      counts;
#   3. top-p: the same descent weighted by mass, among the top-k tokens: the largest key u with
#      mass(key >= u) >= p * mass(top-k set), masses in fixed point (e * 2^(62 - bits of V) rounded to
#      an int64, so that V of them cannot overflow: exact sums in any order) with their counts, one
#      all-reduce a round;
#   4. the shard pass (kernel): the shard's masses s and s_kept (float64), and the exponential race
#      over its kept tokens with the global index as Philox counter, so each rank's best score is the
#      unsharded race's over those tokens (the same d = (x - M) / T, the same variates); one all-gather
#      of 48 bytes a row, and every rank takes the best score (ties: the lowest index) and sums the
#      masses in rank order.
#
# The sampled token equals the unsharded sampler's unless a top-p boundary falls within the masses'
# rounding (half a unit a token: 2^-45 relative at V = 151936, against float64 sums unsharded);
# log-probs are the unsharded ones within float rounding, and every rank gets the same bits.


def _mass_units(vocab: int) -> float:
    """The fixed-point scale of a token's mass e = exp(d) in [0, 1] (step 3): V masses of at most
    2^(62 - bits of V) + 1/2 each sum below 2^63."""
    return 2.0 ** (62 - vocab.bit_length())


# Tokens a histogram pass reads at once (its int64 temporaries: 16 MiB each).
_CHUNK_ELEMENTS = 1 << 21


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """The kernels' order-preserving keys of float32 / float64 logits (csrc/sampling.cpp
    order_key), as int64 holding the key's bits: 32-bit keys in [0, 2^32), 64-bit ones
    reinterpreted (so compare them only bit-wise, as the radix select does)."""
    x = x + 0.0  # -0.0 and +0.0 share a key
    if x.dtype == torch.float32:
        bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31)
    bits = x.view(torch.int64)
    return torch.where(bits < 0, ~bits, bits ^ -(2**63))


def _key_values(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The logits whose keys (``_order_keys``'s int64 bits) are ``keys``."""
    if dtype == torch.float32:
        bits = torch.where(keys >= 2**31, keys & 0x7FFFFFFF, ~keys & 0xFFFFFFFF)
        return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    return torch.where(keys < 0, keys ^ -(2**63), ~keys).view(torch.float64)


def _row_chunks(rows: torch.Tensor):
    """(first row, [c, V_r] chunk in the compute dtype) over the flat rows of a row view, a copy of
    at most _CHUNK_ELEMENTS logits each."""
    outer, inner, vocab = rows.shape
    n_rows = outer * inner
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    acc = reference.compute_dtype(rows)
    for first in range(0, n_rows, step):
        index = torch.arange(first, min(first + step, n_rows), device=rows.device)
        yield first, rows[index // inner, index % inner].to(acc)


def _all_reduce_sum(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t, group=shard.group)
    return t


# The key bits a logit dtype can set (sign, exponent, mantissa of its float32 or float64 value): bf16's
# float32 keys vary in their top 16 bits only (the low 16 are all zeros, or all ones for negative
# values), fp16's in their top 19: the search's rounds stop at the lowest digit that varies.
_KEY_BITS = {torch.bfloat16: 16, torch.float16: 19, torch.float32: 32, torch.float64: 64}


def _digit_shifts(dtype: torch.dtype) -> range:
    """The shifts of the 8-bit digits the threshold search finds, most significant first."""
    width = 64 if dtype == torch.float64 else 32
    return range(width - 8, width - _KEY_BITS[dtype] - 8, -8)


def _completed_key(prefix: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``prefix`` (the digits found) with the bits below them as every key of ``dtype`` has them:
    zeros for positive values (key's top bit set), ones for negative ones."""
    low = _digit_shifts(dtype)[-1]
    if low == 0:
        return prefix
    top = prefix < 0 if dtype == torch.float64 else prefix >= 2**31
    return torch.where(top, prefix, prefix | ((1 << low) - 1))


def _digit_histograms(rows, shard: Shard, prefix, shift, backend, params, floor=None, m=None) -> torch.Tensor:
    """[N, 256] counts (or with ``floor``, [N, 2, 256] counts and mass units of the tokens x >=
    floor) of the keys' 8-bit digit at ``shift`` among the row's keys that share ``prefix``'s bits
    above it, summed over the ranks (csrc/sampling.h, shard_digit_histogram; plain torch, chunked,
    on the reference backend)."""
    n_rows = prefix.shape[0]
    acc = reference.compute_dtype(rows)
    if backend != "reference":
        given = None if floor is None else torch.stack([m, floor], -1)
        hist = _ops.shard_digit_histogram(rows, prefix.contiguous(), shift, given,
                                          *_ops.split_row_param(params["temperature"]), _mass_units(shard.vocab),
                                          backend)  # fmt: skip
    else:
        hist = torch.zeros(n_rows, 1 if floor is None else 2, 257, dtype=torch.int64, device=prefix.device)
        t = reference._per_row(params["temperature"], (n_rows,), acc, prefix.device)[:, 0]
        inv_t = torch.where(t > 0, 1.0 / torch.where(t > 0, t, 1.0), 1.0)
        for first, x in _row_chunks(rows):
            last = first + x.shape[0]
            keys = _order_keys(x)
            member = torch.ones_like(keys, dtype=torch.bool)
            if shift + 8 < (64 if acc == torch.float64 else 32):
                member = ((keys ^ prefix[first:last, None]) >> (shift + 8)) == 0
            if floor is not None:
                member &= x >= floor[first:last, None]
            digit = torch.where(member, (keys >> shift) & 255, 256)  # (bin 256: not counted)
            hist[first:last, 0].scatter_add_(1, digit, torch.ones_like(digit))
            if floor is not None:
                e = torch.exp((x - m[first:last, None]) * inv_t[first:last, None]).clamp(max=1.0)
                hist[first:last, 1].scatter_add_(1, digit, (e * _mass_units(shard.vocab)).round().to(torch.int64))
        hist = hist[..., :256].contiguous()
    hist = _all_reduce_sum(hist, shard)
    return hist[:, 0] if floor is None else hist


def _top_k_threshold(rows, shard: Shard, k: torch.Tensor, backend, params) -> torch.Tensor:
    """The k-th largest logit of each row over all shards (radix select, module comment)."""
    dtype = rows.dtype
    prefix = torch.zeros_like(k)
    need = k.clamp(min=1)
    for shift in _digit_shifts(dtype):
        hist = _digit_histograms(rows, shard, prefix, shift, backend, params)
        at_or_above = hist.flip(-1).cumsum(-1).flip(-1)  # tokens in this digit or a higher one
        # the highest digit from which down the count reaches `need` (0 if none: a row not selecting)
        digit = ((at_or_above >= need.unsqueeze(-1)).sum(-1) - 1).clamp(min=0)
        need = need - (at_or_above.gather(1, digit.unsqueeze(-1)) - hist.gather(1, digit.unsqueeze(-1))).squeeze(-1)
        prefix = prefix | (digit << shift)
    return _key_values(_completed_key(prefix, dtype), reference.compute_dtype(rows))


def _top_p_threshold(rows, shard: Shard, p, floor, m, backend, params) -> torch.Tensor:
    """The largest logit u with mass(x >= u) >= p * mass(x >= floor) among the tokens x >= floor
    (the top-k set), per row over all shards; the lowest such logit when rounding leaves every
    mass short of the target (as csrc/sampling.cpp's mass_threshold_key)."""
    dtype = rows.dtype
    prefix = torch.zeros(p.shape[0], dtype=torch.int64, device=p.device)
    above = torch.zeros_like(prefix)  # mass units strictly above the current prefix's range
    target = None
    digits = torch.arange(256, device=p.device)
    for shift in _digit_shifts(dtype):
        counts, units = _digit_histograms(rows, shard, prefix, shift, backend, params, floor, m).unbind(1)
        if target is None:
            target = p.double() * units.sum(-1).double()
        reached = above.unsqueeze(-1) + units.flip(-1).cumsum(-1).flip(-1)  # mass of this digit and up
        present = counts > 0
        ok = present & (reached.double() >= target.unsqueeze(-1))
        highest_ok = torch.where(ok, digits, -1).amax(-1)
        lowest_present = torch.where(present, digits, 256).amin(-1).clamp(max=255)
        digit = torch.where(highest_ok >= 0, highest_ok, lowest_present)
        above = (reached.gather(1, digit.unsqueeze(-1)) - units.gather(1, digit.unsqueeze(-1))).squeeze(-1)
        prefix = prefix | (digit << shift)
    return _key_values(_completed_key(prefix, dtype), reference.compute_dtype(rows))


def _kept(x, d, tau, min_p):
    """The kept tokens of [N, V_r] logits ``x`` with d = (x - M) / T, given each row's threshold
    ``tau`` [N, 1] and ``min_p`` [N]: x >= tau and d >= log(min_p) (sampling.py's kept set)."""
    return (x >= tau) & ((d >= torch.log(min_p).unsqueeze(-1)) | (min_p <= 0).unsqueeze(-1))


def _reference_shard_pass(rows, given, temps, temp_scalar, min_p, shard: Shard, seed=None, offset=0, labels=None):
    """The shard pass (csrc/sampling.h, sample_shard_pass) in plain torch: the reference backend's."""
    outer, inner, vocab = rows.shape
    n_rows = outer * inner
    acc = given.dtype
    x = rows.reshape(n_rows, vocab).to(acc)
    t = reference._per_row(temps if temps is not None else temp_scalar, (n_rows,), acc, x.device)[:, 0]
    mp = reference._per_row(min_p, (n_rows,), acc, x.device)[:, 0]
    m, tau = given[:, :1], given[:, 1:]
    greedy = (t == 0).unsqueeze(-1)
    d = (x - m) * torch.where(greedy, 1.0, 1.0 / t.unsqueeze(-1))
    kept = _kept(x, d, tau, mp)
    e = torch.exp(d).double()
    at_max = x == m
    columns = torch.arange(vocab, device=x.device) + shard.start
    sums = torch.zeros(n_rows, 4, dtype=torch.float64, device=x.device)
    picks = torch.full((n_rows, 2), -1, dtype=torch.int64, device=x.device)
    sums[:, 0] = torch.where(greedy.squeeze(-1), at_max.sum(-1).double(), e.sum(-1))
    sums[:, 1] = torch.where(greedy.squeeze(-1), 0.0, torch.where(kept, e, 0.0).sum(-1))
    picks[:, 1] = torch.where(at_max.any(-1), columns[at_max.to(torch.int8).argmax(-1)], -1)
    if labels is None:
        if isinstance(seed, torch.Tensor):
            seeds, salt = seed.unsqueeze(-1), torch.zeros(n_rows, 1, dtype=torch.int64, device=x.device)
        else:
            seeds = torch.full((n_rows, 1), seed, dtype=torch.int64, device=x.device)
            salt = torch.arange(n_rows, device=x.device).unsqueeze(-1)
        off = int(offset) if not isinstance(offset, torch.Tensor) else int(offset.reshape(-1)[0])
        mask = 0xFFFFFFFF
        w0, w1, _, _ = reference.philox4x32_10(columns.unsqueeze(0), salt, off & mask, off >> 32, seeds & mask,
                                               (seeds >> 32) & mask)  # fmt: skip
        score = torch.where(kept, d - torch.log(reference.exponential_variate(w0, w1).to(acc)), -torch.inf)
        best, winner = score.max(-1)  # (ties: the first index)
        won = best > -torch.inf
        sums[:, 2] = torch.where(greedy.squeeze(-1), 0.0, best.double())
        sums[:, 3] = torch.where(greedy.squeeze(-1), 0.0, d.gather(1, winner.unsqueeze(-1)).squeeze(-1).double())
        picks[:, 0] = torch.where(won & ~greedy.squeeze(-1), winner + shard.start, -1)
    else:
        local = labels.long() - shard.start
        here = (local >= 0) & (local < vocab)
        at = local.clamp(0, vocab - 1).unsqueeze(-1)
        d_label = torch.where(kept.gather(1, at), d.gather(1, at), -torch.inf).squeeze(-1)
        sums[:, 2] = torch.where(greedy.squeeze(-1), 0.0, torch.where(here, d_label.double(), torch.nan))
    bad = ~(torch.isfinite(given[:, 0]))
    sums[bad] = torch.nan
    picks[bad] = -1
    return sums, picks


def _shard_pass(rows, given, params, shard: Shard, backend, seed=None, offset=0, labels=None):
    """This shard's (sums [N, 4] float64, picks [N, 2] int64) (csrc/sampling.h, sample_shard_pass)."""
    temps, temp_scalar = _ops.split_row_param(params["temperature"])
    min_p_rows, min_p = _ops.split_row_param(params["min_p"])
    if backend == "reference":
        return _reference_shard_pass(rows, given, temps, temp_scalar, params["min_p"], shard, seed, offset, labels)
    seed_rows, seed_scalar = _ops.split_row_param(0 if seed is None else seed)
    offset_tensor, offset_scalar = _ops.split_row_param(offset)
    return _ops.sample_shard_pass(rows, given, temps, temp_scalar, min_p_rows, min_p, shard.start, seed_rows,
                                  seed_scalar, offset_tensor, offset_scalar, labels, backend)  # fmt: skip


def _kept_threshold(rows, params, shard: Shard, top_k_on: bool, top_p_on: bool, backend):
    """(given [N, 2] = (M, tau) in the compute dtype, bad [N]): the row's global max and kept
    threshold (module comment, steps 1-3), and the rows with nothing to sample or an invalid
    parameter."""
    outer, inner, vocab = rows.shape
    n_rows = outer * inner
    acc = reference.compute_dtype(rows)
    local_max = rows.amax(-1).reshape(n_rows).to(acc)
    maxima = _all_gather(local_max, shard)
    m = maxima.amax(0)
    t, k, p, mp = (reference._per_row(params[name], (n_rows,), dtype, rows.device)[:, 0]
                   for name, dtype in (("temperature", acc), ("top_k", torch.int64), ("top_p", acc), ("min_p", acc)))  # fmt: skip
    t_ok = (t == 0) | ((t > 0) & torch.isfinite(t) & torch.isfinite(1.0 / t))
    valid = t_ok & (k >= 0) & (p > 0) & (p <= 1) & (mp >= 0) & (mp <= 1)
    bad = maxima.isnan().any(0) | ~torch.isfinite(m) | ~valid
    active = ~bad & (t > 0)
    m_safe = torch.where(bad, 0.0, m)
    tau = torch.full_like(m, -torch.inf)
    if top_k_on:
        k_on = active & (k > 0) & (k < shard.vocab)
        tau = torch.where(k_on, _top_k_threshold(rows, shard, torch.where(k_on, k, 1), backend, params), tau)
    if top_p_on:
        p_on = active & (p < 1)
        tau = torch.where(p_on, _top_p_threshold(rows, shard, p, tau, m_safe, backend, params), tau)
    return torch.stack([torch.where(bad, torch.nan, m), tau], -1), bad


def _combine_shard_passes(sums, picks, shard: Shard):
    """Every rank's shard pass, gathered once ([world, N, 6] float64) and combined in rank order:
    (token or the first max [N] int64, d of it, s [N], s_kept [N] float64, label d [N] float64,
    first max [N] int64)."""
    gathered = _all_gather(torch.cat([sums, picks.double()], -1), shard)
    s, s_kept, score, d_win, winner, first = gathered.unbind(-1)
    total, total_kept = s[0].clone(), s_kept[0].clone()
    for r in range(1, s.shape[0]):  # rank order: the same bits on every rank
        total += s[r]
        total_kept += s_kept[r]
    first_max = torch.where(first >= 0, first, torch.inf).amin(0)
    best = score.amax(0)
    won = (score == best) & (winner >= 0)
    token = torch.where(won, winner, torch.inf).amin(0)
    d = torch.where(won & (winner == token), d_win, -torch.inf).amax(0)
    # Every kept draw lost (E = inf, ~2^-25 each): the first max, as the unsharded race.
    lost = torch.isinf(token)
    token = torch.where(lost, first_max, token)
    d = torch.where(lost, 0.0, d)
    # A label's d: from the shard holding it (the others' entry is NaN).
    label_d = torch.where(torch.isnan(score), -torch.inf, score).amax(0)
    label_d = torch.where(torch.isnan(score).all(0), torch.nan, label_d)
    first_max = torch.where(torch.isinf(first_max), -1, first_max).long()
    return torch.where(torch.isinf(token), -1, token).long(), d, total, total_kept, label_d, first_max


def _filters_on(params) -> tuple[bool, bool]:
    """Whether the call runs top-k's and top-p's rounds: decided from the arguments' kind, which
    the ranks have agreed on (a per-row tensor, or a scalar that is on), never from values that
    would need a host sync."""
    top_k, top_p = params["top_k"], params["top_p"]
    return isinstance(top_k, torch.Tensor) or top_k > 0, isinstance(top_p, torch.Tensor) or top_p < 1


def sample_sharded(logits, check, group, vocab_start):
    """The sharded form of ``sampling.sample``: (tokens, logprobs, raw_logprobs) [N] of this rank's
    vocabulary shard ``logits [..., V_r]``, the same on every rank; ``check()`` returns the checked
    (params, seed, offset) as sampling.sample holds them."""
    checked = {}

    def layout():
        checked["params"], checked["seed"], checked["offset"] = check()
        return logits_layout(logits, **checked["params"], seed=checked["seed"], offset=checked["offset"])

    shard = agree(group, layout, vocab_start, 0, values=lambda: (*checked["params"].values(), checked["seed"],
                                                                   checked["offset"]))  # fmt: skip
    params, seed, offset = checked["params"], checked["seed"], checked["offset"]
    rows, n_rows = row_view(logits), logits.shape[:-1].numel()
    acc = reference.compute_dtype(logits)
    if n_rows == 0:
        empty = lambda dt: torch.empty(n_rows, dtype=dt, device=logits.device)  # noqa: E731
        return empty(torch.int64), empty(acc), empty(acc)
    backend = select_backend(logits.device)
    given, bad = _kept_threshold(rows, params, shard, *_filters_on(params), backend)
    sums, picks = _shard_pass(rows, given, params, shard, backend, seed=seed, offset=offset)
    token, d, total, total_kept, _, _ = _combine_shard_passes(sums, picks, shard)
    greedy = reference._per_row(params["temperature"], (n_rows,), acc, logits.device)[:, 0] == 0
    logprob = torch.where(greedy, 0.0, d.to(acc) - torch.log(total_kept).to(acc))
    raw = torch.where(greedy, -torch.log(total).to(acc), d.to(acc) - torch.log(total).to(acc))
    return token.masked_fill(bad, -1), logprob.masked_fill(bad, torch.nan), raw.masked_fill(bad, torch.nan)


class _ShardedTruncated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, params, shard, backend):
        rows = row_view(logits)
        n_rows = labels.shape[0]
        given, bad = _kept_threshold(rows, params, shard, *_filters_on(params), backend)
        sums, picks = _shard_pass(rows, given, params, shard, backend, labels=labels)
        _, _, _, total_kept, label_d, first_max = _combine_shard_passes(sums, picks, shard)
        acc = given.dtype
        greedy = reference._per_row(params["temperature"], (n_rows,), acc, logits.device)[:, 0] == 0
        log_kept = torch.log(total_kept).to(acc)
        out = torch.where(greedy, torch.where(labels == first_max, 0.0, -torch.inf).to(acc), label_d.to(acc) - log_kept)
        out = out.masked_fill(bad, torch.nan)
        # (M, log s_kept, tau) as the unsharded backward takes them; a bad row's NaN makes its gradient NaN.
        stats = torch.stack([given[:, 0], log_kept.masked_fill(bad, torch.nan), given[:, 1]], -1)
        label_kept = (out > -torch.inf) & ~greedy
        ctx.save_for_backward(logits, labels, stats, label_kept,
                              *(v for v in params.values() if isinstance(v, torch.Tensor)))  # fmt: skip
        ctx.params, ctx.shard, ctx.backend = params, shard, backend
        return out

    @staticmethod
    def backward(ctx, grad_out):
        """This shard's gradient (sampling.truncated_logprobs's, kept set held fixed) from the
        agreed statistics and whether each label is kept: no collective."""
        _ops.refuse_double_backward()
        logits, labels, stats, label_kept, *_ = ctx.saved_tensors
        rows, params, shard = row_view(logits), ctx.params, ctx.shard
        grad_out = grad_out.to(stats.dtype).contiguous()
        if ctx.backend == "reference":
            grad = _reference_truncated_backward(rows, labels, stats, label_kept, grad_out, params, shard)
        else:
            grad = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
            truncation = tuple(x for name in ("temperature", "top_k", "top_p", "min_p")
                               for x in _ops.split_row_param(params[name]))  # fmt: skip
            _ops.truncated_backward(rows, labels, stats, grad_out, grad, *truncation, shard.start, label_kept,
                                    ctx.backend)  # fmt: skip
        return grad.reshape(logits.shape), None, None, None, None


def _reference_truncated_backward(rows, labels, stats, label_kept, grad_out, params, shard: Shard):
    """(1/T) g ([j == label] - q_j) over the kept tokens of the shard, in plain torch."""
    outer, inner, vocab = rows.shape
    n_rows = outer * inner
    acc = stats.dtype
    x = rows.reshape(n_rows, vocab).to(acc)
    t = reference._per_row(params["temperature"], (n_rows,), acc, x.device)[:, 0]
    mp = reference._per_row(params["min_p"], (n_rows,), acc, x.device)[:, 0]
    inv_t = torch.where(t > 0, 1.0 / torch.where(t > 0, t, 1.0), 0.0).unsqueeze(-1)
    m, log_kept, tau = stats.unbind(-1)
    d = (x - m.unsqueeze(-1)) * inv_t
    kept = _kept(x, d, tau.unsqueeze(-1), mp)
    q = torch.where(kept, torch.exp(d - log_kept.unsqueeze(-1)), 0.0)
    scale = torch.where(label_kept & (t > 0), grad_out * inv_t.squeeze(-1), 0.0)
    scale = torch.where(m.isnan() | log_kept.isnan(), torch.nan, scale).unsqueeze(-1)
    local = labels.long() - shard.start
    onehot = torch.arange(vocab, device=x.device) == local.unsqueeze(-1)
    grad = torch.where(scale == 0, 0.0, scale * (onehot.to(acc) - q))
    return grad.to(rows.dtype)


def truncated_logprobs_sharded(logits, labels, check, group, vocab_start):
    """The sharded form of ``sampling.truncated_logprobs``: the log-prob [N] of global ``labels``
    under the processed distribution of the whole row, the same on every rank; differentiable
    (no collective backward). ``check()`` returns the checked truncation parameters."""
    checked = {}

    def layout():
        checked["params"] = check()
        return logits_layout(logits, **checked["params"])

    shard = agree(group, layout, vocab_start, LABELED, label_range(labels, None),
                  lambda: (labels, *checked["params"].values()))
    if logits.shape[:-1].numel() == 0:  # (the empty result still joins the graph: a backward gives a zero gradient)
        return logits.to(reference.compute_dtype(logits)).sum(-1).reshape(0)
    flat = labels.reshape(-1).contiguous()
    return _ShardedTruncated.apply(logits, flat, checked["params"], shard, select_backend(logits.device))
