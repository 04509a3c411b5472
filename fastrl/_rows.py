"""The row layout every kernel reads logits by, shared by the native and Triton
launchers (csrc/rows.h, ``fastrl.kernels.reduce.row_start``): the rows of
``[N, V]``, or of the ``[outer, inner, V]`` view ``fastrl.logprobs.row_view``
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


def row_count(t: torch.Tensor) -> int:
    """The rows of ``[N, V]`` or ``[outer, inner, V]``."""
    return math.prod(t.shape[:-1])
