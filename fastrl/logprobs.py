"""Log-probs and entropy of chosen tokens from ``[..., V]`` logits.

    z        = logits / T                      (fp32 inside the kernel; never a scaled copy)
    logprob  = log_softmax(z)[label]           (0 where label == ignore_index)
    entropy  = -sum_v softmax(z)_v log softmax(z)_v

Both are differentiable w.r.t. the logits (the 1/T factor included); the
temperature is a constant. Outputs are float32 (float64 for float64 logits,
which the kernels accept so that their gradients can be checked with gradcheck).

Memory: the forward reads the logits once and, when a gradient is needed, keeps
three fp32 numbers per row (max logit, log-normaliser, and entropy if it was
asked for); under ``torch.no_grad`` it keeps nothing. The backward reads the
logits once and writes the gradient once.

``inplace_backward=True`` writes the gradient into the logits' own storage, and
then bumps their version counter, as any in-place op does: every other autograd
node that saved the logits (another op on them, ``retain_graph`` and a second
backward) raises torch's "modified by an inplace operation" error instead of
reading a gradient as logits. Where overwriting cannot be right it is not done
and a fresh buffer is used: a leaf tensor or a view of one (its data would
become the gradient), and rows that share memory (expanded, stride-0 rows). What remains
the caller's to know: after the backward, the logits tensor holds the gradient.
"""

from __future__ import annotations

import numbers

import torch

from . import _ops, _validation, reference
from ._backend import select_backend
from ._rows import can_overwrite, row_view
from ._sharded.logprobs import logprobs_and_entropy_sharded, sum_pi_squared_grad

__all__ = ["logprobs_from_logits", "logprobs_and_entropy", "entropy_from_logits", "sum_pi_squared"]


