"""Every kernel launch of fastrl as a ``torch.library`` operator (``torch.ops.fastrl.*``).

Why: ``torch.compile`` cannot trace into a launcher (it passes raw pointers to
C++ or launches a Triton kernel), and CUDA-graph trees and export need to know
what an opaque call reads, writes and returns. So each launcher of
``fastrl._native`` / ``fastrl.kernels`` is wrapped here once as an operator with

  * a schema: per-row parameters (a Python number or a per-row tensor) travel as
    a pair ``Tensor? <name>_rows, <scalar> <name>``; an output that was not asked
    for is an empty tensor (the API layer turns it back into None); gradient
    buffers the size of the logits are written in place (``Tensor(a!) grad_out``)
    so that ``inplace_backward`` can pass the logits themselves;
  * a CPU and a CUDA implementation: the launcher of the backend named by the
    ``backend`` argument (``"native"`` or ``"triton"``), chosen by the API layer;
    the native kernels are CPU-only, so the CUDA implementation refuses it;
  * a fake implementation: the outputs' shapes and dtypes, for tracing.

The autograd of each op family is an ``autograd.Function`` in its API module
that calls these operators (forward op in ``forward``, backward op in
``backward``); torch.compile traces those Functions, so a compiled function
using fastrl is one graph forward and one backward. The operators are defined
with ``Library.define`` rather than ``torch.library.custom_op``: the plain
dispatcher costs about 4 us a call in eager mode, the custom_op wrapper (and a
registered autograd kernel) 20 to 50 us, which small policy-loss batches feel.
"""

from __future__ import annotations

import importlib
import math
from types import ModuleType

import torch

from ._rows import compute_dtype, row_view, segment_length

__all__ = ["launchers", "refuse_double_backward", "row_param", "split_row_param"]

_LIB = torch.library.Library("fastrl", "DEF")

# Per-row parameter pairs in the schemas: "<name>_rows" (a flat per-row tensor) or "<name>" (a scalar).
_TEMPERATURE = "Tensor? temperature_rows, float temperature"
_TRUNCATION = f"{_TEMPERATURE}, Tensor? top_k_rows, int top_k, Tensor? top_p_rows, float top_p, Tensor? min_p_rows, float min_p"  # fmt: skip


# The launchers each kernel backend offers an op family, the operators below their one caller:
# fastrl._native (C++) and fastrl.kernels.<family> (Triton) define every one with the same
# parameters (names, kinds, defaults; tests/test_layers.py holds them to it).
LAUNCHERS = {
    "logprobs": ("logprobs_forward", "logprobs_backward", "logprobs_segments", "logprobs_combine"),
    "sampling": ("sample_forward", "truncated_forward", "truncated_backward", "sample_shard_pass",
                 "shard_digit_histogram", "sample_mass_logs"),
    "kl": ("kl_penalty_forward", "kl_penalty_backward", "full_kl_forward", "full_kl_backward"),
    "policy": ("stats_shape", "policy_forward", "policy_finalize", "policy_backward", "rollout_correction_forward",
               "rollout_finalize"),
}  # fmt: skip
# Launchers of the Triton backend alone, and why the native one has no twin: the tensor-parallel
# sampler's segment statistics, which give the ranks the Triton sampler's float row sum (its raw
# log-prob and its top-p target without top-k); the native sampler weighs exact integer masses,
# which the shard passes already add up (fastrl._sharded.sampling).
TRITON_LAUNCHERS = {"sampling": ("sample_segments", "sample_segments_fold")}


def launchers(backend: str, family: str) -> ModuleType:
    """The launcher module of a kernel backend for an op family: ``fastrl.kernels.<family>``
    (Triton) or ``fastrl._native`` (C++); both define ``LAUNCHERS[family]`` alike
    (``TRITON_LAUNCHERS[family]``: the Triton module alone)."""
    if backend == "triton":
        return importlib.import_module(f"fastrl.kernels.{family}")
    if backend == "native":
        return importlib.import_module("fastrl._native")
    raise ValueError(f"backend must be 'triton' or 'native' for a kernel launch; got {backend!r}")


