"""A row's sampling parameters (T, top_k, top_p, min_p; the race's seed and
offset): each travels to a kernel as a pointer to per-row values or a scalar, a
float one as its float64 bits (_launch.float_scalar_arg), with a PER_ROW_* flag
(``_params``); a kernel reads its row's value with ``_row_param``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import float_scalar, float_scalar_arg


@triton.jit
def _row_param(ptr, scalar, row, PER_ROW: tl.constexpr, DTYPE: tl.constexpr):
    """This row's value of a parameter: ptr[row], or the scalar (a float one as
    _launch.float_scalar_arg passes it)."""
    if PER_ROW:
        return tl.load(ptr + row).to(DTYPE)
    elif DTYPE == tl.int64:
        return tl.full([], scalar, DTYPE)
    else:
        return float_scalar(scalar, DTYPE)


@triton.jit
def _row_params(row, temps_ptr, temp, top_k_ptr, top_k, top_p_ptr, top_p, min_p_ptr, min_p,
                PER_ROW_T: tl.constexpr, PER_ROW_K: tl.constexpr, PER_ROW_P: tl.constexpr,
                PER_ROW_MIN_P: tl.constexpr, ACC: tl.constexpr):
    """This row's (T, top_k, top_p, min_p, whether they are all valid). T is 0
    (greedy) or positive with a finite 1/T: the kernels scale by 1/T, and an
    infinite one would make the max's (x - m) / T = 0 * inf NaN."""
    t = _row_param(temps_ptr, temp, row, PER_ROW_T, ACC)
    k = _row_param(top_k_ptr, top_k, row, PER_ROW_K, tl.int64)
    p = _row_param(top_p_ptr, top_p, row, PER_ROW_P, ACC)
    mp = _row_param(min_p_ptr, min_p, row, PER_ROW_MIN_P, ACC)
    t_ok = (t == 0) | ((t > 0) & (t < float("inf")) & (1.0 / t < float("inf")))
    valid = t_ok & (k >= 0) & (p > 0) & (p <= 1) & (mp >= 0) & (mp <= 1)
    return t, k, p, mp, valid


@triton.jit
def _inverse_temperature(t, valid, ACC: tl.constexpr):
    """1/T, and 1 for greedy rows and rows with an invalid parameter (whose
    statistics are the row's at T = 1)."""
    return tl.where((t == 0) | (~valid), 1.0, 1.0 / t).to(ACC)


def _params(temperature, top_k, top_p, min_p) -> tuple[list, dict]:
    """Kernel arguments (pointer-or-None, scalar) per parameter, and the PER_ROW_* flags."""
    args, flags = [], {}
    for value, flag in ((temperature, "PER_ROW_T"), (top_k, "PER_ROW_K"), (top_p, "PER_ROW_P"), (min_p, "PER_ROW_MIN_P")):
        per_row = isinstance(value, torch.Tensor)
        args += [value if per_row else None, 0 if per_row else float_scalar_arg(value)]
        flags[flag] = per_row
    return args, flags