class _LogprobsEntropy(torch.autograd.Function):
    """Outputs, in order: logprob (if labels are given), entropy (if asked for),
    sum_pi_squared (if asked for)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, ignore_index, with_entropy, with_sum_pi_squared, inplace_backward,
                backend):  # fmt: skip
        rows = row_view(logits)
        temps, temp_scalar = _ops.split_row_param(temperature)
        logprob, entropy, stats, sum_pi_squared = _ops.logprobs_forward(
            rows, labels, temps, temp_scalar, ignore_index, with_entropy, True, with_sum_pi_squared, backend
        )
        # The logits themselves, not the rows view made here: a write over them is
        # then reported by torch's own "modified by an inplace operation" check.
        ctx.save_for_backward(logits, labels, temps, stats, entropy if with_entropy else None,
                              sum_pi_squared if with_sum_pi_squared else None)  # fmt: skip
        ctx.temp_scalar, ctx.ignore_index, ctx.backend = temp_scalar, ignore_index, backend
        ctx.inplace_backward = inplace_backward and can_overwrite(logits, rows)
        ctx.logits_shape = logits.shape
        ctx.has_labels, ctx.with_entropy, ctx.with_sum_pi_squared = labels is not None, with_entropy, with_sum_pi_squared
        ctx.set_materialize_grads(False)
        wanted = ((logprob, ctx.has_labels), (entropy, with_entropy), (sum_pi_squared, with_sum_pi_squared))
        return tuple(t for t, want in wanted if want)

    @staticmethod
    def backward(ctx, *grads):
        _ops.refuse_double_backward()
        logits, labels, temps, stats, entropy, sum_pi_squared = ctx.saved_tensors
        rows = row_view(logits)
        grads = list(grads)
        grad_logprob = grads.pop(0) if ctx.has_labels else None
        grad_entropy = grads.pop(0) if ctx.with_entropy else None
        grad_sum_pi_squared = grads.pop(0) if ctx.with_sum_pi_squared else None
        if grad_logprob is None and grad_entropy is None and grad_sum_pi_squared is None:
            return (None,) * 8
        acc = stats.dtype
        if grad_logprob is not None:
            grad_logprob = grad_logprob.to(acc).contiguous()
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(acc).contiguous()
        # Sum_pi_squared's term is computed in torch (an [N, V] temporary: a gradient
        # through it is the rare case), before the kernel may write over the logits.
        extra = None
        if grad_sum_pi_squared is not None:
            extra = sum_pi_squared_grad(rows, temps, ctx.temp_scalar, stats, sum_pi_squared, grad_sum_pi_squared)
        if grad_logprob is None and grad_entropy is None:  # Σπ²'s term alone: no kernel
            grad_rows = rows.copy_(extra) if ctx.inplace_backward else extra.to(rows.dtype)
        else:
            grad_rows = rows if ctx.inplace_backward else torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
            _ops.logprobs_backward(
                rows, labels, temps, ctx.temp_scalar, ctx.ignore_index, stats, entropy, grad_logprob, grad_entropy,
                grad_rows, 0, -1, ctx.backend,
            )  # fmt: skip
            if extra is not None:
                grad_rows.copy_(grad_rows.to(acc) + extra)
        if ctx.inplace_backward and not torch.compiler.is_compiling():
            # The kernel wrote through a raw pointer: tell autograd, so that any node
            # that saved the logits fails loudly instead of reading the gradient.
            # (A compiled graph sees the write from the operator's schema.)
            torch.autograd.graph.increment_version(rows)
        return grad_rows.reshape(ctx.logits_shape), *(None,) * 7


def _run(logits, labels, temperature, ignore_index, inplace_backward, with_entropy, group=None, vocab_start=None,
         agree_options=None, with_sum_pi_squared=False):  # fmt: skip
    """Validates, picks the backend and runs the op. Returns (logprob, entropy,
    sum_pi_squared), each None when not asked for, shaped like
    ``logits.shape[:-1]``. With a ``group`` the logits are this rank's vocabulary
    shard (fastrl._sharded.logprobs), and ``agree_options`` the caller's options
    the ranks must also agree on."""
    if group is None and vocab_start is not None:
        raise ValueError("vocab_start is for vocabulary-sharded logits: pass the group= they are sharded over")
    _validation.check_bool(inplace_backward, "inplace_backward")
    _validation.check_bool(with_sum_pi_squared, "sum_pi_squared")
    if group is not None:
        return logprobs_and_entropy_sharded(logits, labels, temperature, ignore_index, with_entropy, group, vocab_start,
                                            agree_options or {}, inplace_backward, with_sum_pi_squared)  # fmt: skip
    temperature = _validation.check_logprobs_arguments(logits, labels, temperature, ignore_index)
    token_shape = logits.shape[:-1]
    acc = reference.compute_dtype(logits)

    backend = select_backend(logits.device)
    if backend == "reference" or logits.numel() == 0:
        options = {"temperature": temperature}
        sum_pi_squared = reference.sum_pi_squared(logits, **options) if with_sum_pi_squared else None
        if labels is None:
            return None, reference.entropy_from_logits(logits, **options) if with_entropy else None, sum_pi_squared
        if not with_entropy:
            logprob = reference.logprobs_from_logits(logits, labels, ignore_index=ignore_index, **options)
            return logprob, None, sum_pi_squared
        return *reference.logprobs_and_entropy(logits, labels, ignore_index=ignore_index, **options), sum_pi_squared

    temperature = _validation.flat_per_row(temperature, token_shape, acc)
    flat_labels = labels.reshape(-1).contiguous() if labels is not None else None

    if torch.is_grad_enabled() and logits.requires_grad:
        outputs = list(
            _LogprobsEntropy.apply(
                logits, flat_labels, temperature, ignore_index, with_entropy, with_sum_pi_squared, inplace_backward,
                backend,
            )
        )
        logprob = outputs.pop(0) if labels is not None else None
        entropy = outputs.pop(0) if with_entropy else None
        sum_pi_squared = outputs.pop(0) if with_sum_pi_squared else None
    else:
        logprob, entropy, _, sum_pi_squared = _ops.logprobs_forward(
            row_view(logits), flat_labels, *_ops.split_row_param(temperature), ignore_index, with_entropy, False,
            with_sum_pi_squared, backend,
        )  # fmt: skip
        logprob = logprob if labels is not None else None
        entropy = entropy if with_entropy else None
        sum_pi_squared = sum_pi_squared if with_sum_pi_squared else None
    reshape = lambda t: None if t is None else t.view(token_shape)  # noqa: E731
    return reshape(logprob), reshape(entropy), reshape(sum_pi_squared)


def _check_inplace_backward(value: object) -> None:
    """``logprobs_from_logits``' third positional argument is veRL's
    ``inplace_backward``; TRL's ``selective_log_softmax(logits, index, temperature)``
    has the temperature there. A number or tensor in that place is a temperature
    given positionally: say so, rather than only that it is not a bool."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.Tensor)):
        return
    if isinstance(value, torch.Tensor):
        got, shown = "a tensor", "..."
    else:
        got, shown = f"{type(value).__name__} {value!r}", repr(value)
    raise TypeError(
        f"inplace_backward must be a bool; got {got}. If that is the temperature: temperature is keyword-only, "
        f"pass temperature={shown} (TRL's selective_log_softmax takes the temperature third; fastrl's third "
        f"positional argument is veRL's inplace_backward)"
    )


