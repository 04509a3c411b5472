"""Launchers for the native C++ kernels in ``fastrl._C``.

The extension takes raw pointers, sizes, strides and dtype codes (the codes of
``csrc/common.h``); these functions allocate the outputs and pass them. They
mirror the Triton launchers in ``fastrl.kernels`` argument for argument, so the
API layer picks a backend by picking a module.
"""

from __future__ import annotations

import torch

from ._backend import native_module

DTYPE_CODES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
    torch.int32: 10,
    torch.int64: 11,
}


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _entry(name: str, device: torch.device):
    """``fastrl._C.<name>`` for CPU tensors, ``<name>_cuda`` for CUDA tensors;
    the CUDA entry takes the current stream as one more argument."""
    mod = native_module()
    if device.type == "cuda":
        cuda_fn = getattr(mod, f"{name}_cuda")
        stream = torch.cuda.current_stream(device).cuda_stream
        return lambda *args: cuda_fn(*args, stream)
    return getattr(mod, name)


def _row_param(value: float | int | torch.Tensor) -> tuple[int, float | int]:
    """(pointer to per-row values or 0, the scalar value) of a per-row parameter."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr(), 0
    return 0, value


def logprobs_forward(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: float | torch.Tensor,
    ignore_index: int,
    *,
    with_entropy: bool,
    with_stats: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The contract of ``fastrl.kernels.logprobs.logprobs_forward``, on the C++
    kernels; per-row temperatures come as a contiguous ``[N]`` tensor of the
    accumulation dtype."""
    n_rows, vocab = logits.shape
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    new = lambda: torch.empty(n_rows, dtype=acc, device=logits.device)  # noqa: E731
    logprob = new() if labels is not None else None
    entropy = new() if with_entropy else None
    stats = torch.empty(n_rows, 2, dtype=acc, device=logits.device) if with_stats else None
    temps_ptr, temp_scalar = _row_param(temperature)
    _entry("logprobs_forward", logits.device)(
        logits.data_ptr(), DTYPE_CODES[logits.dtype], n_rows, vocab, logits.stride(0),
        _ptr(labels), DTYPE_CODES[labels.dtype] if labels is not None else -1, ignore_index,
        temps_ptr, temp_scalar, _ptr(logprob), _ptr(entropy), _ptr(stats),
    )  # fmt: skip
    return logprob, entropy, stats


def logprobs_backward(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: float | torch.Tensor,
    ignore_index: int,
    stats: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    grad_out: torch.Tensor,
) -> None:
    """The contract of ``fastrl.kernels.logprobs.logprobs_backward``, on the C++ kernels."""
    n_rows, vocab = logits.shape
    temps_ptr, temp_scalar = _row_param(temperature)
    _entry("logprobs_backward", logits.device)(
        logits.data_ptr(), DTYPE_CODES[logits.dtype], n_rows, vocab, logits.stride(0),
        _ptr(labels), DTYPE_CODES[labels.dtype] if labels is not None else -1, ignore_index,
        temps_ptr, temp_scalar, stats.data_ptr(), _ptr(entropy), _ptr(grad_logprob),
        _ptr(grad_entropy), grad_out.data_ptr(), grad_out.stride(0),
    )  # fmt: skip


def _truncation(logits, temperature, top_k, top_p, min_p) -> tuple:
    """The processed-distribution arguments of csrc/sampling.h, in binding order."""
    n_rows, vocab = logits.shape
    return (
        logits.data_ptr(), DTYPE_CODES[logits.dtype], n_rows, vocab, logits.stride(0),
        *_row_param(temperature), *_row_param(top_k), *_row_param(top_p), *_row_param(min_p),
    )  # fmt: skip


def sample_forward(logits, *, temperature, top_k, top_p, min_p, seed, offset):
    """The contract of ``fastrl.kernels.sampling.sample_forward``, on the C++ kernels."""
    n_rows = logits.shape[0]
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    tokens = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(n_rows, dtype=acc, device=logits.device)
    raw = torch.empty(n_rows, dtype=acc, device=logits.device)
    per_row_seeds = isinstance(seed, torch.Tensor)
    native_module().sample_forward(
        _truncation(logits, temperature, top_k, top_p, min_p),
        seed.data_ptr() if per_row_seeds else 0, 0 if per_row_seeds else seed, per_row_seeds,
        *_row_param(offset), tokens.data_ptr(), logprobs.data_ptr(), raw.data_ptr(),
    )  # fmt: skip
    return tokens, logprobs, raw


def truncated_forward(logits, labels, *, temperature, top_k, top_p, min_p, with_stats):
    """The contract of ``fastrl.kernels.sampling.truncated_forward``, on the C++ kernels."""
    n_rows = logits.shape[0]
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = torch.empty(n_rows, dtype=acc, device=logits.device)
    stats = torch.empty(n_rows, 3, dtype=acc, device=logits.device) if with_stats else None
    native_module().truncated_logprobs_forward(
        _truncation(logits, temperature, top_k, top_p, min_p),
        labels.data_ptr(), DTYPE_CODES[labels.dtype], out.data_ptr(), _ptr(stats),
    )  # fmt: skip
    return out, stats


def truncated_backward(logits, labels, stats, grad_logprob, grad_out, *, temperature, top_k, top_p, min_p):
    """The contract of ``fastrl.kernels.sampling.truncated_backward``, on the C++ kernels."""
    native_module().truncated_logprobs_backward(
        _truncation(logits, temperature, top_k, top_p, min_p),
        labels.data_ptr(), DTYPE_CODES[labels.dtype], stats.data_ptr(), grad_logprob.data_ptr(),
        grad_out.data_ptr(), grad_out.stride(0),
    )  # fmt: skip
