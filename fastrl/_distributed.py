"""The bottom layer of tensor parallelism over torch.distributed: a rank's place in the
vocabulary (``Shard``), the agreement of a call across the group (``agree``), and the collectives
the sharded ops share, each giving every rank the same bits whatever the collective's algorithm
(gathers in rank order, ``sum_in_rank_order``). The combine math of each op family:
fastrl._sharded.

A call's arguments are agreed across the group before its first collective: row
counts (the hidden size too for the LM head), shard sizes and starts, dtype, which
outputs, the scalar options (temperature, ignore_index, softcap, ...), each rank's
label range, and whether each rank's arguments passed their checks, so a bad
argument on one rank raises on every rank (a ValueError naming the rank) instead
of leaving the others waiting in a collective. Per-token tensors (labels, per-row
temperatures and sampling parameters, seeds) are compared by a 64-bit fingerprint
computed on their device; the LM head's hidden states and the policy loss's
per-token inputs are not.

That agreement is one small all-gather whose table the host reads: on CUDA a sync
that drains the stream. So it runs once per configuration: the first call with a
given (group, shapes, shard size and start, dtype, outputs, scalar options) is
agreed in full and remembered (``_AGREED``, the most recent 256); a later call
with the same configuration, the steady state of a training loop, makes no
collective and reads nothing on the host beyond what the unsharded op reads, so
a CUDA graph can capture it. What only the full agreement sees is then left to
the data: labels outside the vocabulary give NaN rows (as on CUDA without
checks), and ranks that pass different per-token values get different results.
A rank that alone changes an agreed argument while the others repeat it cannot
be told apart from them without a collective: it raises, or leaves the others
waiting, as in any collective code. ``FASTRL_CHECKS=1`` agrees every call in full,
with everything the first call checks. Under torch.compile the first call of a
configuration breaks the graph at that host read (``fullgraph=True`` refuses it):
agree it with one eager call first, as a CUDA graph's warm-up does.
"""

from __future__ import annotations

import collections
import dataclasses

import torch

from ._backend import checks_enabled

# The agreement's fields, one int64 each per rank.
_FIELDS = ("error", "shape", "vocab", "start", "dtype", "outputs", "options", "values", "label_min", "label_max")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
# The agreement's "outputs" code: bits of what the call computes.
LABELED, ENTROPY, FULL_KL = 1, 2, 4
# The configurations this process has agreed with its groups (module docstring): (group id, this
# rank's configuration) -> (group, Shard), most recently used last, at most _AGREED_KEPT of them.
_AGREED: collections.OrderedDict = collections.OrderedDict()
_AGREED_KEPT = 256


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
    # Options that change from call to call (a sampler's seed and offset): compared when a call is
    # agreed, left out of the configuration an agreement is remembered by.
    per_call: tuple[str, ...] = ()

    def options_exact(self, with_per_call: bool = True) -> tuple[tuple[str, str], ...]:
        """The options' exact text by name: floats in hex (so no two values share it as they
        may share Python's hash: hash(-1.0) == hash(-2.0)), tensors by a code (``agree``
        compares their values by fingerprint); ``with_per_call=False``: without ``per_call``."""

        def exact(value) -> str:
            if isinstance(value, torch.Tensor):
                return "<tensor>"
            if isinstance(value, float):
                return value.hex()
            return repr(value)

        return tuple((name, exact(value)) for name, value in self.options.items()
                     if with_per_call or name not in self.per_call)  # fmt: skip

    def options_key(self) -> int:
        """The options as one int64, the same in every process: a 64-bit BLAKE2 digest of
        their exact text."""
        import hashlib

        text = ";".join(f"{name}={text}" for name, text in self.options_exact())
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
    ``_fingerprint``. A configuration agreed before is not agreed again
    (module docstring), unless FASTRL_CHECKS=1."""
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
    configuration = None
    if error is None:
        configuration = (id(group), layout.shape, layout.vocab, vocab_start, layout.dtype, outputs,
                         layout.options_exact(with_per_call=False))  # fmt: skip
        known = _AGREED.get(configuration)
        if known is not None and not checks_enabled():
            _AGREED.move_to_end(configuration)
            return known[1]
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
    shard = Shard(group, starts[rank], sizes[rank], vocab, starts, sizes)
    _AGREED[configuration] = (group, shard)  # (the group held, so that its id is not reused while remembered)
    while len(_AGREED) > _AGREED_KEPT:
        _AGREED.popitem(last=False)
    return shard


def logits_layout(logits: torch.Tensor, per_call: tuple[str, ...] = (), **options) -> Layout:
    """The Layout of a logits op: token shape, shard size, dtype, options."""
    return Layout(tuple(logits.shape[:-1]), logits.shape[-1], logits.dtype, logits.device, options, per_call=per_call)


def gather_ranks(local: torch.Tensor, shard: Shard) -> torch.Tensor:
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


class _OwnedEntriesOnEveryRank(torch.autograd.Function):
    """Forward: the entries each rank owns (0 on the ranks that do not), on every rank:
    their sum in rank order, which is exact (one term of each entry is not 0), so every
    rank holds the owner's bits (a -0.0 comes back +0.0). Backward: every rank computes
    the same loss from them, so each passes the gradient on as it is; the caller's mask
    keeps the part its own entries get."""

    @staticmethod
    def forward(ctx, part, group):
        return sum_in_rank_order(part, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def owned_entries_on_every_rank(part: torch.Tensor, group) -> torch.Tensor:
    """``part`` [N, ...] (0 where this rank owns no entry, each entry owned by one rank),
    completed from every rank's: differentiable (_OwnedEntriesOnEveryRank)."""
    return _OwnedEntriesOnEveryRank.apply(part, group)


def all_reduce_sum(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t, group=shard.group)
    return t