_TRL_TEMPERATURE = "TRL's selective_log_softmax takes the temperature third; here pass temperature=... by name"


@_validation.keyword_only_options(hint=_TRL_TEMPERATURE)
def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    inplace_backward: bool = False,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    group: object = None,
    vocab_start: int | None = None,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)[..., label]`` per token, float32.

    Drop-in for veRL's ``verl.utils.torch_functional.logprobs_from_logits``
    (same positional arguments, same result) and equal to TRL's
    ``selective_log_softmax`` on float32 input.

    Args:
        logits: ``[..., V]`` bf16 / fp16 / fp32 (fp64 accepted, computed in fp64).
        labels: ``[...]`` int32 / int64, in ``[0, V)`` or ``ignore_index``.
        inplace_backward: write the gradient into ``logits``' storage instead of
            allocating a new ``[..., V]`` tensor (module docstring: the logits'
            version counter moves, so other users of them raise; a leaf or
            overlapping rows get a fresh buffer). Default False, where veRL's
            defaults to True: pass True (positionally, as veRL's callers may) to
            get its in-place backward.
        temperature: keyword-only (TRL's ``selective_log_softmax`` takes it
            third, positionally; a number there raises a TypeError saying so):
            positive float, or a tensor of per-row temperatures broadcastable
            to ``labels.shape``.
        ignore_index: keyword-only; label whose log-prob is 0 and whose gradient is 0.
        group: keyword-only; a ``torch.distributed`` process group over which
            the vocabulary is sharded (tensor parallelism): ``logits`` are this
            rank's ``[..., V_r]`` columns, labels are global ids, and every rank
            gets the unsharded result (one all-gather of 16 bytes a row forward,
            no collective backward; ``fastrl._sharded.logprobs``);
            ``inplace_backward`` applies to the shard as to whole logits.
        vocab_start: keyword-only, with ``group``; the global id of this rank's
            first column, where the shards do not follow rank order (default:
            the sizes of the lower ranks' shards summed).
    """
    _check_inplace_backward(inplace_backward)
    logprob, _, _ = _run(logits, labels, temperature, ignore_index, inplace_backward, False, group, vocab_start)
    return logprob


@_validation.keyword_only_options(
    hint="TRL's selective_log_softmax_and_entropy takes entropy_requires_grad and temperature positionally; here pass "
    "temperature=... by name, and the entropy's gradient is computed only when the entropy reaches the loss"
)
def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    inplace_backward: bool = False,
    ignore_index: int = -100,
    group: object = None,
    vocab_start: int | None = None,
    sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``(logprobs, entropy)`` of the same distribution, from one read of the
    logits. Arguments as :func:`logprobs_from_logits` (``group`` /
    ``vocab_start`` too); the entropy is defined on ``ignore_index`` rows too.
    The entropy's gradient term is skipped in the backward when the entropy is
    not used in the loss. ``sum_pi_squared=True`` returns ``(logprobs, entropy,
    sum_pi_squared)``, the third from the same read (:func:`sum_pi_squared`)."""
    logprob, entropy, result = _run(logits, labels, temperature, ignore_index, inplace_backward, True, group,
                                    vocab_start, with_sum_pi_squared=sum_pi_squared)  # fmt: skip
    return (logprob, entropy, result) if sum_pi_squared else (logprob, entropy)


@_validation.keyword_only_options(
    hint="TRL's entropy_from_logits(logits, chunk_size) takes a chunk size second: fastrl needs none, it never "
    "materialises the [N, V] probabilities"
)
def entropy_from_logits(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    group: object = None,
    vocab_start: int | None = None,
) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` per row, float32,
    differentiable; ``group`` / ``vocab_start`` as :func:`logprobs_from_logits`."""
    _, entropy, _ = _run(logits, None, temperature, -100, False, True, group, vocab_start)
    return entropy


def sum_pi_squared(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    group: object = None,
    vocab_start: int | None = None,
) -> torch.Tensor:
    """``sum_v softmax(logits / temperature)_v ** 2`` per row, float32, from one
    read of the logits: veRL's ``calculate_sum_pi_squared_from_logits`` (Σπ², for
    its optimal-token baseline) with the temperature inside; ``group`` /
    ``vocab_start`` as :func:`logprobs_from_logits`. Differentiable (the gradient,
    2 p (p - Σπ²) / T, is computed with an [N, V] temporary). A row of only
    -inf gives NaN."""
    _, _, result = _run(logits, None, temperature, -100, False, False, group, vocab_start, with_sum_pi_squared=True)
    return result
