"""Argument checks shared by every op. Each raises ValueError / TypeError naming
the argument and what it accepts, before any kernel runs.

Checks that would need a host sync on CUDA (label ranges, tensor temperatures)
run on CPU tensors always and on CUDA tensors only under ``FASTRL_CHECKS=1``;
without it the kernels never read out of bounds and return NaN for a bad row.
"""

from __future__ import annotations

import math
import numbers

import torch

from ._backend import checks_enabled

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
LABEL_DTYPES = (torch.int32, torch.int64)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def _host_checks(device: torch.device) -> bool:
    return device.type == "cpu" or checks_enabled()


def check_logits(logits: object, name: str = "logits") -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(logits).__name__}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype ({_names(LOGIT_DTYPES)}); got {logits.dtype}")
    if logits.dim() == 0:
        raise ValueError(f"{name} must have shape [..., V] with at least one dimension; got a 0-d tensor")
    if logits.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last (vocabulary) dimension; got shape {tuple(logits.shape)}")
    return logits


def check_labels(labels: object, logits: torch.Tensor, ignore_index: object, name: str = "labels") -> torch.Tensor:
    """``labels`` must be integer ``[...]`` matching ``logits[..., V]``; on CPU
    (or under FASTRL_CHECKS=1) every label must be in [0, V) or ``ignore_index``."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(labels).__name__}")
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"{name} must have an integer dtype ({_names(LABEL_DTYPES)}); got {labels.dtype}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index must be an int; got {type(ignore_index).__name__}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{name} must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}; got {tuple(labels.shape)}"
        )
    if labels.device != logits.device:
        raise ValueError(f"{name} is on {labels.device} but logits is on {logits.device}; they must share a device")
    if labels.numel() and _host_checks(labels.device):
        vocab = logits.shape[-1]
        bad = ((labels < 0) | (labels >= vocab)) & (labels != ignore_index)
        if bool(bad.any()):
            first = labels[bad].flatten()[0].item()
            raise ValueError(
                f"{name} must lie in [0, {vocab}) or equal ignore_index={ignore_index}; found {first} "
                f"({int(bad.sum())} such labels)"
            )
    return labels


def check_temperature(temperature: object, shape: torch.Size, device: torch.device) -> float | torch.Tensor:
    """A positive finite number, or a floating tensor of such numbers that
    broadcasts to ``shape`` (one temperature per row) on ``device``."""
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point():
            raise TypeError(f"temperature must be a float or a floating tensor; got a tensor of {temperature.dtype}")
        if temperature.device != device:
            raise ValueError(f"temperature is on {temperature.device} but logits is on {device}; they must share a device")
        try:
            broadcast_ok = torch.broadcast_shapes(temperature.shape, shape) == shape
        except RuntimeError:
            broadcast_ok = False
        if not broadcast_ok:
            raise ValueError(
                f"temperature must broadcast to the per-token shape {tuple(shape)}; got shape {tuple(temperature.shape)}"
            )
        if temperature.numel() and _host_checks(device):
            ok = torch.isfinite(temperature) & (temperature > 0)
            if not bool(ok.all()):
                bad = temperature[~ok].flatten()[0].item()
                raise ValueError(f"temperature must be positive and finite in every row; found {bad}")
        return temperature
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a float or a tensor; got {type(temperature).__name__}")
    value = float(temperature)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"temperature must be positive and finite; got {value}")
    return value


def check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
    return value
