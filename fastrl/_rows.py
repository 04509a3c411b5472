"""The row layout every kernel reads logits by, shared by the native and Triton
launchers (csrc/rows.h, ``fastrl.kernels.reduce.row_start``): the rows of
``[N, V]``, or of the ``[outer, inner, V]`` view ``row_view``
makes, numbered row-major over the leading dims, row r at
``(r // inner) * outer_stride + (r % inner) * inner_stride``; and the dtype
every kernel and the reference compute in (``compute_dtype``)."""

from __future__ import annotations

import math

import torch


def row_layout(t: torch.Tensor) -> tuple[int, int, int]:
    """(inner, outer_stride, inner_stride) of the rows of ``[N, V]`` or ``[outer, inner, V]``."""
    if t.dim() == 2:
        return max(t.shape[0], 1), 0, t.stride(0)
    return max(t.shape[1], 1), t.stride(0), t.stride(1)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 stays float64; bf16 / fp16 / fp32 are computed in float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


# Every row reduction of the log-prob kernels cuts a row of V logits into
# segments of segment_length(V) and folds their statistics left to right
# (kernels/reduce.py fold_segment, csrc/softmax_stats.h fold_row_stats). When V
# is a multiple of 64 the segments are V / 8 long: every shard boundary of a
# vocabulary split evenly over 1, 2, 4 or 8 ranks falls between two segments,
# so a rank's shard is whole segments, and the ranks' segment statistics,
# gathered and folded in vocabulary order, give the bits of the whole row in one
# program: the tensor-parallel degree changes no bit. (V / 8 is then a multiple
# of 8, so each segment starts on a 16-byte boundary in every dtype, where the
# row does.) Another V is one segment, the whole row.
TP_SEGMENTS = 8


def segment_length(vocab: int) -> int:
    """The segment length of a row of ``vocab`` logits (TP_SEGMENTS above)."""
    return vocab // TP_SEGMENTS if vocab > 0 and vocab % (8 * TP_SEGMENTS) == 0 else vocab


def exact_mass_limbs(mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-negative float64 masses as the exact sums of the sampler's C++ kernels hold
    them (csrc/sampling.cpp, ExactMass): int64 limbs, the nearest multiple of 2^-32 and
    the rest to the nearest 2^-64, which ranks add as integers, in any order, without
    rounding; exact for a mass below 2^31 that is a multiple of 2^-64."""
    scaled = mass * 2.0**32
    whole = torch.round(scaled)  # (ties to even, as the kernels' shifters)
    return whole.long(), torch.round((scaled - whole) * 2.0**32).long()


def mass_logs(masses: torch.Tensor) -> torch.Tensor:
    """(log s, log s_kept, entropy) [N, 3] float64 of masses [N, 6] (three
    exact_mass_limbs pairs: s, s_kept, u) by csrc/sampling.cpp's formula (mass_logs):
    log1p of each mass above 1, and the entropy log s_kept + u / s_kept."""
    hi, lo = masses.reshape(-1, 3, 2).unbind(-1)
    above_one = (hi - 2**32).double() * 2.0**-32 + lo.double() * 2.0**-64
    value = hi.double() * 2.0**-32 + lo.double() * 2.0**-64
    logs = torch.log1p(above_one)
    return torch.stack([logs[:, 0], logs[:, 1], logs[:, 1] + value[:, 2] / value[:, 1]], -1)


def row_count(t: torch.Tensor) -> int:
    """The rows of ``[N, V]`` or ``[outer, inner, V]``."""
    return math.prod(t.shape[:-1])


def row_view(logits: torch.Tensor) -> torch.Tensor:
    """``logits [..., V]`` as an ``[outer, inner, V]`` view of the same memory, the
    kernels' input (csrc/rows.h): row r is (r // inner, r % inner), in the
    row-major order of the leading dims. Leading dims that are contiguous with
    each other merge, so every layout with unit stride in V whose leading dims
    merge into at most two strided ones is read in place: contiguous, veRL's
    ``logits[:, -response_length - 1:-1]``, ``logits[::2]``, a vocabulary slice,
    a transposed ``[S, B, V]``. Only the rest (three or more leading dims that
    cannot merge, or a strided vocabulary) is copied, once."""
    vocab = logits.shape[-1]
    merged: list[tuple[int, int]] = []  # (size, stride) of the merged leading dims, outermost first
    for size, stride in zip(logits.shape[:-1], logits.stride()[:-1]):
        if size == 1:
            continue
        if merged and merged[-1][1] == stride * size:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if (vocab == 1 or logits.stride(-1) == 1) and len(merged) <= 2:
        (outer, outer_stride), (inner, inner_stride) = [(1, 0)] * (2 - len(merged)) + merged
        return logits.as_strided((outer, inner, vocab), (outer_stride, inner_stride, 1))
    return logits.reshape(-1, vocab).contiguous().unsqueeze(0)


def can_overwrite(logits: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether the backward may write the gradient over ``rows`` (the row view of
    ``logits``) for ``inplace_backward``: never over a leaf or a view of one (a
    parameter's data would become the gradient, and nothing in autograd checks a
    leaf's version), and only when no two elements share memory (sufficient test:
    with the dims sorted by stride, each stride clears the extent of the smaller ones)."""
    if (logits if logits._base is None else logits._base).is_leaf:
        return False
    # Sorted by comparisons (an insertion sort of three dims), not sorted(): under torch.compile with dynamic
    # shapes the strides are symbolic, which dynamo compares (as guards) but does not sort by.
    dims: list[tuple[int, int]] = []
    for size, stride in zip(rows.shape, rows.stride()):
        if size == 1:
            continue
        at = len(dims)
        while at and dims[at - 1][1] > stride:
            at -= 1
        dims.insert(at, (size, stride))
    extent = 0
    for size, stride in dims:
        if stride <= extent:
            return False
        extent += stride * (size - 1)
    return True


def forward_outputs(n_rows: int, acc: torch.dtype, device: torch.device, has_labels: bool, with_entropy: bool,
                    with_stats: bool, with_sum_pi_squared: bool) -> tuple[torch.Tensor | None, ...]:  # fmt: skip
    """The log-prob forward's outputs as every launcher allocates them (fastrl._native,
    fastrl.kernels.logprobs): log-prob [N], entropy [N], stats [N, 2] (max logit,
    log s) and sum_pi_squared [N] in ``acc``, None where not asked for."""
    new = lambda *shape: torch.empty(n_rows, *shape, dtype=acc, device=device)  # noqa: E731
    return (new() if has_labels else None, new() if with_entropy else None, new(2) if with_stats else None,
            new() if with_sum_pi_squared else None)  # fmt: skip