def split_row_param(value: int | float | torch.Tensor | None) -> tuple[torch.Tensor | None, int | float | None]:
    """(per-row tensor or None, scalar) of a per-row parameter, as the schemas take
    it; None (an optional count not given) is (None, None)."""
    if isinstance(value, torch.Tensor):
        return value, 0
    return None, value


def row_param(rows: torch.Tensor | None, scalar: int | float) -> int | float | torch.Tensor:
    """The inverse of :func:`split_row_param`: what the launchers take."""
    return scalar if rows is None else rows


def refuse_double_backward() -> None:
    """Called first in every backward of fastrl's autograd Functions. Their
    backwards are kernels, differentiable no further: under create_graph=True
    (the engine then runs backwards with grad mode on) the gradient would not
    depend on the inputs in autograd's eyes and a second-order term would be
    dropped without a word. So a double backward raises instead. (Not while
    torch.compile traces, which runs backwards with grad mode on by itself.)"""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            "fastrl ops are differentiable once: their backward is a kernel, so create_graph=True (double "
            "backward, gradient penalties) would silently drop second-order terms. Use "
            "fastrl.use_backend('reference') for higher-order gradients."
        )


def _on_cuda(name: str, impl):
    """The CUDA implementation of operator ``name``: ``impl``, except that it refuses
    the native backend (every schema ends in ``str backend``), whose CPU kernels
    would read device pointers."""

    def cuda_impl(*args):
        if args[-1] == "native":
            raise ValueError(
                f"backend of fastrl::{name} must be 'triton' for CUDA tensors; got 'native' "
                "(the native kernels run CPU tensors only)"
            )
        return impl(*args)

    return cuda_impl


def _define(schema: str, impl, fake) -> torch._ops.OpOverload:
    name = schema.split("(", 1)[0]
    _LIB.define(schema)
    _LIB.impl(name, impl, "CPU")
    _LIB.impl(name, _on_cuda(name, impl), "CUDA")
    torch.library.register_fake(f"fastrl::{name}", fake, lib=_LIB)
    return getattr(torch.ops.fastrl, name).default


def _new(like: torch.Tensor, *shape, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=like.device)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An output not asked for travels as an empty tensor."""
    return _new(like, 0, dtype=dtype) if t is None else t


def _per_row_fake(logits: torch.Tensor, columns: int = 0, wanted: bool = True) -> torch.Tensor:
    """Fake of a per-row output of ``logits [..., V]`` (the N rows of a
    ``[outer, inner, V]`` row view, or of ``[N, V]``): [N] (or [N, columns] of
    statistics), in the accumulation dtype; empty when not ``wanted``."""
    n_rows = math.prod(logits.shape[:-1])
    shape = ((n_rows, columns) if columns else (n_rows,)) if wanted else (0,)
    return _new(logits, *shape, dtype=compute_dtype(logits))


def _no_output(*args, **kwargs) -> None:
    """Fake of an op that only writes into its ``grad_out`` argument."""
    return None


# --- log-probs and entropy ---------------------------------------------------------------------


def _logprobs_forward(logits, labels, temperature_rows, temperature, ignore_index, with_entropy, with_stats,
                      with_sum_pi_squared, backend):  # fmt: skip
    outputs = launchers(backend, "logprobs").logprobs_forward(
        logits, labels, row_param(temperature_rows, temperature), ignore_index,
        with_entropy=with_entropy, with_stats=with_stats, with_sum_pi_squared=with_sum_pi_squared,
    )  # fmt: skip
    acc = compute_dtype(logits)
    return tuple(_or_empty(t, logits, acc) for t in outputs)


def _logprobs_forward_fake(logits, labels, temperature_rows, temperature, ignore_index, with_entropy, with_stats,
                           with_sum_pi_squared, backend):  # fmt: skip
    return (
        _per_row_fake(logits, wanted=labels is not None),
        _per_row_fake(logits, wanted=with_entropy),
        _per_row_fake(logits, 2, with_stats),
        _per_row_fake(logits, wanted=with_sum_pi_squared),
    )


# sum_pi_squared: sum_j p_j^2 of each row (veRL's optimal-token baseline), from the same read.
logprobs_forward = _define(
    "logprobs_forward(Tensor logits, Tensor? labels, " + _TEMPERATURE + ", int ignore_index, bool with_entropy, "
    "bool with_stats, bool with_sum_pi_squared, str backend) "
    "-> (Tensor logprob, Tensor entropy, Tensor stats, Tensor sum_pi_squared)",
    _logprobs_forward, _logprobs_forward_fake,
)  # fmt: skip


def _logprobs_backward(logits, labels, temperature_rows, temperature, ignore_index, stats, entropy, grad_logprob,
                       grad_entropy, grad_out, label_base, label_vocab, backend):  # fmt: skip
    launchers(backend, "logprobs").logprobs_backward(
        logits, labels, row_param(temperature_rows, temperature), ignore_index, stats, entropy, grad_logprob,
        grad_entropy, grad_out, label_base, label_vocab if label_vocab >= 0 else None,
    )  # fmt: skip


# label_base / label_vocab: the rows are columns [label_base, label_base + V) of rows
# of label_vocab entries (0 / -1: a whole row); the fused LM head's vocabulary slabs.
logprobs_backward = _define(
    "logprobs_backward(Tensor logits, Tensor? labels, " + _TEMPERATURE + ", int ignore_index, Tensor stats, "
    "Tensor? entropy, Tensor? grad_logprob, Tensor? grad_entropy, Tensor(a!) grad_out, int label_base, "
    "int label_vocab, str backend) -> ()",
    _logprobs_backward, _no_output,
)  # fmt: skip


def _logprobs_segments(logits, temperature_rows, temperature, with_entropy, with_sum_pi_squared, segment, vocab,
                       backend):  # fmt: skip
    return launchers(backend, "logprobs").logprobs_segments(
        logits, row_param(temperature_rows, temperature), with_entropy=with_entropy,
        with_sum_pi_squared=with_sum_pi_squared, segment=segment, vocab=vocab,
    )  # fmt: skip


def _logprobs_segments_fake(logits, temperature_rows, temperature, with_entropy, with_sum_pi_squared, segment, vocab,
                            backend):  # fmt: skip
    n_segments = logits.shape[-1] // segment if segment else 0
    return _new(logits, math.prod(logits.shape[:-1]), n_segments, 5, dtype=torch.float64)


# A vocabulary shard's part of the forward: each row's segments' statistics (fastrl._rows.segment_length),
# [N, V_r / segment, 5] float64, reduced with the tile of a row of `vocab` logits; gathered from the ranks
# in vocabulary order, logprobs_combine gives logprobs_forward's outputs of the whole rows, bit for bit.
logprobs_segments = _define(
    "logprobs_segments(Tensor logits, " + _TEMPERATURE + ", bool with_entropy, bool with_sum_pi_squared, "
    "int segment, int vocab, str backend) -> Tensor",
    _logprobs_segments, _logprobs_segments_fake,
)  # fmt: skip


def _logprobs_combine(segments, label_logits, labels, temperature_rows, temperature, ignore_index, with_entropy,
                      with_stats, with_sum_pi_squared, vocab, acc, backend):  # fmt: skip
    outputs = launchers(backend, "logprobs").logprobs_combine(
        segments, label_logits, labels, row_param(temperature_rows, temperature), ignore_index,
        with_entropy=with_entropy, with_stats=with_stats, with_sum_pi_squared=with_sum_pi_squared, vocab=vocab,
        acc=acc,
    )  # fmt: skip
    return tuple(_or_empty(t, segments, acc) for t in outputs)


def _logprobs_combine_fake(segments, label_logits, labels, temperature_rows, temperature, ignore_index, with_entropy,
                           with_stats, with_sum_pi_squared, vocab, acc, backend):  # fmt: skip
    n_rows = segments.shape[0]
    per_row = lambda wanted, *columns: _new(segments, *((n_rows, *columns) if wanted else (0,)), dtype=acc)  # noqa: E731
    return (per_row(labels is not None), per_row(with_entropy), per_row(with_stats, 2),
            per_row(with_sum_pi_squared))  # fmt: skip


# label_logits: each row's label logit in `acc` (read where the label is in [0, vocab)).
logprobs_combine = _define(
    "logprobs_combine(Tensor segments, Tensor? label_logits, Tensor? labels, " + _TEMPERATURE + ", "
    "int ignore_index, bool with_entropy, bool with_stats, bool with_sum_pi_squared, int vocab, ScalarType acc, "
    "str backend) -> (Tensor logprob, Tensor entropy, Tensor stats, Tensor sum_pi_squared)",
    _logprobs_combine, _logprobs_combine_fake,
)  # fmt: skip


# --- sampling ----------------------------------------------------------------------------------


def _truncation(temperature_rows, temperature, top_k_rows, top_k, top_p_rows, top_p, min_p_rows, min_p) -> dict:
    return {
        "temperature": row_param(temperature_rows, temperature), "top_k": row_param(top_k_rows, top_k),
        "top_p": row_param(top_p_rows, top_p), "min_p": row_param(min_p_rows, min_p),
    }  # fmt: skip


def _sample_forward(logits, *args):
    *truncation, seed_rows, seed, offset_tensor, offset, backend = args
    return launchers(backend, "sampling").sample_forward(
        logits, **_truncation(*truncation), seed=row_param(seed_rows, seed), offset=row_param(offset_tensor, offset)
    )


def _sample_forward_fake(logits, *args):
    return _per_row_fake(logits).to(torch.int64), _per_row_fake(logits), _per_row_fake(logits), _per_row_fake(logits)


sample_forward = _define(
    "sample_forward(Tensor logits, " + _TRUNCATION + ", Tensor? seed_rows, int seed, Tensor? offset_tensor, "
    "int offset, str backend) -> (Tensor tokens, Tensor logprobs, Tensor raw_logprobs, Tensor entropy)",
    _sample_forward, _sample_forward_fake,
)  # fmt: skip


def _truncated_forward(logits, labels, *args):
    *truncation, with_stats, backend = args
    out, stats = launchers(backend, "sampling").truncated_forward(
        logits, labels, **_truncation(*truncation), with_stats=with_stats
    )
    return out, _or_empty(stats, logits, compute_dtype(logits))


def _truncated_forward_fake(logits, labels, *args):
    with_stats = args[-2]
    return _per_row_fake(logits), _per_row_fake(logits, 3, with_stats)


truncated_forward = _define(
    "truncated_forward(Tensor logits, Tensor labels, " + _TRUNCATION + ", bool with_stats, str backend) "
    "-> (Tensor logprob, Tensor stats)",
    _truncated_forward, _truncated_forward_fake,
)  # fmt: skip


def _truncated_backward(logits, labels, stats, grad_logprob, grad_out, *args):
    *truncation, label_base, label_kept, backend = args
    launchers(backend, "sampling").truncated_backward(
        logits, labels, stats, grad_logprob, grad_out, **_truncation(*truncation), label_base=label_base,
        label_kept=label_kept,
    )  # fmt: skip


# label_base / label_kept: a vocabulary shard's (fastrl._sharded.sampling); 0 / None unsharded.
truncated_backward = _define(
    "truncated_backward(Tensor logits, Tensor labels, Tensor stats, Tensor grad_logprob, Tensor(a!) grad_out, "
    + _TRUNCATION + ", int label_base, Tensor? label_kept, str backend) -> ()",
    _truncated_backward, _no_output,
)  # fmt: skip


def _sample_shard_pass(logits, given, temperature_rows, temperature, min_p_rows, min_p, column_base, seed_rows, seed,
                       offset_tensor, offset, labels, backend):  # fmt: skip
    return launchers(backend, "sampling").sample_shard_pass(
        logits, given, temperature=row_param(temperature_rows, temperature), min_p=row_param(min_p_rows, min_p),
        column_base=column_base, seed=row_param(seed_rows, seed), offset=row_param(offset_tensor, offset),
        labels=labels,
    )  # fmt: skip


def _sample_shard_pass_fake(logits, *args):
    n_rows = math.prod(logits.shape[:-1])
    return (_new(logits, n_rows, 2, dtype=torch.float64), _new(logits, n_rows, 6, dtype=torch.int64),
            _new(logits, n_rows, 2, dtype=torch.int64))  # fmt: skip


def _sample_mass_logs(masses, float64, backend):
    return launchers(backend, "sampling").sample_mass_logs(masses, float64)


def _sample_mass_logs_fake(masses, float64, backend):
    return _new(masses, masses.shape[0], 3, dtype=torch.float64)


def _shard_digit_histogram(logits, prefix, shift, given, temperature_rows, temperature, unit_scale, backend):
    return launchers(backend, "sampling").shard_digit_histogram(
        logits, prefix, shift, given, temperature=row_param(temperature_rows, temperature), unit_scale=unit_scale
    )


def _shard_digit_histogram_fake(logits, prefix, shift, given, *args):
    return _new(logits, math.prod(logits.shape[:-1]), 1 if given is None else 2, 256, dtype=torch.int64)


# A round of the tensor-parallel sampler's threshold search (fastrl._sharded.sampling).
shard_digit_histogram = _define(
    "shard_digit_histogram(Tensor logits, Tensor prefix, int shift, Tensor? given, " + _TEMPERATURE
    + ", float unit_scale, str backend) -> Tensor",
    _shard_digit_histogram, _shard_digit_histogram_fake,
)  # fmt: skip


# A vocabulary shard's pass of the tensor-parallel sampler (fastrl._sharded.sampling): the race
# (labels None) or the truncated log-prob's terms (labels given), from the agreed max and threshold.
sample_shard_pass = _define(
    "sample_shard_pass(Tensor logits, Tensor given, " + _TEMPERATURE + ", Tensor? min_p_rows, float min_p, "
    "int column_base, Tensor? seed_rows, int seed, Tensor? offset_tensor, int offset, Tensor? labels, str backend) "
    "-> (Tensor scores, Tensor masses, Tensor picks)",
    _sample_shard_pass, _sample_shard_pass_fake,
)  # fmt: skip

# The tensor-parallel sampler's log-masses and entropy from its shard passes' masses summed over the
# ranks, by the unsharded kernels' formula (fastrl._sharded.sampling); float64: of float64 logits.
sample_mass_logs = _define(
    "sample_mass_logs(Tensor masses, bool float64, str backend) -> Tensor",
    _sample_mass_logs, _sample_mass_logs_fake,
)  # fmt: skip



def _triton_backend(backend: str, name: str) -> str:
    """``backend``, which must be "triton" for a TRITON_LAUNCHERS operator."""
    if backend != "triton":
        raise ValueError(f"backend of fastrl::{name} must be 'triton' (a Triton-only launcher); got {backend!r}")
    return backend


def _sample_segments(logits, temperature_rows, temperature, vocab, backend):
    return launchers(_triton_backend(backend, "sample_segments"), "sampling").sample_segments(
        logits, temperature=row_param(temperature_rows, temperature), vocab=vocab
    )


def _sample_segments_fake(logits, temperature_rows, temperature, vocab, backend):
    return _new(logits, math.prod(logits.shape[:-1]), logits.shape[-1] // segment_length(vocab), 3,
                dtype=torch.float64)  # fmt: skip


def _sample_segments_fold(segments, acc, temperature_rows, temperature, backend):
    return launchers(_triton_backend(backend, "sample_segments_fold"), "sampling").sample_segments_fold(
        segments, acc, temperature=row_param(temperature_rows, temperature)
    )


def _sample_segments_fold_fake(segments, acc, *args):
    return _new(segments, segments.shape[0], 3, dtype=torch.float64)


# The tensor-parallel Triton sampler's segment statistics of a vocabulary shard of whole segments, and
# their fold into each row's (m, s, log s), gathered from the ranks (fastrl._sharded.sampling).
sample_segments = _define(
    "sample_segments(Tensor logits, " + _TEMPERATURE + ", int vocab, str backend) -> Tensor",
    _sample_segments, _sample_segments_fake,
)  # fmt: skip
sample_segments_fold = _define(
    "sample_segments_fold(Tensor segments, ScalarType acc, " + _TEMPERATURE + ", str backend) -> Tensor",
    _sample_segments_fold, _sample_segments_fold_fake,
)  # fmt: skip


# --- KL ----------------------------------------------------------------------------------------


def _kl_penalty_forward(log_probs, ref_log_probs, estimator, backend):
    return launchers(backend, "kl").kl_penalty_forward(log_probs, ref_log_probs, estimator=estimator)


kl_penalty_forward = _define(
    "kl_penalty_forward(Tensor log_probs, Tensor ref_log_probs, int estimator, str backend) -> Tensor",
    _kl_penalty_forward, lambda log_probs, *args: torch.empty_like(log_probs),
)  # fmt: skip


def _kl_penalty_backward(log_probs, ref_log_probs, grad, estimator, straight_through, backend):
    return launchers(backend, "kl").kl_penalty_backward(
        log_probs, ref_log_probs, grad, estimator=estimator, straight_through=straight_through
    )


kl_penalty_backward = _define(
    "kl_penalty_backward(Tensor log_probs, Tensor ref_log_probs, Tensor grad, int estimator, bool straight_through, "
    "str backend) -> Tensor",
    _kl_penalty_backward, lambda log_probs, *args: torch.empty_like(log_probs),
)  # fmt: skip


def _full_kl_forward(logits, ref_logits, temperature_rows, temperature, with_stats, backend):
    kl, stats = launchers(backend, "kl").full_kl_forward(
        logits, ref_logits, row_param(temperature_rows, temperature), with_stats=with_stats
    )
    return kl, _or_empty(stats, logits, compute_dtype(logits))


def _full_kl_forward_fake(logits, ref_logits, temperature_rows, temperature, with_stats, backend):
    return _per_row_fake(logits), _per_row_fake(logits, 4, with_stats)


full_kl_forward = _define(
    "full_kl_forward(Tensor logits, Tensor ref_logits, " + _TEMPERATURE + ", bool with_stats, str backend) "
    "-> (Tensor kl, Tensor stats)",
    _full_kl_forward, _full_kl_forward_fake,
)  # fmt: skip


def _full_kl_backward(logits, ref_logits, temperature_rows, temperature, stats, kl, grad_kl, grad_out, backend):
    launchers(backend, "kl").full_kl_backward(
        logits, ref_logits, row_param(temperature_rows, temperature), stats, kl, grad_kl, grad_out
    )


full_kl_backward = _define(
    "full_kl_backward(Tensor logits, Tensor ref_logits, " + _TEMPERATURE + ", Tensor stats, Tensor kl, "
    "Tensor grad_kl, Tensor(a!) grad_out, str backend) -> ()",
    _full_kl_backward, _no_output,
)  # fmt: skip


def full_kl_gradient(logits, ref_rows, temps, temp_scalar, stats, kl, grad_kl, backend) -> torch.Tensor:
    """dL/dlogits from the row statistics (m, log s, m', log s') and the KL (the
    whole row's, or the whole vocabulary's for a shard: fastrl._sharded.kl)."""
    rows = row_view(logits)
    grad = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    full_kl_backward(rows, ref_rows, temps, temp_scalar, stats, kl, grad_kl.to(kl.dtype).contiguous(), grad, backend)
    return grad.reshape(logits.shape)


# --- policy loss, aggregation, rollout correction ----------------------------------------------

_POLICY_INPUTS = (
    "Tensor log_probs, Tensor? old_log_probs, Tensor? advantages, Tensor mask, Tensor? weights, Tensor? ref_log_probs"
)
_POLICY_OPTIONS = "float clip_low, float clip_high, float? clip_c, bool sequence, bool with_pg"


def _stats(rows: torch.Tensor, backend: str) -> torch.Tensor:
    """The forward's statistics of [B, L] rows: per row [B, N_STATS] (native), per
    chunk of the row [B, C * N_STATS] (Triton)."""
    return _new(rows, *launchers(backend, "policy").stats_shape(*rows.shape), dtype=torch.float64)


def _policy_forward(log_probs, old, adv, mask, weights, ref, values, estimator, clip_low, clip_high, clip_c,
                    sequence, with_pg, backend):  # fmt: skip
    return launchers(backend, "policy").policy_forward(
        log_probs, old, adv, mask, weights, ref, values, estimator=estimator, clip_low=clip_low,
        clip_high=clip_high, clip_c=clip_c, sequence=sequence, with_pg=with_pg,
    )  # fmt: skip


policy_forward = _define(
    f"policy_forward({_POLICY_INPUTS}, Tensor? values, int estimator, {_POLICY_OPTIONS}, str backend) -> Tensor",
    _policy_forward, lambda log_probs, *args: _stats(log_probs, args[-1]),
)  # fmt: skip


def _policy_finalize(stats, mode, dp_size, batch_num_tokens_tensor, batch_num_tokens, global_batch_size_tensor,
                     global_batch_size, norm, kl_coef, value_coef, loss_dtype, backend):  # fmt: skip
    return launchers(backend, "policy").policy_finalize(
        stats, mode=mode, dp_size=dp_size,
        batch_num_tokens=batch_num_tokens if batch_num_tokens_tensor is None else batch_num_tokens_tensor,
        global_batch_size=global_batch_size if global_batch_size_tensor is None else global_batch_size_tensor,
        norm=norm, kl_coef=kl_coef, value_coef=value_coef, loss_dtype=loss_dtype,
    )  # fmt: skip


def _policy_finalize_fake(stats, *args):
    loss_dtype = args[-2]
    return _new(stats, dtype=loss_dtype), _new(stats, 6, dtype=torch.float32), _new(stats, stats.shape[0], dtype=torch.float64)


policy_finalize = _define(
    "policy_finalize(Tensor stats, int mode, float dp_size, Tensor? batch_num_tokens_tensor, float? batch_num_tokens, "
    "Tensor? global_batch_size_tensor, float? global_batch_size, float norm, float kl_coef, float value_coef, "
    "ScalarType loss_dtype, str backend) -> (Tensor loss, Tensor metrics, Tensor row_weights)",
    _policy_finalize, _policy_finalize_fake,
)  # fmt: skip


def _policy_backward(log_probs, old, adv, mask, weights, ref, stats, row_weights, grad_loss, estimator,
                     straight_through, kl_coef, value_coef, clip_low, clip_high, clip_c, sequence, with_pg,
                     grad_log_probs, grad_values, backend):  # fmt: skip
    grad_logp = torch.empty_like(log_probs) if grad_log_probs else None
    grad_vals = torch.empty_like(log_probs) if grad_values else None
    launchers(backend, "policy").policy_backward(
        log_probs, old, adv, mask, weights, ref, stats, row_weights, grad_loss, estimator=estimator,
        straight_through=straight_through, kl_coef=kl_coef, value_coef=value_coef, clip_low=clip_low,
        clip_high=clip_high, clip_c=clip_c, sequence=sequence, with_pg=with_pg, grad_logp=grad_logp,
        grad_values=grad_vals,
    )  # fmt: skip
    return _or_empty(grad_logp, log_probs, log_probs.dtype), _or_empty(grad_vals, log_probs, log_probs.dtype)


def _policy_backward_fake(log_probs, *args):
    grad_log_probs, grad_values = args[-3], args[-2]
    empty = lambda wanted: torch.empty_like(log_probs) if wanted else _new(log_probs, 0, dtype=log_probs.dtype)  # noqa: E731
    return empty(grad_log_probs), empty(grad_values)


policy_backward = _define(
    f"policy_backward({_POLICY_INPUTS}, Tensor stats, Tensor row_weights, Tensor grad_loss, int estimator, "
    f"bool straight_through, float kl_coef, float value_coef, {_POLICY_OPTIONS}, bool grad_log_probs, "
    "bool grad_values, str backend) -> (Tensor grad_logp, Tensor grad_vals)",
    _policy_backward, _policy_backward_fake,
)  # fmt: skip


def _rollout_correction_forward(old, rollout, mask, sequence, truncate, clip_min, clip_max, low_threshold, backend):
    return launchers(backend, "policy").rollout_correction_forward(
        old, rollout, mask, sequence=sequence, truncate=truncate, clip_min=clip_min, clip_max=clip_max,
        low_threshold=low_threshold,
    )  # fmt: skip


def _rollout_correction_forward_fake(old, *args):
    return _new(old, *old.shape, dtype=torch.float32), _stats(old, args[-1])


rollout_correction_forward = _define(
    "rollout_correction_forward(Tensor old_log_probs, Tensor rollout_log_probs, Tensor mask, bool sequence, "
    "bool truncate, float clip_min, float clip_max, float low_threshold, str backend) -> (Tensor weights, Tensor stats)",
    _rollout_correction_forward, _rollout_correction_forward_fake,
)  # fmt: skip

rollout_finalize = _define(
    "rollout_finalize(Tensor stats, bool sequence, str backend) -> Tensor",
    lambda stats, sequence, backend: launchers(backend, "policy").rollout_finalize(stats, sequence=sequence),
    lambda stats, sequence, backend: _new(stats, 8, dtype=torch.float32),
)  # fmt: skip
